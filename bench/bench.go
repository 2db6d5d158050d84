// Package bench measures xdpagg against the alternatives a user runs today, side by side in one
// run. Every mode runs in the environment that suits it best (Environments): xdpagg on the XDP
// testbed, the baselines on a plain kernel-forwarding topology with no XDP program and default
// offloads. Rounds are interleaved (A B C D, B C D A, ...) so that the ratios share the
// machine's drift, and each mode builds and tears down its environment within its turn of a
// round, so no other mode's processes are alive while it is timed. Modes:
//
//	xdpagg  workers -> XDP switch -> workers (hostlib.Worker through the switch)
//	ps      hostlib's parameter server in user space, no switch help (batched syscalls, all cores)
//	ring    ring allreduce among workers over UDP (hostlib.Ring; INCEPTIONN's aggregator-free exchange)
//	gloo    torch.distributed.all_reduce with Gloo over TCP, routed by the switch namespace's kernel
//
// LossCost measures what 0.1% loss costs xdpagg, in paired clean and lossy allreduces.
// Benchmarks print figures; they assert nothing about timings.
package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/netip"
	"os"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/xdpagg/xdpagg/bench/gloo"
	"github.com/xdpagg/xdpagg/hostlib"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/netns_tests/testbed"
	"github.com/xdpagg/xdpagg/netns_tests/topo"
	"github.com/xdpagg/xdpagg/wire"
	"golang.org/x/sys/unix"
)

// Mode names.
const (
	ModeXdpagg = "xdpagg"
	ModePS     = "ps"
	ModeRing   = "ring"
	ModeGloo   = "gloo"
	// ModeXdpaggUDP is xdpagg with workers receiving their results on their UDP sockets, as
	// ModeXdpagg does only on shaped links: the reference of A/B runs of AF_XDP receive
	// (--modes xdpagg,xdpagg-udp; docs/benchmarks.md, "AF_XDP receive").
	ModeXdpaggUDP = "xdpagg-udp"
)

// AllModes in report order: the default set.
var AllModes = []string{ModeXdpagg, ModePS, ModeRing, ModeGloo}

// ExtraModes may be asked for by name; they are not in the default set.
var ExtraModes = []string{ModeXdpaggUDP}

// knownModes is every mode, in report order.
func knownModes() []string { return append(slices.Clone(AllModes), ExtraModes...) }

// Ports of the baselines (the switch intercepts only the xdpagg port).
const (
	psPort       = 9511
	psWorkerPort = 9601
	ringPort     = 9700
)

// ErrConfig reports unusable options.
var ErrConfig = errors.New("invalid benchmark options")

// Options configures a run. Zero values take defaults.
type Options struct {
	Modes   []string // default AllModes
	Bytes   []int    // tensor sizes in bytes (float32): default 40 KB, 4 MiB, 64 MiB
	Workers []int    // default 2, 4, 8
	Rounds  int      // interleaved rounds per (W, size); default 9 (5 for sizes >= 16 MiB)
	Python  string   // interpreter with torch for gloo (default /usr/bin/python3)
	// Progress receives a one-line status as the run proceeds (nil: none).
	Progress io.Writer
	// Window overrides the xdpagg/ps workers' window (0: hostlib's default).
	Window int
	// MTU of every link of the topology (0: DefaultMTU). Every mode gets the same links; the UDP
	// modes fill packets to it (wire.ValuesForMTU).
	MTU int
	// LinkRates are the host-link rates to measure at, in bits/s per direction (topo.ShapeLinks
	// on every mode's topology alike); 0 is unshaped. Default: unshaped only.
	LinkRates []uint64
	// SwitchObject, when set, is a compiled switch object to run instead of the built-in one
	// (loader.Config.Object): A/B runs of switch program changes.
	SwitchObject string
	// Host-side tuning of xdpagg's testbed, for A/B runs (docs/benchmarks.md, Fast path): the
	// workers' WorkerConfig.BusyPoll and SocketBuffer (0: hostlib's defaults), and threaded NAPI
	// on every veth of the testbed (topo.SetThreadedNAPI).
	BusyPoll     time.Duration
	SocketBuffer int
	ThreadedNAPI bool
	// CPUs, when set, confines the run to these CPUs (online ones, e.g. ParseCPUList("0,1")):
	// every thread of this process, and so every child it starts (Gloo's ranks), is pinned to
	// them for the run (pinCPUs), and each cell's CoresBusy counts only them. Empty: every CPU,
	// nothing pinned.
	CPUs []int
}

// DefaultMTU is the benchmark topology's MTU: the largest frame a veth hands XDP as one buffer,
// 832 values a packet. Measured against 1500 (360 values) in one interleaved run, xdpagg W = 4
// took 0.54x the time at 4 MiB and 0.56x at 40 KB (docs/benchmarks.md, Fast path); every mode
// gets the same links.
const DefaultMTU = 3388

// DefaultBytes are the sizes: iSwitch's PPO model, ATP's microbenchmark, a large layer.
var DefaultBytes = []int{40 << 10, 4 << 20, 64 << 20}

func (o Options) withDefaults() Options {
	if len(o.Modes) == 0 {
		o.Modes = AllModes
	}
	if len(o.Bytes) == 0 {
		o.Bytes = DefaultBytes
	}
	if len(o.Workers) == 0 {
		o.Workers = []int{2, 4, 8}
	}
	if o.MTU == 0 {
		o.MTU = DefaultMTU
	}
	if o.Python == "" {
		o.Python = "/usr/bin/python3"
	}
	if len(o.LinkRates) == 0 {
		o.LinkRates = []uint64{0}
	}
	return o
}

