package bpf_test

// Randomized property test: random DATA frames through xdpagg_switch against a Go model of the
// slot state machine (reserve / add / duplicate / collision / shadow / complete / same-job reuse),
// of admission and membership, of the PS check on RESULTs and of slot quotas (jobs.held).

import (
	"fmt"
	"math/bits"
	"math/rand/v2"
	"net/netip"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
)

const modelPool = 4

type mslot struct {
	state, counter, fan, scale uint8
	job, seq, bitmap           uint32
	nvals, flags               uint16
	vals                       [bpf.MaxValues]int32
}

type model struct {
	pool  uint32
	slots []mslot
	jobs  map[uint32]*mjob // admitted jobs
}

// mjob is an admitted job as the model sees it: its PS and quota, and how many slots it holds.
type mjob struct {
	psIP      [4]byte
	psPort    uint16
	psIfindex uint32
	maxSlots  uint32
	held      int32
	threshold uint8 // H: a slot completes with min(H, fan-in) contributors (0: the fan-in)
}

// The model's jobs: modelJobs are admitted (PS psIP:aggPort behind loIfindex) with every worker
// id enrolled at workerIP(w):workerPort(w) behind loIfindex; modelUnadmitted has its workers
// enrolled but was never admitted (its DATA is not_member); modelFarPSJob is admitted with its
// PS behind another switch port (otherPortIfindex), so RESULTs arriving at loIfindex are refused.
var modelJobs = []uint32{1, 2, 3}

const (
	modelUnadmitted = 4
	modelFarPSJob   = 5
)

// newModel is the model of a switch enrolled by enrollModel, with slot quotas for jobs 1..3
// (quota[j-1]; 0 means the whole pool).
func newModel(quota [3]uint32) *model {
	m := &model{pool: modelPool, slots: make([]mslot, modelPool), jobs: map[uint32]*mjob{}}
	for i, j := range modelJobs {
		q := quota[i]
		if q == 0 {
			q = modelPool
		}
		m.jobs[j] = &mjob{psIP: psIP, psPort: aggPort, psIfindex: loIfindex, maxSlots: q}
	}
	m.jobs[modelFarPSJob] = &mjob{psIP: psIP, psPort: aggPort, psIfindex: otherPortIfindex, maxSlots: modelPool}
	return m
}

// enrollModel sets a freshly loaded switch up as newModel(quota) describes it.
func enrollModel(t testing.TB, mp *maps.Maps, m *model) {
	t.Helper()
	for id, j := range m.jobs {
		admit(t, mp, maps.Job{JobID: id, PS: netip.AddrPortFrom(netip.AddrFrom4(j.psIP), j.psPort), PSIfindex: j.psIfindex,
			Workers: uint8(bpf.MaxWorkers), MaxSlots: j.maxSlots, Threshold: j.threshold})
		enrollWorkers(t, mp, loIfindex, id)
	}
	enrollWorkers(t, mp, loIfindex, modelUnadmitted)
}

// resetJobs rewrites the switch's job entries as the model has them (held included): the fuzz
// target reuses one switch across inputs, and each input starts from an empty pool.
func resetJobs(t testing.TB, mp *maps.Maps, m *model) {
	t.Helper()
	for id, j := range m.jobs {
		var v bpf.XdpaggJob
		if err := mp.Jobs.Lookup(id, &v); err != nil {
			t.Fatalf("read job %d: %v", id, err)
		}
		v.MaxSlots, v.Held, v.Threshold = j.maxSlots, j.held, j.threshold
		if err := mp.Jobs.Update(id, &v, ebpf.UpdateExist); err != nil {
			t.Fatalf("rewrite job %d: %v", id, err)
		}
	}
}

// expectHeld compares every job's held slots (jobs.held) with the model's.
func (m *model) expectHeld(t *testing.T, s *sw) {
	t.Helper()
	for id, j := range m.jobs {
		var v bpf.XdpaggJob
		if err := s.Maps.Jobs.Lookup(id, &v); err != nil {
			t.Fatalf("read job %d: %v", id, err)
		}
		if v.Held != j.held || v.MaxSlots != j.maxSlots {
			t.Errorf("job %d: held %d of %d slots, model says %d of %d", id, v.Held, v.MaxSlots, j.held, j.maxSlots)
		}
	}
}

