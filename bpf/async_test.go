package bpf_test

// Asynchronous aggregation (iSwitch): a job's threshold H, changed in place by xdpagg_gc's
// OP_SET_H (maps.SetThreshold), and FBcast's forced flush (OP_FLUSH, maps.FlushSlot), through
// BPF_PROG_TEST_RUN.

import (
	"encoding/binary"
	"errors"
	"testing"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/maps"
)

// asyncJob is the job the tests below run with fan-in 4 (admitted with 32 workers by load).
const asyncJob = 8

func TestSwitchThreshold(t *testing.T) {
	const (
		rx   = maps.CntRx
		agg  = maps.CntAggregated
		done = maps.CntCompleted
		shad = maps.CntShadowTx
	)
	s := load(t, 0)
	setH := func(h uint8) func(t *testing.T) {
		return func(t *testing.T) {
			t.Helper()
			if err := s.Maps.SetThreshold(asyncJob, h); err != nil {
				t.Fatalf("SetThreshold(%d): %v", h, err)
			}
			j, err := s.Maps.Admission(asyncJob)
			if err != nil || j.Threshold != h {
				t.Fatalf("threshold after SetThreshold(%d): %d, %v", h, j.Threshold, err)
			}
		}
	}
	view := func(state uint8, seq, bitmap uint32, counter uint8, nvals int) *slotView {
		return &slotView{State: state, Counter: counter, FanIn: 4, Scale: 24, Job: asyncJob, Seq: seq, Bitmap: bitmap, Nvals: uint16(nvals)}
	}
	d := func(seq uint32, idx uint32, w uint8, base int32) frame {
		return dataFrame(asyncJob, seq, idx, w, 4, base, base+1, -base, 7*base)
	}
	a0, a1, a2, a3 := d(100, 3, 0, 1), d(100, 3, 1, 10), d(100, 3, 2, 100), d(100, 3, 3, 1000)
	s012 := sum(sum(a0.Vals, a1.Vals), a2.Vals)
	a3resend := a3.with(flags(fResend))
	b0, b1 := d(101, 4, 0, 2), d(101, 4, 1, 20)
	s01b := sum(b0.Vals, b1.Vals)
	c2 := d(102, 5, 2, 3)
	e0, e1 := d(103, 6, 0, 4), d(103, 6, 1, 40)
	e1resend := e1.with(flags(fResend))
	s01e := sum(e0.Vals, e1.Vals)
	steps := []step{
		{name: "H=3: worker 0 reserves", setup: setH(3), in: a0, verdict: xdpDrop, delta: cnt{rx: 1, agg: 1},
			idx: 3, slot: view(slotAggregating, 100, 1, 1, 4), vals: a0.Vals},
		{name: "H=3: worker 1 adds", in: a1, verdict: xdpDrop, delta: cnt{rx: 1, agg: 1},
			idx: 3, slot: view(slotAggregating, 100, 3, 2, 4), vals: sum(a0.Vals, a1.Vals)},
		{name: "H=3: worker 2 completes with three of four", in: a2, verdict: xdpRedirect,
			want: ptr(asResult(a2, 7, fFromSwitch, s012)), delta: cnt{rx: 1, agg: 1, done: 1},
			idx: 3, slot: view(slotComplete, 100, 7, 3, 4), vals: s012},
		{name: "H=3: the slow worker 3 gets the shadow copy, the sum without it", in: a3, verdict: xdpTX,
			want: ptr(asShadow(a3, 7, fFromSwitch|fShadow, s012)), delta: cnt{rx: 1, shad: 1},
			idx: 3, slot: view(slotComplete, 100, 7, 3, 4), vals: s012},
		{name: "H=3: and so does its resend", in: a3resend, verdict: xdpTX,
			want: ptr(asShadow(a3resend, 7, fFromSwitch|fShadow, s012)), delta: cnt{rx: 1, shad: 1},
			idx: 3, slot: view(slotComplete, 100, 7, 3, 4), vals: s012},
		{name: "H=3: worker 0 reserves the next fragment", in: b0, verdict: xdpDrop, delta: cnt{rx: 1, agg: 1},
			idx: 4, slot: view(slotAggregating, 101, 1, 1, 4), vals: b0.Vals},
		{name: "SetH 1 mid-fragment: the next contribution completes it", setup: setH(1), in: b1, verdict: xdpRedirect,
			want: ptr(asResult(b1, 3, fFromSwitch, s01b)), delta: cnt{rx: 1, agg: 1, done: 1},
			idx: 4, slot: view(slotComplete, 101, 3, 2, 4), vals: s01b},
		{name: "H=1: a first contribution completes alone", in: c2, verdict: xdpRedirect,
			want: ptr(asResult(c2, 4, fFromSwitch, c2.Vals)), delta: cnt{rx: 1, agg: 1, done: 1},
			idx: 5, slot: view(slotComplete, 102, 4, 1, 4), vals: c2.Vals},
		{name: "H=2: worker 0 reserves", setup: setH(2), in: e0, verdict: xdpDrop, delta: cnt{rx: 1, agg: 1},
			idx: 6, slot: view(slotAggregating, 103, 1, 1, 4), vals: e0.Vals},
		{name: "H=2: a resend that brings the second contribution completes (no flush)", in: e1resend, verdict: xdpRedirect,
			want: ptr(asResult(e1resend, 3, fFromSwitch, s01e)), delta: cnt{rx: 1, agg: 1, done: 1},
			idx: 6, slot: view(slotComplete, 103, 3, 2, 4), vals: s01e},
	}
	runSteps(t, s, steps)
	expectHeld(t, s, asyncJob)

	// Refusals: H above the job's workers, a job not admitted, a threshold for a sparse job.
	if err := s.Maps.SetThreshold(asyncJob, uint8(bpf.MaxWorkers)+1); !errors.Is(err, maps.ErrBadJob) {
		t.Errorf("SetThreshold(33): %v, want ErrBadJob", err)
	}
	if err := s.Maps.SetThreshold(unenrolledJob, 1); !errors.Is(err, maps.ErrNoJob) {
		t.Errorf("SetThreshold of a job not admitted: %v, want ErrNoJob", err)
	}
	j := testJob(s.Maps, 77)
	j.Workers, j.Threshold = 4, 5
	if err := s.Maps.AddJob(j, testKey(77)); !errors.Is(err, maps.ErrBadJob) {
		t.Errorf("AddJob with threshold 5 of 4 workers: %v, want ErrBadJob", err)
	}
	j.Threshold = 3
	admit(t, s.Maps, j)
	if got, err := s.Maps.Admission(77); err != nil || got.Threshold != 3 {
		t.Errorf("admitted with threshold 3: got %d, %v", got.Threshold, err)
	}
}

