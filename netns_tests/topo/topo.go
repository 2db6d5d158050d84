// Package topo builds network-namespace topologies for end-to-end tests, `xdpagg demo` and
// benchmarks: one switch namespace that routes between N hosts (workers and optionally one
// parameter server), each host in its own namespace attached to the switch by a veth pair.
//
//	host ns Prefix-w0  eth0 10.200.1.2/24 ─── p0 10.200.1.1/24 ┐
//	host ns Prefix-w1  eth0 10.200.2.2/24 ─── p1 10.200.2.1/24 ├ switch ns Prefix-sw (ip_forward=1)
//	host ns Prefix-ps  eth0 10.200.3.2/24 ─── p2 10.200.3.1/24 ┘
//
// Config.Standby adds a standby switch with the primary's port names, addresses and MACs and a
// second link from every host to it, and Config.Mgmt (or Standby) a management namespace linked
// to the switches (standby.go).
//
// Neighbour entries are static in both directions, so nothing depends on ARP (an XDP program
// under test may drop it). TX checksum offload is off and GRO on for every veth (unless
// Config.KernelOffloads). IPv6 is disabled in every namespace so that no stray ICMPv6 traffic
// reaches the programs under test.
//
// Namespaces are named (under /run/netns), so `ip netns exec Prefix-w0 ...` works for debugging.
// The package never logs or exits; it returns wrapped errors.
package topo

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"regexp"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// ErrConfig is wrapped by New's errors about an unusable Config.
var ErrConfig = errors.New("invalid topology configuration")

// Limits and defaults.
const (
	MaxWorkers = 200
	DefaultMTU = 1500
	// HostIfname is the name of every host's interface inside its namespace.
	HostIfname = "eth0"
	// HostIfname2 is every host's link to the standby switch (Config.Standby).
	HostIfname2 = "eth1"
	// MetricPrimary and MetricStandby are the route metrics of a dual-homed host's two links.
	MetricPrimary = 10
	MetricStandby = 20
)

// Config describes a topology.
type Config struct {
	// Prefix is the unique name prefix of the topology, e.g. from NewPrefix(); namespaces are
	// Prefix+"-sw", Prefix+"-w0", ..., Prefix+"-ps". Empty means NewPrefix().
	Prefix string
	// Workers is the number of worker hosts, 1..MaxWorkers.
	Workers int
	// PS adds a parameter-server host (after the workers).
	PS bool
	// MTU of every veth, both ends; 0 means DefaultMTU.
	MTU int
	// HostXDP, if set, is attached in native XDP mode to every host's eth0: XDP_TX and
	// XDP_REDIRECT into a veth are only delivered when its peer runs an XDP program.
	HostXDP *ebpf.Program
	// KernelOffloads leaves every veth's offloads at the kernel's defaults (TX checksum offload
	// on, GRO off) instead of the settings XDP needs (see tuneVeth): a plain kernel-forwarding
	// topology for traffic that no XDP program touches, e.g. benchmark baselines. Do not combine
	// it with XDP programs on the ports or HostXDP.
	KernelOffloads bool
	// Standby adds a standby switch (namespace Prefix+"-sb") with the primary's port names,
	// addresses and MACs, and dual-homes every host: a second link HostIfname2 to the standby's
	// port of the same name, the host's address on both, routes via the primary's link at metric
	// MetricPrimary and via the standby's at MetricStandby, and ignore_routes_with_linkdown=1, so
	// that when the primary's port loses carrier the host's kernel sends everything to the
	// standby. It also adds a management namespace (Prefix+"-mg") with a link to each switch
	// (Topology.Mgmt). HostXDP is attached to both host links.
	Standby bool
	// Mgmt adds the management namespace (Topology.Mgmt) with a link to the switch only, for a
	// topology without a standby (Standby implies it).
	Mgmt bool
}

