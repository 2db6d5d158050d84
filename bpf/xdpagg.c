// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//go:build ignore

/*
 * xdpagg switch: in-network gradient aggregation as XDP programs.
 *
 *   xdpagg_switch  ingress on every switch port. Sums MSG_DATA fragments into aggregator slots,
 *                  broadcasts completed sums (and the PS's results) to the job's workers, sends
 *                  what it cannot sum on to the parameter server, and passes everything else to
 *                  the kernel, which routes it like an ordinary L3 switch. First it drops what no
 *                  host may send (docs/security.md): sources the port may not use (strict uRPF),
 *                  xdpagg traffic with IP options, fragments or a bad checksum, and control
 *                  messages over the port's budget.
 *   xdpagg_egress  devmap program run on each broadcast copy: rewrites addresses for the member of
 *                  the job behind that port, drops the copy where the job has no member.
 *   xdpagg_pass    XDP_PASS, for veth peers: a veth only accepts XDP_REDIRECT/XDP_TX frames when
 *                  its peer runs an XDP program.
 *   xdpagg_sparse  one pass of a hot (sparse) packet over the register arrays; entered by tail call
 *                  from xdpagg_switch and from itself (recirculation), never attached.
 *   xdpagg_gc      never attached: the agent's slot garbage collector, run with BPF_PROG_TEST_RUN;
 *                  also the agent's slot operations (SetH's threshold, FBcast's flush).
 *
 * Switch constraints we emulate (docs/design.md): every loop has a named constant bound; each
 * register map (slots, members, counters) is looked up at most once per packet pass; one
 * bpf_spin_lock guards all fields of a slot; the adder works in place in the packet, and only the
 * partial last chunk of values goes through a per-CPU scratch map.
 */
#include <linux/bpf.h>
#include <bpf_helpers.h>
#include <bpf_endian.h>

#include "net.h"
#include "xdpagg.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#include "maps.h"
#include "parse.h"
#include "slot.h"
#include "phantom.h"
#include "ctl_budget.h"
#include "adder.h"
#include "rewrite.h"
#include "gc.h"
#include "sparse.h"
#include "sparse_handlers.h"
#include "dense_handlers.h"

