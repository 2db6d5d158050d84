package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/hostlib"
	"github.com/xdpagg/xdpagg/netns_tests/testbed"
	"github.com/xdpagg/xdpagg/wire"
)

// ProfileOptions configures Profile: one xdpagg testbed, many allreduces of one size, so that a
// whole-system profiler (perf record -a, a Go CPU profile) sees the steady state rather than
// the set-up and teardown of Run's per-round environments.
type ProfileOptions struct {
	Workers    int // default 4
	Bytes      int // default 4 MiB
	MTU        int // default DefaultMTU
	Allreduces int // per phase (default 150)
	// Host-side tuning, as in Options.
	BusyPoll     time.Duration
	SocketBuffer int
	ThreadedNAPI bool
	// Ready, if set, is called after the warm-up, right before the timed phase (e.g. to start
	// a profiler); Done right after it.
	Ready, Done func()
}

// ProfileResult is where the CPU of one allreduce goes, by the kernel's own accounting.
type ProfileResult struct {
	Workers, Bytes, MTU, Allreduces int
	PacketsPerWorker                int // DATA packets each worker sends per allreduce
	// Timed phase: per allreduce.
	MedianMs, P10Ms, P90Ms float64
	// Machine-wide /proc/stat time per allreduce (ms), by field (user, system, softirq, idle,
	// ...): on a shared machine this includes everyone's load.
	MachineMs map[string]float64
	OwnMs     float64 // this process (workers' goroutines and the syscalls' softirq work) and ksoftirqd
	// The workers' counters per allreduce, all workers together: DATA packets sent, of them
	// resent, UDP GSO messages they went in, and results received.
	DataSent, Retransmits, GSOMessages, Results float64
	Softirqs                                    map[string]float64 // /proc/softirqs raised per allreduce
	// Second phase, with the kernel's BPF run-time statistics on (they cost two clock reads per
	// program run, so they are kept out of the timed phase): per program, runs and ms per
	// allreduce and ns per run.
	BPF []ProfileProgram
}

// ProfileProgram is one XDP program's share of an allreduce.
type ProfileProgram struct {
	Name             string
	RunsPerAllreduce float64
	MsPerAllreduce   float64
	NsPerRun         float64
}

