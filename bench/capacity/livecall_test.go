package capacity

import (
	"errors"
	"fmt"
	"runtime"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/wire"
)

// BenchmarkLiveFramesCall is the cost of BPF_PROG_RUN in live-frame mode per call and per frame,
// by frames per call, with an XDP_DROP program attached to a veth of a namespace of its own and
// MTU-3388 frames: what a worker would pay to send its DATA packets into its veth as XDP frames
// (XDP_TX reaches the switch port's XDP with no skb, no GSO and no headroom copy) instead of
// through its UDP socket. docs/benchmarks.md (Fast path) has the figures: a fixed cost per call
// (the kernel sets up a page pool of the frame) that a windowed sender, sending a few packets
// per result batch, cannot spread.
func BenchmarkLiveFramesCall(b *testing.B) {
	runtime.LockOSThread() // never unlocked: the thread ends in the benchmark's namespace
	orig, err := netns.Get()
	if err != nil {
		b.Fatal(err)
	}
	ns, err := netns.New()
	if err != nil {
		b.Fatalf("new network namespace: %v", err)
	}
	defer func() { _ = netns.Set(orig); ns.Close() }()
	la := netlink.NewLinkAttrs()
	la.Name = "lf-a"
	if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: la, PeerName: "lf-b"}); err != nil {
		b.Fatal(err)
	}
	dev, err := netlink.LinkByName("lf-a")
	if err != nil {
		b.Fatal(err)
	}
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.XDP, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 1 /* XDP_DROP */), asm.Return()}})
	if errors.Is(err, ebpf.ErrNotSupported) {
		b.Skip(err)
	}
	if err != nil {
		b.Fatal(err)
	}
	defer prog.Close()
	// Attached, so that each run does not rewrite the XDP dispatcher (see attachDrivers).
	l, err := link.AttachXDP(link.XDPOptions{Program: prog, Interface: dev.Attrs().Index})
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	frame := make([]byte, 14+20+8+wire.MaxPacket) // Ethernet, IPv4, UDP, the largest xdpagg packet
	for _, frames := range []uint32{1, 4, 16, 64, 256} {
		b.Run(fmt.Sprintf("frames=%d", frames), func(b *testing.B) {
			opts := ebpf.RunOptions{Data: frame, Flags: unix.BPF_F_TEST_XDP_LIVE_FRAMES, Repeat: frames, BatchSize: 64,
				Context: xdpMd{DataEnd: uint32(len(frame)), IngressIfindex: uint32(dev.Attrs().Index)}}
			for b.Loop() {
				if _, err := prog.Run(&opts); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(frames), "ns/frame")
		})
	}
}
