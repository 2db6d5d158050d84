package controller

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/mgmt"
)

// fakeSwitch is a switch's management channel as the controller sees it: it records the calls,
// keeps admitted jobs and restored members, and fails calls while broken.
type fakeSwitch struct {
	name    string
	mu      sync.Mutex
	calls   []string
	jobs    map[uint32]mgmt.Job
	members []mgmt.Member
	slots   []mgmt.Slot
	restore []*mgmt.Snapshot
	syncs   []mgmt.SyncRequest
	broken  error
	// failRestore fails Restore only (the other calls work).
	failRestore error
	drained     bool
	rec         func(string) // the pair's log of every switch's calls, in order
}

func (f *fakeSwitch) do(call string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, call)
	if f.rec != nil {
		f.rec(f.name + " " + call)
	}
	return f.broken
}

func (f *fakeSwitch) Admit(_ context.Context, j mgmt.Job) error {
	if err := f.do(fmt.Sprintf("admit %d", j.ID)); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.jobs == nil {
		f.jobs = map[uint32]mgmt.Job{}
	}
	f.jobs[j.ID] = j
	return nil
}

func (f *fakeSwitch) Remove(_ context.Context, id uint32) error {
	return f.do(fmt.Sprintf("remove %d", id))
}
func (f *fakeSwitch) Reset(_ context.Context, id uint32) error {
	return f.do(fmt.Sprintf("reset %d", id))
}

func (f *fakeSwitch) Snapshot(_ context.Context, s mgmt.Scope) (*mgmt.Snapshot, error) {
	if err := f.do(fmt.Sprintf("snapshot %d", s)); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	snap := &mgmt.Snapshot{Switch: f.name, Taken: time.Now(), Scope: s, Members: slices.Clone(f.members), Draining: f.drained}
	for _, j := range f.jobs {
		snap.Jobs = append(snap.Jobs, j)
	}
	if s == mgmt.ScopeAll {
		snap.Slots = slices.Clone(f.slots)
	}
	return snap, nil
}

func (f *fakeSwitch) Restore(_ context.Context, s *mgmt.Snapshot) (mgmt.RestoreStats, error) {
	if err := f.do("restore"); err != nil {
		return mgmt.RestoreStats{}, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failRestore != nil {
		return mgmt.RestoreStats{}, f.failRestore
	}
	f.restore = append(f.restore, s)
	f.members = append(f.members, s.Members...)
	return mgmt.RestoreStats{Jobs: len(s.Jobs), Members: len(s.Members), Slots: len(s.Slots)}, nil
}

// Sync makes the fake's members of the snapshot's jobs the snapshot's, and forgets the jobs gone.
func (f *fakeSwitch) Sync(_ context.Context, r mgmt.SyncRequest) (mgmt.RestoreStats, error) {
	if err := f.do("sync"); err != nil {
		return mgmt.RestoreStats{}, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.syncs = append(f.syncs, r)
	in := func(job uint32) bool {
		return slices.ContainsFunc(r.Snapshot.Jobs, func(j mgmt.Job) bool { return j.ID == job }) || slices.Contains(r.Gone, job)
	}
	f.members = slices.DeleteFunc(f.members, func(m mgmt.Member) bool { return in(m.Job) })
	f.members = append(f.members, r.Snapshot.Members...)
	for _, id := range r.Gone {
		delete(f.jobs, id)
	}
	return mgmt.RestoreStats{Jobs: len(r.Snapshot.Jobs), Members: len(r.Snapshot.Members), Removed: len(r.Gone)}, nil
}

// lastSync is the last mirror onto the fake (nil: none).
func (f *fakeSwitch) lastSync() *mgmt.SyncRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.syncs) == 0 {
		return nil
	}
	r := f.syncs[len(f.syncs)-1]
	return &r
}

// callLog is a copy of the calls so far.
func (f *fakeSwitch) callLog() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.calls)
}

func (f *fakeSwitch) Drain(context.Context) error {
	if err := f.do("drain"); err != nil {
		return err
	}
	f.mu.Lock()
	f.drained = true
	f.mu.Unlock()
	return nil
}

func (f *fakeSwitch) called(prefix string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, c := range f.calls {
		if strings.HasPrefix(c, prefix) {
			n++
		}
	}
	return n
}

func (f *fakeSwitch) setBroken(err error) {
	f.mu.Lock()
	f.broken = err
	f.mu.Unlock()
}

