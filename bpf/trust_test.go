package bpf_test

// BPF_PROG_TEST_RUN tests of the switch's trust and isolation rules: admitted jobs only, RESULTs
// only from the job's PS (address, UDP port and switch port), IPv4 options / fragments / bad
// header checksums to the aggregation port dropped, slot quotas (jobs.max_slots, jobs.held), the
// per-port control budget and the xdpagg_gc garbage collector. Strict source validation (uRPF)
// needs routes and ports of its own: urpf_test.go.

import (
	"errors"
	"fmt"
	"math/bits"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/maps"
)

// ---- frame builder: the IPv4 header checksum the switch now verifies ----

// ipv4Checksum is RFC 1071 computed independently of the builder's csum16/fold: the ones'
// complement of the ones' complement sum of the header's 16-bit words, checksum field zero.
func ipv4Checksum(h []byte) uint16 {
	var s uint64
	for i := 0; i < len(h); i += 2 {
		if i == 10 {
			continue // the checksum field itself
		}
		s += uint64(h[i])<<8 | uint64(h[i+1])
	}
	for s > 0xffff {
		s = s>>16 + s&0xffff
	}
	return ^uint16(s)
}

func TestFrameBuilderIPChecksum(t *testing.T) {
	frames := map[string]frame{
		"data":                   dataFrame(1, 1, 0, 0, 2, 1, 2, 3),
		"result":                 resultFrame(1, 1, 0, 2, 1, 2),
		"options (IHL 6)":        dataFrame(1, 1, 0, 0, 2, 1).with(func(f *frame) { f.IHL = 6 }),
		"options (IHL 15)":       dataFrame(1, 1, 0, 0, 2, 1).with(func(f *frame) { f.IHL = 15 }),
		"fragment":               dataFrame(1, 1, 0, 0, 2, 1).with(func(f *frame) { f.FragOff = 0x2000 | 7 }),
		"TOS, TTL, IP length":    dataFrame(1, 1, 0, 0, 2, 1).with(func(f *frame) { f.TOS = 0xb8; f.TTL = 1; f.IPLen = 99 }),
		"ICMP":                   dataFrame(1, 1, 0, 0, 2, 1).with(func(f *frame) { f.Proto = 1; f.Payload = []byte{8, 0, 0, 0} }),
		"addresses of all ones":  dataFrame(1, 1, 0, 0, 2, 1).with(func(f *frame) { f.SrcIP = [4]byte{255, 255, 255, 255}; f.DstIP = f.SrcIP }),
		"addresses of all zeros": dataFrame(1, 1, 0, 0, 2, 1).with(func(f *frame) { f.SrcIP = [4]byte{}; f.DstIP = f.SrcIP }),
	}
	for name, f := range frames {
		b := f.bytes()
		hl := int(b[offIP]&0xf) * 4
		iph := b[offIP : offIP+hl]
		got := uint16(iph[10])<<8 | uint16(iph[11])
		if want := ipv4Checksum(iph); got != want && !(got == 0xffff && want == 0) && !(got == 0 && want == 0xffff) {
			t.Errorf("%s: IPv4 checksum %#04x, RFC 1071 says %#04x", name, got, want)
		}
		if !ipChecksumOK(iph) {
			t.Errorf("%s: the builder's IPv4 checksum does not verify", name)
		}
		bad := f.with(func(f *frame) { f.BadIPCsum = true }).bytes()
		if ipChecksumOK(bad[offIP : offIP+hl]) {
			t.Errorf("%s: BadIPCsum left a valid IPv4 checksum", name)
		}
		if string(bad[:offIP+10]) != string(b[:offIP+10]) || string(bad[offIP+12:]) != string(b[offIP+12:]) {
			t.Errorf("%s: BadIPCsum changed more than the checksum field", name)
		}
	}
	// And the switch agrees: a builder frame aggregates, a corrupted one does not.
	s := load(t, 0)
	s.runExpect(t, dataFrame(1, 1, 0, 0, 2, 1, 2), xdpDrop)
	s.expectDelta(t, cnt{maps.CntRx: 1, maps.CntAggregated: 1})
	s.runExpect(t, dataFrame(1, 1, 0, 1, 2, 1, 2).with(func(f *frame) { f.BadIPCsum = true }), xdpDrop)
	s.expectDelta(t, cnt{maps.CntRx: 1, maps.CntIPInvalid: 1})
}

// ---- IPv4 options, fragments and checksums to the aggregation port ----

