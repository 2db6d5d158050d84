package netns_tests

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/agent"
	"github.com/xdpagg/xdpagg/controller"
	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/mgmt"
	"github.com/xdpagg/xdpagg/netns_tests/topo"
	"github.com/xdpagg/xdpagg/wire"
)

// The failover tests: a primary and a standby `xdpagg switch` (same port names, addresses and
// MACs; dual-homed hosts, topo.Config.Standby), an `xdpagg controller --config` in the management
// namespace that owns the job, and a job's allreduces running, each checked exact, across a
// failure of the primary.

const failoverPool = 64

// tightDegrade drains a switch whose workers resend more than 5% of what it aggregates.
const tightDegrade = `{"max_resend_share": 0.05, "min_packets": 100, "heartbeats": 3}`

// failoverEnv is a primary/standby pair, their controller and one job.
type failoverEnv struct {
	bin              string
	tp               *topo.Topology
	pinP, pinS       string
	keyP, keyS       string // the switches' controller key files
	primary, standby *cliSwitch
	dir, cfgPath     string       // the controller's state directory and config
	hosts            []*topo.Host // the job's workers
	ctl              *cliProc
}

// newFailoverEnv builds the topology, starts both switches with their management channels, and
// writes the controller's config for job with n workers (degrade: the config's "degrade" JSON).
// extra hosts beyond the job's (e.g. an attacker) come after its workers.
func newFailoverEnv(t *testing.T, n int, job uint32, degrade string, extra int) *failoverEnv {
	t.Helper()
	tp := newAgentTopoOf(t, topo.Config{Workers: n + extra, PS: true, Standby: true})
	keys := t.TempDir()
	e := &failoverEnv{bin: buildCLI(t), tp: tp, hosts: tp.Workers[:n], pinP: bpffsDir(t), pinS: bpffsDir(t), dir: t.TempDir(),
		keyP: filepath.Join(keys, "primary.key"), keyS: filepath.Join(keys, "standby.key")}
	m := tp.Mgmt
	e.primary = e.startSwitch(t, tp.SwitchNS, e.pinP, e.keyP, m.Primary.Switch)
	e.standby = e.startSwitch(t, tp.StandbyNS, e.pinS, e.keyS, m.Standby.Switch)
	sw := func(name, keyFile string, addr netip.Addr) map[string]any {
		return map[string]any{"name": name, "mgmt": netip.AddrPortFrom(addr, mgmt.DefaultPort).String(),
			"heartbeat": netip.AddrPortFrom(addr, loader.DefaultPort).String(), "key_file": keyFile}
	}
	cfg := map[string]any{
		"groups": []any{map[string]any{"name": "g", "primary": sw("sw-a", e.keyP, m.Primary.Switch), "standby": sw("sw-b", e.keyS, m.Standby.Switch)}},
		"jobs": []any{map[string]any{"id": job, "workers": n, "ps": netip.AddrPortFrom(tp.PS.IP, loader.DefaultPort).String(),
			"ps_port": tp.PS.Port, "group": "g"}},
		"heartbeat": map[string]any{"interval": "100ms", "fail_after": 3},
		"degrade":   json.RawMessage(degrade),
	}
	b, err := json.MarshalIndent(cfg, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	e.cfgPath = filepath.Join(keys, "controller.json")
	if err := os.WriteFile(e.cfgPath, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return e
}

func (e *failoverEnv) startSwitch(t *testing.T, ns, pinRoot, keyFile string, mgmtAddr netip.Addr) *cliSwitch {
	t.Helper()
	return startSwitchIn(t, e.bin, pinRoot, ns, e.tp, "--pool", strconv.Itoa(failoverPool), "--controller-key-file", keyFile,
		"--mgmt-listen", netip.AddrPortFrom(mgmtAddr, mgmt.DefaultPort).String())
}

// startController runs `xdpagg controller --config --state-dir` in the management namespace and
// waits for its ready file.
func (e *failoverEnv) startController(t *testing.T) {
	t.Helper()
	ready := filepath.Join(t.TempDir(), "ready.json")
	e.ctl = startDaemon(t, "controller", ready, "netns", "exec", e.tp.Mgmt.NS, e.bin, "controller", "--config", e.cfgPath, "--state-dir", e.dir, "--ready-file", ready)
}

// killController SIGKILLs the controller.
func (e *failoverEnv) killController(t *testing.T) {
	t.Helper()
	if err := e.ctl.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-e.ctl.exited
}

// view reads the controller's status file.
func (e *failoverEnv) view() (controller.View, error) {
	var v controller.View
	b, err := os.ReadFile(filepath.Join(e.dir, controller.StatusFile))
	if err == nil {
		err = json.Unmarshal(b, &v)
	}
	return v, err
}

// waitView waits until the controller's view satisfies ok.
func (e *failoverEnv) waitView(t *testing.T, what string, within time.Duration, ok func(controller.View) bool) controller.View {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		v, err := e.view()
		if err == nil && ok(v) {
			return v
		}
		if time.Now().After(deadline) {
			b, _ := json.MarshalIndent(v, "", "  ")
			t.Fatalf("controller: not %s after %v (%v)\n%s\ncontroller:\n%s\nprimary:\n%s\nstandby:\n%s", what, within, err, b,
				e.ctl.stderr.String(), e.primary.stderr.String(), e.standby.stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// runFailoverJob builds a failoverEnv for job (3 workers, extra more hosts), starts its
// controller and the job; the context ends with the test (or after 3 minutes).
func runFailoverJob(t *testing.T, job uint32, degrade string, extra int) (*failoverEnv, context.Context, *runningJob) {
	t.Helper()
	e := newFailoverEnv(t, 3, job, degrade, extra)
	e.startController(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	return e, ctx, e.startJob(ctx, t, job)
}

// startJob waits for the controller to admit job on both switches, then serves its PS and starts
// and joins its workers with the key the controller wrote for the hosts.
func (e *failoverEnv) startJob(ctx context.Context, t *testing.T, id uint32) *runningJob {
	t.Helper()
	key := e.admittedKey(t)
	a := &agentEnv{bin: e.bin, tp: e.tp, sw: e.primary, pool: failoverPool}
	spec := jobSpec{id: id, hosts: e.hosts}
	a.startPS(ctx, t, spec)
	spec.key = key
	j := a.startJob(ctx, t, spec)
	e.waitMirrored(t, len(j.hosts))
	return j
}

// admittedKey waits for the controller to admit the job on both switches and returns its key.
func (e *failoverEnv) admittedKey(t *testing.T) []byte {
	t.Helper()
	v := e.waitView(t, "job admitted on both switches", 30*time.Second, func(v controller.View) bool {
		return len(v.Jobs) == 1 && v.Jobs[0].Admitted["sw-a"] && v.Jobs[0].Admitted["sw-b"]
	})
	b, err := os.ReadFile(v.Jobs[0].KeyFile)
	if err != nil {
		t.Fatal(err)
	}
	key, err := ctlauth.ParseKey(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	return key
}

// waitMirrored waits for the controller's replica to hold every one of the job's members and to
// be mirrored onto the standby.
func (e *failoverEnv) waitMirrored(t *testing.T, members int) {
	t.Helper()
	e.waitView(t, "the replica holding every member, mirrored onto the standby", 30*time.Second, func(v controller.View) bool {
		return len(v.Groups) == 1 && len(v.Groups[0].Members) == members && v.Groups[0].Hot && !v.Groups[0].Mirrored.Before(v.Groups[0].ReplicaTaken)
	})
}

// runAcross runs verified allreduces on j until stop closes, then three more, and returns when
// they are done (exactness is checked by reduceExact; a failure ends the test).
func runAcross(ctx context.Context, t *testing.T, j *runningJob, stop <-chan struct{}) *sync.WaitGroup {
	var wg sync.WaitGroup
	wg.Go(func() {
		for r := uint64(0); ; r++ {
			select {
			case <-stop:
				reduceExact(ctx, t, j, 3, 20_000, 1000+r)
				return
			default:
			}
			if t.Failed() {
				return
			}
			reduceExact(ctx, t, j, 1, 50_000, r)
		}
	})
	return &wg
}

// nextResult returns a channel that receives the time from `since` to the first fragment any of
// j's workers completes after the call.
func nextResult(ctx context.Context, j *runningJob, since time.Time) <-chan time.Duration {
	var base uint64
	for _, w := range j.workers {
		base += w.Stats().ResultsReceived
	}
	out := make(chan time.Duration, 1)
	go func() {
		for ctx.Err() == nil {
			var n uint64
			for _, w := range j.workers {
				n += w.Stats().ResultsReceived
			}
			if n > base {
				out <- time.Since(since)
				return
			}
			time.Sleep(time.Millisecond)
		}
	}()
	return out
}

// stallWatch samples j's completed fragments every millisecond until ctx ends or the returned
// function is called, which returns the longest time without a completion and when it ended.
func stallWatch(ctx context.Context, j *runningJob) func() (time.Duration, time.Time) {
	ctx, cancel := context.WithCancel(ctx)
	var mu sync.Mutex
	var longest time.Duration
	var endedAt time.Time
	done := make(chan struct{})
	go func() {
		defer close(done)
		var last uint64
		lastAt := time.Now()
		for ctx.Err() == nil {
			var n uint64
			for _, w := range j.workers {
				n += w.Stats().ResultsReceived
			}
			now := time.Now()
			if n != last {
				mu.Lock()
				if gap := now.Sub(lastAt); gap > longest {
					longest, endedAt = gap, now
				}
				mu.Unlock()
				last, lastAt = n, now
			}
			time.Sleep(time.Millisecond)
		}
	}()
	return func() (time.Duration, time.Time) {
		cancel()
		<-done
		mu.Lock()
		defer mu.Unlock()
		return longest, endedAt
	}
}

// killPrimary SIGKILLs the primary's agent, detaches its XDP programs (the pinned links go with
// their pins) and takes its ports down: a switch that died. It returns when the agent died (its
// heartbeats stop) and when the ports were down (its datapath stops).
func (e *failoverEnv) killPrimary(t *testing.T) (killed, down time.Time) {
	t.Helper()
	if err := e.primary.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	killed = time.Now()
	<-e.primary.exited
	if err := os.RemoveAll(agent.PinDir(e.pinP, "t")); err != nil {
		t.Fatal(err)
	}
	if err := e.tp.SetPortsUp(e.tp.SwitchNS, false); err != nil {
		t.Fatal(err)
	}
	return killed, time.Now()
}

// failure is what failPrimary measured.
type failure struct {
	f         *controller.Failover
	decided   time.Duration // from the kill to the controller's decision
	recovery  time.Duration // from the ports going down to the job's first completed fragment
	longest   time.Duration // the longest time without a completed fragment
	killToOff time.Duration // from the kill to the ports down (the test's own steps)
}

func (r failure) String() string {
	return fmt.Sprintf("failover decided %v after the kill (restore %v, %+v); first fragment completed %v after the ports went down (down %v after the kill); longest stall %v",
		r.decided.Round(time.Millisecond), r.f.Restore.Round(time.Microsecond), r.f.Migrated, r.recovery.Round(time.Millisecond),
		r.killToOff.Round(time.Millisecond), r.longest.Round(time.Millisecond))
}

// failPrimary kills the primary while j runs (runAcross until stop), waits for the controller to
// move the group to the standby from its replica and for the job's allreduces to finish.
func (e *failoverEnv) failPrimary(ctx context.Context, t *testing.T, j *runningJob, stop chan struct{}, wg *sync.WaitGroup) failure {
	t.Helper()
	stall := stallWatch(ctx, j)
	killed, down := e.killPrimary(t)
	next := nextResult(ctx, j, down)
	v := e.waitView(t, "moved to the standby", 30*time.Second, func(v controller.View) bool { return v.Groups[0].Active == "sw-b" })
	close(stop)
	wg.Wait()
	r := failure{killToOff: down.Sub(killed)}
	r.longest, _ = stall()
	r.f = e.checkMoved(t, v, controller.ReasonFailed, "replica", len(j.hosts))
	if !r.f.Hot {
		t.Errorf("the failover's target was not a hot standby: %+v", r.f)
	}
	r.decided = r.f.Started.Sub(killed)
	select {
	case r.recovery = <-next:
	case <-ctx.Done():
		t.Fatal("no fragment completed after the failure")
	}
	return r
}

// checkMoved checks the group's last failover and that the job completes on the standby.
func (e *failoverEnv) checkMoved(t *testing.T, v controller.View, reason, source string, members int) *controller.Failover {
	t.Helper()
	g := v.Groups[0]
	f := g.LastFailover
	if f == nil || f.Error != "" || f.Reason != reason || f.Source != source || f.To != "sw-b" || f.Migrated.Members < members {
		t.Fatalf("last failover %+v, want %s from %s with %d members\ncontroller:\n%s", f, reason, source, members, e.ctl.stderr.String())
	}
	if g.Failovers[reason] != 1 {
		t.Errorf("failovers %v", g.Failovers)
	}
	return f
}

// TestFailoverPrimaryKilled: issue 10 (a). The primary's agent is SIGKILLed mid-job, its XDP
// detached and its ports taken down. The hosts' kernels move the traffic to the standby (carrier
// loss), which is hot: the controller has mirrored the primary's jobs, keys and members onto it
// at every replica, so it aggregates at once; what the primary was aggregating is recovered by
// the workers' resends and the PS. The controller then declares the primary failed (3
// heartbeats of 100 ms) and restores the replica on the standby without resetting it (the
// record says hot). Every allreduce is exact; the standby aggregates afterwards.
func TestFailoverPrimaryKilled(t *testing.T) {
	const job = 71
	e, ctx, j := runFailoverJob(t, job, `{"off": true}`, 0)
	reduceExact(ctx, t, j, 2, 20_000, 1)

	stop := make(chan struct{})
	wg := runAcross(ctx, t, j, stop)
	time.Sleep(150 * time.Millisecond)
	r := e.failPrimary(ctx, t, j, stop, wg)
	c := inspect(t, e.bin, e.pinS).Counters
	if c["aggregated"] == 0 {
		t.Errorf("the standby aggregated nothing: %v", c)
	}
	t.Logf("primary killed: %v; standby aggregated %d, to_ps %d", r, c["aggregated"], c["to_ps"])
}

// TestFailoverPrimaryDegraded: issue 10 (b). The primary's links to the workers lose 20% of what
// it sends them: the workers resend, the controller's degradation policy (resends per aggregated
// DATA over 3 heartbeats) fires while the primary still answers, and the controller drains it
// (its agent takes its ports down: the hosts move to the standby), reads its whole state
// (slots, cache, members) and restores it on the standby. Then the operator fails back by hand
// (`xdpagg failover`). Every allreduce is exact.
func TestFailoverPrimaryDegraded(t *testing.T) {
	const job = 72
	e, ctx, j := runFailoverJob(t, job, tightDegrade, 0)
	reduceExact(ctx, t, j, 2, 20_000, 1)
	if v, _ := e.view(); v.Groups[0].Active != "sw-a" || v.Groups[0].LastFailover != nil {
		t.Fatalf("a failover before any fault: %+v", v.Groups[0].LastFailover)
	}

	stop := make(chan struct{})
	wg := runAcross(ctx, t, j, stop)
	time.Sleep(100 * time.Millisecond)
	for _, h := range e.hosts {
		if err := e.tp.Impair(h, topo.FromSwitch, topo.Impairment{Loss: 20}); err != nil {
			t.Fatal(err)
		}
	}
	degraded := time.Now()
	stall := stallWatch(ctx, j)
	v := e.waitView(t, "drained to the standby", 60*time.Second, func(v controller.View) bool { return v.Groups[0].Active == "sw-b" })
	close(stop)
	wg.Wait()
	longest, endedAt := stall()
	f := e.checkMoved(t, v, controller.ReasonDegraded, "drained", 3)
	t.Logf("primary degraded: %s; failover %v after the loss began: drain %v, snapshot %v, restore %v, total %v; migrated %+v; longest stall without a completed fragment %v (ended %v after the drain began)",
		f.Detail, f.Started.Sub(degraded).Round(time.Millisecond), f.Drain.Round(time.Microsecond), f.Snapshot.Round(time.Microsecond),
		f.Restore.Round(time.Microsecond), f.Total.Round(time.Microsecond), f.Migrated, longest.Round(time.Millisecond), endedAt.Sub(f.Started).Round(time.Millisecond))
	if c := inspect(t, e.bin, e.pinS).Counters; c["aggregated"] == 0 {
		t.Errorf("the standby aggregated nothing: %v", c)
	}

	// Fail back by hand, as docs/operations.md says: the primary's link is mended, `xdpagg
	// failover` drains the standby and moves the state back, the primary's ports come up (the
	// hosts follow the carrier), then the standby's (it is the standby again). The job runs on.
	for _, h := range e.hosts {
		if err := e.tp.ClearImpair(h, topo.FromSwitch); err != nil {
			t.Fatal(err)
		}
	}
	stop = make(chan struct{})
	wg = runAcross(ctx, t, j, stop)
	time.Sleep(100 * time.Millisecond)
	stall = stallWatch(ctx, j)
	back := time.Now()
	out, err := exec.CommandContext(ctx, e.bin, "failover", "--state-dir", e.dir, "--group", "g").Output()
	if err != nil {
		t.Fatalf("xdpagg failover: %v\n%s", err, e.ctl.stderr.String())
	}
	var fb controller.Failover
	// The primary's ports are still down: nothing reaches it between the reset and the restore,
	// so every entry of the standby's snapshot applies.
	if err := json.Unmarshal(out, &fb); err != nil || fb.To != "sw-a" || fb.Source != "drained" || fb.Reason != controller.ReasonOperator || fb.Migrated.Skipped != 0 {
		t.Fatalf("xdpagg failover printed %s (%v)", out, err)
	}
	if err := e.tp.SetPortsUp(e.tp.SwitchNS, true); err != nil {
		t.Fatal(err)
	}
	if err := e.tp.SetPortsUp(e.tp.StandbyNS, true); err != nil {
		t.Fatal(err)
	}
	close(stop)
	wg.Wait()
	longest, _ = stall()
	v, err = e.view()
	if err != nil || v.Groups[0].Active != "sw-a" || !v.Groups[0].Armed || v.Groups[0].Failovers[controller.ReasonOperator] != 1 {
		t.Errorf("after the fail-back: %+v %v", v.Groups, err)
	}
	t.Logf("fail-back by hand: %v from the request to the primary's ports up; drain %v, snapshot %v, restore %v; migrated %+v; longest stall %v",
		time.Since(back).Round(time.Millisecond), fb.Drain.Round(time.Microsecond), fb.Snapshot.Round(time.Microsecond), fb.Restore.Round(time.Microsecond),
		fb.Migrated, longest.Round(time.Millisecond))
}

// TestFailoverControllerRestarted: issue 10 (c). The controller is SIGKILLed mid-job and started
// again over its state directory: the job (which never depended on it) runs on, the new
// controller keeps the job's key and admissions, resumes heartbeats and replicas, and when the
// primary then dies it fails over from the reloaded state. Every allreduce is exact.
func TestFailoverControllerRestarted(t *testing.T) {
	const job = 73
	e, ctx, j := runFailoverJob(t, job, `{"off": true}`, 0)
	before, _ := e.view()

	stop := make(chan struct{})
	wg := runAcross(ctx, t, j, stop)
	time.Sleep(100 * time.Millisecond)
	e.killController(t)
	time.Sleep(300 * time.Millisecond) // the job runs on without a controller
	restarted := time.Now()
	e.startController(t)
	e.waitView(t, "heartbeating and mirroring again", 30*time.Second, func(v controller.View) bool {
		// Mirrored after the restart: the new controller reset the standby's job and mirrored the
		// primary onto it (the old one's last status files are newer than before, too).
		return v.Time.After(before.Time) && len(v.Groups[0].Switches) == 2 && v.Groups[0].Switches[0].State == controller.StateHealthy &&
			v.Groups[0].Hot && v.Groups[0].Mirrored.After(restarted)
	})
	after, _ := e.view()
	if after.Jobs[0].KeyFile != before.Jobs[0].KeyFile {
		t.Errorf("key file moved: %s -> %s", before.Jobs[0].KeyFile, after.Jobs[0].KeyFile)
	}
	b, _ := os.ReadFile(after.Jobs[0].KeyFile)
	if strings.TrimSpace(string(b)) != ctlauth.FormatKey(j.key) {
		t.Error("the restarted controller wrote another job key")
	}
	r := e.failPrimary(ctx, t, j, stop, wg)
	t.Logf("controller restarted, then primary killed: %v", r)
	if strings.Count(e.ctl.stderr.String(), fmt.Sprintf("admit job %d", job)) > 0 {
		t.Errorf("the restarted controller admitted again or failed to:\n%s", e.ctl.stderr.String())
	}
}

// forgeDuring runs j's allreduces (each exact) for d while the env's first extra host, no member,
// sends DATA of the job claiming worker 1 (with flags) to the primary, or to the standby: from
// its own address, and with worker 1's address and MAC. It returns the attacker and the counters
// of the switch attacked before and after.
func (e *failoverEnv) forgeDuring(ctx context.Context, t *testing.T, j *runningJob, standby bool, flags uint16, d time.Duration) (atk *attacker, before, after map[string]uint64) {
	t.Helper()
	atk = newAttacker(t, e.tp, e.tp.Workers[len(e.hosts)])
	ifindex, pin := atk.h.Ifindex, e.pinP
	if standby {
		ifindex, pin = atk.h.Ifindex2, e.pinS
	}
	w1, ps := e.hosts[1], e.tp.PS
	before = inspect(t, e.bin, pin).Counters
	var seq atomic.Uint32
	start := time.Now()
	during(func() {
		for range 8 {
			s := seq.Add(1)
			data := xpkt(wire.Header{Type: wire.MsgData, JobId: j.id, Seq: s, AggIndex: s % failoverPool, Flags: flags,
				Bitmap0: 1 << 1, FanIn0: 3, WorkerId: 1}, 64, 1<<20)
			atk.sendOn(t, ifindex, atk.from(atk.h.IP, 9600, ps.IP, loader.DefaultPort, data), 1)
			f := atk.from(w1.IP, 9600, ps.IP, loader.DefaultPort, data)
			f.srcMAC = w1.MAC
			atk.sendOn(t, ifindex, f, 1)
		}
	}, func() {
		for time.Since(start) < d {
			reduceExact(ctx, t, j, 1, 50_000, uint64(seq.Load()))
		}
	})
	return atk, before, inspect(t, e.bin, pin).Counters
}

// TestFailoverAttackerCannotForceDrain: a host on a switch port that is not a member floods the
// primary with DATA for the job flagged as resends — from its own address claiming worker 1,
// and with worker 1's address and MAC — while the job runs under the tight degradation policy.
// The switch drops it all before it can count as a resend (not_member), so the primary
// never looks degraded: no failover, and the job stays exact. (The controller itself is on the
// management network, which no switch port reaches.)
func TestFailoverAttackerCannotForceDrain(t *testing.T) {
	const job = 74
	e, ctx, j := runFailoverJob(t, job, tightDegrade, 1)
	// At least 15 heartbeats (five policy windows) of attack, with the job running.
	atk, before, after := e.forgeDuring(ctx, t, j, false, wire.FlagResend, 1500*time.Millisecond)
	// DATA is held to the member's exact registration (address, UDP port, switch port): both
	// kinds fail it, before any slot (or resend counter) is touched.
	grew(t, before, after, "not_member", 100)
	if d := after["duplicate"] - before["duplicate"]; d != 0 {
		t.Errorf("forged resends counted as duplicates: +%d", d)
	}
	v, err := e.view()
	if err != nil {
		t.Fatal(err)
	}
	if g := v.Groups[0]; g.Active != "sw-a" || g.LastFailover != nil || g.Degraded != "" {
		t.Errorf("the attacker moved the group: active %s, degraded %q, last failover %+v", g.Active, g.Degraded, g.LastFailover)
	}
	t.Logf("forged resends: %d frames; not_member +%d, duplicate +%d; no failover, job exact",
		atk.sent.Load(), after["not_member"]-before["not_member"], after["duplicate"]-before["duplicate"])
}

// TestFailoverHotStandbyAttacked: the hot standby holds the job's members (mirrored from the
// primary) and nothing else: a host on a standby port that is not a member sends it DATA for the
// job — from its own address claiming worker 1, and with worker 1's address and MAC — while the
// job runs on the primary. The standby holds every binding exactly as the primary does (address,
// UDP port, port), so it drops it all (not_member) and aggregates nothing; the job stays exact.
func TestFailoverHotStandbyAttacked(t *testing.T) {
	const job = 75
	e, ctx, j := runFailoverJob(t, job, `{"off": true}`, 1)
	atk, before, after := e.forgeDuring(ctx, t, j, true, 0, time.Second)
	grew(t, before, after, "not_member", 100)
	if d := after["aggregated"] - before["aggregated"]; d != 0 {
		t.Errorf("the standby aggregated %d forged DATA", d)
	}
	if v, err := e.view(); err != nil || !v.Groups[0].Hot || v.Groups[0].Active != "sw-a" {
		t.Errorf("view %+v %v", v.Groups, err)
	}
	t.Logf("forged DATA to the hot standby: %d frames; not_member +%d, aggregated +0; job exact",
		atk.sent.Load(), after["not_member"]-before["not_member"])
}
