// Package bench measures xdpagg against the alternatives a user runs today, side by side in one
// run: every mode on the same netns topology, interleaved round by round (A B C D A B C D ...) so
// that the ratios share the machine's drift. Modes:
//
//	xdpagg  workers -> XDP switch -> workers (hostlib.Worker through the switch)
//	ps      hostlib's parameter server in user space, no switch help (batched syscalls, all cores)
//	ring    ring allreduce among workers over UDP (hostlib.Ring; INCEPTIONN's aggregator-free exchange)
//	gloo    torch.distributed.all_reduce with Gloo over TCP through the same switch box
//
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
	"time"

	"github.com/xdpagg/xdpagg/bench/gloo"
	"github.com/xdpagg/xdpagg/hostlib"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/netns_tests/testbed"
)

// Mode names.
const (
	ModeXdpagg = "xdpagg"
	ModePS     = "ps"
	ModeRing   = "ring"
	ModeGloo   = "gloo"
)

// AllModes in report order.
var AllModes = []string{ModeXdpagg, ModePS, ModeRing, ModeGloo}

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
	// MTU of every link of the topology (0: 1500). Every mode gets the same links; the UDP modes
	// fill packets to it (bpf.ValuesForMTU).
	MTU int
}

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
		o.MTU = 1500
	}
	if o.Python == "" {
		o.Python = "/usr/bin/python3"
	}
	return o
}

