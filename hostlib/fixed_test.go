package hostlib

import (
	"math"
	"math/rand/v2"
	"testing"
)

func TestQuantizeRounding(t *testing.T) {
	const s = 24
	u := math.Ldexp(1, -s) // one unit in the last place of the fixed-point format
	cases := []struct {
		x    float64
		want int32
	}{
		{0, 0},
		{u, 1},
		{0.5 * u, 0}, // ties go to even
		{1.5 * u, 2},
		{2.5 * u, 2},
		{-0.5 * u, 0},
		{-1.5 * u, -2},
		{-2.5 * u, -2},
		{0.75 * u, 1},
		{0.25 * u, 0},
		{1, 1 << s},
		{-1, -1 << s},
		{127.5, 255 << (s - 1)},
		{-128, math.MinInt32}, // exactly representable: not an overflow
	}
	for _, c := range cases {
		got, ok := Quantize(float32(c.x), s)
		if !ok || got != c.want {
			t.Errorf("Quantize(%g) = %d, %v; want %d, true", c.x, got, ok, c.want)
		}
	}
	if got, ok := Quantize(3, 0); got != 3 || !ok {
		t.Errorf("scale 0: %d %v", got, ok)
	}
}

func TestQuantizeClamps(t *testing.T) {
	const s = 24
	cases := []struct {
		x    float32
		want int32
	}{
		{float32(math.NaN()), 0},
		{float32(math.Inf(1)), math.MaxInt32},
		{float32(math.Inf(-1)), math.MinInt32},
		{128, math.MaxInt32}, // 2^31: one past int32
		{-128.00002, math.MinInt32},
		{1e6, math.MaxInt32},
		{-1e30, math.MinInt32},
		{math.MaxFloat32, math.MaxInt32},
	}
	for _, c := range cases {
		got, ok := Quantize(c.x, s)
		if ok || got != c.want {
			t.Errorf("Quantize(%g) = %d, %v; want %d, false", c.x, got, ok, c.want)
		}
	}
	// The largest float32 below 128 still fits.
	if _, ok := Quantize(math.Nextafter32(128, 0), s); !ok {
		t.Errorf("largest float32 below 128 did not fit at scale %d", s)
	}
}

func TestDequantize(t *testing.T) {
	for _, s := range []uint8{0, 1, 8, 24, 30} {
		for _, v := range []int32{0, 1, -1, 12345, math.MaxInt32, math.MinInt32} {
			want := float32(math.Ldexp(float64(v), -int(s)))
			if got := Dequantize(v, s); got != want {
				t.Errorf("Dequantize(%d, %d) = %g, want %g", v, s, got, want)
			}
		}
	}
	// Multiples of 2^-s that fit float32 survive the round trip exactly.
	r := rand.New(rand.NewPCG(3, 4))
	for i := 0; i < 10000; i++ {
		v := int32(r.Uint32()) >> 8 // 24 bits: exact in float32
		x := Dequantize(v, 24)
		if q, ok := Quantize(x, 24); !ok || q != v {
			t.Fatalf("round trip of %d: %d %v", v, q, ok)
		}
	}
}

// The documented bound: |Dequantize(sum of Quantize) - exact| <= W*2^-(s+1) + half an ulp of the
// float32 result.
func TestFixedPointBound(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	for _, s := range []uint8{8, 16, 24, 30} {
		limit := math.Ldexp(1, 31-int(s)) / 40 // 32 workers cannot overflow
		for _, w := range []int{1, 2, 4, 32} {
			for i := 0; i < 5000; i++ {
				var q int64
				var exact float64
				for k := 0; k < w; k++ {
					x := float32((r.Float64()*2 - 1) * limit * math.Pow(2, -float64(r.IntN(20))))
					v, ok := Quantize(x, s)
					if !ok {
						t.Fatalf("Quantize(%g, %d) overflowed", x, s)
					}
					q += int64(v)
					exact += float64(x) // exact: float32s of limited range
				}
				got := float64(Dequantize(int32(q), s))
				bound := float64(w)*math.Ldexp(1, -int(s)-1) + halfULP32(got)
				if d := math.Abs(got - exact); d > bound {
					t.Fatalf("s=%d w=%d: got %g, exact %g, error %g > bound %g", s, w, got, exact, d, bound)
				}
			}
		}
	}
}

// halfULP32 is half the spacing of float32 values around |x|.
func halfULP32(x float64) float64 {
	f := float32(math.Abs(x))
	if math.IsInf(float64(f), 0) {
		return math.Inf(1)
	}
	return float64(math.Nextafter32(f, math.MaxFloat32)-f) / 2
}
