package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/netip"
	"text/tabwriter"
	"time"

	"github.com/cilium/ebpf"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/hostlib"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/netns_tests/testbed"
	"github.com/xdpagg/xdpagg/netns_tests/topo"
	"github.com/xdpagg/xdpagg/sparse"
	"github.com/xdpagg/xdpagg/workload"
)

// SparseOptions configures `xdpagg bench --sparse`: Zebra's Figs. 6, 9 and 10 on a recorded
// trace, side by side in one run.
type SparseOptions struct {
	Trace      string  // recorded trace (workload.RecordedNames), default "ctr_w8"
	Workers    []int   // default 2, 4, 8
	Iterations int     // iterations per round (default 60)
	Rounds     int     // rounds per system and W; the best round counts (default 5)
	Arrays     int     // register arrays of the sparse job (default 256)
	Sample     float64 // offline identification's sampling rate (default 0.08)
	P          float64 // Principle 1's p (default 0.9)
	MTU        int     // default 1500
	// LinkRates are the host-link rates (bits/s each way, every host's link alike: the PS's is
	// Zebra's bottleneck) Fig. 6 is measured at, as Options.LinkRates; 0 is unshaped (the
	// default). The layouts of Fig. 10 count passes, not time, and run unshaped.
	LinkRates []uint64
	// CPUs pins the run to these CPUs and counts cores busy over them, as Options.CPUs.
	CPUs     []int
	Progress io.Writer
}

func (o SparseOptions) withDefaults() SparseOptions {
	if o.Trace == "" {
		o.Trace = "ctr_w8"
	}
	if len(o.Workers) == 0 {
		o.Workers = []int{2, 4, 8}
	}
	if o.Iterations == 0 {
		o.Iterations = 60
	}
	if o.Rounds == 0 {
		o.Rounds = 5
	}
	if o.Arrays == 0 {
		o.Arrays = int(bpf.JobMaxArrays)
	}
	if o.Sample == 0 {
		o.Sample = 0.08
	}
	if o.P == 0 {
		o.P = 0.9
	}
	if o.MTU == 0 {
		o.MTU = 1500
	}
	if len(o.LinkRates) == 0 {
		o.LinkRates = []uint64{0}
	}
	return o
}

// SparseThroughput is one row of the Fig. 6 table: one W, every system.
type SparseThroughput struct {
	Workers  int    `json:"workers"`
	LinkRate uint64 `json:"link_rate_bps"` // every host link shaped to this, each way; 0: unshaped
	// Pairs per iteration (all workers) and the dense tensor's size (the model's rows).
	Pairs      float64 `json:"pairs_per_iteration"`
	DenseElems int     `json:"dense_elements"`
	// Seconds per iteration (best round) and gradient pairs aggregated per second.
	SparseSec, PSOnlySec, DenseSec float64
	SparsePPS, PSOnlyPPS, DensePPS float64
	VsPSOnly, VsDense              float64 // sparse xdpagg's speed-up
	HotShare                       float64 `json:"hot_share"` // pairs summed in the switch
	RecircPerPkt                   float64 `json:"recirculations_per_packet"`
	// Cores busy (as Cell.CoresBusy) over every timed round of each system, not only the best,
	// and its standard deviation from /proc/stat's rounding (as Cell.CoresBusyErr).
	SparseCoresBusy    float64 `json:"sparse_cores_busy"`
	PSOnlyCoresBusy    float64 `json:"ps_only_cores_busy"`
	DenseCoresBusy     float64 `json:"dense_cores_busy"`
	SparseCoresBusyErr float64 `json:"sparse_cores_busy_stddev"`
	PSOnlyCoresBusyErr float64 `json:"ps_only_cores_busy_stddev"`
	DenseCoresBusyErr  float64 `json:"dense_cores_busy_stddev"`
}

