package sparse

// Online is Zebra's iteration-based hot identification: frequencies gathered every Period
// iterations, the top K recomputed, and a swap proposed only when the Kendall tau distance between
// the current top-K and the new one is at least Threshold.
//
// The threshold exists because a swap is expensive (Zebra §V-C: sorting, then notifying every
// worker and switch, which re-zero their registers): a re-ranking that merely reorders a few
// lukewarm keys is not worth it. Counts are cumulative over the whole run rather than per period,
// so the proposed set converges as evidence accumulates instead of chasing one period's noise.
//
// The zero value is ready to use: set K, Period and Threshold, then call Observe once per
// iteration and Propose when Due. K <= 0 ranks every key seen; Period <= 0 is never Due (call
// Propose whenever you like). An Online is not safe for concurrent use.
type Online struct {
	K, Period int
	Threshold float64

	counts map[uint64]uint64 // cumulative update counts per key
	iters  int               // iterations observed in total
	since  int               // iterations observed since the last Propose
}

// Observe adds one iteration's per-key update counts (how many workers touched each key). Keys
// with count 0 are ignored; a nil or empty map still counts as an iteration (nothing was hot).
// Counts saturate at the largest uint64 instead of wrapping, so a key can never look cold
// because it was too hot.
func (o *Online) Observe(counts map[uint64]uint64) {
	if o.counts == nil {
		o.counts = make(map[uint64]uint64, len(counts))
	}
	for k, n := range counts {
		if n == 0 {
			continue
		}
		s := o.counts[k] + n
		if s < n {
			s = ^uint64(0)
		}
		o.counts[k] = s
	}
	o.iters++
	o.since++
}

// Iterations returns how many iterations have been observed in total.
func (o *Online) Iterations() int { return o.iters }

// Due reports whether Period iterations have been observed since the last Propose.
func (o *Online) Due() bool { return o.Period > 0 && o.since >= o.Period }

// Propose ranks every key by its cumulative count and returns the top K as next, the normalized
// Kendall tau distance between it and the top K of current (see KendallTauDistance), and whether
// that distance is at least Threshold, i.e. whether to swap current for next. It uses all counts
// so far (cumulative) and resets the period counter, so that Due restarts whether or not the
// caller swaps. next is a fresh slice the caller owns.
func (o *Online) Propose(current Ranking) (next Ranking, distance float64, swap bool) {
	next = RankByFrequency(o.counts)
	if o.K > 0 && len(next) > o.K {
		next = next[:o.K:o.K]
	}
	o.since = 0
	distance = KendallTauDistance(current, next, o.K)
	return next, distance, distance >= o.Threshold
}
