package workload

import (
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

func TestGenerateDeterministic(t *testing.T) {
	cfg := GenConfig{Workers: 4, Iterations: 5, KeysPerBatch: 200, KeySpace: 30_000, Skew: 1.2, Seed: 11}
	a, err := Generate(cfg)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := Generate(cfg)
	if !equalTraces(a, b) {
		t.Fatal("the same configuration gave different traces")
	}
	if err := a.Validate(); err != nil {
		t.Fatal(err)
	}
	for i, it := range a.Iters {
		for w, keys := range it {
			if len(keys) != cfg.KeysPerBatch {
				t.Fatalf("iteration %d worker %d has %d keys, want %d", i, w, len(keys), cfg.KeysPerBatch)
			}
		}
	}
	// Each batch has its own stream: fewer workers or iterations give a slice of the same trace.
	bigger := cfg
	bigger.Workers, bigger.Iterations = 7, 9
	big, _ := Generate(bigger)
	if s, _ := big.Slice(4, 5); !equalTraces(a, s) {
		t.Error("a smaller configuration is not a slice of a bigger one")
	}
	other := cfg
	other.Seed++
	if c, _ := Generate(other); equalTraces(a, c) {
		t.Error("another seed gave the same trace")
	}
	// Ranks are scattered: the hottest keys are not the smallest ids.
	if hot := a.TopKeys(20); slices.Max(hot) < 1000 {
		t.Errorf("the 20 hottest keys are all below 1000: %v", hot)
	}
}

func TestGenerateRejects(t *testing.T) {
	ok := GenConfig{Workers: 2, Iterations: 2, KeysPerBatch: 10, KeySpace: 100, Skew: 1.5}
	for name, mut := range map[string]func(*GenConfig){
		"no workers":      func(c *GenConfig) { c.Workers = 0 },
		"many workers":    func(c *GenConfig) { c.Workers = MaxWorkers + 1 },
		"negative iters":  func(c *GenConfig) { c.Iterations = -1 },
		"many batches":    func(c *GenConfig) { c.Iterations = MaxBatches },
		"no keys":         func(c *GenConfig) { c.KeysPerBatch = 0 },
		"keys > space":    func(c *GenConfig) { c.KeysPerBatch = 101 },
		"many keys":       func(c *GenConfig) { c.KeySpace, c.KeysPerBatch, c.Iterations = 1<<40, MaxKeys/2, 2 },
		"skew 1":          func(c *GenConfig) { c.Skew = 1 },
		"skew NaN":        func(c *GenConfig) { c.Skew = math.NaN() },
		"skew too large":  func(c *GenConfig) { c.Skew = 9 },
		"offset below 1":  func(c *GenConfig) { c.V = 0.5 },
		"offset infinite": func(c *GenConfig) { c.V = math.Inf(1) },
	} {
		c := ok
		mut(&c)
		if _, err := Generate(c); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: Generate gave %v, want ErrInvalid", name, err)
		}
	}
	if _, err := Generate(ok); err != nil {
		t.Errorf("Generate(%+v): %v", ok, err)
	}
	for _, share := range []float64{0, -0.1, 1.1, math.NaN()} {
		if _, err := Fit(ok, 10, share); !errors.Is(err, ErrInvalid) {
			t.Errorf("Fit to share %v: %v, want ErrInvalid", share, err)
		}
	}
	if _, err := Fit(ok, 0, 0.5); !errors.Is(err, ErrInvalid) {
		t.Errorf("Fit of the top 0: %v, want ErrInvalid", err)
	}
}

// TestGenerateWholeSpace draws every key of a small space, with and without a tail beyond the
// sampler's head: successive sampling must find the last, least likely keys rather than stall.
func TestGenerateWholeSpace(t *testing.T) {
	for _, n := range []uint64{1, 7, maxHead + 50} {
		for _, s := range []float64{1.001, 3} {
			tr, err := Generate(GenConfig{Workers: 1, Iterations: 1, KeysPerBatch: int(n), KeySpace: n, Skew: s})
			if err != nil {
				t.Fatal(err)
			}
			if got := len(tr.Iters[0][0]); uint64(got) != n && n <= maxHead {
				t.Errorf("n=%d s=%v: %d keys, want all", n, s, got)
			}
		}
	}
}

