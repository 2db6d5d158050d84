// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//go:build ignore

/*
 * xdpagg_host: the XDP program of a worker host's interface when the worker receives results
 * through AF_XDP (hostlib.WorkerConfig.AFXDP). It sorts, it never admits:
 *
 *   - a frame that is Ethernet + IPv4 (no options, not a fragment) + UDP to worker_ip:worker_port
 *     carrying an xdpagg header of version XAGG_VERSION, type MSG_RESULT and job job_id goes to
 *     the AF_XDP socket bound to the frame's receive queue (map xsks), so results never become
 *     skbs;
 *   - everything else, and a result arriving on a queue without a socket, is XDP_PASS: the
 *     kernel delivers it as before (the worker's control messages reach its UDP socket).
 *
 * The worker applies to what the socket gives it the same checks as to its UDP socket's datagrams
 * (source address and port, wire.ParsePacket, job, fragment): a frame forged to pass this filter
 * is refused there and counted. On a veth the program also does what xdpagg_pass does for the
 * switch's XDP_REDIRECTed frames: a veth accepts them only when its peer runs XDP.
 */
#include <linux/bpf.h>
#include <bpf_helpers.h>
#include <bpf_endian.h>

#include "../net.h"
#include "../xdpagg.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* Runtime configuration, set at load (host.Config). */
volatile const __be32 worker_ip = 0;   /* the worker's IPv4 address, network byte order */
volatile const __be16 worker_port = 0; /* the worker's UDP port, network byte order */
volatile const __u32 job_id = 0;       /* the worker's job (hdr.job_id, little-endian on the wire, host order here) */

/* Receive queues one program serves: a veth has one per CPU at most, and a worker binds one. */
#define HOST_MAX_QUEUES 64

/* Counter ids (index into host_counters). */
enum host_counter {
	HOST_CNT_XSK = 0,  /* results handed to bpf_redirect_map (to the socket, or passed if the queue has none) */
	HOST_CNT_PASS = 1, /* frames passed to the kernel: not a result of this worker's job */
	HOST_CNT_MAX = 2,
};

/* The worker's AF_XDP sockets. Key: receive queue index (host order). Value: the socket's fd,
 * written by the worker (the kernel keeps a reference to the socket, not the fd number). */
struct {
	__uint(type, BPF_MAP_TYPE_XSKMAP);
	__uint(max_entries, HOST_MAX_QUEUES);
	__type(key, __u32);
	__type(value, __u32);
} xsks SEC(".maps");

/* Verdict counters. Key: enum host_counter. Value: frames, per CPU, host order. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, HOST_CNT_MAX);
	__type(key, __u32);
	__type(value, __u64);
} host_counters SEC(".maps");

static __always_inline void host_count(__u32 id)
{
	__u64 *c = bpf_map_lookup_elem(&host_counters, &id);
	if (c)
		*c += 1;
}

/* The fixed prefix of a result frame: everything this program reads, in one bounds check. */
struct result_frame {
	struct ethhdr eth;
	struct iphdr ip;
	struct udphdr udp;
	struct hdr h;
} __attribute__((packed));

/* Keep enum host_counter in BTF, so bpf2go -type exports it to Go (host.Counter*). */
const volatile enum host_counter unused_host_counter;

SEC("xdp")
int xdpagg_host(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct result_frame *f = data;

	if ((void *)(f + 1) > data_end)
		goto pass;
	if (f->eth.h_proto != bpf_htons(ETH_P_IP) || f->ip.version != 4 || f->ip.ihl != 5 ||
	    f->ip.protocol != IPPROTO_UDP || (f->ip.frag_off & bpf_htons(IP_MF | IP_OFFSET)))
		goto pass;
	if (f->ip.daddr != worker_ip || f->udp.dest != worker_port)
		goto pass;
	if (f->h.version != XAGG_VERSION || f->h.type != MSG_RESULT || f->h.job_id != job_id)
		goto pass;
	host_count(HOST_CNT_XSK);
	/* No socket on this queue: XDP_PASS (the lower bits of flags are the default verdict). */
	return bpf_redirect_map(&xsks, ctx->rx_queue_index, XDP_PASS);
pass:
	host_count(HOST_CNT_PASS);
	return XDP_PASS;
}