// outcome is what the model predicts for one frame.
type outcome struct {
	verdict uint32
	delta   cnt
	out     *frame // expected output frame; nil for drops
	what    string
	how     string // for aggregated/completed: how the slot was taken
}

func seqAfter(a, b uint32) bool { return int32(a-b) > 0 }

// step mirrors parse and handle_data (bpf/dense_handlers.h) for a DATA frame that parses as xdpagg (lengths
// agree, no IP options, fragments or bad checksums). No slot ever times out (the switch under
// test has a one-hour timeout).
func (m *model) step(f frame) outcome {
	h := f.Hdr
	malformed := outcome{verdict: xdpDrop, delta: cnt{maps.CntRx: 1, maps.CntMalformed: 1}, what: "malformed"}
	// Parse: counts, reserved encodings (ENC_SPARSE_KV), slot index.
	if h.Count == 0 || int(h.Count) > bpf.MaxValues || int(h.Count) != len(f.Vals) || h.Encoding > encFloat32 || h.AggIndex >= m.pool {
		return malformed
	}
	bm, fan := h.Bitmap0, uint32(h.FanIn0)
	if h.Flags&fLevel1 != 0 {
		bm, fan = h.Bitmap1, uint32(h.FanIn1)
	}
	if fan == 0 || fan > uint32(bpf.MaxWorkers) || bm == 0 || (fan < 32 && bm>>fan != 0) || h.JobId == 0 {
		return malformed
	}
	// Membership: the enrolled jobs have every worker id at workerIP(w):workerPort(w) behind
	// loIfindex; then the job must be admitted.
	w := h.WorkerId
	enrolled := m.jobs[h.JobId] != nil || h.JobId == modelUnadmitted
	if !enrolled || w >= uint8(bpf.MaxWorkers) || bm != 1<<w || f.SrcIP != workerIP(w) || f.SrcPort != workerPort(w) {
		return outcome{verdict: xdpDrop, delta: cnt{maps.CntRx: 1, maps.CntNotMember: 1}, what: "not a member"}
	}
	j := m.jobs[h.JobId]
	if j == nil {
		return outcome{verdict: xdpDrop, delta: cnt{maps.CntRx: 1, maps.CntNotMember: 1}, what: "job not admitted"}
	}
	toPS := func(fl uint16, what string) outcome {
		d := cnt{maps.CntRx: 1, maps.CntToPS: 1}
		if fl != 0 {
			d[maps.CntCollision] = 1
		}
		return outcome{verdict: xdpPass, delta: d, out: ptr(asToPS(f, fl)), what: what}
	}
	if h.Encoding != encFixed32 || h.Flags&fCollision != 0 {
		return toPS(0, "to PS (encoding / diverted)")
	}
	n := int(h.Count)
	s := &m.slots[h.AggIndex]
	c := mcontrib{job: h.JobId, seq: h.Seq, bitmap: bm, nvals: h.Count, fan: uint8(fan), scale: h.ScaleLog2,
		flags: h.Flags & (fECN | fOverflow), resend: h.Flags&fResend != 0,
		quotaOK: j.held < int32(j.maxSlots), // read before the slot's lock, as the switch does
		need:    slotNeed(uint8(fan), j.threshold)}
	how := map[uint8]string{slotFree: "reserve a free slot", slotAggregating: "take over own older half-filled slot",
		slotComplete: "retake own completed slot"}[s.state]
	matched := s.state != slotFree && s.job == h.JobId && s.seq == h.Seq
	if matched {
		how = "add"
	}
	d := slotDecide(s, c)
	// The value pass, still "under the lock".
	ovf := false
	switch d.pass {
	case passCopy:
		copy(s.vals[:n], f.Vals)
	case passAdd, passAddOut:
		for i, v := range f.Vals {
			var o bool
			s.vals[i], o = wrapAddOvf(s.vals[i], v)
			ovf = ovf || o
		}
	}
	if ovf {
		s.flags |= fOverflow
	}
	slotSettle(s, &d, c.need)
	j.held += d.heldDelta
	if d.prevOwner != 0 {
		m.jobs[d.prevOwner].held--
	}
	result := func(extra uint16) uint16 {
		return h.Flags&fLevel1 | s.flags&(fECN|fOverflow) | extra
	}
	withReclaim := func(dl cnt) cnt {
		if d.reclaimed {
			dl[maps.CntReclaimed] = 1
		}
		return dl
	}
	switch d.verdict {
	case vMalformed:
		return malformed
	case vDuplicate:
		return outcome{verdict: xdpDrop, delta: cnt{maps.CntRx: 1, maps.CntDuplicate: 1}, what: "duplicate"}
	case vCollision:
		return toPS(fCollision, "collision")
	case vOverQuota:
		o := toPS(0, "over quota")
		o.delta[maps.CntOverQuota] = 1
		return o
	case vToPS:
		if !matched {
			return toPS(0, "resend without a matching slot")
		}
		return toPS(0, "partial aggregate overlapping the slot")
	case vShadow:
		return outcome{verdict: xdpTX, delta: cnt{maps.CntRx: 1, maps.CntShadowTx: 1},
			out: ptr(asShadow(f, s.bitmap, result(fFromSwitch|fShadow), s.vals[:n])), what: "shadow"}
	case vFlush:
		// ATP's partial flush: the slot's partial sum goes on to the PS as DATA with its bits.
		g := f
		if h.Flags&fLevel1 != 0 {
			g.Hdr.Bitmap1 = s.bitmap
		} else {
			g.Hdr.Bitmap0 = s.bitmap
		}
		g.Hdr.Flags |= s.flags & (fECN | fOverflow)
		g.Vals = slices.Clone(s.vals[:n])
		return outcome{verdict: xdpPass, delta: cnt{maps.CntRx: 1, maps.CntToPS: 1, maps.CntFlushed: 1},
			out: ptr(asToPS(g, 0)), what: "flush partial to PS"}
	case vAggregated:
		return outcome{verdict: xdpDrop, delta: withReclaim(cnt{maps.CntRx: 1, maps.CntAggregated: 1}), what: "aggregated", how: how}
	}
	// vCompleted
	dl := withReclaim(cnt{maps.CntRx: 1, maps.CntAggregated: 1, maps.CntCompleted: 1})
	if s.flags&fOverflow != 0 {
		dl[maps.CntOverflow] = 1
	}
	if c.resend {
		how = "resend completes"
	}
	return outcome{verdict: xdpRedirect, delta: dl, out: ptr(asResult(f, s.bitmap, result(fFromSwitch), s.vals[:n])), what: "completed", how: how}
}

