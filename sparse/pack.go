package sparse

import (
	"fmt"
	"slices"
)

// Pack is Zebra's Algorithm 1 (PARAMETER_ORCHESTRATING): split the hot ranks of one worker's
// iteration into packets of at most maxPairs pairs such that, as far as possible, no packet
// carries two ranks of the same array (rank % m).
//
// It first estimates P = ceil(len/maxPairs) packets, the fewest that can carry the ranks. Each
// rank, in the order given, goes into the first packet among P that is not full and holds no rank
// of its array; ranks that fit nowhere (Zebra's G') go into extra packets appended at the end,
// maxPairs at a time in order. Zebra's reasoning: spreading G' over the first P packets would
// cost a recirculation per rank, while G' itself holds ranks of many arrays.
//
// A packet of more than m pairs cannot be conflict-free (the pigeonhole principle), so when
// maxPairs > m the P packets hold at most m conflict-free ranks each, G' takes the rest and its
// packets are crowded: Pack still recirculates far less than a random layout, but below one
// recirculation per packet takes m >= maxPairs (see TestZipfRecirculations).
//
// It returns packets as lists of indices into ranks, each packet's indices in the order given
// (increasing). Every index appears exactly once and no packet is empty; len(ranks) == 0 returns
// no packets. Deterministic. It panics if m < 1 or maxPairs < 1.
//
// Cost: O(n α(n)) time and O(n + min(m, n)) space for n ranks, whatever m and P are. The literal
// algorithm scans the P packets for every rank and each packet's contents for the rank's array,
// O(n·P·maxPairs); this needs neither, because of two facts:
//
//   - Packets only fill up, and a packet that holds a rank of array a always will, so a packet
//     that was no candidate for one rank of a is none for any later one. Keep next[a], one past
//     the packet that took the last rank of a: every packet below it is full or holds a, and
//     none at or above it holds a (each rank of a went at or above the next[a] of its time,
//     which then moved past it).
//   - So the answer for a rank of array a is simply the first packet at or above next[a] that is
//     not full, which a disjoint-set "next open packet" structure finds in amortized
//     near-constant time.
func Pack(ranks []uint32, m, maxPairs int) [][]int {
	if m < 1 || maxPairs < 1 {
		panic(fmt.Sprintf("sparse: Pack with m = %d, maxPairs = %d", m, maxPairs))
	}
	n := len(ranks)
	if n == 0 {
		return nil
	}
	p := (n + maxPairs - 1) / maxPairs // line 1 of Algorithm 1: Estimate_packets

	next := newArrayCursors(m, n)
	open := newNextOpen(p)
	size := make([]int, p, p+(n+maxPairs-1)/maxPairs) // pairs per packet, G' packets appended
	pkt := make([]int, n)                             // packet of each index
	var spill []int                                   // G': indices that fit in none of the P
	for i, r := range ranks {
		a := uint64(r) % uint64(m)
		q := open.find(next.get(a))
		if q == p { // every packet is full or holds a rank of a
			spill = append(spill, i)
			continue
		}
		pkt[i] = q
		next.set(a, q+1)
		if size[q]++; size[q] == maxPairs {
			open.close(q)
		}
	}
	for j, i := range spill {
		q := p + j/maxPairs
		if q == len(size) {
			size = append(size, 0)
		}
		pkt[i] = q
		size[q]++
	}
	return group(pkt, size)
}

// group turns a packet number per index into the lists of indices per packet, in index order,
// with one backing array (a counting sort). Each list is capped at its length, so a caller's
// append cannot overwrite the next packet.
func group(pkt, size []int) [][]int {
	out := make([][]int, len(size))
	backing := make([]int, len(pkt))
	off := 0
	for q, s := range size {
		out[q] = backing[off : off : off+s]
		off += s
	}
	for i, q := range pkt {
		out[q] = append(out[q], i)
	}
	return out
}

// arrayCursors is next[a] for Pack: a slice when m is small enough to allocate, a map when m
// exceeds the number of ranks (then most arrays never occur and a slice would waste memory).
type arrayCursors struct {
	dense  []int
	sparse map[uint64]int
}

func newArrayCursors(m, n int) arrayCursors {
	if m <= n {
		return arrayCursors{dense: make([]int, m)}
	}
	return arrayCursors{sparse: make(map[uint64]int, n)}
}