// Validate says what to change.
func (o Options) Validate() error {
	for _, m := range o.Modes {
		if !slices.Contains(knownModes(), m) {
			return fmt.Errorf("%w: mode %q: use one of %s", ErrConfig, m, strings.Join(knownModes(), ", "))
		}
	}
	for _, b := range o.Bytes {
		if b < 4 || b%4 != 0 {
			return fmt.Errorf("%w: size %d bytes: use a positive multiple of 4 (float32)", ErrConfig, b)
		}
	}
	for _, w := range o.Workers {
		if w < 2 || w > 32 {
			return fmt.Errorf("%w: %d workers: use 2..32", ErrConfig, w)
		}
	}
	if o.MTU != 0 && (o.MTU < 576 || o.MTU > 3388) {
		return fmt.Errorf("%w: MTU %d: use 576..3388 (the largest frame a veth gives XDP as one buffer)", ErrConfig, o.MTU)
	}
	for _, r := range o.LinkRates {
		if r != 0 && (r < topo.MinLinkRate || r > topo.MaxLinkRate) {
			return fmt.Errorf("%w: link rate %d bit/s: use none or %s..%s", ErrConfig, r,
				FormatRate(topo.MinLinkRate), FormatRate(topo.MaxLinkRate))
		}
	}
	if o.Rounds < 0 {
		return fmt.Errorf("%w: rounds %d: use a positive number", ErrConfig, o.Rounds)
	}
	return nil
}

// Cell is one mode at one (W, size, link rate).
type Cell struct {
	Mode            string    `json:"mode"`
	Workers         int       `json:"workers"`
	Bytes           int       `json:"bytes"`
	LinkRate        uint64    `json:"link_rate_bps"` // every host link shaped to this, each way; 0: unshaped
	Seconds         []float64 `json:"seconds"`
	Median          float64   `json:"median_s"`
	P10             float64   `json:"p10_s"`
	P90             float64   `json:"p90_s"`
	ElementsPerSec  float64   `json:"aggregated_elements_per_s"` // values per worker / median time (SwitchML's metric)
	AlgBWGBps       float64   `json:"algbw_GBps"`                // bytes per worker / median time
	CPUSecPerGB     float64   `json:"cpu_s_per_GB"`              // the mode's own CPU (its processes + ksoftirqd) per GB reduced per worker
	MachineCPUPerGB float64   `json:"machine_cpu_s_per_GB"`      // the whole machine's busy CPU (others' load included) per GB reduced per worker
	// CoresBusy is how many cores were busy on average while the cell's timed runs ran: the
	// busy time (/proc/stat: all but idle and iowait; others' load included) of the counted CPUs
	// (Report.CPUs, or every online CPU) summed over the timed runs, over their wall time summed.
	// CoresBusyErr is the standard deviation of CoresBusy that /proc/stat's 10 ms units alone
	// cause (coresBusyError): large where the timed runs are short.
	CoresBusy    float64 `json:"cores_busy"`
	CoresBusyErr float64 `json:"cores_busy_stddev"`
	// The split of CPUSecPerGB into the workers' side and the switch's side (Report.CPUSplit
	// says what each includes per mode); absent where a side cannot be told apart.
	WorkerCPUPerGB *float64 `json:"worker_cpu_s_per_GB,omitempty"`
	SwitchCPUPerGB *float64 `json:"switch_cpu_s_per_GB,omitempty"`
	Verified       bool     `json:"verified"`
	Error          string   `json:"error,omitempty"`
}

// Ratio compares two modes at one (W, size, link rate) over paired rounds: time(Other) /
// time(Mode), so above 1 means Mode is faster.
type Ratio struct {
	Mode     string  `json:"mode"`
	Other    string  `json:"other"`
	Workers  int     `json:"workers"`
	Bytes    int     `json:"bytes"`
	LinkRate uint64  `json:"link_rate_bps"`
	Median   float64 `json:"median"`
	P10      float64 `json:"p10"`
	P90      float64 `json:"p90"`
	// Theory is the ratio when the links alone set the time (shaped cells of xdpagg against
	// another mode; see LinkBoundRatio), and FromTheory Median/Theory - 1: how far the
	// measurement is from it (the target: within 10%). Zero: no theory.
	Theory     float64 `json:"theory,omitempty"`
	FromTheory float64 `json:"from_theory,omitempty"`
}

// LinkBoundRatio is time(other)/time(xdpagg) for W workers when every host link is the
// bottleneck and each mode moves its bytes at the link's rate in both directions at once: an
// xdpagg worker sends its N bytes and receives the N-byte sum; a ring (and Gloo's ring
// allreduce) sends and receives 2(W-1)/W·N per worker; a parameter server's one link carries
// W·N each way. Headers are alike (every mode fills the same MTU). 0: no theory for the mode.
func LinkBoundRatio(other string, w int) float64 {
	switch other {
	case ModeRing, ModeGloo:
		return 2 * float64(w-1) / float64(w)
	case ModePS:
		return float64(w)
	}
	return 0
}

// Report is a whole run.
type Report struct {
	Started time.Time `json:"started"`
	Machine string    `json:"machine"`
	Rounds  int       `json:"rounds"`
	MTU     int       `json:"mtu"`
	// Cores is the machine's online CPUs; CPUs the ones the run was pinned to (Options.CPUs),
	// which the cells' CoresBusy counts (absent: every online CPU, nothing pinned).
	Cores  int     `json:"cores"`
	CPUs   []int   `json:"cpus,omitempty"`
	Cells  []Cell  `json:"cells"`
	Ratios []Ratio `json:"ratios"`
	// Environments says where each measured mode ran (see the package's Environments).
	Environments map[string]string `json:"environments"`
	// LinkShaping says how shaped cells were shaped (topo.ShapeLinks).
	LinkShaping string `json:"link_shaping,omitempty"`
	// CPUSplit says, per mode, what its worker-side and switch-side CPU figures include.
	CPUSplit map[string]string `json:"cpu_split"`
	Notes    []string          `json:"notes,omitempty"`
}