SEC("xdp")
int xdpagg_switch(struct xdp_md *ctx)
{
	struct counters *ctr = counters_get();
	struct cursor c = { .pos = (void *)(long)ctx->data, .end = (void *)(long)ctx->data_end };
	struct pkt p;

	p.eth = cursor_take(&c, sizeof(struct ethhdr));
	if (!p.eth) {
		count(ctr, CNT_NON_AGG);
		return XDP_PASS;
	}
	int pr = PARSE_NOT_OURS;
	if (p.eth->h_proto == bpf_htons(ETH_P_IP)) {
		p.ip = cursor_take(&c, sizeof(struct iphdr));
		if (p.ip) {
			pr = parse_l4(&c, &p);
			/* Source validation for every kind of IPv4 traffic: nothing a host sends with
			 * another host's address gets further (docs/security.md). Well-formed DATA and
			 * RESULTs are held to their exact registration instead, before they touch
			 * anything: a member's address, UDP port and switch port, or the job's PS's.
			 * That is stricter than the routes, and spares the hot path a FIB lookup. */
			int registered = pr == PARSE_OK && (p.h->type == MSG_DATA || p.h->type == MSG_RESULT || p.h->type == MSG_PULL);
			if (source_check && !registered && p.ip->version == 4 && !source_ok(ctx, p.ip->saddr)) {
				count(ctr, CNT_SPOOFED);
				return XDP_DROP;
			}
		}
	} else if (p.eth->h_proto == bpf_htons(ETH_P_ARP) && source_check) {
		/* ARP claims an IPv4 address too: a host may claim only its own (0.0.0.0 is a probe). */
		struct arp4 *arp = cursor_take(&c, sizeof(struct arp4));
		if (arp && arp->ptype == bpf_htons(ETH_P_IP) && arp->spa != 0 && !source_ok(ctx, arp->spa)) {
			count(ctr, CNT_SPOOFED);
			return XDP_DROP;
		}
	}
	if (pr == PARSE_NOT_OURS) {
		if (port_rate_Bps)
			port_congested(ctx, ctx->data_end - ctx->data, 0); /* cross traffic fills the link too */
		count(ctr, CNT_NON_AGG);
		return XDP_PASS;
	}
	count(ctr, CNT_RX);
	if (pr == PARSE_MALFORMED) {
		count(ctr, CNT_MALFORMED);
		return XDP_DROP;
	}
	if (pr == PARSE_BAD_IP) {
		count(ctr, CNT_IP_INVALID);
		return XDP_DROP;
	}
	switch (p.h->type) {
	case MSG_DATA:
		if (port_rate_Bps && port_congested(ctx, ctx->data_end - ctx->data, 1)) {
			/* ATP: congestion marks ride in the DATA to the slot (OR-ed) and on to the result
			 * (or via the PS), which every worker of the job sees: one signal per job. */
			p.h->flags |= F_ECN;
			count(ctr, CNT_ECN_MARKED);
		}
		return handle_data(ctx, ctr, &p);
	case MSG_RESULT:
		return handle_result(ctx, ctr, &p);
	case MSG_PULL:
		return handle_pull(ctx, ctr, &p);
	case MSG_JOIN:
	case MSG_LEAVE:
	case MSG_RESET:
	case MSG_HALT:
	case MSG_SETH:
	case MSG_FBCAST:
	case MSG_HEARTBEAT:
	case MSG_ACK:
	case MSG_RETRANSMIT:
	case MSG_HELP:
		if (!ctl_admit(ctx)) {
			count(ctr, CNT_CTL_LIMITED);
			return XDP_DROP;
		}
		count(ctr, CNT_CONTROL);
		return XDP_PASS; /* the agent's socket on the switch takes control messages */
	default:
		/* Any other type is unknown: malformed. */
		count(ctr, CNT_MALFORMED);
		return XDP_DROP;
	}
}

/* One pass of a hot packet over the register arrays, entered by tail call from xdpagg_switch
 * (the first pass) or from itself (each recirculation), at most XAGG_SPARSE_MAX_PASSES times. */
SEC("xdp")
int xdpagg_sparse(struct xdp_md *ctx)
{
	struct counters *ctr = counters_get();
	__u32 zero = 0;
	struct sparse_pass *sp = bpf_map_lookup_elem(&sparse_pass, &zero);
	if (!sp)
		return XDP_ABORTED;
	sparse_run_pass(sp, ctr);
	if (sp->left && sp->pass < XAGG_SPARSE_MAX_PASSES) {
		bpf_tail_call(ctx, &sparse_progs, 0);
		count(ctr, CNT_TAILCALL_ERR);
	}
	return sparse_finish(ctx, ctr, sp);
}

SEC("xdp/devmap")
int xdpagg_egress(struct xdp_md *ctx)
{
	struct counters *ctr = counters_get();
	struct cursor c = { .pos = (void *)(long)ctx->data, .end = (void *)(long)ctx->data_end };
	struct pkt p;
	if (parse(&c, &p) != PARSE_OK || p.h->type != MSG_RESULT)
		return XDP_PASS; /* only results are broadcast; anything else goes out untouched */

	struct member_key k = { .job_id = p.h->job_id, .ifindex = ctx->egress_ifindex };
	struct member *m = bpf_map_lookup_elem(&members, &k);
	if (!m) {
		count(ctr, CNT_EGRESS_SKIP);
		return XDP_DROP;
	}
	__builtin_memcpy(p.eth->h_dest, m->dst_mac, ETH_ALEN);
	__builtin_memcpy(p.eth->h_source, m->src_mac, ETH_ALEN);
	p.ip->saddr = m->src_ip;
	p.ip->daddr = m->dst_ip;
	p.ip->ttl = 64;
	ip_csum(p.ip);
	p.udp->source = bpf_htons(agg_port);
	p.udp->dest = m->dst_port;
	p.udp->check = 0;
	count(ctr, CNT_EGRESS_TX);
	return XDP_PASS;
}

