package controller

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/mgmt"
)

// More sentinels.
var (
	// ErrState: the state directory holds a state file that cannot be read.
	ErrState = errors.New("unreadable controller state")
	// ErrNoGroup: a request names a group or job the controller does not have.
	ErrNoGroup = errors.New("no such group or job")
	// ErrRequest: the controller refused or could not complete an operator's request (a
	// failover that did not complete leaves the group on its active switch).
	ErrRequest = errors.New("controller request failed")
)

// Reasons for a failover.
const (
	ReasonFailed   = "failed"   // the active switch stopped answering heartbeats (Policy)
	ReasonDegraded = "degraded" // its statistics passed the DegradePolicy
	ReasonOperator = "operator" // an operator's request (`xdpagg failover`)
)

// Switch is the controller's side of one switch's management channel; *mgmt.Client is one.
type Switch interface {
	Admit(context.Context, mgmt.Job) error
	Remove(context.Context, uint32) error
	Reset(context.Context, uint32) error
	Snapshot(context.Context, mgmt.Scope) (*mgmt.Snapshot, error)
	Restore(context.Context, *mgmt.Snapshot) (mgmt.RestoreStats, error)
	Sync(context.Context, mgmt.SyncRequest) (mgmt.RestoreStats, error)
	Drain(context.Context) error
}

// Options are a Controller's knobs beyond its Config.
type Options struct {
	// Local is the heartbeat socket's address (port 0: any).
	Local netip.AddrPort
	// Dial makes a switch's management client (default: mgmt.Dial).
	Dial func(SwitchConfig) (Switch, error)
	// ReplicaEvery is the period of the replica's refresh (default 1s); it is also refreshed
	// whenever a heartbeat shows the active switch's member count changed. Every refresh is
	// mirrored onto the group's other switch (mgmt.Client.Sync): the hot standby.
	ReplicaEvery time.Duration
	// OpTimeout bounds each management call (default 5s).
	OpTimeout time.Duration
	// OnChange (a switch's heartbeat state), OnFailover (every failover, completed or not) and
	// OnError (a management call that failed outside a failover), if set, are called from Run's
	// goroutines.
	OnChange   func(Status)
	OnFailover func(Failover)
	OnError    func(error)
}

// Controller owns the jobs of its switch groups: it admits them on both switches of their group,
// heartbeats every switch (Monitor), keeps a replica of each active switch's control state, and
// fails a group over to its standby when the active switch fails or degrades, or when asked.
// Its state lives in a directory (State, status and the operator's socket) so that a restarted
// controller carries on; the jobs never depend on the controller being up.
type Controller struct {
	cfg  *Config
	dir  string
	opt  Options
	mon  *Monitor
	sw   map[string]Switch
	deg  DegradePolicy
	pol  Policy
	reqs chan request

	mu        sync.Mutex
	st        *State
	hist      map[string][]answer  // per switch: the last answers, oldest first
	answered  map[string]uint64    // per switch: Status.Answered when hist last grew
	degraded  map[string]string    // per switch: why it is degraded now ("" not)
	retryAt   map[string]time.Time // per group: no automatic failover before
	replicaAt map[string]time.Time // per group: the last replica refresh tried
	// hot, per group: the standby whose jobs this controller reset (clearing what it held of
	// them from its last time as the active switch) and whose control state it has mirrored
	// from the active switch since, every replica; a group not in it has a standby in an unknown
	// state (never mirrored by this controller, a mirror failed, or a failover since).
	hot map[string]string
}

