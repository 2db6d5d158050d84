/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The dense packet handlers of xdpagg_switch: a member's DATA (handle_data: checked, summed into
 * its slot under the slot's lock, then dropped, sent on or counted; a hot sparse DATA goes on to
 * handle_sparse) and the PS's RESULT (handle_result: frees the slot, broadcast to the job).
 */
#ifndef __XDPAGG_DENSE_HANDLERS_H
#define __XDPAGG_DENSE_HANDLERS_H

/* The admitted job whose member sent this DATA, or NULL. Membership and anti-spoofing: the sender
 * must have joined the job as this worker id, from this address, port and switch port, and may
 * only set its own contributor bit (bm). Checked before anything reads or writes a slot, so no one
 * outside a job can touch its slots. */
static __always_inline struct job *data_sender_job(struct xdp_md *ctx, struct pkt *p, __u32 bm)
{
	struct hdr *h = p->h;
	struct worker_key wk = { .job_id = h->job_id, .worker_id = h->worker_id };
	struct worker *wm = bpf_map_lookup_elem(&workers, &wk);
	if (!wm || h->worker_id >= XAGG_MAX_WORKERS || bm != (1u << h->worker_id) ||
	    wm->ip != p->ip->saddr || wm->port != p->udp->source || wm->ifindex != ctx->ingress_ifindex)
		return NULL;
	__u32 job_key = h->job_id;
	return bpf_map_lookup_elem(&jobs, &job_key);
}

/* The partial last chunk, tail_len bytes at off, from the packet into the scratch (store: back).
 * Nonzero on failure. The length is 64-bit, opaque to clang, and checked twice apart: clang must
 * neither drop the zero check (the caller knows tail_len != 0) nor merge both into one wrapping
 * compare on a copy of the register, which the verifier cannot follow to the helper's argument. */
static __always_inline long tail_xfer(struct xdp_md *ctx, __u32 off, struct scratch *sc, __u32 tail_len, int store)
{
	__u64 len = tail_len;
	barrier_var(len);
	if (len == 0)
		return -1;
	barrier_var(len);
	if (len >= sizeof(sc->vals))
		return -1;
	if (store)
		return bpf_xdp_store_bytes(ctx, off, sc->vals, len);
	return bpf_xdp_load_bytes(ctx, off, sc->vals, len);
}

/* The contribution of a member's DATA (bits bm of fan, n values), as the slot's state machine sees
 * it. Slot quota: the job may reserve a slot it does not hold yet only while it holds fewer than
 * max_slots; read once before the lock (an atomic counter, changed after unlocking), CPUs racing
 * past the check together can overshoot by at most one slot each. */
static __always_inline void data_contrib(struct contrib *in, struct hdr *h, struct job *j, __u32 bm, __u32 fan, __u32 n)
{
	*in = (struct contrib){
		.job = h->job_id,
		.seq = h->seq,
		.bitmap = bm,
		.nvals = n,
		.fan_in = fan,
		.scale_log2 = h->scale_log2,
		.flags = h->flags & (F_ECN | F_OVERFLOW),
		.resend = (h->flags & F_RESEND) != 0,
		.quota_ok = (__s32)READ_ONCE(j->held) < (__s32)j->max_slots,
		/* H as the job has it now (SetH changes it in place at any time): a slot completes
		 * at the threshold in force when its H-th contribution arrives. */
		.need = slot_need(fan, READ_ONCE(j->threshold)),
		.now = bpf_ktime_get_ns(),
	};
}

/* A decision that sends the fragment on (V_FLUSH, V_SHADOW, V_COMPLETED), once the packet holds
 * the values to send (its tail stored back): the slot's partial aggregate to the PS, the slot's
 * sum back to the sender alone, or the completed sum to the job's members. */