// Run performs the benchmark.
func Run(ctx context.Context, opts Options) (*Report, error) {
	opts = opts.withDefaults()
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	rep := &Report{Started: time.Now(), Machine: machine(), Rounds: opts.Rounds, MTU: opts.MTU,
		Cores: coreCount(), CPUs: opts.CPUs, Environments: map[string]string{}, CPUSplit: map[string]string{}}
	for _, m := range opts.Modes {
		rep.Environments[m] = Environments[m]
		rep.CPUSplit[m] = CPUSplit[m]
	}
	if slices.ContainsFunc(opts.LinkRates, func(r uint64) bool { return r != 0 }) {
		rep.LinkShaping = LinkShaping
	}
	if slices.Contains(opts.Modes, ModeGloo) {
		if err := gloo.Available(opts.Python); err != nil {
			return nil, fmt.Errorf("%w: gloo mode: %w (or leave gloo out with --modes)", ErrConfig, err)
		}
	}
	unpin, err := pinCPUs(opts.CPUs)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err := unpin(); err != nil {
			rep.Notes = append(rep.Notes, fmt.Sprintf("unpin: %v", err))
		}
	}()
	for _, rate := range opts.LinkRates {
		for _, w := range opts.Workers {
			if err := runWorkers(ctx, opts, w, rate, rep); err != nil {
				return rep, err
			}
		}
	}
	rep.ratios(opts.Modes)
	return rep, nil
}

func (o Options) rounds(bytes int) int {
	if o.Rounds > 0 {
		return o.Rounds
	}
	if bytes >= 16<<20 {
		return 5
	}
	return 9
}

func progress(o Options, format string, a ...any) {
	if o.Progress != nil {
		fmt.Fprintf(o.Progress, "\r\033[K"+format, a...)
	}
}

// runWorkers measures every mode and size at W workers and link rate rate (0: unshaped) in
// interleaved rounds. In each round
// every mode in turn builds its own environment (topology and processes), runs every size once
// after an untimed warm-up, and tears everything down again: no process, socket or thread of one
// mode is alive while another is timed. The order of the modes rotates from round to round so
// that no mode always follows the same one.
func runWorkers(ctx context.Context, opts Options, w int, rate uint64, rep *Report) error {
	type sized struct {
		bytes    int
		pristine [][]float32
		ref      []float64
		work     [][]float32
		cells    map[string]*Cell
		busy     map[string]float64    // the mode's own CPU seconds in timed runs
		machine  map[string]float64    // the machine's busy CPU seconds in timed runs
		cores    map[string]*coreMeter // the counted CPUs over the timed runs
		switched map[string]float64    // the switch's CPU seconds in warm-up runs (switchMeter)
		metered  map[string]int        // warm-up runs whose switch CPU was measured
		rounds   int
	}
	var all []*sized
	maxRounds := 0
	for _, bytes := range opts.Bytes {
		n := bytes / 4
		s := &sized{bytes: bytes, cells: map[string]*Cell{}, busy: map[string]float64{}, machine: map[string]float64{},
			cores: map[string]*coreMeter{}, switched: map[string]float64{}, metered: map[string]int{}, rounds: opts.rounds(bytes)}
		s.pristine, s.ref = makeInputs(w, n, uint64(w)<<32|uint64(n))
		s.work = make([][]float32, w)
		for i := range s.work {
			s.work[i] = make([]float32, n)
		}
		for _, name := range opts.Modes {
			s.cells[name] = &Cell{Mode: name, Workers: w, Bytes: bytes, LinkRate: rate}
			s.cores[name] = &coreMeter{cpus: opts.CPUs}
		}
		maxRounds = max(maxRounds, s.rounds)
		all = append(all, s)
	}
	failed := map[string]string{} // mode -> why its environment could not be set up
	link := ""
	if rate != 0 {
		link = " at " + FormatRate(rate)
	}
	statsNoted := false
	for r := range maxRounds {
		for k := range opts.Modes {
			name := opts.Modes[(r+k)%len(opts.Modes)]
			if failed[name] != "" {
				continue
			}
			progress(opts, "W=%d%s round %d/%d: %s: setting up", w, link, r+1, maxRounds, name)
			m, err := setUp(ctx, name, opts, w, rate)
			if err != nil && ctx.Err() == nil {
				// Once more: a rank's start-up can trip over the machine's load.
				rep.Notes = append(rep.Notes, fmt.Sprintf("W=%d%s round %d: set up %s failed, retried: %v", w, link, r+1, name, err))
				m, err = setUp(ctx, name, opts, w, rate)
			}
			if err != nil {
				if ctx.Err() != nil {
					return ctx.Err()
				}
				failed[name] = fmt.Sprintf("set up %s: %v", name, err)
				continue
			}
			if r == 0 {
				if n := m.note(); n != "" {
					rep.Notes = append(rep.Notes, fmt.Sprintf("W=%d%s %s: %s", w, link, name, n))
				}
			}
			// Garbage of the previous mode is collected now rather than while this one is timed,
			// and the previous environment's asynchronous teardown is given time to finish.
			runtime.GC()
			settle()
			for _, s := range all {
				c := s.cells[name]
				if r >= s.rounds || c.Error != "" {
					continue
				}
				progress(opts, "W=%d%s round %d/%d: %s %s", w, link, r+1, maxRounds, name, humanBytes(s.bytes))
				if m.needsWarmUp() {
					for i := range s.work {
						copy(s.work[i], s.pristine[i])
					}
					// The switch's side is measured on the untimed warm-up (see switchMeter).
					meter, metered := m.(switchMeter)
					var stats io.Closer
					var sw0 float64
					if metered {
						var err error
						if stats, err = ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME)); err != nil {
							metered = false
							if !statsNoted {
								statsNoted = true
								rep.Notes = append(rep.Notes, fmt.Sprintf("W=%d%s %s: no switch-side CPU: BPF run-time statistics: %v", w, link, name, err))
							}
						} else if sw0, err = meter.switchCPU(); err != nil {
							metered = false
							stats.Close()
						}
					}
					_, err := m.run(ctx, s.work)
					if metered {
						if sw1, merr := meter.switchCPU(); merr == nil && err == nil {
							s.switched[name] += sw1 - sw0
							s.metered[name]++
						}
						stats.Close()
					}
					if err != nil {
						if ctx.Err() != nil {
							m.close()
							return ctx.Err()
						}
						c.Error = "warm-up: " + err.Error()
						continue
					}
				}
				for i := range s.work {
					copy(s.work[i], s.pristine[i])
				}
				cpu0, mach0 := ownCPU()+m.cpu(), busyCPU()
				s.cores[name].start()
				took, err := m.run(ctx, s.work)
				s.cores[name].stop()
				s.busy[name] += (ownCPU() + m.cpu() - cpu0) / float64(m.perRun())
				s.machine[name] += (busyCPU() - mach0) / float64(m.perRun())
				if err != nil {
					if ctx.Err() != nil {
						m.close()
						return ctx.Err()
					}
					c.Error = err.Error()
					continue
				}
				if r == 0 {
					if err := m.verify(s.work, s.ref); err != nil {
						c.Error = "wrong result: " + err.Error()
						continue
					}
					c.Verified = true
				}
				c.Seconds = append(c.Seconds, took.Seconds())
			}
			progress(opts, "W=%d%s round %d/%d: %s: tearing down", w, link, r+1, maxRounds, name)
			if err := m.close(); err != nil {
				rep.Notes = append(rep.Notes, fmt.Sprintf("W=%d%s %s: teardown: %v", w, link, name, err))
			}
		}
	}
	for _, s := range all {
		n := s.bytes / 4
		for _, name := range opts.Modes {
			c := s.cells[name]
			if c.Error == "" && failed[name] != "" {
				c.Error = failed[name]
			}
			if len(c.Seconds) > 0 {
				sec := slices.Clone(c.Seconds)
				sort.Float64s(sec)
				c.Median, c.P10, c.P90 = quantile(sec, 0.5), quantile(sec, 0.1), quantile(sec, 0.9)
				c.ElementsPerSec = float64(n) / c.Median
				c.AlgBWGBps = float64(s.bytes) / c.Median / 1e9
				gb := float64(s.bytes) * float64(len(c.Seconds)) / 1e9
				c.CPUSecPerGB, c.MachineCPUPerGB = s.busy[name]/gb, s.machine[name]/gb
				c.CoresBusy, c.CoresBusyErr = s.cores[name].coresBusy()
				c.WorkerCPUPerGB, c.SwitchCPUPerGB = splitCPU(name, c.CPUSecPerGB, s.switched[name], s.metered[name], s.bytes)
			}
			rep.Cells = append(rep.Cells, *c)
		}
	}
	progress(opts, "")
	return nil
}