// New loads the controller's state from dir (made if missing) and binds its heartbeat socket.
func New(cfg *Config, dir string, opt Options) (*Controller, error) {
	if err := cfg.check(); err != nil {
		return nil, err
	}
	if opt.Dial == nil {
		opt.Dial = func(s SwitchConfig) (Switch, error) { return mgmt.Dial(s.Mgmt, s.Key()) }
	}
	if opt.ReplicaEvery == 0 {
		opt.ReplicaEvery = time.Second
	}
	if opt.OpTimeout == 0 {
		opt.OpTimeout = 5 * time.Second
	}
	if err := os.MkdirAll(filepath.Join(dir, KeysDir), 0o700); err != nil {
		return nil, fmt.Errorf("state directory: %w", err)
	}
	st, err := loadState(dir)
	if err != nil {
		return nil, err
	}
	c := &Controller{cfg: cfg, dir: dir, opt: opt, sw: map[string]Switch{}, deg: cfg.Degrade.withDefaults(), st: st,
		reqs: make(chan request), hist: map[string][]answer{}, answered: map[string]uint64{},
		degraded: map[string]string{}, retryAt: map[string]time.Time{}, replicaAt: map[string]time.Time{},
		hot: map[string]string{}}
	var targets []Target
	for _, g := range cfg.Groups {
		gs := st.Groups[g.Name]
		if gs == nil || (gs.Active != g.Primary.Name && gs.Active != g.Standby.Name) {
			gs = &GroupState{Active: g.Primary.Name, Armed: true} // new, or its switches were renamed
			st.Groups[g.Name] = gs
		}
		for _, s := range []SwitchConfig{g.Primary, g.Standby} {
			if c.sw[s.Name], err = opt.Dial(s); err != nil {
				return nil, fmt.Errorf("management client of %s: %w", s.Name, err)
			}
			targets = append(targets, Target{Name: s.Name, Addr: s.Heartbeat, Key: s.Key()})
		}
	}
	for _, j := range cfg.Jobs {
		js := st.Jobs[j.ID]
		if js == nil || len(js.Key) != ctlauth.KeySize {
			key, err := ctlauth.NewKey()
			if err != nil {
				return nil, err
			}
			js = &JobState{Key: key, Admitted: map[string]bool{}}
			st.Jobs[j.ID] = js
		}
		if js.Admitted == nil {
			js.Admitted = map[string]bool{}
		}
		js.KeyFile = j.KeyFile
		if js.KeyFile == "" {
			js.KeyFile = filepath.Join(dir, KeysDir, fmt.Sprintf("job-%d.key", j.ID))
		}
		if err := writeAtomic(js.KeyFile, []byte(ctlauth.FormatKey(js.Key)+"\n"), 0o600); err != nil {
			return nil, fmt.Errorf("job %d key: %w", j.ID, err)
		}
	}
	if err := c.save(); err != nil {
		return nil, err
	}
	h := cfg.Heartbeat
	c.pol = Policy{Interval: time.Duration(h.Interval), SuspectAfter: h.SuspectAfter, FailAfter: h.FailAfter, OnChange: opt.OnChange}.withDefaults()
	if c.mon, err = NewMonitor(opt.Local, targets, c.pol); err != nil {
		return nil, err
	}
	return c, nil
}

// Close closes the heartbeat socket.
func (c *Controller) Close() error { return c.mon.Close() }

// Monitor is the controller's heartbeat monitor (its switches' Status).
func (c *Controller) Monitor() *Monitor { return c.mon }

// save writes the state file; called with mu held or before Run.
func (c *Controller) save() error {
	b, err := json.MarshalIndent(c.st, "", "  ")
	if err != nil {
		return err
	}
	return writeAtomic(filepath.Join(c.dir, StateFile), append(b, '\n'), 0o600)
}

// group returns a group's config.
func (c *Controller) group(name string) (GroupConfig, bool) {
	i := slices.IndexFunc(c.cfg.Groups, func(g GroupConfig) bool { return g.Name == name })
	if i < 0 {
		return GroupConfig{}, false
	}
	return c.cfg.Groups[i], true
}

// statusOf is the status of the switch name among statuses (zero if it is not there).
func statusOf(statuses []Status, name string) Status {
	i := slices.IndexFunc(statuses, func(s Status) bool { return s.Name == name })
	if i < 0 {
		return Status{}
	}
	return statuses[i]
}

// other is the switch of g that is not name.
func other(g GroupConfig, name string) string {
	if name == g.Primary.Name {
		return g.Standby.Name
	}
	return g.Primary.Name
}