// The slot state machine of bpf/slot.h, step for step: enum data_verdict, enum value_pass,
// struct contrib and struct decision, slot_decide and slot_settle. No slot of the model ever
// times out (the switch under test has a one-hour timeout), so "stale" is always false.
const (
	vAggregated = iota
	vCompleted
	vDuplicate
	vCollision
	vShadow
	vToPS
	vMalformed
	vFlush
	vOverQuota
)

const (
	passNone = iota
	passCopy
	passRead
	passAdd
	passAddOut
)

type mcontrib struct {
	job, seq, bitmap uint32
	nvals            uint16
	fan, scale       uint8
	flags            uint16
	resend, quotaOK  bool
	need             uint8
}

// slotNeed mirrors slot_need.
func slotNeed(fan, h uint8) uint8 {
	if h != 0 && h < fan {
		return h
	}
	return fan
}

type mdecision struct {
	verdict, pass int
	reclaimed     bool
	heldDelta     int32
	prevOwner     uint32
}

func slotMerge(s *mslot, bm uint32, flags uint16) {
	s.bitmap |= bm
	s.counter++
	s.flags |= flags
}

// slotDecide mirrors slot_decide.
func slotDecide(s *mslot, c mcontrib) (d mdecision) {
	const stale = false
	job, seq, bm := c.job, c.seq, c.bitmap
	match := s.state != slotFree && s.job == job && s.seq == seq
	switch {
	case !match:
		reusable := s.state == slotFree
		if s.state == slotAggregating && (stale || (s.job == job && seqAfter(seq, s.seq))) {
			reusable, d.reclaimed = true, true
		} else if s.state == slotComplete {
			if s.job == job && seqAfter(seq, s.seq) {
				reusable = true
			} else if stale {
				reusable, d.reclaimed = true, true
			}
		}
		owned := s.state != slotFree && s.job == job
		switch {
		case c.resend:
			d.verdict = vToPS
		case !reusable:
			d.verdict = vCollision
		case !owned && !c.quotaOK:
			d.verdict = vOverQuota
		default:
			if !owned {
				d.heldDelta = 1
				if s.state != slotFree {
					d.prevOwner = s.job
				}
			}
			*s = mslot{job: job, seq: seq, bitmap: bm, nvals: c.nvals, state: slotAggregating, counter: 1,
				fan: c.fan, scale: c.scale, flags: c.flags}
			d.pass, d.verdict = passCopy, vAggregated
		}
	case s.state == slotComplete:
		if s.nvals != c.nvals {
			d.verdict = vMalformed
		} else {
			d.pass, d.verdict = passRead, vShadow
		}
	case s.nvals != c.nvals || s.fan != c.fan:
		d.verdict = vMalformed
	case c.resend:
		switch {
		case bm&s.bitmap == bm:
			d.pass, d.verdict = passRead, vFlush
		case bm&s.bitmap != 0:
			d.verdict = vToPS
		default:
			slotMerge(s, bm, c.flags)
			d.pass, d.verdict = passAddOut, vFlush
		}
	case bm&^s.bitmap == 0:
		s.flags |= c.flags & fECN
		d.verdict = vDuplicate
	case bm&s.bitmap != 0:
		d.verdict = vToPS
	default:
		slotMerge(s, bm, c.flags)
		d.verdict = vAggregated
		if bits.OnesCount32(s.bitmap) >= int(c.need) {
			d.pass = passAddOut
		} else {
			d.pass = passAdd
		}
	}
	return d
}

