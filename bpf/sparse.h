/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Sparse hot-parameter aggregation (Zebra; docs/sparse.md): the iteration records that keep a hot
 * packet from adding twice and tell when an iteration is complete (pure decisions under the job's
 * lock, which bpf/sparse_model_test.go mirrors), the register add, and one pass of a packet's
 * pairs over the register arrays, touching each array at most once, as a switch pipeline does.
 */
#ifndef __XDPAGG_SPARSE_H
#define __XDPAGG_SPARSE_H

/* A cell's iteration tag (bits 32-62) and overflow bit (63). */
#define CELL_TAG_MASK 0x7fffffffu
#define CELL_OVERFLOW (1ull << 63)

/* What claiming a hot packet decided. */
enum sparse_claim {
	CLAIM_OK = 0,    /* first time seen: sum its pairs */
	CLAIM_DUPLICATE, /* this worker's packet index was already taken in this iteration */
	CLAIM_STALE,     /* an iteration the record no longer holds, or another hot-set version */
	CLAIM_MALFORMED, /* disagrees with what the iteration's earlier packets said */
};

/* Begin iteration `iter` in a record. */
static __always_inline void sparse_iter_reset(struct sparse_iter *it, __u32 iter, __u32 version, __u32 fan_in)
{
	it->iter = iter;
	it->version = version;
	it->fan_in = fan_in;
	it->state = SPARSE_OPEN;
	it->spilled = 0;
	/* Word by word: the empty asm keeps clang from turning the loops into memset, which BPF
	 * lacks. npkts and done are 2 * 32 u16 = 16 words. */
	__u64 *w = (__u64 *)it->npkts;
	for (__u32 i = 0; i < 2 * XAGG_MAX_WORKERS / 4; i++) {
		w[i] = 0;
		asm volatile("" ::: "memory");
	}
	__u64 *s = (__u64 *)it->seen;
	for (__u32 i = 0; i < XAGG_MAX_WORKERS * (XAGG_SPARSE_MAX_PKTS / 64); i++) {
		s[i] = 0;
		asm volatile("" ::: "memory");
	}
}

/*
 * Claim packet `index` of `worker` for iteration `iter` in the record of its parity, under the
 * job's lock. A record moves on only two iterations at a time: a worker sends iteration t+2 only
 * after it has the update of t+1, which the PS sends only after it has read iteration t out, so
 * by then nothing of t is left to add. Anything older is stale; anything further ahead does not
 * follow the protocol and is stale too.
 */
static __always_inline int sparse_claim(struct sparse_iter *it, __u32 iter, __u32 version, __u32 fan_in,
					__u32 worker, __u32 index, __u32 npkts)
{
	if (worker >= XAGG_MAX_WORKERS || index >= XAGG_SPARSE_MAX_PKTS)
		return CLAIM_MALFORMED;
	if (it->state == SPARSE_EMPTY || it->iter != iter) {
		if (it->state != SPARSE_EMPTY && iter - it->iter != 2)
			return CLAIM_STALE;
		sparse_iter_reset(it, iter, version, fan_in);
	}
	if (it->version != version)
		return CLAIM_STALE;
	if (it->fan_in != fan_in)
		return CLAIM_MALFORMED;
	if (it->npkts[worker] == 0)
		it->npkts[worker] = npkts;
	else if (it->npkts[worker] != npkts)
		return CLAIM_MALFORMED;
	__u64 bit = 1ull << (index % 64);
	__u64 *word = &it->seen[worker][(index / 64) % (XAGG_SPARSE_MAX_PKTS / 64)];
	if (*word & bit)
		return CLAIM_DUPLICATE;
	*word |= bit;
	return CLAIM_OK;
}

/*
 * A claimed packet is through: all its pairs are summed or handed to the PS (`spilled`). Under
 * the job's lock. Returns 1 when this packet completes the iteration (every worker's announced
 * packets are through), and the iteration's spilled packets in *spilled_out.
 */
static __always_inline int sparse_settle(struct sparse_iter *it, __u32 iter, __u32 worker, int spilled,
					 __u16 *spilled_out)
{
	if (it->state == SPARSE_EMPTY || it->iter != iter || worker >= XAGG_MAX_WORKERS)
		return 0;
	it->done[worker] += 1;
	if (spilled)
		it->spilled += 1;
	if (it->state != SPARSE_OPEN)
		return 0;
	for (__u32 w = 0; w < XAGG_MAX_WORKERS; w++) {
		if (w >= it->fan_in)
			break;
		if (it->npkts[w] == 0 || it->done[w] < it->npkts[w])
			return 0;
	}
	it->state = SPARSE_COMPLETE;
	*spilled_out = it->spilled;
	return 1;
}

