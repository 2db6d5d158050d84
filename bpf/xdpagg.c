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
 *   xdpagg_gc      never attached: the agent's slot garbage collector, run with BPF_PROG_TEST_RUN.
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

/* Runtime configuration, set by the loader through VariableSpec.Set before load. */
volatile const __u16 agg_port = XAGG_DEFAULT_PORT;  /* UDP port of xdpagg traffic, host order */
volatile const __u32 pool_size = 1;                 /* slots in `slots`; agg_index must be below */
volatile const __u64 slot_timeout_ns = 5000000000ULL; /* idle age after which any slot may be taken by anyone */
volatile const __u32 cache_results = 0; /* nonzero: copy every completed sum to `results` (agent's retransmit cache) */
volatile const __u64 port_rate_Bps = 0;     /* ports' capacity for the ECN phantom queue, bytes/s; 0: no marking */
volatile const __u64 ecn_threshold_bytes = 65536; /* phantom backlog above which DATA is marked F_ECN */
volatile const __u32 source_check = 1; /* nonzero: strict uRPF on every port (docs/security.md) */
volatile const __u64 ctl_interval_ns = 50000; /* control messages per port: one per interval on average (20,000/s) */
volatile const __u64 ctl_burst_ns = 100000000; /* ... and a burst of burst/interval messages (2,000) */

#ifndef XAGG_POOL_SIZE
#define XAGG_POOL_SIZE 4096 /* default max_entries of `slots`; the loader sets the real pool size */
#endif
#ifndef XAGG_MAX_PORTS
#define XAGG_MAX_PORTS 64
#endif
#ifndef XAGG_MAX_MEMBERS
#define XAGG_MAX_MEMBERS 4096
#endif
#ifndef XAGG_MAX_JOBS
#define XAGG_MAX_JOBS 1024
#endif
#ifndef XAGG_RESULTS_RING
#define XAGG_RESULTS_RING (8 << 20) /* bytes: about 2,400 results of 832 values */
#endif

/* Aggregator pool. Key: agg_index (u32, host order). Value: struct slot (host order, spin-locked). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, XAGG_POOL_SIZE);
	__type(key, __u32);
	__type(value, struct slot);
} slots SEC(".maps");

/* Switch ports that results are broadcast to. Key: ifindex (u32, host order). Value: devmap value
 * with xdpagg_egress as the per-port program. */
struct {
	__uint(type, BPF_MAP_TYPE_DEVMAP_HASH);
	__uint(max_entries, XAGG_MAX_PORTS);
	__type(key, __u32);
	__type(value, struct bpf_devmap_val);
} ports SEC(".maps");

/* Job members per port. Key: struct member_key (host order). Value: struct member (addresses in
 * network order). Written by the control plane. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XAGG_MAX_MEMBERS);
	__type(key, struct member_key);
	__type(value, struct member);
} members SEC(".maps");

/* Job contributors, for the ingress membership check. Key: struct worker_key (host order). Value:
 * struct worker (address and port in network order, ifindex host order). Written by the control
 * plane. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XAGG_MAX_MEMBERS);
	__type(key, struct worker_key);
	__type(value, struct worker);
} workers SEC(".maps");

/* Jobs. Key: job_id (u32, host order). Value: struct job (ps_ip network order). Written by the
 * control plane. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XAGG_MAX_JOBS);
	__type(key, __u32);
	__type(value, struct job);
} jobs SEC(".maps");

/* Job control keys, read by the agent and written by `xdpagg job add`; never read here. Key: job_id
 * (u32, host order). Value: struct job_key. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XAGG_MAX_JOBS);
	__type(key, __u32);
	__type(value, struct job_key);
} job_keys SEC(".maps");

/* Control-message rate budget per port (GCRA). Key: ingress ifindex (u32, host order). Value:
 * struct ctl_bucket (host order, spin-locked); made on a port's first control message. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XAGG_MAX_PORTS);
	__type(key, __u32);
	__type(value, struct ctl_bucket);
} ctl_budget SEC(".maps");

/* Completed in-switch sums for the agent's retransmit cache (when cache_results is set): records
 * of struct result_rec (header little-endian as on the wire). */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, XAGG_RESULTS_RING);
} results SEC(".maps");