// Validate says what to change.
func (o Options) Validate() error {
	for _, m := range o.Modes {
		if !slices.Contains(AllModes, m) {
			return fmt.Errorf("%w: mode %q: use one of %s", ErrConfig, m, strings.Join(AllModes, ", "))
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
	if o.Rounds < 0 {
		return fmt.Errorf("%w: rounds %d: use a positive number", ErrConfig, o.Rounds)
	}
	return nil
}

// Cell is one mode at one (W, size).
type Cell struct {
	Mode           string    `json:"mode"`
	Workers        int       `json:"workers"`
	Bytes          int       `json:"bytes"`
	Seconds        []float64 `json:"seconds"`
	Median         float64   `json:"median_s"`
	P10            float64   `json:"p10_s"`
	P90            float64   `json:"p90_s"`
	ElementsPerSec float64   `json:"aggregated_elements_per_s"` // values per worker / median time (SwitchML's metric)
	AlgBWGBps      float64   `json:"algbw_GBps"`                // bytes per worker / median time
	CPUSecPerGB    float64   `json:"cpu_s_per_GB"`              // machine busy CPU (all processes + softirq) per GB reduced per worker
	Verified       bool      `json:"verified"`
	Error          string    `json:"error,omitempty"`
}

// Ratio compares two modes at one (W, size) over paired rounds: time(Other) / time(Mode), so
// above 1 means Mode is faster.
type Ratio struct {
	Mode    string  `json:"mode"`
	Other   string  `json:"other"`
	Workers int     `json:"workers"`
	Bytes   int     `json:"bytes"`
	Median  float64 `json:"median"`
	P10     float64 `json:"p10"`
	P90     float64 `json:"p90"`
}

// Report is a whole run.
type Report struct {
	Started time.Time `json:"started"`
	Machine string    `json:"machine"`
	Rounds  int       `json:"rounds"`
	MTU     int       `json:"mtu"`
	Cells   []Cell    `json:"cells"`
	Ratios  []Ratio   `json:"ratios"`
	Notes   []string  `json:"notes,omitempty"`
}

// mode is one allreduce implementation set up on an environment.
type mode interface {
	// run all-reduces inputs (one per worker, in place) and returns the slowest worker's time.
	run(ctx context.Context, inputs [][]float32) (time.Duration, error)
	// verify checks the outputs against ref (the float64 sum).
	verify(out [][]float32, ref []float64) error
	close() error
}

// Run performs the benchmark.
func Run(ctx context.Context, opts Options) (*Report, error) {
	opts = opts.withDefaults()
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	rep := &Report{Started: time.Now(), Machine: machine(), Rounds: opts.Rounds, MTU: opts.MTU}
	if slices.Contains(opts.Modes, ModeGloo) {
		if err := gloo.Available(opts.Python); err != nil {
			return nil, fmt.Errorf("%w: gloo mode: %w (or leave gloo out with --modes)", ErrConfig, err)
		}
	}
	for _, w := range opts.Workers {
		if err := runWorkers(ctx, opts, w, rep); err != nil {
			return rep, err
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

// runWorkers builds one environment with W workers, sets every mode up on it and measures all sizes.
func runWorkers(ctx context.Context, opts Options, w int, rep *Report) error {
	progress(opts, "W=%d: building topology and modes", w)
	bed, err := testbed.New(testbed.Options{Workers: w, Window: opts.Window, MTU: opts.MTU,
		Switch: loader.Config{PoolSize: 4096}})
	if err != nil {
		return fmt.Errorf("testbed W=%d: %w", w, err)
	}
	modes := map[string]mode{}
	defer func() {
		for _, m := range modes {
			m.close()
		}
		bed.Close()
	}()
	for _, name := range opts.Modes {
		var m mode
		var err error
		switch name {
		case ModeXdpagg:
			m = &xdpaggMode{bed: bed}
		case ModePS:
			m, err = newPSMode(bed, opts)
		case ModeRing:
			m, err = newRingMode(bed)
		case ModeGloo:
			m, err = newGlooMode(ctx, bed, opts)
		}
		if err != nil {
			return fmt.Errorf("set up %s W=%d: %w", name, w, err)
		}
		modes[name] = m
	}

	defer func() {
		// The fast path's kernel features, reported with the figures they shaped.
		if len(bed.Workers) > 0 {
			if on, why := bed.Workers[0].GSO(); on {
				rep.Notes = append(rep.Notes, fmt.Sprintf("W=%d: workers send with UDP GSO", w))
			} else {
				rep.Notes = append(rep.Notes, fmt.Sprintf("W=%d: UDP GSO off: %v", w, why))
			}
		}
	}()
	for _, bytes := range opts.Bytes {
		n := bytes / 4
		pristine, ref := makeInputs(w, n, uint64(w)<<32|uint64(n))
		work := make([][]float32, w)
		for i := range work {
			work[i] = make([]float32, n)
		}
		cells := map[string]*Cell{}
		for _, name := range opts.Modes {
			cells[name] = &Cell{Mode: name, Workers: w, Bytes: bytes}
		}
		busy := map[string]float64{}
		rounds := opts.rounds(bytes)
		for r := range rounds {
			for _, name := range opts.Modes {
				c := cells[name]
				if c.Error != "" {
					continue
				}
				progress(opts, "W=%d size=%s round %d/%d: %s", w, humanBytes(bytes), r+1, rounds, name)
				for i := range work {
					copy(work[i], pristine[i])
				}
				cpu0 := busyCPU()
				took, err := modes[name].run(ctx, work)
				busy[name] += busyCPU() - cpu0
				if err != nil {
					if ctx.Err() != nil {
						return ctx.Err()
					}
					c.Error = err.Error()
					continue
				}
				if r == 0 {
					if err := modes[name].verify(work, ref); err != nil {
						c.Error = "wrong result: " + err.Error()
						continue
					}
					c.Verified = true
				}
				c.Seconds = append(c.Seconds, took.Seconds())
			}
		}
		for _, name := range opts.Modes {
			c := cells[name]
			if len(c.Seconds) > 0 {
				s := slices.Clone(c.Seconds)
				sort.Float64s(s)
				c.Median, c.P10, c.P90 = quantile(s, 0.5), quantile(s, 0.1), quantile(s, 0.9)
				c.ElementsPerSec = float64(n) / c.Median
				c.AlgBWGBps = float64(bytes) / c.Median / 1e9
				c.CPUSecPerGB = busy[name] / (float64(bytes) * float64(len(c.Seconds)) / 1e9)
			}
			rep.Cells = append(rep.Cells, *c)
		}
	}
	progress(opts, "")
	return nil
}

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
	find := func(m string, w, b int) *Cell {
		for i := range r.Cells {
			c := &r.Cells[i]
			if c.Mode == m && c.Workers == w && c.Bytes == b {
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
			o := find(other, c.Workers, c.Bytes)
			if o == nil || len(o.Seconds) == 0 || len(c.Seconds) == 0 {
				continue
			}
			k := min(len(o.Seconds), len(c.Seconds))
			pr := make([]float64, k)
			for i := range k {
				pr[i] = o.Seconds[i] / c.Seconds[i]
			}
			sort.Float64s(pr)
			r.Ratios = append(r.Ratios, Ratio{Mode: c.Mode, Other: other, Workers: c.Workers, Bytes: c.Bytes,
				Median: quantile(pr, 0.5), P10: quantile(pr, 0.1), P90: quantile(pr, 0.9)})
		}
	}
}

// busyCPU is the machine's non-idle CPU time in seconds (all processes, irq and softirq).
func busyCPU() float64 {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	var busy float64
	for i, v := range f[1:] {
		if i == 3 || i == 4 { // idle, iowait
			continue
		}
		x, _ := strconv.ParseFloat(v, 64)
		busy += x
	}
	return busy / 100 // USER_HZ
}

func machine() string {
	host, _ := os.Hostname()
	k, _ := os.ReadFile("/proc/sys/kernel/osrelease")
	return fmt.Sprintf("%s, %d CPUs, kernel %s, %s", host, runtime.NumCPU(), strings.TrimSpace(string(k)), runtime.Version())
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

type xdpaggMode struct{ bed *testbed.Bed }

func (m *xdpaggMode) run(ctx context.Context, in [][]float32) (time.Duration, error) {
	return m.bed.AllReduce(ctx, in)
}
func (m *xdpaggMode) verify(out [][]float32, ref []float64) error {
	return checkWithin(out, ref, float64(len(out))*math.Ldexp(1, -25), 0x1p-23)
}
func (m *xdpaggMode) close() error { return nil }

// psMode: workers send to a user-space PS on a port the switch does not intercept; the switch
// namespace's kernel routes the packets; the PS answers every worker directly.
type psMode struct {
	srv     *hostlib.PS
	cancel  context.CancelFunc
	workers []*hostlib.Worker
}

func newPSMode(bed *testbed.Bed, opts Options) (*psMode, error) {
	m := &psMode{}
	ps := bed.Topo.PS
	addr := netip.AddrPortFrom(ps.IP, psPort)
	if err := bed.Topo.InHost(ps, func() (err error) {
		m.srv, err = hostlib.NewPS(hostlib.PSConfig{Listen: addr, Direct: true,
			Switch: netip.AddrPortFrom(ps.Gateway, psPort)})
		return err
	}); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	m.cancel = cancel
	go m.srv.Serve(ctx)
	for i, h := range bed.Topo.Workers {
		err := bed.Topo.InHost(h, func() error {
			w, err := hostlib.NewWorker(hostlib.WorkerConfig{JobID: 2, WorkerID: uint8(i),
				NumWorkers: uint8(len(bed.Topo.Workers)), Local: netip.AddrPortFrom(h.IP, psWorkerPort),
				PS: addr, PoolSize: 4096, Window: opts.Window, ValuesPerPacket: bed.ValuesPerPacket()})
			if err != nil {
				return err
			}
			m.workers = append(m.workers, w)
			return nil
		})
		if err != nil {
			m.close()
			return nil, err
		}
	}
	return m, nil
}

func (m *psMode) run(ctx context.Context, in [][]float32) (time.Duration, error) {
	return parallel(ctx, len(in), func(ctx context.Context, i int) error { return m.workers[i].AllReduce(ctx, in[i]) })
}
func (m *psMode) verify(out [][]float32, ref []float64) error {
	return checkWithin(out, ref, float64(len(out))*math.Ldexp(1, -25), 0x1p-23)
}
func (m *psMode) close() error {
	for _, w := range m.workers {
		w.Close()
	}
	m.cancel()
	return m.srv.Close()
}

type ringMode struct{ rings []*hostlib.Ring }

func newRingMode(bed *testbed.Bed) (*ringMode, error) {
	m := &ringMode{}
	var peers []netip.AddrPort
	for _, h := range bed.Topo.Workers {
		peers = append(peers, netip.AddrPortFrom(h.IP, ringPort))
	}
	for i, h := range bed.Topo.Workers {
		err := bed.Topo.InHost(h, func() error {
			r, err := hostlib.NewRing(hostlib.RingConfig{Rank: i, Peers: peers, ValuesPerPacket: bed.ValuesPerPacket()})
			if err != nil {
				return err
			}
			m.rings = append(m.rings, r)
			return nil
		})
		if err != nil {
			m.close()
			return nil, err
		}
	}
	return m, nil
}

func (m *ringMode) run(ctx context.Context, in [][]float32) (time.Duration, error) {
	return parallel(ctx, len(in), func(ctx context.Context, i int) error { return m.rings[i].AllReduce(ctx, in[i]) })
}
func (m *ringMode) verify(out [][]float32, ref []float64) error {
	return checkWithin(out, ref, 1e-6*float64(len(out)), 1e-6)
}
func (m *ringMode) close() error {
	for _, r := range m.rings {
		r.Close()
	}
	return nil
}

// glooMode drives long-lived torch.distributed ranks; it allocates its own tensors (Gloo sums
// correctly or Check fails), so the inputs only give the size.
type glooMode struct{ g *gloo.Group }

func newGlooMode(ctx context.Context, bed *testbed.Bed, opts Options) (*glooMode, error) {
	g, err := gloo.Start(ctx, bed.Topo, gloo.Options{Python: opts.Python})
	if err != nil {
		return nil, err
	}
	return &glooMode{g: g}, nil
}

func (m *glooMode) run(ctx context.Context, in [][]float32) (time.Duration, error) {
	t, err := m.g.AllReduce(ctx, len(in[0]), 1)
	if err != nil {
		return 0, err
	}
	return t[0], nil
}

// verify runs Gloo's own sum check (its tensors live in Python, not in out).
func (m *glooMode) verify(out [][]float32, _ []float64) error {
	return m.g.Check(context.Background(), len(out[0]))
}
func (m *glooMode) close() error { return m.g.Close() }

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
