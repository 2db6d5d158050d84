package workload

import (
	"fmt"
	"math"
	"math/bits"
	"math/rand/v2"
	"slices"
)

// GenConfig configures Generate.
type GenConfig struct {
	// Workers and Iterations size the trace.
	Workers, Iterations int
	// KeysPerBatch is the number of distinct keys per worker per iteration. Every batch has exactly
	// this many, except when KeysPerBatch comes close to a key space of more than maxHead keys:
	// the last, least likely keys may then not turn up within maxDrawFactor*KeysPerBatch draws,
	// and the batch is smaller. In general, then, it is a mean.
	KeysPerBatch int
	// KeySpace bounds the keys: every key is in [0, KeySpace). It must be at least KeysPerBatch.
	KeySpace uint64
	// Skew is the Zipf exponent s > 1: key of popularity rank r (0-based) is drawn with
	// probability proportional to (V + r)^-s.
	Skew float64
	// V is the Zipf offset v >= 1 of that law; 0 means 1, the plain Zipf law. A larger V flattens
	// the head (the V or so hottest keys become about equally popular), which lets a law with
	// s > 1 match curves as flat as DeepLight's in Zebra's Figure 4.
	V float64
	// Seed makes the trace: the same configuration and seed always give the same trace.
	Seed uint64
}

// maxDrawFactor bounds the draws per batch to maxDrawFactor*KeysPerBatch. Almost every draw
// yields a new key (see sampler); the bound keeps a batch that asks for nearly all of a large key
// space from chasing the last, least likely tail keys through endless redraws.
const maxDrawFactor = 32

// Skew bounds: math/rand/v2's Zipf needs s > 1, and it loses precision as s nears 1 (it divides
// by 1-s); beyond maxSkew the hottest handful of keys take nearly all draws for any key space.
const (
	minSkew = 1.001
	maxSkew = 8
)

func (c GenConfig) check() error {
	switch {
	case c.Workers < 1 || c.Workers > MaxWorkers:
		return fmt.Errorf("%w: %d workers, want 1..%d", ErrInvalid, c.Workers, MaxWorkers)
	case c.Iterations < 0 || c.Iterations > MaxBatches/c.Workers:
		return fmt.Errorf("%w: %d iterations of %d workers exceed %d batches", ErrInvalid, c.Iterations, c.Workers, MaxBatches)
	case c.KeysPerBatch < 1 || uint64(c.KeysPerBatch) > c.KeySpace:
		return fmt.Errorf("%w: %d keys per batch in a key space of %d", ErrInvalid, c.KeysPerBatch, c.KeySpace)
	case c.KeysPerBatch > MaxKeys/max(1, c.Workers*c.Iterations):
		return fmt.Errorf("%w: %d batches of %d keys exceed %d keys", ErrInvalid, c.Workers*c.Iterations, c.KeysPerBatch, MaxKeys)
	case c.V != 0 && !(c.V >= 1 && c.V < math.Inf(1)):
		return fmt.Errorf("%w: Zipf offset %v, want >= 1", ErrInvalid, c.V)
	}
	return nil
}

func (c GenConfig) v() float64 {
	if c.V == 0 {
		return 1
	}
	return c.V
}

// Generate makes a synthetic trace: each worker's batch in each iteration is drawn from a Zipf law
// over popularity ranks, drawing until the batch holds KeysPerBatch distinct keys, like a
// mini-batch of samples whose features follow the law (done without the wasted redraws of
// popular keys: see sampler). Ranks become keys through a bijection of
// [0, KeySpace) chosen by the seed (an affine map, rank*a+c mod KeySpace), so that the hot keys
// are scattered over the key space as in hashed or first-seen id assignment rather than being the
// smallest ids.
//
// Each batch draws from its own random stream, derived from (Seed, iteration, worker), so a trace
// generated with fewer workers or iterations is exactly a Slice of one generated with more, and
// traces for different Skews share their random numbers, which keeps TopShare smooth in Skew (what
// Fit needs).
func Generate(cfg GenConfig) (*Trace, error) {
	if err := cfg.check(); err != nil {
		return nil, err
	}
	if !(cfg.Skew >= minSkew && cfg.Skew <= maxSkew) {
		return nil, fmt.Errorf("%w: Zipf exponent %v, want %v..%v", ErrInvalid, cfg.Skew, minSkew, maxSkew)
	}
	n := cfg.KeySpace
	perm := newAffine(n, cfg.Seed)
	t := &Trace{
		Name:     fmt.Sprintf("zipf s=%g v=%g n=%d k=%d seed=%d", cfg.Skew, cfg.v(), n, cfg.KeysPerBatch, cfg.Seed),
		KeySpace: n,
		Iters:    make([][][]uint64, cfg.Iterations),
	}
	smp := newSampler(n, cfg.Skew, cfg.v())
	var ranks []uint64
	for i := range t.Iters {
		t.Iters[i] = make([][]uint64, cfg.Workers)
		for w := range t.Iters[i] {
			rng := rand.New(rand.NewPCG(streamSeeds(cfg.Seed, i, w)))
			ranks = smp.batch(rng, cfg.KeysPerBatch, ranks[:0])
			keys := make([]uint64, len(ranks))
			for j, r := range ranks {
				keys[j] = perm.apply(r)
			}
			slices.Sort(keys)
			t.Iters[i][w] = keys
		}
	}
	return t, nil
}

