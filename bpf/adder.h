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
 * SWAR add: two int32 lanes per 64-bit word (BPF has no SIMD). The low 31 bits of both lanes are
 * added with the lanes' sign bits masked off, so no carry crosses a lane; the sign bits are then
 * put back by XOR. Signed overflow of a lane shows in the sign bit of (a ^ r) & (b ^ r); it is
 * OR-ed into a sticky word rather than saturated per lane: a fragment that overflowed anywhere is
 * not a valid sum whatever its lanes hold (F_OVERFLOW; workers repair it at the PS), so the
 * switch only has to notice, which halves the work per value.
 *
 * Separate static functions (verified in the caller's context; allowed under the spin lock):
 * alone, clang keeps their pointers in registers instead of spilling them on every lane. */
#define LANES_LOW31 0x7fffffff7fffffffULL
#define LANES_SIGN 0x8000000080000000ULL
#define CHUNK_WORDS (XAGG_CHUNK / 2)
#define CHUNK_BYTES (XAGG_CHUNK * 4)
#define MAX_CHUNKS (XAGG_MAX_VALUES / XAGG_CHUNK)

static __always_inline __u64 lane_add(__u64 a, __u64 b, __u64 *ovf)
{
	__u64 r = ((a & LANES_LOW31) + (b & LANES_LOW31)) ^ ((a ^ b) & LANES_SIGN);
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

#endif