// Profile runs opts.Allreduces timed allreduces and as many with BPF statistics on, on one
// testbed, every result checked.
func Profile(ctx context.Context, opts ProfileOptions) (res ProfileResult, err error) {
	if opts.Workers == 0 {
		opts.Workers = 4
	}
	if opts.Bytes == 0 {
		opts.Bytes = 4 << 20
	}
	if opts.MTU == 0 {
		opts.MTU = DefaultMTU
	}
	if opts.Allreduces == 0 {
		opts.Allreduces = 150
	}
	switch {
	case opts.Bytes <= 0 || opts.Bytes%4 != 0:
		return res, fmt.Errorf("%w: profile: size %d bytes: use a positive multiple of 4", ErrConfig, opts.Bytes)
	case opts.Workers < 1 || opts.Workers > wire.MaxWorkers:
		return res, fmt.Errorf("%w: profile: %d workers: use 1..%d", ErrConfig, opts.Workers, wire.MaxWorkers)
	case opts.MTU < 576 || opts.MTU > DefaultMTU:
		return res, fmt.Errorf("%w: profile: MTU %d: use 576..%d", ErrConfig, opts.MTU, DefaultMTU)
	case opts.Allreduces < 0:
		return res, fmt.Errorf("%w: profile: %d allreduces", ErrConfig, opts.Allreduces)
	}
	// Unshaped, the workers on their UDP sockets.
	bed, err := xdpaggBed(Options{MTU: opts.MTU, BusyPoll: opts.BusyPoll, SocketBuffer: opts.SocketBuffer,
		ThreadedNAPI: opts.ThreadedNAPI}, opts.Workers, 0, false)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, bed.Close()) }()
	n := opts.Bytes / 4
	pristine, ref := makeInputs(opts.Workers, n, uint64(opts.Workers)<<32|uint64(n))
	work := make([][]float32, opts.Workers)
	for i := range work {
		work[i] = make([]float32, n)
	}
	var copyCPU float64 // restoring the inputs: not the allreduce's, taken out of OwnMs
	run := func() (time.Duration, error) {
		c0 := selfCPU()
		for i := range work {
			copy(work[i], pristine[i]) // AllReduce works in place
		}
		copyCPU += selfCPU() - c0
		return bed.AllReduce(ctx, work)
	}
	for range 5 {
		if _, err := run(); err != nil {
			return res, fmt.Errorf("warm-up: %w", err)
		}
	}
	if err := checkWithin(work, ref, float64(opts.Workers)*0x1p-25, 0x1p-23); err != nil {
		return res, fmt.Errorf("wrong result: %w", err)
	}
	res = ProfileResult{Workers: opts.Workers, Bytes: opts.Bytes, MTU: opts.MTU, Allreduces: opts.Allreduces,
		PacketsPerWorker: (n + bed.ValuesPerPacket() - 1) / bed.ValuesPerPacket()}
	runtime.GC()
	settle()
	if opts.Ready != nil {
		opts.Ready()
	}
	copyCPU = 0
	ws0 := workerTotals(bed)
	st0, sq0, own0 := statFields(), softirqCounts(), ownCPU()
	ms := make([]float64, 0, opts.Allreduces)
	for range opts.Allreduces {
		d, err := run()
		if err != nil {
			return res, err
		}
		ms = append(ms, d.Seconds()*1e3)
	}
	st1, sq1, own1 := statFields(), softirqCounts(), ownCPU()
	ws1 := workerTotals(bed)
	if opts.Done != nil {
		opts.Done()
	}
	per := 1 / float64(opts.Allreduces)
	sort.Float64s(ms)
	res.MedianMs, res.P10Ms, res.P90Ms = quantile(ms, 0.5), quantile(ms, 0.1), quantile(ms, 0.9)
	res.MachineMs = map[string]float64{}
	for i, name := range statNames {
		if i < len(st0) && i < len(st1) {
			res.MachineMs[name] = (st1[i] - st0[i]) * 1e3 * per
		}
	}
	res.OwnMs = (own1 - own0 - copyCPU) * 1e3 * per
	res.DataSent = float64(ws1.DataSent-ws0.DataSent) * per
	res.Retransmits = float64(ws1.Retransmits-ws0.Retransmits) * per
	res.GSOMessages = float64(ws1.GSOMessages-ws0.GSOMessages) * per
	res.Results = float64(ws1.ResultsReceived-ws0.ResultsReceived) * per
	res.Softirqs = map[string]float64{}
	for k, v := range sq1 {
		if d := (v - sq0[k]) * per; d > 0 {
			res.Softirqs[k] = d
		}
	}

	stats, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err != nil {
		return res, fmt.Errorf("BPF run-time statistics: %w", err)
	}
	defer stats.Close()
	progs := []struct {
		name string
		p    *ebpf.Program
	}{{"xdpagg_switch", bed.Switch.Objects.XdpaggSwitch}, {"xdpagg_egress", bed.Switch.Objects.XdpaggEgress},
		{"xdpagg_pass", bed.Switch.Objects.XdpaggPass}}
	before := make([]*ebpf.ProgramStats, len(progs))
	for i, p := range progs {
		if before[i], err = p.p.Stats(); err != nil {
			return res, fmt.Errorf("%s statistics: %w", p.name, err)
		}
	}
	for range opts.Allreduces {
		if _, err := run(); err != nil {
			return res, err
		}
	}
	for i, p := range progs {
		after, err := p.p.Stats()
		if err != nil {
			return res, fmt.Errorf("%s statistics: %w", p.name, err)
		}
		runs, rt := after.RunCount-before[i].RunCount, after.Runtime-before[i].Runtime
		res.BPF = append(res.BPF, ProfileProgram{Name: p.name, RunsPerAllreduce: float64(runs) * per,
			MsPerAllreduce: rt.Seconds() * 1e3 * per, NsPerRun: float64(rt.Nanoseconds()) / float64(max(runs, 1))})
	}
	return res, nil
}

