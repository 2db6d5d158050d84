package sparse

// topK returns the first k distinct keys of r (all of them if k <= 0 or r is shorter) and each
// one's position in that list. A key repeated in r counts once, at its first position: rankings
// are meant to be duplicate-free, and reading a repeat as "the same item again" keeps the
// measures below in range instead of counting one item twice.
func topK(r Ranking, k int) ([]uint64, map[uint64]int) {
	if k <= 0 || k > len(r) {
		k = len(r)
	}
	keys := make([]uint64, 0, k)
	pos := make(map[uint64]int, k)
	for _, key := range r {
		if len(keys) == k {
			break
		}
		if _, dup := pos[key]; dup {
			continue
		}
		pos[key] = len(keys)
		keys = append(keys, key)
	}
	return keys, pos
}

// KendallTauDistance returns the normalized Kendall tau distance in [0,1] between the top-k of
// two rankings (0: identical, 1: disjoint). k <= 0 compares the whole rankings; a ranking shorter
// than k contributes all it has. Top-k lists of live training jobs hold different items, so the
// classic Kendall tau (a permutation distance) does not apply; this is Fagin, Kumar and
// Sivakumar's K^(p) ("Comparing top k lists", SIAM J. Discrete Math. 17(1), 2003) with the
// neutral penalty p = 1/2.
//
// Let A and B be the two top lists (sizes ka and kb) and consider every unordered pair {i, j} of
// distinct keys of A ∪ B. The pair costs
//
//  1. 1 if i and j are in both lists and the lists order them differently (0 if alike);
//  2. 1 if both are in one list, only i is in the other, and that first list puts j ahead of i
//     (the other list implicitly puts i, which it holds, ahead of j, which it lacks); else 0;
//  3. 1 if i is only in one list and j only in the other;
//  4. p = 1/2 if both are in one list and neither is in the other (their order in the other
//     list is unknown).
//
// K^(1/2) is the sum of these costs, and the distance is K^(1/2) / (ka*kb + (ka(ka-1) +
// kb(kb-1))/4). The divisor is K^(1/2) of two disjoint lists (ka*kb pairs of case 3 and the
// within-list pairs of case 4) and its maximum: with z shared keys, every pair costs at most 1
// and the case-4 pairs exactly 1/2, and that bound grows as z shrinks. For ka = kb = k it is
// k^2 + k(k-1)/2 = k(3k-1)/2. When the divisor is 0 (lists of at most one key and at least one
// empty), there are no pairs to compare: the distance is 0 if both are empty and 1 otherwise.
//
// It runs in O((ka+kb) log kb): case 1 is an inversion count (a Fenwick tree), cases 2-4 are
// counted per key rather than per pair.
func KendallTauDistance(a, b Ranking, k int) float64 {
	ta, pa := topK(a, k)
	tb, pb := topK(b, k)
	ka, kb := len(ta), len(tb)

	// Case 1 and case 2 with both keys in A: walk A in order. For a shared key, the keys of A
	// only seen before it are ahead of it in A (case 2 costs 1 each), and the shared keys seen
	// before it that B puts after it are inversions (case 1).
	var z, inv, ahead, aOnly float64
	fw := newFenwick(kb)
	for _, key := range ta {
		j, shared := pb[key]
		if !shared {
			aOnly++
			continue
		}
		ahead += aOnly
		inv += z - float64(fw.prefix(j)) // earlier shared keys at B positions > j
		fw.add(j)
		z++
	}
	// Case 2 with both keys in B: the same walk over B, counting its keys that A lacks.
	var bOnly float64
	for _, key := range tb {
		if _, shared := pa[key]; shared {
			ahead += bOnly
		} else {
			bOnly++
		}
	}
	x, y := aOnly, bOnly
	// Times 4 to keep the halves of case 4 and of the divisor integral until the last step;
	// float64 is exact up to 2^53 and cannot overflow, whatever k is.
	k4 := 4*(inv+ahead+x*y) + x*(x-1) + y*(y-1)
	norm4 := 4*float64(ka)*float64(kb) + float64(ka)*float64(ka-1) + float64(kb)*float64(kb-1)
	if norm4 == 0 {
		if ka == 0 && kb == 0 {
			return 0
		}
		return 1
	}
	return k4 / norm4
}

// fenwick is a binary indexed tree over positions [0, n): add marks a position, prefix(i)
// counts marked positions <= i.
type fenwick []int

func newFenwick(n int) fenwick { return make(fenwick, n+1) }

func (f fenwick) add(i int) {
	for i++; i < len(f); i += i & -i {
		f[i]++
	}
}

func (f fenwick) prefix(i int) int {
	n := 0
	for i++; i > 0; i -= i & -i {
		n += f[i]
	}
	return n
}

// Precision = |top-k(truth) ∩ top-k(est)| / |top-k(truth)| (Zebra §V-C): the share of the true
// hot keys that the estimate also calls hot, whatever their order. k <= 0 means len(truth).
// Repeated keys count once (see topK). An empty top-k(truth) has nothing to miss: precision 1.
func Precision(truth, est Ranking, k int) float64 {
	if k <= 0 {
		k = len(truth)
	}
	tt, _ := topK(truth, k)
	if len(tt) == 0 {
		return 1
	}
	_, pe := topK(est, k)
	hit := 0
	for _, key := range tt {
		if _, ok := pe[key]; ok {
			hit++
		}
	}
	return float64(hit) / float64(len(tt))
}
