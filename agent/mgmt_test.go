package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net"
	"net/netip"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/internal/bpftest"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/mgmt"
	"github.com/xdpagg/xdpagg/wire"
)

const (
	mgPool   = 16
	mgArrays = 8
	denseJob = 42 // PS behind "p1"
	hotJob   = 43 // sparse, 2 register arrays, PS behind "p2"
	localJob = 44 // the standby's own job
)

// mgSwitch is one loaded switch with its control server, retransmit cache and management handler.
type mgSwitch struct {
	sw     *loader.Switch
	ctrl   *ControlServer
	cache  *ResultCache
	g      *Manager
	ports  []MgmtPort
	downed []int // ports Drain took down
}

// newMgSwitch loads a switch whose ports "p1" and "p2" have ifindexes base and base+1.
func newMgSwitch(t *testing.T, name string, base int) *mgSwitch {
	t.Helper()
	sw := bpftest.LoadSwitch(t, loader.Config{PoolSize: mgPool, RegArrays: mgArrays})
	s := &mgSwitch{sw: sw, ctrl: newControl(t, sw.Maps), cache: NewResultCache(time.Hour, 1024)}
	s.ctrl.SetCache(s.cache)
	s.ports = []MgmtPort{
		{Name: "p1", Ifindex: base, MAC: net.HardwareAddr{2, 0xcc, 0, 0, byte(base), 1}},
		{Name: "p2", Ifindex: base + 1, MAC: net.HardwareAddr{2, 0xcc, 0, 0, byte(base), 2}},
	}
	s.g = NewManager(name, sw.Maps, s.ctrl, s.ports, slog.New(slog.DiscardHandler))
	s.g.setDown = func(ifindex int) error { s.downed = append(s.downed, ifindex); return nil }
	return s
}