// SparseLayout is one row of the Fig. 10 table.
type SparseLayout struct {
	Layout       string   `json:"layout"`
	Arrays       int      `json:"arrays"`
	Histogram    []uint64 `json:"packets_by_passes"`
	RecircPerPkt float64  `json:"recirculations_per_packet"`
	Spilled      uint64   `json:"pairs_to_ps"`
	HotPairs     uint64   `json:"hot_pairs"`
}

// SparsePrecision is one row of the Fig. 9 / Table II table.
type SparsePrecision struct {
	Method    string  `json:"method"` // "sample 4%", "online after 5% of iterations"
	Precision float64 `json:"precision"`
	Kendall   float64 `json:"kendall_tau_distance"`
}

// SparseReadOut compares the two read-outs, per iteration of the hot set.
type SparseReadOut struct {
	Ranks int `json:"ranks"`
	// PullMicros: the PS's MSG_PULLs, first request to last answer, averaged over iterations.
	PullMicros float64 `json:"pull_us"`
	// AgentMicros: reading the job's m arrays of one parity with one batch lookup and zeroing
	// them with one batch update, from user space on the switch (what an agent read-out costs
	// before it sends anything to the PS).
	AgentMicros float64 `json:"agent_batch_us"`
}

// SparseResult is the whole report.
type SparseResult struct {
	Trace      string             `json:"trace"`
	HotKeys    int                `json:"hot_keys"`
	Throughput []SparseThroughput `json:"throughput"`
	Layouts    []SparseLayout     `json:"layouts"`
	Precision  []SparsePrecision  `json:"precision"`
	ReadOut    SparseReadOut      `json:"read_out"`
	Machine    string             `json:"machine"`
	// As Report.Cores and Report.CPUs.
	Cores int   `json:"cores"`
	CPUs  []int `json:"cpus,omitempty"`
}