// Frames to the aggregation port with IPv4 options, as first fragments (too short to show the
// UDP header or not), or with a bad IPv4 header checksum are dropped (ip_invalid, counted in rx)
// before anything reads their xdpagg header. Later fragments, and options/fragments/checksums of
// other traffic, pass (TestSwitchNonAggregation).
func TestSwitchIPInvalid(t *testing.T) {
	data := dataFrame(1, 1, 0, 0, 2, 1, 2, 3, 4)
	res := resultFrame(1, 1, 0, 2, 5, 6)
	join := controlFrame(uint8(bpf.XdpaggMsgTypeMSG_JOIN))
	mf := func(f *frame) { f.FragOff |= 0x2000 }
	cases := []namedFrame{
		{"DATA with 4 bytes of options (IHL 6)", data.with(func(f *frame) { f.IHL = 6 })},
		{"DATA with 40 bytes of options (IHL 15)", data.with(func(f *frame) { f.IHL = 15 })},
		{"RESULT with options", res.with(func(f *frame) { f.IHL = 7 })},
		{"JOIN with options", join.with(func(f *frame) { f.IHL = 6 })},
		{"options and a bad checksum", data.with(func(f *frame) { f.IHL = 6; f.BadIPCsum = true })},
		{"DATA first fragment (MF, offset 0)", data.with(mf)},
		{"DATA first fragment with DF and MF", data.with(func(f *frame) { f.FragOff = 0x4000 | 0x2000 })},
		{"RESULT first fragment", res.with(mf)},
		{"JOIN first fragment", join.with(mf)},
		{"first fragment with options", data.with(mf, func(f *frame) { f.IHL = 6 })},
		{"first fragment, not an xdpagg header after the UDP header", data.with(mf, func(f *frame) { f.Payload = []byte("not xdpagg") })},
		// RFC 1858's tiny fragment: too short to show the UDP ports, so it could be anyone's.
		{"tiny first fragment: 4 bytes of UDP header", data.with(mf, func(f *frame) { f.IPLen = 24; f.Truncate = offIP + 24 })},
		{"tiny first fragment: no UDP header at all", data.with(mf, func(f *frame) { f.IPLen = 20; f.Truncate = offIP + 20 })},
		{"tiny first fragment: IP length 24, frame longer", data.with(mf, func(f *frame) { f.IPLen = 24 })},
		{"tiny first fragment: IP length 27", data.with(mf, func(f *frame) { f.IPLen = 27 })},
		{"tiny first fragment to another port", data.with(mf, func(f *frame) { f.DstPort = 53; f.IPLen = 24; f.Truncate = offIP + 24 })},
		{"tiny first fragment after options", data.with(mf, func(f *frame) { f.IHL = 6; f.IPLen = 28; f.Truncate = offIP + 28 })},
		{"DATA with a bad IPv4 checksum", data.with(func(f *frame) { f.BadIPCsum = true })},
		{"RESULT with a bad IPv4 checksum", res.with(func(f *frame) { f.BadIPCsum = true })},
		{"JOIN with a bad IPv4 checksum", join.with(func(f *frame) { f.BadIPCsum = true })},
		{"an unknown type with a bad IPv4 checksum", join.with(func(f *frame) { f.Hdr.Type = 200; f.BadIPCsum = true })},
		{"bad checksum and a malformed header", data.with(func(f *frame) { f.Hdr.Version = 2; f.BadIPCsum = true })},
		{"bad checksum and trailing bytes", data.with(func(f *frame) { f.Pad = 3; f.BadIPCsum = true })},
		{"bad checksum, header cut", data.with(func(f *frame) { f.Truncate = offHdr + 4; f.BadIPCsum = true })},
		{"checksum of a header whose TTL changed on the way", data.with(func(f *frame) {
			f.Raw = f.bytes()
			f.Raw[offIP+8]-- // a router that forgot to update the checksum
		})},
	}
	s := load(t, 0)
	expectDropped(t, s, cases, maps.CntIPInvalid)
	t.Run("DF alone is not a fragment", func(t *testing.T) {
		s.runExpect(t, data.with(func(f *frame) { f.FragOff = 0x4000 }), xdpDrop)
		s.expectDelta(t, cnt{maps.CntRx: 1, maps.CntAggregated: 1})
	})
}

// ---- admission ----

