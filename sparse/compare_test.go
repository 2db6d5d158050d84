package sparse

import (
	"math"
	"math/rand/v2"
	"testing"
)

// kendallReference is K^(1/2) of Fagin et al. computed literally, pair by pair over the union of
// the two top-k lists, with the normalization documented on KendallTauDistance.
func kendallReference(a, b Ranking, k int) float64 {
	ta, pa := topK(a, k)
	tb, pb := topK(b, k)
	union := append([]uint64(nil), ta...)
	for _, key := range tb {
		if _, ok := pa[key]; !ok {
			union = append(union, key)
		}
	}
	var sum float64
	for x := 0; x < len(union); x++ {
		for y := x + 1; y < len(union); y++ {
			i, j := union[x], union[y]
			ia, inA := pa[i]
			ja, jnA := pa[j]
			ib, inB := pb[i]
			jb, jnB := pb[j]
			switch {
			case inA && jnA && inB && jnB: // case 1
				if (ia < ja) != (ib < jb) {
					sum++
				}
			case inA && jnA && (inB != jnB): // case 2, both in A
				// The one B holds is implicitly ahead in B; penalty if A says otherwise.
				if inB && ja < ia || jnB && ia < ja {
					sum++
				}
			case inB && jnB && (inA != jnA): // case 2, both in B
				if inA && jb < ib || jnA && ib < jb {
					sum++
				}
			case inA && !inB && jnB && !jnA, inB && !inA && jnA && !jnB: // case 3
				sum++
			default: // case 4: both only in A or both only in B
				sum += 0.5
			}
		}
	}
	ka, kb := float64(len(ta)), float64(len(tb))
	norm := ka*kb + (ka*(ka-1)+kb*(kb-1))/4
	if norm == 0 {
		if len(ta) == 0 && len(tb) == 0 {
			return 0
		}
		return 1
	}
	return sum / norm
}

func TestKendallTauDistance(t *testing.T) {
	tests := []struct {
		name string
		a, b Ranking
		k    int
		want float64
	}{
		{"identical", Ranking{1, 2, 3}, Ranking{1, 2, 3}, 3, 0},
		{"disjoint", Ranking{1, 2, 3}, Ranking{4, 5, 6}, 3, 1},
		// k = 3: the maximum is k^2 + k(k-1)/2 = 12.
		{"reversed: 3 discordant pairs", Ranking{1, 2, 3}, Ranking{3, 2, 1}, 3, 3.0 / 12},
		{"one swap", Ranking{1, 2, 3}, Ranking{2, 1, 3}, 3, 1.0 / 12},
		// Only {3, 4} costs (case 3); every other pair agrees.
		{"last differs", Ranking{1, 2, 3}, Ranking{1, 2, 4}, 3, 1.0 / 12},
		// {1,3} and {2,3} cost 1 each (A puts 3, which B lacks, first); {3,4} costs 1.
		{"missing key ranked first", Ranking{3, 1, 2}, Ranking{1, 2, 4}, 3, 3.0 / 12},
		{"beyond k ignored", Ranking{1, 2, 3, 9}, Ranking{1, 2, 3, 8}, 3, 0},
		{"k <= 0 compares whole lists", Ranking{1, 2, 3, 9}, Ranking{1, 2, 3, 8}, 0, 1.0 / (16 + 6)},
		{"k above lengths", Ranking{1, 2}, Ranking{2, 1}, 10, 1.0 / (4 + 1)},
		// ka = 3, kb = 1, B's key is A's last: cases 2 cost 2 ({1,3}, {2,3}); {1,2} is case 4.
		// Divisor 3 + (6 + 0)/4 = 4.5.
		{"different lengths", Ranking{1, 2, 3}, Ranking{3}, 5, 2.5 / 4.5},
		{"both empty", nil, Ranking{}, 3, 0},
		{"empty vs one", nil, Ranking{1}, 3, 1},
		{"empty vs many", Ranking{}, Ranking{1, 2, 3}, 3, 1},
		{"single, same", Ranking{7}, Ranking{7}, 1, 0},
		{"single, different", Ranking{7}, Ranking{8}, 1, 1},
		{"duplicates count once", Ranking{1, 1, 2, 3}, Ranking{1, 2, 3}, 3, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := KendallTauDistance(tt.a, tt.b, tt.k)
			if math.Abs(got-tt.want) > 1e-12 {
				t.Errorf("KendallTauDistance(%v, %v, %d) = %v, want %v", tt.a, tt.b, tt.k, got, tt.want)
			}
			if ref := kendallReference(tt.a, tt.b, tt.k); math.Abs(got-ref) > 1e-12 {
				t.Errorf("reference = %v, fast = %v", ref, got)
			}
			if rev := KendallTauDistance(tt.b, tt.a, tt.k); math.Abs(got-rev) > 1e-12 {
				t.Errorf("not symmetric: %v vs %v", got, rev)
			}
		})
	}
}

