/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The slot state machine: slot_decide, a pure decision under the slot's lock (which
 * bpf/model_test.go mirrors step for step), slot_settle after the value pass, and the slot quota's
 * release.
 */
#ifndef __XDPAGG_SLOT_H
#define __XDPAGG_SLOT_H

/* Serial-number comparison (RFC 1982): is a after b, with wrap-around. */
static __always_inline int seq_after(__u32 a, __u32 b)
{
	return (__s32)(a - b) > 0;
}

/* What the locked section decided. */
enum data_verdict {
	V_AGGREGATED = 0, /* summed, waiting for more */
	V_COMPLETED,      /* summed and complete: packet (+ scratch tail) holds the sum */
	V_DUPLICATE,
	V_COLLISION,
	V_SHADOW,         /* slot already complete: packet (+ scratch tail) holds the sum for this one worker */
	V_TO_PS,          /* resend without a matching slot */
	V_MALFORMED,
	V_FLUSH,          /* resend on a half-filled slot: packet = its partial aggregate, to the PS; slot freed */
	V_OVER_QUOTA,     /* the slot could be reserved, but the job holds its quota of slots */
};

/* A slot of job_id was freed or taken by another job: one slot less held by job_id. */
static __always_inline void job_release_slot(__u32 job_id)
{
	struct job *o = bpf_map_lookup_elem(&jobs, &job_id);
	if (o)
		__sync_fetch_and_add(&o->held, -1);
}

/* Which value pass the locked section runs over the fragment's chunks. */
enum value_pass {
	PASS_NONE = 0,
	PASS_COPY,    /* slot = packet */
	PASS_READ,    /* packet = slot */
	PASS_ADD,     /* slot += packet */
	PASS_ADD_OUT, /* slot = packet = slot + packet */
};

/* One DATA contribution, as the slot state machine sees it. */
struct contrib {
	__u32 job, seq;
	__u32 bitmap;     /* the contributor bits it carries */
	__u16 nvals;
	__u8 fan_in;
	__u8 scale_log2;
	__u16 flags;      /* F_ECN | F_OVERFLOW of the packet */
	__u8 resend;      /* F_RESEND */
	__u8 quota_ok;    /* the job may reserve a slot it does not hold */
	__u8 need;        /* distinct contributors that complete the slot: the job's threshold H when
			   * 0 < H < fan_in (asynchronous aggregation), else fan_in */
	__u64 now;        /* bpf_ktime_get_ns() */
};

/* The contributors that complete a slot of fan-in `fan` for a job of threshold h (0: the fan-in). */
static __always_inline __u8 slot_need(__u8 fan, __u8 h)
{
	return h && h < fan ? h : fan;
}

/* What the state machine decided for a contribution. */
struct decision {
	int verdict;       /* enum data_verdict */
	int pass;          /* enum value_pass: what to do with the values, still under the lock */
	int reclaimed;     /* the slot was taken over (idle past the timeout, or the job's own older one) */
	__s32 held_delta;  /* change of the contributing job's held slots */
	__u32 prev_owner;  /* another job that lost the slot to this one (its held - 1) */
};

/* A contribution's bits and flags join the slot's (its values are added by the value pass). */
static __always_inline void slot_merge(struct slot *s, __u32 bm, __u16 flags)
{
	s->bitmap |= bm;
	s->counter++;
	s->flags |= flags;
}

/*
 * The slot state machine (docs/protocol.md, "Switch"): decides, and updates every field of the
 * slot but its values, for one contribution. Runs under the slot's lock; touches nothing else.
 * bpf/model_test.go mirrors it step for step.
 */
