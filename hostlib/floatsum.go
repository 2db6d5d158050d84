package hostlib

import (
	"math"
	"math/bits"
)

// exactSum adds float32 values with no rounding at all and rounds the total to float32 once: the
// correctly rounded float32 of the real-number sum, whatever the order of the additions. The PS uses
// it for the float32 repair of saturated fragments, so a repaired result is the same on every run
// and on every worker, and equals float32(exact sum).
//
// Why not float64 with Neumaier compensation: its compensation term is itself a rounded float64,
// and it loses bits whenever the inputs span more than 53 bits with cancellation. For example
// 2^100 + 2^47 + 2^-10 - 2^100 - 2^47 (five float32 values) gives 0 with Neumaier, 2^-10 here
// (TestExactSumBeatsNeumaier). Rounding a float64 sum to float32 also double-rounds.
//
// Every finite float32 is m * 2^(p-149) with an integer m < 2^24 and 0 <= p <= 253, so the sum is an
// integer multiple of 2^-149: exactSum keeps that integer in two's complement over 320 bits (bits
// up to 2^276 per value, plus 5 bits of carries for 32 addends and a sign bit, fit with room to
// spare). An add touches at most two words plus the carry chain; no floating point at all.
type exactSum [5]uint64

// Special-value bits kept beside an exactSum: IEEE-754 infinities and NaNs do not fit an integer,
// and a zero sum's sign depends on the addends.
const (
	spNaN     = 1 << iota // a NaN was added
	spPosInf              // +Inf was added
	spNegInf              // -Inf was added
	spNotNegZ             // something other than -0 was added: an exact zero sum is +0
)

// add adds the float32 with bit pattern b, updating the special bits sp.
func (s *exactSum) add(b uint32, sp *uint8) {
	exp := (b >> 23) & 0xff
	frac := uint64(b & 0x7fffff)
	neg := b>>31 != 0
	if exp == 0xff {
		switch {
		case frac != 0:
			*sp |= spNaN
		case neg:
			*sp |= spNegInf
		default:
			*sp |= spPosInf
		}
		*sp |= spNotNegZ
		return
	}
	if !neg || exp != 0 || frac != 0 {
		*sp |= spNotNegZ
	}
	m, p := frac, uint(0) // subnormal: frac * 2^-149
	if exp != 0 {
		m, p = frac|1<<23, uint(exp-1) // (1.frac) * 2^(exp-127) = m * 2^(exp-1-149)
	}
	if m == 0 {
		return
	}
	w, sh := p/64, p%64 // p <= 253, so w <= 3 and w+1 is a valid word
	lo := m << sh
	hi := m >> (64 - sh) // Go defines a shift by 64 as 0: right for sh == 0
	op := bits.Add64
	if neg {
		op = bits.Sub64
	}
	var c uint64
	s[w], c = op(s[w], lo, 0)
	s[w+1], c = op(s[w+1], hi, c)
	for i := w + 2; c != 0 && i < uint(len(s)); i++ {
		s[i], c = op(s[i], 0, c)
	}
}

// float32 returns the sum rounded to nearest, ties to even, given the special bits of its addends.
func (s *exactSum) float32(sp uint8) float32 {
	switch {
	case sp&spNaN != 0 || sp&(spPosInf|spNegInf) == spPosInf|spNegInf:
		return float32(math.NaN())
	case sp&spPosInf != 0:
		return float32(math.Inf(1))
	case sp&spNegInf != 0:
		return float32(math.Inf(-1))
	}
	v := *s
	neg := int64(v[len(v)-1]) < 0
	if neg { // magnitude: two's complement negation
		var c uint64 = 1
		for i := range v {
			v[i], c = bits.Add64(^v[i], 0, c)
		}
	}
	top := -1 // index of the highest set bit
	for i := len(v) - 1; i >= 0; i-- {
		if v[i] != 0 {
			top = i*64 + 63 - bits.LeadingZeros64(v[i])
			break
		}
	}
	if top < 0 {
		if sp&spNotNegZ == 0 {
			return float32(math.Copysign(0, -1)) // only -0 was added (or nothing)
		}
		return 0
	}
	var mant uint64
	shift := 0
	if top < 24 {
		mant = v[0] // < 2^24 units of 2^-149: exactly a float32 (subnormal or the lowest binade)
	} else {
		shift = top - 23 // keep the top 24 bits
		mant = extractBits(&v, shift, 24)
		round := extractBits(&v, shift-1, 1) != 0
		sticky := anyBitsBelow(&v, shift-1)
		if round && (sticky || mant&1 != 0) {
			mant++
			if mant == 1<<24 {
				mant >>= 1
				shift++
			}
		}
		if shift > 253 { // mant * 2^(shift-149) >= 2^128: beyond float32
			if neg {
				return float32(math.Inf(-1))
			}
			return float32(math.Inf(1))
		}
	}
	// mant has at most 24 significant bits and the exponent is in float32 range: both the float64
	// value and its float32 conversion are exact.
	f := float32(math.Ldexp(float64(mant), shift-149))
	if neg {
		f = -f
	}
	return f
}

// extractBits returns n <= 32 bits of v starting at bit pos.
func extractBits(v *exactSum, pos, n int) uint64 {
	w, off := pos/64, uint(pos%64)
	x := v[w] >> off
	if off != 0 && w+1 < len(v) {
		x |= v[w+1] << (64 - off)
	}
	return x & (1<<uint(n) - 1)
}

// anyBitsBelow reports whether any bit of v below bit pos is set.
func anyBitsBelow(v *exactSum, pos int) bool {
	w, off := pos/64, uint(pos%64)
	if v[w]&(1<<off-1) != 0 {
		return true
	}
	for i := 0; i < w; i++ {
		if v[i] != 0 {
			return true
		}
	}
	return false
}
