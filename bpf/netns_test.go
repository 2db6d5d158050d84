package bpf_test

// A private network namespace with two switch ports, for the tests and benchmarks that need the
// switch's strict source validation (uRPF by bpf_fib_lookup) to see real ports and routes:
// BPF_PROG_TEST_RUN with an xdp_md context whose ingress_ifindex is one of the ports.

import (
	"errors"
	"net"
	"os"
	"runtime"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/internal/bpftest"
)

// xdpMd is struct xdp_md, the context BPF_PROG_TEST_RUN accepts for an XDP program: data and
// data_end are offsets into the frame (data_end must be its length, data_meta 0), ingress_ifindex
// names a device of the caller's network namespace (its rx queue rx_queue_index must exist), and
// egress_ifindex must be 0.
type xdpMd struct {
	Data, DataEnd, DataMeta, IngressIfindex, RxQueueIndex, EgressIfindex uint32
}

func ip4(s string) [4]byte {
	var a [4]byte
	copy(a[:], net.ParseIP(s).To4())
	return a
}

// portNS is a network namespace with switch ports a (10.77.1.1/24) and b (10.77.2.1/24), both
// up (dummy devices, or veths where the kernel has no dummy driver), and IPv4 forwarding on (bpf_fib_lookup answers "forwarding disabled" otherwise).
type portNS struct {
	ns, orig netns.NsHandle
	nl       *netlink.Handle
	a, b     netlink.Link
	kind     string // "dummy" or "veth": what the ports are
}

// newPortNS makes the namespace and moves the calling goroutine's thread into it for the rest of
// the test (the thread is locked; the namespace is left and closed in t.Cleanup). Subtests and
// sub-benchmarks run on other goroutines: they call enter first.
func newPortNS(tb testing.TB) *portNS {
	tb.Helper()
	// Handles of both namespaces, for subtests' goroutines to enter and leave (enter).
	orig, err := netns.Get()
	if err != nil {
		tb.Fatalf("get the thread's network namespace: %v", err)
	}
	tb.Cleanup(func() { orig.Close() })
	bpftest.InNewNetns(tb)
	ns, err := netns.Get()
	if err != nil {
		tb.Fatalf("get the new network namespace: %v", err)
	}
	tb.Cleanup(func() { ns.Close() })
	p := &portNS{ns: ns, orig: orig}
	p.nl, err = netlink.NewHandle() // a netlink socket of the new namespace
	if err != nil {
		tb.Fatalf("netlink handle: %v", err)
	}
	tb.Cleanup(p.nl.Close)
	p.a = p.port(tb, "xagg-a", "10.77.1.1/24")
	p.b = p.port(tb, "xagg-b", "10.77.2.1/24")
	p.setForwarding(tb, true)
	tb.Logf("switch ports: %s devices %s (ifindex %d) and %s (ifindex %d)", p.kind,
		p.a.Attrs().Name, p.a.Attrs().Index, p.b.Attrs().Name, p.b.Attrs().Index)
	return p
}

// port makes an up switch port with address cidr: a dummy device, or where the kernel has no
// dummy driver (RTM_NEWLINK answers EOPNOTSUPP) one end of a veth pair whose peer (name+"p") is up
// too, so that the port has a carrier.
func (p *portNS) port(tb testing.TB, name, cidr string) netlink.Link {
	tb.Helper()
	err := p.nl.LinkAdd(&netlink.Dummy{LinkAttrs: netlink.LinkAttrs{Name: name}})
	if errors.Is(err, unix.EOPNOTSUPP) {
		p.kind = "veth"
		err = p.nl.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name}, PeerName: name + "p"})
		if err == nil {
			var peer netlink.Link
			if peer, err = p.nl.LinkByName(name + "p"); err == nil {
				err = p.nl.LinkSetUp(peer)
			}
		}
	} else if p.kind == "" {
		p.kind = "dummy"
	}
	if err != nil {
		tb.Fatalf("add port %s: %v", name, err)
	}
	l, err := p.nl.LinkByName(name)
	if err != nil {
		tb.Fatalf("find %s: %v", name, err)
	}
	addr, err := netlink.ParseAddr(cidr)
	if err != nil {
		tb.Fatal(err)
	}
	if err := p.nl.AddrAdd(l, addr); err != nil {
		tb.Fatalf("address %s on %s: %v", cidr, name, err)
	}
	if err := p.nl.LinkSetUp(l); err != nil {
		tb.Fatalf("set %s up: %v", name, err)
	}
	return l
}

// enter moves the calling goroutine's thread into the namespace until the (sub)test ends.
func (p *portNS) enter(tb testing.TB) {
	tb.Helper()
	runtime.LockOSThread()
	if err := netns.Set(p.ns); err != nil {
		runtime.UnlockOSThread()
		tb.Fatalf("enter the test's network namespace: %v", err)
	}
	tb.Cleanup(func() {
		if err := netns.Set(p.orig); err != nil {
			tb.Errorf("return to the original network namespace: %v", err)
			return // still locked: the thread is discarded
		}
		runtime.UnlockOSThread()
	})
}

const ipForward = "/proc/sys/net/ipv4/ip_forward"

// setForwarding writes net.ipv4.ip_forward. /proc/sys/net resolves to the network namespace of
// the thread that opens the file, so this must (and does) run on the namespace's locked thread.
func (p *portNS) setForwarding(tb testing.TB, on bool) {
	tb.Helper()
	v := "0\n"
	if on {
		v = "1\n"
	}
	if err := os.WriteFile(ipForward, []byte(v), 0o644); err != nil {
		tb.Fatalf("write %s: %v", ipForward, err)
	}
	for _, f := range []string{ipForward, "/proc/sys/net/ipv4/conf/" + p.a.Attrs().Name + "/forwarding",
		"/proc/sys/net/ipv4/conf/" + p.b.Attrs().Name + "/forwarding"} {
		b, err := os.ReadFile(f)
		if err != nil || string(b) != v {
			tb.Fatalf("%s = %q (%v), want %q", f, b, err, v)
		}
	}
}

// readOutside reads a file from a thread of the original namespace (a fresh goroutine: the
// calling one is locked to the namespace's thread).
func readOutside(file string) (string, error) {
	type res struct {
		s   string
		err error
	}
	ch := make(chan res, 1)
	go func() {
		b, err := os.ReadFile(file)
		ch <- res{strings.TrimSpace(string(b)), err}
	}()
	r := <-ch
	return r.s, r.err
}

// runAt runs prog on frame in as if it arrived at switch port ifindex.
func runAt(tb testing.TB, prog *ebpf.Program, in []byte, ifindex int) (uint32, []byte) {
	tb.Helper()
	opts := &ebpf.RunOptions{
		Data:    in,
		DataOut: make([]byte, len(in)+512),
		Context: xdpMd{DataEnd: uint32(len(in)), IngressIfindex: uint32(ifindex)},
	}
	ret, err := prog.Run(opts)
	if errors.Is(err, ebpf.ErrNotSupported) {
		tb.Skipf("BPF_PROG_TEST_RUN with an xdp_md context: %v", err)
	}
	if err != nil {
		tb.Fatalf("BPF_PROG_TEST_RUN at ifindex %d: %v", ifindex, err)
	}
	return ret, opts.DataOut
}