func mgKey(t *testing.T) []byte {
	t.Helper()
	k, err := ctlauth.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// testSlot is a slot of job in use: every field set, values a pattern of seed.
func testSlot(job, seq uint32, state bpf.XdpaggSlotState, seed int32) bpf.XdpaggSlot {
	s := bpf.XdpaggSlot{JobId: job, Seq: seq, Bitmap: 0b101, Nvals: 100, State: uint8(state), Counter: 2,
		FanIn: 3, ScaleLog2: 4, Flags: wire.FlagECN}
	for i := range s.Vals {
		s.Vals[i] = seed*int32(i) - 7
	}
	return s
}

func putSlot(t *testing.T, m *maps.Maps, idx uint32, s bpf.XdpaggSlot, age time.Duration) {
	t.Helper()
	now, err := m.DatapathNow()
	if err != nil {
		t.Fatal(err)
	}
	s.TsNs = now - uint64(age)
	if err := m.PutSlotLocked(idx, &s); err != nil {
		t.Fatal(err)
	}
	if err := m.AddHeld(s.JobId, 1); err != nil {
		t.Fatal(err)
	}
}

func resultRec(job, seq uint32, vals ...int32) []byte {
	h := wire.Header{Version: wire.Version, Type: wire.MsgResult, Count: uint16(len(vals)), JobId: job, Seq: seq, Bitmap0: 0b11, FanIn0: 2}
	b := wire.AppendHeader(nil, &h)
	for _, v := range vals {
		b = append(b, byte(v), byte(v>>8), byte(v>>16), byte(v>>24))
	}
	return b
}

// TestSnapshotRestore: the state of one switch (jobs, members, slots, sparse registers and
// records, cached results) read with Snapshot(ScopeAll) and written into another with Restore
// arrives exactly: slot values equal with their ages kept on the other datapath clock, members
// behind the ports of the same names, nothing of the standby's own overwritten.
func TestSnapshotRestore(t *testing.T) {
	a := newMgSwitch(t, "primary", 7)
	b := newMgSwitch(t, "standby", 17)
	ma, mb := a.sw.Maps, b.sw.Maps
	denseKey, hotKey, localKey := mgKey(t), mgKey(t), mgKey(t)
	dense := mgmt.Job{ID: denseJob, Workers: 3, PS: netip.MustParseAddrPort("10.9.0.2:9510"), PSPort: "p1", Key: denseKey}
	hot := mgmt.Job{ID: hotJob, Workers: 2, PS: netip.MustParseAddrPort("10.9.1.2:9511"), PSPort: "p2", MaxSlots: 4, RegArrays: 2, Key: hotKey}
	for _, j := range []mgmt.Job{dense, hot} {
		if err := a.g.Admit(j); err != nil {
			t.Fatalf("Admit(%d): %v", j.ID, err)
		}
	}
	// The dense job's H moves from synchronous to 2 after its admission (as MSG_SETH moves it):
	// the snapshot carries the H of now.
	if err := ma.SetThreshold(denseJob, 2); err != nil {
		t.Fatal(err)
	}
	// Workers 0 and 1 of the dense job behind p1 and p2, worker 0 of the hot job behind p1.
	wmac := net.HardwareAddr{2, 0xbb, 0, 0, 0, 9}
	for _, m := range []maps.Member{
		{JobID: denseJob, WorkerID: 0, Ifindex: 7, Addr: netip.MustParseAddrPort("10.9.0.10:4000"), MAC: wmac, PortMAC: a.ports[0].MAC},
		{JobID: denseJob, WorkerID: 1, Ifindex: 8, Addr: netip.MustParseAddrPort("10.9.2.10:4001"), MAC: wmac, PortMAC: a.ports[1].MAC},
		{JobID: hotJob, WorkerID: 0, Ifindex: 7, Addr: netip.MustParseAddrPort("10.9.0.10:4002"), MAC: wmac, PortMAC: a.ports[0].MAC},
	} {
		if err := ma.PutMember(m); err != nil {
			t.Fatal(err)
		}
	}
	slotsA := map[uint32]bpf.XdpaggSlot{
		1: testSlot(denseJob, 100, bpf.XdpaggSlotStateSLOT_AGGREGATING, 3),
		2: testSlot(denseJob, 101, bpf.XdpaggSlotStateSLOT_COMPLETE, -5),
		5: testSlot(hotJob, 7, bpf.XdpaggSlotStateSLOT_AGGREGATING, 11),
	}
	ages := map[uint32]time.Duration{1: time.Millisecond, 2: 2 * time.Second, 5: 0}
	for idx, s := range slotsA {
		putSlot(t, ma, idx, s, ages[idx])
	}
	hotA, _ := ma.Admission(hotJob)
	var regs [2][2]bpf.XdpaggRegArray
	for p := range uint32(2) {
		for arr := range uint32(2) {
			r := &regs[p][arr]
			for i := range r.Cells {
				r.Cells[i] = uint64(p+1)<<40 | uint64(arr)<<20 | uint64(i)
				r.Hits[i] = uint32(i) ^ p
			}
			if err := ma.PutJobRegisters(hotA, p, arr, r); err != nil {
				t.Fatal(err)
			}
		}
	}
	var rec bpf.XdpaggSparseJob
	rec.It[0].Iter, rec.It[0].Version, rec.It[0].State, rec.It[0].FanIn = 8, 3, 1, 2
	rec.It[0].Npkts[0], rec.It[0].Done[0] = 5, 4
	rec.It[1].Iter, rec.It[1].State = 7, 2
	if err := ma.PutSparseRecords(hotJob, &rec); err != nil {
		t.Fatal(err)
	}
	cached := resultRec(denseJob, 99, 1, -2, 3)
	if err := a.cache.Store(cached, time.Now()); err != nil {
		t.Fatal(err)
	}

	// The standby has a job of its own using slot 2.
	if err := b.g.Admit(mgmt.Job{ID: localJob, Workers: 2, PS: netip.MustParseAddrPort("10.9.3.2:9512"), PSPort: "p1", Key: localKey}); err != nil {
		t.Fatal(err)
	}
	own := testSlot(localJob, 1, bpf.XdpaggSlotStateSLOT_AGGREGATING, 1)
	putSlot(t, mb, 2, own, 0)
	ownNow, _ := mb.SlotLocked(2)

	snap, err := a.g.Snapshot(mgmt.ScopeAll)
	if err != nil {
		t.Fatalf("Snapshot: %v", err)
	}
	if len(snap.Jobs) != 2 || len(snap.Members) != 3 || len(snap.Slots) != 3 || len(snap.Sparse) != 5 || len(snap.Cache) != 1 {
		t.Fatalf("snapshot: %d jobs, %d members, %d slots, %d sparse, %d cached; want 2, 3, 3, 5, 1", len(snap.Jobs), len(snap.Members), len(snap.Slots), len(snap.Sparse), len(snap.Cache))
	}
	for _, j := range snap.Jobs {
		if want := map[uint32]uint8{denseJob: 2, hotJob: 0}[j.ID]; j.Threshold != want {
			t.Errorf("snapshot of job %d: threshold %d, want %d", j.ID, j.Threshold, want)
		}
	}
	for _, s := range snap.Slots {
		if s.Idle < ages[s.Index] {
			t.Errorf("slot %d idle %v, set %v ago", s.Index, s.Idle, ages[s.Index])
		}
	}
	// Through JSON, as on the wire.
	js, err := json.Marshal(snap)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("ScopeAll snapshot of %d slots: %d bytes of JSON", len(snap.Slots), len(js))
	var moved mgmt.Snapshot
	if err := json.Unmarshal(js, &moved); err != nil {
		t.Fatal(err)
	}

	before, _ := mb.DatapathNow()
	st, err := b.g.Restore(&moved)
	if err != nil {
		t.Fatalf("Restore: %v", err)
	}
	after, _ := mb.DatapathNow()
	if want := (mgmt.RestoreStats{Jobs: 2, Members: 3, Slots: 2, Sparse: 5, Cache: 1, Skipped: 1}); st != want {
		t.Errorf("restore stats %+v, want %+v", st, want)
	}

	// Jobs: same parameters, H and keys, PS behind the standby's p1/p2.
	dense.Threshold = 2
	for _, j := range []mgmt.Job{dense, hot} {
		got, err := mb.Admission(j.ID)
		if err != nil {
			t.Fatal(err)
		}
		p, _ := b.g.portByName(j.PSPort)
		if got.PS != j.PS || got.PSIfindex != uint32(p.Ifindex) || got.Workers != j.Workers || got.RegArrays != j.RegArrays || got.Threshold != j.Threshold {
			t.Errorf("job %d on the standby: %+v", j.ID, got)
		}
		if k, _ := mb.JobKey(j.ID); !bytes.Equal(k, j.Key) {
			t.Errorf("job %d key differs", j.ID)
		}
	}
	// Members: behind the ports of the same names, with the standby's port MACs.
	got, err := mb.ListMembers()
	if err != nil {
		t.Fatal(err)
	}
	want := map[[2]uint32]MgmtPort{{denseJob, 0}: b.ports[0], {denseJob, 1}: b.ports[1], {hotJob, 0}: b.ports[0]}
	if len(got) != len(want) {
		t.Errorf("standby members %+v", got)
	}
	for _, m := range got {
		p, ok := want[[2]uint32{m.JobID, uint32(m.WorkerID)}]
		if !ok || m.Ifindex != uint32(p.Ifindex) || !bytes.Equal(m.PortMAC, p.MAC) || !bytes.Equal(m.MAC, wmac) {
			t.Errorf("standby member %+v, want behind %+v", m, p)
		}
		bd, err := mb.Worker(m.JobID, m.WorkerID)
		if err != nil || bd.Ifindex != m.Ifindex || bd.Addr != m.Addr {
			t.Errorf("standby binding of job %d worker %d: %+v, %v", m.JobID, m.WorkerID, bd, err)
		}
	}
	// Slots: values equal, timestamps rebased (the age kept), the standby's own slot untouched.
	for idx, s := range slotsA {
		have, err := mb.SlotLocked(idx)
		if err != nil {
			t.Fatal(err)
		}
		if idx == 2 {
			if have != ownNow {
				t.Errorf("the standby's own slot 2 was overwritten: job %d seq %d", have.JobId, have.Seq)
			}
			continue
		}
		var idle time.Duration
		for _, ms := range moved.Slots {
			if ms.Index == idx {
				idle = ms.Idle
			}
		}
		if ts := have.TsNs + uint64(idle); ts < before || ts > after {
			t.Errorf("slot %d: ts %d + idle %v outside the restore's datapath time [%d, %d]", idx, have.TsNs, idle, before, after)
		}
		have.TsNs, s.TsNs = 0, 0
		if have != s {
			t.Errorf("slot %d differs after the restore", idx)
		}
	}
	for id, n := range map[uint32]int32{denseJob: 1, hotJob: 1, localJob: 1} {
		if j, _ := mb.Admission(id); j.Held != n {
			t.Errorf("job %d holds %d slots on the standby, want %d", id, j.Held, n)
		}
	}
	// Sparse: registers and records equal (the standby's register base may differ).
	hotB, _ := mb.Admission(hotJob)
	for p := range uint32(2) {
		for arr := range uint32(2) {
			r, err := mb.JobRegisters(hotB, p, arr)
			if err != nil {
				t.Fatal(err)
			}
			if r != regs[p][arr] {
				t.Errorf("register array %d parity %d differs", arr, p)
			}
		}
	}
	if r, err := mb.SparseRecords(hotJob); err != nil || r != rec {
		t.Errorf("sparse records on the standby: %+v, %v; want %+v", r, err, rec)
	}
	// The cache answers the standby's RETRANSMITs.
	if pkt, ok := b.cache.Get(denseJob, 99); !ok || !bytes.Equal(pkt, cached) {
		t.Errorf("cached result on the standby: %x, %v; want %x", pkt, ok, cached)
	}

	// Again: idempotent, nothing written twice.
	st, err = b.g.Restore(&moved)
	if err != nil {
		t.Fatalf("second Restore: %v", err)
	}
	if want := (mgmt.RestoreStats{Jobs: 2, Members: 3, Cache: 1, Skipped: 3 + 5}); st != want {
		t.Errorf("second restore %+v, want %+v: no slot or sparse state written twice", st, want)
	}
	for id, n := range map[uint32]int32{denseJob: 1, hotJob: 1} {
		if j, _ := mb.Admission(id); j.Held != n {
			t.Errorf("job %d holds %d slots after a second restore, want %d", id, j.Held, n)
		}
	}
}

// TestRestoreRefusals: snapshots that do not fit are refused before anything is written; a job
// the standby has with another key is skipped with everything of it.
func TestRestoreRefusals(t *testing.T) {
	a := newMgSwitch(t, "primary", 7)
	b := newMgSwitch(t, "standby", 17)
	key := mgKey(t)
	j := mgmt.Job{ID: denseJob, Workers: 2, PS: netip.MustParseAddrPort("10.9.0.2:9510"), PSPort: "p1", Key: key}
	if err := a.g.Admit(j); err != nil {
		t.Fatal(err)
	}
	if err := a.sw.Maps.PutMember(maps.Member{JobID: denseJob, WorkerID: 1, Ifindex: 8, Addr: netip.MustParseAddrPort("10.9.0.10:4000"),
		MAC: net.HardwareAddr{2, 0, 0, 0, 0, 1}, PortMAC: a.ports[1].MAC}); err != nil {
		t.Fatal(err)
	}
	putSlot(t, a.sw.Maps, 3, testSlot(denseJob, 1, bpf.XdpaggSlotStateSLOT_AGGREGATING, 2), 0)
	snap, err := a.g.Snapshot(mgmt.ScopeAll)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		edit func(s *mgmt.Snapshot)
	}{
		{"pool size", func(s *mgmt.Snapshot) { s.Pool *= 2 }},
		{"register arrays", func(s *mgmt.Snapshot) { s.Arrays-- }},
		{"PS port name", func(s *mgmt.Snapshot) { s.Jobs[0].PSPort = "eth9" }},
		{"member port name", func(s *mgmt.Snapshot) { s.Members[0].Port = "eth9" }},
		{"threshold above workers", func(s *mgmt.Snapshot) { s.Jobs[0].Threshold = s.Jobs[0].Workers + 1 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := *snap
			s.Jobs = slices.Clone(snap.Jobs)
			s.Members = slices.Clone(snap.Members)
			tc.edit(&s)
			if _, err := b.g.Restore(&s); !errors.Is(err, mgmt.ErrIncompatible) {
				t.Fatalf("Restore: %v, want ErrIncompatible", err)
			}
			if js, _ := b.sw.Maps.ListJobs(); len(js) != 0 {
				t.Errorf("the standby admitted %+v", js)
			}
		})
	}

	// The standby has the job under another key: the job, its member and slot are skipped.
	other := j
	other.Key = mgKey(t)
	if err := b.g.Admit(other); err != nil {
		t.Fatal(err)
	}
	st, err := b.g.Restore(snap)
	if err != nil {
		t.Fatal(err)
	}
	if want := (mgmt.RestoreStats{Skipped: 3}); st != want {
		t.Errorf("restore over another key: %+v, want %+v", st, want)
	}
	if s, _ := b.sw.Maps.SlotLocked(3); s.State != uint8(bpf.XdpaggSlotStateSLOT_FREE) {
		t.Errorf("slot of a job with another key written: %+v", s.JobId)
	}
	if ms, _ := b.sw.Maps.ListMembers(); len(ms) != 0 {
		t.Errorf("members of a job with another key written: %+v", ms)
	}
}