// slotSettle mirrors slot_settle.
func slotSettle(s *mslot, d *mdecision, need uint8) {
	full := bits.OnesCount32(s.bitmap) >= int(need)
	if (d.verdict == vAggregated || d.verdict == vFlush) && full {
		s.state = slotComplete
		d.verdict = vCompleted
	} else if d.verdict == vFlush {
		s.state = slotFree
		d.heldDelta = -1
	}
}

// Ways to forge a PS result (forgeResult), shared by the random walk and the fuzzer.
const (
	forgeJob0       = iota // job 0: malformed
	forgeFromWorker        // from a worker's address, not the PS's
	forgeUnenrolled        // for a job nobody joined
	forgeOtherPort         // from another UDP port of the PS
	forgeFarPS             // for a job whose PS is behind another switch port
	forgeUnadmitted        // for a job never admitted
)

// forgeResult turns a PS result into forgery how (none for any other value: the real result) and
// says what it did; w is the worker it may come from, param varies the port.
func forgeResult(f *frame, how int, w uint8, param uint16) string {
	switch how {
	case forgeJob0:
		f.Hdr.JobId = 0
		return " (job 0)"
	case forgeFromWorker:
		f.SrcIP = workerIP(w)
		return " (from a worker, not the PS)"
	case forgeUnenrolled:
		f.Hdr.JobId = unenrolledJob
		return " (job nobody joined)"
	case forgeOtherPort:
		f.SrcPort = aggPort + 1 + param%100
		return " (from another UDP port of the PS)"
	case forgeFarPS:
		f.Hdr.JobId = modelFarPSJob
		return " (job whose PS is behind another switch port)"
	case forgeUnadmitted:
		f.Hdr.JobId = modelUnadmitted
		return " (job never admitted)"
	}
	return ""
}

