/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Parsing: the bounds-checked cursor, the parsed packet, and the rules that decide what is an
 * xdpagg packet and whether it is well formed (docs/protocol.md), plus source validation.
 */
#ifndef __XDPAGG_PARSE_H
#define __XDPAGG_PARSE_H

/* Offsets of a linear xdpagg packet: IPv4 without options (xdpagg traffic with options is dropped). */
#define OFF_IP (sizeof(struct ethhdr))
#define OFF_UDP (OFF_IP + sizeof(struct iphdr))
#define OFF_HDR (OFF_UDP + sizeof(struct udphdr))
#define OFF_VALS (OFF_HDR + sizeof(struct hdr))

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
	struct sparse_hdr *sh; /* sparse encodings and MSG_PULL only */
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
	p->sh = NULL;
	if (p->h->version != XAGG_VERSION || p->h->reserved != 0)
		return PARSE_MALFORMED;
	__u8 type = p->h->type;
	if (type != MSG_DATA && type != MSG_RESULT && type != MSG_PULL)
		return PARSE_OK;
	__u16 n = p->h->count;
	__u8 enc = p->h->encoding;
	if (enc <= ENC_FLOAT32 && type != MSG_PULL) {
		/* Dense: 1..XAGG_MAX_VALUES 4-byte values for slot agg_index. */
		if (n == 0 || n > XAGG_MAX_VALUES)
			return PARSE_MALFORMED;
		if (udp_len != sizeof(struct udphdr) + sizeof(struct hdr) + (__u32)n * 4)
			return PARSE_MALFORMED;
		if (p->h->agg_index >= pool_size)
			return PARSE_MALFORMED;
		return PARSE_OK;
	}
	/* Sparse: a sparse header, then pairs. Hot pairs travel in DATA (workers) and MSG_PULL (the
	 * PS's read-out), cold pairs in DATA (to the PS) and RESULTs (the PS's update), hot sums by
	 * rank in RESULTs. */
	__u32 psize, pmax;
	if (enc == ENC_SPARSE_KV && type != MSG_RESULT) {
		psize = sizeof(struct kv_pair);
		pmax = XAGG_SPARSE_MAX_PAIRS;
	} else if (enc == ENC_SPARSE_COLD && type != MSG_PULL) {
		psize = sizeof(struct cold_pair);
		pmax = XAGG_COLD_MAX_PAIRS;
	} else if (enc == ENC_SPARSE_HOT && type == MSG_RESULT) {
		psize = 4;
		pmax = XAGG_HOT_MAX_VALUES;
	} else {
		return PARSE_MALFORMED;
	}
	if (n > pmax || (type == MSG_PULL && n == 0))
		return PARSE_MALFORMED;
	if (udp_len != sizeof(struct udphdr) + sizeof(struct hdr) + sizeof(struct sparse_hdr) + (__u32)n * psize)
		return PARSE_MALFORMED;
	p->sh = cursor_take(c, sizeof(struct sparse_hdr));
	if (!p->sh)
		return PARSE_MALFORMED;
	if (type == MSG_PULL) {
		if (p->sh->npkts != 0)
			return PARSE_MALFORMED;
	} else if (p->sh->npkts == 0 || p->h->agg_index >= p->sh->npkts) {
		return PARSE_MALFORMED;
	}
	/* Hot pairs: one aggregation level, and at most XAGG_SPARSE_MAX_PKTS packets per worker and
	 * iteration (the switch's dedup record has a bit for each). */
	if (type == MSG_DATA && enc == ENC_SPARSE_KV &&
	    ((p->h->flags & F_LEVEL1) || p->sh->npkts > XAGG_SPARSE_MAX_PKTS))
		return PARSE_MALFORMED;
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

#endif