// Nothing of a job exists before `xdpagg job add`: its DATA and RESULTs are dropped (not_member)
// even when workers are bound, PutMember refuses it, and RemoveJob takes everything away again.
func TestSwitchAdmission(t *testing.T) {
	const job = 40
	s := load(t, 0)
	d0 := dataFrame(job, 1, 2, 0, 2, 1, 2)
	d1 := dataFrame(job, 1, 2, 1, 2, 3, 4)

	// Workers bound (maps.PutWorker, as a stale JOIN would leave them), but no `jobs` entry.
	enrollWorkers(t, s.Maps, loIfindex, job)
	s.runExpect(t, d0, xdpDrop)
	s.expectDelta(t, cnt{maps.CntRx: 1, maps.CntNotMember: 1})
	s.runExpect(t, resultFrame(job, 1, 2, 2, 9), xdpDrop)
	s.expectDelta(t, cnt{maps.CntRx: 1, maps.CntNotMember: 1})
	s.runExpect(t, dataFrame(unenrolledJob, 1, 2, 0, 2, 1, 2), xdpDrop)
	s.expectDelta(t, cnt{maps.CntRx: 1, maps.CntNotMember: 1})
	s.allSlotsFree(t)
	mb := member(job, 5, loIfindex, net.HardwareAddr{2, 0, 0, 0, 1, 0}, net.HardwareAddr{2, 0, 0, 0, 0, 0xfe})
	if err := s.Maps.PutMember(mb); !errors.Is(err, maps.ErrNoJob) {
		t.Errorf("PutMember of a job not admitted: %v, want ErrNoJob", err)
	}
	if _, err := s.Maps.GetJob(job); !errors.Is(err, maps.ErrNoJob) {
		t.Errorf("GetJob of a job not admitted: %v, want ErrNoJob", err)
	}

	// Admission checks.
	good := testJob(s.Maps, job)
	for _, c := range []struct {
		name string
		mod  func(j *maps.Job)
		key  []byte
	}{
		{"job 0", func(j *maps.Job) { j.JobID = 0 }, nil},
		{"PS without a port", func(j *maps.Job) { j.PS = netip.AddrPortFrom(j.PS.Addr(), 0) }, nil},
		{"IPv6 PS", func(j *maps.Job) { j.PS = netip.MustParseAddrPort("[2001:db8::1]:9000") }, nil},
		{"no PS port ifindex", func(j *maps.Job) { j.PSIfindex = 0 }, nil},
		{"0 workers", func(j *maps.Job) { j.Workers = 0 }, nil},
		{"33 workers", func(j *maps.Job) { j.Workers = 33 }, nil},
		{"quota 0", func(j *maps.Job) { j.MaxSlots = 0 }, nil},
		{"short key", nil, make([]byte, maps.KeySize-1)},
	} {
		j := good
		if c.mod != nil {
			c.mod(&j)
		}
		key := testKey(job)
		if c.key != nil {
			key = c.key
		}
		if err := s.Maps.AddJob(j, key); !errors.Is(err, maps.ErrBadJob) {
			t.Errorf("AddJob with %s: %v, want ErrBadJob", c.name, err)
		}
	}
	if _, err := s.Maps.GetJob(job); !errors.Is(err, maps.ErrNoJob) {
		t.Fatalf("a refused AddJob left job %d behind: %v", job, err)
	}

	admit(t, s.Maps, good)
	if err := s.Maps.AddJob(good, testKey(job)); !errors.Is(err, maps.ErrJobExists) {
		t.Errorf("second AddJob: %v, want ErrJobExists", err)
	}
	if err := s.Maps.PutMember(mb); err != nil {
		t.Errorf("PutMember of an admitted job: %v", err)
	}
	got, err := s.Maps.GetJob(job)
	if err != nil {
		t.Fatal(err)
	}
	if want := (maps.Job{JobID: job, PS: good.PS, PSIfindex: loIfindex, Workers: 32, MaxSlots: poolSize, Joined: got.Joined}); got != want {
		t.Errorf("GetJob: %+v, want %+v", got, want)
	}
	s.runExpect(t, d0, xdpDrop)
	s.expectDelta(t, cnt{maps.CntRx: 1, maps.CntAggregated: 1})
	expectHeld(t, s, job)

	// Removal: the slot is freed, the job's traffic is refused again.
	freed, err := s.Maps.RemoveJob(job)
	if err != nil || freed != 1 {
		t.Errorf("RemoveJob: %d slots freed, %v; want 1, nil", freed, err)
	}
	if sl := s.slot(t, 2); sl.State != slotFree {
		t.Errorf("slot of the removed job: %+v", slotSummary(sl))
	}
	s.runExpect(t, d1, xdpDrop)
	s.expectDelta(t, cnt{maps.CntRx: 1, maps.CntNotMember: 1})
	if _, err := s.Maps.GetJob(job); !errors.Is(err, maps.ErrNoJob) {
		t.Errorf("GetJob after RemoveJob: %v, want ErrNoJob", err)
	}
	if _, err := s.Maps.Worker(job, 0); err == nil {
		t.Errorf("RemoveJob left worker 0 bound")
	}
	if _, err := s.Maps.RemoveJob(job); !errors.Is(err, maps.ErrNoJob) {
		t.Errorf("second RemoveJob: %v, want ErrNoJob", err)
	}
	// Admitted again (workers too), the job starts from nothing.
	enroll(t, s.Maps, loIfindex, job)
	s.runExpect(t, d1, xdpDrop)
	s.expectDelta(t, cnt{maps.CntRx: 1, maps.CntAggregated: 1})
	expectSlot(t, s.slot(t, 2), slotView{State: slotAggregating, Counter: 1, FanIn: 2, Scale: 24, Job: job, Seq: 1, Bitmap: 2, Nvals: 2}, d1.Vals)
	expectHeld(t, s, job)
}

// ---- RESULT source ----