// result mirrors handle_result for a RESULT that parses (arriving at loIfindex): job 0 is
// malformed; only the admitted job's PS (address, UDP port, switch port) may send it; it frees a
// slot aggregating its <job, seq>.
func (m *model) result(f frame) outcome {
	h := f.Hdr
	if h.JobId == 0 {
		return outcome{verdict: xdpDrop, delta: cnt{maps.CntRx: 1, maps.CntMalformed: 1}, what: "malformed result"}
	}
	j := m.jobs[h.JobId]
	if j == nil || f.SrcIP != j.psIP || f.SrcPort != j.psPort || j.psIfindex != loIfindex {
		return outcome{verdict: xdpDrop, delta: cnt{maps.CntRx: 1, maps.CntNotMember: 1}, what: "result not from the PS"}
	}
	if s := &m.slots[h.AggIndex]; s.state == slotAggregating && s.job == h.JobId && s.seq == h.Seq {
		s.state = slotFree
		j.held--
	}
	return outcome{verdict: xdpRedirect, delta: cnt{maps.CntRx: 1, maps.CntPSResult: 1}, out: ptr(f), what: "ps result"}
}

func (m *model) expectSlots(t *testing.T, s *sw) {
	t.Helper()
	for i := range m.pool {
		m.expectSlot(t, s, i)
	}
}

// expectSlot compares slot i of the switch with the model's.
func (m *model) expectSlot(t *testing.T, s *sw, i uint32) {
	t.Helper()
	ms := &m.slots[i]
	want := slotView{State: ms.state, Counter: ms.counter, FanIn: ms.fan, Scale: ms.scale, Job: ms.job, Seq: ms.seq,
		Bitmap: ms.bitmap, Nvals: ms.nvals, Flags: ms.flags}
	got := s.slot(t, i)
	// Lanes past nvals are the switch's business (zero up to the end of the last chunk,
	// stale beyond): only the fragment's own values are state.
	n := int(ms.nvals)
	if slotSummary(got) != want || !slices.Equal(got.Vals[:n], ms.vals[:n]) {
		at := 0
		for at < n && got.Vals[at] == ms.vals[at] {
			at++
		}
		t.Errorf("slot %d: got %+v\n\t\twant %+v\n\t\tvals differ from lane %d of %d: got %v want %v", i, slotSummary(got), want,
			at, n, got.Vals[at:min(n, at+8)], ms.vals[at:min(n, at+8)])
	}
}

