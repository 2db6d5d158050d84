package hostlib

import (
	"math"
	"math/big"
	"math/rand/v2"
	"testing"
)

// exactRef is the correctly rounded float32 of the exact sum, by math/big.
func exactRef(xs []float32) float32 {
	s := new(big.Float).SetPrec(2000)
	for _, x := range xs {
		s.Add(s, new(big.Float).SetPrec(2000).SetFloat64(float64(x)))
	}
	f, _ := s.Float32()
	return f
}

func sumExact(xs []float32) float32 {
	var s exactSum
	var sp uint8
	for _, x := range xs {
		s.add(math.Float32bits(x), &sp)
	}
	return s.float32(sp)
}

func same(a, b float32) bool {
	return math.Float32bits(a) == math.Float32bits(b) || (a != a && b != b)
}

func TestExactSumMatchesBig(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	gens := map[string]func() float32{
		"uniform": func() float32 { return float32(r.Float64()*2 - 1) },
		"any bits": func() float32 {
			for {
				x := math.Float32frombits(r.Uint32())
				if !math.IsNaN(float64(x)) && !math.IsInf(float64(x), 0) {
					return x
				}
			}
		},
		"subnormal": func() float32 { return math.Float32frombits(r.Uint32() & 0x807fffff) },
		"huge": func() float32 {
			return float32(math.Ldexp(r.Float64()*2-1, 100+r.IntN(28)))
		},
		"wide": func() float32 { // every exponent, both signs: heavy cancellation
			return float32(math.Ldexp(r.Float64()*2-1, r.IntN(250)-125))
		},
		"ties": func() float32 { // integers around 2^24: sums land on float32 midpoints
			return float32(int64(r.IntN(1<<10)) + 1<<24 - 1<<9)
		},
	}
	for name, gen := range gens {
		for i := 0; i < 3000; i++ {
			n := 1 + r.IntN(32)
			xs := make([]float32, n)
			for j := range xs {
				xs[j] = gen()
			}
			if rand.IntN(4) == 0 { // cancel most of the sum
				for j := 0; j < n/2; j++ {
					xs[n-1-j] = -xs[j]
				}
			}
			got, want := sumExact(xs), exactRef(xs)
			if !same(got, want) {
				t.Fatalf("%s: sum of %v = %g (%#x), want %g (%#x)", name, xs, got, math.Float32bits(got), want, math.Float32bits(want))
			}
		}
	}
}

func TestExactSumSpecials(t *testing.T) {
	inf, nan := float32(math.Inf(1)), float32(math.NaN())
	negz := float32(math.Copysign(0, -1))
	cases := []struct {
		xs   []float32
		want float32
	}{
		{nil, negz}, // an empty sum never happens at the PS; IEEE's identity for + is -0
		{[]float32{negz, negz}, negz},
		{[]float32{negz, 0}, 0},
		{[]float32{1, -1}, 0},
		{[]float32{inf, 1}, inf},
		{[]float32{-inf, 1}, -inf},
		{[]float32{inf, -inf}, nan},
		{[]float32{nan, 1}, nan},
		{[]float32{math.MaxFloat32, math.MaxFloat32}, inf},
		{[]float32{-math.MaxFloat32, -math.MaxFloat32}, -inf},
		// MaxFloat32 plus just under half an ulp stays finite; half an ulp (a tie, odd mantissa)
		// rounds up to infinity.
		{[]float32{math.MaxFloat32, 0x1p102, 0x1p101}, math.MaxFloat32},
		{[]float32{math.MaxFloat32, 0x1p103}, inf},
		{[]float32{math.MaxFloat32, 0x1p103, -0x1p80}, math.MaxFloat32},
		{[]float32{math.SmallestNonzeroFloat32, math.SmallestNonzeroFloat32}, 2 * math.SmallestNonzeroFloat32},
		{[]float32{math.SmallestNonzeroFloat32, -math.SmallestNonzeroFloat32}, 0},
	}
	for _, c := range cases {
		if got := sumExact(c.xs); !same(got, c.want) {
			t.Errorf("sum %v = %g (%#x), want %g", c.xs, got, math.Float32bits(got), c.want)
		}
	}
}

// The reason exactSum exists: float64 with Neumaier compensation gets this five-worker sum wrong.
func TestExactSumBeatsNeumaier(t *testing.T) {
	xs := []float32{0x1p100, 0x1p47, 0x1p-10, -0x1p100, -0x1p47}
	if got := sumExact(xs); got != 0x1p-10 {
		t.Fatalf("exact sum = %g, want 2^-10", got)
	}
	var s, c float64
	for _, x := range xs {
		v := float64(x)
		t := s + v
		if math.Abs(s) >= math.Abs(v) {
			c += (s - t) + v
		} else {
			c += (v - t) + s
		}
		s = t
	}
	if float32(s+c) == 0x1p-10 {
		t.Fatalf("Neumaier got it right after all (%g): the comment in floatsum.go is wrong", s+c)
	}
}
