/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The slot garbage collector's compare-and-free, and the agent's slot operations (SetH's
 * threshold, FBcast's flush): what xdpagg_gc runs, never on the packet path.
 */
#ifndef __XDPAGG_GC_H
#define __XDPAGG_GC_H

/* One slot of the garbage collector: 1 if it freed the slot. A global function, verified once on
 * its own rather than once per loop iteration. */
__noinline int gc_slot(__u32 idx, __u32 job, __u64 now)
{
	struct slot *s = bpf_map_lookup_elem(&slots, &idx);
	if (!s)
		return 0;
	__u32 owner = 0;
	bpf_spin_lock(&s->lock);
	if (s->state != SLOT_FREE && (job ? s->job_id == job : now - s->ts_ns > slot_timeout_ns)) {
		s->state = SLOT_FREE;
		owner = s->job_id;
	}
	bpf_spin_unlock(&s->lock);
	if (!owner)
		return 0;
	job_release_slot(owner);
	return 1;
}

/* OP_SET_H: the job's threshold, one byte stored in place (the datapath reads it with READ_ONCE;
 * rewriting the entry would lose `held`'s concurrent atomic adds). */
static __always_inline __u32 op_set_h(__u32 job_id, __u32 h)
{
	struct job *j = bpf_map_lookup_elem(&jobs, &job_id);
	if (!j || h > XAGG_MAX_WORKERS)
		return OPS_NONE;
	WRITE_ONCE(j->threshold, (__u8)h);
	return OPS_SET;
}

/* OP_FLUSH (FBcast): under the slot's lock, a slot aggregating <job, seq> becomes complete with
 * the contributions it holds (later ones get its shadow copy, as after a completion at H), and
 * its sum is copied out with its header; a slot already complete for <job, seq> is copied out as
 * it is. Anything else is left alone. */
static __always_inline __u32 op_flush(struct slot_op *o, void *end, __u32 job_id, __u32 seq, __u32 idx, __u64 now)
{
	struct slot *s = bpf_map_lookup_elem(&slots, &idx);
	if (!s)
		return OPS_NONE;
	__u32 status = OPS_NONE;
	bpf_spin_lock(&s->lock);
	if (s->state != SLOT_FREE && s->job_id == job_id && s->seq == seq) {
		status = s->state == SLOT_COMPLETE ? OPS_COMPLETE : OPS_FLUSHED;
		s->state = SLOT_COMPLETE;
		s->ts_ns = now;
		o->rec.h.version = XAGG_VERSION;
		o->rec.h.type = MSG_RESULT;
		o->rec.h.encoding = ENC_FIXED32;
		o->rec.h.scale_log2 = s->scale_log2;
		o->rec.h.flags = (s->flags & (F_ECN | F_OVERFLOW)) | F_FROM_SWITCH;
		o->rec.h.count = s->nvals;
		o->rec.h.job_id = job_id;
		o->rec.h.seq = seq;
		o->rec.h.agg_index = idx;
		o->rec.h.bitmap0 = s->bitmap;
		o->rec.h.bitmap1 = 0;
		o->rec.h.fan_in0 = s->fan_in;
		o->rec.h.fan_in1 = 0;
		o->rec.h.worker_id = 0;
		o->rec.h.reserved = 0;
		/* Every chunk (the tail past count is undefined, as in the results ring). */
		copy_packet((__u64 *)s->vals, o->rec.vals, end, MAX_CHUNKS, 1);
	}
	bpf_spin_unlock(&s->lock);
	return status;
}

#endif
