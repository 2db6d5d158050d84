package hostlib

import (
	"encoding/binary"
	"math"
)

// Fixed-point codec for ENC_FIXED32: a value x travels as the int32 round(x * 2^scaleLog2), which
// the switch can add with integer ALUs (an XDP program, like a switch pipeline, has no FPU).
//
// Error bound. Each worker's Quantize is off by at most 2^-(scale+1) (half a unit of the last
// place, when it reports ok). The switch's int32 sum is exact unless it overflows, and an overflowed
// sum is flagged F_OVERFLOW and repaired in float32 by the PS, so it never reaches Dequantize.
// Dequantize scales exactly in float64 and rounds once to float32. So for W workers:
//
//	|result - exact sum| <= W * 2^-(scale+1) + float32 rounding of the result (half an ulp)
//
// where exact sum is the real-number sum of the workers' float32 inputs.

// pow2 and invPow2 hold 2^s and 2^-s for every uint8 scale: one multiply instead of a Ldexp per
// value on the hot path. Both are exact in float64 (|s| <= 255 is far inside its exponent range).
var pow2, invPow2 [256]float64

func init() {
	for s := range pow2 {
		pow2[s] = math.Ldexp(1, s)
		invPow2[s] = math.Ldexp(1, -s)
	}
}

// Quantize returns x * 2^scaleLog2 rounded to the nearest int32, ties to even. ok is false when x
// is NaN, infinite or out of int32 range after scaling; the value is then clamped (NaN to 0, the
// rest to MinInt32/MaxInt32) and the sender must flag its packet F_OVERFLOW so the fragment is
// repaired in float32.
func Quantize(x float32, scaleLog2 uint8) (v int32, ok bool) {
	// float32 -> float64 is exact and so is the power-of-two scaling: RoundToEven is the only
	// rounding.
	f := math.RoundToEven(float64(x) * pow2[scaleLog2])
	switch {
	case f != f: // NaN
		return 0, false
	case f > math.MaxInt32:
		return math.MaxInt32, false
	case f < math.MinInt32:
		return math.MinInt32, false
	}
	return int32(f), true
}

// Dequantize returns v * 2^-scaleLog2 as float32. The product is exact in float64 (31 significant
// bits), so the conversion to float32 is the one and only rounding.
func Dequantize(v int32, scaleLog2 uint8) float32 {
	return float32(float64(v) * invPow2[scaleLog2])
}

const (
	// roundMagic is 1.5*2^52: for |f| < 2^51, f+roundMagic rounds f to an integer, ties to even
	// (the default rounding mode), and leaves it, two's complement, in the low bits of the
	// mantissa.
	roundMagic     = 0x1.8p52
	roundMagicBits = 0x4338000000000000 // math.Float64bits(roundMagic)
)

// quantizeToScalar writes Quantize(vals[j], scaleLog2) little-endian into out[4j:4j+4] for every
// j and reports whether every value was ok. It is the hot path of every DATA packet: one
// multiply, one add and a predictable range check per value; a packet with any value out of
// range is redone value by value through Quantize, which also clamps. quantizeTo is this, or its
// SIMD twin (fixed_simd.go) when built with GOEXPERIMENT=simd, which must give the same bytes.
func quantizeToScalar(out []byte, vals []float32, scaleLog2 uint8) (ok bool) {
	m := pow2[scaleLog2]
	out = out[:4*len(vals)]
	var bad uint64
	for j, x := range vals {
		// t is RoundToEven(f) when |f| < 2^51; for any other f (huge, infinite, NaN) |t| >= 2^51.
		// So t fits an int32 exactly when Quantize would say ok: no branch per value.
		t := int64(math.Float64bits(float64(x)*m+roundMagic)) - roundMagicBits
		bad |= uint64(t+1<<31) >> 32
		binary.LittleEndian.PutUint32(out[4*j:4*j+4], uint32(t))
	}
	if bad == 0 {
		return true
	}
	ok = true
	for j, x := range vals {
		q, qok := Quantize(x, scaleLog2)
		ok = ok && qok
		binary.LittleEndian.PutUint32(out[4*j:], uint32(q))
	}
	return ok
}

// dequantizeFromScalar sets dst[j] = Dequantize(int32 little-endian at in[4j:], scaleLog2).
// dequantizeFrom is this, or its SIMD twin (fixed_simd.go), bit for bit the same.
func dequantizeFromScalar(dst []float32, in []byte, scaleLog2 uint8) {
	if scaleLog2 > MaxScaleLog2 {
		for j := range dst {
			dst[j] = Dequantize(int32(binary.LittleEndian.Uint32(in[4*j:])), scaleLog2)
		}
		return
	}
	// In float32 directly: float32(v) is the one rounding, and scaling it by 2^-s with s <= 30
	// is exact (the result stays a normal float32), so this equals Dequantize bit for bit.
	m := float32(invPow2[scaleLog2])
	in = in[:4*len(dst)]
	for j := range dst {
		dst[j] = float32(int32(binary.LittleEndian.Uint32(in[4*j:4*j+4]))) * m
	}
}