/* Phantom queues for ECN marking. Key: ingress ifindex (u32, host order). Value: struct
 * port_queue (host order, spin-locked). Entries are made by the program on a port's first packet
 * when port_rate_Bps is set. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XAGG_MAX_PORTS);
	__type(key, __u32);
	__type(value, struct port_queue);
} port_queues SEC(".maps");

/* Verdict counters. Key: 0 (one entry). Value: struct counters per CPU, indexed by enum counter,
 * host order. One entry, looked up once per packet: a switch touches each register array once per
 * pass, and one lookup is cheaper than one per counter bump. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct counters);
} counters SEC(".maps");

/* One-entry per-CPU scratch for the partial last chunk of a fragment (zero-padded to a chunk). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct scratch);
} scratch_buf SEC(".maps");

/* Offsets of a linear xdpagg packet: IPv4 without options (xdpagg traffic with options is dropped). */
#define OFF_IP (sizeof(struct ethhdr))
#define OFF_UDP (OFF_IP + sizeof(struct iphdr))
#define OFF_HDR (OFF_UDP + sizeof(struct udphdr))
#define OFF_VALS (OFF_HDR + sizeof(struct hdr))

static __always_inline struct counters *counters_get(void)
{
	__u32 zero = 0;
	return bpf_map_lookup_elem(&counters, &zero);
}

static __always_inline void count(struct counters *c, __u32 id)
{
	if (c && id < CNT_MAX)
		c->cnt[id] += 1; /* per-CPU: no atomics needed */
}

/* Bounds-checked parsing cursor: every access goes through cursor_take. */
struct cursor {
	void *pos;
	void *end;
};

static __always_inline void *cursor_take(struct cursor *c, __u32 len)
{
	void *p = c->pos;
	if (p + len > c->end)
		return NULL;
	c->pos = p + len;
	return p;
}

/* Pointers into a parsed xdpagg packet. */
struct pkt {
	struct ethhdr *eth;
	struct iphdr *ip;
	struct udphdr *udp;
	struct hdr *h;
};

enum parse_result {
	PARSE_NOT_OURS = 0, /* not UDP/IPv4 to the aggregation port */
	PARSE_OK,
	PARSE_MALFORMED,
	PARSE_BAD_IP, /* to the aggregation port, but with IP options, as a fragment, or a bad IP checksum */
};

#define ETH_P_ARP 0x0806

/* ARP for IPv4 over Ethernet, as far as source validation reads it. */
struct arp4 {
	__be16 htype;
	__be16 ptype;
	__u8 hlen;
	__u8 plen;
	__be16 oper;
	__u8 sha[ETH_ALEN];
	__be32 spa; /* sender's IPv4 address */
} __attribute__((packed));

/* Strict unicast reverse-path forwarding (BCP 38, RFC 3704): a source address is valid at a port
 * only if the switch's own routing table sends traffic for that address out of the same port. The
 * routes of the switch's namespace are the registry of who is behind which port; the kernel's
 * FIB answers in one lookup, for every kind of traffic. Local, broadcast, unroutable and
 * otherwise-routed sources all fail. */
static __always_inline int source_ok(struct xdp_md *ctx, __be32 saddr)
{
	struct bpf_fib_lookup fib = {};
	fib.family = 2; /* AF_INET */
	fib.ipv4_dst = saddr;
	fib.ifindex = ctx->ingress_ifindex;
	long rc = bpf_fib_lookup(ctx, &fib, sizeof(fib), BPF_FIB_LOOKUP_SKIP_NEIGH);
	return rc == BPF_FIB_LKUP_RET_SUCCESS && fib.ifindex == ctx->ingress_ifindex;
}

/* Full IPv4 header checksum (20 bytes, no options) of what is in the packet now: 0 when valid. */
static __always_inline __u16 ip_csum_check(struct iphdr *ip)
{
	__u16 *w = (__u16 *)ip;
	__u32 sum = 0;
#pragma unroll
	for (int i = 0; i < (int)(sizeof(struct iphdr) / 2); i++)
		sum += w[i];
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return (__u16)~sum;
}

