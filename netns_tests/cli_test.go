package netns_tests

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/agent"
	"github.com/xdpagg/xdpagg/internal/bpftest"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/netns_tests/topo"
)

// buildCLI compiles cmd/xdpagg once per test binary run.
func buildCLI(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "xdpagg")
	out, err := exec.Command("go", "build", "-o", bin, "../cmd/xdpagg").CombinedOutput()
	if err != nil {
		t.Fatalf("build CLI: %v\n%s", err, out)
	}
	return bin
}

// bpffsDir mounts a private bpffs for the test's pins and unmounts it at cleanup.
func bpffsDir(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	if err := loader.MountBPFFS(dir); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dir, 0) })
	return dir
}

type inspectOut struct {
	Counters map[string]uint64 `json:"counters"`
	Members  []struct {
		JobID    uint32 `json:"job"`
		WorkerID uint8  `json:"worker"`
	} `json:"members"`
	Ports []uint32 `json:"ports"`
	InUse int      `json:"slots_in_use"`
	Cache *struct {
		Entries, Stored, Hits, Misses uint64
		EvictedAcked                  uint64 `json:"evicted_acked"`
		EvictedAge                    uint64 `json:"evicted_age"`
		Acks                          uint64 `json:"acks"`
	} `json:"retransmit_cache"`
	Sparse []maps.SparseState `json:"sparse"`
}

func inspect(t *testing.T, bin, pinRoot string) inspectOut {
	t.Helper()
	out, err := exec.Command(bin, "inspect", "--json", "--slots", "--pin-root", pinRoot, "--name", "t").Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			t.Fatalf("inspect: %v: %s", err, ee.Stderr)
		}
		t.Fatalf("inspect: %v", err)
	}
	var in inspectOut
	if err := json.Unmarshal(out, &in); err != nil {
		t.Fatalf("inspect output %q: %v", out, err)
	}
	return in
}

