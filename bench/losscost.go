package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"runtime"
	"slices"
	"time"

	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/netns_tests/testbed"
	"github.com/xdpagg/xdpagg/netns_tests/topo"
)

// LossCostOptions configures LossCost. Zero values take defaults.
type LossCostOptions struct {
	Workers int     // default 4
	Bytes   int     // tensor size per worker (float32), default 4 MiB
	Pairs   int     // clean/lossy pairs, default 15
	Loss    float64 // percent of packets dropped each way on every worker link, default 0.1
	MTU     int     // of every link (0: DefaultMTU)
	Window  int     // worker window (0: hostlib's default)
	// Timeout is the workers' retransmit timeout (0: hostlib's default, as in the benchmark's
	// xdpagg mode).
	Timeout  time.Duration
	Progress io.Writer
}

func (o LossCostOptions) withDefaults() LossCostOptions {
	if o.Workers == 0 {
		o.Workers = 4
	}
	if o.Bytes == 0 {
		o.Bytes = 4 << 20
	}
	if o.Pairs == 0 {
		o.Pairs = 15
	}
	if o.Loss == 0 {
		o.Loss = 0.1
	}
	if o.MTU == 0 {
		o.MTU = DefaultMTU
	}
	return o
}

// LossCostResult is the time cost of loss to xdpagg: per pair, time(lossy)/time(clean).
type LossCostResult struct {
	Workers      int       `json:"workers"`
	Bytes        int       `json:"bytes"`
	LossPercent  float64   `json:"loss_percent"` // each way, on every worker link
	MTU          int       `json:"mtu"`
	Ratios       []float64 `json:"ratios"` // lossy/clean per pair, in run order
	Median       float64   `json:"median"`
	P10          float64   `json:"p10"`
	P90          float64   `json:"p90"`
	CleanMedian  float64   `json:"clean_median_s"`
	LossyMedian  float64   `json:"lossy_median_s"`
	LossyResends float64   `json:"lossy_resends_per_allreduce"` // DATA packets resent, all workers
	CleanResends float64   `json:"clean_resends_per_allreduce"`
}