#define IP_MAX_OPTIONS 40 /* bytes of IPv4 options at most (ihl 15) */

/* Parse from the IPv4 header on (p->eth and p->ip already taken). */
static __always_inline int parse_l4(struct cursor *c, struct pkt *p)
{
	if (p->ip->version != 4 || p->ip->protocol != IPPROTO_UDP || p->ip->ihl < 5)
		return PARSE_NOT_OURS;
	if (p->ip->frag_off & bpf_htons(IP_OFFSET))
		return PARSE_NOT_OURS; /* a later fragment shows no port; its first fragment decides (below) */
	int first_frag = (p->ip->frag_off & bpf_htons(IP_MF)) != 0;
	if (p->ip->ihl != 5) {
		/* IP options: hosts never send them with xdpagg traffic. Look past them for the port. */
		__u32 optlen = ((__u32)p->ip->ihl * 4 - sizeof(struct iphdr)) & 0x3f;
		if (optlen > IP_MAX_OPTIONS || !cursor_take(c, optlen))
			return PARSE_NOT_OURS;
	}
	p->udp = cursor_take(c, sizeof(struct udphdr));
	if (!p->udp || (first_frag && bpf_ntohs(p->ip->tot_len) < (__u32)p->ip->ihl * 4 + sizeof(struct udphdr)))
		/* A first fragment too short to show its UDP ports (RFC 1858's tiny fragment) could
		 * be anyone's: drop it, so that no datagram to the port can be assembled behind us. */
		return first_frag ? PARSE_BAD_IP : PARSE_NOT_OURS;
	if (p->udp->dest != bpf_htons(agg_port))
		return PARSE_NOT_OURS;
	/* Ours from here: the kernel would reassemble fragments and honour options (source routes)
	 * behind the switch's checks, so neither is passed up. */
	if (first_frag || p->ip->ihl != 5 || ip_csum_check(p->ip) != 0)
		return PARSE_BAD_IP;
	p->h = cursor_take(c, sizeof(struct hdr));
	if (!p->h)
		return PARSE_MALFORMED;
	/* Lengths must agree with what arrived, to the byte: the IP total length covers the rest of
	 * the frame (an xdpagg frame is longer than Ethernet's 60-byte minimum, so it never carries
	 * link padding: trailing bytes are malformed), and the UDP length covers exactly header +
	 * count values. */
	__u16 udp_len = bpf_ntohs(p->udp->len);
	__u16 ip_len = bpf_ntohs(p->ip->tot_len);
	if (ip_len != sizeof(struct iphdr) + udp_len)
		return PARSE_MALFORMED;
	if ((void *)p->ip + ip_len != c->end)
		return PARSE_MALFORMED;
	if (p->h->version != XAGG_VERSION || p->h->reserved != 0)
		return PARSE_MALFORMED;
	if (p->h->type == MSG_DATA || p->h->type == MSG_RESULT) {
		__u16 n = p->h->count;
		if (n == 0 || n > XAGG_MAX_VALUES)
			return PARSE_MALFORMED;
		if (udp_len != sizeof(struct udphdr) + sizeof(struct hdr) + (__u32)n * 4)
			return PARSE_MALFORMED;
		/* ENC_SPARSE_KV is reserved: nothing sums it yet, so it is refused here, counted. */
		if (p->h->encoding > ENC_FLOAT32)
			return PARSE_MALFORMED;
		if (p->h->agg_index >= pool_size)
			return PARSE_MALFORMED;
	}
	return PARSE_OK;
}

static __always_inline int parse(struct cursor *c, struct pkt *p)
{
	p->eth = cursor_take(c, sizeof(struct ethhdr));
	if (!p->eth || p->eth->h_proto != bpf_htons(ETH_P_IP))
		return PARSE_NOT_OURS;
	p->ip = cursor_take(c, sizeof(struct iphdr));
	if (!p->ip)
		return PARSE_NOT_OURS;
	return parse_l4(c, p);
}

