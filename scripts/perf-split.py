#!/usr/bin/env python3
"""Split a `perf record -a -g` of `xdpagg bench --profile N` into the packet path's stages.

usage: perf script -i perf.data -F comm,tid,period,ip,sym | scripts/perf-split.py N [comm]

N is the number of timed allreduces (ms per allreduce are printed); comm is the benchmark's
command name (default xdpagg). Only samples of that command and of ksoftirqd count as the
benchmark's: on a shared machine the packet path is charged to whichever task it interrupts, and
the samples of the switch's and hosts' XDP programs found in other tasks are reported apart.
Each sample is charged to the first stage (leaf to root) one of its frames matches.
"""
import collections
import re
import sys

STAGES = [
    ("quantise (Go)", r"hostlib\.quantizeTo|hostlib\.Quantize$"),
    ("dequantise + apply result (Go)", r"hostlib\.\(\*Worker\)\.applyResult|dequantizeFrom"),
    ("switch XDP program (xdpagg_switch)", r"bpf_prog_\w+_xdpagg_switch"),
    ("egress rewrite (xdpagg_egress)", r"bpf_prog_\w+_xdpagg_egress"),
    ("host XDP program (xdpagg_pass)", r"bpf_prog_\w+_xdpagg_pass"),
    ("broadcast: frame clones, devmap enqueue/flush", r"xdpf_clone|dev_map_enqueue_multi|dev_map_redirect_multi|"
     r"dev_map_bpf_prog_run|bq_xmit_all|bq_enqueue|__dev_flush|xdp_do_flush|dev_map_enqueue_clone"),
    ("GSO segmentation", r"skb_segment|__udp_gso_segment|udp4_ufo_fragment|__skb_gso_segment|udp_gso_segment"),
    ("veth XDP: skb to xdp (headroom copy), frame to skb, NAPI", r"veth_xdp_rcv_skb|skb_pp_cow_data|veth_xdp_rcv_one|"
     r"veth_convert_skb|__xdp_build_skb_from_frame|veth_xdp_rcv$|veth_poll|veth_xdp_xmit|veth_ndo_xdp_xmit"),
    ("UDP/IP receive and socket enqueue (softirq)", r"udp_rcv|__udp4_lib_rcv|udp_queue_rcv|__udp_enqueue_schedule_skb|"
     r"ip_rcv|ip_list_rcv|ip_local_deliver|__netif_receive_skb|netif_receive_skb|napi_gro|gro_"),
    ("socket receive (recvmmsg, copy to user)", r"__sys_recvmmsg|udp_recvmsg|do_recvmmsg"),
    ("socket send (sendmmsg: UDP/IP, checksum, veth xmit)", r"__sys_sendmmsg|udp_sendmsg|veth_xmit|ip_finish_output|"
     r"dev_hard_start_xmit"),
    ("other softirq", r"net_rx_action|handle_softirqs|__do_softirq"),
    ("Go worker loop (headers, bookkeeping)", r"hostlib\."),
    ("Go runtime, scheduler, futex, epoll, timers", r"^runtime\.|futex|schedule|epoll|nanosleep"),
]
HARNESS = re.compile(r"bench\.Profile")
XDP = re.compile(r"bpf_prog_\w+_xdpagg_|veth_xdp")


def main():
    n = float(sys.argv[1])
    comm_name = sys.argv[2] if len(sys.argv) > 2 else "xdpagg"
    stages = [(name, re.compile(rx)) for name, rx in STAGES]
    ours, elsewhere = collections.Counter(), collections.Counter()

    def charge(comm, frames, period):
        if not frames:
            return
        if comm != comm_name and not comm.startswith("ksoftirqd"):
            if any(XDP.search(f) for f in frames):
                elsewhere[comm] += period
            return
        if any(HARNESS.search(f) for f in frames):
            # Restoring the inputs between allreduces (AllReduce works in place): not timed.
            ours["bench: copying the inputs back (untimed)"] += period
            return
        for f in frames:
            for name, rx in stages:
                if rx.search(f):
                    ours[name] += period
                    return
        ours["other: " + frames[0]] += period

    comm, frames, period = None, [], 0
    for line in sys.stdin:
        if not line.strip():
            charge(comm, frames, period)
            frames = []
        elif not line[0].isspace():
            f = line.split()
            comm, period, frames = f[0], int(f[-1]) if f[-1].isdigit() else 0, []
        else:
            parts = line.split(None, 1)
            frames.append(parts[1].strip() if len(parts) > 1 else "?")
    charge(comm, frames, period)
    total = sum(ours.values())
    print("%-58s %8s %6s" % ("stage", "ms/op", "share"))
    for name, v in sorted(ours.items(), key=lambda kv: -kv[1]):
        if v / total >= 0.002:
            print("%-58s %8.2f %5.1f%%" % (name, v / 1e6 / n, 100 * v / total))
    print("%-58s %8.2f" % ("total (the benchmark and ksoftirqd)", total / 1e6 / n))
    for comm, v in elsewhere.most_common(5):
        print("  XDP path samples in other tasks (%s): %.2f ms/op" % (comm, v / 1e6 / n))


if __name__ == "__main__":
    main()