// Sparse runs the sparse benchmark.
func Sparse(ctx context.Context, o SparseOptions) (_ *SparseResult, err error) {
	o = o.withDefaults()
	if err := (Options{LinkRates: o.LinkRates}).Validate(); err != nil {
		return nil, err
	}
	full, err := workload.Recorded(o.Trace)
	if err != nil {
		return nil, err
	}
	unpin, err := pinCPUs(o.CPUs)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, unpin()) }()
	res := &SparseResult{Trace: o.Trace, Machine: machine(), Cores: coreCount(), CPUs: o.CPUs}
	say := func(format string, a ...any) {
		if o.Progress != nil {
			fmt.Fprintf(o.Progress, "\r\033[K"+format, a...)
		}
	}
	defer say("")

	// Hot set: Zebra's sampling method and Principle 1 within the job's registers.
	hot, _, err := sparse.OfflineHotSet(full.Iters, o.Sample, 1, o.P, 1, uint64(o.Arrays)*uint64(bpf.RegSlots)*4, 1)
	if err != nil {
		return nil, err
	}
	k := hot.Len()
	res.HotKeys = k

	// Fig. 9 / Table II: identification precision against the full trace's own ranking.
	truth := sparse.RankByFrequency(sparse.Frequency(full.Iters))
	for _, rate := range []float64{0.01, 0.02, 0.04, 0.08, 0.16} {
		est := sparse.SampledRanking(full.Iters, rate, 2)
		res.Precision = append(res.Precision, SparsePrecision{Method: fmt.Sprintf("sample %g%%", 100*rate),
			Precision: sparse.Precision(truth, est, k), Kendall: sparse.KendallTauDistance(truth, est, k)})
	}
	first := max(1, len(full.Iters)/20)
	online := sparse.RankByFrequency(sparse.Frequency(full.Iters[:first]))
	res.Precision = append(res.Precision, SparsePrecision{Method: fmt.Sprintf("online after the first 5%% (%d) of iterations", first),
		Precision: sparse.Precision(truth, online, k), Kendall: sparse.KendallTauDistance(truth, online, k)})

	// Fig. 6: throughput at each link rate and W.
	for _, rate := range o.LinkRates {
		for _, w := range o.Workers {
			tr, err := full.Regroup(w)
			if err != nil {
				return nil, err
			}
			if tr, err = tr.Slice(w, min(o.Iterations, len(tr.Iters))); err != nil {
				return nil, err
			}
			row := SparseThroughput{Workers: w, LinkRate: rate, DenseElems: int(full.KeySpace)}
			row.Pairs = float64(tr.Touches()) / float64(len(tr.Iters))
			at := fmt.Sprintf("W=%d", w)
			if rate != 0 {
				at += " at " + FormatRate(rate)
			}
			sparseM, psM, denseM := &coreMeter{cpus: o.CPUs}, &coreMeter{cpus: o.CPUs}, &coreMeter{cpus: o.CPUs}
			say("sparse %s: xdpagg ...", at)
			best, hotShare, recirc, ro, err := runSparseXdpagg(ctx, o, tr, hot, false, nil, rate, sparseM)
			if err != nil {
				return nil, fmt.Errorf("sparse xdpagg %s: %w", at, err)
			}
			row.SparseSec, row.HotShare, row.RecircPerPkt = best, hotShare, recirc
			if rate == o.LinkRates[0] && (w == 4 || res.ReadOut.Ranks == 0) {
				res.ReadOut = ro
			}
			settle()
			say("sparse %s: PS only ...", at)
			if row.PSOnlySec, err = runSparsePSOnly(ctx, o, tr, rate, psM); err != nil {
				return nil, fmt.Errorf("sparse PS-only %s: %w", at, err)
			}
			settle()
			say("sparse %s: dense xdpagg ...", at)
			if row.DenseSec, err = runSparseDense(ctx, o, w, row.DenseElems, rate, denseM); err != nil {
				return nil, fmt.Errorf("dense xdpagg %s: %w", at, err)
			}
			settle()
			row.SparsePPS, row.PSOnlyPPS, row.DensePPS = row.Pairs/row.SparseSec, row.Pairs/row.PSOnlySec, row.Pairs/row.DenseSec
			row.VsPSOnly, row.VsDense = row.PSOnlySec/row.SparseSec, row.DenseSec/row.SparseSec
			row.SparseCoresBusy, row.SparseCoresBusyErr = sparseM.coresBusy()
			row.PSOnlyCoresBusy, row.PSOnlyCoresBusyErr = psM.coresBusy()
			row.DenseCoresBusy, row.DenseCoresBusyErr = denseM.coresBusy()
			res.Throughput = append(res.Throughput, row)
		}
	}

	// Fig. 10: recirculations per packet by layout, at W = 4 (or the closest W asked for).
	w := o.Workers[0]
	for _, x := range o.Workers {
		if math.Abs(float64(x-4)) < math.Abs(float64(w-4)) {
			w = x
		}
	}
	tr, err := full.Regroup(w)
	if err != nil {
		return nil, err
	}
	if tr, err = tr.Slice(w, min(o.Iterations, len(tr.Iters))); err != nil {
		return nil, err
	}
	// A random layout: the same hot keys, ranked in a random order (so a key's register array
	// has nothing to do with its heat), packed in key order.
	perm := sparse.Permutation(k, 3)
	shuffled := make(sparse.Ranking, k)
	for i, p := range perm {
		shuffled[p] = hot.Key(uint32(i))
	}
	randomHot, err := sparse.NewHotSet(1, shuffled)
	if err != nil {
		return nil, err
	}
	for _, arrays := range []int{o.Arrays, 64} {
		for _, l := range []struct {
			name    string
			hot     *sparse.HotSet
			inOrder bool
		}{{"heat-based + Algorithm 1", hot, false}, {"random + in order", randomHot, true}} {
			say("sparse layouts: %s, m=%d ...", l.name, arrays)
			oo := o
			oo.Arrays = arrays
			hs := l.hot
			if hs.Len() > arrays*int(bpf.RegSlots) {
				if hs, err = sparse.NewHotSet(1, hs.Keys()[:arrays*int(bpf.RegSlots)]); err != nil {
					return nil, err
				}
			}
			row := SparseLayout{Layout: l.name, Arrays: arrays}
			if _, _, _, _, err := runSparseXdpagg(ctx, oo, tr, hs, l.inOrder, &row, 0, nil); err != nil {
				return nil, fmt.Errorf("layout %s: %w", l.name, err)
			}
			res.Layouts = append(res.Layouts, row)
			settle()
		}
	}
	return res, nil
}

