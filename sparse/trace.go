package sparse

import (
	"math"
	"math/rand/v2"
)

// Evaluation helpers over key traces: iters[i][w] = distinct keys worker w touched in iteration i
// (one "batch"). They reproduce Zebra §V-C offline: the truth is the ranking of the whole trace,
// the estimate that of a sample or of the first few iterations.

// Frequency counts how many (iteration, worker) pairs touched each key: the update frequency of
// Zebra §III-C, where a parameter updated by every worker in an iteration counts once per worker.
// A key listed twice in one batch counts once, since it is one update of that batch.
func Frequency(iters [][][]uint64) map[uint64]uint64 {
	return frequencyOf(batches(iters))
}

// batches flattens a trace into its batches (slice headers only; the keys are shared).
func batches(iters [][][]uint64) [][]uint64 {
	var all [][]uint64
	for _, workers := range iters {
		all = append(all, workers...)
	}
	return all
}

// frequencyOf counts, for each key, the batches that list it. Each entry remembers the last batch
// that counted it, which deduplicates within a batch with one map lookup per key and no per-batch
// set to build and clear.
func frequencyOf(batches [][]uint64) map[uint64]uint64 {
	type entry struct {
		n    uint64
		last int // 1 + the number of the last batch that counted this key
	}
	seen := make(map[uint64]entry)
	for i, batch := range batches {
		for _, k := range batch {
			if e := seen[k]; e.last != i+1 {
				seen[k] = entry{n: e.n + 1, last: i + 1}
			}
		}
	}
	freq := make(map[uint64]uint64, len(seen))
	for k, e := range seen {
		freq[k] = e.n
	}
	return freq
}

// SampledRanking ranks keys by frequency over a seeded random sample of `rate` of the (iteration,
// worker) batches (Zebra's sampling-based offline method: train on a random sample of the data).
//
// The sample is ceil(rate*N) of the N batches, drawn uniformly without replacement, so that any
// positive rate looks at some data and the sample size does not vary with the seed. rate >= 1
// uses every batch; rate <= 0 (or NaN) none, giving an empty ranking. The same seed gives the
// same sample.
func SampledRanking(iters [][][]uint64, rate float64, seed uint64) Ranking {
	return RankByFrequency(SampledFrequency(iters, rate, seed))
}

// SampledFrequency counts, per key, the batches that touch it in the sample SampledRanking
// ranks: what Principle 1 (ChooseK) needs besides the ranking.
func SampledFrequency(iters [][][]uint64, rate float64, seed uint64) map[uint64]uint64 {
	all := batches(iters) // a fresh slice: shuffling it leaves iters alone
	n := len(all)
	s := 0
	switch {
	case rate >= 1:
		s = n
	case rate > 0:
		s = min(n, int(math.Ceil(rate*float64(n))))
	}
	// A partial Fisher-Yates shuffle: the first s batches of all are then a uniform sample.
	rng := rand.New(rand.NewPCG(seed, seedStream))
	for i := range s {
		j := i + rng.IntN(n-i)
		all[i], all[j] = all[j], all[i]
	}
	return frequencyOf(all[:s])
}

// OfflineHotSet is Zebra's sampling-based offline identification: rank keys by frequency in a
// seeded sample `rate` of the batches (SampledFrequency), then choose k by Principle 1 (ChooseK:
// the smallest k whose keys take share p of the sample's updates, within c·memBytes of 4-byte
// registers). It returns the hot set (at version), and the share of the sample's updates its
// keys take.
func OfflineHotSet(iters [][][]uint64, rate float64, seed uint64, p, c float64, memBytes uint64, version uint32) (*HotSet, float64, error) {
	freq := SampledFrequency(iters, rate, seed)
	ranking := RankByFrequency(freq)
	k, share, _, err := ChooseK(Frequencies(ranking, freq), p, c, memBytes)
	if err != nil {
		return nil, 0, err
	}
	h, err := NewHotSet(version, ranking[:k])
	return h, share, err
}