// pair is one group of two fake switches with fake heartbeat answerers.
type pair struct {
	cfg              *Config
	agents           map[string]*fakeAgent
	switches         map[string]*fakeSwitch
	dir              string
	failovers        chan Failover
	primary, standby string
	logMu            sync.Mutex
	log              []string // "<switch> <call>" of both switches, in order
}

// calls is a copy of the pair's log.
func (p *pair) calls() []string {
	p.logMu.Lock()
	defer p.logMu.Unlock()
	return slices.Clone(p.log)
}

func newPair(t *testing.T, deg DegradePolicy) *pair {
	t.Helper()
	p := &pair{agents: map[string]*fakeAgent{}, switches: map[string]*fakeSwitch{}, dir: t.TempDir(),
		failovers: make(chan Failover, 16), primary: "sw-a", standby: "sw-b"}
	sc := func(name string) SwitchConfig {
		key, _ := ctlauth.NewKey()
		a := newFakeAgent(t, key)
		p.agents[name] = a
		p.switches[name] = &fakeSwitch{name: name, rec: func(c string) {
			p.logMu.Lock()
			p.log = append(p.log, c)
			p.logMu.Unlock()
		}}
		return SwitchConfig{Name: name, Mgmt: netip.MustParseAddrPort("127.0.0.1:1"), Heartbeat: a.addr(), key: key}
	}
	p.cfg = &Config{
		Groups:    []GroupConfig{{Name: "g", Primary: sc(p.primary), Standby: sc(p.standby)}},
		Jobs:      []JobConfig{{ID: 7, Workers: 2, PS: netip.MustParseAddrPort("10.0.0.9:9500"), PSPort: "p2", Group: "g"}},
		Heartbeat: HeartbeatConfig{Interval: Duration(20 * time.Millisecond), FailAfter: 10}, // 200 ms: a loaded machine's hiccup is no failure
		Degrade:   deg,
	}
	return p
}

// start runs a controller over the pair until the test ends (or stop is called).
func (p *pair) start(t *testing.T) (c *Controller, stop func()) {
	t.Helper()
	c, err := New(p.cfg, p.dir, Options{Local: netip.MustParseAddrPort("127.0.0.1:0"), ReplicaEvery: 50 * time.Millisecond,
		OpTimeout: time.Second, Dial: func(s SwitchConfig) (Switch, error) { return p.switches[s.Name], nil },
		OnFailover: func(f Failover) { p.failovers <- f }})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Run: %v", err)
			}
			c.Close()
		})
	}
	t.Cleanup(stop)
	return c, stop
}

