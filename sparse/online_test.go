package sparse

import (
	"math"
	"slices"
	"testing"
)

func TestOnline(t *testing.T) {
	o := Online{K: 2, Period: 2, Threshold: 0.3}
	if o.Due() || o.Iterations() != 0 {
		t.Fatal("a fresh Online is due or has iterations")
	}
	o.Observe(map[uint64]uint64{1: 4, 2: 3, 3: 1})
	if o.Due() {
		t.Fatal("due after 1 of 2 iterations")
	}
	o.Observe(map[uint64]uint64{1: 4, 2: 3, 4: 0})
	if !o.Due() || o.Iterations() != 2 {
		t.Fatalf("Due, Iterations = %v, %d; want true, 2", o.Due(), o.Iterations())
	}

	// No current set: everything is new, distance 1.
	next, d, swap := o.Propose(nil)
	if !slices.Equal(next, Ranking{1, 2}) || d != 1 || !swap {
		t.Fatalf("Propose(nil) = %v, %v, %v; want [1 2], 1, true", next, d, swap)
	}
	if o.Due() {
		t.Fatal("still due after Propose")
	}
	current := next

	// Counts are now 1: 8, 2: 6, 3: 1. Key 3 warms up to 4 but stays third: same top 2.
	o.Observe(map[uint64]uint64{3: 2})
	o.Observe(map[uint64]uint64{3: 1})
	next, d, swap = o.Propose(current)
	if !slices.Equal(next, Ranking{1, 2}) || d != 0 || swap {
		t.Fatalf("unchanged top: Propose = %v, %v, %v; want [1 2], 0, false", next, d, swap)
	}

	// Key 3 overtakes both: the top 2 becomes [3 1]. Against [1 2], {1,3} costs 1 (case 2: the
	// new list puts 3, unknown to the old, ahead of 1) and {2,3} costs 1 (case 3), of at most
	// 2^2 + 1 = 5: distance 0.4, above the threshold.
	o.Observe(map[uint64]uint64{3: 20})
	next, d, swap = o.Propose(current)
	if !slices.Equal(next, Ranking{3, 1}) || d != 0.4 || !swap {
		t.Fatalf("new top: Propose = %v, %v, %v; want [3 1], 0.4, true", next, d, swap)
	}
	if o.Iterations() != 5 {
		t.Errorf("Iterations = %d, want 5", o.Iterations())
	}
}

func TestOnlineThreshold(t *testing.T) {
	tests := []struct {
		name      string
		threshold float64
		current   Ranking
		wantSwap  bool
	}{
		{"identical, threshold 0 swaps", 0, Ranking{1, 2, 3}, true},
		{"identical, positive threshold keeps", 0.01, Ranking{1, 2, 3}, false},
		{"one swap, at threshold", 1.0 / 12, Ranking{2, 1, 3}, true},
		{"one swap, above threshold", 0.1, Ranking{2, 1, 3}, false},
		{"NaN never swaps", math.NaN(), Ranking{9, 8, 7}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := Online{K: 3, Threshold: tt.threshold}
			o.Observe(map[uint64]uint64{1: 3, 2: 2, 3: 1})
			if _, _, swap := o.Propose(tt.current); swap != tt.wantSwap {
				t.Errorf("swap = %v, want %v", swap, tt.wantSwap)
			}
		})
	}
}

func TestOnlineEdges(t *testing.T) {
	t.Run("period 0 is never due", func(t *testing.T) {
		var o Online
		for range 5 {
			o.Observe(nil)
		}
		if o.Due() || o.Iterations() != 5 {
			t.Errorf("Due, Iterations = %v, %d", o.Due(), o.Iterations())
		}
	})
	t.Run("K 0 ranks every key", func(t *testing.T) {
		var o Online
		o.Observe(map[uint64]uint64{5: 1, 6: 2, 7: 3})
		if next, _, _ := o.Propose(nil); !slices.Equal(next, Ranking{7, 6, 5}) {
			t.Errorf("next = %v", next)
		}
	})
	t.Run("counts saturate", func(t *testing.T) {
		o := Online{K: 2}
		o.Observe(map[uint64]uint64{1: math.MaxUint64 - 1, 2: math.MaxUint64})
		o.Observe(map[uint64]uint64{1: 5})
		// Both saturated: a tie, broken by key. Had 1 wrapped, it would rank last.
		if next, _, _ := o.Propose(nil); !slices.Equal(next, Ranking{1, 2}) {
			t.Errorf("next = %v, want [1 2]", next)
		}
	})
	t.Run("next is the caller's", func(t *testing.T) {
		o := Online{K: 1}
		o.Observe(map[uint64]uint64{1: 2, 2: 1})
		next, _, _ := o.Propose(nil)
		if cap(next) != 1 {
			t.Errorf("cap(next) = %d, want 1 so appends do not alias", cap(next))
		}
	})
}