// gradients returns iteration it's keys and values per worker.
func gradients(tr *workload.Trace, it int) ([][]uint64, [][]float32) {
	keys := tr.Iters[it]
	vals := make([][]float32, len(keys))
	for w, b := range keys {
		vals[w] = workload.Values(w, it, b, 7)
	}
	return keys, vals
}

// runSparseXdpagg runs the trace's iterations o.Rounds times on a sparse job of the XDP switch
// and returns the best round's seconds per iteration, the share of pairs summed in the switch,
// recirculations per hot packet and the read-out measurements. With layout set, it fills that
// row from the switch's histogram instead (one round). Every host link is shaped to rate
// (0: unshaped); cores measures the timed rounds.
func runSparseXdpagg(ctx context.Context, o SparseOptions, tr *workload.Trace, hot *sparse.HotSet, inOrder bool, layout *SparseLayout,
	rate uint64, cores *coreMeter) (best, hotShare, recirc float64, ro SparseReadOut, err error) {
	w := tr.Workers()
	bed, err := testbed.New(testbed.Options{Workers: w, MTU: o.MTU, Switch: loader.Config{PoolSize: 256, RegArrays: uint32(max(o.Arrays, 64))}})
	if err != nil {
		return 0, 0, 0, ro, err
	}
	defer bed.Close()
	if err := shapeLinks(bed.Topo, rate); err != nil {
		return 0, 0, 0, ro, err
	}
	hosts := make([]int, w)
	for i := range hosts {
		hosts[i] = i
	}
	const job = 100
	if err := bed.StartSparse(testbed.SparseJobSpec{ID: job, Hosts: hosts, Arrays: o.Arrays, Hot: hot, InOrder: inOrder}); err != nil {
		return 0, 0, 0, ro, err
	}
	j := bed.SparseJob(job)
	rounds := o.Rounds
	if layout != nil {
		rounds = 1
	}
	iter := uint32(1)
	best = math.Inf(1)
	for range rounds {
		start := time.Now()
		cores.start()
		for it := range tr.Iters {
			keys, vals := gradients(tr, it)
			if _, err := j.Step(ctx, iter, keys, vals); err != nil {
				return 0, 0, 0, ro, err
			}
			iter++
		}
		cores.stop()
		best = min(best, time.Since(start).Seconds()/float64(len(tr.Iters)))
	}
	hist, err := bed.Switch.Maps.RecircHistogram()
	if err != nil {
		return 0, 0, 0, ro, err
	}
	c, err := bed.Counters()
	if err != nil {
		return 0, 0, 0, ro, err
	}
	recirc = maps.RecirculationsPerPacket(hist)
	total := float64(tr.Touches()) * float64(rounds)
	hotShare = float64(c[maps.CntSparsePairs]) / total
	if layout != nil {
		var hp uint64
		for _, x := range j.Workers {
			hp += x.Stats().HotPairs
		}
		layout.Histogram, layout.RecircPerPkt, layout.Spilled, layout.HotPairs = hist, recirc, c[maps.CntSparseSpill], hp
		return best, hotShare, recirc, ro, nil
	}
	st := bed.SparsePS.Stats()
	ro.Ranks = hot.Len()
	if st.ReadOuts > 0 {
		ro.PullMicros = float64(st.ReadOutTime.Microseconds()) / float64(st.ReadOuts)
	}
	ro.AgentMicros, err = agentReadOut(bed, job, o.Arrays)
	return best, hotShare, recirc, ro, err
}

