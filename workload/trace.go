package workload

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
)

// Limits on what a Trace may hold. Read enforces them before allocating, so that a corrupt or
// hostile file cannot make it allocate without bound; Write and Validate enforce them so that
// every trace written can be read back.
const (
	// MaxNameLen is the longest trace name, in bytes.
	MaxNameLen = 1024
	// MaxWorkers is the most workers a trace may have.
	MaxWorkers = 1 << 12
	// MaxBatches is the most (iteration, worker) batches a trace may have.
	MaxBatches = 1 << 22
	// MaxKeys is the most keys all batches of a trace may hold together (512 MiB of uint64).
	MaxKeys = 1 << 26
)

var (
	// ErrBadTrace reports a trace, in memory or in a file, that breaks the format's rules.
	ErrBadTrace = errors.New("bad trace")
	// ErrInvalid reports an invalid argument or generator configuration.
	ErrInvalid = errors.New("invalid argument")
)

// Trace records which parameter rows (keys) each worker's gradient touches in each iteration of a
// data-parallel training job: the non-zero rows of a sparse embedding gradient, which are what a
// worker sends and what the switch aggregates.
type Trace struct {
	// Name says where the trace comes from.
	Name string
	// KeySpace bounds the keys: every key is in [0, KeySpace).
	KeySpace uint64
	// Iters[i][w] holds the keys worker w touched in iteration i, strictly increasing. Every
	// iteration has the same number of workers.
	Iters [][][]uint64
}

// Workers returns the number of workers, 0 for a trace without iterations.
func (t *Trace) Workers() int {
	if len(t.Iters) == 0 {
		return 0
	}
	return len(t.Iters[0])
}

// Batches returns the number of (iteration, worker) batches.
func (t *Trace) Batches() int { return len(t.Iters) * t.Workers() }

// Touches returns the number of key touches: the sum of all batch sizes.
func (t *Trace) Touches() uint64 {
	var n uint64
	for _, it := range t.Iters {
		for _, b := range it {
			n += uint64(len(b))
		}
	}
	return n
}

// Validate checks that t obeys the rules Write and Read rely on: the name and counts within the
// Max limits, every iteration with the same, non-zero number of workers, and every batch strictly
// increasing below KeySpace. Its errors wrap ErrBadTrace.
func (t *Trace) Validate() error {
	if len(t.Name) > MaxNameLen {
		return fmt.Errorf("%w: name of %d bytes exceeds %d", ErrBadTrace, len(t.Name), MaxNameLen)
	}
	w := t.Workers()
	if len(t.Iters) > 0 && w == 0 {
		return fmt.Errorf("%w: iterations without workers", ErrBadTrace)
	}
	if w > MaxWorkers {
		return fmt.Errorf("%w: %d workers exceed %d", ErrBadTrace, w, MaxWorkers)
	}
	if len(t.Iters) > MaxBatches || (w > 0 && len(t.Iters) > MaxBatches/w) {
		return fmt.Errorf("%w: %d iterations of %d workers exceed %d batches", ErrBadTrace, len(t.Iters), w, MaxBatches)
	}
	var keys uint64
	for i, it := range t.Iters {
		if len(it) != w {
			return fmt.Errorf("%w: iteration %d has %d workers, iteration 0 has %d", ErrBadTrace, i, len(it), w)
		}
		for j, b := range it {
			keys += uint64(len(b))
			if keys > MaxKeys {
				return fmt.Errorf("%w: more than %d keys", ErrBadTrace, MaxKeys)
			}
			for n, k := range b {
				if k >= t.KeySpace {
					return fmt.Errorf("%w: iteration %d worker %d: key %d outside key space %d", ErrBadTrace, i, j, k, t.KeySpace)
				}
				if n > 0 && k <= b[n-1] {
					return fmt.Errorf("%w: iteration %d worker %d: keys not strictly increasing at %d", ErrBadTrace, i, j, n)
				}
			}
		}
	}
	return nil
}

