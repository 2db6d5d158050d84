package sparse

import (
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"
)

// packReference is Algorithm 1 as written: for every rank, scan the P packets in order and each
// packet's contents for a rank of the same array. Quadratic, and the oracle for Pack.
func packReference(ranks []uint32, m, maxPairs int) [][]int {
	if len(ranks) == 0 {
		return nil
	}
	array := func(i int) uint64 { return uint64(ranks[i]) % uint64(m) }
	p := (len(ranks) + maxPairs - 1) / maxPairs
	packets := make([][]int, p)
	var spill []int
	for i := range ranks {
		placed := false
		for q := range packets {
			if len(packets[q]) == maxPairs ||
				slices.ContainsFunc(packets[q], func(j int) bool { return array(j) == array(i) }) {
				continue
			}
			packets[q] = append(packets[q], i)
			placed = true
			break
		}
		if !placed {
			spill = append(spill, i)
		}
	}
	for lo := 0; lo < len(spill); lo += maxPairs {
		packets = append(packets, spill[lo:min(lo+maxPairs, len(spill))])
	}
	return packets
}

// checkPacking verifies what every packing promises: each index once, packets non-empty and at
// most maxPairs, indices increasing within a packet.
func checkPacking(t testing.TB, n, maxPairs int, packets [][]int) {
	t.Helper()
	seen := make([]bool, n)
	for q, pk := range packets {
		if len(pk) == 0 || len(pk) > maxPairs {
			t.Fatalf("packet %d holds %d pairs, want 1..%d", q, len(pk), maxPairs)
		}
		for j, i := range pk {
			if i < 0 || i >= n || seen[i] {
				t.Fatalf("packet %d: index %d out of range or repeated", q, i)
			}
			seen[i] = true
			if j > 0 && pk[j-1] >= i {
				t.Fatalf("packet %d not in input order: %v", q, pk)
			}
		}
	}
	for i, s := range seen {
		if !s {
			t.Fatalf("index %d in no packet", i)
		}
	}
}

func TestPack(t *testing.T) {
	tests := []struct {
		name        string
		ranks       []uint32
		m, maxPairs int
		want        [][]int
	}{
		{"empty", nil, 4, 3, nil},
		{"one", []uint32{7}, 4, 3, [][]int{{0}}},
		{"fits one packet", []uint32{0, 1, 2}, 4, 3, [][]int{{0, 1, 2}}},
		// P = 2. Ranks 0 and 4 share array 0, so 4 goes to the second packet, and 1 fills the first.
		{"conflict moves to next packet", []uint32{0, 4, 1, 5}, 4, 2, [][]int{{0, 2}, {1, 3}}},
		// P = 2, all in array 0: two fit (one per packet), the rest spill into G' packets.
		{"one array spills", []uint32{0, 4, 8, 12}, 4, 2, [][]int{{0}, {1}, {2, 3}}},
		// m = 1 is the degenerate register file: each of the P packets takes one rank.
		{"single array", []uint32{5, 6, 7, 8, 9}, 1, 5, [][]int{{0}, {1, 2, 3, 4}}},
		{"maxPairs 1", []uint32{0, 0, 1}, 2, 1, [][]int{{0}, {1}, {2}}},
		// Rank 8 (array 0) finds packet 0 full and packet 1 holding rank 4: G'.
		{"full and conflicting", []uint32{0, 1, 4, 5, 8}, 4, 2, [][]int{{0, 1}, {2, 3}, {4}}},
		{"m above n uses the map path", []uint32{1 << 31, 1<<31 + 1<<30, 7}, 1 << 30, 2,
			[][]int{{0, 2}, {1}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Pack(tt.ranks, tt.m, tt.maxPairs)
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("Pack(%v, %d, %d) = %v, want %v", tt.ranks, tt.m, tt.maxPairs, got, tt.want)
			}
			if ref := packReference(tt.ranks, tt.m, tt.maxPairs); !reflect.DeepEqual(got, ref) {
				t.Errorf("reference = %v", ref)
			}
			checkPacking(t, len(tt.ranks), tt.maxPairs, got)
		})
	}
}

func TestPackMatchesReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for range 500 {
		n := rng.IntN(300)
		m := 1 + rng.IntN(40)
		maxPairs := 1 + rng.IntN(50)
		ranks := make([]uint32, n)
		for i := range ranks {
			ranks[i] = rng.Uint32N(uint32(1 + rng.IntN(500)))
		}
		got, want := Pack(ranks, m, maxPairs), packReference(ranks, m, maxPairs)
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("Pack(%v, %d, %d) = %v, reference %v", ranks, m, maxPairs, got, want)
		}
		checkPacking(t, n, maxPairs, got)
	}
}

// With spare arrays, Algorithm 1 should find a conflict-free packing when one exists at all:
// here the ranks are a permutation of [0, n) with n = P*m, and P packets of m pairs hold them
// exactly with every array once per packet.
func TestPackConflictFree(t *testing.T) {
	const m, maxPairs = 16, 16
	ranks := Permutation(8*m, 9)
	packets := Pack(ranks, m, maxPairs)
	if len(packets) != 8 {
		t.Fatalf("%d packets, want 8", len(packets))
	}
	if rc, _ := Recirculations(ranks, packets, m, 0); rc != 0 {
		t.Errorf("%d recirculations, want 0", rc)
	}
}