// agentReadOut times the other read-out: the job's m register arrays of one parity read with one
// batch lookup and zeroed with one batch update (the best of 20).
func agentReadOut(bed *testbed.Bed, job uint32, m int) (float64, error) {
	j, err := bed.Switch.Maps.GetJob(job)
	if err != nil {
		return 0, err
	}
	regs := bed.Switch.Maps.Registers
	keys := make([]uint32, m)
	for a := range keys {
		keys[a] = uint32(j.RegBase) + uint32(a)
	}
	vals := make([]bpf.XdpaggRegArray, m)
	zero := make([]bpf.XdpaggRegArray, m)
	best := math.Inf(1)
	for range 20 {
		start := time.Now()
		var cursor ebpf.MapBatchCursor
		got := 0
		outKeys := make([]uint32, m)
		for got < m {
			n, err := regs.BatchLookup(&cursor, outKeys[got:], vals[got:], nil)
			got += n
			if errors.Is(err, ebpf.ErrKeyNotExist) || n == 0 {
				break
			}
			if err != nil {
				return 0, fmt.Errorf("batch lookup: %w", err)
			}
		}
		if _, err := regs.BatchUpdate(keys, zero, nil); err != nil {
			return 0, fmt.Errorf("batch update: %w", err)
		}
		best = min(best, float64(time.Since(start).Nanoseconds())/1e3)
	}
	return best, nil
}

// runSparsePSOnly runs the trace with every pair sent to a PS in user space (the same hostlib,
// no hot set), on a topology without XDP whose host links are shaped to rate (0: unshaped);
// cores measures the timed rounds.
func runSparsePSOnly(ctx context.Context, o SparseOptions, tr *workload.Trace, rate uint64, cores *coreMeter) (float64, error) {
	w := tr.Workers()
	tp, err := topo.New(topo.Config{Workers: w, PS: true, MTU: o.MTU, KernelOffloads: true})
	if err != nil {
		return 0, err
	}
	defer tp.Close()
	if err := shapeLinks(tp, rate); err != nil {
		return 0, err
	}
	addr := netip.AddrPortFrom(tp.PS.IP, psPort)
	var workers []netip.AddrPort
	for _, h := range tp.Workers {
		workers = append(workers, netip.AddrPortFrom(h.IP, psWorkerPort))
	}
	var ps *hostlib.SparsePS
	if err := tp.InHost(tp.PS, func() (err error) {
		ps, err = hostlib.NewSparsePS(hostlib.SparsePSConfig{Listen: addr, MTU: o.MTU,
			Jobs: []hostlib.SparsePSJob{{ID: 2, Workers: workers}}})
		return err
	}); err != nil {
		return 0, err
	}
	sctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- ps.Serve(sctx) }()
	defer func() {
		cancel()
		ps.Close()
		<-done
	}()
	ws := make([]*hostlib.SparseWorker, w)
	for i, h := range tp.Workers {
		if err := tp.InHost(h, func() (err error) {
			ws[i], err = hostlib.NewSparseWorker(hostlib.SparseWorkerConfig{JobID: 2, WorkerID: uint8(i), NumWorkers: uint8(w),
				Local: workers[i], PS: addr, MTU: o.MTU})
			return err
		}); err != nil {
			return 0, err
		}
		defer ws[i].Close()
	}
	iter := uint32(1)
	best := math.Inf(1)
	for range o.Rounds {
		start := time.Now()
		cores.start()
		for it := range tr.Iters {
			keys, vals := gradients(tr, it)
			if _, err := testbed.StepAll(ctx, ws, iter, keys, vals); err != nil {
				return 0, err
			}
			iter++
		}
		cores.stop()
		best = min(best, time.Since(start).Seconds()/float64(len(tr.Iters)))
	}
	return best, nil
}

