package sparse

import (
	"errors"
	"slices"
	"testing"
)

func TestNewHotSet(t *testing.T) {
	tests := []struct {
		name    string
		keys    Ranking
		wantErr error
	}{
		{"empty", nil, nil},
		{"one", Ranking{42}, nil},
		{"several", Ranking{9, 1, 5, 0}, nil},
		{"duplicate", Ranking{9, 1, 9}, ErrDuplicateKey},
		{"duplicate adjacent", Ranking{3, 3}, ErrDuplicateKey},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h, err := NewHotSet(7, tt.keys)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("NewHotSet error = %v, want %v", err, tt.wantErr)
			}
			if err != nil {
				if h != nil {
					t.Error("NewHotSet returned a set with an error")
				}
				return
			}
			if h.Version != 7 || h.Len() != len(tt.keys) {
				t.Errorf("Version, Len = %d, %d; want 7, %d", h.Version, h.Len(), len(tt.keys))
			}
			for i, k := range tt.keys {
				if r, hot := h.Rank(k); !hot || r != uint32(i) {
					t.Errorf("Rank(%d) = %d, %v; want %d, true", k, r, hot, i)
				}
				if got := h.Key(uint32(i)); got != k {
					t.Errorf("Key(%d) = %d, want %d", i, got, k)
				}
			}
			if _, hot := h.Rank(1 << 60); hot {
				t.Error("a cold key reported hot")
			}
			if got := h.Keys(); !slices.Equal(got, tt.keys) {
				t.Errorf("Keys = %v, want %v", got, tt.keys)
			}
		})
	}
}

// The set must not alias its caller's slices in either direction: ranks are register addresses,
// and a rank that moved under a running job would corrupt sums.
func TestHotSetCopies(t *testing.T) {
	keys := Ranking{10, 20, 30}
	h, err := NewHotSet(1, keys)
	if err != nil {
		t.Fatal(err)
	}
	keys[0] = 99
	if h.Key(0) != 10 {
		t.Error("NewHotSet kept the caller's slice")
	}
	out := h.Keys()
	out[1] = 99
	if h.Key(1) != 20 {
		t.Error("Keys returned the internal slice")
	}
}

func TestHotSetKeyPanics(t *testing.T) {
	h, err := NewHotSet(1, Ranking{1, 2})
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name string
		h    *HotSet
		rank uint32
	}{{"out of range", h, 2}, {"nil set", nil, 0}} {
		t.Run(tt.name, func(t *testing.T) {
			defer func() {
				if recover() == nil {
					t.Errorf("Key(%d) did not panic", tt.rank)
				}
			}()
			tt.h.Key(tt.rank)
		})
	}
}

func TestNilHotSetIsEmpty(t *testing.T) {
	var h *HotSet
	if h.Len() != 0 || h.Keys() != nil {
		t.Error("nil HotSet not empty")
	}
	if _, hot := h.Rank(1); hot {
		t.Error("nil HotSet has a hot key")
	}
}

func TestOfflineHotSet(t *testing.T) {
	// Key 1 in every batch, key 2 in half, keys 10+ once each: with p = 0.5 the hottest key takes
	// enough; the memory cap of 4 bytes allows one key whatever p asks.
	var iters [][][]uint64
	for i := range 10 {
		b := []uint64{1, uint64(10 + i)}
		if i%2 == 0 {
			b = append(b, 2)
		}
		iters = append(iters, [][]uint64{b})
	}
	h, share, err := OfflineHotSet(iters, 1, 1, 0.4, 1, 1<<20, 7)
	if err != nil || h.Version != 7 || h.Len() != 1 || h.Key(0) != 1 || share < 0.4 {
		t.Fatalf("OfflineHotSet = %v keys %v, share %v, %v", h.Len(), h.Keys(), share, err)
	}
	if h, _, err := OfflineHotSet(iters, 1, 1, 0.9, 1, 4, 1); err != nil || h.Len() != 1 {
		t.Fatalf("capped by memory: %v keys, %v", h.Len(), err)
	}
}