// TestRestoreThreshold: a job admitted on both switches with the controller's H (3, synchronous)
// whose H the primary's binding moved to 1 (MSG_SETH) has H 1 on the standby after a restore of
// the primary's control snapshot (the controller's replica), set in place: the slot the standby
// holds of the job stays counted.
func TestRestoreThreshold(t *testing.T) {
	a := newMgSwitch(t, "primary", 7)
	b := newMgSwitch(t, "standby", 17)
	j := mgmt.Job{ID: denseJob, Workers: 3, PS: netip.MustParseAddrPort("10.9.0.2:9510"), PSPort: "p1", Key: mgKey(t), Threshold: 3}
	for _, s := range []*mgSwitch{a, b} {
		if err := s.g.Admit(j); err != nil {
			t.Fatal(err)
		}
	}
	putSlot(t, b.sw.Maps, 6, testSlot(denseJob, 9, bpf.XdpaggSlotStateSLOT_AGGREGATING, 1), 0)
	if err := a.sw.Maps.SetThreshold(denseJob, 1); err != nil {
		t.Fatal(err)
	}
	snap, err := a.g.Snapshot(mgmt.ScopeControl)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := b.g.Restore(snap); err != nil || st.Jobs != 1 {
		t.Fatalf("Restore: %+v, %v", st, err)
	}
	got, err := b.sw.Maps.Admission(denseJob)
	if err != nil {
		t.Fatal(err)
	}
	if got.Threshold != 1 || got.Held != 1 {
		t.Errorf("standby after the restore: threshold %d, %d slots held; want 1 and 1", got.Threshold, got.Held)
	}
	// Back to synchronous (H 0) the same way.
	if err := a.sw.Maps.SetThreshold(denseJob, 0); err != nil {
		t.Fatal(err)
	}
	if snap, err = a.g.Snapshot(mgmt.ScopeControl); err != nil {
		t.Fatal(err)
	}
	if _, err := b.g.Restore(snap); err != nil {
		t.Fatal(err)
	}
	if got, _ := b.sw.Maps.Admission(denseJob); got.Threshold != 0 || got.Held != 1 {
		t.Errorf("standby after restoring H 0: threshold %d, %d slots held; want 0 and 1", got.Threshold, got.Held)
	}
}

