package gloo

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/netns_tests/topo"
)

// requireTorch fails (not skips) the test when Debian's python3-torch is missing: CI installs it.
func requireTorch(tb testing.TB) {
	tb.Helper()
	if err := Available(DefaultPython); err != nil {
		tb.Fatalf("Gloo baseline unavailable: %v", err)
	}
}

// newTopo builds a W-worker topology as the benchmark runs Gloo on (plain kernel forwarding, the
// kernel's default offloads) and checks on cleanup that nothing is left behind.
func newTopo(tb testing.TB, workers int) *topo.Topology {
	tb.Helper()
	prefix := topo.NewPrefix()
	tp, err := topo.New(topo.Config{Prefix: prefix, Workers: workers, KernelOffloads: true})
	if err != nil {
		tb.Fatalf("topo.New: %v", err)
	}
	tb.Cleanup(func() {
		if err := tp.Close(); err != nil {
			tb.Errorf("topology Close: %v", err)
		}
		if left, err := topo.Leftovers(prefix); err != nil || len(left) != 0 {
			tb.Errorf("namespaces left behind: %v (%v)", left, err)
		}
	})
	return tp
}

// childOfUs reports whether process pid (a /proc entry name) was started by this test process:
// ranks are `ip netns exec` children, which exec the interpreter in place.
func childOfUs(pid string) bool {
	b, err := os.ReadFile(filepath.Join("/proc", pid, "stat"))
	if err != nil {
		return false
	}
	// pid (comm) state ppid ...: comm may hold spaces, so parse after its closing parenthesis.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return false
	}
	f := strings.Fields(string(b[i+1:]))
	return len(f) > 1 && f[1] == strconv.Itoa(os.Getpid())
}

// processesRunning returns the PIDs of live processes this test started whose command line
// mentions s.
func processesRunning(tb testing.TB, s string) []int {
	tb.Helper()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		tb.Fatal(err)
	}
	var out []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil || !bytes.Contains(b, []byte(s)) || !childOfUs(e.Name()) {
			continue // another test binary (go test runs packages in parallel) has its own ranks
		}
		out = append(out, pid)
	}
	return out
}

func TestGlooAllReduce(t *testing.T) {
	requireTorch(t)
	tp := newTopo(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()

	start := time.Now()
	g, err := Start(ctx, tp, Options{})
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Logf("2 ranks (torch %s) ready in %v", g.TorchVersion(), time.Since(start).Round(time.Millisecond))
	script := g.ScriptPath()
	pids := g.PIDs()
	closed := false
	defer func() {
		if !closed {
			_ = g.Close()
		}
	}()
	if g.Size() != 2 || len(pids) != 2 {
		t.Fatalf("Size %d, PIDs %v", g.Size(), pids)
	}
	// `ip netns exec` execs python: the PIDs are the interpreters, inside the worker namespaces.
	for i, pid := range pids {
		link, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/net", pid))
		if err != nil {
			t.Fatal(err)
		}
		var st, want os.FileInfo
		if st, err = os.Stat(fmt.Sprintf("/proc/%d/ns/net", pid)); err == nil {
			want, err = os.Stat(filepath.Join(topo.NetnsDir, tp.Workers[i].NSName))
		}
		if err != nil || !os.SameFile(st, want) {
			t.Errorf("rank %d (pid %d) is in %s, not in %s (%v)", i, pid, link, tp.Workers[i].NSName, err)
		}
		comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
		if !strings.HasPrefix(string(comm), "python") {
			t.Errorf("rank %d pid %d is %q, want python", i, pid, comm)
		}
	}
	// The leftover checks below see exactly these ranks while they live.
	if running := processesRunning(t, script); len(running) != 2 {
		t.Errorf("processesRunning sees %v, want the two ranks %v", running, pids)
	}

	for _, n := range []int{1000, 1 << 20} {
		if err := g.Check(ctx, n); err != nil {
			t.Fatalf("Check(%d): %v", n, err)
		}
		times, err := g.AllReduce(ctx, n, 3)
		if err != nil {
			t.Fatalf("AllReduce(%d): %v", n, err)
		}
		if len(times) != 3 {
			t.Fatalf("AllReduce(%d): %d times, want 3", n, len(times))
		}
		for i, d := range times {
			if d <= 0 || d > 30*time.Second {
				t.Errorf("AllReduce(%d) iteration %d took %v", n, i, d)
			}
		}
		t.Logf("n=%d (%d KiB): %v", n, 4*n>>10, times)
	}
	cpu, err := g.CPUTime()
	if err != nil || cpu <= 0 {
		t.Errorf("CPUTime = %v, %v; want > 0", cpu, err)
	}
	t.Logf("rank CPU so far: %v", cpu)

	if _, err := g.AllReduce(ctx, 0, 1); err == nil {
		t.Error("AllReduce(0, 1) succeeded")
	}

	closed = true
	if err := g.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := g.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if _, err := g.AllReduce(ctx, 10, 1); !errors.Is(err, ErrClosed) {
		t.Errorf("AllReduce after Close = %v, want ErrClosed", err)
	}
	after, err := g.CPUTime()
	if err != nil || after < cpu {
		t.Errorf("CPUTime after Close = %v, %v; want >= %v", after, err, cpu)
	}
	if left := processesRunning(t, script); len(left) != 0 {
		t.Errorf("rank processes still running: %v", left)
	}
	for _, pid := range pids {
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); err == nil {
			t.Errorf("pid %d still exists", pid)
		}
	}
	if _, err := os.Stat(script); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("script %s not removed: %v", script, err)
	}
}