// A RESULT is accepted only from the job's PS: its IPv4 address, its UDP port, and the switch
// port it was admitted behind. Anything else is dropped (not_member) and frees no slot.
func TestSwitchResultSource(t *testing.T) {
	const (
		job      = 3
		farJob   = 41 // PS behind switch port otherPortIfindex
		otherJob = 42 // PS at otherPS
	)
	otherPS := [4]byte{10, 0, 0, 2}
	res := resultFrame(job, 9, 5, 2, 10, 12)
	cases := []struct {
		name string
		in   frame
	}{
		{"from a worker's address", res.with(func(f *frame) { f.SrcIP = workerIP(0) })},
		{"from a worker's address and port", res.with(func(f *frame) { f.SrcIP = workerIP(0); f.SrcPort = workerPort(0) })},
		{"from the PS address, another UDP port", res.with(func(f *frame) { f.SrcPort = aggPort + 1 })},
		{"from the PS address, UDP port 0", res.with(func(f *frame) { f.SrcPort = 0 })},
		{"from the PS address, a worker's UDP port", res.with(func(f *frame) { f.SrcPort = workerPort(1) })},
		{"from the PS address, byte-swapped UDP port", res.with(func(f *frame) { f.SrcPort = bits.ReverseBytes16(aggPort) })},
		{"from another job's PS", res.with(func(f *frame) { f.SrcIP = otherPS })},
		{"from the switch's own address", res.with(func(f *frame) { f.SrcIP = switchIP })},
		{"from 0.0.0.0", res.with(func(f *frame) { f.SrcIP = [4]byte{} })},
		{"PS behind another switch port (job's PS ifindex 999, arrived at 1)", resultFrame(farJob, 9, 5, 2, 1, 2)},
	}
	s := load(t, 0)
	far := testJob(s.Maps, farJob)
	far.PSIfindex = otherPortIfindex
	admit(t, s.Maps, far)
	enrollWorkers(t, s.Maps, loIfindex, farJob)
	other := testJob(s.Maps, otherJob)
	other.PS = netip.AddrPortFrom(netip.AddrFrom4(otherPS), aggPort)
	admit(t, s.Maps, other)

	p0 := dataFrame(job, 9, 5, 0, 2, 4, 5)
	s.runExpect(t, p0, xdpDrop)
	s.runExpect(t, dataFrame(farJob, 9, 6, 0, 2, 4, 5).with(setHdr(func(h *bpf.XdpaggHdr) { h.AggIndex = 5 })), xdpPass) // collides at 5
	s.expectDelta(t, cnt{maps.CntRx: 2, maps.CntAggregated: 1, maps.CntCollision: 1, maps.CntToPS: 1})
	held := func(j uint32) int32 {
		g, err := s.Maps.GetJob(j)
		if err != nil {
			t.Fatal(err)
		}
		return g.Held
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, _ := s.run(t, c.in)
			if got != xdpDrop {
				t.Errorf("verdict %s, want XDP_DROP", verdictName(got))
			}
			s.expectDelta(t, cnt{maps.CntRx: 1, maps.CntNotMember: 1})
			expectSlot(t, s.slot(t, 5), slotView{State: slotAggregating, Counter: 1, FanIn: 2, Scale: 24, Job: job, Seq: 9, Bitmap: 1, Nvals: 2}, p0.Vals)
			if h := held(job); h != 1 {
				t.Errorf("job %d holds %d slots, want 1", job, h)
			}
		})
	}
	t.Run("from the PS: accepted, frees the slot", func(t *testing.T) {
		out := s.runExpect(t, res, xdpRedirect)
		expectFrame(t, out, res)
		s.expectDelta(t, cnt{maps.CntRx: 1, maps.CntPSResult: 1})
		if sl := s.slot(t, 5); sl.State != slotFree {
			t.Errorf("slot 5 after the PS's result: %+v", slotSummary(sl))
		}
		expectHeld(t, s, job)
	})
	t.Run("job 42's own PS for job 42", func(t *testing.T) {
		in := resultFrame(otherJob, 1, 0, 2, 1).with(func(f *frame) { f.SrcIP = otherPS })
		s.runExpect(t, in, xdpRedirect)
		s.expectDelta(t, cnt{maps.CntRx: 1, maps.CntPSResult: 1})
	})
}

// ---- slot quota ----

// expectHeld checks, for each job, that jobs.held (maps.GetJob) is the number of slots of the
// pool that the job holds (any state but free).
func expectHeld(t *testing.T, s *sw, jobs ...uint32) {
	t.Helper()
	n := map[uint32]int32{}
	for i := range s.Maps.PoolSize() {
		if sl := s.slot(t, i); sl.State != slotFree {
			n[sl.JobId]++
		}
	}
	for _, job := range jobs {
		j, err := s.Maps.GetJob(job)
		if err != nil {
			t.Fatalf("read job %d: %v", job, err)
		}
		if j.Held != n[job] {
			t.Errorf("job %d: held = %d, but it holds %d slots of the pool", job, j.Held, n[job])
		}
	}
}

