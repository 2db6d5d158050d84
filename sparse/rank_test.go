package sparse

import (
	"errors"
	"math"
	"math/big"
	"math/rand/v2"
	"slices"
	"testing"
)

func TestRankByFrequency(t *testing.T) {
	tests := []struct {
		name string
		freq map[uint64]uint64
		want Ranking
	}{
		{"nil", nil, Ranking{}},
		{"empty", map[uint64]uint64{}, Ranking{}},
		{"only zero counts", map[uint64]uint64{1: 0, 2: 0}, Ranking{}},
		{"descending count", map[uint64]uint64{1: 1, 2: 3, 3: 2}, Ranking{2, 3, 1}},
		{"ties by ascending key", map[uint64]uint64{9: 5, 3: 5, 7: 5, 1: 6}, Ranking{1, 3, 7, 9}},
		{"zeros omitted", map[uint64]uint64{5: 0, 4: 1, 6: 0}, Ranking{4}},
		{"extreme keys and counts", map[uint64]uint64{math.MaxUint64: math.MaxUint64, 0: math.MaxUint64, 1: 1},
			Ranking{0, math.MaxUint64, 1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := RankByFrequency(tt.freq); !slices.Equal(got, tt.want) {
				t.Errorf("RankByFrequency(%v) = %v, want %v", tt.freq, got, tt.want)
			}
		})
	}
}

// Map iteration order is random; the ranking must not be.
func TestRankByFrequencyDeterministic(t *testing.T) {
	freq := make(map[uint64]uint64)
	for k := range uint64(500) {
		freq[k*7919] = k % 5 // many ties
	}
	first := RankByFrequency(freq)
	for range 20 {
		if got := RankByFrequency(freq); !slices.Equal(got, first) {
			t.Fatal("RankByFrequency depends on map iteration order")
		}
	}
}

func TestFrequencies(t *testing.T) {
	freq := map[uint64]uint64{1: 10, 2: 20}
	if got, want := Frequencies(Ranking{2, 1, 3}, freq), []uint64{20, 10, 0}; !slices.Equal(got, want) {
		t.Errorf("Frequencies = %v, want %v", got, want)
	}
	if got := Frequencies(nil, freq); len(got) != 0 {
		t.Errorf("Frequencies(nil) = %v, want empty", got)
	}
}

func TestChooseK(t *testing.T) {
	const mib = 1 << 20
	ten := slices.Repeat([]uint64{1}, 10)
	tests := []struct {
		name       string
		counts     []uint64
		p, c       float64
		mem        uint64
		wantK      int
		wantShare  float64
		wantCapped bool
	}{
		{"first key is enough", []uint64{8, 1, 1}, 0.8, 1, mib, 1, 0.8, false},
		{"needs two", []uint64{5, 3, 2}, 0.8, 1, mib, 2, 0.8, false},
		{"p = 1 takes every non-zero count", []uint64{5, 3, 2, 0, 0}, 1, 1, mib, 3, 1, false},
		{"decimal p as written", ten, 0.1, 1, mib, 1, 0.1, false},
		{"decimal p as written, 0.3", ten, 0.3, 1, mib, 3, 0.3, false},
		{"all keys", []uint64{1, 1, 1, 1}, 1, 1, mib, 4, 1, false},
		{"cap binds", []uint64{4, 3, 2, 1}, 0.9, 1, 8, 2, 0.7, true},
		{"cap equals need", []uint64{4, 3, 2, 1}, 0.9, 1, 12, 3, 0.9, false},
		{"cap below one register", []uint64{4, 3}, 0.5, 0.5, 7, 0, 0, true},
		{"c scales the budget", []uint64{1, 1, 1, 1, 1, 1, 1, 1}, 1, 0.5, 16, 2, 0.25, true},
		{"Zebra default: 5% of 20 MiB = 262144 registers", slices.Repeat([]uint64{1}, 300000), 1, 0.05, 20 * mib,
			262144, 262144.0 / 300000, true},
		{"no counts", nil, 0.5, 1, mib, 0, 0, false},
		{"all zero", []uint64{0, 0}, 0.5, 1, mib, 0, 0, false},
		{"huge counts (big path)", []uint64{1 << 62, 1 << 62, 1 << 61, 1 << 61}, 0.5, 1, mib, 2, 2.0 / 3, false},
		{"huge counts, cap", []uint64{1 << 62, 1 << 62, 1 << 61, 1 << 61}, 0.9, 1, 12, 3, 5.0 / 6, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			k, share, capped, err := ChooseK(tt.counts, tt.p, tt.c, tt.mem)
			if err != nil {
				t.Fatalf("ChooseK: %v", err)
			}
			if k != tt.wantK || share != tt.wantShare || capped != tt.wantCapped {
				t.Errorf("ChooseK = (%d, %v, %v), want (%d, %v, %v)",
					k, share, capped, tt.wantK, tt.wantShare, tt.wantCapped)
			}
		})
	}
}

func TestChooseKErrors(t *testing.T) {
	ok := []uint64{3, 2, 1}
	tests := []struct {
		name   string
		counts []uint64
		p, c   float64
		mem    uint64
	}{
		{"p zero", ok, 0, 0.5, 100},
		{"p negative", ok, -0.5, 0.5, 100},
		{"p above one", ok, 1.01, 0.5, 100},
		{"p NaN", ok, math.NaN(), 0.5, 100},
		{"p +Inf", ok, math.Inf(1), 0.5, 100},
		{"c zero", ok, 0.5, 0, 100},
		{"c above one", ok, 0.5, 2, 100},
		{"c NaN", ok, 0.5, math.NaN(), 100},
		{"memBytes zero", ok, 0.5, 0.5, 0},
		{"unsorted", []uint64{1, 2, 3}, 0.5, 0.5, 100},
		{"unsorted after zero", []uint64{3, 0, 1}, 0.5, 0.5, 100},
		{"total overflows", []uint64{math.MaxUint64, 1}, 0.5, 0.5, 100},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, _, _, err := ChooseK(tt.counts, tt.p, tt.c, tt.mem)
			if !errors.Is(err, ErrBadParameter) {
				t.Errorf("ChooseK error = %v, want ErrBadParameter", err)
			}
		})
	}
}

// ratio must round num/den once, to nearest even, for totals beyond 2^53 too.
func TestRatio(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	check := func(num, den uint64) {
		t.Helper()
		want, _ := new(big.Rat).SetFrac(new(big.Int).SetUint64(num), new(big.Int).SetUint64(den)).Float64()
		if got := ratio(num, den); got != want {
			t.Errorf("ratio(%d, %d) = %v, want %v", num, den, got, want)
		}
	}
	check(0, 1)
	check(1, 1)
	check(1<<53, 1<<53)
	check(1<<53+1, 1<<53+1)
	check(1<<53, 1<<53+1)
	check(math.MaxUint64-1, math.MaxUint64)
	for range 2000 {
		den := rng.Uint64() >> rng.UintN(64)
		if den == 0 {
			den = 1
		}
		check(rng.Uint64N(den), den)                // anywhere in [0, 1)
		check(den-rng.Uint64N(min(den, 1000)), den) // just below 1, where rounding bites
	}
}