// TestManagerAdmission: Admit is idempotent for the same key and parameters and refuses the
// rest; Remove and Reset take the CLI's and MSG_RESET's paths; Drain takes every port down.
func TestManagerAdmission(t *testing.T) {
	s := newMgSwitch(t, "sw", 7)
	m := s.sw.Maps
	key := mgKey(t)
	j := mgmt.Job{ID: denseJob, Workers: 2, PS: netip.MustParseAddrPort("10.9.0.2:9510"), PSPort: "p2", Key: key}
	if err := s.g.Admit(j); err != nil {
		t.Fatal(err)
	}
	if got, _ := m.Admission(denseJob); got.PSIfindex != 8 || got.MaxSlots != maps.DefaultMaxSlots(mgPool) {
		t.Errorf("admitted %+v: want the PS behind ifindex 8 and the default quota", got)
	}
	if err := s.g.Admit(j); err != nil {
		t.Errorf("admitting again as before: %v", err)
	}
	for name, tc := range map[string]struct {
		edit func(j *mgmt.Job)
		want error
	}{
		"another key":         {func(j *mgmt.Job) { j.Key = mgKey(t) }, mgmt.ErrRefused},
		"other workers":       {func(j *mgmt.Job) { j.Workers = 3 }, mgmt.ErrRefused},
		"another PS port":     {func(j *mgmt.Job) { j.PSPort = "p1" }, mgmt.ErrRefused},
		"unknown PS port":     {func(j *mgmt.Job) { j.PSPort = "eth9" }, mgmt.ErrIncompatible},
		"short key":           {func(j *mgmt.Job) { j.Key = key[:16] }, mgmt.ErrRefused},
		"threshold > workers": {func(j *mgmt.Job) { j.ID = 52; j.Threshold = 3 }, mgmt.ErrRefused},
		"sparse with H":       {func(j *mgmt.Job) { j.ID = 53; j.RegArrays = 1; j.Threshold = 1 }, mgmt.ErrRefused},
		"bad job (no PS)":     {func(j *mgmt.Job) { j.ID = 50; j.PS = netip.AddrPort{} }, mgmt.ErrRefused},
		"too many workers":    {func(j *mgmt.Job) { j.ID = 51; j.Workers = 200 }, mgmt.ErrRefused},
	} {
		jj := j
		tc.edit(&jj)
		if err := s.g.Admit(jj); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", name, err, tc.want)
		}
	}
	if k, _ := m.JobKey(denseJob); !bytes.Equal(k, key) {
		t.Error("the job's key changed")
	}
	// H is run-time state: admitting the job again with another H succeeds and leaves the H it
	// has here (MSG_SETH's); a fresh admission takes the H given.
	if err := m.SetThreshold(denseJob, 1); err != nil {
		t.Fatal(err)
	}
	again := j
	again.Threshold = 2
	if err := s.g.Admit(again); err != nil {
		t.Errorf("admitting again with another threshold: %v", err)
	}
	if got, _ := m.Admission(denseJob); got.Threshold != 1 {
		t.Errorf("threshold after admitting again: %d, want 1 (as set at run time)", got.Threshold)
	}
	async := mgmt.Job{ID: 54, Workers: 3, PS: j.PS, PSPort: "p1", Key: mgKey(t), Threshold: 2}
	if err := s.g.Admit(async); err != nil {
		t.Fatal(err)
	}
	if got, _ := m.Admission(54); got.Threshold != 2 {
		t.Errorf("admitted with H 2: threshold %d", got.Threshold)
	}

	putSlot(t, m, 4, testSlot(denseJob, 1, bpf.XdpaggSlotStateSLOT_COMPLETE, 1), 0)
	if err := s.g.Reset(denseJob); err != nil {
		t.Fatal(err)
	}
	if sl, _ := m.SlotLocked(4); sl.State != uint8(bpf.XdpaggSlotStateSLOT_FREE) {
		t.Error("Reset left the job's slot")
	}
	if _, err := m.Admission(denseJob); err != nil {
		t.Errorf("Reset ended the job: %v", err)
	}
	if err := s.g.Reset(77); !errors.Is(err, mgmt.ErrRefused) {
		t.Errorf("Reset of a job not admitted: %v, want ErrRefused", err)
	}
	if err := s.g.Remove(denseJob); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Admission(denseJob); !errors.Is(err, maps.ErrNoJob) {
		t.Errorf("after Remove: %v", err)
	}
	if err := s.g.Remove(denseJob); err != nil {
		t.Errorf("Remove again: %v", err)
	}

	for range 2 {
		if err := s.g.Drain(); err != nil {
			t.Fatal(err)
		}
	}
	if !reflect.DeepEqual(s.downed, []int{7, 8, 7, 8}) {
		t.Errorf("ports taken down %v, want both, twice", s.downed)
	}
	snap, err := s.g.Snapshot(mgmt.ScopeControl)
	if err != nil || !snap.Draining || snap.Slots != nil {
		t.Errorf("snapshot after Drain: %+v, %v", snap, err)
	}
}