/*
 * Add v to a register cell for iteration `tag`. A cell tagged with another iteration counts as
 * zero (the buffer's previous use, two iterations ago). Compare-and-swap, as a switch's stateful
 * ALU updates tag and sum in one step; gives up after XAGG_CAS_TRIES lost races (the pair then
 * waits for the next pass). Sets *ovf when this add overflowed int32.
 */
static __always_inline int reg_add(__u64 *cell, __u32 tag, __s32 v, int *ovf)
{
	__u64 old = READ_ONCE(*cell);
	for (__u32 i = 0; i < XAGG_CAS_TRIES; i++) {
		__u32 otag = old >> 32;
		__u64 nw;
		int o = 0;
		if ((otag & CELL_TAG_MASK) == tag) {
			__s64 sum = (__s64)(__s32)(__u32)old + v;
			o = sum != (__s32)sum;
			nw = ((__u64)tag << 32) | (__u32)(__s32)sum | (old & CELL_OVERFLOW) | (o ? CELL_OVERFLOW : 0);
		} else {
			nw = ((__u64)tag << 32) | (__u32)v;
		}
		__u64 prev = __sync_val_compare_and_swap(cell, old, nw);
		if (prev == old) {
			*ovf = o;
			return 1;
		}
		old = prev;
	}
	return 0;
}

/* State of one pass, for the per-pair callback (bpf_loop): scalars only; each call looks the
 * per-CPU pass state up again rather than carry a map pointer across frames. */
struct pass_ctx {
	__u32 m;
	__u32 placed;
	__u32 overflows;
};

static long pass_one_pair(__u64 i, void *arg)
{
	struct pass_ctx *pc = arg;
	__u32 zero = 0;
	struct sparse_pass *sp = bpf_map_lookup_elem(&sparse_pass, &zero);
	if (!sp || i >= XAGG_SPARSE_MAX_PAIRS)
		return 1;
	struct kv_pair *kp = &sp->pairs[i];
	__u32 rank = kp->rank;
	__u32 m = pc->m;
	if (rank == XAGG_RANK_PLACED || m == 0)
		return 0;
	__u32 a = rank % m;
	__u32 slot = rank / m;
	__u64 bit = 1ull << (a % 64);
	__u64 *tw = &sp->touched[(a / 64) % (XAGG_JOB_MAX_ARRAYS / 64)];
	if (*tw & bit)
		return 0; /* this array's one access in this pass is spent: next pass */
	*tw |= bit;
	__u32 key = sp->key_base + a;
	struct reg_array *ra = bpf_map_lookup_elem(&registers, &key);
	if (!ra || slot >= XAGG_REG_SLOTS)
		return 0; /* cannot happen: ranks were checked against m * reg_slots */
	int ovf = 0;
	if (!reg_add(&ra->cells[slot], sp->tag, kp->val, &ovf))
		return 0;
	__sync_fetch_and_add(&ra->hits[slot], 1);
	kp->rank = XAGG_RANK_PLACED;
	pc->placed++;
	pc->overflows += ovf;
	return 0;
}

/* One pass of the pipeline over a hot packet's pairs: each pair whose register array is not yet
 * touched in this pass is summed and marked placed; the others wait for the next pass. */
static __always_inline void sparse_run_pass(struct sparse_pass *sp, struct counters *ctr)
{
	if (sp->pass > 0)
		count(ctr, CNT_RECIRCULATED);
	for (__u32 w = 0; w < XAGG_JOB_MAX_ARRAYS / 64; w++)
		sp->touched[w] = 0;
	struct pass_ctx pc = { .m = sp->arrays };
	__u32 n = sp->npairs;
	if (pc.m == 0 || pc.m > XAGG_JOB_MAX_ARRAYS || n > XAGG_SPARSE_MAX_PAIRS)
		n = 0; /* cannot happen: checked when the packet was claimed */
	bpf_loop(n, pass_one_pair, &pc, 0);
	sp->left -= pc.placed;
	sp->pass += 1;
	if (ctr) {
		ctr->cnt[CNT_SPARSE_PAIRS] += pc.placed;
		ctr->cnt[CNT_REG_OVERFLOW] += pc.overflows;
	}
}

#endif
