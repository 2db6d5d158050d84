/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The few L2-L4 headers the switch parses, declared here so no kernel UAPI net headers are needed.
 * All fields in network byte order, as on the wire. */
#ifndef __XDPAGG_NET_H
#define __XDPAGG_NET_H

#include <linux/types.h>

#define ETH_ALEN 6
#define ETH_P_IP 0x0800
#define IPPROTO_UDP 17
#define IP_MF 0x2000
#define IP_OFFSET 0x1FFF

struct ethhdr {
	__u8 h_dest[ETH_ALEN];
	__u8 h_source[ETH_ALEN];
	__be16 h_proto;
} __attribute__((packed));

struct iphdr {
	__u8 ihl : 4, version : 4; /* little-endian bitfield order */
	__u8 tos;
	__be16 tot_len;
	__be16 id;
	__be16 frag_off;
	__u8 ttl;
	__u8 protocol;
	__sum16 check;
	__be32 saddr;
	__be32 daddr;
};

struct udphdr {
	__be16 source;
	__be16 dest;
	__be16 len;
	__sum16 check;
};

#endif
