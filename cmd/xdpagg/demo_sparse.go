package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"time"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/hostlib"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/netns_tests/testbed"
	"github.com/xdpagg/xdpagg/sparse"
	"github.com/xdpagg/xdpagg/workload"
)

// sparseDemoReport is what `xdpagg demo --sparse --json` prints.
type sparseDemoReport struct {
	Trace          string            `json:"trace"`
	Workers        int               `json:"workers"`
	Iterations     int               `json:"iterations"`
	RegArrays      int               `json:"reg_arrays"`
	HotKeys        int               `json:"hot_keys"`
	HotShareSample float64           `json:"hot_share_in_sample"`
	Pairs          uint64            `json:"pairs"`
	HotPairs       uint64            `json:"hot_pairs"`
	Seconds        float64           `json:"seconds"`
	PairsPerSec    float64           `json:"pairs_per_second"`
	Verified       int               `json:"keys_verified"`
	Wrong          int               `json:"keys_wrong"`
	MaxAbsError    float64           `json:"max_abs_error"`
	Recirculation  []uint64          `json:"packets_by_passes"`
	RecircPerPkt   float64           `json:"recirculations_per_packet"`
	Counters       map[string]uint64 `json:"switch_counters"`
	PS             hostlib.SparsePSStats
	WorkerResends  uint64 `json:"worker_resends"`
	SampleRate     float64
	PrincipleP     float64
	PrincipleShare float64
}

// sparseDemoOptions are the flags of `xdpagg demo --sparse`.
type sparseDemoOptions struct {
	workers, iterations, arrays int
	trace                       string
	sample, p                   float64
	mtu                         int
	asJSON                      bool
}