// Host is one host of a topology and the switch port it hangs off.
type Host struct {
	Name      string           // "w0", "w1", ..., "ps"
	NSName    string           // full namespace name, Prefix+"-"+Name
	Ifname    string           // HostIfname, inside the host namespace
	Ifindex   int              // of Ifname, inside the host namespace
	MAC       net.HardwareAddr // of Ifname
	IP        netip.Addr       // 10.200.<i+1>.2 for the i-th host (workers first, then the PS)
	Prefix    netip.Prefix     // the host's /24
	Port      string           // switch-side interface, "p<i>"
	PortIndex int              // ifindex of Port inside the switch namespace
	PortMAC   net.HardwareAddr // of Port
	Gateway   netip.Addr       // Port's address, 10.200.<i+1>.1: the host's default gateway
	// XDPLink is the host's Config.HostXDP attachment (nil without one). Tests swap the program
	// with XDPLink.Update, e.g. for one that drops some packets; Close closes it.
	XDPLink link.Link
	// With Config.Standby: HostIfname2's ifindex in the host namespace, the standby's port of
	// the same name Port (PortMAC, Gateway), its ifindex in the standby namespace, and
	// HostIfname2's HostXDP attachment. MAC is the same on both host links.
	Ifindex2, PortIndex2 int
	XDPLink2             link.Link
}

// Topology is a built topology. Close it to delete everything it made.
type Topology struct {
	Prefix   string
	SwitchNS string  // namespace name of the switch
	Workers  []*Host // in worker-id order
	PS       *Host   // nil without Config.PS
	MTU      int     // of every veth
	// With Config.Standby: the standby switch's namespace and the management network.
	StandbyNS string
	Mgmt      *Mgmt

	mu         sync.Mutex
	namespaces []string // created by this topology, in creation order
	nsHandles  map[string]netns.NsHandle
	nlHandles  map[string]*netlink.Handle
	ports      []nsLink // veths created in the switch namespaces
	xdpLinks   []link.Link
	shaped     []string // host namespaces where ShapeLinks made an ifb
}

// nsLink is a link by namespace and name.
type nsLink struct{ ns, name string }

var prefixRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$`)

// New builds the topology of cfg. On error it tears down whatever it made and returns nil.
func New(cfg Config) (*Topology, error) {
	if cfg.Prefix == "" {
		cfg.Prefix = NewPrefix()
	}
	if cfg.MTU == 0 {
		cfg.MTU = DefaultMTU
	}
	switch {
	case !prefixRE.MatchString(cfg.Prefix):
		return nil, fmt.Errorf("%w: prefix %q: use 1..64 letters, digits, '_', '.', '-'", ErrConfig, cfg.Prefix)
	case cfg.Workers < 1 || cfg.Workers > MaxWorkers:
		return nil, fmt.Errorf("%w: %d workers: use 1..%d", ErrConfig, cfg.Workers, MaxWorkers)
	case cfg.MTU < 68 || cfg.MTU > 65535:
		return nil, fmt.Errorf("%w: MTU %d: use 68..65535", ErrConfig, cfg.MTU)
	}
	t := &Topology{
		Prefix:    cfg.Prefix,
		SwitchNS:  cfg.Prefix + "-sw",
		MTU:       cfg.MTU,
		nsHandles: map[string]netns.NsHandle{},
		nlHandles: map[string]*netlink.Handle{},
	}
	if err := t.build(cfg); err != nil {
		if cerr := t.Close(); cerr != nil {
			return nil, fmt.Errorf("%w (and tearing down: %w)", err, cerr)
		}
		return nil, err
	}
	return t, nil
}

// Hosts returns the workers, then the PS if any.
func (t *Topology) Hosts() []*Host {
	out := append([]*Host(nil), t.Workers...)
	if t.PS != nil {
		out = append(out, t.PS)
	}
	return out
}

// InSwitch runs fn on a locked OS thread inside the switch namespace (see Do).
func (t *Topology) InSwitch(fn func() error) error {
	return Do(t.SwitchNS, fn)
}

// InHost runs fn on a locked OS thread inside h's namespace (see Do).
func (t *Topology) InHost(h *Host, fn func() error) error {
	if h == nil {
		return errors.New("topo: InHost: nil host")
	}
	return Do(h.NSName, fn)
}

// Close deletes every namespace and link the topology made and closes its XDP links. It is safe
// after a partial New and when called again (a later call retries only what failed).
func (t *Topology) Close() error {
	if t == nil {
		return nil
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	var errs []error
	for _, l := range t.xdpLinks {
		if err := l.Close(); err != nil {
			errs = append(errs, fmt.Errorf("close host XDP link: %w", err))
		}
	}
	t.xdpLinks = nil
	// Delete the veths explicitly: a namespace lives on while anything (e.g. a test's socket)
	// holds it, and its veths with it.
	links := t.ports
	// The ifbs too: like the veths, they would live on in a namespace something still holds.
	for _, ns := range t.shaped {
		links = append(links, nsLink{ns, ShapeIfb})
	}
	for _, p := range links {
		if err := deleteLink(t.nlHandles[p.ns], p.name); err != nil {
			errs = append(errs, fmt.Errorf("%s in %s: %w", p.name, p.ns, err))
		}
	}
	t.ports, t.shaped = nil, nil
	for name, h := range t.nlHandles {
		h.Close()
		delete(t.nlHandles, name)
	}
	for name, h := range t.nsHandles {
		if err := h.Close(); err != nil {
			errs = append(errs, fmt.Errorf("close namespace handle %s: %w", name, err))
		}
		delete(t.nsHandles, name)
	}
	var kept []string
	for _, name := range t.namespaces {
		if err := deleteNamed(name); err != nil {
			errs = append(errs, err)
			kept = append(kept, name)
		}
	}
	t.namespaces = kept
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("close topology %s: %w", t.Prefix, err)
	}
	return nil
}

// makeNS creates a named namespace, records it for Close, turns IPv6 off, brings lo up and opens
// a netlink handle in it.
func (t *Topology) makeNS(name string) (netns.NsHandle, *netlink.Handle, error) {
	nsh, created, err := newNamed(name)
	if created {
		t.namespaces = append(t.namespaces, name)
	}
	if err != nil {
		return nsh, nil, err
	}
	t.nsHandles[name] = nsh
	var nlh *netlink.Handle
	err = DoHandle(nsh, func() error {
		if err := disableIPv6(); err != nil {
			return err
		}
		var err error
		nlh, err = netlink.NewHandle(unix.NETLINK_ROUTE)
		if err != nil {
			return fmt.Errorf("netlink handle: %w", err)
		}
		return nil
	})
	if err != nil {
		return nsh, nil, fmt.Errorf("namespace %s: %w", name, err)
	}
	t.nlHandles[name] = nlh
	lo, err := nlh.LinkByName("lo")
	if err == nil {
		err = nlh.LinkSetUp(lo)
	}
	if err != nil {
		return nsh, nlh, fmt.Errorf("namespace %s: bring lo up: %w", name, err)
	}
	return nsh, nlh, nil
}

func (t *Topology) build(cfg Config) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	swNS, sw, err := t.makeSwitchNS(t.SwitchNS)
	if err != nil {
		return err
	}

	n := cfg.Workers
	if cfg.PS {
		n++
	}
	for i := range n {
		name := fmt.Sprintf("w%d", i)
		if i == cfg.Workers {
			name = "ps"
		}
		h, err := t.addHost(cfg, swNS, sw, i, name)
		if err != nil {
			return fmt.Errorf("host %s: %w", name, err)
		}
		if i < cfg.Workers {
			t.Workers = append(t.Workers, h)
		} else {
			t.PS = h
		}
	}
	if cfg.Standby {
		if err := t.buildStandby(cfg); err != nil {
			return err
		}
	}
	if cfg.Standby || cfg.Mgmt {
		return t.buildMgmt()
	}
	return nil
}

// deleteLink deletes the link name through h, if h is open and the link still exists.
func deleteLink(h *netlink.Handle, name string) error {
	if h == nil {
		return nil
	}
	l, err := h.LinkByName(name)
	var nf netlink.LinkNotFoundError
	if errors.As(err, &nf) {
		return nil
	}
	if err == nil {
		err = h.LinkDel(l)
	}
	if err != nil && !errors.Is(err, unix.ENODEV) {
		return fmt.Errorf("delete: %w", err)
	}
	return nil
}

// makeSwitchNS makes a switch namespace: forwarding on, reverse-path filtering off (set before
// any port exists, so the ports inherit the defaults).
func (t *Topology) makeSwitchNS(name string) (netns.NsHandle, *netlink.Handle, error) {
	nsh, nlh, err := t.makeNS(name)
	if err != nil {
		return nsh, nlh, err
	}
	err = DoHandle(nsh, func() error {
		for _, kv := range [][2]string{
			{"net.ipv4.ip_forward", "1"},
			{"net.ipv4.conf.all.rp_filter", "0"},
			{"net.ipv4.conf.default.rp_filter", "0"},
		} {
			if err := writeSysctl(kv[0], kv[1]); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nsh, nlh, fmt.Errorf("switch namespace %s: %w", name, err)
	}
	return nsh, nlh, nil
}

// addHost creates host i's namespace and its link to the switch.
func (t *Topology) addHost(cfg Config, swNS netns.NsHandle, sw *netlink.Handle, i int, name string) (*Host, error) {
	subnet := byte(i + 1)
	h := &Host{
		Name:    name,
		NSName:  t.Prefix + "-" + name,
		Ifname:  HostIfname,
		IP:      netip.AddrFrom4([4]byte{10, 200, subnet, 2}),
		Prefix:  netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 200, subnet, 0}), 24),
		Port:    fmt.Sprintf("p%d", i),
		Gateway: netip.AddrFrom4([4]byte{10, 200, subnet, 1}),
		// Locally administered MACs that spell the addresses: 02:00:0a:c8:<subnet>:<host byte>.
		MAC:     net.HardwareAddr{0x02, 0x00, 10, 200, subnet, 2},
		PortMAC: net.HardwareAddr{0x02, 0x00, 10, 200, subnet, 1},
	}
	hostNS, hn, err := t.makeNS(h.NSName)
	if err != nil {
		return nil, err
	}
	side := hostLink{ns: t.SwitchNS, swNS: swNS, sw: sw, ifname: HostIfname, tmp: fmt.Sprintf("h%d", i)}
	if cfg.Standby {
		side.metric = MetricPrimary
	}
	ifindex, portIndex, xl, err := t.addLink(cfg, hostNS, hn, h, side)
	if err != nil {
		return nil, err
	}
	h.Ifindex, h.PortIndex, h.XDPLink = ifindex, portIndex, xl
	return h, nil
}

// hostLink says which switch a host link goes to.
type hostLink struct {
	ns     string // the switch's namespace
	swNS   netns.NsHandle
	sw     *netlink.Handle
	ifname string // the host side's name
	tmp    string // the host side's name while it is still in the switch namespace
	metric int    // 0: one link, the kernel's connected route and a plain default route
}

// addLink makes the veth pair between host h and a switch (port h.Port, with h.PortMAC and
// h.Gateway; the host side with h.MAC and h.IP), and wires addresses, routes, neighbours and
// HostXDP. It returns the host side's and the port's ifindexes and the XDP attachment.
func (t *Topology) addLink(cfg Config, hostNS netns.NsHandle, hn *netlink.Handle, h *Host, side hostLink) (int, int, link.Link, error) {
	sw, tmp := side.sw, side.tmp
	attrs := netlink.NewLinkAttrs()
	attrs.Name = h.Port
	attrs.MTU = cfg.MTU
	attrs.HardwareAddr = h.PortMAC
	veth := &netlink.Veth{
		LinkAttrs:        attrs,
		PeerName:         tmp,
		PeerHardwareAddr: h.MAC,
		PeerMTU:          uint32(cfg.MTU),
		PeerTxQLen:       -1,
	}
	if err := sw.LinkAdd(veth); err != nil {
		return 0, 0, nil, fmt.Errorf("create veth %s/%s (MTU %d): %w", h.Port, tmp, cfg.MTU, err)
	}
	t.ports = append(t.ports, nsLink{side.ns, h.Port})
	peer, err := sw.LinkByName(tmp)
	if err != nil {
		return 0, 0, nil, fmt.Errorf("find veth peer %s: %w", tmp, err)
	}
	if err := sw.LinkSetNsFd(peer, int(hostNS)); err != nil {
		return 0, 0, nil, fmt.Errorf("move veth peer %s to %s: %w", tmp, h.NSName, err)
	}
	if peer, err = hn.LinkByName(tmp); err != nil {
		return 0, 0, nil, fmt.Errorf("find moved veth peer %s: %w", tmp, err)
	}
	if err := hn.LinkSetName(peer, side.ifname); err != nil {
		return 0, 0, nil, fmt.Errorf("rename veth peer %s to %s: %w", tmp, side.ifname, err)
	}
	eth, err := hn.LinkByName(side.ifname)
	if err != nil {
		return 0, 0, nil, fmt.Errorf("find %s: %w", side.ifname, err)
	}
	port, err := sw.LinkByName(h.Port)
	if err != nil {
		return 0, 0, nil, fmt.Errorf("find port %s: %w", h.Port, err)
	}
	ifindex, portIndex := eth.Attrs().Index, port.Attrs().Index
	h.MAC = eth.Attrs().HardwareAddr
	h.PortMAC = port.Attrs().HardwareAddr

	// Offloads, from threads inside each namespace.
	if !cfg.KernelOffloads {
		if err := DoHandle(side.swNS, func() error { return tuneVeth(h.Port) }); err != nil {
			return 0, 0, nil, fmt.Errorf("port %s: %w", h.Port, err)
		}
		if err := DoHandle(hostNS, func() error { return tuneVeth(side.ifname) }); err != nil {
			return 0, 0, nil, fmt.Errorf("%s: %w", side.ifname, err)
		}
	}

	// Addresses, then up. A dual-homed host's routes are its own, with metrics (below).
	hostAddr := &netlink.Addr{IPNet: &net.IPNet{IP: h.IP.AsSlice(), Mask: net.CIDRMask(24, 32)}}
	if side.metric != 0 {
		hostAddr.Flags = unix.IFA_F_NOPREFIXROUTE
	}
	gwAddr := &netlink.Addr{IPNet: &net.IPNet{IP: h.Gateway.AsSlice(), Mask: net.CIDRMask(24, 32)}}
	if err := sw.AddrAdd(port, gwAddr); err != nil {
		return 0, 0, nil, fmt.Errorf("address %s on port %s: %w", h.Gateway, h.Port, err)
	}
	if err := hn.AddrAdd(eth, hostAddr); err != nil {
		return 0, 0, nil, fmt.Errorf("address %s on %s: %w", h.IP, side.ifname, err)
	}
	if err := sw.LinkSetUp(port); err != nil {
		return 0, 0, nil, fmt.Errorf("bring port %s up: %w", h.Port, err)
	}
	if err := hn.LinkSetUp(eth); err != nil {
		return 0, 0, nil, fmt.Errorf("bring %s up: %w", side.ifname, err)
	}

	// Default route via the switch port, and static neighbours both ways.
	def := &netlink.Route{LinkIndex: ifindex, Gw: h.Gateway.AsSlice()}
	routes := []*netlink.Route{def}
	if side.metric != 0 { // the subnet first: the gateway must be reachable
		def.Priority = side.metric
		routes = []*netlink.Route{{LinkIndex: ifindex, Dst: prefixNet(h.Prefix), Src: h.IP.AsSlice(),
			Scope: netlink.SCOPE_LINK, Priority: side.metric}, def}
	}
	for _, r := range routes {
		if err := hn.RouteAdd(r); err != nil {
			return 0, 0, nil, fmt.Errorf("route %v via %s: %w", r.Dst, side.ifname, err)
		}
	}
	if err := hn.NeighSet(&netlink.Neigh{
		LinkIndex: ifindex, Family: netlink.FAMILY_V4, State: netlink.NUD_PERMANENT,
		IP: h.Gateway.AsSlice(), HardwareAddr: h.PortMAC,
	}); err != nil {
		return 0, 0, nil, fmt.Errorf("neighbour %s on %s: %w", h.Gateway, side.ifname, err)
	}
	if err := sw.NeighSet(&netlink.Neigh{
		LinkIndex: portIndex, Family: netlink.FAMILY_V4, State: netlink.NUD_PERMANENT,
		IP: h.IP.AsSlice(), HardwareAddr: h.MAC,
	}); err != nil {
		return 0, 0, nil, fmt.Errorf("neighbour %s on port %s: %w", h.IP, h.Port, err)
	}

	var xl link.Link
	if cfg.HostXDP != nil {
		err := DoHandle(hostNS, func() error {
			l, err := link.AttachXDP(link.XDPOptions{Program: cfg.HostXDP, Interface: ifindex, Flags: link.XDPDriverMode})
			if err != nil {
				return fmt.Errorf("attach host XDP program to %s: %w", side.ifname, err)
			}
			t.xdpLinks = append(t.xdpLinks, l)
			xl = l
			return nil
		})
		if err != nil {
			return 0, 0, nil, err
		}
	}
	return ifindex, portIndex, xl, nil
}

func prefixNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

// AddHostAddr gives host h a second address ip on its link (in its /24), with the static
// neighbour entry the switch needs to reach it: e.g. a second server process on the PS host
// that must be told apart by address (the switch intercepts one UDP port per address).
func (t *Topology) AddHostAddr(h *Host, ip netip.Addr) error {
	if h == nil || !h.Prefix.Contains(ip) {
		return fmt.Errorf("%w: address %v is not in the host's subnet", ErrConfig, ip)
	}
	t.mu.Lock()
	hn, sw := t.nlHandles[h.NSName], t.nlHandles[t.SwitchNS]
	t.mu.Unlock()
	if hn == nil || sw == nil {
		return fmt.Errorf("%w: no netlink handle for %s", ErrConfig, h.NSName)
	}
	eth, err := hn.LinkByName(h.Ifname)
	if err != nil {
		return fmt.Errorf("find %s in %s: %w", h.Ifname, h.NSName, err)
	}
	if err := hn.AddrAdd(eth, &netlink.Addr{IPNet: &net.IPNet{IP: ip.AsSlice(), Mask: net.CIDRMask(24, 32)}}); err != nil {
		return fmt.Errorf("add %v to %s: %w", ip, h.NSName, err)
	}
	port, err := sw.LinkByName(h.Port)
	if err != nil {
		return fmt.Errorf("find switch port %s: %w", h.Port, err)
	}
	if err := sw.NeighSet(&netlink.Neigh{LinkIndex: port.Attrs().Index, State: netlink.NUD_PERMANENT, Family: netlink.FAMILY_V4,
		IP: ip.AsSlice(), HardwareAddr: h.MAC}); err != nil {
		return fmt.Errorf("static neighbour %v on %s: %w", ip, h.Port, err)
	}
	return nil
}