// Frequency returns, for every key touched, the number of (iteration, worker) batches touching
// it: the update frequency Zebra ranks parameters by.
func (t *Trace) Frequency() map[uint64]uint64 {
	f := make(map[uint64]uint64)
	for _, it := range t.Iters {
		for _, b := range it {
			for _, k := range b {
				f[k]++
			}
		}
	}
	return f
}

// denseLimit is the largest key space counted in a slice indexed by key rather than in a map: a
// slice is many times faster, as long as clearing and scanning its 4 bytes per key (16 MiB here)
// doesn't outweigh the touches counted.
const denseLimit = 1 << 22

// counts returns the non-zero per-key touch counts, in no particular order.
func (t *Trace) counts() []uint64 {
	if t.KeySpace > denseLimit {
		f := t.Frequency()
		c := make([]uint64, 0, len(f))
		for _, n := range f {
			c = append(c, n)
		}
		return c
	}
	// A key is touched at most once per batch and batches are at most MaxBatches (< 2^32), so
	// uint32 counters cannot overflow.
	dense := make([]uint32, t.KeySpace)
	for _, it := range t.Iters {
		for _, b := range it {
			for _, k := range b {
				if k < uint64(len(dense)) { // only false for an invalid trace; don't panic on it
					dense[k]++
				}
			}
		}
	}
	var c []uint64
	for _, n := range dense {
		if n > 0 {
			c = append(c, uint64(n))
		}
	}
	return c
}

// TopShare returns the share of all key touches taken by the k most frequently touched keys: the
// cumulative proportion of Figure 4 of the Zebra paper, i.e. the fraction of the update traffic a
// switch holding those k keys would aggregate. It is 0 for k <= 0 or a trace without touches.
func (t *Trace) TopShare(k int) float64 {
	return topShares(t.counts(), []int{k})[0]
}

// TopShares is TopShare for several k at once, counting the trace only once.
func (t *Trace) TopShares(ks ...int) []float64 {
	return topShares(t.counts(), ks)
}

// topShares computes TopShare for each of ks from per-key counts. It buckets keys by count instead
// of sorting them, since counts are at most the number of batches: O(keys + batches).
func topShares(counts []uint64, ks []int) []float64 {
	var total, maxCount uint64
	for _, c := range counts {
		total += c
		maxCount = max(maxCount, c)
	}
	out := make([]float64, len(ks))
	if total == 0 {
		return out
	}
	hist := make([]uint64, maxCount+1) // hist[c]: number of keys touched c times
	for _, c := range counts {
		hist[c]++
	}
	for i, k := range ks {
		if k <= 0 {
			continue
		}
		left, sum := uint64(k), uint64(0)
		for c := maxCount; c > 0 && left > 0; c-- {
			n := min(hist[c], left)
			sum += n * c
			left -= n
		}
		out[i] = float64(sum) / float64(total)
	}
	return out
}

// TopKeys returns the k most frequently touched keys, most frequent first, ties broken by the
// smaller key so that the result is deterministic: the hot set a Zebra-style switch would hold.
func (t *Trace) TopKeys(k int) []uint64 {
	if k <= 0 {
		return nil
	}
	type kc struct{ key, n uint64 }
	f := t.Frequency()
	all := make([]kc, 0, len(f))
	for key, n := range f {
		all = append(all, kc{key, n})
	}
	slices.SortFunc(all, func(a, b kc) int {
		if c := cmp.Compare(b.n, a.n); c != 0 {
			return c
		}
		return cmp.Compare(a.key, b.key)
	})
	out := make([]uint64, 0, min(k, len(all)))
	for _, e := range all[:min(k, len(all))] {
		out = append(out, e.key)
	}
	return out
}

