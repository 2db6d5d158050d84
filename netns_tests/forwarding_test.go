package netns_tests

import (
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/netns_tests/testbed"
)

// With the switch attached, everything that is not xdpagg traffic is routed like an ordinary L3
// switch: ARP resolves (we delete a static neighbour so it must), TCP and other UDP flow.
func TestNonAggregationTrafficIsForwarded(t *testing.T) {
	b := newBed(t, testbed.Options{Workers: 2})
	w0, w1 := b.Topo.Workers[0], b.Topo.Workers[1]
	before, _ := b.Counters()

	// Make w0 resolve its gateway with ARP through the switch port's XDP program.
	if err := b.Topo.InHost(w0, func() error {
		return netlink.NeighDel(&netlink.Neigh{LinkIndex: w0.Ifindex, IP: w0.Gateway.AsSlice()})
	}); err != nil {
		t.Fatalf("delete static neighbour: %v", err)
	}

	var ln net.Listener
	if err := b.Topo.InHost(w1, func() (err error) {
		ln, err = net.Listen("tcp4", netip.AddrPortFrom(w1.IP, 7000).String())
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	msg := []byte("hello through the switch")
	got := make(chan []byte, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			got <- nil
			return
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(10 * time.Second))
		buf, _ := io.ReadAll(c)
		got <- buf
	}()

	var conn net.Conn
	if err := b.Topo.InHost(w0, func() (err error) {
		conn, err = net.DialTimeout("tcp4", netip.AddrPortFrom(w1.IP, 7000).String(), 10*time.Second)
		return err
	}); err != nil {
		t.Fatalf("TCP through the switch: %v", err)
	}
	if _, err := conn.Write(msg); err != nil {
		t.Fatal(err)
	}
	conn.Close()
	select {
	case g := <-got:
		if string(g) != string(msg) {
			t.Fatalf("received %q, want %q", g, msg)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("nothing received")
	}

	// The gateway was learned dynamically, by ARP.
	if err := b.Topo.InHost(w0, func() error {
		neighs, err := netlink.NeighList(w0.Ifindex, netlink.FAMILY_V4)
		if err != nil {
			return err
		}
		for _, n := range neighs {
			if n.IP.Equal(w0.Gateway.AsSlice()) && n.State&netlink.NUD_PERMANENT == 0 && n.HardwareAddr.String() == w0.PortMAC.String() {
				return nil
			}
		}
		t.Errorf("gateway %v not learned by ARP: %+v", w0.Gateway, neighs)
		return nil
	}); err != nil {
		t.Fatal(err)
	}

	after, _ := b.Counters()
	d := after.Sub(before)
	if d[maps.CntNonAgg] == 0 || d[maps.CntRx] != 0 {
		t.Errorf("counters: non_agg %d (want > 0), rx %d (want 0)", d[maps.CntNonAgg], d[maps.CntRx])
	}
}
