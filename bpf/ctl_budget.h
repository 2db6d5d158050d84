/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Per-port control budgets: a GCRA bucket per switch port for the control messages passed to the
 * agent (docs/security.md).
 */
#ifndef __XDPAGG_CTL_BUDGET_H
#define __XDPAGG_CTL_BUDGET_H

/* Per-port budget for control messages (GCRA), so that one port's flood cannot fill the agent's
 * socket for the others: returns nonzero if this message is within its port's budget. */
static __always_inline int ctl_admit(struct xdp_md *ctx)
{
	struct ctl_bucket zero = {};
	struct ctl_bucket *b = port_entry(&ctl_budget, ctx->ingress_ifindex, &zero);
	if (!b)
		return 0;
	__u64 now = bpf_ktime_get_ns();
	int ok = 0;
	bpf_spin_lock(&b->lock);
	__u64 tat = b->tat > now ? b->tat : now;
	if (tat - now <= ctl_burst_ns) {
		b->tat = tat + ctl_interval_ns;
		ok = 1;
	} else {
		b->dropped++;
	}
	bpf_spin_unlock(&b->lock);
	return ok;
}

#endif
