package bpf_test

// Strict source validation (uRPF, docs/security.md): an IPv4 or ARP frame is dropped (spoofed)
// unless the switch's own routes send traffic for its source address out of the port it arrived
// at. Tested for real: a private network namespace with two dummy ports (netns_test.go), routes
// of its own, and BPF_PROG_TEST_RUN with an xdp_md context naming the ingress port.

import (
	"encoding/binary"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
)

// The namespace's job: workers nsWorkerIP(w):workerPort(w) behind port a, the PS nsPS:aggPort
// behind port b.
const nsJob = 7

var nsPS = ip4("10.77.2.2")

func nsWorkerIP(w uint8) [4]byte { return [4]byte{10, 77, 1, 10 + w} }

// nsData is worker w's DATA for <nsJob, seq> at slot idx, from its namespace address.
func nsData(seq, idx uint32, w, fan uint8, vals ...int32) frame {
	return dataFrame(nsJob, seq, idx, w, fan, vals...).with(func(f *frame) { f.SrcIP = nsWorkerIP(w); f.DstIP = nsPS })
}

// nsResult is the PS's RESULT for <nsJob, seq> at idx.
func nsResult(seq, idx uint32, fan uint8, vals ...int32) frame {
	return resultFrame(nsJob, seq, idx, fan, vals...).with(func(f *frame) { f.SrcIP = nsPS; f.DstIP = ip4("10.77.1.255") })
}

// udpFrom is a UDP datagram (not xdpagg: port 53) from src.
func udpFrom(src [4]byte) frame {
	return dataFrame(1, 1, 0, 0, 1, 1).with(func(f *frame) {
		f.SrcIP, f.DstIP, f.DstPort = src, ip4("10.77.2.2"), 53
		f.Payload = []byte("a query")
	})
}

// arpFrame is an ARP packet (op 1 request, 2 reply) for IPv4 over Ethernet.
func arpFrame(op uint16, spa, tpa [4]byte) frame {
	b := []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02, 0, 0, 0, 1, 5, 0x08, 0x06}
	b = binary.BigEndian.AppendUint16(b, 1)      // htype Ethernet
	b = binary.BigEndian.AppendUint16(b, 0x0800) // ptype IPv4
	b = append(b, 6, 4)
	b = binary.BigEndian.AppendUint16(b, op)
	b = append(b, 0x02, 0, 0, 0, 1, 5)
	b = append(b, spa[:]...)
	b = append(b, 0, 0, 0, 0, 0, 0)
	b = append(b, tpa[:]...)
	return frame{Raw: b}
}

// loadSwitch loads a switch with cfg and admits nsJob: workers behind port a, PS behind port b.
func (p *portNS) loadSwitch(t *testing.T, cfg loader.Config) *sw {
	t.Helper()
	sl, err := loader.Load(cfg)
	skipIfUnsupported(t, "load switch", err)
	t.Cleanup(func() { sl.Close() })
	s := &sw{Switch: sl}
	admit(t, sl.Maps, maps.Job{JobID: nsJob, PS: netip.AddrPortFrom(netip.AddrFrom4(nsPS), aggPort),
		PSIfindex: uint32(p.b.Attrs().Index), Workers: uint8(bpf.MaxWorkers), MaxSlots: sl.Maps.PoolSize()})
	for w := range uint8(bpf.MaxWorkers) {
		addr := netip.AddrPortFrom(netip.AddrFrom4(nsWorkerIP(w)), workerPort(w))
		if err := sl.Maps.PutWorker(nsJob, w, addr, uint32(p.a.Attrs().Index)); err != nil {
			t.Fatal(err)
		}
	}
	s.base = s.counters(t)
	return s
}

// uCase is one frame at one port of portNS.
type uCase struct {
	name    string
	port    byte // 'a' or 'b'
	in      frame
	verdict uint32
	delta   cnt
}

func (p *portNS) ifindex(port byte) int {
	if port == 'b' {
		return p.b.Attrs().Index
	}
	return p.a.Attrs().Index
}