/* Serial-number comparison (RFC 1982): is a after b, with wrap-around. */
static __always_inline int seq_after(__u32 a, __u32 b)
{
	return (__s32)(a - b) > 0;
}

static __always_inline __u16 csum_fold(__u32 sum)
{
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return (__u16)~sum;
}

/* Full IPv4 header checksum (20 bytes, no options). */
static __always_inline void ip_csum(struct iphdr *ip)
{
	__u16 *w = (__u16 *)ip;
	__u32 sum = 0;
	ip->check = 0;
#pragma unroll
	for (int i = 0; i < (int)(sizeof(struct iphdr) / 2); i++)
		sum += w[i];
	ip->check = csum_fold(sum);
}

/* Turn the packet in hand into a RESULT header for `bitmap`, keeping count/job/seq/index. */
static __always_inline void make_result(struct hdr *h, __u32 bitmap, __u16 slot_flags, __u16 extra)
{
	h->type = MSG_RESULT;
	h->flags = (h->flags & (F_LEVEL1)) | (slot_flags & (F_ECN | F_OVERFLOW)) | extra;
	if (h->flags & F_LEVEL1)
		h->bitmap1 = bitmap;
	else
		h->bitmap0 = bitmap;
}

/* Hand a packet to the PS unaggregated: the kernel routes it (dst is the PS). The UDP checksum is
 * zeroed because we changed the header (and a veth sender may have left it partial). */
static __always_inline int to_ps(struct counters *ctr, struct pkt *p, __u16 add_flags)
{
	p->h->flags |= add_flags;
	p->udp->check = 0;
	count(ctr, CNT_TO_PS);
	return XDP_PASS;
}

