package sparse

import (
	"errors"
	"math"
	"slices"
	"testing"
)

func TestLayout(t *testing.T) {
	tests := []struct {
		l           Layout
		rank        uint32
		array, slot int
	}{
		{Layout{Arrays: 4, Slots: 8}, 0, 0, 0},
		{Layout{Arrays: 4, Slots: 8}, 3, 3, 0},
		{Layout{Arrays: 4, Slots: 8}, 4, 0, 1},
		{Layout{Arrays: 4, Slots: 8}, 31, 3, 7},
		{Layout{Arrays: 4, Slots: 8}, 32, 0, 8}, // beyond Size: slot >= Slots
		{Layout{Arrays: 1, Slots: 5}, 3, 0, 3},
		{Layout{Arrays: 64, Slots: 1024}, 130, 2, 2},
		{Layout{Arrays: 3, Slots: 1}, math.MaxUint32, int(math.MaxUint32 % 3), math.MaxUint32 / 3},
	}
	for _, tt := range tests {
		if a, s := tt.l.Array(tt.rank), tt.l.Slot(tt.rank); a != tt.array || s != tt.slot {
			t.Errorf("%+v: rank %d at (%d, %d), want (%d, %d)", tt.l, tt.rank, a, s, tt.array, tt.slot)
		}
		if r := tt.l.Rank(tt.array, tt.slot); r != tt.rank {
			t.Errorf("%+v: Rank(%d, %d) = %d, want %d", tt.l, tt.array, tt.slot, r, tt.rank)
		}
	}
}

// Heat-based placement stripes consecutive ranks over all arrays and fills every slot once.
func TestLayoutBijection(t *testing.T) {
	l := Layout{Arrays: 5, Slots: 7}
	seen := make(map[[2]int]bool)
	for r := range uint32(l.Size()) {
		a, s := l.Array(r), l.Slot(r)
		if a < 0 || a >= l.Arrays || s < 0 || s >= l.Slots || seen[[2]int{a, s}] {
			t.Fatalf("rank %d at (%d, %d): out of range or taken", r, a, s)
		}
		seen[[2]int{a, s}] = true
		if r > 0 && l.Array(r) == l.Array(r-1) {
			t.Fatalf("ranks %d and %d share an array", r-1, r)
		}
	}
}

func TestLayoutValidate(t *testing.T) {
	tests := []struct {
		l    Layout
		okay bool
	}{
		{Layout{Arrays: 64, Slots: 1024}, true},
		{Layout{Arrays: 1, Slots: 1}, true},
		{Layout{Arrays: 1 << 16, Slots: 1 << 16}, math.MaxInt > math.MaxUint32}, // 2^32 ranks, if int holds them
		{Layout{Arrays: 1<<16 + 1, Slots: 1 << 16}, false},
		{Layout{Arrays: 0, Slots: 8}, false},
		{Layout{Arrays: 8, Slots: 0}, false},
		{Layout{Arrays: -1, Slots: 8}, false},
		{Layout{Arrays: 8, Slots: -1}, false},
		{Layout{Arrays: math.MaxInt, Slots: math.MaxInt}, false},
	}
	for _, tt := range tests {
		err := tt.l.Validate()
		if tt.okay && err != nil || !tt.okay && !errors.Is(err, ErrBadParameter) {
			t.Errorf("%+v.Validate() = %v, want ok = %v", tt.l, err, tt.okay)
		}
	}
}

func TestLayoutPanics(t *testing.T) {
	tests := []struct {
		name string
		f    func()
	}{
		{"Array without arrays", func() { Layout{}.Array(1) }},
		{"Slot with negative arrays", func() { Layout{Arrays: -2}.Slot(1) }},
		{"Rank array out of range", func() { Layout{Arrays: 4, Slots: 4}.Rank(4, 0) }},
		{"Rank negative slot", func() { Layout{Arrays: 4, Slots: 4}.Rank(0, -1) }},
		{"Rank beyond uint32", func() { Layout{Arrays: 1 << 20, Slots: 1 << 12}.Rank(0, 1<<12) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			defer func() {
				if recover() == nil {
					t.Error("no panic")
				}
			}()
			tt.f()
		})
	}
}

func TestPermutation(t *testing.T) {
	for _, n := range []int{0, 1, 2, 10, 1000} {
		p := Permutation(n, 42)
		sorted := slices.Clone(p)
		slices.Sort(sorted)
		for i, v := range sorted {
			if v != uint32(i) {
				t.Fatalf("Permutation(%d) is not a permutation: %v", n, p)
			}
		}
		if !slices.Equal(p, Permutation(n, 42)) {
			t.Errorf("Permutation(%d) not deterministic", n)
		}
	}
	if slices.Equal(Permutation(1000, 1), Permutation(1000, 2)) {
		t.Error("different seeds gave the same permutation")
	}
	fixed := 0
	for i, v := range Permutation(1000, 1) {
		if v == uint32(i) {
			fixed++
		}
	}
	if fixed > 10 { // about 1 expected
		t.Errorf("%d fixed points of 1000: not shuffled", fixed)
	}
	func() {
		defer func() {
			if recover() == nil {
				t.Error("Permutation(-1) did not panic")
			}
		}()
		Permutation(-1, 0)
	}()
}
