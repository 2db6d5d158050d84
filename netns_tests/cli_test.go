package netns_tests

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/netip"
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
	"github.com/xdpagg/xdpagg/hostlib"
	"github.com/xdpagg/xdpagg/internal/bpftest"
	"github.com/xdpagg/xdpagg/loader"
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
		Entries, Stored, Hits, Misses, EvictedAcked uint64
	} `json:"retransmit_cache"`
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
	workers := startJoinedJob(ctx, t, tp, 7, 256, stderr.String)
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
	if second.Counters["completed"]-first.Counters["completed"] != 11 {
		t.Errorf("completed moved by %d, want 11 fragments", second.Counters["completed"]-first.Counters["completed"])
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

// cliSwitch is an `xdpagg switch` process running in a topology's switch namespace.
type cliSwitch struct {
	cmd       *exec.Cmd
	exited    chan error
	stderr    bytes.Buffer
	readyFile string
	ready     agent.Ready
	ports     []string
}

// startSwitch runs `xdpagg switch --name t` on every port of tp (plus extra flags) and waits for
// its ready file; the process is killed at cleanup if the test has not stopped it.
func startSwitch(t *testing.T, bin, pinRoot string, tp *topo.Topology, extra ...string) *cliSwitch {
	t.Helper()
	sw := &cliSwitch{exited: make(chan error, 1), readyFile: filepath.Join(t.TempDir(), "ready.json")}
	for _, h := range tp.Hosts() {
		sw.ports = append(sw.ports, h.Port)
	}
	args := append([]string{"netns", "exec", tp.SwitchNS, bin, "switch", "--name", "t", "--pin-root", pinRoot,
		"--iface", strings.Join(sw.ports, ","), "--ready-file", sw.readyFile}, extra...)
	sw.cmd = exec.Command("ip", args...)
	sw.cmd.Stderr = &sw.stderr
	if err := sw.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { sw.exited <- sw.cmd.Wait() }()
	t.Cleanup(func() {
		if sw.cmd.ProcessState == nil {
			_ = sw.cmd.Process.Kill()
			<-sw.exited
		}
	})
	// Wait for the ready file (the daemon's own signal), or for the daemon to die.
	deadline := time.After(30 * time.Second)
	for {
		if _, err := os.Stat(sw.readyFile); err == nil {
			break
		}
		select {
		case err := <-sw.exited:
			t.Fatalf("switch exited before ready: %v\n%s", err, sw.stderr.String())
		case <-deadline:
			t.Fatalf("switch not ready after 30s\n%s", sw.stderr.String())
		case <-time.After(20 * time.Millisecond):
		}
	}
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
	pass := bpftest.LoadSwitch(t, loader.Config{PoolSize: 1})
	prefix := topo.NewPrefix()
	tp, err := topo.New(topo.Config{Prefix: prefix, Workers: n, PS: true, HostXDP: pass.Objects.XdpaggPass})
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

// startJoinedJob serves a PS on tp's PS host until ctx ends and starts one worker of job on each
// worker host, each registered with the switch agent through the control path (JOIN). diag, if
// set, adds the switch's diagnostics to a failed JOIN.
func startJoinedJob(ctx context.Context, t *testing.T, tp *topo.Topology, job, pool uint32, diag func() string) []*hostlib.Worker {
	t.Helper()
	ps := tp.PS
	psAddr := netip.AddrPortFrom(ps.IP, loader.DefaultPort)
	var srv *hostlib.PS
	if err := tp.InHost(ps, func() (err error) {
		srv, err = hostlib.NewPS(hostlib.PSConfig{Listen: psAddr, Switch: netip.AddrPortFrom(ps.Gateway, loader.DefaultPort)})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	go srv.Serve(ctx)
	t.Cleanup(func() { srv.Close() })
	workers := make([]*hostlib.Worker, len(tp.Workers))
	for i, h := range tp.Workers {
		if err := tp.InHost(h, func() (err error) {
			workers[i], err = hostlib.NewWorker(hostlib.WorkerConfig{JobID: job, WorkerID: uint8(i), NumWorkers: uint8(len(tp.Workers)),
				Local: netip.AddrPortFrom(h.IP, 9600), PS: psAddr, PoolSize: pool})
			return err
		}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { workers[i].Close() })
		jctx, jcancel := context.WithTimeout(ctx, 10*time.Second)
		err := workers[i].Join(jctx, netip.AddrPortFrom(h.Gateway, loader.DefaultPort), h.MAC, ps.IP)
		jcancel()
		if err != nil {
			msg := ""
			if diag != nil {
				msg = diag()
			}
			t.Fatalf("worker %d join: %v\n%s", i, err, msg)
		}
	}
	return workers
}
