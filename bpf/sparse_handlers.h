/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The sparse packet handlers of xdpagg_switch (docs/sparse.md): a worker's hot packet
 * (handle_sparse: checked, claimed in its iteration's record, then summed over the register
 * arrays by xdpagg_sparse's passes, entered by tail call), the end of its passes (sparse_finish),
 * and the PS's read-out of an iteration's hot sums (handle_pull, MSG_PULL).
 */
#ifndef __XDPAGG_SPARSE_HANDLERS_H
#define __XDPAGG_SPARSE_HANDLERS_H

/* Recirculation: hot packets run their passes in xdpagg_sparse, which tail-calls itself for each
 * further pass. Key 0: xdpagg_sparse (set at load from this declaration). */
int xdpagg_sparse(struct xdp_md *ctx);
struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__array(values, int(struct xdp_md *));
} sparse_progs SEC(".maps") = {
	.values = { [0] = (void *)&xdpagg_sparse },
};

/* Offset of a sparse packet's pairs. */
#define OFF_PAIRS (OFF_VALS + sizeof(struct sparse_hdr))

/*
 * A hot packet is through its passes (or failed to recirculate): account it to its iteration,
 * then drop it (all pairs summed), or hand it to the PS with the pairs it still carries and, if it
 * completed the iteration, F_SPARSE_DONE and the iteration's spilled-packet count.
 */
static __always_inline int sparse_finish(struct xdp_md *ctx, struct counters *ctr, struct sparse_pass *sp)
{
	__u32 hk = sp->npairs ? sp->pass : 0;
	if (hk > XAGG_SPARSE_MAX_PASSES)
		hk = XAGG_SPARSE_MAX_PASSES;
	__u64 *hv = bpf_map_lookup_elem(&recirc_hist, &hk);
	if (hv)
		*hv += 1; /* per-CPU */
	__u32 left = sp->left;
	__u32 job_id = sp->job_id;
	__u16 spilled_total = 0;
	int complete = 0;
	struct sparse_job *sj = bpf_map_lookup_elem(&sparse_jobs, &job_id);
	if (sj) {
		bpf_spin_lock(&sj->lock);
		complete = sparse_settle(&sj->it[sp->iter & 1], sp->iter, sp->worker, left != 0, &spilled_total);
		bpf_spin_unlock(&sj->lock);
	}
	if (left && ctr)
		ctr->cnt[CNT_SPARSE_SPILLED] += left;
	if (!left && !complete) {
		count(ctr, CNT_AGGREGATED);
		return XDP_DROP;
	}
	if (left) {
		/* The pairs go back into the packet, the placed ones marked, for the PS to sum the rest. */
		__u64 len = (__u64)sp->npairs * sizeof(struct kv_pair);
		barrier_var(len);
		if (len == 0 || len > sizeof(sp->pairs))
			return XDP_ABORTED;
		if (bpf_xdp_store_bytes(ctx, OFF_PAIRS, sp->pairs, len))
			return XDP_ABORTED;
	}
	struct cursor c = { .pos = (void *)(long)ctx->data, .end = (void *)(long)ctx->data_end };
	struct pkt q;
	if (parse(&c, &q) != PARSE_OK || !q.sh)
		return XDP_ABORTED;
	if (left)
		q.h->flags |= F_COLLISION;
	if (complete) {
		q.h->flags |= F_SPARSE_DONE;
		q.sh->spilled = spilled_total;
		count(ctr, CNT_SPARSE_DONE);
	}
	return to_ps(ctr, &q, 0);
}

/* Rank check of a hot packet's pairs, for bpf_loop (one callback verified once, rather than a
 * 415-step loop the verifier walks step by step). */
struct rank_check {
	__u32 size;
	__u32 bad;
};

static long check_one_rank(__u64 i, void *arg)
{
	struct rank_check *rc = arg;
	__u32 zero = 0;
	struct sparse_pass *sp = bpf_map_lookup_elem(&sparse_pass, &zero);
	if (!sp || i >= XAGG_SPARSE_MAX_PAIRS || sp->pairs[i].rank >= rc->size) {
		rc->bad = 1;
		return 1;
	}
	return 0;
}

/* A worker's hot packet: check it against the job's registers, claim it in its iteration's
 * record (a duplicate stops here), copy its pairs to the per-CPU pass state and start the passes. */
