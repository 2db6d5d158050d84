/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Per-port phantom queues (ECN): each port's arrivals drain at the configured port rate, and DATA
 * that arrives over the backlog threshold is marked F_ECN (docs/design.md).
 */
#ifndef __XDPAGG_PHANTOM_H
#define __XDPAGG_PHANTOM_H

/* Account len bytes arriving at the port to its phantom queue, which drains at port_rate_Bps.
 * Returns nonzero when the backlog is over ecn_threshold_bytes: the link into this port carries
 * more than its capacity (whoever sends it: TCP counts too). Accounted: every frame passed to the
 * kernel and every xdpagg DATA packet, so the program sees nearly the port's whole arrival rate;
 * RESULTs, control messages and dropped frames are not. */
static __always_inline int port_congested(struct xdp_md *ctx, __u64 len, int data)
{
	struct port_queue zero = {};
	struct port_queue *q = port_entry(&port_queues, ctx->ingress_ifindex, &zero);
	if (!q)
		return 0;
	__u64 now = bpf_ktime_get_ns();
	int over;
	bpf_spin_lock(&q->lock);
	__u64 dt = now - q->last_ns;
	/* Drain: dt * rate / 1e9, without overflowing for long idle gaps (cap dt at 1 s). */
	if (dt > 1000000000ULL)
		dt = 1000000000ULL;
	__u64 drained = dt * (port_rate_Bps >> 10) / (1000000000ULL >> 10);
	q->vq_bytes = q->vq_bytes > drained ? q->vq_bytes - drained : 0;
	q->vq_bytes += len;
	q->last_ns = now;
	over = q->vq_bytes > ecn_threshold_bytes;
	if (over && data)
		q->marks++;
	bpf_spin_unlock(&q->lock);
	return over;
}

#endif