static __always_inline int broadcast(struct counters *ctr)
{
	long r = bpf_redirect_map(&ports, 0, BPF_F_BROADCAST);
	if (r != XDP_REDIRECT)
		count(ctr, CNT_REDIRECT_ERR);
	return (int)r;
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

#ifndef READ_ONCE
#define READ_ONCE(x) (*(volatile typeof(x) *)&(x))
#endif

/* A slot of job_id was freed or taken by another job: one slot less held by job_id. */
static __always_inline void job_release_slot(__u32 job_id)
{
	struct job *o = bpf_map_lookup_elem(&jobs, &job_id);
	if (o)
		__sync_fetch_and_add(&o->held, -1);
}

/* The value passes over a fragment's full chunks, read and written in place in the (linear)
 * packet. The last partial chunk, if any, goes through the per-CPU scratch instead (zero-padded
 * to a whole chunk), because a direct access must be proven in bounds chunk by chunk.
 *
 * SWAR add: two int32 lanes per 64-bit word (BPF has no SIMD). The low 31 bits of both lanes are
 * added with the lanes' sign bits masked off, so no carry crosses a lane; the sign bits are then
 * put back by XOR. Signed overflow of a lane shows in the sign bit of (a ^ r) & (b ^ r); it is
 * OR-ed into a sticky word rather than saturated per lane: a fragment that overflowed anywhere is
 * not a valid sum whatever its lanes hold (F_OVERFLOW; workers repair it at the PS), so the
 * switch only has to notice, which halves the work per value.
 *
 * Separate static functions (verified in the caller's context; allowed under the spin lock):
 * alone, clang keeps their pointers in registers instead of spilling them on every lane. */
#define LANES_LOW31 0x7fffffff7fffffffULL
#define LANES_SIGN 0x8000000080000000ULL
#define CHUNK_WORDS (XAGG_CHUNK / 2)
#define CHUNK_BYTES (XAGG_CHUNK * 4)
#define MAX_CHUNKS (XAGG_MAX_VALUES / XAGG_CHUNK)

static __always_inline __u64 lane_add(__u64 a, __u64 b, __u64 *ovf)
{
	__u64 r = ((a & LANES_LOW31) + (b & LANES_LOW31)) ^ ((a ^ b) & LANES_SIGN);
	*ovf |= (a ^ r) & (b ^ r);
	return r;
}

/* slot += packet over the first nfull chunks; when out, packet = the new slot as well (the
 * completing contribution carries the sum out). Returns overflow bits (nonzero: overflowed). */
static __noinline __u64 add_packet(__u64 *sv, void *pv0, void *end, __u32 nfull, __u32 out)
{
	__u64 ovf = 0;
	for (__u32 c = 0; c < MAX_CHUNKS; c++) {
		if (c >= nfull)
			break;
		__u64 *pv = pv0 + c * CHUNK_BYTES;
		if ((void *)(pv + CHUNK_WORDS) > end)
			break; /* cannot happen: parse checked the lengths; proves the access */
		__u64 *s = sv + c * CHUNK_WORDS;
		if (out) {
			#pragma unroll
			for (__u32 j = 0; j < CHUNK_WORDS; j++) {
				__u64 r = lane_add(s[j], pv[j], &ovf);
				s[j] = r;
				pv[j] = r;
			}
		} else {
			#pragma unroll
			for (__u32 j = 0; j < CHUNK_WORDS; j++)
				s[j] = lane_add(s[j], pv[j], &ovf);
		}
	}
	return ovf & LANES_SIGN;
}

/* slot (the tail chunk) += scratch, and scratch = the new slot. Returns overflow bits. */
static __noinline __u64 add_tail(__u64 *sv, __u64 *tv)
{
	__u64 ovf = 0;
	#pragma unroll
	for (__u32 j = 0; j < CHUNK_WORDS; j++) {
		__u64 r = lane_add(sv[j], tv[j], &ovf);
		sv[j] = r;
		tv[j] = r;
	}
	return ovf & LANES_SIGN;
}

/* dst = src over the first nfull chunks, one of them in the packet (direction by to_packet). */
static __always_inline void copy_packet(__u64 *sv, void *pv0, void *end, __u32 nfull, int to_packet)
{
	for (__u32 c = 0; c < MAX_CHUNKS; c++) {
		if (c >= nfull)
			break;
		__u64 *pv = pv0 + c * CHUNK_BYTES;
		if ((void *)(pv + CHUNK_WORDS) > end)
			break;
		__u64 *s = sv + c * CHUNK_WORDS;
		if (to_packet) {
			#pragma unroll
			for (__u32 j = 0; j < CHUNK_WORDS; j++)
				pv[j] = s[j];
		} else {
			#pragma unroll
			for (__u32 j = 0; j < CHUNK_WORDS; j++)
				s[j] = pv[j];
		}
	}
}

/* Copy the result in the packet (header + n values) to the agent's retransmit cache. */
static __always_inline void cache_result(struct xdp_md *ctx, struct counters *ctr, __u32 n)
{
	struct result_rec *rec = bpf_ringbuf_reserve(&results, sizeof(*rec), 0);
	if (!rec) {
		count(ctr, CNT_CACHE_FULL);
		return;
	}
	__u64 len = sizeof(struct hdr) + (__u64)n * 4;
	asm volatile("" : "+r"(len));
	if (len < sizeof(struct hdr) + 4 || len > sizeof(*rec) ||
	    bpf_xdp_load_bytes(ctx, OFF_HDR, rec, len)) {
		bpf_ringbuf_discard(rec, 0);
		count(ctr, CNT_CACHE_FULL);
		return;
	}
	bpf_ringbuf_submit(rec, 0);
	count(ctr, CNT_CACHED);
}

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
	/* Membership and anti-spoofing: the sender must have joined the job as this worker id, from
	 * this address, port and switch port, and may only set its own contributor bit. Checked
	 * before anything reads or writes a slot, so no one outside a job can touch its slots. */
	struct worker_key wk = { .job_id = h->job_id, .worker_id = h->worker_id };
	struct worker *wm = bpf_map_lookup_elem(&workers, &wk);
	if (!wm || h->worker_id >= XAGG_MAX_WORKERS || bm != (1u << h->worker_id) ||
	    wm->ip != p->ip->saddr || wm->port != p->udp->source || wm->ifindex != ctx->ingress_ifindex) {
		count(ctr, CNT_NOT_MEMBER);
		return XDP_DROP;
	}
	/* The admitted job, for its slot quota. */
	__u32 job_key = h->job_id;
	struct job *j = bpf_map_lookup_elem(&jobs, &job_key);
	if (!j) {
		count(ctr, CNT_NOT_MEMBER);
		return XDP_DROP;
	}
	if (h->encoding != ENC_FIXED32 || (h->flags & F_COLLISION))
		return to_ps(ctr, p, 0); /* float repair traffic, or already diverted upstream */

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
	asm volatile("" : "+r"(tail_len));
	asm volatile("" : "+r"(nfull));
	if (nfull > MAX_CHUNKS || tail_len >= sizeof(sc->vals))
		goto malformed;
	if (tail_len) {
		__u64 *t = (__u64 *)sc->vals;
		for (__u32 j = 0; j < CHUNK_WORDS; j++)
			t[j] = 0;
		/* 64-bit, opaque to clang, and two separate checks: clang must neither drop the zero
		 * check (it knows tail_len != 0 here) nor merge both into one wrapping compare on a
		 * copy of the register, which the verifier cannot follow to the helper's argument. */
		__u64 len = tail_len;
		asm volatile("" : "+r"(len));
		if (len == 0)
			goto malformed;
		asm volatile("" : "+r"(len));
		if (len >= sizeof(sc->vals))
			goto malformed;
		if (bpf_xdp_load_bytes(ctx, tail_off, sc->vals, len))
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
	asm volatile("" : "+r"(tail_word)); /* check the register that indexes */
	if (tail_word > (XAGG_MAX_VALUES - XAGG_CHUNK) / 2)
		goto malformed;
	__u64 *stail = (__u64 *)s->vals + tail_word;

	__u64 now = bpf_ktime_get_ns();
	__u32 job = h->job_id, seq = h->seq;
	__u16 pkt_flags = h->flags & (F_ECN | F_OVERFLOW);
	int resend = h->flags & F_RESEND;
	int verdict;
	__u32 out_bitmap = 0;
	__u16 out_flags = 0;
	int reclaimed = 0;
	/* Slot quota: the job may reserve a slot it does not hold yet only while it holds fewer
	 * than max_slots. Read once before the lock (an atomic counter, changed after unlocking):
	 * CPUs racing past the check together can overshoot by at most one slot each. */
	int quota_ok = (__s32)READ_ONCE(j->held) < (__s32)j->max_slots;
	__s32 held_delta = 0;  /* change of this job's held slots */
	__u32 prev_owner = 0;  /* another job that lost a slot to this one (its held - 1) */

	/* Which value pass the locked section runs over the fragment's chunks. */
	enum { PASS_NONE, PASS_COPY, PASS_READ, PASS_ADD, PASS_ADD_OUT } run = PASS_NONE;

	bpf_spin_lock(&s->lock);
	int match = s->state != SLOT_FREE && s->job_id == job && s->seq == seq;
	if (!match) {
		int reusable = s->state == SLOT_FREE;
		int stale = now - s->ts_ns > slot_timeout_ns;
		if (s->state == SLOT_AGGREGATING && (stale || (s->job_id == job && seq_after(seq, s->seq)))) {
			/* Abandoned half-filled slot (a job that died, or whose other contributions all
			 * went to the PS): ATP's memory-leak fix. Its contributors still lack a result,
			 * so they resend, and resends go to the PS. The job's own later fragment takes
			 * it at once: a stale reservation (a delayed packet of a fragment the PS already
			 * completed) would otherwise push the job to the PS until the timeout. */
			reusable = reclaimed = 1;
		} else if (s->state == SLOT_COMPLETE) {
			/* A later fragment of the same job may retake its own completed slot: workers keep
			 * at most `window` fragments in flight over 2*window slots, so the sender of
			 * seq+2w has the result of seq+w, which every worker sent only after receiving
			 * the result of seq (SwitchML's shadow-copy argument, docs/design.md). */
			if (s->job_id == job && seq_after(seq, s->seq))
				reusable = 1;
			else if (stale)
				reusable = reclaimed = 1;
		}
		int owned = s->state != SLOT_FREE && s->job_id == job;
		if (resend) {
			verdict = V_TO_PS; /* never reserve for a resend: its partners may be at the PS */
		} else if (!reusable) {
			verdict = V_COLLISION;
		} else if (!owned && !quota_ok) {
			verdict = V_OVER_QUOTA;
		} else {
			if (!owned) {
				held_delta = 1;
				if (s->state != SLOT_FREE)
					prev_owner = s->job_id;
			}
			s->job_id = job;
			s->seq = seq;
			s->bitmap = bm;
			s->nvals = n;
			s->state = SLOT_AGGREGATING;
			s->counter = 1;
			s->fan_in = fan;
			s->scale_log2 = h->scale_log2;
			s->flags = pkt_flags;
			s->ts_ns = now;
			run = PASS_COPY; /* slot = packet */
			verdict = V_AGGREGATED;
		}
	} else if (s->state == SLOT_COMPLETE) {
		/* The sender missed the result (or resent early): answer it alone from the slot. */
		if (s->nvals != n) {
			verdict = V_MALFORMED;
		} else {
			run = PASS_READ; /* packet = slot */
			verdict = V_SHADOW;
		}
	} else if (s->nvals != n || s->fan_in != fan) {
		verdict = V_MALFORMED;
	} else if (resend) {
		/* ATP's partial flush: a resend means some contribution of this fragment is lost or
		 * went to the PS, so waiting here may never end. Merge the sender's bits if new, then
		 * send the slot's partial aggregate on to the PS (which completes the sum by bitmap)
		 * and free the slot; later resends find no slot and go to the PS too. */
		if ((bm & s->bitmap) == bm) {
			run = PASS_READ; /* already summed: the packet carries the slot's partial sum */
			verdict = V_FLUSH;
		} else if (bm & s->bitmap) {
			verdict = V_TO_PS;
		} else {
			s->bitmap |= bm;
			s->counter++;
			s->flags |= pkt_flags;
			run = PASS_ADD_OUT;
			verdict = V_FLUSH;
		}
		s->ts_ns = now;
	} else if ((bm & ~s->bitmap) == 0) {
		s->flags |= pkt_flags & F_ECN;
		verdict = V_DUPLICATE; /* every contributor already summed */
	} else if (bm & s->bitmap) {
		/* A partial aggregate overlapping the slot: adding it would count some contributors
		 * twice, dropping it would lose the others. The PS sorts it out by bitmap. */
		verdict = V_TO_PS;
	} else {
		s->bitmap |= bm;
		s->counter++;
		s->flags |= pkt_flags;
		s->ts_ns = now;
		verdict = V_AGGREGATED;
		/* Complete when every contributor is in: bits, not packets, since a packet may carry
		 * a partial aggregate of several workers. Known before adding, so only the completing
		 * contribution pays for writing the sum into its packet. */
		if ((__u32)__builtin_popcount(s->bitmap) >= s->fan_in)
			run = PASS_ADD_OUT; /* slot = packet = slot + packet */
		else
			run = PASS_ADD; /* slot += packet */
	}

	if (run != PASS_NONE) {
		/* Chunks of XAGG_CHUNK lanes, each a fixed-trip loop with a branch-free body (a switch
		 * pipeline stage does the same fixed work per pass). Only the outer loop exits early,
		 * once per chunk, which keeps the verifier's path count at MAX/CHUNK instead of one per
		 * value. One loop per pass kind keeps each body minimal: this is the hot path. */
		__u64 ovf = 0;
		if (run == PASS_COPY) {
			copy_packet((__u64 *)s->vals, pv, data_end, nfull, 0);
			if (tail_len) {
				__u64 *t = (__u64 *)sc->vals;
				for (__u32 j = 0; j < CHUNK_WORDS; j++)
					stail[j] = t[j];
			}
		} else if (run == PASS_READ) {
			copy_packet((__u64 *)s->vals, pv, data_end, nfull, 1);
			if (tail_len) {
				__u64 *t = (__u64 *)sc->vals;
				for (__u32 j = 0; j < CHUNK_WORDS; j++)
					t[j] = stail[j];
			}
		} else {
			ovf = add_packet((__u64 *)s->vals, pv, data_end, nfull, run == PASS_ADD_OUT);
			if (tail_len)
				ovf |= add_tail(stail, (__u64 *)sc->vals);
		}
		if (ovf)
			s->flags |= F_OVERFLOW;
		int full = (__u32)__builtin_popcount(s->bitmap) >= s->fan_in;
		if ((verdict == V_AGGREGATED || verdict == V_FLUSH) && full) {
			s->state = SLOT_COMPLETE; /* a resend that completes the sum completes it here */
			verdict = V_COMPLETED;
		} else if (verdict == V_FLUSH) {
			s->state = SLOT_FREE;
			held_delta = -1;
		}
		out_bitmap = s->bitmap;
		out_flags = s->flags;
	}
	bpf_spin_unlock(&s->lock);

	if (held_delta)
		__sync_fetch_and_add(&j->held, held_delta);
	if (prev_owner)
		job_release_slot(prev_owner);
	if (reclaimed && (verdict == V_AGGREGATED || verdict == V_COMPLETED))
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
	if (tail_len) {
		__u64 len = tail_len;
		asm volatile("" : "+r"(len));
		if (len == 0)
			return XDP_ABORTED;
		asm volatile("" : "+r"(len));
		if (len >= sizeof(sc->vals))
			return XDP_ABORTED;
		if (bpf_xdp_store_bytes(ctx, tail_off, sc->vals, len))
			return XDP_ABORTED;
	}
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
		__u8 mac[ETH_ALEN];
		__builtin_memcpy(mac, q.eth->h_dest, ETH_ALEN);
		__builtin_memcpy(q.eth->h_dest, q.eth->h_source, ETH_ALEN);
		__builtin_memcpy(q.eth->h_source, mac, ETH_ALEN);
		__be32 a = q.ip->saddr;
		q.ip->saddr = q.ip->daddr;
		q.ip->daddr = a;
		q.udp->dest = q.udp->source;
		q.udp->source = bpf_htons(agg_port);
		q.udp->check = 0;
		count(ctr, CNT_SHADOW_TX);
		return XDP_TX;
	}

	make_result(q.h, out_bitmap, out_flags, F_FROM_SWITCH);
	q.udp->check = 0; /* payload changed; egress zeroes it too, but a result must be valid anywhere */
	if (cache_results)
		cache_result(ctx, ctr, n);
	count(ctr, CNT_AGGREGATED);
	count(ctr, CNT_COMPLETED);
	if (out_flags & F_OVERFLOW)
		count(ctr, CNT_OVERFLOW);
	return broadcast(ctr);

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

/* The entry of a per-port map (keyed by ifindex) for this port, made from zero on first use. */
static __always_inline void *port_entry(void *map, __u32 ifindex, void *zero)
{
	void *v = bpf_map_lookup_elem(map, &ifindex);
	if (v)
		return v;
	bpf_map_update_elem(map, &ifindex, zero, BPF_NOEXIST);
	return bpf_map_lookup_elem(map, &ifindex);
}

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
			int registered = pr == PARSE_OK && (p.h->type == MSG_DATA || p.h->type == MSG_RESULT);
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
	case MSG_JOIN:
	case MSG_LEAVE:
	case MSG_ACK:
	case MSG_RETRANSMIT:
		if (!ctl_admit(ctx)) {
			count(ctr, CNT_CTL_LIMITED);
			return XDP_DROP;
		}
		count(ctr, CNT_CONTROL);
		return XDP_PASS; /* the agent's socket on the switch takes control messages */
	default:
		/* MSG_RESET and MSG_HEARTBEAT are reserved (no agent handles them yet), and any
		 * other type is unknown: both are malformed. */
		count(ctr, CNT_MALFORMED);
		return XDP_DROP;
	}
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

SEC("xdp")
int xdpagg_gc(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
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
struct result_rec *const volatile unused_result_rec;
struct cache_stats *const volatile unused_cache_stats;
struct ctl_auth *const volatile unused_ctl_auth;
struct gc_args *const volatile unused_gc_args;
