package topo

import (
	"errors"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf/link"

	"github.com/xdpagg/xdpagg/internal/bpftest"
)

// shaping is Topology.Shaping that fails the test on an error.
func shaping(t *testing.T, topo *Topology, h *Host) LinkShaping {
	t.Helper()
	s, err := topo.Shaping(h)
	if err != nil {
		t.Fatalf("Shaping %s: %v", h.Name, err)
	}
	return s
}

// Every host link of both kinds of topology the benchmark uses (kernel forwarding with default
// offloads, and XDP hosts) is shaped in both directions, and the traffic really passes the
// shapers: what a host sends through its egress class, what it receives (kernel-forwarded, or
// XDP_REDIRECTed past the switch port's qdisc) through its ifb's class. Counts, never timings.
func TestShapeLinks(t *testing.T) {
	const rate = 1_000_000_000
	for _, tc := range []struct {
		name string
		cfg  func(t *testing.T) Config
	}{
		{"kernel forwarding, default offloads", func(*testing.T) Config {
			return Config{Workers: 2, PS: true, KernelOffloads: true}
		}},
		{"XDP hosts", func(t *testing.T) Config { return Config{Workers: 2, PS: true, HostXDP: loadPass(t)} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := tc.cfg(t)
			topo := newTopo(t, cfg)
			for _, h := range topo.Hosts() {
				if s := shaping(t, topo, h); s.EgressRate != 0 || s.IngressRate != 0 || s.IngressRedirect {
					t.Errorf("%s before ShapeLinks: %+v, want no shaping", h.Name, s)
				}
			}
			if err := topo.ShapeLinks(rate); err != nil {
				t.Fatalf("ShapeLinks: %v", err)
			}
			for _, h := range topo.Hosts() {
				s := shaping(t, topo, h)
				if s.EgressRate != rate || s.IngressRate != rate || !s.IngressRedirect || s.Queue != shapeQueue {
					t.Errorf("%s: %+v, want %d bit/s both ways, ingress redirected, queue %d", h.Name, s, rate, shapeQueue)
				}
			}

			w0, w1, ps := topo.Workers[0], topo.Workers[1], topo.PS
			const port = 9530
			dst := netip.AddrPortFrom(w1.IP, port)
			ln := udpListen(t, topo, w1, port)
			before0, before1 := shaping(t, topo, w0), shaping(t, topo, w1)
			const n = 20
			for range n {
				deliver(t, topo, w0, ln, dst, "routed")
			}
			after0, after1 := shaping(t, topo, w0), shaping(t, topo, w1)
			if d := after0.EgressPackets - before0.EgressPackets; d < n {
				t.Errorf("w0's egress shaper sent %d packets for %d datagrams", d, n)
			}
			if d := after1.IngressPackets - before1.IngressPackets; d < n {
				t.Errorf("w1's ingress shaper passed %d packets for %d datagrams", d, n)
			}
			if cfg.HostXDP == nil {
				return
			}
			// The switch's XDP broadcast path: frames XDP_REDIRECTed into w1's port bypass
			// the port's qdisc, and still meet w1's ingress shaper.
			redirect := redirectTo(t, w1)
			err := topo.InSwitch(func() error {
				l, err := link.AttachXDP(link.XDPOptions{Program: redirect, Interface: ps.PortIndex, Flags: link.XDPDriverMode})
				if err != nil {
					return err
				}
				t.Cleanup(func() { l.Close() })
				return nil
			})
			bpftest.Check(t, "attach redirecting XDP program to "+ps.Port, err)
			before := shaping(t, topo, w1)
			for range n {
				deliver(t, topo, ps, ln, dst, "redirected")
			}
			if d := shaping(t, topo, w1).IngressPackets - before.IngressPackets; d < n {
				t.Errorf("w1's ingress shaper passed %d XDP-redirected packets for %d datagrams", d, n)
			}
		})
	}
}

func TestShapeLinksErrors(t *testing.T) {
	topo := newTopo(t, Config{Workers: 1})
	for _, rate := range []uint64{0, MinLinkRate - 1, MaxLinkRate + 1} {
		if err := topo.ShapeLinks(rate); !errors.Is(err, ErrShape) {
			t.Errorf("rate %d: %v, want ErrShape", rate, err)
		}
	}
	if s := shaping(t, topo, topo.Workers[0]); s.EgressRate != 0 || s.IngressRedirect {
		t.Errorf("a refused ShapeLinks shaped: %+v", s)
	}
}

// Rates up to MaxLinkRate reach the kernel whole: 10 Gbit/s fits tc's 32-bit byte rate, 100
// Gbit/s needs the 64-bit attribute.
func TestShapeLinksHighRates(t *testing.T) {
	for _, rate := range []uint64{10_000_000_000, MaxLinkRate} {
		topo := newTopo(t, Config{Workers: 1})
		if err := topo.ShapeLinks(rate); err != nil {
			t.Fatalf("ShapeLinks(%d): %v", rate, err)
		}
		if s := shaping(t, topo, topo.Workers[0]); s.EgressRate != rate || s.IngressRate != rate || !s.IngressRedirect {
			t.Errorf("%d bit/s: %+v", rate, s)
		}
	}
}

func TestShapeBurst(t *testing.T) {
	const hz = 1e9 // high-resolution timers (/proc/net/psched)
	for _, c := range []struct {
		rate uint64
		want uint32
	}{
		{200_000_000, 1600},     // tc's size (rate/hz + 1600 bytes), as before
		{1_000_000_000, 6250},   // 50 µs
		{10_000_000_000, 62500}, // 50 µs
		{MaxLinkRate, 625000},   // 50 µs
		{MinLinkRate, 1600},     // tc's size
	} {
		if got := shapeBurst(c.rate, hz); got != c.want {
			t.Errorf("shapeBurst(%d) = %d, want %d", c.rate, got, c.want)
		}
	}
}
