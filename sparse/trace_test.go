package sparse

import (
	"maps"
	"slices"
	"testing"
)

func TestFrequency(t *testing.T) {
	tests := []struct {
		name  string
		iters [][][]uint64
		want  map[uint64]uint64
	}{
		{"nil", nil, map[uint64]uint64{}},
		{"empty batches", [][][]uint64{{nil, {}}, {}}, map[uint64]uint64{}},
		{"one batch", [][][]uint64{{{1, 2}}}, map[uint64]uint64{1: 1, 2: 1}},
		{"per worker and iteration", [][][]uint64{{{1, 2}, {2, 3}}, {{2}, {1}}},
			map[uint64]uint64{1: 2, 2: 3, 3: 1}},
		{"repeats within a batch count once", [][][]uint64{{{5, 5, 5}, {5}}, {{5, 6, 5}}},
			map[uint64]uint64{5: 3, 6: 1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Frequency(tt.iters); !maps.Equal(got, tt.want) {
				t.Errorf("Frequency = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestSampledRanking(t *testing.T) {
	// 10 iterations of 2 workers; batch b = 2*iteration + worker holds the keys k with 2k <= b,
	// so key k appears in 20-2k batches and the truth is 0, 1, ..., 9.
	var iters [][][]uint64
	for it := range 10 {
		var workers [][]uint64
		for w := range 2 {
			var batch []uint64
			for k := uint64(0); 2*k <= uint64(2*it+w); k++ {
				batch = append(batch, k)
			}
			workers = append(workers, batch)
		}
		iters = append(iters, workers)
	}
	truth := RankByFrequency(Frequency(iters))
	if !slices.Equal(truth, Ranking{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}) {
		t.Fatalf("truth = %v", truth)
	}

	t.Run("rate 1 is the whole trace", func(t *testing.T) {
		if got := SampledRanking(iters, 1, 7); !slices.Equal(got, truth) {
			t.Errorf("SampledRanking(1) = %v, want %v", got, truth)
		}
		if got := SampledRanking(iters, 5, 7); !slices.Equal(got, truth) {
			t.Errorf("SampledRanking(5) = %v, want %v", got, truth)
		}
	})
	t.Run("rate 0 samples nothing", func(t *testing.T) {
		for _, rate := range []float64{0, -1} {
			if got := SampledRanking(iters, rate, 7); len(got) != 0 {
				t.Errorf("SampledRanking(%v) = %v, want empty", rate, got)
			}
		}
	})
	t.Run("deterministic per seed", func(t *testing.T) {
		a, b := SampledRanking(iters, 0.3, 11), SampledRanking(iters, 0.3, 11)
		if !slices.Equal(a, b) {
			t.Errorf("same seed, different rankings: %v vs %v", a, b)
		}
	})
	t.Run("leaves the trace alone", func(t *testing.T) {
		before := Frequency(iters)
		first := slices.Clone(iters[0][0])
		SampledRanking(iters, 0.5, 3)
		if !maps.Equal(Frequency(iters), before) || !slices.Equal(iters[0][0], first) {
			t.Error("SampledRanking modified its input")
		}
	})
}

// The sample is exactly ceil(rate*N) batches: with one distinct key per batch, the ranking's
// length is the sample size.
func TestSampledRankingSize(t *testing.T) {
	var iters [][][]uint64
	for it := range 10 {
		iters = append(iters, [][]uint64{{uint64(2 * it)}, {uint64(2*it + 1)}})
	}
	tests := []struct {
		rate float64
		want int
	}{{0.001, 1}, {0.05, 1}, {0.1, 2}, {0.11, 3}, {0.5, 10}, {0.99, 20}, {1, 20}}
	for _, tt := range tests {
		for seed := range uint64(5) {
			if got := len(SampledRanking(iters, tt.rate, seed)); got != tt.want {
				t.Errorf("rate %v, seed %d: %d keys, want %d", tt.rate, seed, got, tt.want)
			}
		}
	}
}
