package sparse

import (
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
)

// The Zipf workload of the evaluation tests: a sparse model's key trace where update frequency
// is heavily skewed, as Zebra measures on industrial models (its Figure 4).
const (
	zipfS        = 1.1     // Zipf exponent
	zipfKeys     = 100_000 // key space
	zipfWorkers  = 8
	zipfPerBatch = 2000 // distinct keys per worker per iteration
	zipfIters    = 10
	zipfHot      = 8192 // hot set: top ranks by frequency
	maxPasses    = 4    // XAGG_SPARSE_MAX_PASSES of bpf/xdpagg.h
)

// zipfTrace is iters[i][w]: the distinct keys worker w touches in iteration i, each batch sorted
// by key as PS-lite sends them (so the order says nothing about heat). Zipf values are scattered
// over the uint64 key space by an odd multiplier (a bijection), so no test can mistake a key for
// its rank. Generated once; tests must not modify it.
var zipfTrace = sync.OnceValue(func() [][][]uint64 {
	rng := rand.New(rand.NewPCG(2024, 1))
	z := rand.NewZipf(rng, zipfS, 1, zipfKeys-1)
	iters := make([][][]uint64, zipfIters)
	seen := make(map[uint64]bool, zipfPerBatch)
	for i := range iters {
		iters[i] = make([][]uint64, zipfWorkers)
		for w := range iters[i] {
			clear(seen)
			batch := make([]uint64, 0, zipfPerBatch)
			for len(batch) < zipfPerBatch {
				if k := z.Uint64() * 0x9e3779b97f4a7c15; !seen[k] {
					seen[k] = true
					batch = append(batch, k)
				}
			}
			slices.Sort(batch)
			iters[i][w] = batch
		}
	}
	return iters
})

// hotRanks returns, per batch, the ranks of its hot keys in batch order: what a worker packs.
func hotRanks(iters [][][]uint64, hot *HotSet) [][]uint32 {
	var out [][]uint32
	for _, workers := range iters {
		for _, batch := range workers {
			var ranks []uint32
			for _, k := range batch {
				if r, ok := hot.Rank(k); ok {
					ranks = append(ranks, r)
				}
			}
			out = append(out, ranks)
		}
	}
	return out
}

// TestZipfRecirculations is Zebra §V-D on a synthetic trace: recirculations per packet with
// heat-based layout and Algorithm 1 against a random layout packed in order.
//
// A packet can touch each array once per pass, so a packet of more than m pairs cannot avoid
// recirculating: with maxPairs = 179 and m = 64, every full packet takes at least ceil(179/64) = 3
// passes. Algorithm 1 sizes its packet count for maxPairs, so at m = 64 it fills packets past m
// and the ranks that do not fit conflict-free (G') end up in crowded packets; it still beats the
// random layout by a wide margin, but it cannot get below one recirculation per packet. Below
// one needs m >= maxPairs: m = 256 (XAGG_JOB_MAX_ARRAYS, and 256 arrays of 1024 slots are
// Zebra's 1 MiB of registers) shows it.
func TestZipfRecirculations(t *testing.T) {
	iters := zipfTrace()
	truth := RankByFrequency(Frequency(iters))
	hot, err := NewHotSet(1, truth[:zipfHot])
	if err != nil {
		t.Fatal(err)
	}
	batches := hotRanks(iters, hot)
	perm := Permutation(zipfHot, 7)

	tests := []struct {
		m, maxPairs int
	}{
		{64, 179},
		{256, 179},
	}
	for _, tt := range tests {
		var zebraPkts, zebraRC, zebraPS, randPkts, randRC, randPS, pairs int
		for _, ranks := range batches {
			pairs += len(ranks)
			packets := Pack(ranks, tt.m, tt.maxPairs)
			rc, _ := Recirculations(ranks, packets, tt.m, 0)
			_, ps := Recirculations(ranks, packets, tt.m, maxPasses)
			zebraPkts, zebraRC, zebraPS = zebraPkts+len(packets), zebraRC+rc, zebraPS+ps

			// Random layout: rank r lives at position perm[r], packed as it comes.
			shuffled := make([]uint32, len(ranks))
			for i, r := range ranks {
				shuffled[i] = perm[r]
			}
			packets = PackInOrder(shuffled, tt.maxPairs)
			rc, _ = Recirculations(shuffled, packets, tt.m, 0)
			_, ps = Recirculations(shuffled, packets, tt.m, maxPasses)
			randPkts, randRC, randPS = randPkts+len(packets), randRC+rc, randPS+ps
		}
		zebra := float64(zebraRC) / float64(zebraPkts)
		random := float64(randRC) / float64(randPkts)
		t.Logf("m = %d, maxPairs = %d, %d hot pairs in %d batches: recirculations per packet: "+
			"heat-based + Pack %.3f (%d packets), random + PackInOrder %.3f (%d packets); "+
			"pairs left to the PS after %d passes: %d vs %d",
			tt.m, tt.maxPairs, pairs, len(batches), zebra, zebraPkts, random, randPkts,
			maxPasses, zebraPS, randPS)
		if zebra >= random/2 {
			t.Errorf("m = %d: heat-based + Pack %.3f recirculations per packet, not under half of random's %.3f",
				tt.m, zebra, random)
		}
		if tt.maxPairs <= tt.m && zebra >= 1 {
			t.Errorf("m = %d: heat-based + Pack %.3f recirculations per packet, want < 1", tt.m, zebra)
		}
		if zebraPS > randPS {
			t.Errorf("m = %d: heat-based + Pack leaves %d pairs to the PS, random %d", tt.m, zebraPS, randPS)
		}
	}
}