// Fit returns the Zipf exponent s whose generated traces (cfg with Skew = s; cfg.Skew itself is
// ignored) have the TopShare(k) closest to share. It bisects over s in [1.001, 8] with cfg.Seed
// throughout, so the answer is deterministic; since the traces for different s share their random
// numbers (see Generate), TopShare grows with s all but monotonically. A share outside what the
// configuration can produce gives the nearer end of the range. Each step generates a whole trace:
// keep cfg as small as the measurement allows.
func Fit(cfg GenConfig, k int, share float64) (float64, error) {
	if err := cfg.check(); err != nil {
		return 0, err
	}
	if k < 1 || !(share > 0 && share <= 1) {
		return 0, fmt.Errorf("%w: fit top %d to share %v", ErrInvalid, k, share)
	}
	at := func(s float64) (float64, error) {
		c := cfg
		c.Skew = s
		t, err := Generate(c)
		if err != nil {
			return 0, err
		}
		return t.TopShare(k), nil
	}
	lo, hi := minSkew, float64(maxSkew)
	flo, err := at(lo)
	if err != nil {
		return 0, err
	}
	if flo >= share {
		return lo, nil
	}
	fhi, err := at(hi)
	if err != nil {
		return 0, err
	}
	if fhi <= share {
		return hi, nil
	}
	// Bisect in log(s-1): shares change fastest for s near 1, where realistic laws live, and a
	// relative step there matters as much as a large absolute one at high s.
	for (hi-1)/(lo-1) > 1+fitTolerance {
		mid := 1 + math.Sqrt((lo-1)*(hi-1))
		f, err := at(mid)
		if err != nil {
			return 0, err
		}
		if f < share {
			lo, flo = mid, f
		} else {
			hi, fhi = mid, f
		}
	}
	if share-flo <= fhi-share {
		return lo, nil
	}
	return hi, nil
}

// fitTolerance is the relative precision Fit bisects (s-1) to. TopShare moves by well under 0.01
// within it on the traces of this package, below the noise between seeds.
const fitTolerance = 0.01

// Values returns deterministic gradient values in [-1, 1) for keys of worker's batch in iteration
// iter: value j is a hash of (seed, worker, iter, keys[j]) alone, so a key has the same value
// however a trace is sliced or regrouped, and a test can recompute any expected sum from the keys.
// Values are multiples of 2^-23: exact in float32, and exact in xdpagg's fixed point (x*2^e in
// int32, e = 24 by default) for any e >= 23, so a test can predict the switch's sums exactly.
func Values(worker, iter int, keys []uint64, seed uint64) []float32 {
	h := mix(mix(mix(seed)^uint64(worker)) ^ uint64(iter))
	out := make([]float32, len(keys))
	for j, k := range keys {
		out[j] = float32(mix(h^k)>>40)*(1.0/(1<<23)) - 1 // 24 random bits over [0, 2), shifted
	}
	return out
}

// mix is SplitMix64's finaliser: a bijection of uint64 whose output bits all depend on all input
// bits, which is what makes hashes of nearby inputs (consecutive keys, workers) independent. The
// added constant keeps mix(0) from being 0.
func mix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// streamSeeds derives the PCG seeds of one batch. PCG states that differ by little give correlated
// streams, so (iteration, worker) go through mix rather than straight into the state.
func streamSeeds(seed uint64, iter, worker int) (uint64, uint64) {
	a := mix(mix(seed) ^ uint64(iter))
	return a, mix(a ^ uint64(worker))
}

// affine is the bijection r -> (a*r + c) mod n of [0, n), with a coprime to n.
type affine struct{ a, c, n uint64 }

func newAffine(n, seed uint64) affine {
	rng := rand.New(rand.NewPCG(mix(seed), 0x5eed))
	p := affine{n: n, c: rng.Uint64N(n)}
	for {
		// A random multiplier spreads consecutive ranks over the whole space; coprime to n, it
		// makes the map a bijection. About 6/pi^2 of candidates are coprime, so this ends fast.
		p.a = rng.Uint64N(n)
		if gcd(p.a, n) == 1 {
			return p
		}
	}
}

func (p affine) apply(r uint64) uint64 {
	hi, lo := bits.Mul64(p.a, r)
	x := bits.Rem64(hi, lo, p.n)
	if x >= p.n-p.c { // x + c >= n, computed without overflowing
		return x - (p.n - p.c)
	}
	return x + p.c
}

func gcd(a, b uint64) uint64 {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}
