/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The adder: the value passes over a fragment's values, in place in the packet and the slot.
 */
#ifndef __XDPAGG_ADDER_H
#define __XDPAGG_ADDER_H

/* The value passes over a fragment's full chunks, read and written in place in the (linear)
 * packet. The last partial chunk, if any, goes through the per-CPU scratch instead (zero-padded
 * to a whole chunk), because a direct access must be proven in bounds chunk by chunk.
 *
 * SWAR add: two int32 lanes per 64-bit word (BPF has no SIMD). One 64-bit add sums both lanes,
 * except that the low lane's carry (bit 32 of a ^ b ^ s, the sum's bit 32 with the operands' own
 * bits taken out) has leaked into the high lane: subtracting it back cuts the lanes apart. Signed
 * overflow of a lane shows in the sign bit of (a ^ r) & (b ^ r) (both operands' signs differ from
 * the result's); it is OR-ed into a sticky word rather than saturated per lane, and masked to the
 * lanes' sign bits once per packet: a fragment that overflowed anywhere is not a valid sum
 * whatever its lanes hold (F_OVERFLOW; workers repair it at the PS), so the switch only has to
 * notice, which halves the work per value.
 *
 * This form needs one constant (the carry bit) where masking both lanes' sign bits off before
 * the add and putting them back by XOR needs two (0x7fffffff7fffffff and its complement); with
 * BPF's ten registers that second constant made clang spill a pointer and reload constants on
 * every word (docs/benchmarks.md, Fast path: the switch adder).
 *
 * Separate static functions (verified in the caller's context; allowed under the spin lock):
 * alone, clang keeps their pointers in registers instead of spilling them on every lane. */
#define LANES_SIGN 0x8000000080000000ULL
#define LANE_CARRY 0x0000000100000000ULL
#define CHUNK_WORDS (XAGG_CHUNK / 2)
#define CHUNK_BYTES (XAGG_CHUNK * 4)
#define MAX_CHUNKS (XAGG_MAX_VALUES / XAGG_CHUNK)

static __always_inline __u64 lane_add(__u64 a, __u64 b, __u64 *ovf)
{
	__u64 s = a + b;
	__u64 r = s - ((a ^ b ^ s) & LANE_CARRY);
	*ovf |= (a ^ r) & (b ^ r);
	return r;
}

/* slot += packet over the first nfull chunks; when out, packet = the new slot as well (the
 * completing contribution carries the sum out). Returns overflow bits (nonzero: overflowed). */
static __noinline __u64 add_packet(__u64 *sv, void *pv0, void *end, __u32 nfull, __u32 out)
{
	__u64 ovf = 0;
	for (__u32 c = 0; c < MAX_CHUNKS; c++) {
		if (c >= nfull)
			break;
		__u64 *pv = pv0 + c * CHUNK_BYTES;
		if ((void *)(pv + CHUNK_WORDS) > end)
			break; /* cannot happen: parse checked the lengths; proves the access */
		__u64 *s = sv + c * CHUNK_WORDS;
		if (out) {
			#pragma unroll
			for (__u32 j = 0; j < CHUNK_WORDS; j++) {
				__u64 r = lane_add(s[j], pv[j], &ovf);
				s[j] = r;
				pv[j] = r;
			}
		} else {
			#pragma unroll
			for (__u32 j = 0; j < CHUNK_WORDS; j++)
				s[j] = lane_add(s[j], pv[j], &ovf);
		}
	}
	return ovf & LANES_SIGN;
}

/* slot (the tail chunk) += scratch, and scratch = the new slot. Returns overflow bits. */
static __noinline __u64 add_tail(__u64 *sv, __u64 *tv)
{
	__u64 ovf = 0;
	#pragma unroll
	for (__u32 j = 0; j < CHUNK_WORDS; j++) {
		__u64 r = lane_add(sv[j], tv[j], &ovf);
		sv[j] = r;
		tv[j] = r;
	}
	return ovf & LANES_SIGN;
}

/* dst = src over the first nfull chunks, one of them in the packet (direction by to_packet). */
static __always_inline void copy_packet(__u64 *sv, void *pv0, void *end, __u32 nfull, int to_packet)
{
	for (__u32 c = 0; c < MAX_CHUNKS; c++) {
		if (c >= nfull)
			break;
		__u64 *pv = pv0 + c * CHUNK_BYTES;
		if ((void *)(pv + CHUNK_WORDS) > end)
			break;
		__u64 *s = sv + c * CHUNK_WORDS;
		if (to_packet) {
			#pragma unroll
			for (__u32 j = 0; j < CHUNK_WORDS; j++)
				pv[j] = s[j];
		} else {
			#pragma unroll
			for (__u32 j = 0; j < CHUNK_WORDS; j++)
				s[j] = pv[j];
		}
	}
}

/* The value pass the slot state machine chose (enum value_pass), under the slot's lock, over the
 * fragment's nfull full chunks at pv and, when it has one (tail), its tail chunk: the scratch tv
 * against the slot lanes stail. Returns overflow bits (nonzero: overflowed).
 *
 * Chunks of XAGG_CHUNK lanes, each a fixed-trip loop with a branch-free body (a switch pipeline
 * stage does the same fixed work per pass). Only the outer loop exits early, once per chunk, which
 * keeps the verifier's path count at MAX/CHUNK instead of one per value. One loop per pass kind
 * keeps each body minimal: this is the hot path. */
static __always_inline __u64 value_pass(int run, struct slot *s, __u64 *stail, void *pv, void *end, __u32 nfull, __u32 tail, __u64 *tv)
{
	__u64 ovf = 0;
	if (run == PASS_COPY) {
		copy_packet((__u64 *)s->vals, pv, end, nfull, 0);
		if (tail)
			for (__u32 j = 0; j < CHUNK_WORDS; j++)
				stail[j] = tv[j];
	} else if (run == PASS_READ) {
		copy_packet((__u64 *)s->vals, pv, end, nfull, 1);
		if (tail)
			for (__u32 j = 0; j < CHUNK_WORDS; j++)
				tv[j] = stail[j];
	} else {
		ovf = add_packet((__u64 *)s->vals, pv, end, nfull, run == PASS_ADD_OUT);
		if (tail)
			ovf |= add_tail(stail, tv);
	}
	return ovf;
}

#endif