func TestSwitchFBcast(t *testing.T) {
	const (
		rx   = maps.CntRx
		agg  = maps.CntAggregated
		shad = maps.CntShadowTx
	)
	s := load(t, 0)
	f0 := dataFrame(asyncJob, 200, 9, 0, 4, 5, 6, 7)
	f1 := dataFrame(asyncJob, 200, 9, 1, 4, 50, 60, 70)
	f3 := dataFrame(asyncJob, 200, 9, 3, 4, 500, 600, 700)
	s01 := sum(f0.Vals, f1.Vals)
	s.runExpect(t, f0, xdpDrop)
	s.runExpect(t, f1, xdpDrop)
	s.expectDelta(t, cnt{rx: 2, agg: 2})

	if _, _, err := s.Maps.FlushSlot(asyncJob, 201, 9); !errors.Is(err, maps.ErrNoSlot) {
		t.Errorf("flush of another seq: %v, want ErrNoSlot", err)
	}
	if _, _, err := s.Maps.FlushSlot(asyncJob+1, 200, 9); !errors.Is(err, maps.ErrNoSlot) {
		t.Errorf("flush of another job's fragment: %v, want ErrNoSlot", err)
	}
	if _, _, err := s.Maps.FlushSlot(asyncJob, 200, 10); !errors.Is(err, maps.ErrNoSlot) {
		t.Errorf("flush of a free slot: %v, want ErrNoSlot", err)
	}
	if _, _, err := s.Maps.FlushSlot(asyncJob, 200, poolSize+5); !errors.Is(err, maps.ErrNoSlot) {
		t.Errorf("flush beyond the pool: %v, want ErrNoSlot", err)
	}
	expectSlot(t, s.slot(t, 9), slotView{State: slotAggregating, Counter: 2, FanIn: 4, Scale: 24, Job: asyncJob, Seq: 200, Bitmap: 3, Nvals: 3}, s01)

	rec, already, err := s.Maps.FlushSlot(asyncJob, 200, 9)
	if err != nil || already {
		t.Fatalf("flush: already %v, %v", already, err)
	}
	h := rec.H
	if h.Version != bpf.Version || h.Type != msgResult || h.Encoding != encFixed32 || h.ScaleLog2 != 24 || h.Flags != fFromSwitch ||
		h.Count != 3 || h.JobId != asyncJob || h.Seq != 200 || h.AggIndex != 9 || h.Bitmap0 != 3 || h.FanIn0 != 4 || h.Bitmap1 != 0 || h.WorkerId != 0 {
		t.Errorf("flushed result header %+v", h)
	}
	equalVals(t, "flushed sum", rec.Vals[:3], s01)
	expectSlot(t, s.slot(t, 9), slotView{State: slotComplete, Counter: 2, FanIn: 4, Scale: 24, Job: asyncJob, Seq: 200, Bitmap: 3, Nvals: 3}, s01)

	// A contribution after the flush gets the flushed sum, without it, as after completing at H.
	out := s.runExpect(t, f3, xdpTX)
	expectFrame(t, out, asShadow(f3, 3, fFromSwitch|fShadow, s01))
	s.expectDelta(t, cnt{rx: 1, shad: 1})

	// Flushing again returns the same sum and says it was complete already.
	rec2, already, err := s.Maps.FlushSlot(asyncJob, 200, 9)
	if err != nil || !already || rec2.H != rec.H {
		t.Errorf("second flush: already %v, header %+v, %v", already, rec2.H, err)
	}
	equalVals(t, "second flush", rec2.Vals[:3], s01)
	expectHeld(t, s, asyncJob)
}

