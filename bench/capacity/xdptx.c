//go:build ignore
// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)

/*
 * Helper programs of the switch capacity benchmark (package bench/capacity). None of them is part
 * of the switch.
 *
 *   xdp_tx    the baseline: bounce every frame back out of the port it came in on (XDP_TX).
 *   xdp_gen   the traffic generator: rewrites the frame in hand into the next packet of a
 *             synthetic job (worker w's contribution to fragment f) and tail-calls the program
 *             under test (`next`[0]: xdpagg_switch or xdp_tx). BPF_PROG_RUN re-runs one frame;
 *             without this every repeat after the first would be a duplicate.
 *   xdp_sink  on the hosts' side of the veths: counts and drops what the switch transmits (the
 *             "wire"); a veth only delivers XDP_TX/XDP_REDIRECT frames when its peer runs XDP.
 */
#include <linux/bpf.h>
#include <bpf_helpers.h>

#include "../../bpf/net.h"
#include "../../bpf/xdpagg.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define OFF_HDR (sizeof(struct ethhdr) + sizeof(struct iphdr) + sizeof(struct udphdr))
#define OFF_VALS (OFF_HDR + sizeof(struct hdr))
/* Ethernet + IPv4 + UDP + xdpagg header: 74 bytes, rewritten from the template on every packet
 * (9 u64 words + 1 u16). */
#define TMPL_WORDS 9

_Static_assert(OFF_VALS == TMPL_WORDS * 8 + 2, "template copy must cover all headers");

/* Most values a generated frame may carry: more than any linear XDP frame holds, so that this
 * object need not follow the switch's XAGG_MAX_VALUES. */
#define GEN_MAX_VALUES 1024

/* Generator configuration, written by Go (XdptxGenCfg). */
struct gen_cfg {
	__u8 tmpl[80];     /* the first OFF_VALS bytes of a DATA frame of the job */
	__u32 workers;     /* contributors cycled through: worker ids 0..workers-1 */
	__u32 fan_in;      /* hdr.fan_in0 */
	__u32 window;      /* fragments each worker sends back to back, 1..slots */
	__u32 slots;       /* agg_index = fragment mod slots */
	__u32 seq_base;    /* seq of fragment 0 */
	__u32 nvals;       /* values per frame (hdr.count) */
	__u32 restore;     /* nonzero: restore vals in frames that came back as results (else all zero) */
	__s32 vals[GEN_MAX_VALUES]; /* values restored into frames the switch turned into results */
};

/* Generator position, per CPU (XdptxGenState in Go). Packet k of the sequence is worker
 * w's contribution to fragment frag_base + i: each worker sends `window` fragments in a row, then
 * the next worker; after the last worker the window moves on. */
struct gen_state {
	__u64 packets;  /* packets generated */
	__u64 restored; /* frames whose values had to be restored (they came back as results) */
	__u32 i;
	__u32 w;
	__u32 frag_base;
	__u32 slot_base; /* frag_base mod slots */
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct gen_cfg);
} gen_cfg SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct gen_state);
} gen_state SEC(".maps");

/* Program under test, behind the generator. */
struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} next SEC(".maps");

/* Frames received by xdp_sink, per CPU. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} sink_count SEC(".maps");

SEC("xdp")
int xdp_tx(struct xdp_md *ctx)
{
	return XDP_TX;
}

SEC("xdp")
int xdp_sink(struct xdp_md *ctx)
{
	__u32 zero = 0;
	__u64 *n = bpf_map_lookup_elem(&sink_count, &zero);
	if (n)
		*n += 1;
	return XDP_DROP;
}

SEC("xdp")
int xdp_gen(struct xdp_md *ctx)
{
	__u32 zero = 0;
	struct gen_cfg *cfg = bpf_map_lookup_elem(&gen_cfg, &zero);
	struct gen_state *st = bpf_map_lookup_elem(&gen_state, &zero);
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	if (!cfg || !st || data + OFF_VALS > end)
		return XDP_ABORTED;

	/* A frame the switch completed comes back (recycled page, or the same buffer without live
	 * frames) as a RESULT holding the sum: restore its values as well as its headers, unless the
	 * values are all zero (their sum is zero too). */
	struct hdr *h = data + OFF_HDR;
	int restore = cfg->restore && h->type != MSG_DATA;

	__u64 *dst = data;
	__u64 *src = (__u64 *)cfg->tmpl;
#pragma unroll
	for (int j = 0; j < TMPL_WORDS; j++)
		dst[j] = src[j];
	*(__u16 *)(data + TMPL_WORDS * 8) = *(__u16 *)(cfg->tmpl + TMPL_WORDS * 8);

	__u32 i = st->i, w = st->w;
	__u32 slot = st->slot_base + i;
	if (slot >= cfg->slots)
		slot -= cfg->slots;
	h->seq = cfg->seq_base + st->frag_base + i;
	h->agg_index = slot;
	h->bitmap0 = 1u << (w & 31);
	h->worker_id = w;
	h->fan_in0 = cfg->fan_in;

	/* Advance: next fragment of this worker's window, else the next worker, else the next window. */
	st->packets++;
	if (++i >= cfg->window) {
		i = 0;
		if (++w >= cfg->workers) {
			w = 0;
			st->frag_base += cfg->window;
			st->slot_base += cfg->window;
			if (st->slot_base >= cfg->slots)
				st->slot_base -= cfg->slots;
		}
	}
	st->i = i;
	st->w = w;

	if (restore) {
		/* Two separate checks, kept apart so that clang cannot fold them into one range check
		 * on a copy: the verifier must see both bounds on the register passed to the helper. */
		__u64 len = (__u64)cfg->nvals * 4; /* 64-bit: no zero-extending copies */
		asm volatile("" : "+r"(len));
		if (len > sizeof(cfg->vals))
			return XDP_ABORTED;
		asm volatile("" : "+r"(len));
		if (len == 0)
			return XDP_ABORTED;
		if (bpf_xdp_store_bytes(ctx, OFF_VALS, cfg->vals, len))
			return XDP_ABORTED;
		st->restored++;
	}

	bpf_tail_call(ctx, &next, 0);
	return XDP_ABORTED; /* empty program array */
}