// Appending to one packet must not overwrite the next (they share one backing array).
func TestPackPacketsCapped(t *testing.T) {
	packets := Pack([]uint32{0, 1, 2, 3, 4, 5}, 8, 2)
	_ = append(packets[0], 99)
	if packets[1][0] != 2 {
		t.Error("append to packet 0 overwrote packet 1")
	}
	inOrder := PackInOrder([]uint32{0, 1, 2, 3}, 2)
	_ = append(inOrder[0], 99)
	if inOrder[1][0] != 2 {
		t.Error("append to PackInOrder's packet 0 overwrote packet 1")
	}
}

func TestPackInOrder(t *testing.T) {
	tests := []struct {
		n, maxPairs int
		want        [][]int
	}{
		{0, 3, nil},
		{1, 3, [][]int{{0}}},
		{3, 3, [][]int{{0, 1, 2}}},
		{7, 3, [][]int{{0, 1, 2}, {3, 4, 5}, {6}}},
		{3, 1, [][]int{{0}, {1}, {2}}},
	}
	for _, tt := range tests {
		got := PackInOrder(make([]uint32, tt.n), tt.maxPairs)
		if !reflect.DeepEqual(got, tt.want) {
			t.Errorf("PackInOrder(n = %d, %d) = %v, want %v", tt.n, tt.maxPairs, got, tt.want)
		}
		checkPacking(t, tt.n, tt.maxPairs, got)
	}
}

func TestPackPanics(t *testing.T) {
	tests := []struct {
		name string
		f    func()
	}{
		{"Pack m 0", func() { Pack([]uint32{1}, 0, 3) }},
		{"Pack maxPairs 0", func() { Pack([]uint32{1}, 3, 0) }},
		{"Pack empty still checks", func() { Pack(nil, -1, 3) }},
		{"PackInOrder maxPairs 0", func() { PackInOrder([]uint32{1}, 0) }},
		{"Passes m 0", func() { Passes([]uint32{1}, 0, 4) }},
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

// passesReference runs the pass loop of bpf/sparse.h literally.
func passesReference(ranks []uint32, m, maxPasses int) (passes, unplaced int) {
	left := slices.Clone(ranks)
	for len(left) > 0 && (maxPasses <= 0 || passes < maxPasses) {
		touched := make(map[uint64]bool)
		var wait []uint32
		for _, r := range left {
			a := uint64(r) % uint64(m)
			if touched[a] {
				wait = append(wait, r)
			} else {
				touched[a] = true
			}
		}
		left = wait
		passes++
	}
	return passes, len(left)
}

func TestPasses(t *testing.T) {
	tests := []struct {
		name                  string
		ranks                 []uint32
		m, maxPasses          int
		wantPasses, wantSpill int
	}{
		{"empty", nil, 4, 4, 0, 0},
		{"one", []uint32{3}, 4, 4, 1, 0},
		{"distinct arrays", []uint32{0, 1, 2, 3}, 4, 4, 1, 0},
		{"one conflict", []uint32{0, 4, 1}, 4, 4, 2, 0},
		{"three in one array", []uint32{0, 4, 8, 1, 5}, 4, 4, 3, 0},
		{"limit leaves pairs for the PS", []uint32{0, 4, 8, 12, 16, 1}, 4, 2, 2, 3},
		{"limit 1", []uint32{0, 4, 1, 5, 2}, 4, 1, 1, 2},
		{"unlimited", []uint32{0, 0, 0, 0, 0, 0}, 1, 0, 6, 0},
		{"negative limit is unlimited", []uint32{0, 2, 4}, 2, -1, 3, 0},
		{"m 1", []uint32{9, 8, 7}, 1, 4, 3, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, u := Passes(tt.ranks, tt.m, tt.maxPasses)
			if p != tt.wantPasses || u != tt.wantSpill {
				t.Errorf("Passes = (%d, %d), want (%d, %d)", p, u, tt.wantPasses, tt.wantSpill)
			}
			if rp, ru := passesReference(tt.ranks, tt.m, tt.maxPasses); rp != p || ru != u {
				t.Errorf("reference = (%d, %d)", rp, ru)
			}
		})
	}
}

func TestRecirculations(t *testing.T) {
	ranks := []uint32{0, 4, 8, 1, 5, 2}
	tests := []struct {
		name           string
		packets        [][]int
		maxPasses      int
		wantRC, wantPS int
	}{
		{"none", nil, 4, 0, 0},
		{"all in one", [][]int{{0, 1, 2, 3, 4, 5}}, 4, 2, 0},
		{"split by array", [][]int{{0, 3, 5}, {1, 4}, {2}}, 4, 0, 0},
		{"empty packet skipped", [][]int{{}, {0, 1}}, 4, 1, 0},
		{"limit", [][]int{{0, 1, 2, 3, 4, 5}}, 2, 1, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rc, ps := Recirculations(ranks, tt.packets, 4, tt.maxPasses)
			if rc != tt.wantRC || ps != tt.wantPS {
				t.Errorf("Recirculations = (%d, %d), want (%d, %d)", rc, ps, tt.wantRC, tt.wantPS)
			}
		})
	}
}