func TestSwitchModel(t *testing.T) {
	var compared atomic.Int64
	t.Cleanup(func() {
		// Printed, not logged: `make test` shows it (go test keeps stdout of passing packages only with -v).
		if t.Failed() {
			return
		}
		fmt.Printf("differential model check: %d packets through the Go model and the XDP switch, 0 mismatches\n", compared.Load())
	})
	// 3 seeds of 35,000 packets: more than 100,000 packets through both the model and the
	// switch per `make test`, each compared by verdict, output bytes, counters and every slot.
	packets := 35_000
	if testing.Short() {
		packets = 2000
	}
	for _, seed := range []uint64{1, 2, 3} {
		t.Run(fmt.Sprintf("seed %d", seed), func(t *testing.T) {
			sl, err := loader.Load(modelConfig())
			skipIfUnsupported(t, "load switch", err)
			t.Cleanup(func() { sl.Close() })
			s := &sw{Switch: sl}
			r := rand.New(rand.NewPCG(seed, 0x9510))
			fans := map[uint32]uint8{1: uint8(1 + r.IntN(4)), 2: uint8(1 + r.IntN(4)), 3: uint8(2 + r.IntN(3))} // job 3 always has partners
			// Slot quotas of jobs 1..3 (of a pool of 4): tight for one job or two, none for another.
			quota := map[uint64][3]uint32{1: {1, 2, 4}, 2: {2, 1, 3}, 3: {1, 1, 2}}[seed]
			m := newModel(quota)
			// Thresholds H of jobs 1..3 (0: the fan-in; above the fan-in: the fan-in too).
			hs := map[uint64][3]uint8{1: {0, 1, 2}, 2: {2, 2, 0}, 3: {3, 0, 2}}[seed]
			for i, j := range modelJobs {
				m.jobs[j].threshold = hs[i]
			}
			enrollModel(t, sl.Maps, m)
			s.base = s.counters(t)
			t.Logf("fan-in by job: %v, slot quotas of jobs 1..3: %v, thresholds: %v", fans, quota, hs)
			seen := map[string]int{}
			var history []string
			// A crude job emulation keeps the walk in interesting states: the workers of each job
			// send the fragments base and base+1 of their window, each worker first once, then as
			// resends; base moves on when a fragment has a result. A PS gathers what the switch
			// passes on and, once it holds every contribution of a fragment, answers it with a
			// RESULT through the switch (on top of the DATA frames).
			type frag = [2]uint32 // job, seq
			base := map[uint32]uint32{}
			sent := map[frag]uint32{} // workers that sent the fragment at least once
			atPS := map[frag]uint32{} // contributions the PS got
			done := map[frag]bool{}   // a result went out
			queued := map[frag]bool{} // the PS has the result on its way
			var psQueue []frag
			for p := 0; p < packets; {
				var (
					f    frame
					want outcome
					desc string
				)
				if len(psQueue) > 0 && r.IntN(3) == 0 {
					fr := psQueue[0]
					job, sq := fr[0], fr[1]
					idx := (3*job + sq) % modelPool
					f = resultFrame(job, sq, idx, fans[job], mkVals(modelCount(job, sq), func(int) int32 { return r.Int32() })...)
					desc = fmt.Sprintf("PS result job %d seq %d idx %d", job, sq, idx)
					if r.IntN(6) == 0 {
						// A forged copy, before the real one: not from the job's PS.
						desc += forgeResult(&f, []int{forgeOtherPort, forgeFromWorker, forgeFarPS, forgeUnadmitted}[r.IntN(4)],
							uint8(r.IntN(int(fans[job]))), uint16(r.IntN(100)))
					} else {
						psQueue = psQueue[1:]
						done[fr] = true
					}
					want = m.result(f)
				} else {
					job := uint32(1 + r.IntN(3))
					fan := fans[job]
					full := uint32(1)<<fan - 1
					fr := frag{job, base[job] + uint32(r.IntN(2))}
					// A late frame for a fragment that already has a result: a worker that missed
					// the result (a resend), or a copy the network delayed (not a resend).
					late := r.IntN(12) == 0 && base[job] > 0
					if late {
						fr[1] = base[job] - 1 - uint32(r.IntN(4))
					} else if done[fr] {
						continue
					}
					w := uint8(r.IntN(int(fan)))
					resend := late && r.IntN(2) == 0
					if pending := full &^ sent[fr]; late {
						// as chosen above
					} else if pending != 0 {
						for pending&(1<<w) == 0 {
							w = uint8(r.IntN(int(fan)))
						}
					} else {
						resend = r.IntN(3) != 0 // else a copy the network duplicated
					}
					sent[fr] |= 1 << w
					idx := (3*job + fr[1]) % modelPool
					if resend && r.IntN(20) == 0 {
						idx = uint32(r.IntN(modelPool)) // a confused worker (resends never reserve)
					}
					p++
					f, desc = randomData(r, p, job, fr[1], idx, w, fan, resend)
					if r.IntN(40) == 0 {
						// Someone outside the job, or a member lying about who it is.
						switch r.IntN(5) {
						case 0:
							f.Hdr.WorkerId = (w + 1) % uint8(bpf.MaxWorkers) // another worker's id
						case 1:
							f.SrcIP = [4]byte{10, 9, 9, 9}
						case 2:
							f.SrcPort++
						case 3:
							f.Hdr.JobId = unenrolledJob
						case 4:
							f.Hdr.JobId = modelUnadmitted // workers bound, job not admitted
						}
						desc += " (spoofed)"
					}
					want = m.step(f)
					switch {
					case want.verdict == xdpRedirect:
						done[fr] = true
					case want.verdict == xdpPass && f.Hdr.FanIn0 == fan && int(f.Hdr.Count) == modelCount(job, fr[1]):
						contrib := uint32(1) << w
						if want.out != nil {
							contrib = want.out.Hdr.Bitmap0 // a flushed partial aggregate
						}
						// The PS completes at the job's threshold too.
						need := int(slotNeed(fan, m.jobs[job].threshold))
						if atPS[fr] |= contrib; bits.OnesCount32(atPS[fr]) >= need && !done[fr] && !queued[fr] {
							psQueue = append(psQueue, fr)
							queued[fr] = true
						}
					}
				}
				for job := uint32(1); job <= 3; job++ {
					for done[frag{job, base[job]}] {
						base[job]++
					}
				}
				seen[want.what]++
				if want.how != "" {
					seen[want.how]++
				}
				history = append(history, desc+" -> "+want.what)
				if len(history) > 12 {
					history = history[1:]
				}

				got, out := s.run(t, f)
				if got != want.verdict {
					t.Errorf("%s: verdict %s, model says %s (%s)", desc, verdictName(got), verdictName(want.verdict), want.what)
				}
				if want.out != nil && got == want.verdict {
					expectFrame(t, out, *want.out)
				}
				s.expectDelta(t, want.delta)
				m.expectSlots(t, s)
				m.expectHeld(t, s)
				if t.Failed() {
					t.Fatalf("diverged from the model at packet %d; last packets:\n\t%s", p, joinLines(history))
				}
			}
			t.Logf("outcomes: %v", seen)
			compared.Add(int64(packets))
			if testing.Short() {
				return // too few packets to promise every outcome
			}
			for _, w := range []string{"aggregated", "completed", "duplicate", "collision", "shadow", "resend without a matching slot",
				"malformed", "ps result", "reserve a free slot", "retake own completed slot", "add",
				"not a member", "flush partial to PS", "over quota", "result not from the PS", "job not admitted"} {
				if seen[w] == 0 {
					t.Errorf("the random walk never produced %q; tune the generator", w)
				}
			}
		})
	}
}

