package workload

import (
	"math"
	"math/rand/v2"
)

// sampler draws a batch of distinct popularity ranks from the law P(r) ∝ (v + r)^-s on [0, n) by
// successive sampling: each draw picks among the ranks not yet in the batch, in proportion to
// their weights. That is what "draw from the law until the batch has k distinct ranks" amounts to,
// without that recipe's cost: for s well above 1 the popular ranks come back over and over (about
// k^s draws for k distinct ranks), while here every draw but a rare few yields a new rank.
//
// The head, ranks [0, h), sits in a sum tree of weights, from which a drawn rank is removed (and
// put back after the batch). Every node is recomputed as the sum of its children rather than
// decremented, so that what is left stays exact relative to itself: under a steep law the ranks
// left after the first few hundred weigh 1e-20 of the total, far below the rounding error of a
// decremented sum. The tail, ranks [h, n), is too large for a table in general; a rank is drawn
// from it with math/rand/v2's Zipf shifted by h (P(h + j) ∝ (v + h + j)^-s) and redrawn if
// already in the batch, which is rare since tail ranks are individually unlikely. The head or the
// tail is chosen in proportion to their remaining weights, the tail's total coming from the
// Euler–Maclaurin formula.
type sampler struct {
	s, v  float64
	n     uint64
	h     int       // head size
	leaf  int       // index of rank 0's leaf: a power of two >= h
	tree  []float64 // tree[1] is the root, tree[i] = tree[2i] + tree[2i+1], leaves from tree[leaf]
	headW []float64 // head weights, to put removed leaves back
	drawn []int     // head ranks removed during the current batch
	tailW float64   // total weight of the tail
	seen  *rankSet
}

// maxHead bounds the head. 16 Ki ranks cover the keys that come back often under the laws this
// package fits, and its 384 KiB of tree and weights stay in cache, which matters more: a draw is a
// walk down the tree. A larger head only makes tail redraws rarer.
const maxHead = 1 << 14

func newSampler(n uint64, s, v float64) *sampler {
	p := &sampler{s: s, v: v, n: n, h: int(min(n, maxHead)), seen: newRankSet(n)}
	for p.leaf = 1; p.leaf < p.h; p.leaf *= 2 {
	}
	p.headW = make([]float64, p.h)
	p.tree = make([]float64, 2*p.leaf)
	for r := range p.headW {
		p.headW[r] = p.weight(uint64(r))
		p.tree[p.leaf+r] = p.headW[r]
	}
	for i := p.leaf - 1; i > 0; i-- {
		p.tree[i] = p.tree[2*i] + p.tree[2*i+1]
	}
	if n > uint64(p.h) {
		p.tailW = p.sum(uint64(p.h), n-1)
	}
	return p
}

func (p *sampler) weight(r uint64) float64 { return math.Pow(p.v+float64(r), -p.s) }

// sum returns the sum of the weights of ranks a..b by the Euler–Maclaurin formula, to two
// derivative terms; for a >= maxHead (the only use) the next term is below 1e-20 of the sum.
func (p *sampler) sum(a, b uint64) float64 {
	s, x, y := p.s, p.v+float64(a), p.v+float64(b)
	// The integral (x^(1-s) - y^(1-s)) / (s-1), written with Expm1 so that s near 1 keeps its
	// precision instead of subtracting two numbers close to 1.
	integral := -math.Pow(x, 1-s) * math.Expm1((1-s)*math.Log(y/x)) / (s - 1)
	d1 := func(z float64) float64 { return -s * math.Pow(z, -s-1) }
	d3 := func(z float64) float64 { return -s * (s + 1) * (s + 2) * math.Pow(z, -s-3) }
	return integral + (math.Pow(x, -s)+math.Pow(y, -s))/2 + (d1(y)-d1(x))/12 - (d3(y)-d3(x))/720
}

// find returns the head rank whose slice of the remaining weight holds u in [0, tree[1]). Rounding
// can make it return a removed rank (weight 0) or a padding leaf (>= h); callers draw again.
func (p *sampler) find(u float64) int {
	i := 1
	for i < p.leaf {
		i *= 2
		if l := p.tree[i]; u >= l {
			u -= l
			i++
		}
	}
	return i - p.leaf
}

// set gives head rank r the weight w and recomputes the sums above it.
func (p *sampler) set(r int, w float64) {
	i := p.leaf + r
	p.tree[i] = w
	for i /= 2; i > 0; i /= 2 {
		p.tree[i] = p.tree[2*i] + p.tree[2*i+1]
	}
}

// batch appends up to k distinct ranks to out, drawn by successive sampling with rng.
func (p *sampler) batch(rng *rand.Rand, k int, out []uint64) []uint64 {
	p.seen.reset()
	defer func() {
		// Sums are recomputed in the same order as they were built: the tree comes back bit for
		// bit, and the next batch draws from exactly the same law.
		for _, r := range p.drawn {
			p.set(r, p.headW[r])
		}
		p.drawn = p.drawn[:0]
	}()
	var tail *rand.Zipf
	if p.tailW > 0 {
		tail = rand.NewZipf(rng, p.s, p.v+float64(p.h), p.n-1-uint64(p.h))
	}
	tailW := p.tailW
	// Every draw but a redrawn tail rank or a rounding artefact adds a rank; the bound only
	// matters if k is close to a huge n, where the tail's redraws would take forever.
	for d := 0; len(out) < k && d < maxDrawFactor*k; d++ {
		headW := p.tree[1]
		u := rng.Float64() * (headW + max(tailW, 0))
		switch {
		case u < headW:
			r := p.find(u)
			if r >= p.h || !p.seen.add(uint64(r)) {
				continue
			}
			p.set(r, 0)
			p.drawn = append(p.drawn, r)
			out = append(out, uint64(r))
		case tail != nil && tailW > 0:
			r := uint64(p.h) + tail.Uint64()
			if !p.seen.add(r) {
				continue
			}
			tailW -= p.weight(r)
			out = append(out, r)
		case headW <= 0:
			return out // nothing left to draw
		}
	}
	return out
}

// rankSet is the set of ranks drawn for the current batch: a stamped array for key spaces that
// fit in a few MiB (no clearing between batches: a new stamp empties it), a map beyond.
type rankSet struct {
	stamp []uint32
	cur   uint32
	m     map[uint64]struct{}
}

// denseRanks is the largest key space whose ranks are tracked in an array (4 MiB of stamps).
const denseRanks = 1 << 20

func newRankSet(n uint64) *rankSet {
	if n <= denseRanks {
		return &rankSet{stamp: make([]uint32, n)}
	}
	return &rankSet{m: make(map[uint64]struct{})}
}

func (s *rankSet) reset() {
	if s.m != nil {
		clear(s.m)
		return
	}
	s.cur++ // at most MaxBatches < 2^32 batches: never wraps back to a stale stamp
}

// add adds r and reports whether it was new.
func (s *rankSet) add(r uint64) bool {
	if s.m != nil {
		if _, ok := s.m[r]; ok {
			return false
		}
		s.m[r] = struct{}{}
		return true
	}
	if s.stamp[r] == s.cur {
		return false
	}
	s.stamp[r] = s.cur
	return true
}