// TestZipfIdentification is Zebra §V-C on a synthetic trace: how well a sample of the batches
// (offline) and the first iteration (online) find the hottest keys of the whole trace. The trace
// is only 80 batches, so frequencies below the head are mostly ties and the tail of a large hot
// set is noise; the numbers are logged for comparison with the paper and asserted only for the
// head.
func TestZipfIdentification(t *testing.T) {
	iters := zipfTrace()
	freq := Frequency(iters)
	truth := RankByFrequency(freq)
	k, share, capped, err := ChooseK(Frequencies(truth, freq), 0.8, 0.05, 20<<20)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("Principle 1 (p = 0.8, c = 0.05 of 20 MiB): k = %d of %d keys, share %.3f, capped %v",
		k, len(truth), share, capped)

	const head = 1024
	for _, rate := range []float64{0.04, 0.08, 0.25} {
		est := SampledRanking(iters, rate, 1)
		for _, kk := range []int{head, zipfHot} {
			prec, dist := Precision(truth, est, kk), KendallTauDistance(truth, est, kk)
			t.Logf("sampling %2.0f%% of batches, top %4d: precision %.3f, Kendall tau distance %.3f",
				rate*100, kk, prec, dist)
			if rate == 0.25 && kk == head && prec < 0.8 {
				t.Errorf("25%% sample: precision %.3f on the top %d, want >= 0.8", prec, head)
			}
		}
	}

	o := Online{K: zipfHot, Period: 1, Threshold: 0.1}
	o.Observe(Frequency(iters[:1]))
	if !o.Due() {
		t.Fatal("not due after one period")
	}
	est, dist, swap := o.Propose(nil)
	for _, kk := range []int{head, zipfHot} {
		t.Logf("online after 1 of %d iterations, top %4d: precision %.3f", len(iters), kk, Precision(truth, est, kk))
	}
	if prec := Precision(truth, est, head); !swap || dist != 1 || prec < 0.6 {
		t.Errorf("online after one iteration: precision %.3f on the top %d, distance %v, swap %v; "+
			"want >= 0.6, 1, true", prec, head, dist, swap)
	}
	for _, workers := range iters[1:] {
		o.Observe(Frequency([][][]uint64{workers}))
	}
	next, dist, swap := o.Propose(est)
	if !slices.Equal(next, truth[:zipfHot]) {
		t.Error("online over the whole trace differs from the truth")
	}
	t.Logf("online after all %d iterations: distance to the first set %.3f (swap at 0.1: %v)", len(iters), dist, swap)
}

// BenchmarkPack packs a Zebra-sized iteration: 30,000 hot ranks (Zebra's k) over 64 arrays at
// 179 pairs per packet.
func BenchmarkPack(b *testing.B) {
	ranks := Permutation(1<<16, 1)[:30_000]
	b.ReportAllocs()
	for b.Loop() {
		Pack(ranks, 64, 179)
	}
}