// TestHeartbeatOnManagementInterface: heartbeats are answered on the management interface once
// the agent is told which it is, still only under the controller key; other interfaces stay
// refused.
func TestHeartbeatOnManagementInterface(t *testing.T) {
	ct := newCtlTest(t)
	c := ct.c
	ctl := newWorkerAt(t, "127.0.0.6")
	ctlKey := mgKey(t)
	c.SetControllerKey(ctlKey)
	beat := func(seq uint32, key []byte) []byte {
		return seal(t, key, wire.AppendHeader(nil, &wire.Header{Version: wire.Version, Type: msgHeartbeat, Seq: seq}))
	}
	const mgmtIface = 11
	wantRefused(t, c.handle(beat(1, ctlKey), mgmtIface, ctl.addr), RejectNotAPort, "neither a switch port nor the management interface")
	c.SetHeartbeatInterfaces(false, mgmtIface)
	accept(t, c, beat(2, ctlKey), mgmtIface, ctl.addr)
	wantRefused(t, c.handle(beat(3, ctlKey), notAPort, ctl.addr), RejectNotAPort, "HEARTBEAT")
	wantRefused(t, c.handle(beat(4, mgKey(t)), mgmtIface, ctl.addr), RejectUnauth, "HEARTBEAT")
	c.SetHeartbeatInterfaces(true)
	accept(t, c, beat(5, ctlKey), notAPort, ctl.addr)
}