// TestSamplerMatchesRejection checks successive sampling against its definition: draw from the
// Zipf law until the batch has k distinct ranks. Both are run over many batches and must give the
// same per-rank inclusion frequencies, with and without a tail beyond the head.
func TestSamplerMatchesRejection(t *testing.T) {
	for _, c := range []struct {
		n    uint64
		s, v float64
		k    int
	}{
		{5_000, 1.3, 1, 200},
		{200_000, 1.2, 1, 300},
		{200_000, 1.1, 50, 300},
	} {
		const batches = 300
		fast, slow := map[uint64]float64{}, map[uint64]float64{}
		smp := newSampler(c.n, c.s, c.v)
		for b := range batches {
			rng := rand.New(rand.NewPCG(1, uint64(b)))
			for _, r := range smp.batch(rng, c.k, nil) {
				fast[r]++
			}
			rng = rand.New(rand.NewPCG(2, uint64(b)))
			z := rand.NewZipf(rng, c.s, c.v, c.n-1)
			seen := map[uint64]bool{}
			for len(seen) < c.k {
				seen[z.Uint64()] = true
			}
			for r := range seen {
				slow[r]++
			}
		}
		// Inclusion frequencies of the hottest ranks (the difference of two binomial frequencies
		// over 300 batches has a standard deviation of at most 0.041) and of rank blocks through
		// head and tail, which sum many small ones.
		for _, r := range []uint64{0, 1, 5, 20, 60} {
			if d := math.Abs(fast[r]-slow[r]) / batches; d > 0.12 {
				t.Errorf("%+v: rank %d in %.3f of batches, by rejection %.3f", c, r, fast[r]/batches, slow[r]/batches)
			}
		}
		blocks := []uint64{0}
		for _, b := range []uint64{100, 1000, 10_000, maxHead} {
			if b < c.n {
				blocks = append(blocks, b)
			}
		}
		blocks = append(blocks, c.n)
		for i := 0; i+1 < len(blocks); i++ {
			var f, s float64
			for r := blocks[i]; r < blocks[i+1]; r++ {
				f += fast[r]
				s += slow[r]
			}
			f, s = f/(batches*float64(c.k)), s/(batches*float64(c.k))
			if math.Abs(f-s) > 0.01 {
				t.Errorf("%+v: ranks [%d, %d) take %.4f of keys, by rejection %.4f", c, blocks[i], blocks[i+1], f, s)
			}
		}
	}
}

// TestTailSum checks the Euler–Maclaurin tail weight against a direct sum.
func TestTailSum(t *testing.T) {
	for _, c := range []struct{ s, v float64 }{{1.001, 1}, {1.3, 1}, {2.5, 30}, {8, 1}} {
		p := &sampler{s: c.s, v: c.v}
		a, b := uint64(maxHead), uint64(maxHead+200_000)
		var direct float64
		for r := b; r >= a; r-- { // smallest first, for accuracy
			direct += p.weight(r)
		}
		if got := p.sum(a, b); math.Abs(got-direct) > 1e-10*direct {
			t.Errorf("s=%v v=%v: sum %v, direct %v", c.s, c.v, got, direct)
		}
	}
}

func TestFitRecoversExponent(t *testing.T) {
	t.Parallel()
	cfg := GenConfig{Workers: 8, Iterations: 10, KeysPerBatch: 500, KeySpace: 50_000, Seed: 1}
	for _, s := range []float64{1.15, 1.6} {
		cfg.Skew = s
		tr, err := Generate(cfg)
		if err != nil {
			t.Fatal(err)
		}
		const k = 300
		share := tr.TopShare(k)
		fitCfg := cfg
		fitCfg.Seed = 2 // another trace of the same law
		got, err := Fit(fitCfg, k, share)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("s=%v: TopShare(%d) = %.4f, Fit on another seed gives s=%.4f", s, k, share, got)
		if math.Abs(got-s) > 0.03 {
			t.Errorf("Fit gave s=%.4f for a trace of s=%v", got, s)
		}
	}
	// Shares beyond reach give the nearer end of the range.
	cfg.Iterations = 1
	if s, _ := Fit(cfg, 1, 1e-9); s != minSkew {
		t.Errorf("Fit to a tiny share = %v, want %v", s, minSkew)
	}
	if s, _ := Fit(cfg, 1, 1); s != maxSkew {
		t.Errorf("Fit to share 1 of a single key = %v, want %v", s, float64(maxSkew))
	}
}

func TestValues(t *testing.T) {
	keys := []uint64{0, 1, 2, 1 << 40, 1<<64 - 1}
	a := Values(3, 7, keys, 99)
	if !slices.Equal(a, Values(3, 7, keys, 99)) {
		t.Fatal("Values is not deterministic")
	}
	// A value depends on its own key only, not on the rest of the batch.
	if v := Values(3, 7, keys[2:3], 99); v[0] != a[2] {
		t.Error("a key's value depends on the other keys")
	}
	for _, other := range [][]float32{Values(4, 7, keys, 99), Values(3, 8, keys, 99), Values(3, 7, keys, 100)} {
		if slices.Equal(a, other) {
			t.Error("another worker, iteration or seed gave the same values")
		}
	}
	var sum, sq float64
	const n = 100_000
	many := make([]uint64, n)
	for i := range many {
		many[i] = uint64(i)
	}
	for _, v := range Values(0, 0, many, 1) {
		if v < -1 || v >= 1 || v*(1<<23) != float32(math.Trunc(float64(v)*(1<<23))) {
			t.Fatalf("value %v outside [-1, 1) or not a multiple of 2^-23", v)
		}
		sum += float64(v)
		sq += float64(v) * float64(v)
	}
	// Uniform on [-1, 1): mean 0, variance 1/3, each within a few standard errors.
	if mean, vr := sum/n, sq/n-(sum/n)*(sum/n); math.Abs(mean) > 0.01 || math.Abs(vr-1./3) > 0.01 {
		t.Errorf("mean %.4f, variance %.4f; want about 0 and 1/3", mean, vr)
	}
}
