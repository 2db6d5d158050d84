package netns_tests

import (
	"context"
	"errors"
	"net/netip"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/hostlib"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/netns_tests/topo"
)

// TestAgentRestartKeepsJobs: the switch agent is SIGKILLed in the middle of a job's allreduces
// and started again over the pins it left. Meanwhile the XDP programs keep running on their
// pinned links with the pinned maps; the new agent adopts them (the ports' links move to its
// programs in one step) instead of refusing the directory. Every allreduce, before, during and
// after, is exact, the workers' control messages reach the new agent, and once the job is idle
// its slots drain (the new agent's garbage collector frees them): none leaked.
func TestAgentRestartKeepsJobs(t *testing.T) {
	a := newAgentEnv(t, 3, 64, "--slot-timeout", "1s")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	jobs := a.startJobs(ctx, t, jobSpec{id: 51, hosts: []*topo.Host{a.tp.Workers[0], a.tp.Workers[1], a.tp.Workers[2]}})
	j := jobs[0]
	reduceExact(ctx, t, j, 3, 20_000, 1)
	before := a.counters(t)

	var wg sync.WaitGroup
	wg.Go(func() { reduceExact(ctx, t, j, 40, 50_000, 100) })
	time.Sleep(150 * time.Millisecond)
	if err := a.sw.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-a.sw.exited
	killed := time.Now()
	time.Sleep(200 * time.Millisecond) // the job runs on, with no agent
	a.sw = startSwitch(t, a.bin, a.pinRoot, a.tp, "--pool", "64", "--slot-timeout", "1s")
	t.Logf("agent restarted %v after the kill", time.Since(killed).Round(time.Millisecond))
	if !strings.Contains(a.sw.stderr.String(), "took over the running switch") {
		t.Errorf("the new agent did not take over the pinned switch:\n%s", a.sw.stderr.String())
	}
	wg.Wait()
	if t.Failed() {
		t.Fatalf("the job failed across the restart\n%s", a.sw.stderr.String())
	}
	// After the restart the job goes on through the new agent too.
	reduceExact(ctx, t, j, 3, 20_000, 200)

	deadline := time.Now().Add(20 * time.Second)
	for {
		in := inspect(t, a.bin, a.pinRoot)
		if in.InUse == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d slots still in use long after the job went idle: leaked", in.InUse)
		}
		time.Sleep(200 * time.Millisecond)
	}
	c := a.counters(t)
	if c["completed"] <= before["completed"] {
		t.Errorf("counters restarted from zero (completed %d, %d before the kill): the maps were not kept", c["completed"], before["completed"])
	}
	t.Logf("after the restart: completed %d, to_ps %d, shadow_tx %d, control %d", c["completed"], c["to_ps"], c["shadow_tx"], c["control"])
}

// TestResetMidJob: a worker sends iSwitch's Reset (authenticated, from its binding) while its
// job's allreduces run: the agent frees the job's slots under them. Sums in flight lose what the
// switch held and complete through resends at the PS; every allreduce stays exact.
func TestResetMidJob(t *testing.T) {
	a := newAgentEnv(t, 3, 64)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	j := a.startJobs(ctx, t, jobSpec{id: 52, hosts: []*topo.Host{a.tp.Workers[0], a.tp.Workers[1], a.tp.Workers[2]}})[0]
	before := a.counters(t)
	var wg sync.WaitGroup
	wg.Go(func() { reduceExact(ctx, t, j, 30, 50_000, 7) })
	resets := 0
	for i := range 3 {
		time.Sleep(time.Duration(50+40*i) * time.Millisecond)
		h := j.hosts[0]
		rctx, rcancel := context.WithTimeout(ctx, time.Minute)
		err := j.workers[0].Reset(rctx, netip.AddrPortFrom(h.Gateway, loader.DefaultPort))
		rcancel()
		if err != nil {
			t.Fatalf("reset %d: %v\n%s", i, err, a.sw.stderr.String())
		}
		resets++
	}
	wg.Wait()
	c := a.counters(t)
	if !strings.Contains(a.sw.stderr.String(), "job reset") {
		t.Errorf("the agent logged no reset:\n%s", a.sw.stderr.String())
	}
	t.Logf("reset: %d resets mid-job, every allreduce exact; to_ps +%d, flushed +%d, reclaimed +%d", resets,
		c["to_ps"]-before["to_ps"], c["flushed"]-before["flushed"], c["reclaimed"]-before["reclaimed"])
}

// TestHaltJob: iSwitch's Halt. One worker halts its job while the job's allreduces run: the agent
// tells every member (authenticated), each one's running or next allreduce fails with ErrHalted
// at once, none hangs; another job on the switch is untouched. After Resume on every member the
// job goes on, in step and exact.
func TestHaltJob(t *testing.T) {
	a := newAgentEnv(t, 4, 64)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	hosts := a.tp.Workers
	jobs := a.startJobs(ctx, t, jobSpec{id: 53, hosts: hosts[:3]}, jobSpec{id: 54, hosts: hosts[1:], port: 9700})
	j, other := jobs[0], jobs[1]
	reduceExact(ctx, t, j, 2, 20_000, 1)

	errs := make(chan error, len(j.workers))
	start := make(chan struct{})
	for i, w := range j.workers {
		go func() {
			<-start
			for r := 0; ; r++ {
				in, _ := inputs(len(j.workers), 200_000, uint64(r), uniform)
				if err := w.AllReduce(ctx, in[i]); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	close(start)
	time.Sleep(100 * time.Millisecond)
	halted := time.Now()
	h := j.hosts[0]
	hctx, hcancel := context.WithTimeout(ctx, time.Minute)
	err := j.workers[0].Halt(hctx, netip.AddrPortFrom(h.Gateway, loader.DefaultPort))
	hcancel()
	if err != nil {
		t.Fatalf("halt: %v\n%s", err, a.sw.stderr.String())
	}
	var worst time.Duration
	for range j.workers {
		err := <-errs
		if !errors.Is(err, hostlib.ErrHalted) {
			t.Errorf("a member's allreduce ended with %v, want ErrHalted", err)
		}
		worst = max(worst, time.Since(halted))
	}
	for _, w := range j.workers {
		if !w.Halted() {
			t.Error("a member does not know its job is halted")
		}
	}
	// The other job runs on.
	reduceExact(ctx, t, other, 3, 20_000, 5)
	// The members may have failed different allreduces (one whose last result came after the
	// notice fails the call the others completed): Resume puts each at the halt's resume point,
	// so they go on in step.
	for _, w := range j.workers {
		w.Resume()
	}
	reduceExact(ctx, t, j, 3, 20_000, 9)
	t.Logf("halt: every member stopped within %v of the halt, the other job ran on, the job resumed exact", worst.Round(time.Millisecond))
}
