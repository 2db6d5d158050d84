package bench

import (
	"errors"
	"fmt"
	"math"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// ParseCPUList reads a CPU list in the kernel's list format (cpuset(7)): comma-separated CPU
// numbers and ranges, e.g. "0", "0,1", "0-3", "0-1,4". The result is sorted, without duplicates.
func ParseCPUList(list string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(strings.TrimSpace(list), ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		lo, hi, isRange := strings.Cut(f, "-")
		a, err := strconv.Atoi(lo)
		b := a
		if err == nil && isRange {
			b, err = strconv.Atoi(hi)
		}
		if err != nil || a < 0 || b < a || b >= cpuSetSize {
			return nil, fmt.Errorf("%w: CPU list %q: %q is not a CPU number or range (use e.g. 0 or 0,1 or 0-3)", ErrConfig, list, f)
		}
		for c := a; c <= b; c++ {
			out = append(out, c)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%w: CPU list %q names no CPU (use e.g. 0 or 0,1 or 0-3)", ErrConfig, list)
	}
	slices.Sort(out)
	return slices.Compact(out), nil
}

// cpuSetSize is the number of CPUs unix.CPUSet can hold.
const cpuSetSize = len(unix.CPUSet{}) * 64

// checkCPUs says which of cpus is not among online.
func checkCPUs(cpus, online []int) error {
	for _, c := range cpus {
		if !slices.Contains(online, c) {
			return fmt.Errorf("%w: CPU %d is not online (online: %s)", ErrConfig, c, FormatCPUList(online))
		}
	}
	return nil
}

// FormatCPUList writes sorted CPUs in the kernel's list format ("0-3,6").
func FormatCPUList(cpus []int) string {
	var parts []string
	for i := 0; i < len(cpus); {
		j := i
		for j+1 < len(cpus) && cpus[j+1] == cpus[j]+1 {
			j++
		}
		if j == i {
			parts = append(parts, strconv.Itoa(cpus[i]))
		} else {
			parts = append(parts, fmt.Sprintf("%d-%d", cpus[i], cpus[j]))
		}
		i = j + 1
	}
	return strings.Join(parts, ",")
}

// onlineCPUs is the machine's online CPUs (/sys/devices/system/cpu/online).
func onlineCPUs() ([]int, error) {
	b, err := os.ReadFile("/sys/devices/system/cpu/online")
	if err != nil {
		return nil, fmt.Errorf("online CPUs: %w", err)
	}
	return ParseCPUList(string(b))
}

// coreCount is the machine's online CPUs, or runtime.NumCPU (this process's affinity at start)
// where /sys cannot be read.
func coreCount() int {
	if on, err := onlineCPUs(); err == nil {
		return len(on)
	}
	return runtime.NumCPU()
}

// pinCPUs confines every thread of this process to cpus (after checking them against the
// online CPUs) and returns a function that puts the previous affinity back. Children started
// afterwards (Gloo's ranks) inherit the mask from the thread that forks them. No cpus: nothing
// to do.
//
// sched_setaffinity acts on one thread, and a Go process has several, created by the runtime
// at any time from whichever thread needs one; a new thread inherits its creator's mask. So
// every thread in /proc/self/task is set, and the listing repeated until a pass finds none left
// to set: a thread created during a pass by a thread not yet pinned is caught by the next one,
// and once every thread is pinned every new thread is born pinned. GOMAXPROCS follows the new
// mask (runtime.SetDefaultGOMAXPROCS), as in a process started under it.
func pinCPUs(cpus []int) (restore func() error, err error) {
	if len(cpus) == 0 {
		return func() error { return nil }, nil
	}
	online, err := onlineCPUs()
	if err != nil {
		return nil, err
	}
	if err := checkCPUs(cpus, online); err != nil {
		return nil, err
	}
	var prev unix.CPUSet
	if err := unix.SchedGetaffinity(0, &prev); err != nil {
		return nil, fmt.Errorf("CPU affinity: %w", err)
	}
	var set unix.CPUSet
	for _, c := range cpus {
		set.Set(c)
	}
	if err := setAllThreads(set); err != nil {
		return nil, errors.Join(err, setAllThreads(prev))
	}
	runtime.SetDefaultGOMAXPROCS()
	return func() error {
		err := setAllThreads(prev)
		runtime.SetDefaultGOMAXPROCS()
		return err
	}, nil
}

// setAllThreads sets every thread's affinity to set (see pinCPUs) and checks that the kernel
// kept all of it: a cpuset cgroup may allow fewer CPUs, which sched_setaffinity drops silently.
func setAllThreads(set unix.CPUSet) error {
	for pass := 0; ; pass++ {
		tasks, err := os.ReadDir("/proc/self/task")
		if err != nil {
			return fmt.Errorf("CPU affinity: list threads: %w", err)
		}
		changed := false
		for _, t := range tasks {
			tid, err := strconv.Atoi(t.Name())
			if err != nil {
				continue
			}
			var cur unix.CPUSet
			if err := unix.SchedGetaffinity(tid, &cur); err != nil {
				continue // the thread has exited
			}
			if cur == set {
				continue
			}
			changed = true
			if err := unix.SchedSetaffinity(tid, &set); err != nil {
				if err == unix.ESRCH {
					continue
				}
				return fmt.Errorf("CPU affinity of thread %d: %w", tid, err)
			}
			if err := unix.SchedGetaffinity(tid, &cur); err == nil && cur != set {
				return fmt.Errorf("%w: CPU affinity: this process may not run on all of CPUs %s (its cpuset allows fewer)",
					ErrConfig, FormatCPUList(cpuList(set)))
			}
		}
		if !changed {
			return nil
		}
		if pass > 100 {
			return fmt.Errorf("CPU affinity: threads kept appearing unpinned")
		}
	}
}

// cpuList is the CPUs in set, sorted.
func cpuList(set unix.CPUSet) []int {
	var out []int
	for c := range cpuSetSize {
		if set.IsSet(c) {
			out = append(out, c)
		}
	}
	return out
}

// parseStat sums the fields (statNames order, in seconds: USER_HZ ticks / 100) of /proc/stat's
// per-CPU lines "cpuN" of the CPUs in cpus, or returns the all-CPU line "cpu" when cpus is
// empty. A CPU without a line is an error.
func parseStat(stat string, cpus []int) ([]float64, error) {
	var out []float64
	found := 0
	for _, line := range strings.Split(stat, "\n") {
		f := strings.Fields(line)
		if len(f) < 2 || !strings.HasPrefix(f[0], "cpu") {
			continue
		}
		if len(cpus) == 0 {
			if f[0] != "cpu" {
				continue
			}
		} else if n, err := strconv.Atoi(f[0][3:]); err != nil || !slices.Contains(cpus, n) {
			continue
		}
		found++
		for i, v := range f[1:] {
			x, _ := strconv.ParseFloat(v, 64)
			if i == len(out) {
				out = append(out, 0)
			}
			out[i] += x // ticks, summed exactly
		}
		if len(cpus) == 0 {
			break
		}
	}
	if want := max(len(cpus), 1); found != want {
		return nil, fmt.Errorf("/proc/stat: %d of %d CPU lines found", found, want)
	}
	for i := range out {
		out[i] /= 100 // USER_HZ
	}
	return out, nil
}

// busyOf is the busy time (all but idle and iowait) in seconds of a parseStat result.
func busyOf(fields []float64) float64 {
	var sum float64
	for i, x := range fields {
		if i != 3 && i != 4 {
			sum += x
		}
	}
	return sum
}

// coresBusy is how many cores were busy on average: busy CPU-seconds over wall seconds.
func coresBusy(busy, wall float64) float64 {
	if wall <= 0 {
		return 0
	}
	return busy / wall
}

// coreMeter sums the busy time of some CPUs (all when cpus is empty) and the wall time over
// timed intervals, each between start and stop. A nil meter measures nothing.
type coreMeter struct {
	cpus       []int
	busy, wall float64
	intervals  int
	busy0      float64
	start0     time.Time
}

func (m *coreMeter) start() {
	if m != nil {
		m.busy0, m.start0 = busyCPUOn(m.cpus), time.Now()
	}
}

func (m *coreMeter) stop() {
	if m != nil {
		m.wall += time.Since(m.start0).Seconds()
		m.busy += busyCPUOn(m.cpus) - m.busy0
		m.intervals++
	}
}

// coresBusy is how many of the CPUs were busy on average over the intervals, and the standard
// deviation of that figure that /proc/stat's rounding alone causes (coresBusyError).
func (m *coreMeter) coresBusy() (cores, stddev float64) {
	k := len(m.cpus)
	if k == 0 {
		k = coreCount()
	}
	return coresBusy(m.busy, m.wall), coresBusyError(m.intervals, k, m.wall)
}

// coresBusyError is the standard deviation of a cores-busy figure from /proc/stat's rounding
// alone, over n intervals of k CPUs lasting wall seconds in all. /proc/stat counts each CPU's
// time in whole 10 ms units (USER_HZ), so a CPU's busy time over an interval, the difference of
// two readings, is off by the difference of two roundings, each uniform in [0, 10 ms) when the
// intervals fall at random against the counters: a standard deviation of 10 ms/√6 per CPU and
// interval, and √(n·k) times that summed. Short intervals (a 40 KB allreduce takes well under
// a millisecond) are far shorter than the unit, so their figure says little.
func coresBusyError(n, k int, wall float64) float64 {
	if wall <= 0 {
		return 0
	}
	return statUnit / math.Sqrt(6) * math.Sqrt(float64(n*k)) / wall
}

// statUnit is /proc/stat's unit in seconds (USER_HZ = 100).
const statUnit = 0.01
