/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Rewriting packets on their way out: results, packets handed to the PS, broadcasts, the shadow
 * copy's unicast answer, the egress rewrite per member, and the copy to the retransmit cache.
 */
#ifndef __XDPAGG_REWRITE_H
#define __XDPAGG_REWRITE_H

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

/* Send the packet back where it came from: swap L2/L3 endpoints (the IP checksum is unchanged by
 * a swap) and answer from the aggregation port. */
static __always_inline void reply_in_place(struct pkt *q)
{
	__u8 mac[ETH_ALEN];
	__builtin_memcpy(mac, q->eth->h_dest, ETH_ALEN);
	__builtin_memcpy(q->eth->h_dest, q->eth->h_source, ETH_ALEN);
	__builtin_memcpy(q->eth->h_source, mac, ETH_ALEN);
	__be32 a = q->ip->saddr;
	q->ip->saddr = q->ip->daddr;
	q->ip->daddr = a;
	q->udp->dest = q->udp->source;
	q->udp->source = bpf_htons(agg_port);
	q->udp->check = 0;
}

static __always_inline int broadcast(struct counters *ctr)
{
	long r = bpf_redirect_map(&ports, 0, BPF_F_BROADCAST);
	if (r != XDP_REDIRECT)
		count(ctr, CNT_REDIRECT_ERR);
	return (int)r;
}

/* Copy the result in the packet (its xdpagg header and the len - sizeof(struct hdr) bytes after
 * it: a dense sum's values, or a sparse update's sparse header and sums or pairs) to the agent's
 * retransmit cache. */
static __always_inline void cache_result(struct xdp_md *ctx, struct counters *ctr, __u64 len)
{
	struct result_rec *rec = bpf_ringbuf_reserve(&results, sizeof(*rec), 0);
	if (!rec) {
		count(ctr, CNT_CACHE_FULL);
		return;
	}
	barrier_var(len);
	if (len < sizeof(struct hdr) + 4 || len > sizeof(*rec) ||
	    bpf_xdp_load_bytes(ctx, OFF_HDR, rec, len)) {
		bpf_ringbuf_discard(rec, 0);
		count(ctr, CNT_CACHE_FULL);
		return;
	}
	bpf_ringbuf_submit(rec, 0);
	count(ctr, CNT_CACHED);
}

#endif
