package sparse

import (
	"fmt"
	"math"
	"math/bits"
	"math/rand/v2"
)

// Layout is the switch's register file: Arrays (m) register arrays of Slots (r) values each;
// M = m*r. Heat-based placement (Zebra): rank i lives in array i % m, slot i / m.
//
// Consecutive ranks have similar heat, so they are the ranks most likely to travel in the same
// packet; striping them over the arrays puts them in different arrays, which one pipeline pass
// can all touch. Ranks i and i+m, which do share an array, differ in heat by a whole stripe and
// rarely meet in one packet (Zebra §III-D).
type Layout struct {
	Arrays, Slots int
}

// Size returns M = Arrays*Slots, the number of ranks the layout holds. Valid layouts only (see
// Validate): the product of an invalid one may overflow.
func (l Layout) Size() int { return l.Arrays * l.Slots }

// Array returns the register array of rank. It panics if l.Arrays < 1.
func (l Layout) Array(rank uint32) int { return int(uint64(rank) % l.arrays()) }

// Slot returns rank's slot within its array. It panics if l.Arrays < 1. A slot >= l.Slots means
// the rank is beyond the layout's Size.
func (l Layout) Slot(rank uint32) int { return int(uint64(rank) / l.arrays()) }

// Rank is the inverse of Array and Slot: the rank stored in slot of array. It panics if
// l.Arrays < 1, and if the rank would not fit in uint32, like a slice index out of range.
func (l Layout) Rank(array, slot int) uint32 {
	m := l.arrays()
	if array < 0 || uint64(array) >= m || slot < 0 {
		panic(fmt.Sprintf("sparse: Layout.Rank(%d, %d) with %d arrays", array, slot, l.Arrays))
	}
	hi, r := bits.Mul64(uint64(slot), m)
	r, carry := bits.Add64(r, uint64(array), 0)
	if hi != 0 || carry != 0 || r > math.MaxUint32 {
		panic(fmt.Sprintf("sparse: Layout.Rank(%d, %d): rank beyond uint32", array, slot))
	}
	return uint32(r)
}

func (l Layout) arrays() uint64 {
	if l.Arrays < 1 {
		panic(fmt.Sprintf("sparse: layout with %d register arrays", l.Arrays))
	}
	return uint64(l.Arrays)
}

// Validate reports (ErrBadParameter) a layout without arrays or slots, or one whose Size does
// not fit an int or exceeds the 2^32 ranks a uint32 can address.
func (l Layout) Validate() error {
	if l.Arrays < 1 || l.Slots < 1 {
		return fmt.Errorf("%w: layout of %d arrays of %d slots", ErrBadParameter, l.Arrays, l.Slots)
	}
	if l.Arrays > math.MaxInt/l.Slots {
		return fmt.Errorf("%w: layout of %d arrays of %d slots: Size overflows int",
			ErrBadParameter, l.Arrays, l.Slots)
	}
	if uint64(l.Arrays)*uint64(l.Slots) > math.MaxUint32+1 {
		return fmt.Errorf("%w: layout of %d arrays of %d slots exceeds 2^32 ranks",
			ErrBadParameter, l.Arrays, l.Slots)
	}
	return nil
}

// Permutation returns a seeded random permutation of [0, n) (math/rand/v2 PCG), used to model a
// random layout: rank i is stored at position perm[i] instead of i, so its array is perm[i] % m.
// The same seed gives the same permutation, so experiments can be repeated. It panics if n is
// negative or above 2^32, which uint32 positions cannot hold.
func Permutation(n int, seed uint64) []uint32 {
	if n < 0 || uint64(n) > math.MaxUint32+1 {
		panic(fmt.Sprintf("sparse: Permutation(%d): n out of [0, 2^32]", n))
	}
	perm := make([]uint32, n)
	for i := range perm {
		perm[i] = uint32(i)
	}
	rng := rand.New(rand.NewPCG(seed, seedStream))
	rng.Shuffle(n, func(i, j int) { perm[i], perm[j] = perm[j], perm[i] })
	return perm
}

// seedStream is PCG's second seed word for every generator of this package: callers pick one
// uint64 seed, and this constant (an arbitrary odd number) fills in the rest of the state.
const seedStream = 0x9e3779b97f4a7c15