// settle waits, at most settleMax, until the machine's kernel has been nearly idle for one
// settleWindow: namespace and XDP teardown finishes asynchronously in kernel workers, which must
// not be charged to the next mode. Only kernel time counts (system, irq, softirq), so that
// unrelated user-space load does not hold the benchmark up; on a machine whose kernel is busy
// with other work it gives up after settleMax.
func settle() {
	deadline := time.Now().Add(settleMax)
	for time.Now().Before(deadline) {
		k0 := kernelCPU()
		time.Sleep(settleWindow)
		if kernelCPU()-k0 <= settleBusy {
			return
		}
	}
}

const (
	settleWindow = 100 * time.Millisecond
	settleBusy   = 0.02 // kernel CPU seconds (all cores) in one window: 20% of one core
	settleMax    = time.Second
)

// makeInputs returns W tensors of n values uniform in [-1, 1) and their float64 sum.
func makeInputs(w, n int, seed uint64) ([][]float32, []float64) {
	r := rand.New(rand.NewPCG(seed, 7))
	in := make([][]float32, w)
	ref := make([]float64, n)
	for i := range in {
		in[i] = make([]float32, n)
		for j := range in[i] {
			v := float32(r.Float64()*2 - 1)
			in[i][j] = v
			ref[j] += float64(v)
		}
	}
	return in, ref
}

// checkWithin verifies every output within abs + rel·|ref|.
func checkWithin(out [][]float32, ref []float64, abs, rel float64) error {
	for i, o := range out {
		for j, v := range o {
			if d := math.Abs(float64(v) - ref[j]); d > abs+rel*math.Abs(ref[j]) || math.IsNaN(float64(v)) {
				return fmt.Errorf("worker %d element %d: %v, want %v", i, j, v, ref[j])
			}
		}
	}
	return nil
}

func quantile(sorted []float64, q float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	pos := q * float64(len(sorted)-1)
	lo := int(math.Floor(pos))
	hi := min(lo+1, len(sorted)-1)
	return sorted[lo] + (sorted[hi]-sorted[lo])*(pos-float64(lo))
}

// ratios pairs rounds of every two modes.
func (r *Report) ratios(modes []string) {
	find := func(m string, w, b int, rate uint64) *Cell {
		for i := range r.Cells {
			c := &r.Cells[i]
			if c.Mode == m && c.Workers == w && c.Bytes == b && c.LinkRate == rate {
				return c
			}
		}
		return nil
	}
	for _, c := range r.Cells {
		for _, other := range modes {
			if other == c.Mode {
				continue
			}
			o := find(other, c.Workers, c.Bytes, c.LinkRate)
			if o == nil || len(o.Seconds) == 0 || len(c.Seconds) == 0 {
				continue
			}
			k := min(len(o.Seconds), len(c.Seconds))
			pr := make([]float64, k)
			for i := range k {
				pr[i] = o.Seconds[i] / c.Seconds[i]
			}
			sort.Float64s(pr)
			x := Ratio{Mode: c.Mode, Other: other, Workers: c.Workers, Bytes: c.Bytes, LinkRate: c.LinkRate,
				Median: quantile(pr, 0.5), P10: quantile(pr, 0.1), P90: quantile(pr, 0.9)}
			if c.LinkRate != 0 && c.Mode == ModeXdpagg {
				if th := LinkBoundRatio(other, c.Workers); th > 0 {
					x.Theory, x.FromTheory = th, x.Median/th-1
				}
			}
			r.Ratios = append(r.Ratios, x)
		}
	}
}