static __always_inline int data_send(struct xdp_md *ctx, struct counters *ctr, int verdict, __u32 out_bitmap, __u16 out_flags, __u32 n)
{
	/* store_bytes may move packet data: re-derive the header pointers with fresh checks. */
	struct cursor c = { .pos = (void *)(long)ctx->data, .end = (void *)(long)ctx->data_end };
	struct pkt q;
	if (parse(&c, &q) != PARSE_OK)
		return XDP_ABORTED;

	if (verdict == V_FLUSH) {
		/* The partial aggregate goes on to the PS as DATA with the slot's contributors. */
		if (q.h->flags & F_LEVEL1)
			q.h->bitmap1 = out_bitmap;
		else
			q.h->bitmap0 = out_bitmap;
		q.h->flags |= out_flags & (F_ECN | F_OVERFLOW);
		count(ctr, CNT_FLUSHED);
		return to_ps(ctr, &q, 0);
	}

	if (verdict == V_SHADOW) {
		/* Unicast back to the sender: swap L2/L3 endpoints; the IP checksum is unchanged by a swap. */
		make_result(q.h, out_bitmap, out_flags, F_FROM_SWITCH | F_SHADOW);
		reply_in_place(&q);
		count(ctr, CNT_SHADOW_TX);
		return XDP_TX;
	}

	make_result(q.h, out_bitmap, out_flags, F_FROM_SWITCH);
	q.udp->check = 0; /* payload changed; egress zeroes it too, but a result must be valid anywhere */
	if (cache_results)
		cache_result(ctx, ctr, sizeof(struct hdr) + (__u64)n * 4);
	count(ctr, CNT_AGGREGATED);
	count(ctr, CNT_COMPLETED);
	if (out_flags & F_OVERFLOW)
		count(ctr, CNT_OVERFLOW);
	return broadcast(ctr);
}

/* A member's DATA: checked, summed into its slot under the slot's lock, then dropped (summed),
 * sent on (to the PS, the sender, the job) or counted as what it is. */
static __always_inline int handle_data(struct xdp_md *ctx, struct counters *ctr, struct pkt *p)
{
	struct hdr *h = p->h;
	__u32 level1 = h->flags & F_LEVEL1;
	__u32 bm = level1 ? h->bitmap1 : h->bitmap0;
	__u32 fan = level1 ? h->fan_in1 : h->fan_in0;

	if (fan == 0 || fan > XAGG_MAX_WORKERS || bm == 0)
		goto malformed;
	if (fan < XAGG_MAX_WORKERS && (bm >> fan) != 0)
		goto malformed; /* contributor bits outside the job's fan-in */
	if (h->job_id == 0)
		goto malformed;
	struct job *j = data_sender_job(ctx, p, bm);
	if (!j) {
		count(ctr, CNT_NOT_MEMBER);
		return XDP_DROP;
	}
	if (h->encoding == ENC_SPARSE_KV)
		return handle_sparse(ctx, ctr, p, j);
	if (h->encoding != ENC_FIXED32 || (h->flags & F_COLLISION))
		return to_ps(ctr, p, 0); /* cold pairs, float repair traffic, or already diverted upstream */

	__u32 n = h->count;
	if (n == 0 || n > XAGG_MAX_VALUES)
		goto malformed;
	/* Full chunks are summed in place in the packet; the partial last chunk (ntail values) goes
	 * through the scratch, zero-padded so the slot's tail lanes stay zero. */
	__u32 nfull = n / XAGG_CHUNK;
	__u32 ntail = n % XAGG_CHUNK;
	__u32 zero = 0;
	struct scratch *sc = bpf_map_lookup_elem(&scratch_buf, &zero);
	if (!sc)
		return XDP_ABORTED;
	__u32 tail_off = OFF_VALS + nfull * CHUNK_BYTES;
	__u32 tail_len = ntail * 4;
	/* Keep clang from re-deriving these from the unchecked count: the verifier must see the
	 * bounds on the very registers used below. */
	barrier_var(tail_len);
	barrier_var(nfull);
	if (nfull > MAX_CHUNKS || tail_len >= sizeof(sc->vals))
		goto malformed;
	if (tail_len) {
		__u64 *t = (__u64 *)sc->vals;
		for (__u32 j = 0; j < CHUNK_WORDS; j++)
			t[j] = 0;
		if (tail_xfer(ctx, tail_off, sc, tail_len, 0))
			goto malformed;
	}
	/* Packet pointers after the helper call: re-derive them (load_bytes does not move data, but
	 * the verifier forgets packet ranges across helpers that may). */
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	void *pv = data + OFF_VALS;
	if (pv > data_end)
		goto malformed;

	__u32 idx = h->agg_index;
	struct slot *s = bpf_map_lookup_elem(&slots, &idx);
	if (!s)
		goto malformed;
	/* The slot lanes of the tail chunk. */
	__u64 tail_word = ntail ? nfull * CHUNK_WORDS : 0; /* nfull < MAX_CHUNKS when there is a tail */
	barrier_var(tail_word); /* check the register that indexes */
	if (tail_word > (XAGG_MAX_VALUES - XAGG_CHUNK) / 2)
		goto malformed;
	__u64 *stail = (__u64 *)s->vals + tail_word;

	struct contrib in;
	data_contrib(&in, h, j, bm, fan, n);
	struct decision d = {};
	__u32 out_bitmap = 0;
	__u16 out_flags = 0;

	bpf_spin_lock(&s->lock);
	slot_decide(s, &in, &d);
	if (d.pass != PASS_NONE) {
		if (value_pass(d.pass, s, stail, pv, data_end, nfull, tail_len, (__u64 *)sc->vals))
			s->flags |= F_OVERFLOW;
		slot_settle(s, &d, in.need);
		out_bitmap = s->bitmap;
		out_flags = s->flags;
	}
	bpf_spin_unlock(&s->lock);

	if (d.held_delta)
		__sync_fetch_and_add(&j->held, d.held_delta);
	if (d.prev_owner)
		job_release_slot(d.prev_owner);
	int verdict = d.verdict;
	if (d.reclaimed && (verdict == V_AGGREGATED || verdict == V_COMPLETED))
		count(ctr, CNT_RECLAIMED);

	switch (verdict) {
	case V_AGGREGATED:
		count(ctr, CNT_AGGREGATED);
		return XDP_DROP; /* consumed: its values live in the slot now */
	case V_DUPLICATE:
		count(ctr, CNT_DUPLICATE);
		return XDP_DROP;
	case V_COLLISION:
		count(ctr, CNT_COLLISION);
		return to_ps(ctr, p, F_COLLISION);
	case V_OVER_QUOTA:
		/* The job holds its share of the pool: its fragment is summed at the PS instead. Only
		 * this job slows down; the pool stays free for the others. */
		count(ctr, CNT_OVER_QUOTA);
		return to_ps(ctr, p, 0);
	case V_TO_PS:
		return to_ps(ctr, p, 0);
	case V_MALFORMED:
		goto malformed;
	case V_SHADOW:
	case V_COMPLETED:
	case V_FLUSH:
		break;
	}
	/* The full chunks already hold the sum; the tail comes from the scratch. A completing
	 * PASS_COPY (a partial aggregate that completes alone) already carries the sum. */
	if (tail_len && tail_xfer(ctx, tail_off, sc, tail_len, 1))
		return XDP_ABORTED;
	return data_send(ctx, ctr, verdict, out_bitmap, out_flags, n);

malformed:
	count(ctr, CNT_MALFORMED);
	return XDP_DROP;
}

