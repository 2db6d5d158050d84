package topo

import (
	"fmt"
	"net"
	"net/netip"

	"github.com/vishvananda/netlink"
)

// The standby switch and the management network (Config.Standby):
//
//	host ns Prefix-w0  eth0 ─── p0 switch ns Prefix-sw  mgmt 10.201.1.1 ─── m0 10.201.1.2 ┐
//	                   eth1 ─── p0 switch ns Prefix-sb  mgmt 10.201.2.1 ─── m1 10.201.2.2 ┴ mgmt ns Prefix-mg
//
// The standby's ports have the primary's names, addresses and MACs (it takes over the primary's
// addresses, like a VRRP virtual gateway) and each host's two links share its address and MAC,
// so a worker's membership (address, MAC, port name) means the same on either switch. Hosts
// route via eth0 at MetricPrimary and via eth1 at MetricStandby with
// ignore_routes_with_linkdown=1: when the primary's port goes down the host's eth0 loses carrier
// and the kernel skips its routes (no bonding driver on the test kernel, no host software).

// Mgmt is the management network: the controller's namespace with one link to each switch.
type Mgmt struct {
	NS      string   // Prefix+"-mg"
	Primary MgmtLink // to the switch namespace
	Standby MgmtLink // to the standby namespace (zero without Config.Standby)
}

// MgmtLink is one management link.
type MgmtLink struct {
	Ifname string     // in the management namespace ("m0", "m1")
	Local  netip.Addr // the controller's address on it
	Switch netip.Addr // the switch's address on it (its interface MgmtIfname)
}

// MgmtIfname is the management interface's name in each switch namespace.
const MgmtIfname = "mgmt"

// InStandby runs fn on a locked OS thread inside the standby switch's namespace (see Do).
func (t *Topology) InStandby(fn func() error) error {
	if t.StandbyNS == "" {
		return fmt.Errorf("%w: no standby switch", ErrConfig)
	}
	return Do(t.StandbyNS, fn)
}

// InMgmt runs fn on a locked OS thread inside the management namespace (see Do).
func (t *Topology) InMgmt(fn func() error) error {
	if t.Mgmt == nil {
		return fmt.Errorf("%w: no management network", ErrConfig)
	}
	return Do(t.Mgmt.NS, fn)
}

// SetPortsUp brings every host-facing port of the switch namespace ns (t.SwitchNS or
// t.StandbyNS) up or down: down, the hosts' links to it lose carrier.
func (t *Topology) SetPortsUp(ns string, up bool) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	h := t.nlHandles[ns]
	if h == nil {
		return fmt.Errorf("%w: no switch namespace %q", ErrConfig, ns)
	}
	for _, p := range t.ports {
		if p.ns != ns || p.name == MgmtIfname {
			continue
		}
		l, err := h.LinkByName(p.name)
		if err == nil {
			if up {
				err = h.LinkSetUp(l)
			} else {
				err = h.LinkSetDown(l)
			}
		}
		if err != nil {
			return fmt.Errorf("port %s in %s: %w", p.name, ns, err)
		}
	}
	return nil
}