// LossCost measures what packet loss costs xdpagg's allreduce: on one testbed, after a warm-up,
// Pairs pairs of allreduces, the first of each pair clean and the second with Loss percent of
// packets dropped in both directions on every worker's link (topo.Impair), so that both halves of
// a pair share the machine's drift. It reports the median per-pair ratio lossy/clean with p10
// and p90, and verifies every result. Nothing else of the benchmark runs meanwhile.
func LossCost(ctx context.Context, o LossCostOptions) (*LossCostResult, error) {
	o = o.withDefaults()
	switch {
	case o.Workers < 2 || o.Workers > 32:
		return nil, fmt.Errorf("%w: loss cost: %d workers: use 2..32", ErrConfig, o.Workers)
	case o.Bytes < 4 || o.Bytes%4 != 0:
		return nil, fmt.Errorf("%w: loss cost: size %d bytes: use a positive multiple of 4", ErrConfig, o.Bytes)
	case o.Pairs < 1:
		return nil, fmt.Errorf("%w: loss cost: %d pairs: use at least 1", ErrConfig, o.Pairs)
	case o.Loss <= 0 || o.Loss > 100:
		return nil, fmt.Errorf("%w: loss cost: loss %g%%: use (0, 100]", ErrConfig, o.Loss)
	case o.MTU != 0 && (o.MTU < 576 || o.MTU > 3388):
		return nil, fmt.Errorf("%w: loss cost: MTU %d: use 576..3388", ErrConfig, o.MTU)
	}
	if o.Progress != nil {
		fmt.Fprintf(o.Progress, "\r\033[Kloss cost: W=%d %s, %g%% loss, %d pairs", o.Workers, humanBytes(o.Bytes), o.Loss, o.Pairs)
		defer fmt.Fprint(o.Progress, "\r\033[K")
	}
	bed, err := testbed.New(testbed.Options{Workers: o.Workers, Window: o.Window, MTU: o.MTU, Timeout: o.Timeout,
		Switch: loader.Config{PoolSize: 4096}})
	if err != nil {
		return nil, fmt.Errorf("loss cost: testbed: %w", err)
	}
	defer bed.Close()

	lossy := func(on bool) error {
		var errs []error
		for _, h := range bed.Topo.Workers {
			for _, dir := range []topo.Direction{topo.ToSwitch, topo.FromSwitch} {
				if on {
					errs = append(errs, bed.Topo.Impair(h, dir, topo.Impairment{Loss: o.Loss}))
				} else {
					errs = append(errs, bed.Topo.ClearImpair(h, dir))
				}
			}
		}
		return errors.Join(errs...)
	}
	n := o.Bytes / 4
	pristine, ref := makeInputs(o.Workers, n, 0x1055<<32|uint64(n))
	work := make([][]float32, o.Workers)
	for i := range work {
		work[i] = make([]float32, n)
	}
	resends := func() (total uint64) {
		for _, w := range bed.Workers {
			total += w.Stats().Retransmits // FastResends are a part of them
		}
		return total
	}
	run := func(what string) (time.Duration, uint64, error) {
		for i := range work {
			copy(work[i], pristine[i])
		}
		r0 := resends()
		d, err := bed.AllReduce(ctx, work)
		if err != nil {
			return 0, 0, fmt.Errorf("loss cost: %s allreduce: %w", what, err)
		}
		if err := checkWithin(work, ref, float64(len(work))*math.Ldexp(1, -25), 0x1p-23); err != nil {
			return 0, 0, fmt.Errorf("loss cost: %s allreduce: wrong result: %w", what, err)
		}
		return d, resends() - r0, nil
	}
	runtime.GC()
	settle()
	if _, _, err := run("warm-up"); err != nil {
		return nil, err
	}
	res := &LossCostResult{Workers: o.Workers, Bytes: o.Bytes, LossPercent: o.Loss, MTU: o.MTU}
	var cleanT, lossyT []float64
	var cleanR, lossyR uint64
	for p := range o.Pairs {
		if o.Progress != nil {
			fmt.Fprintf(o.Progress, "\r\033[Kloss cost: W=%d %s, %g%% loss, pair %d/%d", o.Workers, humanBytes(o.Bytes), o.Loss, p+1, o.Pairs)
		}
		if err := lossy(false); err != nil {
			return nil, fmt.Errorf("loss cost: clear loss: %w", err)
		}
		c, cr, err := run("clean")
		if err != nil {
			return nil, err
		}
		if err := lossy(true); err != nil {
			return nil, fmt.Errorf("loss cost: inject loss: %w", err)
		}
		l, lr, err := run("lossy")
		if err != nil {
			return nil, err
		}
		cleanT, lossyT = append(cleanT, c.Seconds()), append(lossyT, l.Seconds())
		cleanR, lossyR = cleanR+cr, lossyR+lr
		res.Ratios = append(res.Ratios, l.Seconds()/c.Seconds())
	}
	if err := lossy(false); err != nil {
		return nil, fmt.Errorf("loss cost: clear loss: %w", err)
	}
	sorted := slices.Sorted(slices.Values(res.Ratios))
	res.Median, res.P10, res.P90 = quantile(sorted, 0.5), quantile(sorted, 0.1), quantile(sorted, 0.9)
	slices.Sort(cleanT)
	slices.Sort(lossyT)
	res.CleanMedian, res.LossyMedian = quantile(cleanT, 0.5), quantile(lossyT, 0.5)
	res.CleanResends = float64(cleanR) / float64(o.Pairs)
	res.LossyResends = float64(lossyR) / float64(o.Pairs)
	return res, nil
}

// Table prints the loss cost in one paragraph.
func (r *LossCostResult) Table(w io.Writer) {
	mtu := r.MTU
	if mtu == 0 {
		mtu = 1500
	}
	fmt.Fprintf(w, "loss cost: xdpagg, W=%d, %s, MTU %d, %g%% loss both ways on every worker link, %d clean/lossy pairs:\n",
		r.Workers, humanBytes(r.Bytes), mtu, r.LossPercent, len(r.Ratios))
	fmt.Fprintf(w, "  lossy/clean time %.3f (p10 %.3f, p90 %.3f); clean %.3f ms, lossy %.3f ms (medians); resends per allreduce: clean %.1f, lossy %.1f\n",
		r.Median, r.P10, r.P90, 1e3*r.CleanMedian, 1e3*r.LossyMedian, r.CleanResends, r.LossyResends)
}