// Slice returns the first `workers` workers of the first `iters` iterations of t. The result
// shares its key slices with t: treat both as read-only.
func (t *Trace) Slice(workers, iters int) (*Trace, error) {
	if workers < 1 || workers > t.Workers() {
		return nil, fmt.Errorf("%w: %d workers of a trace with %d", ErrInvalid, workers, t.Workers())
	}
	if iters < 0 || iters > len(t.Iters) {
		return nil, fmt.Errorf("%w: %d iterations of a trace with %d", ErrInvalid, iters, len(t.Iters))
	}
	out := &Trace{Name: t.Name, KeySpace: t.KeySpace, Iters: make([][][]uint64, iters)}
	for i := range out.Iters {
		out.Iters[i] = t.Iters[i][:workers:workers]
	}
	return out, nil
}

// Regroup re-deals the batches of each iteration over `workers` workers, so that one recording
// (say with 8 workers) can stand for the same training job run with 2, 4 or 16 workers. It keeps
// each iteration's multiset of keys (how many workers touch each key, which is what a switch
// aggregates) as close as a set-per-worker trace allows:
//
//   - Fewer workers: batch b goes to worker b mod workers, as in a round-robin deal. A key the
//     receiving worker already holds (because another of its batches touched it too) moves on to
//     the next worker, cyclically, that lacks it. A key is dropped only when all workers hold it,
//     i.e. when more than `workers` original batches touched it, which no worker count of that
//     size can express: the multiset loses exactly sum over keys of max(0, m(key) - workers).
//     Merging the batches by plain union instead would lose every repeat within a merged pair and
//     make the aggregation look less effective than the recorded job was.
//   - More workers: batch b is split among the workers w with w mod old == b, its sorted keys dealt
//     round-robin over those parts. Every key stays exactly once per original batch, so the
//     multiset is unchanged; a key's parts land on distinct workers, so batches stay sets.
//
// When the counts don't divide each other, workers get unequal shares of the batches (8 to 3: 3,
// 3 and 2 batches), as a round-robin deal does. The result never shares memory with t.
func (t *Trace) Regroup(workers int) (*Trace, error) {
	if workers < 1 || workers > MaxWorkers || len(t.Iters) > MaxBatches/workers {
		return nil, fmt.Errorf("%w: regroup into %d workers", ErrInvalid, workers)
	}
	if len(t.Iters) > 0 && t.Workers() == 0 {
		return nil, fmt.Errorf("%w: iterations without workers", ErrBadTrace)
	}
	out := &Trace{Name: t.Name, KeySpace: t.KeySpace, Iters: make([][][]uint64, len(t.Iters))}
	for i, it := range t.Iters {
		if workers <= len(it) {
			out.Iters[i] = merge(it, workers)
		} else {
			out.Iters[i] = split(it, workers)
		}
	}
	return out, nil
}

// merge deals the batches of one iteration over workers <= len(batches) workers (see Regroup).
func merge(batches [][]uint64, workers int) [][]uint64 {
	held := make([]map[uint64]struct{}, workers)
	for w := range held {
		held[w] = make(map[uint64]struct{})
	}
	for b, keys := range batches {
		for _, k := range keys {
			for step := range workers {
				w := (b + step) % workers
				if _, ok := held[w][k]; !ok {
					held[w][k] = struct{}{}
					break
				}
			}
		}
	}
	out := make([][]uint64, workers)
	for w, h := range held {
		keys := make([]uint64, 0, len(h))
		for k := range h {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		out[w] = keys
	}
	return out
}

// split deals the batches of one iteration over workers > len(batches) workers (see Regroup).
func split(batches [][]uint64, workers int) [][]uint64 {
	old := len(batches)
	out := make([][]uint64, workers)
	for b, keys := range batches {
		parts := (workers - b + old - 1) / old // workers w < `workers` with w mod old == b
		for p := range parts {
			// Every parts-th key from position p on: sorted, and disjoint from the other parts.
			part := make([]uint64, 0, (len(keys)+parts-1-p)/parts)
			for j := p; j < len(keys); j += parts {
				part = append(part, keys[j])
			}
			out[b+p*old] = part
		}
	}
	return out
}