static __always_inline int handle_sparse(struct xdp_md *ctx, struct counters *ctr, struct pkt *p, struct job *j)
{
	struct hdr *h = p->h;
	struct sparse_hdr *sh = p->sh;
	__u32 m = j->reg_arrays;
	__u32 base = j->reg_base;
	if (!sh || (h->flags & F_LEVEL1) || m == 0 || m > XAGG_JOB_MAX_ARRAYS || base + m > reg_arrays)
		goto malformed;
	__u32 npkts = sh->npkts; /* 1..XAGG_SPARSE_MAX_PKTS (parse_l4) */
	if (npkts > XAGG_SPARSE_MAX_PKTS)
		goto malformed;
	/* Only the switch says what it did: a worker's flags beyond resend and ECN are cleared. */
	h->flags &= F_RESEND | F_ECN;
	sh->spilled = 0;
	__u32 iter = h->seq, version = sh->hot_version, worker = h->worker_id, index = h->agg_index;
	__u32 fan = h->fan_in0, n = h->count;

	__u32 zero = 0;
	struct sparse_pass *sp = bpf_map_lookup_elem(&sparse_pass, &zero);
	if (!sp)
		return XDP_ABORTED;
	__u64 len = (__u64)n * sizeof(struct kv_pair);
	barrier_var(len);
	if (len > sizeof(sp->pairs))
		goto malformed;
	if (len) {
		barrier_var(len);
		if (len == 0 || len > sizeof(sp->pairs))
			goto malformed;
		if (bpf_xdp_load_bytes(ctx, OFF_PAIRS, sp->pairs, len))
			goto malformed;
	}
	/* Every rank must be one of this job's registers (nor a placed mark). */
	struct rank_check rc = { .size = m * reg_slots };
	if (n > XAGG_SPARSE_MAX_PAIRS)
		goto malformed;
	bpf_loop(n, check_one_rank, &rc, 0);
	if (rc.bad)
		goto malformed;

	__u32 job_id = h->job_id;
	struct sparse_job *sj = bpf_map_lookup_elem(&sparse_jobs, &job_id);
	if (!sj)
		goto malformed;
	bpf_spin_lock(&sj->lock);
	int claim = sparse_claim(&sj->it[iter & 1], iter, version, fan, worker, index, npkts);
	bpf_spin_unlock(&sj->lock);
	switch (claim) {
	case CLAIM_OK:
		break;
	case CLAIM_DUPLICATE:
		count(ctr, CNT_DUPLICATE);
		return XDP_DROP;
	case CLAIM_STALE:
		count(ctr, CNT_SPARSE_STALE);
		return XDP_DROP;
	default:
		goto malformed;
	}
	sp->job_id = job_id;
	sp->iter = iter;
	sp->key_base = (iter & 1) * reg_arrays + base;
	sp->arrays = m;
	sp->tag = iter & CELL_TAG_MASK;
	sp->npairs = n;
	sp->left = n;
	sp->worker = worker;
	sp->pass = 0;
	sp->index = index;
	if (n > 0) {
		bpf_tail_call(ctx, &sparse_progs, 0);
		count(ctr, CNT_TAILCALL_ERR);
	}
	/* An empty marker (nothing to sum), or the tail call failed: finish here. */
	return sparse_finish(ctx, ctr, sp);

malformed:
	count(ctr, CNT_MALFORMED);
	return XDP_DROP;
}

/* One rank of a read-out, for bpf_loop: into the per-CPU pass state's pair buffer as struct reg_read. */
struct read_ctx {
	__u32 first;
	__u32 m;
	__u32 key_base;
	__u32 tag;
	__u32 overflow;
	__u32 failed;
};

