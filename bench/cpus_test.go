package bench

import (
	"errors"
	"math"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestParseCPUList(t *testing.T) {
	for in, want := range map[string][]int{
		"0":         {0},
		"0,1":       {0, 1},
		"0-3":       {0, 1, 2, 3},
		" 3,0-1,1 ": {0, 1, 3},
		"0-1,4\n":   {0, 1, 4}, // as /sys/devices/system/cpu/online writes it
		"2-2":       {2},
	} {
		got, err := ParseCPUList(in)
		if err != nil || !slices.Equal(got, want) {
			t.Errorf("ParseCPUList(%q) = %v, %v; want %v", in, got, err, want)
		}
		if err == nil {
			if back, err := ParseCPUList(FormatCPUList(got)); err != nil || !slices.Equal(back, got) {
				t.Errorf("FormatCPUList(%v) = %q reads back as %v, %v", got, FormatCPUList(got), back, err)
			}
		}
	}
	for _, in := range []string{"", ",", "a", "-1", "1-", "3-1", "0-x", "1.5", "100000"} {
		if got, err := ParseCPUList(in); !errors.Is(err, ErrConfig) {
			t.Errorf("ParseCPUList(%q) = %v, %v; want ErrConfig", in, got, err)
		}
	}
	if got := FormatCPUList([]int{0, 1, 2, 5, 7, 8}); got != "0-2,5,7-8" {
		t.Errorf("FormatCPUList = %q", got)
	}
}

func TestCheckCPUs(t *testing.T) {
	online := []int{0, 1}
	if err := checkCPUs([]int{0, 1}, online); err != nil {
		t.Errorf("online CPUs refused: %v", err)
	}
	err := checkCPUs([]int{1, 2}, online)
	if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "CPU 2 is not online (online: 0-1)") {
		t.Errorf("offline CPU: %v", err)
	}
}

const statSample = `cpu  1000 10 500 8000 20 0 30 0 0 0
cpu0 600 10 300 3000 10 0 20 0 0 0
cpu1 400 0 200 5000 10 0 10 0 0 0
intr 12345 0 0
ctxt 999
`

func TestParseStat(t *testing.T) {
	all, err := parseStat(statSample, nil)
	if err != nil || len(all) != 10 || all[0] != 10 || all[3] != 80 {
		t.Fatalf("all CPUs: %v, %v", all, err)
	}
	// user + nice + system + softirq; idle and iowait are not busy.
	if b := busyOf(all); math.Abs(b-15.4) > 1e-9 {
		t.Errorf("busy of all = %v, want 15.4", b)
	}
	one, err := parseStat(statSample, []int{1})
	if err != nil || math.Abs(busyOf(one)-6.1) > 1e-9 {
		t.Errorf("busy of CPU 1 = %v (%v), want 6.1", busyOf(one), err)
	}
	both, err := parseStat(statSample, []int{0, 1})
	if err != nil || !slices.Equal(both, all) {
		t.Errorf("CPUs 0,1 = %v (%v), want the all-CPU line %v", both, err, all)
	}
	if _, err := parseStat(statSample, []int{0, 2}); err == nil {
		t.Error("a CPU without a line was not reported")
	}
	if f, err := parseStat("intr 1\n", nil); err == nil {
		t.Errorf("no cpu line: %v, no error", f)
	}
}

func TestCoresBusy(t *testing.T) {
	for _, c := range []struct{ busy, wall, want float64 }{
		{3, 2, 1.5}, {0, 2, 0}, {1, 0, 0}, {16, 1, 16},
	} {
		if got := coresBusy(c.busy, c.wall); got != c.want {
			t.Errorf("coresBusy(%v, %v) = %v, want %v", c.busy, c.wall, got, c.want)
		}
	}
	var m *coreMeter // a nil meter measures nothing and does not fail
	m.start()
	m.stop()
	if c, sd := (&coreMeter{cpus: []int{0, 1}, busy: 3, wall: 4, intervals: 3}).coresBusy(); c != 0.75 || math.Abs(sd-0.01/4) > 1e-12 {
		t.Errorf("coreMeter.coresBusy = %v ± %v, want 0.75 ± 0.0025", c, sd)
	}
	// 10 ms/√6 per CPU and interval: 9 intervals of 2 CPUs over 45 ms (a 4 MiB cell on 2
	// cores) is ±0.39 cores; 5 intervals of 16 CPUs over 0.5 s is ±0.073.
	for _, c := range []struct {
		n, k       int
		wall, want float64
	}{{1, 6, 0.01, 1}, {9, 2, 0.045, 0.3849}, {5, 16, 0.5, 0.0730}, {3, 2, 0, 0}} {
		if got := coresBusyError(c.n, c.k, c.wall); math.Abs(got-c.want) > 1e-4 {
			t.Errorf("coresBusyError(%d, %d, %v) = %v, want %v", c.n, c.k, c.wall, got, c.want)
		}
	}
}

// TestPinCPUs pins the test process to one CPU and checks every thread and a child started
// afterwards, then that the previous affinity comes back.
func TestPinCPUs(t *testing.T) {
	online, err := onlineCPUs()
	if err != nil {
		t.Fatal(err)
	}
	var before unix.CPUSet
	if err := unix.SchedGetaffinity(0, &before); err != nil {
		t.Fatal(err)
	}
	cpu := cpuList(before)[len(cpuList(before))-1]
	if _, err := pinCPUs([]int{online[len(online)-1] + 1}); !errors.Is(err, ErrConfig) {
		t.Errorf("an offline CPU: %v, want ErrConfig", err)
	}
	restore, err := pinCPUs([]int{cpu})
	if err != nil {
		t.Fatal(err)
	}
	restored := false
	t.Cleanup(func() {
		if !restored {
			restore()
		}
	})
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Fatal(err)
	}
	for _, task := range tasks {
		tid, _ := strconv.Atoi(task.Name())
		var set unix.CPUSet
		if err := unix.SchedGetaffinity(tid, &set); err == nil && !slices.Equal(cpuList(set), []int{cpu}) {
			t.Errorf("thread %d runs on %v, want [%d]", tid, cpuList(set), cpu)
		}
	}
	out, err := exec.Command("grep", "Cpus_allowed_list", "/proc/self/status").Output()
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.TrimSpace(strings.TrimPrefix(string(out), "Cpus_allowed_list:")); got != strconv.Itoa(cpu) {
		t.Errorf("a child runs on %q, want %d", got, cpu)
	}
	restored = true
	if err := restore(); err != nil {
		t.Fatal(err)
	}
	var after unix.CPUSet
	if err := unix.SchedGetaffinity(0, &after); err != nil || after != before {
		t.Errorf("affinity after restore: %v (%v), want %v", cpuList(after), err, cpuList(before))
	}
}