func TestSwitchQuota(t *testing.T) {
	const (
		rx    = maps.CntRx
		agg   = maps.CntAggregated
		done  = maps.CntCompleted
		tops  = maps.CntToPS
		quota = maps.CntOverQuota
		psr   = maps.CntPSResult
		flsh  = maps.CntFlushed
		recl  = maps.CntReclaimed
		dup   = maps.CntDuplicate
		coll  = maps.CntCollision
	)
	const (
		q2 = 50 // quota 2, fan-in 2
		q1 = 51 // quota 1
		nq = 1  // testJob: quota = the pool
	)
	// Each step sends one frame; after it, jobs.held of every job must match the pool.
	type qstep struct {
		name    string
		before  func(t *testing.T, s *sw)
		in      frame
		verdict uint32
		want    *frame
		delta   cnt
		held    map[uint32]int32
	}
	d := func(job, seq, idx uint32, w uint8, vals ...int32) frame {
		return dataFrame(job, seq, idx, w, 2, vals...)
	}
	sleep := func(*testing.T, *sw) { time.Sleep(60 * time.Millisecond) }
	scenarios := []struct {
		name    string
		timeout time.Duration
		steps   []qstep
	}{
		{name: "quota 2, three fragments", timeout: time.Hour, steps: []qstep{
			{name: "seq 1 at slot 0", in: d(q2, 1, 0, 0, 1), verdict: xdpDrop, delta: cnt{rx: 1, agg: 1}, held: map[uint32]int32{q2: 1}},
			{name: "seq 2 at slot 1", in: d(q2, 2, 1, 0, 2), verdict: xdpDrop, delta: cnt{rx: 1, agg: 1}, held: map[uint32]int32{q2: 2}},
			{name: "seq 3 at slot 2: over quota, to the PS", in: d(q2, 3, 2, 0, 3), verdict: xdpPass,
				want: ptr(asToPS(d(q2, 3, 2, 0, 3), 0)), delta: cnt{rx: 1, quota: 1, tops: 1}, held: map[uint32]int32{q2: 2}},
			{name: "seq 3's other worker: over quota too", in: d(q2, 3, 2, 1, 4), verdict: xdpPass,
				want: ptr(asToPS(d(q2, 3, 2, 1, 4), 0)), delta: cnt{rx: 1, quota: 1, tops: 1}, held: map[uint32]int32{q2: 2}},
			{name: "a resend of seq 3 goes to the PS (no quota counted: resends never reserve)", in: d(q2, 3, 2, 1, 4).with(flags(fResend)),
				verdict: xdpPass, delta: cnt{rx: 1, tops: 1}, held: map[uint32]int32{q2: 2}},
			{name: "duplicate on a held slot", in: d(q2, 1, 0, 0, 1), verdict: xdpDrop, delta: cnt{rx: 1, dup: 1}, held: map[uint32]int32{q2: 2}},
			{name: "completing its own slot needs no quota", in: d(q2, 1, 0, 1, 5), verdict: xdpRedirect,
				want: ptr(asResult(d(q2, 1, 0, 1, 5), 3, fFromSwitch, []int32{6})), delta: cnt{rx: 1, agg: 1, done: 1}, held: map[uint32]int32{q2: 2}},
			{name: "shadow copy of the completed slot", in: d(q2, 1, 0, 1, 5).with(flags(fResend)), verdict: xdpTX,
				delta: cnt{rx: 1, maps.CntShadowTx: 1}, held: map[uint32]int32{q2: 2}},
			{name: "retaking its own completed slot needs no quota", in: d(q2, 5, 0, 0, 7), verdict: xdpDrop,
				delta: cnt{rx: 1, agg: 1}, held: map[uint32]int32{q2: 2}},
			{name: "taking over its own older half-filled slot needs no quota", in: d(q2, 6, 1, 0, 8), verdict: xdpDrop,
				delta: cnt{rx: 1, agg: 1, recl: 1}, held: map[uint32]int32{q2: 2}},
			{name: "other jobs are not limited by q2's quota", in: d(nq, 1, 2, 0, 9), verdict: xdpDrop,
				delta: cnt{rx: 1, agg: 1}, held: map[uint32]int32{q2: 2, nq: 1}},
			{name: "PS result frees q2's half-filled slot 1", in: resultFrame(q2, 6, 1, 2, 1), verdict: xdpRedirect,
				delta: cnt{rx: 1, psr: 1}, held: map[uint32]int32{q2: 1, nq: 1}},
			{name: "a slot within quota again: seq 7 at slot 3", in: d(q2, 7, 3, 0, 10), verdict: xdpDrop,
				delta: cnt{rx: 1, agg: 1}, held: map[uint32]int32{q2: 2}},
			{name: "over quota again: seq 8 at slot 4", in: d(q2, 8, 4, 0, 11), verdict: xdpPass,
				delta: cnt{rx: 1, quota: 1, tops: 1}, held: map[uint32]int32{q2: 2}},
			{name: "a resend flushes slot 3 to the PS and frees it", in: d(q2, 7, 3, 0, 10).with(flags(fResend)), verdict: xdpPass,
				delta: cnt{rx: 1, tops: 1, flsh: 1}, held: map[uint32]int32{q2: 1}},
			{name: "a resend that completes on flush keeps the slot", in: d(q2, 5, 0, 1, 1).with(flags(fResend)), verdict: xdpRedirect,
				delta: cnt{rx: 1, agg: 1, done: 1}, held: map[uint32]int32{q2: 1}},
			{name: "seq 8 at slot 4 now fits", in: d(q2, 8, 4, 1, 11), verdict: xdpDrop,
				delta: cnt{rx: 1, agg: 1}, held: map[uint32]int32{q2: 2}},
			{name: "the PS's result of a completed slot frees nothing", in: resultFrame(q2, 5, 0, 2, 8), verdict: xdpRedirect,
				delta: cnt{rx: 1, psr: 1}, held: map[uint32]int32{q2: 2}},
			{name: "collision on another job's slot costs no quota", in: d(q2, 9, 2, 0, 1), verdict: xdpPass,
				delta: cnt{rx: 1, coll: 1, tops: 1}, held: map[uint32]int32{q2: 2, nq: 1}},
		}},
		{name: "quota 1 and stale slots of other jobs", timeout: 50 * time.Millisecond, steps: []qstep{
			{name: "job 1 takes slot 0", in: d(nq, 1, 0, 0, 1), verdict: xdpDrop, delta: cnt{rx: 1, agg: 1}, held: map[uint32]int32{nq: 1}},
			{name: "job 1 takes slot 1", in: d(nq, 1, 1, 0, 1).with(setHdr(func(h *bpf.XdpaggHdr) { h.Seq = 2 })), verdict: xdpDrop,
				delta: cnt{rx: 1, agg: 1}, held: map[uint32]int32{nq: 2}},
			{name: "q1 takes slot 2", in: d(q1, 1, 2, 0, 1), verdict: xdpDrop, delta: cnt{rx: 1, agg: 1}, held: map[uint32]int32{q1: 1}},
			{name: "q1 at its quota does not take job 1's stale slot 0", before: sleep, in: d(q1, 2, 0, 0, 2), verdict: xdpPass,
				delta: cnt{rx: 1, quota: 1, tops: 1}, held: map[uint32]int32{nq: 2, q1: 1}},
			{name: "q1's own stale slot 2 is freed by the PS", in: resultFrame(q1, 1, 2, 2, 1), verdict: xdpRedirect,
				delta: cnt{rx: 1, psr: 1}, held: map[uint32]int32{nq: 2, q1: 0}},
			{name: "q1 takes job 1's stale slot 0: job 1 holds one less", in: d(q1, 2, 0, 0, 2), verdict: xdpDrop,
				delta: cnt{rx: 1, agg: 1, recl: 1}, held: map[uint32]int32{nq: 1, q1: 1}},
			{name: "job 1 takes q1's stale slot 0 back", before: sleep, in: d(nq, 3, 0, 0, 3), verdict: xdpDrop,
				delta: cnt{rx: 1, agg: 1, recl: 1}, held: map[uint32]int32{nq: 2, q1: 0}},
			{name: "a PS result of another fragment frees job 1's stale slot 1", in: resultFrame(nq, 99, 1, 2, 1), verdict: xdpRedirect,
				delta: cnt{rx: 1, psr: 1, recl: 1}, held: map[uint32]int32{nq: 1}},
			{name: "a PS result of job 1 frees its own stale slot 0", before: sleep, in: resultFrame(nq, 98, 0, 2, 1),
				verdict: xdpRedirect, delta: cnt{rx: 1, psr: 1, recl: 1}, held: map[uint32]int32{nq: 0}},
			{name: "q1 reserves, job 1 lets it stale", in: d(q1, 3, 3, 0, 4), verdict: xdpDrop,
				delta: cnt{rx: 1, agg: 1}, held: map[uint32]int32{q1: 1}},
			{name: "job 1's PS result frees q1's stale slot 3: q1 holds one less", before: sleep, in: resultFrame(nq, 97, 3, 2, 1),
				verdict: xdpRedirect, delta: cnt{rx: 1, psr: 1, recl: 1}, held: map[uint32]int32{nq: 0, q1: 0}},
		}},
	}
	for _, sc := range scenarios {
		t.Run(sc.name, func(t *testing.T) {
			s := load(t, sc.timeout)
			for _, j := range []struct {
				id, quota uint32
			}{{q2, 2}, {q1, 1}} {
				job := testJob(s.Maps, j.id)
				job.MaxSlots = j.quota
				admit(t, s.Maps, job)
				enrollWorkers(t, s.Maps, loIfindex, j.id)
			}
			for i, st := range sc.steps {
				ok := t.Run(st.name, func(t *testing.T) {
					if st.before != nil {
						st.before(t, s)
					}
					out := s.runExpect(t, st.in, st.verdict)
					if st.want != nil {
						expectFrame(t, out, *st.want)
					}
					s.expectDelta(t, st.delta)
					for job, want := range st.held {
						j, err := s.Maps.GetJob(job)
						if err != nil {
							t.Fatal(err)
						}
						if j.Held != want {
							t.Errorf("job %d holds %d slots, want %d", job, j.Held, want)
						}
					}
					expectHeld(t, s, q2, q1, nq)
				})
				if !ok {
					t.Fatalf("step %d (%s) failed; later steps depend on it", i, st.name)
				}
			}
		})
	}
}