// TestMgmtEndToEnd: mgmt.Client to the agent's Manager over loopback TCP (listenMgmt, as Run
// serves it): an admission and a snapshot cross the channel, a client under another key is
// dropped and counted in xdpagg_agent_mgmt_dropped_total, every reason exported from zero.
func TestMgmtEndToEnd(t *testing.T) {
	s := newMgSwitch(t, "sw", 7)
	key := mgKey(t)
	srv, ln, err := listenMgmt("127.0.0.1:0", key, s.g, s.ctrl, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, ln) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	if !s.ctrl.hbIfaces[1] {
		t.Errorf("heartbeats not answered on the loopback interface the channel listens on: %v", s.ctrl.hbIfaces)
	}
	addr := ln.Addr().(*net.TCPAddr).AddrPort()
	c, _ := mgmt.Dial(addr, key)
	j := mgmt.Job{ID: denseJob, Workers: 2, PS: netip.MustParseAddrPort("10.9.0.2:9510"), PSPort: "p1", Key: mgKey(t)}
	if err := c.Admit(ctx, j); err != nil {
		t.Fatalf("Admit: %v", err)
	}
	snap, err := c.Snapshot(ctx, mgmt.ScopeAll)
	if err != nil {
		t.Fatalf("Snapshot: %v", err)
	}
	if len(snap.Jobs) != 1 || !bytes.Equal(snap.Jobs[0].Key, j.Key) || snap.Jobs[0].PSPort != "p1" || snap.Pool != mgPool || snap.Arrays != mgArrays {
		t.Errorf("snapshot %+v", snap)
	}
	if err := c.Admit(ctx, mgmt.Job{ID: denseJob, Workers: 2, PS: j.PS, PSPort: "p1", Key: mgKey(t)}); !errors.Is(err, mgmt.ErrRefused) {
		t.Errorf("Admit under another key: %v, want ErrRefused", err)
	}

	bad, _ := mgmt.Dial(addr, mgKey(t))
	if err := bad.Drain(ctx); !errors.Is(err, mgmt.ErrFrame) {
		t.Errorf("Drain under another key: %v, want ErrFrame", err)
	}
	if len(s.downed) != 0 {
		t.Errorf("ports taken down by a client without the key: %v", s.downed)
	}
	got := map[string]float64{}
	for _, se := range gather(t, NewCollector(s.sw.Maps).WithMgmt(srv))["xdpagg_agent_mgmt_dropped_total"] {
		got[se.labels["reason"]] = se.value
	}
	for _, r := range mgmt.BadFrameReasons() {
		want := 0.0
		if r == mgmt.BadFrameAuth {
			want = 1
		}
		if v, ok := got[r]; !ok || v != want {
			t.Errorf("xdpagg_agent_mgmt_dropped_total{reason=%q} = %v (%v), want %v", r, v, ok, want)
		}
	}
}

// TestSnapshotFullPool: a ScopeAll snapshot of a full 4,096-slot pool moves every slot; its size
// stays far under mgmt.MaxFrame. Logs the snapshot's JSON size and the times to read and write it.
func TestSnapshotFullPool(t *testing.T) {
	const pool = 4096
	load := func() (*loader.Switch, *Manager) {
		sw := bpftest.LoadSwitch(t, loader.Config{PoolSize: pool, RegArrays: mgArrays})
		ctrl := newControl(t, sw.Maps)
		return sw, NewManager("sw", sw.Maps, ctrl, []MgmtPort{{Name: "p1", Ifindex: 7, MAC: net.HardwareAddr{2, 0, 0, 0, 0, 7}}}, slog.New(slog.DiscardHandler))
	}
	a, ga := load()
	b, gb := load()
	j := mgmt.Job{ID: denseJob, Workers: 3, PS: netip.MustParseAddrPort("10.9.0.2:9510"), PSPort: "p1", MaxSlots: pool, Key: mgKey(t)}
	if err := ga.Admit(j); err != nil {
		t.Fatal(err)
	}
	now, _ := a.Maps.DatapathNow()
	for i := range uint32(pool) {
		s := testSlot(denseJob, i, bpf.XdpaggSlotStateSLOT_COMPLETE, int32(i))
		s.TsNs = now
		if err := a.Maps.PutSlotLocked(i, &s); err != nil {
			t.Fatal(err)
		}
	}
	start := time.Now()
	snap, err := ga.Snapshot(mgmt.ScopeAll)
	if err != nil {
		t.Fatal(err)
	}
	took := time.Since(start)
	js, err := json.Marshal(snap)
	if err != nil {
		t.Fatal(err)
	}
	if len(snap.Slots) != pool || len(js) > mgmt.MaxFrame/8 {
		t.Fatalf("%d slots in %d bytes", len(snap.Slots), len(js))
	}
	start = time.Now()
	st, err := gb.Restore(snap)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("full pool of %d slots: snapshot read in %v, %.1f MB of JSON; restored in %v", pool, took.Round(time.Millisecond),
		float64(len(js))/1e6, time.Since(start).Round(time.Millisecond))
	// Every slot written and nothing skipped: the other counts as they came.
	if want := (mgmt.RestoreStats{Jobs: st.Jobs, Members: st.Members, Slots: pool, Sparse: st.Sparse, Cache: st.Cache,
		Unbound: st.Unbound, Removed: st.Removed}); st != want {
		t.Errorf("restore %+v, want all %d slots and none skipped", st, pool)
	}
	if jb, _ := b.Maps.Admission(denseJob); jb.Held != pool {
		t.Errorf("job holds %d slots after the restore, want %d", jb.Held, pool)
	}
}