// TestSlotOpRefusals: xdpagg_gc's slot operations, run raw: an unknown operation, a threshold
// beyond XAGG_MAX_WORKERS and a job not admitted do nothing and say so (OPS_NONE); a collection
// (a struct gc_args-sized packet) is still a collection.
func TestSlotOpRefusals(t *testing.T) {
	s := load(t, 0)
	run := func(op bpf.XdpaggSlotOp) bpf.XdpaggSlotOp {
		t.Helper()
		in, err := binary.Append(nil, binary.LittleEndian, &op)
		if err != nil {
			t.Fatal(err)
		}
		got, out := runProg(t, s.Objects.XdpaggGc, in)
		if got != xdpPass {
			t.Fatalf("op %d: verdict %s", op.Op, verdictName(got))
		}
		var res bpf.XdpaggSlotOp
		if _, err := binary.Decode(out, binary.LittleEndian, &res); err != nil {
			t.Fatal(err)
		}
		return res
	}
	none := uint32(bpf.XdpaggSlotOpStatusOPS_NONE)
	for name, op := range map[string]bpf.XdpaggSlotOp{
		"unknown operation":    {Op: 99, JobId: asyncJob, Threshold: 2},
		"threshold beyond 32":  {Op: uint32(bpf.XdpaggSlotOpKindOP_SET_H), JobId: asyncJob, Threshold: 33},
		"job not admitted":     {Op: uint32(bpf.XdpaggSlotOpKindOP_SET_H), JobId: unenrolledJob, Threshold: 2},
		"flush of a free slot": {Op: uint32(bpf.XdpaggSlotOpKindOP_FLUSH), JobId: asyncJob, Seq: 1, AggIndex: 2},
	} {
		if res := run(op); res.Status != none {
			t.Errorf("%s: status %d, want OPS_NONE", name, res.Status)
		}
	}
	if j, err := s.Maps.Admission(asyncJob); err != nil || j.Threshold != 0 {
		t.Errorf("threshold after refused operations: %d, %v", j.Threshold, err)
	}
	if res := run(bpf.XdpaggSlotOp{Op: uint32(bpf.XdpaggSlotOpKindOP_SET_H), JobId: asyncJob, Threshold: 32}); res.Status != uint32(bpf.XdpaggSlotOpStatusOPS_SET) {
		t.Errorf("OP_SET_H 32: status %d", res.Status)
	}
	// A collection is told apart by its size.
	if now, err := s.Maps.DatapathNow(); err != nil || now == 0 {
		t.Errorf("collection after slot operations: %d, %v", now, err)
	}
}