// ---- control budget ----

func TestSwitchControlBudget(t *testing.T) {
	join := controlFrame(uint8(bpf.XdpaggMsgTypeMSG_JOIN))
	types := []uint8{uint8(bpf.XdpaggMsgTypeMSG_JOIN), uint8(bpf.XdpaggMsgTypeMSG_LEAVE), uint8(bpf.XdpaggMsgTypeMSG_ACK),
		uint8(bpf.XdpaggMsgTypeMSG_RETRANSMIT)}
	// burst sends n control messages (cycling through the four types) in a tight loop and returns
	// how many passed.
	burst := func(t *testing.T, s *sw, n int) (passed int) {
		t.Helper()
		for i := range n {
			in := join.with(setHdr(func(h *bpf.XdpaggHdr) { h.Type = types[i%len(types)] }))
			switch got, _ := s.run(t, in); got {
			case xdpPass:
				passed++
			case xdpDrop:
			default:
				t.Fatalf("control message %d: verdict %s", i, verdictName(got))
			}
		}
		return passed
	}
	bucket := func(t *testing.T, s *sw, ifindex uint32) bpf.XdpaggCtlBucket {
		t.Helper()
		var b bpf.XdpaggCtlBucket
		if err := s.Maps.CtlBudget.Lookup(ifindex, &b); err != nil {
			t.Fatalf("read control budget of ifindex %d: %v", ifindex, err)
		}
		return b
	}

	t.Run("1/s, burst 5: 6 pass, the rest are dropped", func(t *testing.T) {
		cfg := testConfig(0)
		cfg.ControlRate, cfg.ControlBurst = 1, 5
		s := loadCfg(t, cfg)
		if p := burst(t, s, 20); p != 6 {
			t.Errorf("%d of 20 control messages passed, want 6 (1 + a burst of 5)", p)
		}
		s.expectDelta(t, cnt{maps.CntRx: 20, maps.CntControl: 6, maps.CntCtlLimited: 14})
		if b := bucket(t, s, loIfindex); b.Dropped != 14 {
			t.Errorf("ctl_budget[lo].dropped = %d, want 14", b.Dropped)
		}
		// The budget is for control messages only: data, results and reserved types are not
		// held back by it, nor do they use it up.
		s.runExpect(t, dataFrame(1, 1, 0, 0, 2, 1), xdpDrop)
		s.runExpect(t, resultFrame(1, 1, 0, 2, 1), xdpRedirect)
		s.runExpect(t, join.with(setHdr(func(h *bpf.XdpaggHdr) { h.Type = 200 })), xdpDrop)
		s.expectDelta(t, cnt{maps.CntRx: 3, maps.CntAggregated: 1, maps.CntPSResult: 1, maps.CntMalformed: 1})
		s.runExpect(t, join, xdpDrop)
		s.expectDelta(t, cnt{maps.CntRx: 1, maps.CntCtlLimited: 1})
	})
	t.Run("1000/s, burst 3: the budget refills", func(t *testing.T) {
		cfg := testConfig(0)
		cfg.ControlRate, cfg.ControlBurst = 1000, 3
		s := loadCfg(t, cfg)
		start := time.Now()
		p := burst(t, s, 10)
		if max := 4 + int(time.Since(start)/time.Millisecond); p < 4 || p > max {
			t.Errorf("%d of 10 control messages passed, want 4..%d", p, max)
		}
		time.Sleep(10 * time.Millisecond)
		start = time.Now()
		p = burst(t, s, 10)
		if max := 4 + int(time.Since(start)/time.Millisecond); p < 4 || p > max {
			t.Errorf("after 10 ms: %d of 10 control messages passed, want 4..%d", p, max)
		}
		d := s.counters(t).Sub(s.base)
		s.base = s.counters(t)
		if d[maps.CntRx] != 20 || d[maps.CntControl]+d[maps.CntCtlLimited] != 20 {
			t.Errorf("counter deltas {%v}", deltaOf(d))
		}
	})
	t.Run("defaults: 20,000/s with bursts of 2,000", func(t *testing.T) {
		s := load(t, 0)
		start := time.Now()
		p := burst(t, s, 3000)
		el := time.Since(start)
		// 2,001 at once, then one per 50 µs.
		if max := 2001 + int(el/(50*time.Microsecond)) + 1; p < 2001 || p > max {
			t.Errorf("%d of 3,000 control messages in %v passed, want 2,001..%d", p, el, max)
		}
		t.Logf("%d of 3,000 control messages sent back to back in %v passed", p, el)
		s.expectDelta(t, cnt{maps.CntRx: 3000, maps.CntControl: uint64(p), maps.CntCtlLimited: uint64(3000 - p)})
	})
}