SEC("xdp")
int xdpagg_pass(struct xdp_md *ctx)
{
	return XDP_PASS;
}

/*
 * Slot garbage collector, never attached: the agent runs it with BPF_PROG_TEST_RUN on a "packet"
 * that is a struct gc_args. It frees slots idle past the slot timeout (job_id 0: ATP's aggregator
 * garbage collection, so an idle pool drains) or every slot of one job (job_id != 0: `xdpagg job
 * rm`), each with one compare-and-free under the slot's own spin lock, so a packet that takes the
 * slot meanwhile is never undone. Freed slots are released from their owners' quota. The clock
 * is the datapath's own (bpf_ktime_get_ns), whatever clock the caller's namespace shows.
 */
SEC("xdp")
int xdpagg_gc(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	if (ctx->data_end - ctx->data == sizeof(struct slot_op)) {
		/* The agent's slot operations (SetH, FBcast). */
		struct slot_op *o = data;
		if ((void *)(o + 1) > data_end)
			return XDP_ABORTED;
		__u32 op = o->op, job_id = o->job_id, seq = o->seq, idx = o->agg_index, h = o->threshold;
		__u32 status = OPS_NONE;
		if (op == OP_SET_H)
			status = op_set_h(job_id, h);
		else if (op == OP_FLUSH)
			status = op_flush(o, data_end, job_id, seq, idx, bpf_ktime_get_ns());
		data = (void *)(long)ctx->data;
		data_end = (void *)(long)ctx->data_end;
		o = data;
		if ((void *)(o + 1) > data_end)
			return XDP_ABORTED;
		o->status = status;
		return XDP_PASS;
	}
	struct gc_args *a = data;
	if ((void *)(a + 1) > data_end)
		return XDP_ABORTED;
	__u32 first = a->first, count = a->count, job = a->job_id, freed = 0;
	__u64 now = bpf_ktime_get_ns();
	for (__u32 i = 0; i < XAGG_GC_BATCH; i++) {
		if (i >= count || first + i >= pool_size)
			break;
		freed += gc_slot(first + i, job, now) ? 1 : 0;
	}
	data = (void *)(long)ctx->data;
	data_end = (void *)(long)ctx->data_end;
	a = data;
	if ((void *)(a + 1) > data_end)
		return XDP_ABORTED;
	a->freed = freed;
	a->now_ns = now;
	return XDP_PASS;
}

/* Keep types that no code path names in BTF, so bpf2go -type can export them to Go. */
const volatile enum counter unused_counter;
const volatile enum msg_type unused_msg_type;
const volatile enum encoding unused_encoding;
const volatile enum flag unused_flag;
const volatile enum slot_state unused_slot_state;
const volatile enum limit unused_limit;
struct hdr *const volatile unused_hdr;
struct join_body *const volatile unused_join_body;
struct help_body *const volatile unused_help_body;
struct result_rec *const volatile unused_result_rec;
struct cache_stats *const volatile unused_cache_stats;
struct ctl_auth *const volatile unused_ctl_auth;
struct gc_args *const volatile unused_gc_args;
struct slot_op *const volatile unused_slot_op;
struct seth_body *const volatile unused_seth_body;
const volatile enum slot_op_kind unused_slot_op_kind;
const volatile enum slot_op_status unused_slot_op_status;
struct heartbeat_stats *const volatile unused_heartbeat_stats;
struct sparse_hdr *const volatile unused_sparse_hdr;
struct kv_pair *const volatile unused_kv_pair;
struct cold_pair *const volatile unused_cold_pair;
struct reg_read *const volatile unused_reg_read;
const volatile enum sparse_state unused_sparse_state;