// busyCPU is the machine's non-idle CPU time in seconds (all processes, irq and softirq).
func busyCPU() float64 { return busyCPUOn(nil) }

// busyCPUOn is the non-idle CPU time in seconds of cpus (all CPUs when empty).
func busyCPUOn(cpus []int) float64 { return busyOf(statFieldsOn(cpus)) }

// ownCPU is the CPU time in seconds of this process (the benchmark with the workers, PS and
// rings of the UDP modes) and of the kernel's softirq threads. The packet path of a send (veth,
// forwarding in the switch namespace, XDP, delivery) mostly runs in softirq at the end of the
// sending syscall and is charged to the sender; what the kernel defers runs in ksoftirqd.
func ownCPU() float64 {
	s := selfCPU()
	for _, pid := range softirqThreads() {
		s += procCPU(pid)
	}
	return s
}

var softirqPIDs struct {
	once sync.Once
	pids []int
}

// softirqThreads returns the PIDs of the ksoftirqd/N kernel threads.
func softirqThreads() []int {
	softirqPIDs.once.Do(func() {
		dirs, _ := os.ReadDir("/proc")
		for _, d := range dirs {
			pid, err := strconv.Atoi(d.Name())
			if err != nil {
				continue
			}
			if comm, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid)); err == nil &&
				strings.HasPrefix(string(comm), "ksoftirqd/") {
				softirqPIDs.pids = append(softirqPIDs.pids, pid)
			}
		}
	})
	return softirqPIDs.pids
}

// procCPU is utime+stime of pid in seconds (0 if it cannot be read).
func procCPU(pid int) float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return 0
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0
	}
	u, _ := strconv.ParseFloat(f[11], 64)
	st, _ := strconv.ParseFloat(f[12], 64)
	return (u + st) / 100 // USER_HZ
}

// kernelCPU is the machine's system, irq and softirq time in seconds.
func kernelCPU() float64 {
	return cpuStat(func(i int) bool { return i == 2 || i == 5 || i == 6 })
}

// cpuStat sums the fields of /proc/stat's "cpu" line whose index (0: user) include says.
func cpuStat(include func(i int) bool) float64 {
	var sum float64
	for i, x := range statFields() {
		if include(i) {
			sum += x
		}
	}
	return sum
}

func machine() string {
	host, _ := os.Hostname()
	k, _ := os.ReadFile("/proc/sys/kernel/osrelease")
	return fmt.Sprintf("%s, %d CPUs, kernel %s, %s", host, coreCount(), strings.TrimSpace(string(k)), runtime.Version())
}

func humanBytes(b int) string {
	switch {
	case b >= 1<<20 && b%(1<<20) == 0:
		return fmt.Sprintf("%dMiB", b>>20)
	case b >= 1<<10 && b%(1<<10) == 0:
		return fmt.Sprintf("%dKB", b>>10)
	}
	return fmt.Sprintf("%dB", b)
}

// ---- modes ----

// mode is one allreduce implementation running in its own environment (topology and processes),
// built by setUp for one round and torn down by close.
type mode interface {
	// run all-reduces inputs (one per worker, in place) and returns the slowest worker's time.
	run(ctx context.Context, inputs [][]float32) (time.Duration, error)
	// needsWarmUp says whether run should be called once untimed before the timed run (Gloo
	// warms up inside its own command).
	needsWarmUp() bool
	// cpu is the CPU time in seconds so far of the mode's processes other than this one (the
	// Gloo ranks; 0 for modes that run inside the benchmark process, which ownCPU counts).
	cpu() float64
	// perRun is how many allreduces one run performs (the machine's CPU time during a run is
	// charged to that many): 1, or 2 for Gloo's command, which warms up inside.
	perRun() int
	// verify checks the outputs of the last run against ref (the float64 sum).
	verify(out [][]float32, ref []float64) error
	// note is a remark for the report about the environment (empty: none).
	note() string
	// close stops every process, socket and goroutine of the mode and deletes its topology.
	close() error
	// topology is the mode's network (tests check its shaping).
	topology() *topo.Topology
}

// switchMeter is a mode whose switch side runs as BPF programs: switchCPU is their run time
// in seconds so far (kernel BPF statistics, counted only while enabled).
type switchMeter interface {
	switchCPU() (float64, error)
}

// CPUSplit says what each mode's worker-side and switch-side CPU figures include (Report.CPUSplit).
var CPUSplit = map[string]string{
	ModeXdpagg:    "switch: run time of the switch's XDP programs (xdpagg_switch on every port, xdpagg_egress per broadcast copy) from the kernel's BPF statistics, enabled only for the untimed warm-up allreduce (they cost two clock reads per program run) and averaged over warm-ups; it leaves out the kernel's XDP work around the programs (veth NAPI, frame conversion, the broadcast's frame clones and devmap transmit), so it is a lower bound. worker: the timed run's CPU s/GB minus the switch side: this process (workers' goroutines, sockets, the kernel's packet path run in their syscalls) and ksoftirqd, the kernel's XDP work around the switch's programs included",
	ModeXdpaggUDP: "as xdpagg",
	ModePS:        "not separated: the PS runs as goroutines of this process beside the workers, so the worker figure is the whole CPU s/GB, the PS's summing included; no switch figure",
	ModeRing:      "switch: 0 (a ring needs no switch help); worker: the whole CPU s/GB: this process and ksoftirqd, including the kernel forwarding in the switch namespace that stands in for a switch ASIC",
	ModeGloo:      "switch: 0 (Gloo needs no switch help); worker: the whole CPU s/GB: the Gloo ranks' processes and ksoftirqd, including the kernel forwarding in the switch namespace that stands in for a switch ASIC",
}