// randomRanking draws n distinct keys from [0, space), so two of them overlap partly.
func randomRanking(rng *rand.Rand, n int, space uint64) Ranking {
	seen := make(map[uint64]bool, n)
	r := make(Ranking, 0, n)
	for len(r) < n {
		if k := rng.Uint64N(space); !seen[k] {
			seen[k] = true
			r = append(r, k)
		}
	}
	return r
}

func TestKendallTauDistanceMatchesReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 1))
	for range 300 {
		na, nb := rng.IntN(25), rng.IntN(25)
		space := uint64(max(na, nb, 1) + rng.IntN(30))
		a, b := randomRanking(rng, na, space), randomRanking(rng, nb, space)
		k := rng.IntN(30) - 3
		got, want := KendallTauDistance(a, b, k), kendallReference(a, b, k)
		if math.Abs(got-want) > 1e-12 || got < 0 || got > 1 {
			t.Fatalf("KendallTauDistance(%v, %v, %d) = %v, reference %v", a, b, k, got, want)
		}
	}
}

// The divisor is the maximum: nothing scores above disjoint lists, which score exactly 1.
func TestKendallTauDistanceMaximum(t *testing.T) {
	for k := 1; k <= 6; k++ {
		a := make(Ranking, k)
		for i := range a {
			a[i] = uint64(i)
		}
		// Every list of k keys from [0, 2k), with a in the middle of it: the worst is disjoint.
		best := 0.0
		rng := rand.New(rand.NewPCG(uint64(k), 0))
		for range 2000 {
			b := randomRanking(rng, k, uint64(2*k))
			best = max(best, KendallTauDistance(a, b, k))
		}
		if best > 1 {
			t.Errorf("k = %d: distance %v above 1", k, best)
		}
		disjoint := make(Ranking, k)
		for i := range disjoint {
			disjoint[i] = uint64(k + i)
		}
		if d := KendallTauDistance(a, disjoint, k); d != 1 {
			t.Errorf("k = %d: disjoint distance %v, want 1", k, d)
		}
	}
}

func TestPrecision(t *testing.T) {
	tests := []struct {
		name       string
		truth, est Ranking
		k          int
		want       float64
	}{
		{"identical", Ranking{1, 2, 3}, Ranking{1, 2, 3}, 3, 1},
		{"order does not matter", Ranking{1, 2, 3}, Ranking{3, 1, 2}, 3, 1},
		{"disjoint", Ranking{1, 2}, Ranking{3, 4}, 2, 0},
		{"half", Ranking{1, 2, 3, 4}, Ranking{1, 9, 3, 8}, 4, 0.5},
		{"only top-k of est counts", Ranking{1, 2}, Ranking{9, 8, 1, 2}, 2, 0},
		{"k <= 0 is len(truth)", Ranking{1, 2}, Ranking{2, 7, 1}, 0, 0.5},
		{"k above len(truth)", Ranking{1, 2}, Ranking{5, 6, 2, 1}, 4, 1},
		{"short estimate", Ranking{1, 2, 3, 4}, Ranking{4}, 4, 0.25},
		{"empty truth", nil, Ranking{1}, 3, 1},
		{"empty estimate", Ranking{1, 2}, nil, 2, 0},
		{"duplicates in truth count once", Ranking{1, 1, 2}, Ranking{1, 2}, 2, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Precision(tt.truth, tt.est, tt.k); got != tt.want {
				t.Errorf("Precision(%v, %v, %d) = %v, want %v", tt.truth, tt.est, tt.k, got, tt.want)
			}
		})
	}
}

func TestTopK(t *testing.T) {
	keys, pos := topK(Ranking{5, 3, 5, 1, 3, 2}, 3)
	if want := []uint64{5, 3, 1}; len(keys) != 3 || keys[0] != want[0] || keys[1] != want[1] || keys[2] != want[2] {
		t.Errorf("topK keys = %v, want %v", keys, want)
	}
	if pos[5] != 0 || pos[3] != 1 || pos[1] != 2 || len(pos) != 3 {
		t.Errorf("topK positions = %v", pos)
	}
}
