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
 *   xdp_copy  the honest ceiling of the switch: behind xdp_gen, it does what the aggregation mix
 *             does with the bytes and the copies, without aggregating. It loads every value of
 *             the packet and stores it back (the full chunks in place, the partial last chunk
 *             through a per-CPU scratch with bpf_xdp_load_bytes/store_bytes, as the switch's
 *             adder does), then drops the packet, except the last contributor of each fragment
 *             (worker_id == fan_in0 - 1, one in fan_in0 of the generator's packets, exactly the
 *             ones the switch completes), which it rewrites into a RESULT and broadcasts through
 *             the switch's own `ports` devmap, so xdpagg_egress rewrites every copy as it does
 *             for a real result. No parsing beyond fixed offsets, no slot, no lock, no state.
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

/* The switch's broadcast ports: at load time Go replaces this with the switch's own `ports` map
 * (same definition as bpf/maps.h: key ifindex, u32 host order; value struct bpf_devmap_val with
 * xdpagg_egress as the per-port program), so xdp_copy's copies take the switch's egress path. */
struct {
	__uint(type, BPF_MAP_TYPE_DEVMAP_HASH);
	__uint(max_entries, 64); /* bpf/maps.h XAGG_MAX_PORTS; Go sets the switch map's own before loading */
	__type(key, __u32);
	__type(value, struct bpf_devmap_val);
} ports SEC(".maps");

/* What xdp_copy did, per CPU (XdptxCopyStats in Go): the mix check compares it with the
 * generator's packets and the switch's egress counter. */
struct copy_stats {
	__u64 packets;    /* packets whose values were loaded and stored back */
	__u64 broadcasts; /* of them, rewritten into a RESULT and broadcast */
	__u64 fold;       /* XOR of every 64-bit word loaded: a use of the loads the compiler cannot drop */
	__u64 errors;     /* frames too short for their count, or a refused redirect */
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct copy_stats);
} copy_stats SEC(".maps");

/* The partial last chunk of values, as the switch's `scratch_buf` holds it, per CPU. */
struct copy_scratch {
	__u64 words[XAGG_CHUNK / 2];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct copy_scratch);
} copy_scratch SEC(".maps");

#define COPY_CHUNK_WORDS (XAGG_CHUNK / 2)
#define COPY_CHUNK_BYTES (XAGG_CHUNK * 4)
#define COPY_MAX_CHUNKS (XAGG_MAX_VALUES / XAGG_CHUNK)

/* Load every word of the first nfull chunks and store it back, the switch adder's access pattern
 * (one bounds check per chunk, a fixed-trip inner body). volatile makes each load and store
 * real; the fold uses the loads besides. */
static __noinline __u64 touch_chunks(void *pv0, void *end, __u32 nfull)
{
	__u64 fold = 0;
	for (__u32 c = 0; c < COPY_MAX_CHUNKS; c++) {
		if (c >= nfull)
			break;
		volatile __u64 *pv = pv0 + c * COPY_CHUNK_BYTES;
		if ((void *)(pv + COPY_CHUNK_WORDS) > end)
			break;
#pragma unroll
		for (__u32 j = 0; j < COPY_CHUNK_WORDS; j++) {
			__u64 v = pv[j];
			fold ^= v;
			pv[j] = v;
		}
	}
	return fold;
}

SEC("xdp")
int xdp_copy(struct xdp_md *ctx)
{
	__u32 zero = 0;
	struct copy_stats *st = bpf_map_lookup_elem(&copy_stats, &zero);
	struct copy_scratch *sc = bpf_map_lookup_elem(&copy_scratch, &zero);
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	if (!st || !sc)
		return XDP_ABORTED;
	if (data + OFF_VALS > end) {
		st->errors++;
		return XDP_DROP;
	}
	struct hdr *h = data + OFF_HDR;
	__u32 n = h->count;
	if (n == 0 || n > XAGG_MAX_VALUES || data + OFF_VALS + (__u64)n * 4 > end) {
		st->errors++;
		return XDP_DROP;
	}
	__u32 nfull = n / XAGG_CHUNK;
	__u32 ntail = n % XAGG_CHUNK;
	__u64 fold = touch_chunks(data + OFF_VALS, end, nfull);
	if (ntail) {
		/* Two separate checks on an opaque 64-bit length, as in the switch: the verifier must
		 * see both bounds on the register passed to the helpers. */
		__u64 len = (__u64)ntail * 4;
		__u64 off = OFF_VALS + (__u64)nfull * COPY_CHUNK_BYTES;
		asm volatile("" : "+r"(len));
		if (len == 0)
			return XDP_ABORTED;
		asm volatile("" : "+r"(len));
		if (len >= sizeof(sc->words))
			return XDP_ABORTED;
		if (bpf_xdp_load_bytes(ctx, off, sc->words, len))
			return XDP_ABORTED;
		volatile __u64 *t = sc->words;
#pragma unroll
		for (__u32 j = 0; j < COPY_CHUNK_WORDS; j++)
			fold ^= t[j];
		if (bpf_xdp_store_bytes(ctx, off, sc->words, len))
			return XDP_ABORTED;
	}
	st->fold ^= fold;
	st->packets++;

	/* store_bytes may move packet data: fresh pointers and checks. */
	data = (void *)(long)ctx->data;
	end = (void *)(long)ctx->data_end;
	if (data + OFF_VALS > end)
		return XDP_ABORTED;
	h = data + OFF_HDR;
	if ((__u32)h->worker_id + 1 != h->fan_in0)
		return XDP_DROP; /* consumed, as a contribution that does not complete */

	/* The completing contribution: rewritten into the result header and broadcast. */
	struct udphdr *udp = data + sizeof(struct ethhdr) + sizeof(struct iphdr);
	h->type = MSG_RESULT;
	h->flags |= F_FROM_SWITCH;
	h->bitmap0 = h->fan_in0 >= 32 ? 0xffffffffu : (1u << h->fan_in0) - 1;
	udp->check = 0;
	long r = bpf_redirect_map(&ports, 0, BPF_F_BROADCAST);
	if (r != XDP_REDIRECT) {
		st->errors++;
		return (int)r;
	}
	st->broadcasts++;
	return XDP_REDIRECT;
}

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