// modelCount is the value count of fragment <job, sq>: counts around the adder's chunk boundaries
// (full chunks are summed in the packet, the partial last one through the scratch) and the limits.
func modelCount(job, sq uint32) int { return modelCounts[int(job*7+sq*3)%len(modelCounts)] }

var modelCounts = []int{1, 2, 3, 7, 10, 31, 32, 33, 63, 64, 65, 100, bpf.StdValues, bpf.MaxValues - 1, bpf.MaxValues}

// randomData is worker w's DATA frame for <job, sq> at idx, with now and then a wrong count or
// fan-in (resends only), ECN, a worker's overflow flag or float32 values.
func randomData(r *rand.Rand, p int, job, sq, idx uint32, w, fan uint8, resend bool) (frame, string) {
	n := modelCount(job, sq)
	// Wrong counts and fan-ins only in resends: a first packet with them would reserve the slot
	// with its count and fan-in, and every correct contribution after it would be dropped as
	// malformed, wedging the fragment for good (see the report) and the walk with it.
	if resend && r.IntN(10) == 0 {
		n = 1 + r.IntN(12)
	}
	if resend && r.IntN(10) == 0 {
		fan = uint8(1 + r.IntN(4))
	}
	big := r.IntN(25) == 0 // magnitudes whose sums overflow int32
	vals := mkVals(n, func(int) int32 {
		if big {
			return int32(r.Uint32())
		}
		return int32(r.IntN(2_000_001) - 1_000_000)
	})
	f := dataFrame(job, sq, idx, w, fan, vals...)
	f.Hdr.ScaleLog2 = uint8(16 + job)
	if resend {
		f.Hdr.Flags |= fResend
	}
	if r.IntN(20) == 0 {
		f.Hdr.Flags |= fECN
	}
	if r.IntN(100) == 0 {
		f.Hdr.Flags |= fOverflow
	}
	if r.IntN(60) == 0 {
		f.Hdr.Encoding = encFloat32
	}
	return f, fmt.Sprintf("#%d job %d seq %d idx %d worker %d fan %d count %d flags %#x enc %d",
		p, job, sq, idx, w, fan, n, f.Hdr.Flags, f.Hdr.Encoding)
}

func joinLines(l []string) string {
	out := ""
	for i, s := range l {
		if i > 0 {
			out += "\n\t"
		}
		out += s
	}
	return out
}

// modelConfig is the switch the model runs against: the model's pool, no timeouts (the model has
// no clock), no source validation (Program.Run's ingress is the loopback device) and a control
// budget no sequence can exhaust (the model does not rate control messages).
func modelConfig() loader.Config {
	return loader.Config{PoolSize: modelPool, SlotTimeout: time.Hour, NoSourceCheck: true,
		ControlRate: 1e9, ControlBurst: 1e9}
}