func eventually(t *testing.T, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("never: %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (p *pair) state(t *testing.T) *State {
	t.Helper()
	st, err := loadState(p.dir)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func (p *pair) failover(t *testing.T) Failover {
	t.Helper()
	select {
	case f := <-p.failovers:
		return f
	case <-time.After(10 * time.Second):
		t.Fatal("no failover")
	}
	return Failover{}
}

// waitReplica waits for a replica of the active switch with members members.
func (p *pair) waitReplica(t *testing.T, members int) {
	t.Helper()
	eventually(t, "replica", func() bool {
		gs := p.state(t).Groups["g"]
		return gs.Replica != nil && len(gs.Replica.Members) == members
	})
}

// kill makes a switch stop answering heartbeats and management calls.
func (p *pair) kill(name string) {
	p.agents[name].silent.Store(true)
	p.switches[name].setBroken(errors.New("connection refused"))
}

var twoMembers = []mgmt.Member{{Job: 7, Worker: 0, Port: "p0"}, {Job: 7, Worker: 1, Port: "p1"}}

// TestAdmitAndReplicate: the controller makes the job's key, writes it 0600 for the hosts, admits
// the job on both switches with that key, and keeps the active switch's control snapshot in its
// state directory; the status file shows the group without keys.
func TestAdmitAndReplicate(t *testing.T) {
	p := newPair(t, DegradePolicy{})
	p.switches[p.primary].members = twoMembers
	p.start(t)
	a, b := p.switches[p.primary], p.switches[p.standby]
	eventually(t, "job admitted on both switches", func() bool { return a.called("admit 7") == 1 && b.called("admit 7") == 1 })
	eventually(t, "replica with the members", func() bool {
		gs := p.state(t).Groups["g"]
		return gs.Replica != nil && len(gs.Replica.Members) == 2
	})
	st := p.state(t)
	key := st.Jobs[7].Key
	if !slices.Equal(a.jobs[7].Key, key) || !slices.Equal(b.jobs[7].Key, key) || len(key) != ctlauth.KeySize {
		t.Errorf("keys: primary %x standby %x state %x", a.jobs[7].Key, b.jobs[7].Key, key)
	}
	kf := filepath.Join(p.dir, KeysDir, "job-7.key")
	fi, err := os.Stat(kf)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("key file %s: %v %v", kf, fi, err)
	}
	if b, _ := os.ReadFile(kf); strings.TrimSpace(string(b)) != ctlauth.FormatKey(key) {
		t.Errorf("key file holds %q", b)
	}
	if fi, _ := os.Stat(filepath.Join(p.dir, StateFile)); fi.Mode().Perm() != 0o600 {
		t.Errorf("state file mode %v", fi.Mode().Perm())
	}
	if b.called("snapshot") != 0 || b.called("restore") != 0 || a.called("drain") != 0 {
		t.Errorf("calls without a failover: primary %v standby %v", a.calls, b.calls)
	}
	var v View
	eventually(t, "status file", func() bool {
		raw, err := os.ReadFile(filepath.Join(p.dir, StatusFile))
		return err == nil && json.Unmarshal(raw, &v) == nil && len(v.Groups) == 1 && len(v.Groups[0].Members) == 2
	})
	raw, _ := os.ReadFile(filepath.Join(p.dir, StatusFile))
	if strings.Contains(string(raw), ctlauth.FormatKey(key)) || strings.Contains(string(raw), `"key"`) {
		t.Error("the status file holds a job key")
	}
	if g := v.Groups[0]; g.Active != p.primary || !g.Armed || len(v.Jobs) != 1 || !v.Jobs[0].Admitted[p.standby] {
		t.Errorf("view %+v", v)
	}
}

// TestFailoverOnFailure: the active switch stops answering heartbeats; the controller restores
// the replica (jobs, members) on the standby without trying to drain a dead switch, records the
// failover, and never moves the group back automatically, even when the old primary answers
// again and the standby dies.
func TestFailoverOnFailure(t *testing.T) {
	p := newPair(t, DegradePolicy{})
	a, b := p.switches[p.primary], p.switches[p.standby]
	a.members = twoMembers
	c, _ := p.start(t)
	p.waitReplica(t, 2)
	p.kill(p.primary)
	f := p.failover(t)
	if f.Reason != ReasonFailed || f.From != p.primary || f.To != p.standby || f.Source != "replica" || f.Error != "" ||
		f.Migrated.Members != 2 || f.Migrated.Jobs != 1 {
		t.Errorf("failover %+v", f)
	}
	if a.called("drain") != 0 {
		t.Error("the controller drained a failed switch")
	}
	if len(b.restore) != 1 || len(b.restore[0].Members) != 2 {
		t.Fatalf("standby restores %v", b.restore)
	}
	gs := p.state(t).Groups["g"]
	if gs.Active != p.standby || gs.Armed || gs.Failovers[ReasonFailed] != 1 || gs.LastFailover == nil {
		t.Errorf("group after the failover %+v", gs)
	}
	// Back on the old primary? Never automatically.
	p.agents[p.primary].silent.Store(false)
	a.setBroken(nil)
	p.agents[p.standby].silent.Store(true)
	eventually(t, "standby failed, primary healthy", func() bool {
		st := c.Monitor().Status()
		return st[0].State == StateHealthy && st[1].State == StateFailed
	})
	time.Sleep(200 * time.Millisecond) // ten rounds of the controller's loop
	select {
	case f := <-p.failovers:
		t.Errorf("failed back automatically: %+v", f)
	default:
	}
}

// TestThresholdThroughFailover: a job configured with H 2 is admitted with it on both switches;
// its binding moves H to 1 on the primary (MSG_SETH), the replica and the view follow, and a
// failover restores H 1 on the standby.
func TestThresholdThroughFailover(t *testing.T) {
	p := newPair(t, DegradePolicy{})
	p.cfg.Jobs[0].Workers, p.cfg.Jobs[0].Threshold = 3, 2
	a, b := p.switches[p.primary], p.switches[p.standby]
	a.members = twoMembers
	c, _ := p.start(t)
	eventually(t, "job admitted on both switches", func() bool { return a.called("admit 7") == 1 && b.called("admit 7") == 1 })
	for _, sw := range []*fakeSwitch{a, b} {
		sw.mu.Lock()
		h := sw.jobs[7].Threshold
		sw.mu.Unlock()
		if h != 2 {
			t.Errorf("%s admitted job 7 with H %d, want 2", sw.name, h)
		}
	}
	a.mu.Lock()
	j := a.jobs[7]
	j.Threshold = 1 // the job's binding sent SETH 1 to the primary
	a.jobs[7] = j
	a.mu.Unlock()
	eventually(t, "the view shows H 1", func() bool {
		v := c.View()
		return len(v.Jobs) == 1 && v.Jobs[0].ThresholdNow != nil && *v.Jobs[0].ThresholdNow == 1 && v.Jobs[0].Threshold == 2
	})
	p.kill(p.primary)
	if f := p.failover(t); f.Error != "" || f.Source != "replica" {
		t.Fatalf("failover %+v", f)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.restore) != 1 || len(b.restore[0].Jobs) != 1 || b.restore[0].Jobs[0].Threshold != 1 {
		t.Errorf("standby restores %+v: want job 7 with H 1", b.restore)
	}
}

// TestFailoverOnDegradation: the active switch answers but its workers resend more than the
// policy allows over its window: the controller drains it, reads its whole state (ScopeAll) and
// restores that on the standby. A switch below the threshold, or with too few packets, stays.
func TestFailoverOnDegradation(t *testing.T) {
	p := newPair(t, DegradePolicy{MaxResendShare: 0.2, MinPackets: 100, Heartbeats: 3})
	a, b := p.switches[p.primary], p.switches[p.standby]
	a.members, a.slots = twoMembers, []mgmt.Slot{{Index: 3}, {Index: 4}}
	c, _ := p.start(t)
	agent := p.agents[p.primary]
	var st bpf.XdpaggHeartbeatStats
	grow := func(agg, resends uint64, beats int) {
		for range beats {
			st.Aggregated += agg
			st.ShadowTx += resends / 2
			st.CacheHits += resends - resends/2
			agent.set(st)
			time.Sleep(25 * time.Millisecond)
		}
	}
	grow(1000, 100, 8) // 10%: healthy
	grow(10, 10, 8)    // 100%, but 20 packets per heartbeat: too few to judge
	select {
	case f := <-p.failovers:
		t.Fatalf("failover below the policy: %+v", f)
	default:
	}
	go grow(1000, 500, 40)
	f := p.failover(t)
	if f.Reason != ReasonDegraded || f.Source != "drained" || f.Migrated.Slots != 2 || f.Error != "" || !strings.Contains(f.Detail, "resends") {
		t.Errorf("failover %+v", f)
	}
	if a.called("drain") != 1 || a.called(fmt.Sprintf("snapshot %d", mgmt.ScopeAll)) != 1 {
		t.Errorf("primary calls %v", a.calls)
	}
	if len(b.restore) != 1 || !b.restore[0].Draining || b.restore[0].Scope != mgmt.ScopeAll {
		t.Errorf("standby restored %+v", b.restore)
	}
	t.Logf("degraded failover: %s; drain %v, snapshot %v, restore %v, total %v", f.Detail, f.Drain, f.Snapshot, f.Restore, f.Total)

	// Prometheus: the failover by reason, the active switch, the migrated entries.
	got := metrics(t, c)
	for k, want := range map[string]float64{
		"xdpagg_controller_failovers_total,g,degraded": 1, "xdpagg_controller_failovers_total,g,failed": 0,
		"xdpagg_controller_active_switch,g,sw-b": 1, "xdpagg_controller_active_switch,g,sw-a": 0,
		"xdpagg_controller_migrated_entries,g,slots": 2, "xdpagg_controller_migrated_entries,g,members": 2,
	} {
		if v, ok := got[k]; !ok || v != want {
			t.Errorf("%s = %v (present %v), want %v", k, v, ok, want)
		}
	}
	if _, ok := got["xdpagg_controller_migration_seconds,g,total"]; !ok {
		t.Error("no migration seconds")
	}
}

// metrics gathers the controller's collector: "name,label values..." -> value.
func metrics(t *testing.T, c *Controller) map[string]float64 {
	t.Helper()
	reg := prometheus.NewRegistry()
	reg.MustRegister(NewControllerCollector(c))
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			name := mf.GetName()
			for _, l := range m.GetLabel() {
				name += "," + l.GetValue()
			}
			got[name] = m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return got
}

// TestFailoverOnSlowAnswers: with MaxRTT set, an active switch whose agent answers every
// heartbeat of the window late (but in time: it is not missed) is degraded and drained.
func TestFailoverOnSlowAnswers(t *testing.T) {
	p := newPair(t, DegradePolicy{Heartbeats: 3, MaxRTT: Duration(2 * time.Millisecond)})
	p.agents[p.primary].delay.Store(int64(6 * time.Millisecond)) // under the 20 ms interval
	p.switches[p.primary].members = twoMembers
	p.start(t)
	f := p.failover(t)
	if f.Reason != ReasonDegraded || !strings.Contains(f.Detail, "slower than 2ms") || f.Source != "drained" {
		t.Errorf("failover %+v", f)
	}
}

// TestOperatorFailoverNeedsHealthyTarget: an operator failover towards a switch that does not
// answer heartbeats is refused before anything is drained (a drain would move the hosts to it).
func TestOperatorFailoverNeedsHealthyTarget(t *testing.T) {
	p := newPair(t, DegradePolicy{})
	c, _ := p.start(t)
	p.kill(p.standby)
	eventually(t, "standby failed", func() bool { return c.Monitor().Status()[1].State == StateFailed })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if r, err := Ask(ctx, p.dir, Request{Op: "failover", Group: "g"}); err == nil || !strings.Contains(r.Error, "not healthy") {
		t.Errorf("failover to a dead standby: %+v %v", r, err)
	}
	if n := p.switches[p.primary].called("drain"); n != 0 {
		t.Errorf("the primary was drained %d times", n)
	}
}

// TestFailoverRetriedAfterDrain: a degraded failover drains the primary (the hosts move) but the
// standby's restore fails; the controller retries it every round until it completes, though the
// drained primary no longer looks degraded.
func TestFailoverRetriedAfterDrain(t *testing.T) {
	p := newPair(t, DegradePolicy{MaxResendShare: 0.2, MinPackets: 100, Heartbeats: 3})
	a, b := p.switches[p.primary], p.switches[p.standby]
	a.members = twoMembers
	p.start(t)
	eventually(t, "job admitted on the standby", func() bool { return p.state(t).Jobs[7].Admitted[p.standby] })
	b.mu.Lock()
	b.failRestore = errors.New("restore: disk on fire")
	b.mu.Unlock()
	var st bpf.XdpaggHeartbeatStats
	for range 8 { // resends at half the aggregated DATA, then nothing more
		st.Aggregated += 1000
		st.Duplicate += 500
		p.agents[p.primary].set(st)
		time.Sleep(25 * time.Millisecond)
	}
	f := p.failover(t)
	if f.Error == "" || f.Reason != ReasonDegraded {
		t.Fatalf("first attempt %+v", f)
	}
	if gs := p.state(t).Groups["g"]; gs.Pending != ReasonDegraded || gs.Active != p.primary {
		t.Errorf("after the failed attempt: %+v", gs)
	}
	b.mu.Lock()
	b.failRestore = nil
	b.mu.Unlock()
	for f.Error != "" {
		f = p.failover(t)
	}
	if f.Reason != ReasonDegraded || f.To != p.standby || f.Source != "drained" {
		t.Errorf("completed failover %+v", f)
	}
	if gs := p.state(t).Groups["g"]; gs.Pending != "" || gs.Active != p.standby {
		t.Errorf("after the retry: %+v", gs)
	}
}

// TestHotStandby: every replica of the active switch is mirrored onto the standby (mgmt Sync),
// the first mirror after a reset of the job there; a binding that changed on the active switch
// (a worker rebound on a new UDP port, a LEAVE) is replaced or removed on the standby, and a job
// the active switch no longer has is removed there.
func TestHotStandby(t *testing.T) {
	p := newPair(t, DegradePolicy{})
	a, b := p.switches[p.primary], p.switches[p.standby]
	w0 := mgmt.Member{Job: 7, Worker: 0, Port: "p0", Addr: netip.MustParseAddrPort("10.0.0.1:9000")}
	w1 := mgmt.Member{Job: 7, Worker: 1, Port: "p1", Addr: netip.MustParseAddrPort("10.0.0.2:9000")}
	a.members = []mgmt.Member{w0, w1}
	c, _ := p.start(t)
	members := func(f *fakeSwitch) []mgmt.Member {
		f.mu.Lock()
		defer f.mu.Unlock()
		return slices.Clone(f.members)
	}
	eventually(t, "three mirrors onto the standby", func() bool { return b.called("sync") >= 3 })
	if m := members(b); !slices.EqualFunc(m, []mgmt.Member{w0, w1}, func(x, y mgmt.Member) bool { return x.Addr == y.Addr && x.Worker == y.Worker }) {
		t.Errorf("standby members %v", m)
	}
	// One reset of the job on the standby, before its first mirror; none after.
	log := b.callLog()
	if first := slices.Index(log, "sync"); b.called("reset 7") != 1 || first < 0 || slices.Index(log, "reset 7") > first {
		t.Errorf("standby calls %v: want one reset 7 before the first sync", log)
	}
	// The first mirror after the reset replaces bindings workers made there by JOIN; the others
	// leave those alone.
	b.mu.Lock()
	for i, r := range b.syncs {
		if r.Force != (i == 0) {
			t.Errorf("mirror %d: force %v", i, r.Force)
		}
	}
	b.mu.Unlock()
	// A mirror for every replica read (the last one may be between its two calls).
	if r, m := a.called("snapshot 0"), b.called("sync"); m < r-1 || m > r {
		t.Errorf("%d replicas, %d mirrors", r, m)
	}
	if v := c.View(); !v.Groups[0].Hot || v.Groups[0].Mirrored.IsZero() {
		t.Errorf("view: hot %v mirrored %v", v.Groups[0].Hot, v.Groups[0].Mirrored)
	}
	if v := metrics(t, c)["xdpagg_controller_standby_hot,g"]; v != 1 {
		t.Errorf("xdpagg_controller_standby_hot{group=g} = %v, want 1", v)
	}
	for _, f := range []*fakeSwitch{a, b} {
		if f.called("restore") != 0 || f.called("drain") != 0 {
			t.Errorf("%s: restore or drain without a failover: %v", f.name, f.callLog())
		}
	}

	// Worker 1 restarts on a new UDP port (it joins the primary again), worker 0 leaves.
	w1b := w1
	w1b.Addr = netip.MustParseAddrPort("10.0.0.2:9001")
	a.mu.Lock()
	a.members = []mgmt.Member{w1b}
	a.mu.Unlock()
	eventually(t, "the standby holding the new binding only", func() bool {
		m := members(b)
		return len(m) == 1 && m[0].Worker == 1 && m[0].Addr == w1b.Addr
	})

	// The job is removed on the primary (`xdpagg job rm` there): the standby follows.
	a.mu.Lock()
	delete(a.jobs, 7)
	a.members = nil
	a.mu.Unlock()
	eventually(t, "job 7 gone from the standby", func() bool {
		r := b.lastSync()
		b.mu.Lock()
		_, has := b.jobs[7]
		b.mu.Unlock()
		return r != nil && slices.Equal(r.Gone, []uint32{7}) && !has
	})
}

// TestMirrorOnlyFromActive: once the active switch misses a heartbeat its replica is no longer
// read or mirrored (its hosts may be on the standby, binding there what no stale snapshot may
// overwrite); the failover onto the hot standby does not reset it (it aggregates the job's live
// traffic) and restores the replica there (adding, never replacing a binding); after it, the
// new active switch is mirrored onto the old one when that answers again, never the other way.
func TestMirrorOnlyFromActive(t *testing.T) {
	p := newPair(t, DegradePolicy{})
	a, b := p.switches[p.primary], p.switches[p.standby]
	a.members = twoMembers
	c, _ := p.start(t)
	eventually(t, "a mirror with the members", func() bool { r := b.lastSync(); return r != nil && len(r.Snapshot.Members) == 2 })
	// The primary stops answering heartbeats; its management channel still answers (a stale
	// snapshot could be read from it).
	p.agents[p.primary].silent.Store(true)
	var since time.Time
	eventually(t, "primary not healthy", func() bool {
		st := c.Monitor().Status()[0]
		since = st.Since
		return st.State != StateHealthy
	})
	// Every round that started before the change has ended once a status file of after it exists.
	eventually(t, "a round after the change", func() bool {
		var v View
		raw, err := os.ReadFile(filepath.Join(p.dir, StatusFile))
		return err == nil && json.Unmarshal(raw, &v) == nil && v.Time.After(since)
	})
	syncs, resets := b.called("sync"), b.called("reset 7")
	a.setBroken(errors.New("connection refused")) // now dead for the failover too
	f := p.failover(t)
	if f.Reason != ReasonFailed || f.Source != "replica" || !f.Hot || f.Error != "" || f.Migrated.Members != 2 {
		t.Errorf("failover %+v", f)
	}
	if n := b.called("sync"); n != syncs {
		t.Errorf("%d mirrors onto the standby after the primary missed a heartbeat", n-syncs)
	}
	if n := b.called("reset 7"); n != resets {
		t.Errorf("the hot standby was reset by the failover: %v", b.callLog())
	}
	if b.called("restore") != 1 {
		t.Errorf("no last restore on the standby: %v", b.callLog())
	}
	// The old primary answers again: the standby (now active) is mirrored onto it, after a reset
	// of the job there (what it holds is from its time as the active switch).
	p.agents[p.primary].silent.Store(false)
	a.setBroken(nil)
	eventually(t, "a mirror onto the old primary", func() bool { r := a.lastSync(); return r != nil && r.Snapshot.Switch == p.standby })
	log := a.callLog()
	if i, j := slices.Index(log, "reset 7"), slices.Index(log, "sync"); i < 0 || i > j {
		t.Errorf("old primary calls %v: want a reset before the first sync", log)
	}
	time.Sleep(200 * time.Millisecond) // four replica periods
	if n := b.called("sync"); n != syncs {
		t.Errorf("the active switch was mirrored onto: %d syncs", n-syncs)
	}
}

// TestOperatorFailover: `xdpagg failover` through the operator socket drains and moves the
// group, then moves it back (an operator failover re-arms the group); a drain that fails falls
// back to the replica; requests for unknown groups, unknown ops and garbage are refused; the
// socket is the owner's only.
func TestOperatorFailover(t *testing.T) {
	p := newPair(t, DegradePolicy{})
	a, b := p.switches[p.primary], p.switches[p.standby]
	a.members = twoMembers
	p.start(t)
	p.waitReplica(t, 2)
	eventually(t, "standby healthy", func() bool { return len(p.agents) == 2 && p.state(t).Jobs[7].Admitted[p.standby] })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if fi, err := os.Stat(filepath.Join(p.dir, SocketFile)); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("socket %v %v", fi, err)
	}
	r, err := Ask(ctx, p.dir, Request{Op: "failover", Group: "g"})
	if err != nil || r.Failover == nil || r.Failover.Source != "drained" || r.Failover.To != p.standby {
		t.Fatalf("failover: %+v %v", r.Failover, err)
	}
	<-p.failovers
	// The hot standby was cooled (its members unbound) before the primary was drained, so the
	// drained slots apply to a switch that aggregated nothing meanwhile.
	log := p.calls()
	drain := slices.Index(log, "sw-a drain")
	k := 0 // syncs onto the standby before the drain; the last of them cooled it
	for _, c := range log[:max(drain, 0)] {
		if c == "sw-b sync" {
			k++
		}
	}
	if drain < 0 || k == 0 || len(b.syncs[k-1].Snapshot.Members) != 0 || len(b.syncs[k-1].Snapshot.Jobs) != 1 || !b.syncs[k-1].Force {
		t.Errorf("the standby was not cooled (a sync without members) right before the drain: %v", log)
	}
	if gs := p.state(t).Groups["g"]; gs.Active != p.standby || !gs.Armed || gs.Failovers[ReasonOperator] != 1 {
		t.Errorf("group %+v", gs)
	}
	// Back, with the standby's drain failing: the replica of the standby is restored instead.
	eventually(t, "replica of the standby", func() bool { gs := p.state(t).Groups["g"]; return gs.Replica != nil && gs.Replica.Switch == p.standby })
	b.setBroken(errors.New("drain: link busy"))
	r, err = Ask(ctx, p.dir, Request{Op: "failover", Group: "g"})
	if err != nil || r.Failover.Source != "replica" || r.Failover.To != p.primary || len(r.Failover.Notes) != 1 {
		t.Fatalf("failover back: %+v %v", r.Failover, err)
	}
	for _, bad := range []Request{{Op: "failover", Group: "nope"}, {Op: "reset", Job: 99}, {Op: "format-disk"}} {
		if _, err := Ask(ctx, p.dir, bad); err == nil {
			t.Errorf("request %+v accepted", bad)
		}
	}
	conn, err := net.Dial("unix", filepath.Join(p.dir, SocketFile))
	if err != nil {
		t.Fatal(err)
	}
	_, _ = conn.Write([]byte("{not json\n"))
	var rep Reply
	_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
	if err := json.NewDecoder(conn).Decode(&rep); err != nil || !strings.Contains(rep.Error, "bad request") {
		t.Errorf("garbage answered %+v %v", rep, err)
	}
	conn.Close()
	b.setBroken(nil)
	// Each drained failover unbinds the members on its target before the drain (a sync without
	// members), and resets the job there before the restore.
	for _, sw := range []*fakeSwitch{a, b} {
		log := sw.callLog()
		restores := 0
		for i, c := range log {
			if c != "restore" {
				continue
			}
			restores++
			if i < 1 || log[i-1] != "reset 7" {
				t.Errorf("%s: a restore not right after a reset: %v", sw.name, log)
			}
		}
		if restores != 1 {
			t.Errorf("%s: %d restores, want 1: %v", sw.name, restores, log)
		}
	}
	ra, rb := a.called("reset 7"), b.called("reset 7")
	if _, err := Ask(ctx, p.dir, Request{Op: "reset", Job: 7}); err != nil || a.called("reset 7") <= ra || b.called("reset 7") <= rb {
		t.Errorf("reset: %v", err)
	}
}

