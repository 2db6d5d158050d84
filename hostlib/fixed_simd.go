//go:build goexperiment.simd && amd64

package hostlib

import "simd/archsimd"

// The SIMD twin of the fixed-point codec (GOEXPERIMENT=simd): eight values per instruction with
// AVX2, the same bytes and floats as quantizeToScalar and dequantizeFromScalar, which remain the
// oracle (fixed_simd_test.go fuzzes one against the other) and the path for what SIMD does not
// cover (no AVX2, scales above MaxScaleLog2, the last len%8 values).

// useSIMD is decided once: the CPU must have AVX2 (the integer ops on 256-bit vectors).
var useSIMD = archsimd.X86.AVX2()

// SIMDCodec reports whether quantisation and dequantisation run on SIMD instructions (a build
// with GOEXPERIMENT=simd on an amd64 CPU with AVX2).
func SIMDCodec() bool { return useSIMD }

// Why float32 arithmetic gives Quantize's result: for scaleLog2 <= MaxScaleLog2 (30), 2^scaleLog2
// is a float32 and x * 2^scaleLog2 is exact in float32 unless it overflows to ±Inf (a power of
// two only moves the exponent; a subnormal x gains no bits). So RoundToEven of the float32
// product is RoundToEven of the real product, as Quantize computes it in float64. That integer
// fits an int32 exactly when -2^31 <= f < 2^31 (a float32 integer below 2^31 is at most
// 2^31-128); NaN and ±Inf fail the test, and any lane failing it sends the whole packet to the
// scalar path, which clamps and reports !ok exactly as before.
const (
	twoTo31    = float32(1 << 31)
	minusTwo31 = -float32(1 << 31)
)

func quantizeTo(out []byte, vals []float32, scaleLog2 uint8) bool {
	if !useSIMD || scaleLog2 > MaxScaleLog2 || len(vals) < 8 {
		return quantizeToScalar(out, vals, scaleLog2)
	}
	out = out[:4*len(vals)]
	m := archsimd.BroadcastFloat32x8(float32(pow2[scaleLog2]))
	hi := archsimd.BroadcastFloat32x8(twoTo31)
	lo := archsimd.BroadcastFloat32x8(minusTwo31)
	n := len(vals) &^ 7
	good := uint8(0xff)
	for j := 0; j < n; j += 8 {
		f := archsimd.LoadFloat32x8((*[8]float32)(vals[j : j+8])).Mul(m).RoundToEven()
		good &= f.GreaterEqual(lo).And(f.Less(hi)).ToBits()
		// VCVTTPS2DQ: f is already an integer, so truncation is exact for every good lane. The
		// wire is little-endian, as is amd64: the lanes' bytes are stored as they are (byte
		// vectors, so no unaligned *int32 is ever made).
		f.ConvertToInt32().AsUint8x32().Store((*[32]byte)(out[4*j : 4*j+32]))
	}
	if good != 0xff {
		return quantizeToScalar(out, vals, scaleLog2)
	}
	if n == len(vals) {
		return true
	}
	return quantizeToScalar(out[4*n:], vals[n:], scaleLog2)
}

func dequantizeFrom(dst []float32, in []byte, scaleLog2 uint8) {
	if !useSIMD || scaleLog2 > MaxScaleLog2 || len(dst) < 8 {
		dequantizeFromScalar(dst, in, scaleLog2)
		return
	}
	// As dequantizeFromScalar: float32(v) is the one rounding (VCVTDQ2PS rounds to nearest even
	// in Go's default MXCSR, as the scalar conversion does) and the scaling by 2^-s, s <= 30, is
	// exact.
	m := archsimd.BroadcastFloat32x8(float32(invPow2[scaleLog2]))
	in = in[:4*len(dst)]
	n := len(dst) &^ 7
	for j := 0; j < n; j += 8 {
		archsimd.LoadUint8x32((*[32]byte)(in[4*j : 4*j+32])).AsInt32x8().ConvertToFloat32().Mul(m).Store((*[8]float32)(dst[j : j+8]))
	}
	if n < len(dst) {
		dequantizeFromScalar(dst[n:], in[4*n:], scaleLog2)
	}
}
