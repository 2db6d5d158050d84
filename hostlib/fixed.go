package hostlib

import "math"

// Fixed-point codec for ENC_FIXED32: a value x travels as the int32 round(x * 2^scaleLog2), which
// the switch can add with integer ALUs (an XDP program, like a switch pipeline, has no FPU).
//
// Error bound. Each worker's Quantize is off by at most 2^-(scale+1) (half a unit of the last
// place, when it reports ok). The switch's int32 sum is exact unless it saturates, and a saturated
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
