package sparse

import (
	"cmp"
	"fmt"
	"math"
	"math/big"
	"slices"
)

// Ranking lists keys from hottest to coldest.
type Ranking []uint64

// RankByFrequency sorts keys by descending count; ties by ascending key (deterministic). Keys with
// count 0 are omitted.
//
// Breaking ties by key rather than leaving them to map order matters: the rank of a key is its
// register address on the switch, so every worker, the PS and the switch must derive the same
// ranking from the same counts.
func RankByFrequency(freq map[uint64]uint64) Ranking {
	r := make(Ranking, 0, len(freq))
	for k, n := range freq {
		if n > 0 {
			r = append(r, k)
		}
	}
	slices.SortFunc(r, func(a, b uint64) int {
		if c := cmp.Compare(freq[b], freq[a]); c != 0 {
			return c
		}
		return cmp.Compare(a, b)
	})
	return r
}

// Frequencies returns the counts of r's keys in rank order (helper for ChooseK). A key missing
// from freq counts 0.
func Frequencies(r Ranking, freq map[uint64]uint64) []uint64 {
	out := make([]uint64, len(r))
	for i, k := range r {
		out[i] = freq[k]
	}
	return out
}

// ChooseK applies Zebra's Principle 1 to counts sorted descending: the smallest k with
// T_k/T_n >= p, capped so that 4*k <= c*memBytes (4 bytes per register value). Returns k and the
// share T_k/T_n it covers.
//
// T_k is the sum of the first k counts and T_n the sum of all. Both conditions are evaluated in
// float64 as they are written: share is T_k/T_n correctly rounded and the memory budget is
// c*memBytes rounded, so that parameters written as decimals behave as written (ten equal counts
// and p = 0.1 give k = 1, although the float64 0.1 is slightly more than 1/10).
//
// If the cap binds, k is the cap (k may then be 0 when c*memBytes < 4) and share < p; capped
// reports it. Otherwise share >= p. When all counts are 0 (or there are none) there is no traffic
// to intercept: k = 0, share = 0 and capped = false.
//
// Errors (ErrBadParameter) for p or c outside (0,1], memBytes 0, counts not sorted descending
// (the principle is about the hottest keys, so an unsorted list is a caller's bug that would
// silently pick the wrong ones), and counts whose total overflows uint64.
func ChooseK(counts []uint64, p, c float64, memBytes uint64) (k int, share float64, capped bool, err error) {
	// Written as !(in range) so that NaN is rejected too.
	if !(p > 0 && p <= 1) {
		return 0, 0, false, fmt.Errorf("%w: p = %v, want 0 < p <= 1", ErrBadParameter, p)
	}
	if !(c > 0 && c <= 1) {
		return 0, 0, false, fmt.Errorf("%w: c = %v, want 0 < c <= 1", ErrBadParameter, c)
	}
	if memBytes == 0 {
		return 0, 0, false, fmt.Errorf("%w: memBytes = 0", ErrBadParameter)
	}
	var total uint64
	for i, n := range counts {
		if i > 0 && n > counts[i-1] {
			return 0, 0, false, fmt.Errorf("%w: counts not sorted descending at index %d (%d > %d)",
				ErrBadParameter, i, n, counts[i-1])
		}
		if total+n < total {
			return 0, 0, false, fmt.Errorf("%w: counts total overflows uint64", ErrBadParameter)
		}
		total += n
	}
	if total == 0 {
		return 0, 0, false, nil
	}
	// 4k <= c*memBytes. The budget is below 2^64, so the cap fits an int on 64-bit platforms;
	// on 32-bit ones it saturates, which changes nothing because k <= len(counts) anyway.
	capF := math.Floor(c * float64(memBytes) / 4)
	kcap := math.MaxInt
	if capF < math.MaxInt {
		kcap = int(capF)
	}
	// share is monotone in k (counts are non-negative and rounding is monotone), so the first k
	// that reaches p is the smallest; stopping at the cap makes T_kcap's share the answer.
	var sum uint64
	for k = 0; k < len(counts) && k < kcap; k++ {
		if share = ratio(sum, total); share >= p {
			return k, share, false, nil
		}
		sum += counts[k]
	}
	// Here k = min(len(counts), kcap). If k is all of counts, share is 1 >= p: not capped.
	share = ratio(sum, total)
	return k, share, share < p, nil
}

// ratio returns num/den (num <= den, den > 0) correctly rounded to float64. Integers up to 2^53
// convert exactly, and then one IEEE division rounds correctly; beyond that the quotient is
// computed exactly by math/big and rounded once, because converting first would round twice.
func ratio(num, den uint64) float64 {
	if den <= 1<<53 {
		return float64(num) / float64(den)
	}
	x := new(big.Float).SetUint64(num) // exact: SetUint64 uses 64 bits of precision
	y := new(big.Float).SetUint64(den)
	q, _ := new(big.Float).SetPrec(53).SetMode(big.ToNearestEven).Quo(x, y).Float64()
	return q
}