func (c *Controller) call(ctx context.Context, fn func(context.Context) error) error {
	return c.callFor(ctx, c.opt.OpTimeout, fn)
}

// callFor is call with its own bound: the calls Run's loop makes every round (admission,
// replicas) are bounded by ReplicaEvery, so a switch that stopped answering cannot hold a
// failover back by more than that.
func (c *Controller) callFor(ctx context.Context, d time.Duration, fn func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, min(d, c.opt.OpTimeout))
	defer cancel()
	return fn(ctx)
}

func (c *Controller) report(err error) {
	if err != nil && c.opt.OnError != nil {
		c.opt.OnError(err)
	}
}

// Run heartbeats the switches, admits the jobs, refreshes the replicas, fails groups over and
// answers operator requests on the state directory's socket, until ctx ends.
func (c *Controller) Run(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ln, err := c.listen()
	if err != nil {
		return err
	}
	defer ln.Close()
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Go(func() { c.serveRequests(ctx, ln) })
	monErr := make(chan error, 1)
	wg.Go(func() { monErr <- c.mon.Run(ctx) })
	tick := time.NewTicker(c.pol.Interval)
	defer tick.Stop()
	for {
		c.step(ctx, time.Now())
		select {
		case <-ctx.Done():
			return nil
		case err := <-monErr:
			return err
		case r := <-c.reqs:
			r.reply <- c.handle(ctx, r.Request)
		case <-tick.C:
		}
	}
}

// step is one round of Run: admissions, degradation, failovers, replicas, status.
func (c *Controller) step(ctx context.Context, now time.Time) {
	statuses := c.mon.Status()
	c.admitAll(ctx, statuses)
	for _, g := range c.cfg.Groups {
		c.mu.Lock()
		gs := c.st.Groups[g.Name]
		active, armed, retry, pending := gs.Active, gs.Armed, c.retryAt[g.Name], gs.Pending
		c.mu.Unlock()
		as, ts := statusOf(statuses, active), statusOf(statuses, other(g, active))
		why := c.observe(as)
		switch {
		case pending != "" && !now.Before(retry) && ts.State == StateHealthy:
			c.failover(ctx, g, pending, "retrying a failover that drained "+active)
			continue
		case !armed || now.Before(retry) || ts.State != StateHealthy:
			// Nowhere to go automatically: keep the group where it is.
		case as.State == StateFailed:
			c.failover(ctx, g, ReasonFailed, as.Reason)
			continue
		case why != "":
			c.failover(ctx, g, ReasonDegraded, why)
			continue
		}
		c.mu.Lock()
		last, replica := c.replicaAt[g.Name], gs.Replica
		c.mu.Unlock()
		changed := replica != nil && as.Answered > 0 && int(as.Stats.Members) != len(replica.Members)
		if as.State == StateHealthy && (now.Sub(last) >= c.opt.ReplicaEvery || changed && now.Sub(last) >= c.pol.Interval) {
			c.replicate(ctx, g, active, now)
		}
	}
	c.writeStatus()
}

// observe takes the active switch's latest heartbeat into its history and returns why it is
// degraded by the DegradePolicy ("" if it is not).
func (c *Controller) observe(s Status) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	if s.Answered == 0 || s.Answered == c.answered[s.Name] {
		return c.degraded[s.Name]
	}
	c.answered[s.Name] = s.Answered
	h := append(c.hist[s.Name], answer{s.Stats, s.RTT})
	if len(h) > c.deg.Heartbeats+1 {
		h = h[len(h)-c.deg.Heartbeats-1:]
	}
	c.hist[s.Name] = h
	c.degraded[s.Name] = ""
	if c.deg.Off || len(h) < c.deg.Heartbeats+1 {
		return ""
	}
	resends, agg := resendEvidence(h[0].stats, h[len(h)-1].stats)
	slow := time.Duration(c.deg.MaxRTT) > 0
	for _, a := range h[1:] {
		slow = slow && a.rtt > time.Duration(c.deg.MaxRTT)
	}
	switch {
	case agg+resends >= c.deg.MinPackets && float64(resends) > c.deg.MaxResendShare*float64(agg):
		c.degraded[s.Name] = fmt.Sprintf("%d resends per %d aggregated DATA over %d heartbeats (limit %.2f)", resends, agg, c.deg.Heartbeats, c.deg.MaxResendShare)
	case slow:
		c.degraded[s.Name] = fmt.Sprintf("%d heartbeats answered slower than %v", c.deg.Heartbeats, time.Duration(c.deg.MaxRTT))
	}
	return c.degraded[s.Name]
}

