//go:build goexperiment.simd && amd64

package hostlib

import (
	"bytes"
	"encoding/binary"
	"math"
	"testing"
)

// The SIMD codec against its scalar twin: the same bytes, the same ok, the same float bits, for
// any values, any scale and any length (the SIMD body and the scalar tail), on every input the
// fuzzer finds. TestQuantizeToMatchesQuantize also holds it to Quantize itself.
func FuzzSIMDCodecMatchesScalar(f *testing.F) {
	seed := func(vals []float32, s uint8) {
		b := make([]byte, 4*len(vals))
		for i, v := range vals {
			binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(v))
		}
		f.Add(b, s)
	}
	seed([]float32{0, 1, -1, 0.5, 1.5, 2.5, -2.5, 3, 4, 5, 6, 7, 8}, 24)
	seed([]float32{127.99999, 128, -128, -128.00002, 0x1p31, -0x1p31, 2147483520, -2147483648, 1, 2, 3}, 0)
	seed([]float32{float32(math.NaN()), 1, 2, 3, 4, 5, 6, 7, 8}, 24)
	seed([]float32{float32(math.Inf(1)), math.MaxFloat32, math.SmallestNonzeroFloat32, 1, 2, 3, 4, 5}, 30)
	seed(make([]float32, 17), 31)
	f.Fuzz(func(t *testing.T, raw []byte, s uint8) {
		n := len(raw) / 4
		vals := make([]float32, n)
		for i := range vals {
			vals[i] = math.Float32frombits(binary.LittleEndian.Uint32(raw[4*i:]))
		}
		got, want := make([]byte, 4*n), make([]byte, 4*n)
		gotOK, wantOK := quantizeTo(got, vals, s), quantizeToScalar(want, vals, s)
		if gotOK != wantOK || !bytes.Equal(got, want) {
			t.Fatalf("scale %d: quantizeTo = %x ok %v; scalar %x ok %v", s, got, gotOK, want, wantOK)
		}
		// Dequantise the raw bytes as they are: every int32 bit pattern.
		gd, wd := make([]float32, n), make([]float32, n)
		dequantizeFrom(gd, raw, s)
		dequantizeFromScalar(wd, raw, s)
		for i := range gd {
			if math.Float32bits(gd[i]) != math.Float32bits(wd[i]) {
				t.Fatalf("scale %d, value %d: dequantizeFrom = %g, scalar %g", s, i, gd[i], wd[i])
			}
		}
	})
}

func BenchmarkQuantizeToScalar(b *testing.B) { benchQuantize(b, quantizeToScalar) }

func BenchmarkDequantizeFromScalar(b *testing.B) { benchDequantize(b, dequantizeFromScalar) }