// The CLI end to end: `xdpagg switch` in the switch namespace, workers that JOIN through the
// control path, allreduces through it, `xdpagg inspect --json` from another process showing
// counters that move, and a clean detach/unpin on SIGTERM.
func TestCLISwitchInspect(t *testing.T) {
	bin := buildCLI(t)
	pinRoot := bpffsDir(t)

	tp := newAgentTopo(t, 2)

	sw := startSwitch(t, bin, pinRoot, tp, "--pool", "256", "--metrics-addr", "127.0.0.1:0")
	ready, rd, cmd, exited, stderr, ports := sw.readyFile, sw.ready, sw.cmd, sw.exited, &sw.stderr, sw.ports

	first := inspect(t, bin, pinRoot)
	if len(first.Ports) != 3 {
		t.Fatalf("ports %v, want 3", first.Ports)
	}

	// PS and workers; the workers register through the control path.
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	env := &agentEnv{bin: bin, pinRoot: pinRoot, tp: tp, sw: sw, pool: 256}
	workers := env.startJobs(ctx, t, jobSpec{id: 7, hosts: tp.Workers})[0].workers
	if got := inspect(t, bin, pinRoot); len(got.Members) != 2 {
		t.Fatalf("members after join: %+v", got.Members)
	}

	in, ref := inputs(2, 10*K+3, 99, uniform)
	errs := make(chan error, 2)
	for i, w := range workers {
		go func() { errs <- w.AllReduce(ctx, in[i]) }()
	}
	for range workers {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	checkFixed(t, in, ref, 24)

	second := inspect(t, bin, pinRoot)
	for _, c := range []string{"rx", "aggregated", "completed", "egress_tx", "control"} {
		if second.Counters[c] <= first.Counters[c] {
			t.Errorf("counter %s did not move: %d -> %d", c, first.Counters[c], second.Counters[c])
		}
	}
	// 11 fragments: all completed in-switch unless a worker resent after its 20 ms timeout (a
	// loaded machine), which flushes the half-filled slot to the PS. Never more than 11.
	if done := second.Counters["completed"] - first.Counters["completed"]; done > 11 {
		t.Errorf("completed moved by %d, more than the 11 fragments", done)
	} else if done < 11 {
		t.Logf("completed moved by %d of 11 fragments (the rest went through the PS after a retransmit timeout)", done)
	}

	// SIGTERM: the daemon detaches, unpins and removes its ready file.
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("switch exit: %v\n%s", err, stderr.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatal("switch did not exit on SIGTERM")
	}
	if _, err := os.Stat(rd.PinDir); !os.IsNotExist(err) {
		t.Errorf("pin dir %s still there after exit (%v)", rd.PinDir, err)
	}
	if _, err := os.Stat(ready); !os.IsNotExist(err) {
		t.Errorf("ready file still there after exit")
	}
	if err := tp.InSwitch(func() error {
		for _, p := range ports {
			l, err := netlink.LinkByName(p)
			if err != nil {
				return err
			}
			if x := l.Attrs().Xdp; x != nil && x.Attached {
				t.Errorf("port %s still has XDP attached (prog id %d)", p, x.ProgId)
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

// cliProc is an xdpagg daemon the test runs (`xdpagg switch`, `xdpagg controller`).
type cliProc struct {
	cmd    *exec.Cmd
	exited chan error
	stderr bytes.Buffer
}

// cliSwitch is an `xdpagg switch` process running in a topology's switch namespace.
type cliSwitch struct {
	*cliProc
	readyFile string
	ready     agent.Ready
	ports     []string
}

// startDaemon runs `ip args...` and waits for readyFile (the daemon's own signal); it fails the
// test if the daemon dies first. The process is killed at cleanup if the test has not stopped it.
func startDaemon(t *testing.T, what, readyFile string, args ...string) *cliProc {
	t.Helper()
	p := &cliProc{exited: make(chan error, 1)}
	p.cmd = exec.Command("ip", args...)
	p.cmd.Stderr = &p.stderr
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.exited <- p.cmd.Wait() }()
	t.Cleanup(func() {
		if p.cmd.ProcessState == nil {
			_ = p.cmd.Process.Kill()
			<-p.exited
		}
	})
	deadline := time.After(30 * time.Second)
	for {
		if _, err := os.Stat(readyFile); err == nil {
			return p
		}
		select {
		case err := <-p.exited:
			t.Fatalf("%s exited before ready: %v\n%s", what, err, p.stderr.String())
		case <-deadline:
			t.Fatalf("%s not ready after 30s\n%s", what, p.stderr.String())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// startSwitch runs `xdpagg switch --name t` on every port of tp (plus extra flags) and waits for
// its ready file; the process is killed at cleanup if the test has not stopped it.
func startSwitch(t *testing.T, bin, pinRoot string, tp *topo.Topology, extra ...string) *cliSwitch {
	t.Helper()
	return startSwitchIn(t, bin, pinRoot, tp.SwitchNS, tp, extra...)
}

// startSwitchIn is startSwitch in the switch namespace ns (tp.SwitchNS or tp.StandbyNS).
func startSwitchIn(t *testing.T, bin, pinRoot, ns string, tp *topo.Topology, extra ...string) *cliSwitch {
	t.Helper()
	sw := &cliSwitch{readyFile: filepath.Join(t.TempDir(), "ready.json")}
	for _, h := range tp.Hosts() {
		sw.ports = append(sw.ports, h.Port)
	}
	args := append([]string{"netns", "exec", ns, bin, "switch", "--name", "t", "--pin-root", pinRoot,
		"--iface", strings.Join(sw.ports, ","), "--ready-file", sw.readyFile}, extra...)
	sw.cliProc = startDaemon(t, "switch", sw.readyFile, args...)
	b, _ := os.ReadFile(sw.readyFile)
	if err := json.Unmarshal(b, &sw.ready); err != nil || sw.ready.PinDir == "" {
		t.Fatalf("ready file %q: %v", b, err)
	}
	return sw
}

// newAgentTopo builds a topology of n workers and a PS for a switch run by the agent, and checks
// at cleanup that its namespaces are gone. The host-side veth ends get an XDP program so that the
// switch's XDP_TX/redirect frames are accepted.
func newAgentTopo(t *testing.T, n int) *topo.Topology {
	t.Helper()
	return newAgentTopoOf(t, topo.Config{Workers: n, PS: true})
}

// newAgentTopoOf is newAgentTopo for any cfg (its Prefix and HostXDP are set here).
func newAgentTopoOf(t *testing.T, cfg topo.Config) *topo.Topology {
	t.Helper()
	pass := bpftest.LoadSwitch(t, loader.Config{PoolSize: 1})
	prefix := topo.NewPrefix()
	cfg.Prefix, cfg.HostXDP = prefix, pass.Objects.XdpaggPass
	tp, err := topo.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		tp.Close()
		if left, _ := topo.Leftovers(prefix); len(left) > 0 {
			t.Errorf("namespaces left: %v", left)
		}
	})
	return tp
}