static long read_one_rank(__u64 i, void *arg)
{
	struct read_ctx *rc = arg;
	__u32 zero = 0;
	struct sparse_pass *sp = bpf_map_lookup_elem(&sparse_pass, &zero);
	if (!sp || i >= XAGG_SPARSE_MAX_PAIRS || rc->m == 0) {
		rc->failed = 1;
		return 1;
	}
	__u32 rank = rc->first + (__u32)i;
	__u32 key = rc->key_base + rank % rc->m;
	__u32 slot = rank / rc->m;
	struct reg_array *ra = bpf_map_lookup_elem(&registers, &key);
	if (!ra || slot >= XAGG_REG_SLOTS) {
		rc->failed = 1;
		return 1;
	}
	__u64 cell = READ_ONCE(ra->cells[slot]);
	__u32 hits = READ_ONCE(ra->hits[slot]);
	/* The cell holds t's sum if its tag is t's and it was ever added to: a never-used cell is
	 * all zero, iteration 0's tag, and its hit counter is 0 too. */
	int mine = ((cell >> 32) & CELL_TAG_MASK) == rc->tag && (cell != 0 || hits != 0);
	struct reg_read *out = (struct reg_read *)&sp->pairs[i];
	out->sum = mine ? (__s32)(__u32)cell : 0;
	/* Masked, so a counter past 2^31 never reads as the flag. */
	out->hits = (hits & XAGG_REG_HITS_MASK) | (mine ? XAGG_REG_THIS_ITER : 0);
	if (mine && (cell & CELL_OVERFLOW))
		rc->overflow = 1;
	return 0;
}

/*
 * The PS reads a range of a completed iteration's hot sums: MSG_PULL for ranks [agg_index,
 * agg_index + count), count <= m so that the range touches each register array once (one pass).
 * The switch writes each rank's struct reg_read into the packet and sends it back; F_PENDING,
 * without values, while it holds no complete iteration seq. Reading changes nothing, so the PS
 * may ask again; the buffer is reused (and reads as zero) two iterations on.
 */
static __always_inline int handle_pull(struct xdp_md *ctx, struct counters *ctr, struct pkt *p)
{
	struct hdr *h = p->h;
	__u32 job_id = h->job_id;
	if (job_id == 0)
		goto malformed;
	struct job *j = bpf_map_lookup_elem(&jobs, &job_id);
	if (!j || j->ps_ip != p->ip->saddr || j->ps_port != p->udp->source || j->ps_ifindex != ctx->ingress_ifindex) {
		count(ctr, CNT_NOT_MEMBER);
		return XDP_DROP;
	}
	__u32 m = j->reg_arrays, base = j->reg_base;
	__u32 n = h->count, first = h->agg_index, iter = h->seq;
	__u32 size = m * reg_slots;
	if (m == 0 || m > XAGG_JOB_MAX_ARRAYS || base + m > reg_arrays || n > m || first >= size || n > size - first)
		goto malformed;
	struct sparse_job *sj = bpf_map_lookup_elem(&sparse_jobs, &job_id);
	if (!sj)
		goto malformed;
	bpf_spin_lock(&sj->lock);
	struct sparse_iter *it = &sj->it[iter & 1];
	int ready = it->state == SPARSE_COMPLETE && it->iter == iter;
	__u16 spilled = it->spilled;
	bpf_spin_unlock(&sj->lock);

	__u16 flags = F_FROM_SWITCH;
	if (ready) {
		__u32 zero = 0;
		struct sparse_pass *sp = bpf_map_lookup_elem(&sparse_pass, &zero);
		if (!sp)
			return XDP_ABORTED;
		struct read_ctx rc = {
			.first = first,
			.m = m,
			.key_base = (iter & 1) * reg_arrays + base,
			.tag = iter & CELL_TAG_MASK,
		};
		bpf_loop(n, read_one_rank, &rc, 0);
		if (rc.failed)
			return XDP_ABORTED;
		if (rc.overflow)
			flags |= F_OVERFLOW;
		__u64 len = (__u64)n * sizeof(struct reg_read);
		barrier_var(len);
		if (len == 0 || len > sizeof(sp->pairs))
			return XDP_ABORTED;
		if (bpf_xdp_store_bytes(ctx, OFF_PAIRS, sp->pairs, len))
			return XDP_ABORTED;
	} else {
		flags |= F_PENDING;
		count(ctr, CNT_PULL_PENDING);
	}
	struct cursor c = { .pos = (void *)(long)ctx->data, .end = (void *)(long)ctx->data_end };
	struct pkt q;
	if (parse(&c, &q) != PARSE_OK || !q.sh)
		return XDP_ABORTED;
	q.h->flags = flags;
	q.sh->spilled = spilled;
	reply_in_place(&q);
	count(ctr, CNT_PULL);
	return XDP_TX;

malformed:
	count(ctr, CNT_MALFORMED);
	return XDP_DROP;
}

#endif