// ---- slot garbage collector ----

func TestSlotGC(t *testing.T) {
	const timeout = 50 * time.Millisecond
	s := load(t, timeout)
	state := func(idx uint32) uint8 { return s.slot(t, idx).State }
	reclaim := func(want int) {
		t.Helper()
		n, err := s.Maps.ReclaimIdle()
		if err != nil {
			t.Fatalf("ReclaimIdle: %v", err)
		}
		if n != want {
			t.Errorf("ReclaimIdle freed %d slots, want %d", n, want)
		}
	}
	// Job 1: slots 0 (half-filled) and 1 (half-filled, touched again later); job 2: slot 2
	// (complete); job 3: slot 3 (half-filled) and slot 4 (complete).
	s.runExpect(t, dataFrame(1, 1, 0, 0, 2, 1), xdpDrop)
	s.runExpect(t, dataFrame(1, 2, 1, 0, 3, 1), xdpDrop)
	s.runExpect(t, dataFrame(2, 1, 2, 0, 1, 1), xdpRedirect)
	s.runExpect(t, dataFrame(3, 1, 3, 0, 2, 1), xdpDrop)
	s.runExpect(t, dataFrame(3, 2, 4, 0, 1, 1), xdpRedirect)
	s.expectDelta(t, cnt{maps.CntRx: 5, maps.CntAggregated: 5, maps.CntCompleted: 2})
	expectHeld(t, s, 1, 2, 3)

	reclaim(0) // all young
	time.Sleep(timeout + 20*time.Millisecond)
	s.runExpect(t, dataFrame(1, 2, 1, 1, 3, 1), xdpDrop) // slot 1 touched: young again
	s.expectDelta(t, cnt{maps.CntRx: 1, maps.CntAggregated: 1})
	reclaim(4)
	for idx, want := range []uint8{slotFree, slotAggregating, slotFree, slotFree, slotFree} {
		if got := state(uint32(idx)); got != want {
			t.Errorf("slot %d: state %s, want %s", idx, maps.StateName(got), maps.StateName(want))
		}
	}
	expectHeld(t, s, 1, 2, 3)
	for job, want := range map[uint32]int32{1: 1, 2: 0, 3: 0} {
		if j, _ := s.Maps.GetJob(job); j.Held != want {
			t.Errorf("job %d holds %d slots, want %d", job, j.Held, want)
		}
	}
	s.expectDelta(t, cnt{}) // the collector counts nothing
	reclaim(0)

	// Freed slots are free for anyone at once, without a reclaim.
	s.runExpect(t, dataFrame(4, 1, 0, 0, 2, 1), xdpDrop)
	s.expectDelta(t, cnt{maps.CntRx: 1, maps.CntAggregated: 1})

	// RemoveJob frees all of one job's slots, young or not, and no other job's.
	s.runExpect(t, dataFrame(1, 3, 2, 0, 1, 1), xdpRedirect)
	s.runExpect(t, dataFrame(1, 4, 3, 0, 2, 1), xdpDrop)
	freed, err := s.Maps.RemoveJob(1)
	if err != nil || freed != 3 {
		t.Errorf("RemoveJob(1) freed %d slots, %v; want 3, nil", freed, err)
	}
	for idx, want := range []uint8{slotAggregating, slotFree, slotFree, slotFree, slotFree} {
		if got := state(uint32(idx)); got != want {
			t.Errorf("after RemoveJob: slot %d: state %s, want %s", idx, maps.StateName(got), maps.StateName(want))
		}
	}
	expectHeld(t, s, 4)

	// A pool bigger than one collector batch.
	t.Run(fmt.Sprintf("pool of %d slots", 3*bpf.XdpaggLimitLIMIT_GC_BATCH+5), func(t *testing.T) {
		cfg := testConfig(timeout)
		cfg.PoolSize = uint32(3*bpf.XdpaggLimitLIMIT_GC_BATCH + 5)
		s := loadCfg(t, cfg)
		var idxs []uint32
		for i := uint32(0); i < cfg.PoolSize; i += 97 {
			idxs = append(idxs, i)
		}
		idxs = append(idxs, cfg.PoolSize-1)
		for k, idx := range idxs {
			s.runExpect(t, dataFrame(uint32(1+k%2), uint32(k), idx, 0, 2, 1), xdpDrop)
		}
		time.Sleep(timeout + 20*time.Millisecond)
		n, err := s.Maps.ReclaimIdle()
		if err != nil || n != len(idxs) {
			t.Errorf("ReclaimIdle freed %d, %v; want %d", n, err, len(idxs))
		}
		expectHeld(t, s, 1, 2)
	})
}