static __always_inline void slot_decide(struct slot *s, const struct contrib *c, struct decision *d)
{
	__u32 job = c->job, seq = c->seq, bm = c->bitmap;
	int match = s->state != SLOT_FREE && s->job_id == job && s->seq == seq;
	if (!match) {
		int reusable = s->state == SLOT_FREE;
		int stale = c->now - s->ts_ns > slot_timeout_ns;
		if (s->state == SLOT_AGGREGATING && (stale || (s->job_id == job && seq_after(seq, s->seq)))) {
			/* Abandoned half-filled slot (a job that died, or whose other contributions all
			 * went to the PS): ATP's memory-leak fix. Its contributors still lack a result,
			 * so they resend, and resends go to the PS. The job's own later fragment takes
			 * it at once: a stale reservation (a delayed packet of a fragment the PS already
			 * completed) would otherwise push the job to the PS until the timeout. */
			reusable = d->reclaimed = 1;
		} else if (s->state == SLOT_COMPLETE) {
			/* A later fragment of the same job may retake its own completed slot: workers keep
			 * at most `window` fragments in flight over 2*window slots, so the sender of
			 * seq+2w has the result of seq+w, which every worker sent only after receiving
			 * the result of seq (SwitchML's shadow-copy argument, docs/design.md). */
			if (s->job_id == job && seq_after(seq, s->seq))
				reusable = 1;
			else if (stale)
				reusable = d->reclaimed = 1;
		}
		int owned = s->state != SLOT_FREE && s->job_id == job;
		if (c->resend) {
			d->verdict = V_TO_PS; /* never reserve for a resend: its partners may be at the PS */
		} else if (!reusable) {
			d->verdict = V_COLLISION;
		} else if (!owned && !c->quota_ok) {
			d->verdict = V_OVER_QUOTA;
		} else {
			if (!owned) {
				d->held_delta = 1;
				if (s->state != SLOT_FREE)
					d->prev_owner = s->job_id;
			}
			s->job_id = job;
			s->seq = seq;
			s->bitmap = bm;
			s->nvals = c->nvals;
			s->state = SLOT_AGGREGATING;
			s->counter = 1;
			s->fan_in = c->fan_in;
			s->scale_log2 = c->scale_log2;
			s->flags = c->flags;
			s->ts_ns = c->now;
			d->pass = PASS_COPY;
			d->verdict = V_AGGREGATED;
		}
	} else if (s->state == SLOT_COMPLETE) {
		/* The sender missed the result (or resent early): answer it alone from the slot. */
		if (s->nvals != c->nvals) {
			d->verdict = V_MALFORMED;
		} else {
			d->pass = PASS_READ;
			d->verdict = V_SHADOW;
		}
	} else if (s->nvals != c->nvals || s->fan_in != c->fan_in) {
		d->verdict = V_MALFORMED;
	} else if (c->resend) {
		/* ATP's partial flush: a resend means some contribution of this fragment is lost or
		 * went to the PS, so waiting here may never end. Merge the sender's bits if new, then
		 * send the slot's partial aggregate on to the PS (which completes the sum by bitmap)
		 * and free the slot; later resends find no slot and go to the PS too. */
		if ((bm & s->bitmap) == bm) {
			d->pass = PASS_READ; /* already summed: the packet carries the slot's partial sum */
			d->verdict = V_FLUSH;
		} else if (bm & s->bitmap) {
			d->verdict = V_TO_PS;
		} else {
			slot_merge(s, bm, c->flags);
			d->pass = PASS_ADD_OUT;
			d->verdict = V_FLUSH;
		}
		s->ts_ns = c->now;
	} else if ((bm & ~s->bitmap) == 0) {
		s->flags |= c->flags & F_ECN;
		d->verdict = V_DUPLICATE; /* every contributor already summed */
	} else if (bm & s->bitmap) {
		/* A partial aggregate overlapping the slot: adding it would count some contributors
		 * twice, dropping it would lose the others. The PS sorts it out by bitmap. */
		d->verdict = V_TO_PS;
	} else {
		slot_merge(s, bm, c->flags);
		s->ts_ns = c->now;
		d->verdict = V_AGGREGATED;
		/* Complete when every contributor is in (or H of them, asynchronous): bits, not
		 * packets, since a packet may carry a partial aggregate of several workers. Known
		 * before adding, so only the completing contribution pays for writing the sum into
		 * its packet. Contributions after that find the slot complete and get its shadow
		 * copy, the sum without them. */
		if ((__u32)__builtin_popcount(s->bitmap) >= c->need)
			d->pass = PASS_ADD_OUT;
		else
			d->pass = PASS_ADD;
	}
}

/* After the value pass, still under the lock: a full slot (need contributors) completes (a resend that completes
 * the sum completes it here), a flushed one is freed. */
static __always_inline void slot_settle(struct slot *s, struct decision *d, __u32 need)
{
	int full = (__u32)__builtin_popcount(s->bitmap) >= need;
	if ((d->verdict == V_AGGREGATED || d->verdict == V_FLUSH) && full) {
		s->state = SLOT_COMPLETE;
		d->verdict = V_COMPLETED;
	} else if (d->verdict == V_FLUSH) {
		s->state = SLOT_FREE;
		d->held_delta = -1;
	}
}

#endif
