package hostlib

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"testing"
)

// quantizeTo and dequantizeFrom must agree with Quantize and Dequantize value for value.
func TestQuantizeToMatchesQuantize(t *testing.T) {
	edge := []float32{0, float32(math.Copysign(0, -1)), 0.5, -0.5, 1.5, 2.5, -2.5,
		float32(math.Inf(1)), float32(math.Inf(-1)), float32(math.NaN()),
		math.MaxFloat32, -math.MaxFloat32, math.SmallestNonzeroFloat32, 127.99999, 128, -128, -128.00002,
		1 << 30, -(1 << 30), 0x1p31, -0x1p31, 2147483520, -2147483648, 0x1.fffffep30}
	rng := rand.New(rand.NewPCG(1, 2))
	for _, s := range []uint8{0, 1, 8, 23, 24, 30, 31, 255} {
		vals := append([]float32(nil), edge...)
		for range 4000 {
			switch rng.IntN(3) {
			case 0:
				vals = append(vals, float32(rng.Float64()*2-1))
			case 1:
				vals = append(vals, float32((rng.Float64()*2-1)*math.Ldexp(1, 31-int(s))))
			default:
				// exact ties: k + 0.5 units of the last place
				vals = append(vals, float32(math.Ldexp(float64(rng.IntN(1<<20)-(1<<19))+0.5, -int(s))))
			}
		}
		for lo := 0; lo < len(vals); lo += 97 {
			pkt := vals[lo:min(lo+97, len(vals))]
			out := make([]byte, 4*len(pkt))
			gotOK := quantizeTo(out, pkt, s)
			wantOK := true
			for j, x := range pkt {
				q, ok := Quantize(x, s)
				wantOK = wantOK && ok
				if got := int32(binary.LittleEndian.Uint32(out[4*j:])); got != q {
					t.Fatalf("scale %d: quantizeTo(%g) = %d, Quantize = %d", s, x, got, q)
				}
			}
			if gotOK != wantOK {
				t.Fatalf("scale %d, values %d..: ok %v, want %v", s, lo, gotOK, wantOK)
			}
			dst := make([]float32, len(pkt))
			dequantizeFrom(dst, out, s)
			for j := range dst {
				want := Dequantize(int32(binary.LittleEndian.Uint32(out[4*j:])), s)
				if math.Float32bits(dst[j]) != math.Float32bits(want) {
					t.Fatalf("scale %d: dequantizeFrom = %g, Dequantize = %g", s, dst[j], want)
				}
			}
		}
	}
}

func TestDequantizeFromRandom(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	in := make([]byte, 4*1000)
	dst := make([]float32, 1000)
	for _, s := range []uint8{0, 1, 13, 24, 29, 30, 31, 64, 255} {
		for i := range 1000 {
			v := rng.Uint32() >> rng.IntN(32)
			if i < 4 {
				v = []uint32{0, 1 << 31, 1<<31 - 1, 1<<32 - 1}[i]
			}
			binary.LittleEndian.PutUint32(in[4*i:], v)
		}
		dequantizeFrom(dst, in, s)
		for i := range dst {
			want := Dequantize(int32(binary.LittleEndian.Uint32(in[4*i:])), s)
			if math.Float32bits(dst[i]) != math.Float32bits(want) {
				t.Fatalf("scale %d: dequantizeFrom = %g, Dequantize = %g", s, dst[i], want)
			}
		}
	}
}

func BenchmarkQuantizeTo(b *testing.B) { benchQuantize(b, quantizeTo) }

func BenchmarkDequantizeFrom(b *testing.B) { benchDequantize(b, dequantizeFrom) }

// benchQuantize and benchDequantize time one 832-value packet through a codec (quantizeTo, or
// its scalar twin in the SIMD build).
func benchQuantize(b *testing.B, quantize func(out []byte, vals []float32, scaleLog2 uint8) bool) {
	vals := make([]float32, 832)
	for i := range vals {
		vals[i] = float32(i)/832 - 0.5
	}
	out := make([]byte, 4*len(vals))
	b.SetBytes(int64(len(out)))
	for b.Loop() {
		quantize(out, vals, 24)
	}
}

func benchDequantize(b *testing.B, dequantize func(dst []float32, in []byte, scaleLog2 uint8)) {
	dst := make([]float32, 832)
	in := make([]byte, 4*len(dst))
	b.SetBytes(int64(len(in)))
	for b.Loop() {
		dequantize(dst, in, 24)
	}
}