// runSparseDemo trains through a recorded sparse-model trace (which embedding rows each worker's
// gradient touches in each iteration): hot keys chosen offline from a sample (Zebra's sampling
// method and Principle 1) are summed in the XDP switch's registers, the rest at the PS, and
// every key of every iteration's update is checked against the exact sum.
func runSparseDemo(ctx context.Context, o sparseDemoOptions, stdout io.Writer) error {
	progress := func(format string, a ...any) {
		if !o.asJSON {
			fmt.Fprintf(stdout, format+"\n", a...)
		}
	}
	tr, err := workload.Recorded(o.trace)
	if err != nil {
		return err
	}
	if tr, err = tr.Regroup(o.workers); err != nil {
		return err
	}
	if o.iterations > 0 && o.iterations < len(tr.Iters) {
		if tr, err = tr.Slice(o.workers, o.iterations); err != nil {
			return err
		}
	}
	rep := sparseDemoReport{Trace: o.trace, Workers: o.workers, Iterations: len(tr.Iters), RegArrays: o.arrays,
		SampleRate: o.sample, PrincipleP: o.p}

	// Offline hot identification: rank by a sample of the batches, k by Principle 1 within the
	// job's registers (c = 1 of m·r·4 bytes).
	freq := sparse.Frequency(tr.Iters)
	hot, share, err := sparse.OfflineHotSet(tr.Iters, o.sample, 1, o.p, 1, uint64(o.arrays)*uint64(bpf.RegSlots)*4, 1)
	if err != nil {
		return err
	}
	k := hot.Len()
	rep.HotKeys, rep.PrincipleShare = k, share
	progress("trace %s: %d iterations, %d workers, %d keys touched; hot set: top %d keys of a %.0f%% sample (they take %.0f%% of its updates; Principle 1 with p=%.2f, %d registers)",
		o.trace, len(tr.Iters), o.workers, len(freq), k, 100*o.sample, 100*share, o.p, o.arrays*int(bpf.RegSlots))

	progress("building topology: switch namespace + %d workers + parameter server (veth, native XDP)", o.workers)
	bed, err := testbed.New(testbed.Options{Workers: o.workers, MTU: o.mtu,
		Switch: loader.Config{PoolSize: 256, RegArrays: uint32(o.arrays)}})
	if err != nil {
		return err
	}
	defer bed.Close()
	const jobID = 100
	hosts := make([]int, o.workers)
	for i := range hosts {
		hosts[i] = i
	}
	if err := bed.StartSparse(testbed.SparseJobSpec{ID: jobID, Hosts: hosts, Arrays: o.arrays, Hot: hot}); err != nil {
		return err
	}
	job := bed.SparseJob(jobID)
	before, err := bed.Counters()
	if err != nil {
		return err
	}
	bound := float64(o.workers) * math.Ldexp(1, -int(hostlib.DefaultScaleLog2)-1)
	var took time.Duration
	for it, batches := range tr.Iters {
		keys := make([][]uint64, o.workers)
		vals := make([][]float32, o.workers)
		ref := map[uint64]float64{}
		for w, b := range batches {
			keys[w] = b
			vals[w] = workload.Values(w, it, b, 7)
			for i, k := range b {
				ref[k] += float64(vals[w][i])
			}
			rep.Pairs += uint64(len(b))
		}
		start := time.Now()
		ups, err := job.Step(ctx, uint32(it+1), keys, vals)
		took += time.Since(start)
		if err != nil {
			return err
		}
		for _, up := range ups {
			if len(up.Keys) != len(ref) {
				rep.Wrong += len(ref)
				continue
			}
			for i, k := range up.Keys {
				want, ok := ref[k]
				d := math.Abs(float64(up.Vals[i]) - want)
				rep.MaxAbsError = max(rep.MaxAbsError, d)
				if !ok || d > bound+math.Abs(want)*0x1p-23 || math.IsNaN(float64(up.Vals[i])) {
					rep.Wrong++
				}
				rep.Verified++
			}
		}
		if (it+1)%50 == 0 || it+1 == len(tr.Iters) {
			progress("iteration %d/%d: every key of every worker's update checked (%d wrong so far)", it+1, len(tr.Iters), rep.Wrong)
		}
	}
	after, err := bed.Counters()
	if err != nil {
		return err
	}
	d := after.Sub(before)
	rep.Counters = d.Map()
	rep.Seconds = took.Seconds()
	rep.PairsPerSec = float64(rep.Pairs) / took.Seconds()
	for _, w := range job.Workers {
		s := w.Stats()
		rep.HotPairs += s.HotPairs
		rep.WorkerResends += s.Resends
	}
	if rep.Recirculation, err = bed.Switch.Maps.RecircHistogram(); err != nil {
		return err
	}
	rep.RecircPerPkt = maps.RecirculationsPerPacket(rep.Recirculation)
	rep.PS = bed.SparsePS.Stats()
	if o.asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(rep); err != nil {
			return err
		}
	} else {
		fmt.Fprintf(stdout, "\nverified %d keys: %d wrong (max |error| %.3g, bound %.3g + float32 rounding)\n", rep.Verified, rep.Wrong, rep.MaxAbsError, bound)
		fmt.Fprintf(stdout, "pairs: %d, %.1f%% summed in the switch's registers (%d pairs, %d iterations completed there), %d pairs left to the PS\n",
			rep.Pairs, 100*float64(d[maps.CntSparsePairs])/float64(rep.Pairs), d[maps.CntSparsePairs], d[maps.CntSparseDone], d[maps.CntSparseSpill])
		fmt.Fprintf(stdout, "hot packets by passes (empty, 1..%d): %v: %.3f recirculations per packet (Algorithm 1, heat-based layout)\n",
			bpf.SparseMaxPasses, rep.Recirculation, rep.RecircPerPkt)
		fmt.Fprintf(stdout, "%.3fs for %d iterations: %.3g gradient pairs/s; PS read-outs %d (%d pending), worker resends %d\n",
			rep.Seconds, rep.Iterations, rep.PairsPerSec, rep.PS.Pulls, rep.PS.PullsPending, rep.WorkerResends)
	}
	if rep.Wrong > 0 {
		return errors.New("demo: some keys were wrong")
	}
	return nil
}