// The collector runs on the datapath's clock (bpf_ktime_get_ns), not on the caller's: run in a
// time namespace whose CLOCK_MONOTONIC is a day ahead, it still frees exactly the slots idle past
// the timeout. The test re-runs itself as a child process in such a namespace (the offsets of a
// time namespace can only be set before its first process enters it).
func TestSlotGCTimeNamespace(t *testing.T) {
	const offset = 24 * time.Hour
	if os.Getenv("XDPAGG_TIMENS_CHILD") == "1" {
		// In the namespace: its offsets are the ones the parent wrote. (They are relative to the
		// host's clock, whatever namespace the parent itself runs in.)
		offs, err := os.ReadFile("/proc/self/timens_offsets")
		if err != nil {
			t.Fatal(err)
		}
		if f := strings.Fields(string(offs)); len(f) < 2 || f[0] != "monotonic" || f[1] != strconv.FormatInt(int64(offset/time.Second), 10) {
			want := fmt.Sprintf("monotonic %d", int64(offset/time.Second))
			t.Fatalf("time namespace offsets %q, want %q: not in the time namespace", offs, want)
		}
		var ts unix.Timespec
		const timeout = 50 * time.Millisecond
		s := load(t, timeout)
		// The datapath's clock is the host's: a day behind this namespace's.
		dp, err := s.Maps.DatapathNow()
		if err != nil {
			t.Fatal(err)
		}
		if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
			t.Fatal(err)
		}
		if behind := time.Duration(ts.Nano() - int64(dp)); behind < offset-time.Minute || behind > offset+time.Minute {
			t.Errorf("maps.DatapathNow is %v behind this namespace's CLOCK_MONOTONIC, want about %v", behind, offset)
		}
		s.runExpect(t, dataFrame(1, 1, 0, 0, 2, 1), xdpDrop)
		s.runExpect(t, dataFrame(2, 1, 1, 0, 1, 1), xdpRedirect)
		if n, err := s.Maps.ReclaimIdle(); err != nil || n != 0 {
			t.Errorf("ReclaimIdle on young slots freed %d, %v; want 0", n, err)
		}
		time.Sleep(timeout + 20*time.Millisecond)
		s.runExpect(t, dataFrame(1, 1, 0, 1, 3, 1).with(setHdr(func(h *bpf.XdpaggHdr) { h.FanIn0 = 2 })), xdpRedirect) // slot 0 touched
		if n, err := s.Maps.ReclaimIdle(); err != nil || n != 1 {
			t.Errorf("ReclaimIdle freed %d, %v; want 1 (slot 1)", n, err)
		}
		expectHeld(t, s, 1, 2)
		return
	}

	// This goroutine's thread gets a time namespace for its children and is never unlocked: it
	// ends with the test instead of serving others (a multi-threaded process cannot setns back).
	runtime.LockOSThread()
	if err := unix.Unshare(unix.CLONE_NEWTIME); err != nil {
		t.Fatalf("unshare(CLONE_NEWTIME): %v", err)
	}
	offs := fmt.Sprintf("monotonic %d 0\nboottime %d 0\n", int64(offset/time.Second), int64(offset/time.Second))
	// /proc/<tid>: the file is per process (tgid) directory only, and /proc/self is the
	// thread-group leader, whose time namespace for children is not this thread's.
	if err := os.WriteFile(fmt.Sprintf("/proc/%d/timens_offsets", unix.Gettid()), []byte(offs), 0o644); err != nil {
		t.Fatalf("set the time namespace's offsets: %v", err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestSlotGCTimeNamespace$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), "XDPAGG_TIMENS_CHILD=1")
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: TestSlotGCTimeNamespace") {
		t.Fatalf("child in a time namespace %v ahead: %v\n%s", offset, err, out)
	}
}