func (p *portNS) runCases(t *testing.T, s *sw, cases []uCase) {
	t.Helper()
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p.enter(t)
			in := c.in.bytes()
			got, out := runAt(t, s.Objects.XdpaggSwitch, in, p.ifindex(c.port))
			if got != c.verdict {
				t.Errorf("at port %c: verdict %s, want %s", c.port, verdictName(got), verdictName(c.verdict))
			}
			if got == xdpPass && c.delta[maps.CntNonAgg]+c.delta[maps.CntControl] > 0 {
				expectUnchangedBut(t, out[:len(in)], in)
			}
			s.expectDelta(t, c.delta)
		})
	}
}

func TestSourceValidation(t *testing.T) {
	// Host namespace's forwarding setting, read before the namespace exists.
	hostFwd, err := readOutside(ipForward)
	if err != nil {
		t.Fatal(err)
	}
	p := newPortNS(t)

	// ip_forward is per namespace: writing it here leaves the host's alone.
	t.Run("net.ipv4.ip_forward is the namespace's own", func(t *testing.T) {
		p.enter(t)
		p.setForwarding(t, hostFwd != "1")
		if got, err := readOutside(ipForward); err != nil || got != hostFwd {
			t.Errorf("host ip_forward = %q (%v) after writing the namespace's; was %q", got, err, hostFwd)
		}
		p.setForwarding(t, true)
		if got, err := readOutside(ipForward); err != nil || got != hostFwd {
			t.Errorf("host ip_forward = %q (%v) after writing the namespace's; was %q", got, err, hostFwd)
		}
	})

	// Routes beyond the ports' subnets: hosts behind a router on port a, and one host of a's
	// subnet that lives behind port b (a more specific route wins).
	for _, r := range []*netlink.Route{
		{LinkIndex: p.a.Attrs().Index, Dst: mustCIDR("10.99.0.0/16"), Gw: net.ParseIP("10.77.1.2")},
		{LinkIndex: p.b.Attrs().Index, Dst: mustCIDR("10.77.1.200/32"), Scope: netlink.SCOPE_LINK},
	} {
		if err := p.nl.RouteAdd(r); err != nil {
			t.Fatalf("add route %v: %v", r, err)
		}
	}

	s := p.loadSwitch(t, loader.Config{PoolSize: poolSize, SlotTimeout: time.Hour})
	const (
		spoof = maps.CntSpoofed
		pass  = maps.CntNonAgg
	)
	sp := cnt{spoof: 1}
	ok := cnt{pass: 1}
	p.runCases(t, s, []uCase{
		// Plain traffic: every IPv4 source is checked.
		{"UDP from port a's subnet at a", 'a', udpFrom(ip4("10.77.1.5")), xdpPass, ok},
		{"UDP from port b's subnet at b", 'b', udpFrom(ip4("10.77.2.5")), xdpPass, ok},
		{"UDP from behind a router on a, at a", 'a', udpFrom(ip4("10.99.3.4")), xdpPass, ok},
		{"UDP from a host route's address at its port b", 'b', udpFrom(ip4("10.77.1.200")), xdpPass, ok},
		{"UDP from port b's subnet at a", 'a', udpFrom(ip4("10.77.2.5")), xdpDrop, sp},
		{"UDP from port a's subnet at b", 'b', udpFrom(ip4("10.77.1.5")), xdpDrop, sp},
		{"UDP from behind a's router, at b", 'b', udpFrom(ip4("10.99.3.4")), xdpDrop, sp},
		{"UDP from a host route's address at a (its subnet's port)", 'a', udpFrom(ip4("10.77.1.200")), xdpDrop, sp},
		{"UDP from the switch's own address on a, at a", 'a', udpFrom(ip4("10.77.1.1")), xdpDrop, sp},
		{"UDP from the switch's own address on b, at a", 'a', udpFrom(ip4("10.77.2.1")), xdpDrop, sp},
		{"UDP from the switch's own address on b, at b", 'b', udpFrom(ip4("10.77.2.1")), xdpDrop, sp},
		{"UDP from 127.0.0.1", 'a', udpFrom(ip4("127.0.0.1")), xdpDrop, sp},
		{"UDP from 0.0.0.0", 'a', udpFrom(ip4("0.0.0.0")), xdpDrop, sp},
		{"UDP from 255.255.255.255", 'a', udpFrom(ip4("255.255.255.255")), xdpDrop, sp},
		{"UDP from a's subnet broadcast 10.77.1.255", 'a', udpFrom(ip4("10.77.1.255")), xdpDrop, sp},
		{"UDP from a multicast address", 'a', udpFrom(ip4("224.0.0.1")), xdpDrop, sp},
		{"UDP from an unrouted address", 'a', udpFrom(ip4("192.0.2.1")), xdpDrop, sp},
		{"ICMP from b's subnet at a", 'a', udpFrom(ip4("10.77.2.5")).with(func(f *frame) { f.Proto = 1; f.Payload = []byte{8, 0, 0, 0} }), xdpDrop, sp},
		{"TCP from an unrouted address", 'a', udpFrom(ip4("192.0.2.1")).with(func(f *frame) { f.Proto = 6; f.Payload = make([]byte, 20) }), xdpDrop, sp},
		{"a later fragment from b's subnet at a", 'a', udpFrom(ip4("10.77.2.5")).with(func(f *frame) { f.FragOff = 0x00b9 }), xdpDrop, sp},
		{"a bad IPv4 checksum from b's subnet at a", 'a', udpFrom(ip4("10.77.2.5")).with(func(f *frame) { f.BadIPCsum = true }), xdpDrop, sp},
		// Not validated: no IPv4 source the switch can read.
		{"IP version 6 in an IPv4 ethertype, unrouted source", 'a', udpFrom(ip4("192.0.2.1")).with(func(f *frame) { f.IPVersion = 6 }), xdpPass, ok},
		{"IPv4 header cut short", 'a', udpFrom(ip4("192.0.2.1")).with(func(f *frame) { f.Truncate = offIP + 10 }), xdpPass, ok},
		{"IPv6 (not validated by the switch)", 'a', udpFrom(ip4("192.0.2.1")).with(func(f *frame) { f.EtherType = 0x86dd }), xdpPass, ok},

		// Well-formed DATA and RESULTs are held to their exact registration (member or PS
		// address, UDP port and switch port) instead of the routes: a wrong source is
		// not_member. Everything else is validated against the routes and counts alone (no rx).
		{"DATA of worker 0 at a", 'a', nsData(1, 0, 0, 2, 1, 2), xdpDrop, cnt{maps.CntRx: 1, maps.CntAggregated: 1}},
		{"DATA of worker 1 at b", 'b', nsData(1, 0, 1, 2, 3, 4), xdpDrop, cnt{maps.CntRx: 1, maps.CntNotMember: 1}},
		{"DATA of worker 1 with b's address, at b: valid source, not a member", 'b',
			nsData(1, 0, 1, 2, 3, 4).with(func(f *frame) { f.SrcIP = ip4("10.77.2.50") }), xdpDrop, cnt{maps.CntRx: 1, maps.CntNotMember: 1}},
		{"DATA with the PS's address at a", 'a', nsData(1, 0, 1, 2, 3, 4).with(func(f *frame) { f.SrcIP = nsPS }), xdpDrop, cnt{maps.CntRx: 1, maps.CntNotMember: 1}},
		{"DATA with IP options from an unrouted address", 'a', nsData(1, 0, 1, 2, 3, 4).with(func(f *frame) { f.SrcIP = ip4("192.0.2.1"); f.IHL = 6 }), xdpDrop, sp},
		{"RESULT of the PS at a", 'a', nsResult(1, 0, 2, 9, 9), xdpDrop, cnt{maps.CntRx: 1, maps.CntNotMember: 1}},
		{"malformed DATA with b's address at a", 'a', nsData(1, 0, 1, 2, 3, 4).with(func(f *frame) { f.SrcIP = ip4("10.77.2.5"); f.Pad = 4 }), xdpDrop, sp},
		{"RESULT from another host at b", 'b', nsResult(1, 0, 2, 9, 9).with(func(f *frame) { f.SrcIP = ip4("10.77.2.3") }), xdpDrop,
			cnt{maps.CntRx: 1, maps.CntNotMember: 1}},
		{"RESULT of the PS at b from another UDP port", 'b', nsResult(1, 0, 2, 9, 9).with(func(f *frame) { f.SrcPort = 7 }), xdpDrop,
			cnt{maps.CntRx: 1, maps.CntNotMember: 1}},
		{"RESULT of the PS at b", 'b', nsResult(1, 0, 2, 9, 9), xdpRedirect, cnt{maps.CntRx: 1, maps.CntPSResult: 1}},
		{"JOIN of worker 0 at a", 'a', controlFrame(uint8(bpf.XdpaggMsgTypeMSG_JOIN)).with(func(f *frame) { f.SrcIP = nsWorkerIP(0) }), xdpPass,
			cnt{maps.CntRx: 1, maps.CntControl: 1}},
		{"JOIN with b's address at a", 'a', controlFrame(uint8(bpf.XdpaggMsgTypeMSG_JOIN)).with(func(f *frame) { f.SrcIP = ip4("10.77.2.5") }), xdpDrop, sp},

		// ARP: a host may claim only an address its port may send from; 0.0.0.0 is a probe.
		{"ARP request from a's subnet at a", 'a', arpFrame(1, ip4("10.77.1.5"), ip4("10.77.1.1")), xdpPass, ok},
		{"ARP reply from a's subnet at a", 'a', arpFrame(2, ip4("10.77.1.5"), ip4("10.77.1.1")), xdpPass, ok},
		{"gratuitous ARP from a's subnet at a", 'a', arpFrame(1, ip4("10.77.1.5"), ip4("10.77.1.5")), xdpPass, ok},
		{"ARP probe (sender 0.0.0.0) at a", 'a', arpFrame(1, ip4("0.0.0.0"), ip4("10.77.1.5")), xdpPass, ok},
		{"ARP request with b's address at a", 'a', arpFrame(1, ip4("10.77.2.5"), ip4("10.77.1.1")), xdpDrop, sp},
		{"ARP reply claiming the switch's address at a", 'a', arpFrame(2, ip4("10.77.1.1"), ip4("10.77.1.5")), xdpDrop, sp},
		{"gratuitous ARP for the PS's address at a", 'a', arpFrame(1, nsPS, nsPS), xdpDrop, sp},
		{"ARP from an unrouted address", 'a', arpFrame(1, ip4("192.0.2.1"), ip4("10.77.1.1")), xdpDrop, sp},
		{"ARP from 255.255.255.255", 'a', arpFrame(1, ip4("255.255.255.255"), ip4("10.77.1.1")), xdpDrop, sp},
		{"ARP for another protocol (not IPv4) is not checked", 'a',
			frame{Raw: func() []byte {
				b := arpFrame(1, ip4("192.0.2.1"), ip4("10.77.1.1")).bytes()
				b[16] = 0x86
				b[17] = 0xdd
				return b
			}()}, xdpPass, ok},
		{"ARP cut before the sender address", 'a', frame{Raw: arpFrame(1, ip4("192.0.2.1"), ip4("10.77.1.1")).bytes()[:14+10]}, xdpPass, ok},
	})

	t.Run("source check off (loader.Config.NoSourceCheck)", func(t *testing.T) {
		p.enter(t)
		off := p.loadSwitch(t, loader.Config{PoolSize: poolSize, SlotTimeout: time.Hour, NoSourceCheck: true})
		p.runCases(t, off, []uCase{
			{"UDP from b's subnet at a", 'a', udpFrom(ip4("10.77.2.5")), xdpPass, ok},
			{"UDP from 0.0.0.0", 'a', udpFrom(ip4("0.0.0.0")), xdpPass, ok},
			{"ARP with b's address at a", 'a', arpFrame(1, ip4("10.77.2.5"), ip4("10.77.1.1")), xdpPass, ok},
			// The PS check's switch-port half, which uRPF otherwise makes redundant.
			{"RESULT of the PS at a: wrong switch port", 'a', nsResult(1, 0, 2, 9, 9), xdpDrop, cnt{maps.CntRx: 1, maps.CntNotMember: 1}},
			{"RESULT of the PS at b", 'b', nsResult(1, 0, 2, 9, 9), xdpRedirect, cnt{maps.CntRx: 1, maps.CntPSResult: 1}},
			{"DATA of worker 0 at b: wrong switch port", 'b', nsData(1, 0, 0, 2, 1, 2), xdpDrop, cnt{maps.CntRx: 1, maps.CntNotMember: 1}},
		})
	})

	// With forwarding off, bpf_fib_lookup answers BPF_FIB_LKUP_RET_FWD_DISABLED for every
	// source: the switch then drops all IPv4 and ARP (but ARP probes) as spoofed.
	t.Run("forwarding off: every source fails", func(t *testing.T) {
		p.enter(t)
		p.setForwarding(t, false)
		t.Cleanup(func() { p.setForwarding(t, true) })
		p.runCases(t, s, []uCase{
			{"UDP from a's subnet at a", 'a', udpFrom(ip4("10.77.1.5")), xdpDrop, sp},
			{"ARP request from a's subnet at a", 'a', arpFrame(1, ip4("10.77.1.5"), ip4("10.77.1.1")), xdpDrop, sp},
			{"ARP probe at a", 'a', arpFrame(1, ip4("0.0.0.0"), ip4("10.77.1.5")), xdpPass, ok},
		})
	})

	t.Run("a route added at run time is seen at once", func(t *testing.T) {
		p.enter(t)
		r := &netlink.Route{LinkIndex: p.b.Attrs().Index, Dst: mustCIDR("192.0.2.0/24"), Scope: netlink.SCOPE_LINK}
		if err := p.nl.RouteAdd(r); err != nil {
			t.Fatal(err)
		}
		p.runCases(t, s, []uCase{
			{"UDP from 192.0.2.1 at b", 'b', udpFrom(ip4("192.0.2.1")), xdpPass, ok},
			{"UDP from 192.0.2.1 at a", 'a', udpFrom(ip4("192.0.2.1")), xdpDrop, sp},
		})
		if err := p.nl.RouteDel(r); err != nil {
			t.Fatal(err)
		}
		p.runCases(t, s, []uCase{{"UDP from 192.0.2.1 at b, route gone", 'b', udpFrom(ip4("192.0.2.1")), xdpDrop, sp}})
	})

	t.Run("port down: its sources fail", func(t *testing.T) {
		p.enter(t)
		if err := p.nl.LinkSetDown(p.b); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if err := p.nl.LinkSetUp(p.b); err != nil {
				t.Error(err)
			}
		})
		p.runCases(t, s, []uCase{{"UDP from b's subnet at b", 'b', udpFrom(ip4("10.77.2.5")), xdpDrop, sp}})
	})

	// The control budget is per ingress port.
	t.Run("control budget per port", func(t *testing.T) {
		p.enter(t)
		cs := p.loadSwitch(t, loader.Config{PoolSize: poolSize, SlotTimeout: time.Hour, ControlRate: 1, ControlBurst: 2})
		joinA := controlFrame(uint8(bpf.XdpaggMsgTypeMSG_JOIN)).with(func(f *frame) { f.SrcIP = nsWorkerIP(0) })
		joinB := controlFrame(uint8(bpf.XdpaggMsgTypeMSG_JOIN)).with(func(f *frame) { f.SrcIP = ip4("10.77.2.5") })
		var cases []uCase
		for i := range 5 {
			v, d := uint32(xdpPass), cnt{maps.CntRx: 1, maps.CntControl: 1}
			if i >= 3 {
				v, d = xdpDrop, cnt{maps.CntRx: 1, maps.CntCtlLimited: 1}
			}
			cases = append(cases, uCase{"port a, JOIN " + string(rune('1'+i)), 'a', joinA, v, d})
		}
		for i := range 5 {
			v, d := uint32(xdpPass), cnt{maps.CntRx: 1, maps.CntControl: 1}
			if i >= 3 {
				v, d = xdpDrop, cnt{maps.CntRx: 1, maps.CntCtlLimited: 1}
			}
			cases = append(cases, uCase{"port b, JOIN " + string(rune('1'+i)), 'b', joinB, v, d})
		}
		// A spoofed control message costs its port nothing: it never reaches the budget.
		cases = append(cases, uCase{"spoofed JOIN at a", 'a', joinB, xdpDrop, sp})
		p.runCases(t, cs, cases)
	})
}

func mustCIDR(s string) *net.IPNet {
	_, n, err := net.ParseCIDR(s)
	if err != nil {
		panic(err)
	}
	return n
}