func TestStartFailures(t *testing.T) {
	tp := newTopo(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	// An interpreter that does not exist: every rank exits at once.
	if g, err := Start(ctx, tp, Options{Python: "/nonexistent/python3"}); err == nil {
		g.Close()
		t.Fatal("Start with a missing interpreter succeeded")
	} else if !strings.Contains(err.Error(), "exited") {
		t.Errorf("unexpected error: %v", err)
	}
	if left := processesRunning(t, "xdpagg-gloo-"); len(left) != 0 {
		t.Errorf("processes left: %v", left)
	}

	// The context ends before the ranks have even imported torch: Start must give up and kill
	// the ranks.
	short, cancelShort := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancelShort()
	if g, err := Start(short, tp, Options{}); err == nil {
		g.Close()
		t.Fatal("Start with an expired context succeeded")
	} else if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Start with a short context: %v, want DeadlineExceeded", err)
	}
	if left := processesRunning(t, "xdpagg-gloo-"); len(left) != 0 {
		t.Errorf("processes left: %v", left)
	}
}

// A context that ends mid-command breaks the group; Close then kills the ranks at once.
func TestCancelBreaksGroup(t *testing.T) {
	requireTorch(t)
	tp := newTopo(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	g, err := Start(ctx, tp, Options{})
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	script := g.ScriptPath()
	short, cancelShort := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancelShort()
	if _, err := g.AllReduce(short, 1<<20, 100000); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("AllReduce with a short context = %v, want DeadlineExceeded", err)
	}
	if err := g.Check(ctx, 10); !errors.Is(err, ErrBroken) {
		t.Errorf("Check on a broken group = %v, want ErrBroken", err)
	}
	start := time.Now()
	if err := g.Close(); err != nil {
		t.Errorf("Close of a broken group: %v", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("Close of a broken group took %v", d)
	}
	if left := processesRunning(t, script); len(left) != 0 {
		t.Errorf("rank processes still running: %v", left)
	}
}

func TestAvailable(t *testing.T) {
	err := Available("/nonexistent/python3")
	if err == nil || !strings.Contains(err.Error(), "apt-get install python3-torch") {
		t.Errorf("Available(missing) = %v", err)
	}
}

func TestProcCPU(t *testing.T) {
	// Burn a little CPU so that our own counters are non-zero.
	deadline := time.Now().Add(30 * time.Millisecond)
	for x := 0; time.Now().Before(deadline); x++ {
		_ = x * x
	}
	d, err := procCPU(os.Getpid())
	if err != nil || d <= 0 {
		t.Errorf("procCPU(self) = %v, %v", d, err)
	}
	if _, err := procCPU(1 << 30); err == nil {
		t.Error("procCPU of a missing pid succeeded")
	}
}

// BenchmarkAllReduce reports Gloo allreduce times (max over ranks per iteration) for W=2 and 4
// ranks at 40 KB and 4 MiB of float32. Run: go test ./bench/gloo -run - -bench . -benchtime 20x
func BenchmarkAllReduce(b *testing.B) {
	requireTorch(b)
	for _, w := range []int{2, 4} {
		b.Run(fmt.Sprintf("W=%d", w), func(b *testing.B) {
			tp := newTopo(b, w)
			ctx := context.Background()
			g, err := Start(ctx, tp, Options{})
			if err != nil {
				b.Fatal(err)
			}
			defer g.Close()
			for _, n := range []int{10240, 1 << 20} {
				b.Run(fmt.Sprintf("n=%d", n), func(b *testing.B) {
					times, err := g.AllReduce(ctx, n, b.N)
					if err != nil {
						b.Fatal(err)
					}
					var sum time.Duration
					for _, d := range times {
						sum += d
					}
					slices.Sort(times)
					b.ReportMetric(float64(sum.Nanoseconds())/float64(len(times)), "mean-ns/allreduce")
					b.ReportMetric(float64(times[len(times)/2].Nanoseconds()), "p50-ns/allreduce")
					b.ReportMetric(float64(times[0].Nanoseconds()), "min-ns/allreduce")
				})
			}
		})
	}
}