// buildStandby makes the standby switch and the hosts' second links; called with mu held, after
// every host exists.
func (t *Topology) buildStandby(cfg Config) error {
	t.StandbyNS = t.Prefix + "-sb"
	sbNS, sb, err := t.makeSwitchNS(t.StandbyNS)
	if err != nil {
		return err
	}
	for i, h := range t.Hosts() {
		hostNS, hn := t.nsHandles[h.NSName], t.nlHandles[h.NSName]
		// A host answers on either link and routes around a link without carrier.
		err := DoHandle(hostNS, func() error {
			for _, kv := range [][2]string{
				{"net.ipv4.conf.all.ignore_routes_with_linkdown", "1"},
				{"net.ipv4.conf.default.ignore_routes_with_linkdown", "1"},
				{"net.ipv4.conf.all.rp_filter", "0"},
				{"net.ipv4.conf.default.rp_filter", "0"},
				{"net.ipv4.conf." + HostIfname + ".rp_filter", "0"},
			} {
				if err := writeSysctl(kv[0], kv[1]); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("host %s: %w", h.Name, err)
		}
		side := hostLink{ns: t.StandbyNS, swNS: sbNS, sw: sb, ifname: HostIfname2, tmp: fmt.Sprintf("s%d", i), metric: MetricStandby}
		ifindex, portIndex, xl, err := t.addLink(cfg, hostNS, hn, h, side)
		if err != nil {
			return fmt.Errorf("host %s standby link: %w", h.Name, err)
		}
		h.Ifindex2, h.PortIndex2, h.XDPLink2 = ifindex, portIndex, xl
	}
	return nil
}

// buildMgmt makes the management namespace with a link to the switch and, if there is one, to
// the standby; called with mu held, after the switches exist.
func (t *Topology) buildMgmt() error {
	m := &Mgmt{NS: t.Prefix + "-mg",
		Primary: MgmtLink{Ifname: "m0", Local: netip.AddrFrom4([4]byte{10, 201, 1, 2}), Switch: netip.AddrFrom4([4]byte{10, 201, 1, 1})},
		Standby: MgmtLink{Ifname: "m1", Local: netip.AddrFrom4([4]byte{10, 201, 2, 2}), Switch: netip.AddrFrom4([4]byte{10, 201, 2, 1})},
	}
	mgNS, mg, err := t.makeNS(m.NS)
	if err != nil {
		return err
	}
	links := []struct {
		ml *MgmtLink
		ns string
	}{{&m.Primary, t.SwitchNS}, {&m.Standby, t.StandbyNS}}
	if t.StandbyNS == "" {
		links, m.Standby = links[:1], MgmtLink{}
	}
	for _, l := range links {
		sw := t.nlHandles[l.ns]
		attrs := netlink.NewLinkAttrs()
		attrs.Name = MgmtIfname
		if err := sw.LinkAdd(&netlink.Veth{LinkAttrs: attrs, PeerName: l.ml.Ifname, PeerTxQLen: -1}); err != nil {
			return fmt.Errorf("management veth in %s: %w", l.ns, err)
		}
		t.ports = append(t.ports, nsLink{l.ns, MgmtIfname})
		peer, err := sw.LinkByName(l.ml.Ifname)
		if err == nil {
			err = sw.LinkSetNsFd(peer, int(mgNS))
		}
		if err != nil {
			return fmt.Errorf("move %s to %s: %w", l.ml.Ifname, m.NS, err)
		}
		ends := []struct {
			h      *netlink.Handle
			ifname string
			addr   netip.Addr
			link   netlink.Link
		}{{h: sw, ifname: MgmtIfname, addr: l.ml.Switch}, {h: mg, ifname: l.ml.Ifname, addr: l.ml.Local}}
		for i := range ends {
			end := &ends[i]
			end.link, err = end.h.LinkByName(end.ifname)
			if err == nil {
				err = end.h.AddrAdd(end.link, &netlink.Addr{IPNet: &net.IPNet{IP: end.addr.AsSlice(), Mask: net.CIDRMask(24, 32)}})
			}
			if err == nil {
				err = end.h.LinkSetUp(end.link)
			}
			if err != nil {
				return fmt.Errorf("management link %s (%v): %w", end.ifname, end.addr, err)
			}
		}
		// Static neighbours both ways, like every other link of a topology.
		for i, end := range ends {
			peer := ends[1-i]
			if err := end.h.NeighSet(&netlink.Neigh{LinkIndex: end.link.Attrs().Index, Family: netlink.FAMILY_V4,
				State: netlink.NUD_PERMANENT, IP: peer.addr.AsSlice(), HardwareAddr: peer.link.Attrs().HardwareAddr}); err != nil {
				return fmt.Errorf("neighbour %v on %s: %w", peer.addr, end.ifname, err)
			}
		}
	}
	t.Mgmt = m
	return nil
}