// splitCPU splits a mode's CPU s/GB (total, per worker) into its worker and switch sides:
// switched CPU seconds over metered warm-up runs of bytes per worker (see CPUSplit).
func splitCPU(mode string, total, switched float64, metered, bytes int) (worker, sw *float64) {
	switch mode {
	case ModeXdpagg, ModeXdpaggUDP:
		if metered == 0 {
			return nil, nil
		}
		s := switched / float64(metered) / (float64(bytes) / 1e9)
		w := max(0, total-s)
		return &w, &s
	case ModeRing, ModeGloo:
		zero := 0.0
		return &total, &zero
	}
	return &total, nil
}

// Environments says where each mode runs (Report.Environments): each in the setting that suits
// it best. Only xdpagg needs XDP; with XDP on a veth its peer's TX checksum offload must be off
// (an XDP rewrite breaks a partial checksum) and every frame is handled in the veth's XDP path,
// which costs the baselines' TCP and UDP traffic (GSO super-packets are split, skbs copied). So
// the baselines run on a plain kernel-forwarding switch namespace with no XDP program anywhere
// and the kernel's default veth offloads (TX checksum offload and GSO on, GRO off).
var Environments = map[string]string{
	ModeXdpagg:    "testbed: XDP switch program on every switch port, xdpagg_pass on every host, TX checksum offload off, GRO on",
	ModeXdpaggUDP: "testbed as xdpagg, but every host runs xdpagg_pass and workers receive their results through their UDP sockets, shaped or not",
	ModePS:        "plain: kernel-forwarding switch namespace, no XDP program, default veth offloads; workers + PS",
	ModeRing:      "plain: kernel-forwarding switch namespace, no XDP program, default veth offloads; workers only",
	ModeGloo:      "plain: kernel-forwarding switch namespace, no XDP program, default veth offloads; workers only",
}

// LinkShaping is Report.LinkShaping: how a shaped cell's links are shaped (topo.ShapeLinks).
const LinkShaping = "every host link (workers and, where there is one, the PS), both directions, on every mode's " +
	"topology alike: an HTB qdisc at the root of the host's interface shapes what it sends; what it receives is " +
	"redirected at the host's tc ingress into an ifb with the same HTB, which every packet meets whatever sent it " +
	"(kernel forwarding through the switch namespace, or the switch's XDP broadcast, which bypasses the switch " +
	"ports' qdiscs). Queues of 10000 packets: delayed, not dropped"

// setUp builds mode name's environment for W workers, every host link shaped to rate bits/s
// (0: unshaped).
func setUp(ctx context.Context, name string, opts Options, w int, rate uint64) (mode, error) {
	switch name {
	case ModeXdpagg, ModeXdpaggUDP:
		bed, err := xdpaggBed(opts, w, rate, name == ModeXdpagg && rate == 0)
		if err != nil {
			return nil, err
		}
		return &xdpaggMode{bed: bed}, nil
	case ModePS:
		return newPSMode(opts, w, rate)
	case ModeRing:
		return newRingMode(opts, w, rate)
	case ModeGloo:
		return newGlooMode(ctx, opts, w, rate)
	}
	return nil, fmt.Errorf("%w: mode %q", ErrConfig, name)
}

// xdpaggBed is xdpagg's environment (ModeXdpagg's, and Profile's): the testbed with opts'
// switch object and host-side tuning, every host link shaped to rate bits/s (0: unshaped), the
// workers receiving through AF_XDP if afxdp.
func xdpaggBed(opts Options, w int, rate uint64, afxdp bool) (*testbed.Bed, error) {
	// Each worker's link carries its own window.
	timeout := retransmitTimeout(rate, workerWindow(opts), opts.MTU)
	bed, err := testbed.New(testbed.Options{Workers: w, Window: opts.Window, MTU: opts.MTU, Timeout: timeout,
		Switch: loader.Config{PoolSize: 4096, Object: opts.SwitchObject}, AFXDP: afxdp,
		ExtraWorker: func(_ int, cfg *hostlib.WorkerConfig) {
			cfg.BusyPoll, cfg.SocketBuffer = opts.BusyPoll, opts.SocketBuffer
		}})
	if err != nil {
		return nil, err
	}
	if opts.ThreadedNAPI {
		if err := bed.Topo.SetThreadedNAPI(true); err != nil {
			return nil, errors.Join(err, bed.Close())
		}
	}
	if err := shapeLinks(bed.Topo, rate); err != nil {
		return nil, errors.Join(err, bed.Close())
	}
	return bed, nil
}

// plainTopology is the baselines' environment: kernel forwarding, no XDP, default offloads;
// every host link shaped to rate bits/s (0: unshaped).
func plainTopology(opts Options, w int, ps bool, rate uint64) (*topo.Topology, error) {
	t, err := topo.New(topo.Config{Workers: w, PS: ps, MTU: opts.MTU, KernelOffloads: true})
	if err != nil {
		return nil, err
	}
	if err := shapeLinks(t, rate); err != nil {
		return nil, errors.Join(err, t.Close())
	}
	return t, nil
}

// shapeLinks shapes every host link of t to rate bits/s (topo.ShapeLinks); 0: leaves it unshaped.
func shapeLinks(t *topo.Topology, rate uint64) error {
	if rate == 0 {
		return nil
	}
	return t.ShapeLinks(rate)
}

// workerNote reports whether a worker sends with UDP GSO, the fast path's kernel feature.
func workerNote(w *hostlib.Worker) string {
	on, why := w.GSO()
	if on {
		return "workers send with UDP GSO"
	}
	return fmt.Sprintf("UDP GSO off: %v", why)
}