func (c arrayCursors) get(a uint64) int {
	if c.dense != nil {
		return c.dense[a]
	}
	return c.sparse[a]
}

func (c arrayCursors) set(a uint64, v int) {
	if c.dense != nil {
		c.dense[a] = v
	} else {
		c.sparse[a] = v
	}
}

// nextOpen finds the first open (not full) packet at or after a given one among p packets;
// find returns p if there is none. It is a disjoint-set forest where a full packet points past
// itself, with path halving, so a run of full packets is skipped in amortized near-constant time.
type nextOpen []int

func newNextOpen(p int) nextOpen {
	s := make(nextOpen, p+1) // s[p] is the sentinel "no packet", always its own root
	for i := range s {
		s[i] = i
	}
	return s
}

func (s nextOpen) find(q int) int {
	for s[q] != q {
		s[q] = s[s[q]]
		q = s[q]
	}
	return q
}

func (s nextOpen) close(q int) { s[q] = q + 1 }

// PackInOrder packs ranks in the order given, maxPairs at a time (the baseline "random layout"
// packing, which ignores where ranks live). It panics if maxPairs < 1.
func PackInOrder(ranks []uint32, maxPairs int) [][]int {
	if maxPairs < 1 {
		panic(fmt.Sprintf("sparse: PackInOrder with maxPairs = %d", maxPairs))
	}
	n := len(ranks)
	if n == 0 {
		return nil // as Pack does
	}
	out := make([][]int, 0, (n+maxPairs-1)/maxPairs)
	idx := make([]int, n)
	for i := range idx {
		idx[i] = i
	}
	for lo := 0; lo < n; lo += maxPairs {
		hi := min(lo+maxPairs, n)
		out = append(out, idx[lo:hi:hi])
	}
	return out
}

// Passes models the XDP datapath (bpf/sparse.h): a packet's pairs are visited in order, pass
// after pass; in one pass each register array is touched at most once, so a pair whose array was
// already touched in this pass waits for the next pass. Returns passes used (>= 1 when
// len(ranks) > 0, 0 for an empty packet; at most maxPasses) and how many pairs were still
// unplaced after maxPasses passes (those go to the PS). Recirculations = passes - 1. maxPasses
// <= 0 means no limit. It panics if m < 1.
//
// No simulation is needed: in pass t every array with pairs left places exactly one, its t-th
// pair in packet order (earlier passes took the first t-1, and nothing else in the packet
// touches that array). So an array with c pairs needs c passes: the packet needs as many passes
// as its most loaded array has pairs, and each array leaves max(0, c - maxPasses) pairs over.
func Passes(ranks []uint32, m, maxPasses int) (passes, unplaced int) {
	if m < 1 {
		panic(fmt.Sprintf("sparse: Passes with m = %d", m))
	}
	arr := make([]uint64, len(ranks))
	for i, r := range ranks {
		arr[i] = uint64(r) % uint64(m)
	}
	// Sorting groups each array's pairs without an m-sized table; packets are small.
	slices.Sort(arr)
	for i := 0; i < len(arr); {
		j := i + 1
		for j < len(arr) && arr[j] == arr[i] {
			j++
		}
		c := j - i
		passes = max(passes, c)
		if maxPasses > 0 && c > maxPasses {
			unplaced += c - maxPasses
		}
		i = j
	}
	if maxPasses > 0 {
		passes = min(passes, maxPasses)
	}
	return passes, unplaced
}

// Recirculations applies Passes to every packet of a packing (index lists into ranks, as Pack
// and PackInOrder return) and sums the recirculations (passes - 1 per non-empty packet) and the
// pairs left for the PS. It is the figure of Zebra §V-D: divide by len(packets) for
// recirculations per packet. To model a layout other than heat-based, relabel the ranks first
// (ranks[i] -> perm[ranks[i]], see Permutation). It panics if m < 1.
func Recirculations(ranks []uint32, packets [][]int, m, maxPasses int) (recirculations, unplaced int) {
	var buf []uint32
	for _, pk := range packets {
		if len(pk) == 0 {
			continue
		}
		buf = buf[:0]
		for _, i := range pk {
			buf = append(buf, ranks[i])
		}
		p, u := Passes(buf, m, maxPasses)
		recirculations += p - 1
		unplaced += u
	}
	return recirculations, unplaced
}
