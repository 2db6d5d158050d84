package topo

import (
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
)

// routeDev returns the name of the interface h's kernel routes dst through.
func routeDev(t *testing.T, tp *Topology, h *Host, dst netip.Addr) string {
	t.Helper()
	var dev string
	err := tp.InHost(h, func() error {
		nlh, err := netlink.NewHandle()
		if err != nil {
			return err
		}
		defer nlh.Close()
		rs, err := nlh.RouteGet(dst.AsSlice())
		if err != nil || len(rs) == 0 {
			return err
		}
		l, err := nlh.LinkByIndex(rs[0].LinkIndex)
		if err != nil {
			return err
		}
		dev = l.Attrs().Name
		return nil
	})
	if err != nil {
		t.Fatalf("route get %v in %s: %v", dst, h.Name, err)
	}
	return dev
}

// TestStandby: a dual-homed topology reaches the PS through the primary; with the primary's
// ports down, every host's kernel routes through its second link and the standby forwards; the
// management namespace reaches both switches' management addresses; the existing names and
// addresses are the same on both switches.
func TestStandby(t *testing.T) {
	tp := newTopo(t, Config{Workers: 2, PS: true, Standby: true})
	if tp.StandbyNS == "" || tp.Mgmt == nil {
		t.Fatalf("standby %q, management %+v", tp.StandbyNS, tp.Mgmt)
	}
	for _, h := range tp.Hosts() {
		if h.Ifindex2 == 0 || h.PortIndex2 == 0 {
			t.Errorf("host %s: second link %d, standby port %d", h.Name, h.Ifindex2, h.PortIndex2)
		}
		if dev := routeDev(t, tp, h, tp.PS.IP); h != tp.PS && dev != HostIfname {
			t.Errorf("host %s routes to the PS via %s, want %s", h.Name, dev, HostIfname)
		}
	}
	// The standby's port p0 has the primary's address and MAC.
	var sbMAC net.HardwareAddr
	if err := tp.InStandby(func() error {
		l, err := net.InterfaceByName(tp.Workers[0].Port)
		if err == nil {
			sbMAC = l.HardwareAddr
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if sbMAC.String() != tp.Workers[0].PortMAC.String() {
		t.Errorf("standby port MAC %v, primary's %v", sbMAC, tp.Workers[0].PortMAC)
	}
	checkWorkersReachPS(t, tp, 7001)

	if err := tp.SetPortsUp(tp.SwitchNS, false); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	w := tp.Workers[0]
	for routeDev(t, tp, w, tp.PS.IP) != HostIfname2 {
		if time.Since(start) > 10*time.Second {
			t.Fatalf("%s still routes via %s 10s after the primary's ports went down", w.Name, HostIfname)
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Logf("route flipped to %s %v after the primary's ports went down", HostIfname2, time.Since(start).Round(time.Millisecond))
	checkWorkersReachPS(t, tp, 7002)

	// The management network: the controller's namespace reaches each switch's address.
	for _, l := range []MgmtLink{tp.Mgmt.Primary, tp.Mgmt.Standby} {
		ns := tp.SwitchNS
		if l == tp.Mgmt.Standby {
			ns = tp.StandbyNS
		}
		var conn *net.UDPConn
		if err := Do(ns, func() (err error) {
			conn, err = net.ListenUDP("udp4", &net.UDPAddr{IP: l.Switch.AsSlice(), Port: 7003})
			return err
		}); err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		var c *net.UDPConn
		if err := tp.InMgmt(func() (err error) {
			c, err = net.DialUDP("udp4", nil, &net.UDPAddr{IP: l.Switch.AsSlice(), Port: 7003})
			return err
		}); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Write([]byte("mgmt")); err != nil {
			t.Fatal(err)
		}
		c.Close()
		_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		buf := make([]byte, 16)
		n, from, err := conn.ReadFromUDPAddrPort(buf)
		if err != nil || string(buf[:n]) != "mgmt" || from.Addr().Unmap() != l.Local {
			t.Errorf("management link %s: %q from %v, %v", l.Ifname, buf[:n], from, err)
		}
	}
}