type xdpaggMode struct{ bed *testbed.Bed }

func (m *xdpaggMode) run(ctx context.Context, in [][]float32) (time.Duration, error) {
	return m.bed.AllReduce(ctx, in)
}
func (m *xdpaggMode) needsWarmUp() bool { return true }
func (m *xdpaggMode) perRun() int       { return 1 }
func (m *xdpaggMode) cpu() float64      { return 0 }
func (m *xdpaggMode) verify(out [][]float32, ref []float64) error {
	return checkWithin(out, ref, float64(len(out))*math.Ldexp(1, -25), 0x1p-23)
}
func (m *xdpaggMode) note() string {
	n := workerNote(m.bed.Workers[0])
	if on, why := m.bed.Workers[0].AFXDP(); on {
		n += "; workers receive through AF_XDP"
	} else if why != nil {
		n += fmt.Sprintf("; AF_XDP off: %v", why)
	}
	return n
}
func (m *xdpaggMode) close() error             { return m.bed.Close() }
func (m *xdpaggMode) topology() *topo.Topology { return m.bed.Topo }

// switchCPU sums the run time of the switch's programs (ports and devmap egress).
func (m *xdpaggMode) switchCPU() (float64, error) {
	var sum time.Duration
	for _, p := range []*ebpf.Program{m.bed.Switch.Objects.XdpaggSwitch, m.bed.Switch.Objects.XdpaggEgress} {
		st, err := p.Stats()
		if err != nil {
			return 0, fmt.Errorf("switch program statistics: %w", err)
		}
		sum += st.Runtime
	}
	return sum.Seconds(), nil
}

// psMode: workers send to hostlib's PS in user space (Direct: it answers every worker itself),
// routed by the switch namespace's kernel.
type psMode struct {
	topo    *topo.Topology
	srv     *hostlib.PS
	cancel  context.CancelFunc
	done    chan error
	workers []*hostlib.Worker
}

func newPSMode(opts Options, w int, rate uint64) (_ *psMode, err error) {
	m := &psMode{}
	if m.topo, err = plainTopology(opts, w, true, rate); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			m.close()
		}
	}()
	ps := m.topo.PS
	addr := netip.AddrPortFrom(ps.IP, psPort)
	if err := m.topo.InHost(ps, func() (err error) {
		m.srv, err = hostlib.NewPS(hostlib.PSConfig{Listen: addr, Direct: true, Open: true,
			Switch: netip.AddrPortFrom(ps.Gateway, psPort)})
		return err
	}); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	m.cancel, m.done = cancel, make(chan error, 1)
	go func() { m.done <- m.srv.Serve(ctx) }()
	values := valuesPerPacket(opts)
	// The PS's link carries every worker's window.
	timeout := retransmitTimeout(rate, w*workerWindow(opts), opts.MTU)
	for i, h := range m.topo.Workers {
		err := m.topo.InHost(h, func() error {
			wk, err := hostlib.NewWorker(hostlib.WorkerConfig{JobID: 2, WorkerID: uint8(i),
				NumWorkers: uint8(w), Local: netip.AddrPortFrom(h.IP, psWorkerPort),
				PS: addr, PoolSize: 4096, Window: opts.Window, ValuesPerPacket: values, Timeout: timeout})
			if err != nil {
				return err
			}
			m.workers = append(m.workers, wk)
			return nil
		})
		if err != nil {
			return nil, err
		}
	}
	return m, nil
}

func (m *psMode) run(ctx context.Context, in [][]float32) (time.Duration, error) {
	return parallel(ctx, len(in), func(ctx context.Context, i int) error { return m.workers[i].AllReduce(ctx, in[i]) })
}
func (m *psMode) needsWarmUp() bool { return true }
func (m *psMode) perRun() int       { return 1 }
func (m *psMode) cpu() float64      { return 0 }
func (m *psMode) verify(out [][]float32, ref []float64) error {
	return checkWithin(out, ref, float64(len(out))*math.Ldexp(1, -25), 0x1p-23)
}
func (m *psMode) note() string             { return workerNote(m.workers[0]) }
func (m *psMode) topology() *topo.Topology { return m.topo }
func (m *psMode) close() error {
	var errs []error
	for _, w := range m.workers {
		if err := w.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	if m.srv != nil {
		m.cancel()
		if err := m.srv.Close(); err != nil && !errors.Is(err, hostlib.ErrClosed) {
			errs = append(errs, err)
		}
		<-m.done // every receive goroutine has returned
	}
	errs = append(errs, m.topo.Close())
	return errors.Join(errs...)
}

type ringMode struct {
	topo  *topo.Topology
	rings []*hostlib.Ring
}

func newRingMode(opts Options, w int, rate uint64) (_ *ringMode, err error) {
	m := &ringMode{}
	if m.topo, err = plainTopology(opts, w, false, rate); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			m.close()
		}
	}()
	var peers []netip.AddrPort
	for _, h := range m.topo.Workers {
		peers = append(peers, netip.AddrPortFrom(h.IP, ringPort))
	}
	values := valuesPerPacket(opts)
	for i, h := range m.topo.Workers {
		err := m.topo.InHost(h, func() error {
			r, err := hostlib.NewRing(hostlib.RingConfig{Rank: i, Peers: peers, ValuesPerPacket: values,
				Timeout: retransmitTimeout(rate, hostlib.DefaultRingWindow, opts.MTU)})
			if err != nil {
				return err
			}
			m.rings = append(m.rings, r)
			return nil
		})
		if err != nil {
			return nil, err
		}
	}
	return m, nil
}