/* A result from the PS: free a matching half-filled slot (its contributions reached the PS some
 * other way; ATP's deallocation by parameter packet) and broadcast to the job. */
static __always_inline int handle_result(struct xdp_md *ctx, struct counters *ctr, struct pkt *p)
{
	struct hdr *h = p->h;
	if (h->job_id == 0) {
		count(ctr, CNT_MALFORMED);
		return XDP_DROP;
	}
	/* Only the job's PS may answer for it: no one else can complete or free its slots in use, or
	 * feed its workers. (Any admitted job's PS result frees a slot idle past the timeout at its
	 * index, as ATP does; an idle slot is free for anyone anyway.) */
	__u32 job_id = h->job_id;
	struct job *j = bpf_map_lookup_elem(&jobs, &job_id);
	if (!j || j->ps_ip != p->ip->saddr || j->ps_port != p->udp->source || j->ps_ifindex != ctx->ingress_ifindex) {
		count(ctr, CNT_NOT_MEMBER);
		return XDP_DROP;
	}
	if (h->encoding == ENC_SPARSE_COLD || h->encoding == ENC_SPARSE_HOT) {
		/* A sparse update: no slot is involved. The switch CPU keeps a copy of it too, for
		 * the members that lose it (Libra's copy of the hot parameters' results). */
		if (cache_results)
			cache_result(ctx, ctr, bpf_ntohs(p->udp->len) - sizeof(struct udphdr));
		count(ctr, CNT_PS_RESULT);
		return broadcast(ctr);
	}
	__u32 idx = h->agg_index;
	struct slot *s = bpf_map_lookup_elem(&slots, &idx);
	if (s) {
		__u64 now = bpf_ktime_get_ns();
		int reclaimed = 0;
		__u32 owner = 0;
		bpf_spin_lock(&s->lock);
		if (s->state == SLOT_AGGREGATING && s->job_id == h->job_id && s->seq == h->seq) {
			s->state = SLOT_FREE;
			owner = s->job_id;
		} else if (s->state != SLOT_FREE && now - s->ts_ns > slot_timeout_ns) {
			/* ATP: any parameter packet frees a stale slot at its index, whoever owns it. */
			s->state = SLOT_FREE;
			owner = s->job_id;
			reclaimed = 1;
		}
		bpf_spin_unlock(&s->lock);
		if (owner == job_id)
			__sync_fetch_and_add(&j->held, -1);
		else if (owner)
			job_release_slot(owner);
		if (reclaimed)
			count(ctr, CNT_RECLAIMED);
	}
	count(ctr, CNT_PS_RESULT);
	return broadcast(ctr);
}

#endif