// answer is one heartbeat answer in a switch's history.
type answer struct {
	stats bpf.XdpaggHeartbeatStats
	rtt   time.Duration
}

// resendEvidence counts, between two heartbeat answers, the workers' resends the switch saw and
// the DATA it aggregated; counters that went back (a switch restarted without its maps) count 0.
func resendEvidence(a, b bpf.XdpaggHeartbeatStats) (resends, agg uint64) {
	d := func(x, y uint64) uint64 {
		if y < x {
			return 0
		}
		return y - x
	}
	resends = d(a.Duplicate, b.Duplicate) + d(a.ShadowTx, b.ShadowTx) + d(a.Flushed, b.Flushed) +
		d(a.CacheHits, b.CacheHits) + d(a.CacheMisses, b.CacheMisses)
	return resends, d(a.Aggregated, b.Aggregated)
}

// admitAll admits every job on every switch of its group where it is not yet admitted, if that
// switch answers heartbeats.
func (c *Controller) admitAll(ctx context.Context, statuses []Status) {
	for _, j := range c.cfg.Jobs {
		g, _ := c.group(j.Group)
		for _, name := range []string{g.Primary.Name, g.Standby.Name} {
			c.mu.Lock()
			js := c.st.Jobs[j.ID]
			done := js.Admitted[name]
			job := c.job(j, js)
			c.mu.Unlock()
			if done || statusOf(statuses, name).State != StateHealthy {
				continue
			}
			err := c.callFor(ctx, c.opt.ReplicaEvery, func(ctx context.Context) error { return c.sw[name].Admit(ctx, job) })
			if err != nil {
				c.report(fmt.Errorf("admit job %d on %s: %w", j.ID, name, err))
				continue
			}
			c.mu.Lock()
			js.Admitted[name] = true
			err = c.save()
			c.mu.Unlock()
			c.report(err)
		}
	}
}

// job is a job's admission; called with mu held.
func (c *Controller) job(j JobConfig, js *JobState) mgmt.Job {
	return mgmt.Job{ID: j.ID, Workers: j.Workers, PS: j.PS, PSPort: j.PSPort, MaxSlots: j.Quota, RegArrays: j.RegArrays, Threshold: j.Threshold, Key: slices.Clone(js.Key)}
}

// replicate refreshes a group's replica from its active switch and mirrors it onto the other.
func (c *Controller) replicate(ctx context.Context, g GroupConfig, active string, now time.Time) {
	c.mu.Lock()
	c.replicaAt[g.Name] = now
	c.mu.Unlock()
	var snap *mgmt.Snapshot
	err := c.callFor(ctx, c.opt.ReplicaEvery, func(ctx context.Context) (err error) {
		snap, err = c.sw[active].Snapshot(ctx, mgmt.ScopeControl)
		return err
	})
	if err != nil {
		c.report(fmt.Errorf("replica of %s: %w", active, err))
		return
	}
	c.mu.Lock()
	if c.st.Groups[g.Name].Active != active {
		c.mu.Unlock()
		return // a failover moved the group meanwhile
	}
	c.st.Groups[g.Name].Replica = snap
	c.report(c.save())
	c.mu.Unlock()
	c.mirror(ctx, g, active, snap)
}