func (m *ringMode) run(ctx context.Context, in [][]float32) (time.Duration, error) {
	return parallel(ctx, len(in), func(ctx context.Context, i int) error { return m.rings[i].AllReduce(ctx, in[i]) })
}
func (m *ringMode) needsWarmUp() bool { return true }
func (m *ringMode) perRun() int       { return 1 }
func (m *ringMode) cpu() float64      { return 0 }
func (m *ringMode) verify(out [][]float32, ref []float64) error {
	return checkWithin(out, ref, 1e-6*float64(len(out)), 1e-6)
}
func (m *ringMode) note() string             { return "" }
func (m *ringMode) topology() *topo.Topology { return m.topo }
func (m *ringMode) close() error {
	var errs []error
	for _, r := range m.rings {
		if err := r.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	errs = append(errs, m.topo.Close())
	return errors.Join(errs...)
}

// glooMode drives torch.distributed ranks started for this round; it allocates its own tensors
// (Gloo sums correctly or Check fails), so the inputs only give the size.
type glooMode struct {
	topo *topo.Topology
	g    *gloo.Group
}

func newGlooMode(ctx context.Context, opts Options, w int, rate uint64) (_ *glooMode, err error) {
	m := &glooMode{}
	if m.topo, err = plainTopology(opts, w, false, rate); err != nil {
		return nil, err
	}
	if m.g, err = gloo.Start(ctx, m.topo, gloo.Options{Python: opts.Python}); err != nil {
		return nil, errors.Join(err, m.topo.Close())
	}
	return m, nil
}

// run times one allreduce after the command's own untimed warm-up allreduce and a barrier.
func (m *glooMode) run(ctx context.Context, in [][]float32) (time.Duration, error) {
	t, err := m.g.AllReduce(ctx, len(in[0]), 1)
	if err != nil {
		return 0, err
	}
	return t[0], nil
}
func (m *glooMode) needsWarmUp() bool { return false }
func (m *glooMode) perRun() int       { return 2 }
func (m *glooMode) cpu() float64 {
	d, _ := m.g.CPUTime()
	return d.Seconds()
}

// verify runs Gloo's own sum check (its tensors live in Python, not in out).
func (m *glooMode) verify(out [][]float32, _ []float64) error {
	return m.g.Check(context.Background(), len(out[0]))
}
func (m *glooMode) note() string             { return "torch " + m.g.TorchVersion() }
func (m *glooMode) topology() *topo.Topology { return m.topo }

// close stops the ranks (they quit, or are killed after a grace period) and waits for them to
// exit before the topology goes.
func (m *glooMode) close() error { return errors.Join(m.g.Close(), m.topo.Close()) }

// retransmitTimeout is the first retransmit timeout of a UDP mode on links shaped to rate
// bits/s whose busiest link queues up to inflight packets of the MTU: hostlib's default plus
// twice the time that link takes to drain them, so that queueing on a slow link is not taken
// for loss (as one would configure on such a link). 0 (hostlib's default) when unshaped.
func retransmitTimeout(rate uint64, inflight, mtu int) time.Duration {
	if rate == 0 {
		return 0
	}
	bits := float64(inflight) * float64(mtu+14) * 8 // Ethernet header: HTB counts it
	return hostlib.DefaultTimeout + 2*time.Duration(bits/float64(rate)*float64(time.Second))
}

// workerWindow is the window of the xdpagg and ps workers.
func workerWindow(o Options) int {
	if o.Window > 0 {
		return o.Window
	}
	return hostlib.DefaultWindow
}

// valuesPerPacket is what the topology's MTU lets a UDP mode's packet carry.
func valuesPerPacket(o Options) int {
	if o.MTU == 0 {
		o.MTU = DefaultMTU
	}
	return wire.ValuesForMTU(o.MTU)
}

// parallel runs fn for every worker at once and returns the wall time until the last finished.
func parallel(ctx context.Context, n int, fn func(ctx context.Context, i int) error) (time.Duration, error) {
	errs := make(chan error, n)
	start := time.Now()
	for i := range n {
		go func() { errs <- fn(ctx, i) }()
	}
	var all []error
	for range n {
		if err := <-errs; err != nil {
			all = append(all, err)
		}
	}
	return time.Since(start), errors.Join(all...)
}

// ParseLinkRates reads a comma-separated list of link rates in tc's units: "none" (or 0) for
// unshaped, else a number with bit, kbit, mbit, gbit or tbit (decimal: 1gbit = 10^9 bit/s).
func ParseLinkRates(list string) ([]uint64, error) {
	var out []uint64
	for _, f := range strings.Split(list, ",") {
		f = strings.ToLower(strings.TrimSpace(f))
		if f == "" {
			continue
		}
		if f == "none" || f == "0" {
			out = append(out, 0)
			continue
		}
		mult, num := 0.0, f
		for _, u := range []struct {
			suf string
			m   float64
		}{{"tbit", 1e12}, {"gbit", 1e9}, {"mbit", 1e6}, {"kbit", 1e3}, {"bit", 1}} {
			if strings.HasSuffix(f, u.suf) {
				mult, num = u.m, strings.TrimSuffix(f, u.suf)
				break
			}
		}
		v, err := strconv.ParseFloat(num, 64)
		if mult == 0 || err != nil || !(v > 0) || v*mult > math.MaxUint64/2 {
			return nil, fmt.Errorf("%w: link rate %q: use none or a rate like 100mbit, 1gbit, 2.5gbit", ErrConfig, f)
		}
		out = append(out, uint64(math.Round(v*mult)))
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%w: no link rate in %q: use none or a rate like 1gbit", ErrConfig, list)
	}
	return out, nil
}

// FormatRate writes a link rate in tc's units ("none" for 0).
func FormatRate(r uint64) string {
	if r == 0 {
		return "none"
	}
	for _, u := range []struct {
		suf string
		m   uint64
	}{{"tbit", 1e12}, {"gbit", 1e9}, {"mbit", 1e6}, {"kbit", 1e3}} {
		if r >= u.m {
			return strconv.FormatFloat(float64(r)/float64(u.m), 'g', 4, 64) + u.suf
		}
	}
	return strconv.FormatUint(r, 10) + "bit"
}
