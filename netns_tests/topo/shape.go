package topo

import (
	"errors"
	"fmt"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// ErrShape is wrapped by ShapeLinks' errors about an unusable request.
var ErrShape = errors.New("invalid link shaping")

// Limits of ShapeLinks' rate, in bits per second.
const (
	MinLinkRate = 1_000_000       // 1 Mbit/s
	MaxLinkRate = 100_000_000_000 // 100 Gbit/s
)

const (
	// ShapeIfb is the name of the ifb device in each shaped host's namespace through which the
	// host's received packets pass (see ShapeLinks).
	ShapeIfb = "ifb-in"
	// shapeQueue is the packets each direction's queue holds (the txqueuelen of the host's
	// interface and of its ifb, which is the limit of the HTB class's default pfifo): enough
	// for every in-flight window of the benchmark's modes, so the shaper delays and never
	// drops. A UDP sender is held back by its socket buffer meanwhile (a veth orphans the skb
	// only when the qdisc releases it); the receive side has no such back-pressure, which is
	// why the queue is deep.
	shapeQueue = 10000
	// shapePriority of the ingress redirect filter: after Impair's (impairPriority), which
	// ends classification when it passes a packet. Shaping and a FromSwitch impairment on the
	// same host therefore do not compose: the impairment wins and the received packets are
	// not shaped. ToSwitch impairments (a filter on clsact egress, before the root qdisc)
	// compose with shaping.
	shapePriority = 2
	// shapeQuantum is the HTB class's quantum: one class per qdisc, so it only has to be at
	// least a packet (a GSO/GRO aggregate included); larger values make the kernel warn.
	shapeQuantum = 200000
	shapeIfbMTU  = 65535 // a GRO aggregate passes the ifb whole
	// shapeBurstTime is the least time's worth of bytes the HTB class's bucket holds (its burst
	// and cburst; see shapeBurst).
	shapeBurstTime = 50 * time.Microsecond
)

// shapeBurst is the HTB class's bucket in bytes at rate bits/s, for a packet scheduler clock of
// hz (netlink.Hz, /proc/net/psched). netlink sizes the bucket as tc does, rate/hz plus 1600
// bytes, and with high-resolution timers hz is 10^9: about one 1600-byte packet at any rate,
// under 1.3 µs at 10 Gbit/s. HTB banks at most a bucket of tokens, so whenever its dequeue
// timer (or the softirq that runs it) fires later than that, the time past the bucket is lost
// and the link runs below its rate; at 10 Gbit/s a 3388-byte frame takes 2.7 µs, so every
// late wake-up costs. The bucket therefore holds at least shapeBurstTime at the rate (62.5 KB
// at 10 Gbit/s, 6.25 KB at 1 Gbit/s): the latency the shaper absorbs, and the most a host may
// send at once beyond the rate after an idle spell. Below 256 Mbit/s this is under tc's size,
// which is kept, so slower links are shaped as before.
func shapeBurst(rate uint64, hz float64) uint32 {
	bytesPerSec := float64(rate) / 8
	return uint32(max(bytesPerSec*shapeBurstTime.Seconds(), bytesPerSec/hz+1600))
}

// ShapeLinks limits every host's link (workers and the PS) to rate bits/s in each direction,
// as a link of that speed would: packets wait in a queue, none is dropped (up to shapeQueue
// packets per direction).
//
// Where it shapes, and why that is the same for every kind of traffic: the switch's side of a
// link cannot be shaped for XDP traffic, because frames the switch's XDP program sends with
// XDP_TX or XDP_REDIRECT (its broadcast) enter the host's veth through ndo_xdp_xmit and bypass
// every qdisc and tc hook of the port, while kernel-forwarded packets (the baselines') pass the
// port's qdisc. So both directions are shaped on the host's side, which every packet passes
// whatever forwarded it:
//
//   - host to switch: an HTB qdisc (one class at rate, the default for every packet) at the
//     root of the host's interface: every packet the host sends leaves through it, before the
//     switch's XDP program or kernel forwarding sees it.
//   - switch to host: a u32 filter on the host interface's tc ingress (clsact) redirects every
//     received packet (mirred egress redirect) to an ifb device in the host's namespace
//     (ShapeIfb) with the same HTB qdisc, which hands it back to the host's receive path
//     unchanged. Frames the switch's XDP broadcast sent reach tc ingress once the host's XDP
//     program passes them (Config.HostXDP: xdpagg_pass) and they become skbs; kernel-forwarded
//     packets reach it directly. A host XDP program that redirected packets elsewhere (e.g. to
//     an AF_XDP socket) would bypass this shaping.
//
// The kernel this runs on has no netem and no fq (see Impairment), hence HTB. HTB counts each
// packet's length from its Ethernet header (for a GSO aggregate, every segment's headers), so the
// rate is an Ethernet link's bit rate without preamble and inter-frame gap.
//
// ShapeLinks may be called once per topology; Shaping reads back what the kernel holds. Close
// removes it with the topology.
func (t *Topology) ShapeLinks(rate uint64) error {
	if rate < MinLinkRate || rate > MaxLinkRate {
		return fmt.Errorf("%w: rate %d bit/s: use %d..%d", ErrShape, rate, uint64(MinLinkRate), uint64(MaxLinkRate))
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, h := range t.Hosts() { // Hosts reads only fields New set: no t.mu
		if err := t.shapeHost(h, rate); err != nil {
			return fmt.Errorf("shape host %s's link: %w", h.Name, err)
		}
	}
	return nil
}

func (t *Topology) shapeHost(h *Host, rate uint64) error {
	nlh := t.nlHandles[h.NSName]
	if nlh == nil {
		return fmt.Errorf("%w: the topology is closed", ErrShape)
	}
	eth, err := nlh.LinkByIndex(h.Ifindex)
	if err != nil {
		return fmt.Errorf("find %s: %w", h.Ifname, err)
	}
	if err := nlh.LinkSetTxQLen(eth, shapeQueue); err != nil {
		return fmt.Errorf("queue length of %s: %w", h.Ifname, err)
	}
	if err := addShaper(nlh, eth.Attrs().Index, rate); err != nil {
		return fmt.Errorf("%s egress: %w", h.Ifname, err)
	}

	attrs := netlink.NewLinkAttrs()
	attrs.Name = ShapeIfb
	attrs.TxQLen = shapeQueue
	attrs.MTU = shapeIfbMTU
	if err := nlh.LinkAdd(&netlink.Ifb{LinkAttrs: attrs}); err != nil {
		return fmt.Errorf("create %s: %w", ShapeIfb, err)
	}
	t.shaped = append(t.shaped, h.NSName)
	ifb, err := nlh.LinkByName(ShapeIfb)
	if err != nil {
		return fmt.Errorf("find %s: %w", ShapeIfb, err)
	}
	if err := nlh.LinkSetUp(ifb); err != nil {
		return fmt.Errorf("bring %s up: %w", ShapeIfb, err)
	}
	if err := addShaper(nlh, ifb.Attrs().Index, rate); err != nil {
		return fmt.Errorf("%s: %w", ShapeIfb, err)
	}
	// Shared with Impair's filters: an existing clsact stays.
	if err := addClsact(nlh, h.Ifindex); err != nil {
		return fmt.Errorf("%s: %w", h.Ifname, err)
	}
	redirect := netlink.NewMirredAction(ifb.Attrs().Index) // egress redirect, stolen
	filter := &netlink.U32{
		FilterAttrs: netlink.FilterAttrs{
			LinkIndex: h.Ifindex,
			Parent:    netlink.HANDLE_MIN_INGRESS,
			Priority:  shapePriority,
			Protocol:  unix.ETH_P_ALL,
		},
		Actions: []netlink.Action{redirect}, // no selector: every packet
	}
	if err := nlh.FilterAdd(filter); err != nil {
		return fmt.Errorf("redirect %s's ingress to %s: %w", h.Ifname, ShapeIfb, err)
	}
	return nil
}

// addShaper puts an HTB qdisc 1: at the root of ifindex whose one class 1:1 (rate and ceiling
// rate bits/s) takes every packet.
func addShaper(nlh *netlink.Handle, ifindex int, rate uint64) error {
	htb := netlink.NewHtb(netlink.QdiscAttrs{
		LinkIndex: ifindex,
		Parent:    netlink.HANDLE_ROOT,
		Handle:    netlink.MakeHandle(1, 0),
	})
	htb.Defcls = 1 // unclassified packets (all) go to 1:1, not past the shaper
	if err := nlh.QdiscReplace(htb); err != nil {
		return fmt.Errorf("htb qdisc: %w", err)
	}
	class := netlink.NewHtbClass(netlink.ClassAttrs{
		LinkIndex: ifindex,
		Parent:    netlink.MakeHandle(1, 0),
		Handle:    netlink.MakeHandle(1, 1),
	}, netlink.HtbClassAttrs{Rate: rate, Ceil: rate, Quantum: shapeQuantum,
		Buffer: shapeBurst(rate, netlink.Hz()), Cbuffer: shapeBurst(rate, netlink.Hz())})
	if err := nlh.ClassReplace(class); err != nil {
		return fmt.Errorf("htb class at %d bit/s: %w", rate, err)
	}
	return nil
}

// LinkShaping is one host link's shaping as the kernel holds it (Shaping).
type LinkShaping struct {
	// EgressRate is the rate (bits/s) of the default HTB class at the root of the host's
	// interface: what the host sends. 0: none.
	EgressRate uint64
	// IngressRate is the rate of the default HTB class on the host's ifb (ShapeIfb). 0: none.
	IngressRate uint64
	// IngressRedirect says that a filter on the host interface's tc ingress redirects every
	// packet to that ifb, so what the host receives passes the IngressRate shaper.
	IngressRedirect bool
	// Queue is the txqueuelen of the host's interface and of its ifb (the smaller), the
	// shapers' queue in packets.
	Queue int
	// EgressPackets and IngressPackets are the packets each shaper's class has sent so far (a
	// GSO/GRO aggregate counts once): evidence that traffic really passed the shapers.
	EgressPackets, IngressPackets uint64
}

// Shaping reads host h's link shaping back from the kernel.
func (t *Topology) Shaping(h *Host) (LinkShaping, error) {
	var s LinkShaping
	if err := t.checkImpair(h, ToSwitch); err != nil {
		return s, err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	nlh := t.nlHandles[h.NSName]
	if nlh == nil {
		return s, fmt.Errorf("%w: host %s: the topology is closed", ErrShape, h.Name)
	}
	eth, err := nlh.LinkByIndex(h.Ifindex)
	if err != nil {
		return s, fmt.Errorf("host %s: find %s: %w", h.Name, h.Ifname, err)
	}
	if s.EgressRate, s.EgressPackets, err = shaperRate(nlh, eth); err != nil {
		return s, fmt.Errorf("host %s: %s: %w", h.Name, h.Ifname, err)
	}
	s.Queue = eth.Attrs().TxQLen
	ifb, err := nlh.LinkByName(ShapeIfb)
	var nf netlink.LinkNotFoundError
	if errors.As(err, &nf) {
		return s, nil
	}
	if err != nil {
		return s, fmt.Errorf("host %s: find %s: %w", h.Name, ShapeIfb, err)
	}
	if s.IngressRate, s.IngressPackets, err = shaperRate(nlh, ifb); err != nil {
		return s, fmt.Errorf("host %s: %s: %w", h.Name, ShapeIfb, err)
	}
	s.Queue = min(s.Queue, ifb.Attrs().TxQLen)
	filters, err := nlh.FilterList(eth, netlink.HANDLE_MIN_INGRESS)
	if err != nil && !errors.Is(err, unix.EINVAL) { // EINVAL: no clsact
		return s, fmt.Errorf("host %s: tc ingress filters of %s: %w", h.Name, h.Ifname, err)
	}
	for _, f := range filters {
		u, ok := f.(*netlink.U32)
		if !ok || f.Attrs().Priority != shapePriority {
			continue
		}
		matchAll := u.Sel == nil || (len(u.Sel.Keys) == 1 && u.Sel.Keys[0].Mask == 0)
		for _, a := range u.Actions {
			if m, ok := a.(*netlink.MirredAction); ok && matchAll && m.Ifindex == ifb.Attrs().Index &&
				m.MirredAction == netlink.TCA_EGRESS_REDIR {
				s.IngressRedirect = true
			}
		}
	}
	return s, nil
}

// shaperRate is the rate (bits/s) and packets sent of class 1:1 when l's root qdisc is HTB 1:
// sending every packet there; zeros otherwise.
func shaperRate(nlh *netlink.Handle, l netlink.Link) (rate, packets uint64, err error) {
	qdiscs, err := nlh.QdiscList(l)
	if err != nil {
		return 0, 0, fmt.Errorf("list qdiscs: %w", err)
	}
	root := false
	for _, q := range qdiscs {
		if h, ok := q.(*netlink.Htb); ok && q.Attrs().Parent == netlink.HANDLE_ROOT &&
			q.Attrs().Handle == netlink.MakeHandle(1, 0) && h.Defcls == 1 {
			root = true
		}
	}
	if !root {
		return 0, 0, nil
	}
	classes, err := nlh.ClassList(l, netlink.MakeHandle(1, 0))
	if err != nil {
		return 0, 0, fmt.Errorf("list classes: %w", err)
	}
	for _, c := range classes {
		if h, ok := c.(*netlink.HtbClass); ok && c.Attrs().Handle == netlink.MakeHandle(1, 1) && h.Ceil == h.Rate {
			if st := c.Attrs().Statistics; st != nil && st.Basic != nil {
				packets = uint64(st.Basic.Packets)
			}
			return h.Rate * 8, packets, nil
		}
	}
	return 0, 0, nil
}
