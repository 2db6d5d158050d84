package sparse

import (
	"encoding/binary"
	"math"
	"math/big"
	"reflect"
	"slices"
	"testing"
)

// FuzzPack checks Pack against the literal Algorithm 1 and Passes against the literal pass loop,
// on every packet of both packings.
func FuzzPack(f *testing.F) {
	f.Add([]byte{0, 0, 4, 0, 1, 0, 5, 0}, uint8(4), uint8(2), uint8(4))
	f.Add([]byte{0, 0, 0, 0, 0, 0}, uint8(1), uint8(1), uint8(1))
	f.Add(make([]byte, 400), uint8(63), uint8(178), uint8(3))
	f.Fuzz(func(t *testing.T, data []byte, m8, pairs8, passes8 uint8) {
		m, maxPairs, maxPasses := int(m8)+1, int(pairs8)+1, int(passes8)%6 // 0: unlimited
		ranks := make([]uint32, len(data)/2)
		for i := range ranks {
			ranks[i] = uint32(binary.LittleEndian.Uint16(data[2*i:]))
		}
		got := Pack(ranks, m, maxPairs)
		if want := packReference(ranks, m, maxPairs); !reflect.DeepEqual(got, want) {
			t.Fatalf("Pack(%v, %d, %d) = %v, reference %v", ranks, m, maxPairs, got, want)
		}
		checkPacking(t, len(ranks), maxPairs, got)
		for _, packets := range [][][]int{got, PackInOrder(ranks, maxPairs)} {
			for _, pk := range packets {
				var sub []uint32
				for _, i := range pk {
					sub = append(sub, ranks[i])
				}
				p, u := Passes(sub, m, maxPasses)
				if rp, ru := passesReference(sub, m, maxPasses); p != rp || u != ru {
					t.Fatalf("Passes(%v, %d, %d) = (%d, %d), reference (%d, %d)", sub, m, maxPasses, p, u, rp, ru)
				}
			}
		}
	})
}

// FuzzKendallTau checks the O(k log k) distance against the pair-by-pair definition, and its
// metric-like properties. Keys are single bytes, so lists overlap and repeat.
func FuzzKendallTau(f *testing.F) {
	f.Add([]byte{1, 2, 3}, []byte{3, 2, 1}, int8(3))
	f.Add([]byte{1, 2, 3}, []byte{4, 5, 6}, int8(0))
	f.Add([]byte{}, []byte{9}, int8(-1))
	f.Add([]byte{1, 1, 2, 7, 3}, []byte{3, 1, 8}, int8(4))
	f.Fuzz(func(t *testing.T, ab, bb []byte, k8 int8) {
		toRanking := func(b []byte) Ranking {
			r := make(Ranking, len(b))
			for i, v := range b {
				r[i] = uint64(v)
			}
			return r
		}
		a, b, k := toRanking(ab), toRanking(bb), int(k8)
		got := KendallTauDistance(a, b, k)
		if want := kendallReference(a, b, k); math.Abs(got-want) > 1e-9 {
			t.Fatalf("KendallTauDistance(%v, %v, %d) = %v, reference %v", a, b, k, got, want)
		}
		if !(got >= 0 && got <= 1) {
			t.Fatalf("distance %v out of [0, 1]", got)
		}
		if rev := KendallTauDistance(b, a, k); math.Abs(got-rev) > 1e-9 {
			t.Fatalf("not symmetric: %v vs %v", got, rev)
		}
		if self := KendallTauDistance(a, a, k); self != 0 {
			t.Fatalf("distance to itself %v", self)
		}
		if p := Precision(a, b, k); !(p >= 0 && p <= 1) {
			t.Fatalf("precision %v out of [0, 1]", p)
		}
	})
}

// FuzzChooseK checks ChooseK against a direct reading of Principle 1, with shares rounded by
// math/big independently of ratio; a shift pushes totals past 2^53 to exercise the exact path.
func FuzzChooseK(f *testing.F) {
	f.Add([]byte{9, 5, 3, 1}, uint16(800), uint16(1000), uint32(1<<20), uint8(0))
	f.Add([]byte{1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, uint16(100), uint16(1000), uint32(1000), uint8(0))
	f.Add([]byte{200, 100, 0}, uint16(999), uint16(1), uint32(9000), uint8(47))
	f.Fuzz(func(t *testing.T, data []byte, p16, c16 uint16, mem32 uint32, shift uint8) {
		// At most 256 counts below 2^56 each keep the total below 2^64 (ChooseK's limit).
		data = data[:min(len(data), 256)]
		counts := make([]uint64, len(data))
		for i, v := range data {
			counts[i] = uint64(v) << (shift % 48)
		}
		slices.SortFunc(counts, func(a, b uint64) int { return -compareUint64(a, b) })
		p := float64(p16%1000+1) / 1000
		c := float64(c16%1000+1) / 1000
		mem := uint64(mem32) + 1

		k, share, capped, err := ChooseK(counts, p, c, mem)
		if err != nil {
			t.Fatalf("ChooseK: %v", err)
		}
		wk, wshare, wcapped := chooseKReference(counts, p, c, mem)
		if k != wk || share != wshare || capped != wcapped {
			t.Fatalf("ChooseK(%v, %v, %v, %d) = (%d, %v, %v), reference (%d, %v, %v)",
				counts, p, c, mem, k, share, capped, wk, wshare, wcapped)
		}
		traffic := slices.ContainsFunc(counts, func(n uint64) bool { return n > 0 })
		if traffic && capped == (share >= p) {
			t.Fatalf("capped = %v with share %v, p %v", capped, share, p)
		}
		if float64(4*k) > c*float64(mem) {
			t.Fatalf("k = %d exceeds the memory budget", k)
		}
	})
}

func compareUint64(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// chooseKReference evaluates every prefix's share and picks the smallest k that reaches p, then
// applies the memory cap.
func chooseKReference(counts []uint64, p, c float64, mem uint64) (int, float64, bool) {
	total := new(big.Int)
	for _, n := range counts {
		total.Add(total, new(big.Int).SetUint64(n))
	}
	if total.Sign() == 0 {
		return 0, 0, false
	}
	shareOf := func(k int) float64 {
		sum := new(big.Int)
		for _, n := range counts[:k] {
			sum.Add(sum, new(big.Int).SetUint64(n))
		}
		s, _ := new(big.Rat).SetFrac(sum, total).Float64()
		return s
	}
	kcap := int(math.Floor(c * float64(mem) / 4))
	need := len(counts)
	for k := range counts {
		if shareOf(k) >= p {
			need = k
			break
		}
	}
	if need <= kcap {
		return need, shareOf(need), false
	}
	return kcap, shareOf(kcap), true
}