// TestRestart: a controller restarted over its state directory keeps the job's key and does not
// admit again, keeps the group's active switch, and fails over from the reloaded replica even if
// the switch dies before the new controller read it once.
func TestRestart(t *testing.T) {
	p := newPair(t, DegradePolicy{})
	a, b := p.switches[p.primary], p.switches[p.standby]
	a.members = twoMembers
	_, stop := p.start(t)
	p.waitReplica(t, 2)
	key := p.state(t).Jobs[7].Key
	stop()
	// The primary dies while no controller runs: the new one never reads it.
	p.kill(p.primary)
	p.start(t)
	f := p.failover(t)
	if f.Source != "replica" || f.Migrated.Members != 2 || f.Error != "" {
		t.Errorf("failover after the restart %+v", f)
	}
	st := p.state(t)
	if !slices.Equal(st.Jobs[7].Key, key) || b.called("admit 7") != 1 {
		t.Errorf("the restarted controller changed the key or admitted again: %v", b.calls)
	}
	if st.Groups["g"].Active != p.standby {
		t.Errorf("active %s", st.Groups["g"].Active)
	}
}

// TestConfigErrors: configurations the controller refuses.
func TestConfigErrors(t *testing.T) {
	dir := t.TempDir()
	key, _ := ctlauth.NewKey()
	if err := os.WriteFile(filepath.Join(dir, "k"), []byte(ctlauth.FormatKey(key)), 0o600); err != nil {
		t.Fatal(err)
	}
	sw := func(name string) string {
		return fmt.Sprintf(`{"name":%q,"mgmt":"10.0.0.1:9520","heartbeat":"10.0.0.1:9500","key_file":"k"}`, name)
	}
	group := fmt.Sprintf(`{"name":"g","primary":%s,"standby":%s}`, sw("a"), sw("b"))
	job := `{"id":1,"workers":2,"ps":"10.0.0.9:9500","ps_port":"p2","group":"g"}`
	for _, c := range []struct{ name, json string }{
		{"no groups", `{"groups":[],"jobs":[]}`},
		{"unknown field", `{"groups":[` + group + `],"gropus":1}`},
		{"switch twice", fmt.Sprintf(`{"groups":[{"name":"g","primary":%s,"standby":%s}]}`, sw("a"), sw("a"))},
		{"missing key", `{"groups":[{"name":"g","primary":{"name":"a","mgmt":"10.0.0.1:1","heartbeat":"10.0.0.1:2","key_file":"nope"},"standby":` + sw("b") + `}]}`},
		{"job in no group", `{"groups":[` + group + `],"jobs":[{"id":1,"workers":2,"ps":"10.0.0.9:9500","ps_port":"p2","group":"h"}]}`},
		{"job twice", `{"groups":[` + group + `],"jobs":[` + job + `,` + job + `]}`},
		{"threshold above workers", `{"groups":[` + group + `],"jobs":[{"id":1,"workers":2,"threshold":3,"ps":"10.0.0.9:9500","ps_port":"p2","group":"g"}]}`},
		{"sparse job with a threshold", `{"groups":[` + group + `],"jobs":[{"id":1,"workers":2,"threshold":1,"reg_arrays":2,"ps":"10.0.0.9:9500","ps_port":"p2","group":"g"}]}`},
		{"job without PS port", `{"groups":[` + group + `],"jobs":[{"id":1,"workers":2,"ps":"10.0.0.9:9500","group":"g"}]}`},
	} {
		path := filepath.Join(dir, "c.json")
		if err := os.WriteFile(path, []byte(c.json), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := LoadConfig(path); !errors.Is(err, ErrConfig) {
			t.Errorf("%s: %v, want ErrConfig", c.name, err)
		}
	}
	path := filepath.Join(dir, "ok.json")
	if err := os.WriteFile(path, []byte(`{"groups":[`+group+`],"jobs":[`+job+`],"heartbeat":{"interval":"50ms"}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := LoadConfig(path)
	if err != nil || time.Duration(c.Heartbeat.Interval) != 50*time.Millisecond || !slices.Equal(c.Groups[0].Primary.Key(), key) {
		t.Errorf("good config: %+v %v", c, err)
	}
}