// runSparseDense streams the whole model (elems float32 per worker) through dense xdpagg for
// every iteration, SwitchML-style; seconds per iteration, best of the rounds (each a few
// allreduces), every host link shaped to rate (0: unshaped); cores measures the timed rounds.
func runSparseDense(ctx context.Context, o SparseOptions, w, elems int, rate uint64, cores *coreMeter) (float64, error) {
	bed, err := testbed.New(testbed.Options{Workers: w, MTU: o.MTU})
	if err != nil {
		return 0, err
	}
	defer bed.Close()
	if err := shapeLinks(bed.Topo, rate); err != nil {
		return 0, err
	}
	in := make([][]float32, w)
	for i := range in {
		in[i] = make([]float32, elems)
	}
	best := math.Inf(1)
	for range o.Rounds {
		cores.start()
		took, err := bed.AllReduce(ctx, in)
		cores.stop()
		if err != nil {
			return 0, err
		}
		best = min(best, took.Seconds())
	}
	return best, nil
}

// Table prints the three tables and the read-out comparison.
func (r *SparseResult) Table(out io.Writer) {
	fmt.Fprintf(out, "sparse benchmark on the recorded trace %s (%s); hot set: %d keys (8%% sample, Principle 1)\n", r.Trace, r.Machine, r.HotKeys)
	rep := Report{Cores: r.Cores, CPUs: r.CPUs}
	fmt.Fprintf(out, "cores busy (sparse, PS-only, dense): busy CPU-time (/proc/stat, everyone's load) of %s over the wall time of every timed round, ± the standard deviation from /proc/stat's 10 ms units\n\n", rep.countedCPUs())
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "Fig. 6\tW\tlink\tpairs/iter\tsparse xdpagg ms/iter\tPS-only ms/iter\tdense xdpagg ms/iter\tvs PS-only\tvs dense\tin switch\trecirc/pkt\tcores busy\t")
	for _, t := range r.Throughput {
		fmt.Fprintf(tw, "\t%d\t%s\t%.0f\t%.2f\t%.2f\t%.2f\t%.2fx\t%.2fx\t%.1f%%\t%.3f\t%.2f±%.2f, %.2f±%.2f, %.2f±%.2f /%d\t\n", t.Workers, FormatRate(t.LinkRate), t.Pairs, 1e3*t.SparseSec,
			1e3*t.PSOnlySec, 1e3*t.DenseSec, t.VsPSOnly, t.VsDense, 100*t.HotShare, t.RecircPerPkt,
			t.SparseCoresBusy, t.SparseCoresBusyErr, t.PSOnlyCoresBusy, t.PSOnlyCoresBusyErr, t.DenseCoresBusy, t.DenseCoresBusyErr, rep.countedCores())
	}
	tw.Flush()
	fmt.Fprintln(out)
	tw = tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "Fig. 10\tlayout\tm\trecirc/pkt\tpackets by passes (empty,1..4)\tpairs to PS\thot pairs\t")
	for _, l := range r.Layouts {
		fmt.Fprintf(tw, "\t%s\t%d\t%.3f\t%v\t%d\t%d\t\n", l.Layout, l.Arrays, l.RecircPerPkt, l.Histogram, l.Spilled, l.HotPairs)
	}
	tw.Flush()
	fmt.Fprintln(out)
	tw = tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "Fig. 9 / Table II\thot-set identification (top %d)\tprecision\tKendall tau distance\t\n", r.HotKeys)
	for _, p := range r.Precision {
		fmt.Fprintf(tw, "\t%s\t%.1f%%\t%.3f\t\n", p.Method, 100*p.Precision, p.Kendall)
	}
	tw.Flush()
	fmt.Fprintf(out, "\nread-out of %d hot ranks per iteration: PS pull through XDP %.0f us (first request to last answer); agent batch read + zero of the job's arrays %.0f us (before any send to the PS)\n",
		r.ReadOut.Ranks, r.ReadOut.PullMicros, r.ReadOut.AgentMicros)
}