// mirror makes the group's standby hot: its jobs and members equal to snap's, the active
// switch's control snapshot just read, so that it aggregates for the job's members as soon as
// the hosts' traffic reaches it (docs/operations.md). Only the active switch is mirrored, only
// while it answers every heartbeat and its ports are up (not drained), and only onto a standby
// that answers: once the active switch misses a heartbeat its hosts may be on the standby
// already, binding there what no stale snapshot may overwrite. The first mirror onto a standby
// resets the group's jobs there first (what it holds of them is from its last time as the
// active switch; no traffic reaches a standby, so nothing live is cleared), and replaces the
// bindings workers made there by JOIN; later mirrors leave those alone (a worker that joined the
// standby had its traffic reach it: the active switch's links may be dead while its agent still
// answers).
func (c *Controller) mirror(ctx context.Context, g GroupConfig, active string, snap *mgmt.Snapshot) {
	standby := other(g, active)
	statuses := c.mon.Status()
	as, ss := statusOf(statuses, active), statusOf(statuses, standby)
	ok := !snap.Draining && as.State == StateHealthy && as.Misses == 0 && ss.State == StateHealthy
	c.mu.Lock()
	hot := c.hot[g.Name] == standby
	var jobs, gone []uint32
	for _, j := range c.cfg.Jobs {
		if j.Group != g.Name {
			continue
		}
		jobs = append(jobs, j.ID)
		adm := c.st.Jobs[j.ID].Admitted
		// A job admitted on both switches that the active one no longer has was removed there
		// (`xdpagg job rm`): the standby follows. One not admitted on both yet is left alone.
		if adm[active] && adm[standby] && !slices.ContainsFunc(snap.Jobs, func(sj mgmt.Job) bool { return sj.ID == j.ID }) {
			gone = append(gone, j.ID)
		}
	}
	if !ok || c.st.Groups[g.Name].Active != active {
		c.mu.Unlock()
		return
	}
	delete(c.hot, g.Name) // until this mirror completes
	c.mu.Unlock()
	if !hot {
		for _, id := range jobs {
			err := c.callFor(ctx, c.opt.ReplicaEvery, func(ctx context.Context) error { return c.sw[standby].Reset(ctx, id) })
			if err != nil && !errors.Is(err, mgmt.ErrRefused) { // refused: not admitted there (yet)
				c.report(fmt.Errorf("reset job %d on the standby %s before mirroring: %w", id, standby, err))
				return
			}
		}
	}
	err := c.callFor(ctx, c.opt.ReplicaEvery, func(ctx context.Context) error {
		// The first mirror after the reset also replaces what workers bound there by JOIN (from
		// its time as the active switch); later ones leave those alone (mgmt.SyncRequest.Force).
		_, err := c.sw[standby].Sync(ctx, mgmt.SyncRequest{Snapshot: snap, Gone: gone, Force: !hot})
		return err
	})
	if err != nil {
		c.report(fmt.Errorf("mirror %s onto the standby %s: %w", active, standby, err))
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.st.Groups[g.Name].Active == active {
		c.hot[g.Name] = standby
		c.st.Groups[g.Name].Mirrored = snap.Taken
	}
}

// failover moves group g from its active switch to the other one and records it. Degraded and
// operator failovers drain the active switch first and move its whole state; a failed switch
// cannot be read, so its replica is restored.
func (c *Controller) failover(ctx context.Context, g GroupConfig, reason, detail string) Failover {
	start := time.Now()
	c.mu.Lock()
	gs := c.st.Groups[g.Name]
	from := gs.Active
	replica := gs.Replica
	to := other(g, from)
	f := Failover{Group: g.Name, From: from, To: to, Reason: reason, Detail: detail, Started: start.UTC(), Source: "none",
		Hot: reason == ReasonFailed && c.hot[g.Name] == to}
	pending := gs.Pending != ""
	delete(c.hot, g.Name) // whatever happens now, the standby is no longer a mirror
	c.mu.Unlock()
	var snap *mgmt.Snapshot
	drained := false
	if reason != ReasonFailed && replica != nil && !pending {
		// Cool the standby before draining the active switch: a drained snapshot's slots must
		// apply to a target that aggregated nothing of these jobs meanwhile (the packets that
		// reach it between the drain and the restore are dropped as not members, and resent).
		// A pending failover's hosts have moved already: the first attempt cooled the target.
		cold := &mgmt.Snapshot{Switch: replica.Switch, Taken: replica.Taken, Scope: mgmt.ScopeControl, Pool: replica.Pool,
			Arrays: replica.Arrays, Jobs: replica.Jobs}
		err := c.call(ctx, func(ctx context.Context) error {
			_, err := c.sw[to].Sync(ctx, mgmt.SyncRequest{Snapshot: cold, Force: true})
			return err
		})
		if err != nil {
			f.Error = fmt.Sprintf("unbind the members on %s before the drain: %v", to, err)
			f.Total = time.Since(start)
			return c.record(g, gs, f, false)
		}
	}
	if reason != ReasonFailed {
		t := time.Now()
		err := c.call(ctx, func(ctx context.Context) error { return c.sw[from].Drain(ctx) })
		f.Drain = time.Since(t)
		drained = err == nil
		if err == nil {
			t = time.Now()
			err = c.call(ctx, func(ctx context.Context) (err error) {
				snap, err = c.sw[from].Snapshot(ctx, mgmt.ScopeAll)
				return err
			})
			f.Snapshot = time.Since(t)
			if err == nil {
				f.Source = "drained"
			}
		}
		if err != nil {
			f.Notes = append(f.Notes, fmt.Sprintf("%s could not be drained and read (%v): restoring the replica", from, err))
		}
	}
	if snap == nil && replica != nil {
		snap, f.Source = replica, "replica"
	}
	if snap != nil {
		t := time.Now()
		// What the target holds of these jobs is stale (from its last time as the active switch,
		// or packets that reached it before this restore): clear it, so that the snapshot's slots
		// apply; the contributions cleared are resent by the workers (as after MSG_RESET). Not
		// a hot standby's after a failure: it was reset before its first mirror and has been
		// aggregating the job's live traffic since the hosts moved to it; the replica's restore
		// (no slots) then only adds what the last mirror may have missed, and keeps the bindings
		// workers made there.
		for _, j := range snap.Jobs {
			if f.Hot && f.Source == "replica" {
				break
			}
			err := c.call(ctx, func(ctx context.Context) error { return c.sw[f.To].Reset(ctx, j.ID) })
			if err != nil && !errors.Is(err, mgmt.ErrRefused) {
				f.Notes = append(f.Notes, fmt.Sprintf("reset job %d on %s before the restore: %v", j.ID, f.To, err))
			}
		}
		err := c.call(ctx, func(ctx context.Context) (err error) {
			f.Migrated, err = c.sw[f.To].Restore(ctx, snap)
			return err
		})
		f.Restore = time.Since(t)
		if err != nil {
			f.Error = fmt.Sprintf("restore on %s: %v", f.To, err)
		}
	} else {
		f.Notes = append(f.Notes, "no replica yet: the standby has the jobs (admitted on both switches) but no members; workers must join again")
	}
	f.Total = time.Since(start)
	return c.record(g, gs, f, drained)
}

// record completes a failover: the group moves if it did not fail, and it is saved, reported and
// returned.
func (c *Controller) record(g GroupConfig, gs *GroupState, f Failover, drained bool) Failover {
	reason := f.Reason
	c.mu.Lock()
	if f.Error == "" {
		gs.Active, gs.Armed, gs.Pending = f.To, reason == ReasonOperator, ""
		if gs.Failovers == nil {
			gs.Failovers = map[string]int{}
		}
		gs.Failovers[reason]++
		delete(c.hist, f.From)
		delete(c.degraded, f.From)
		c.replicaAt[g.Name] = time.Time{} // read the new active switch at once
	} else {
		c.retryAt[g.Name] = time.Now().Add(c.opt.ReplicaEvery)
		if drained {
			gs.Pending = reason // the hosts have moved: the restore must happen
		}
	}
	gs.LastFailover = &f
	c.report(c.save())
	c.mu.Unlock()
	c.writeStatus()
	if c.opt.OnFailover != nil {
		c.opt.OnFailover(f)
	}
	return f
}
