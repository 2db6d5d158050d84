package netns_tests

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"net/netip"

	"github.com/xdpagg/xdpagg/controller"
	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/netns_tests/topo"
)

// TestControllerDetectsFailure: a controller on the PS host heartbeats the switch's agent (under
// the switch's controller key) and sees it healthy with its statistics; the agent is killed
// while a job runs, and the controller declares the switch failed within its policy (3 missed
// heartbeats of 100 ms); the agent comes back (taking the datapath over) and the controller sees
// it healthy again. The job's allreduces stay exact throughout.
func TestControllerDetectsFailure(t *testing.T) {
	keyFile := filepath.Join(t.TempDir(), "controller.key")
	a := newAgentEnv(t, 3, 64, "--controller-key-file", keyFile)
	b, err := os.ReadFile(keyFile)
	if err != nil {
		t.Fatal(err)
	}
	key, err := ctlauth.ParseKey(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	j := a.startJobs(ctx, t, jobSpec{id: 61, hosts: []*topo.Host{a.tp.Workers[0], a.tp.Workers[1], a.tp.Workers[2]}})[0]

	var mu sync.Mutex
	changes := map[string]time.Time{}
	ps := a.tp.PS
	var m *controller.Monitor
	if err := a.tp.InHost(ps, func() (err error) {
		m, err = controller.NewMonitor(netip.AddrPortFrom(ps.IP, 0),
			[]controller.Target{{Name: "sw", Addr: netip.AddrPortFrom(ps.Gateway, loader.DefaultPort), Key: key}},
			controller.Policy{Interval: 100 * time.Millisecond, FailAfter: 3, OnChange: func(s controller.Status) {
				mu.Lock()
				changes[s.State] = time.Now()
				mu.Unlock()
			}})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	go m.Run(ctx)
	waitState := func(state string, within time.Duration) controller.Status {
		t.Helper()
		deadline := time.Now().Add(within)
		for {
			s := m.Status()[0]
			if s.State == state {
				return s
			}
			if time.Now().After(deadline) {
				t.Fatalf("switch %s after %v, want %s (%+v)\n%s", s.State, within, state, s, a.sw.stderr.String())
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	s := waitState(controller.StateHealthy, 10*time.Second)
	if s.Stats.PoolSize != 64 || s.Stats.Jobs != 1 || s.Stats.Members != 3 {
		t.Errorf("heartbeat statistics %+v: want pool 64, 1 job, 3 members", s.Stats)
	}

	var wg sync.WaitGroup
	wg.Go(func() { reduceExact(ctx, t, j, 30, 50_000, 61) })
	time.Sleep(100 * time.Millisecond)
	if err := a.sw.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-a.sw.exited
	killed := time.Now()
	waitState(controller.StateFailed, 5*time.Second)
	mu.Lock()
	detect := changes[controller.StateFailed].Sub(killed)
	mu.Unlock()

	a.sw = startSwitch(t, a.bin, a.pinRoot, a.tp, "--pool", "64", "--controller-key-file", keyFile)
	restarted := time.Now()
	waitState(controller.StateHealthy, 10*time.Second)
	mu.Lock()
	back := changes[controller.StateHealthy].Sub(restarted)
	mu.Unlock()
	wg.Wait()
	st := m.Status()[0]
	t.Logf("controller: failure detected %v after the kill (policy: 3 x 100 ms), healthy again %v after the restart; %d of %d heartbeats answered, %d failure(s)",
		detect.Round(time.Millisecond), back.Round(time.Millisecond), st.Answered, st.Sent, st.Failures)
	if st.Failures != 1 {
		t.Errorf("failures = %d, want 1", st.Failures)
	}
}