// Table prints the result.
func (r ProfileResult) Table(w io.Writer) {
	fmt.Fprintf(w, "xdpagg W=%d, %s, MTU %d: %d allreduces, %d DATA packets per worker each\n",
		r.Workers, humanBytes(r.Bytes), r.MTU, r.Allreduces, r.PacketsPerWorker)
	fmt.Fprintf(w, "allreduce: median %.2f ms (p10 %.2f, p90 %.2f)\n", r.MedianMs, r.P10Ms, r.P90Ms)
	fmt.Fprintf(w, "CPU per allreduce: this process %.1f ms (%.2f µs per DATA packet, %.2f ns per byte reduced)\n",
		r.OwnMs, r.OwnMs*1e3/float64(r.Workers*r.PacketsPerWorker), r.OwnMs*1e6/float64(r.Workers*r.Bytes))
	fmt.Fprintf(w, "workers per allreduce: %.0f DATA packets sent (%.0f resent) in %.0f GSO messages (%.1f packets each), %.0f results received\n",
		r.DataSent, r.Retransmits, r.GSOMessages, r.DataSent/max(r.GSOMessages, 1), r.Results)
	fmt.Fprint(w, "machine (/proc/stat, everyone's load) per allreduce:")
	for _, name := range statNames {
		if v := r.MachineMs[name]; v >= 0.05 {
			fmt.Fprintf(w, " %s %.1f ms", name, v)
		}
	}
	fmt.Fprintln(w)
	keys := make([]string, 0, len(r.Softirqs))
	for k := range r.Softirqs {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	fmt.Fprint(w, "softirqs raised per allreduce:")
	for _, k := range keys {
		fmt.Fprintf(w, " %s %.0f", k, r.Softirqs[k])
	}
	fmt.Fprintln(w)
	for _, p := range r.BPF {
		fmt.Fprintf(w, "  %-14s %7.0f runs, %5.2f ms per allreduce, %4.0f ns per run\n", p.Name, p.RunsPerAllreduce, p.MsPerAllreduce, p.NsPerRun)
	}
}

// workerTotals sums the counters Profile reports over the bed's workers.
func workerTotals(bed *testbed.Bed) (t hostlib.WorkerStats) {
	for _, w := range bed.Workers {
		s := w.Stats()
		t.DataSent += s.DataSent
		t.Retransmits += s.Retransmits
		t.GSOMessages += s.GSOMessages
		t.ResultsReceived += s.ResultsReceived
	}
	return t
}

var statNames = []string{"user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"}

// statFields is /proc/stat's "cpu" line in seconds, by statNames.
func statFields() []float64 { return statFieldsOn(nil) }

// statFieldsOn is /proc/stat's fields summed over cpus (all CPUs when empty), as parseStat;
// nil if it cannot be read.
func statFieldsOn(cpus []int) []float64 {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return nil
	}
	f, _ := parseStat(string(b), cpus)
	return f
}

// softirqCounts is /proc/softirqs summed over CPUs.
func softirqCounts() map[string]float64 {
	b, err := os.ReadFile("/proc/softirqs")
	if err != nil {
		return nil
	}
	m := map[string]float64{}
	lines := strings.Split(string(b), "\n")
	for _, l := range lines[min(1, len(lines)):] {
		f := strings.Fields(l)
		if len(f) < 2 {
			continue
		}
		var s float64
		for _, x := range f[1:] {
			v, _ := strconv.ParseFloat(x, 64)
			s += v
		}
		m[strings.TrimSuffix(f[0], ":")] = s
	}
	return m
}

// selfCPU is this process's user and system time in seconds.
func selfCPU() float64 {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return float64(ru.Utime.Nano()+ru.Stime.Nano()) / 1e9
}