// TestSync: a mirror of the active switch's control snapshot makes the standby's bindings of the
// snapshot's jobs exactly the active switch's: a worker rebound on a new UDP port is replaced
// (its old address may no longer contribute), one that left is unbound, one bound as in the
// snapshot is kept; the standby's slots, and its own job, are untouched; a second sync changes
// nothing. Bindings workers made by JOIN on the standby (their traffic reached it) are left alone
// unless the sync is forced. Sync refuses whatever is not a control snapshot, and a job both
// kept and gone; a job gone from the active switch is removed.
func TestSync(t *testing.T) {
	a := newMgSwitch(t, "primary", 17)
	b := newMgSwitch(t, "standby", 7) // its control server's ports: testPort is its p1, testPort2 its p2
	j := mgmt.Job{ID: denseJob, Workers: 3, PS: netip.MustParseAddrPort("10.9.0.2:9510"), PSPort: "p1", Key: mgKey(t)}
	own := mgmt.Job{ID: localJob, Workers: 2, PS: netip.MustParseAddrPort("10.9.3.2:9512"), PSPort: "p1", Key: mgKey(t)}
	for _, s := range []*mgSwitch{a, b} {
		if err := s.g.Admit(j); err != nil {
			t.Fatal(err)
		}
	}
	if err := b.g.Admit(own); err != nil {
		t.Fatal(err)
	}
	mac := func(i byte) net.HardwareAddr { return net.HardwareAddr{2, 0, 0, 0, 9, i} }
	w0 := netip.MustParseAddrPort("10.9.1.1:7000")
	w1 := netip.MustParseAddrPort("127.0.0.2:7001") // worker 1 restarted on a new port (loopback: the standby ACKs its JOIN below)
	w1old := netip.MustParseAddrPort("127.0.0.2:7000")
	w2 := netip.MustParseAddrPort("10.9.1.3:7000")
	bind := func(s *mgSwitch, job uint32, w uint8, port int, addr netip.AddrPort) {
		t.Helper()
		p := s.ports[port]
		if err := s.sw.Maps.PutMember(maps.Member{JobID: job, WorkerID: w, Ifindex: uint32(p.Ifindex), Addr: addr, MAC: mac(w), PortMAC: p.MAC}); err != nil {
			t.Fatal(err)
		}
	}
	// The primary: workers 0 and 1 (on its new port). The standby, from an older mirror: worker
	// 0 as on the primary, worker 1 on its old port, worker 2 (who left since); its own job's
	// member, and a slot of the job in use.
	bind(a, denseJob, 0, 0, w0)
	bind(a, denseJob, 1, 1, w1)
	bind(b, denseJob, 0, 0, w0)
	bind(b, denseJob, 1, 1, w1old)
	bind(b, denseJob, 2, 0, w2)
	bind(b, localJob, 0, 1, netip.MustParseAddrPort("10.9.4.1:7000"))
	slot := testSlot(denseJob, 9, bpf.XdpaggSlotStateSLOT_AGGREGATING, 3)
	putSlot(t, b.sw.Maps, 5, slot, 0)

	snap, err := a.g.Snapshot(mgmt.ScopeControl)
	if err != nil {
		t.Fatal(err)
	}
	st, err := b.g.Sync(mgmt.SyncRequest{Snapshot: snap})
	if want := (mgmt.RestoreStats{Jobs: 1, Members: 2, Unbound: 2}); err != nil || st != want {
		t.Fatalf("Sync: %+v %v, want %+v", st, err, want)
	}
	type binding struct {
		w    uint8
		port int
		addr netip.AddrPort
	}
	// check checks job's bindings on the standby; those the mirror made have the snapshot's MACs
	// and the standby's port MACs (a JOIN's have its own).
	check := func(what string, job uint32, want []binding) {
		t.Helper()
		for w := range uint8(3) {
			got, err := b.sw.Maps.Worker(job, w)
			i := slices.IndexFunc(want, func(x binding) bool { return x.w == w })
			switch {
			case i < 0 && !errors.Is(err, ebpf.ErrKeyNotExist):
				t.Errorf("%s: job %d worker %d bound at %+v (%v), want unbound", what, job, w, got, err)
			case i >= 0 && (err != nil || got.Addr != want[i].addr || got.Ifindex != uint32(b.ports[want[i].port].Ifindex)):
				t.Errorf("%s: job %d worker %d bound at %+v (%v), want %v behind %s", what, job, w, got, err, want[i].addr, b.ports[want[i].port].Name)
			}
		}
		ms, err := b.sw.Maps.ListMembers()
		if err != nil {
			t.Fatal(err)
		}
		var eg []binding
		for _, m := range ms {
			if m.JobID == job {
				eg = append(eg, binding{m.WorkerID, slices.IndexFunc(b.ports, func(p MgmtPort) bool { return uint32(p.Ifindex) == m.Ifindex }), m.Addr})
				if p := b.ports[eg[len(eg)-1].port]; !b.ctrl.joinedHere(job, m.WorkerID) && (!bytes.Equal(m.PortMAC, p.MAC) || !bytes.Equal(m.MAC, mac(m.WorkerID))) {
					t.Errorf("%s: member %+v: MACs, want port %v", what, m, p.MAC)
				}
			}
		}
		if !slices.Equal(eg, want) {
			t.Errorf("%s: job %d's members %+v, want %+v", what, job, eg, want)
		}
	}
	check("after the sync", denseJob, []binding{{0, 0, w0}, {1, 1, w1}})
	check("the standby's own job", localJob, []binding{{0, 1, netip.MustParseAddrPort("10.9.4.1:7000")}})
	if got, err := b.sw.Maps.SlotLocked(5); err != nil || got.Seq != slot.Seq || got.Vals != slot.Vals {
		t.Errorf("the standby's slot after the sync: %+v %v", got, err)
	}
	if st, err := b.g.Sync(mgmt.SyncRequest{Snapshot: snap}); err != nil || st != (mgmt.RestoreStats{Jobs: 1, Members: 2}) {
		t.Errorf("second Sync: %+v %v", st, err)
	}

	// Worker 1 restarts on a new UDP port and JOINs the standby (the primary's links died; its
	// agent still answers, so the controller still mirrors the primary's older binding).
	w1j := netip.MustParseAddrPort("127.0.0.2:7009")
	if err := b.ctrl.handle(join(t, j.Key, 1, 1), testPort2, w1j); err != nil {
		t.Fatalf("JOIN of worker 1 on the standby: %v", err)
	}
	joined := []binding{{0, 0, w0}, {1, 1, w1j}}
	check("after the JOIN", denseJob, joined)
	if st, err := b.g.Sync(mgmt.SyncRequest{Snapshot: snap}); err != nil || st != (mgmt.RestoreStats{Jobs: 1, Members: 1, Skipped: 1}) {
		t.Errorf("Sync over a joined binding: %+v %v, want worker 0 kept, worker 1 skipped", st, err)
	}
	check("a mirror after the JOIN", denseJob, joined)
	if st, err := b.g.Sync(mgmt.SyncRequest{Snapshot: snap, Force: true}); err != nil || st != (mgmt.RestoreStats{Jobs: 1, Members: 2, Unbound: 1}) {
		t.Errorf("forced Sync: %+v %v, want worker 1 replaced", st, err)
	}
	check("a forced mirror", denseJob, []binding{{0, 0, w0}, {1, 1, w1}})
	if st, err := b.g.Sync(mgmt.SyncRequest{Snapshot: snap}); err != nil || st != (mgmt.RestoreStats{Jobs: 1, Members: 2}) {
		t.Errorf("Sync after the forced one: %+v %v", st, err)
	}

	// Refusals, before anything is written.
	full, err := a.g.Snapshot(mgmt.ScopeAll)
	if err != nil {
		t.Fatal(err)
	}
	withSlot := *snap
	withSlot.Slots = []mgmt.Slot{{Index: 1}}
	badPort := *snap
	badPort.Members = append(slices.Clone(snap.Members), mgmt.Member{Job: denseJob, Worker: 2, Port: "p9", Addr: w2, MAC: mac(2)})
	for what, r := range map[string]mgmt.SyncRequest{
		"a ScopeAll snapshot":          {Snapshot: full},
		"a snapshot with a slot":       {Snapshot: &withSlot},
		"a job kept and gone":          {Snapshot: snap, Gone: []uint32{denseJob}},
		"a member behind no such port": {Snapshot: &badPort},
	} {
		if _, err := b.g.Sync(r); !errors.Is(err, mgmt.ErrRefused) && !errors.Is(err, mgmt.ErrIncompatible) {
			t.Errorf("Sync of %s: %v, want refused", what, err)
		}
	}
	check("after the refusals", denseJob, []binding{{0, 0, w0}, {1, 1, w1}})

	// The job is removed on the primary: the next mirror removes it here; the standby's own job stays.
	if _, err := a.g.maps.RemoveJob(denseJob); err != nil {
		t.Fatal(err)
	}
	if snap, err = a.g.Snapshot(mgmt.ScopeControl); err != nil {
		t.Fatal(err)
	}
	if st, err := b.g.Sync(mgmt.SyncRequest{Snapshot: snap, Gone: []uint32{denseJob}}); err != nil || st.Removed != 1 {
		t.Fatalf("Sync of a gone job: %+v %v", st, err)
	}
	if _, err := b.sw.Maps.Admission(denseJob); !errors.Is(err, maps.ErrNoJob) {
		t.Errorf("job %d still admitted on the standby: %v", denseJob, err)
	}
	check("the standby's own job at the end", localJob, []binding{{0, 1, netip.MustParseAddrPort("10.9.4.1:7000")}})
}
