package topo

import (
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
)

// ErrImpair is wrapped by the errors of Impair and ClearImpair about an unusable request.
var ErrImpair = errors.New("invalid impairment")

// Reordering delays and the delay line's capacity (see Impairment.Reorder).
const (
	DefaultReorderDelay = 2 * time.Millisecond
	MinReorderDelay     = 10 * time.Microsecond
	MaxReorderDelay     = 10 * time.Second
	// ReorderLanes is the number of parallel lanes of a delay line: a lane holds one packet at a
	// time back by the delay and passes one held packet per 2×ReorderDelay, so a line delays up
	// to ReorderLanes/(2×ReorderDelay) packets per second (8000/s at 2ms) without extra waiting.
	ReorderLanes = 32
	// ReorderQueue is how many held packets one lane queues, beyond which it drops: a burst of
	// about ReorderLanes×ReorderQueue held packets fits (randomly spread over the lanes).
	ReorderQueue = 4096
)

// Impairment is a fault to inject into one direction of a host's link. Percentages are 0..100
// and apply per packet (per skb: a GRO or GSO aggregate counts as one).
//
// Loss and duplication need no queue, so a tc BPF program does them, which also makes an ifb
// device unnecessary for FromSwitch. Reordering needs packets held back, and the kernel the tests
// run on (6.18, without modules: CONFIG_NET_SCH_NETEM, _FQ, _ETF, _FQ_CODEL and
// CONFIG_NET_CLS_MATCHALL unset) has neither netem nor a qdisc that honours BPF-set departure
// times; so Reorder sends the chosen packets through a delay line made of what it does have: a
// veth pair with an HTB qdisc (see Impair). There is no delay or jitter for all packets.
type Impairment struct {
	// Loss is the percentage of packets dropped.
	Loss float64
	// Duplicate is the percentage of the packets that survive Loss which are delivered twice.
	// The copy is not subject to Loss again.
	Duplicate float64
	// Reorder is the percentage of the packets that get through (copies included) which are
	// held back by ReorderDelay and so arrive after packets sent up to ReorderDelay after them.
	// The reordering loses nothing while the line's capacity (ReorderLanes, ReorderQueue) holds;
	// beyond ReorderLanes/(2×ReorderDelay) held packets per second the held packets queue up and
	// wait longer, and a lane whose queue is full drops.
	Reorder float64
	// ReorderDelay is how long a held-back packet waits, at least (more when the line is busy);
	// 0 means DefaultReorderDelay. Without Reorder it has no effect.
	ReorderDelay time.Duration
}

// Direction says which way through a host's link an impairment applies.
type Direction int

const (
	// ToSwitch impairs what the host sends: tc egress of the host's interface.
	ToSwitch Direction = iota
	// FromSwitch impairs what the host receives: tc ingress of the host's interface. The switch
	// side cannot do it: the switch's XDP_TX/XDP_REDIRECT frames enter the host's veth through
	// ndo_xdp_xmit and bypass every tc hook and qdisc of the sending port. On the receiving side
	// a frame that the host's XDP program (Config.HostXDP) passes becomes an skb and does reach
	// tc ingress.
	FromSwitch
)

func (d Direction) String() string {
	switch d {
	case ToSwitch:
		return "to-switch"
	case FromSwitch:
		return "from-switch"
	}
	return fmt.Sprintf("Direction(%d)", int(d))
}

// The impairment's tc filter: one per host and direction, found again by priority and handle so
// that Impair can replace it atomically and ClearImpair delete it without any state kept here.
// Priority 1 runs it before any filter that someone else adds with tc's default priorities.
const (
	impairPriority = 1
	impairHandle   = 1
	impairName     = "topo_impair"
	reorderName    = "topo_reorder"
	// impairMark tags the copies the program makes: a copy re-enters the same hook and must
	// pass untouched instead of being dropped or copied again.
	impairMark = 0x1a7e0d0b
	// ballastMark tags the clone that goes into the delay line ahead of a held packet, and
	// heldMark the held packet itself (also when it comes back to the host's interface).
	ballastMark = 0x1a7e0d0c
	heldMark    = 0x1a7e0d0d
)

// The delay line of a direction: a veth pair in the host's namespace. Held packets enter at the
// first end (its HTB qdisc holds them back) and come out at the second, whose tc ingress program
// hands them back to the host's interface.
var lineNames = [...][2]string{
	ToSwitch:   {"dly-to-sw", "dly-to-sw-x"},
	FromSwitch: {"dly-from-sw", "dly-from-sw-x"},
}

const (
	lineMTU = 65535 // the largest: anything the host's interface carries fits
	// lineMPU is the HTB "minimum packet unit": every packet up to 64 KiB costs a lane the same
	// time, ReorderDelay, whatever its size.
	lineMPU = 65535
)

// Offsets in struct __sk_buff.
const (
	skbMarkOff     = 8
	skbPriorityOff = 32
	skbIfindexOff  = 40
)

// Impair injects imp into h's link in direction dir, replacing any earlier impairment of that
// host and direction (atomically: no packet slips through unimpaired in between). A zero
// Impairment (no Loss, Duplicate or Reorder) is ClearImpair. Close removes impairments with the
// topology.
//
// It attaches a direct-action tc BPF filter to a clsact qdisc on h's interface, both made in h's
// namespace; the kernel keeps the program alive through the filter, so nothing here needs
// closing.
//
// With Reorder, the program sends each packet it holds back through the direction's delay line:
// a veth pair in h's namespace ("dly-to-sw" and "dly-to-sw-x" for ToSwitch, "dly-from-sw" and
// "dly-from-sw-x" for FromSwitch) whose first end has an HTB qdisc with ReorderLanes classes
// ("lanes"), each rate-limited so that any packet costs it ReorderDelay (HTB's minimum packet
// unit is 64 KiB). A token bucket sends the first packet after a pause at once, so the program
// puts a ballast, a clone of the packet, into a random lane right ahead of the packet; the lane
// sends the ballast at once and the packet ReorderDelay later. The second end's tc ingress
// program drops the ballast and redirects the packet back to h's interface: out of it (ToSwitch)
// or into its receive path (FromSwitch), where the impairment program lets it pass. An ifb
// device cannot be the line: bpf_redirect from tc egress into an ifb leaves skb_iif 0 for the
// host's own packets, and ifb drops those.
//
// A held packet, like a copy, comes back with skb mark 0 (and priority 0). Replacing a
// reordering impairment by one without Reorder, ClearImpair and Close remove the line and drop
// what it still holds. The line lives in h's namespace and goes with it: while something (a
// socket) holds the namespace past Close, the line stays there too, idle, since Close deleted
// h's interface.
func (t *Topology) Impair(h *Host, dir Direction, imp Impairment) error {
	if err := t.checkImpair(h, dir); err != nil {
		return err
	}
	for _, p := range []struct {
		name string
		v    float64
	}{{"Loss", imp.Loss}, {"Duplicate", imp.Duplicate}, {"Reorder", imp.Reorder}} {
		if !(p.v >= 0 && p.v <= 100) { // also rejects NaN
			return fmt.Errorf("%w: %s %v%%: use a percentage in 0..100", ErrImpair, p.name, p.v)
		}
	}
	delay := imp.ReorderDelay
	if delay == 0 {
		delay = DefaultReorderDelay
	}
	if delay < MinReorderDelay || delay > MaxReorderDelay {
		return fmt.Errorf("%w: ReorderDelay %v: use %v..%v (0 for %v)", ErrImpair, imp.ReorderDelay,
			MinReorderDelay, MaxReorderDelay, DefaultReorderDelay)
	}
	if imp.Loss == 0 && imp.Duplicate == 0 && imp.Reorder == 0 {
		return t.ClearImpair(h, dir)
	}

	t.mu.Lock()
	defer t.mu.Unlock()
	nlh := t.nlHandles[h.NSName]
	if nlh == nil {
		return fmt.Errorf("%w: host %s: the topology is closed: impair before Close", ErrImpair, h.Name)
	}
	line, made := 0, false // ifindex of the delay line's entry, without reordering none
	if imp.Reorder > 0 {
		var err error
		if line, made, err = t.makeLine(h, dir, nlh, delay); err != nil {
			return err
		}
	}
	err := t.attachImpair(h, dir, nlh, imp, line)
	switch {
	case err != nil && made:
		// The old program never used this line; a line that was there stays for it.
		if derr := deleteLine(h, dir, nlh); derr != nil {
			err = errors.Join(err, derr)
		}
		return err
	case err != nil:
		return err
	case line == 0:
		// The new program holds nothing back: a line of an earlier impairment goes.
		return deleteLine(h, dir, nlh)
	}
	return nil
}

// attachImpair loads the impairment program for imp (holding packets back through the delay
// line whose entry is line) and attaches it to h's interface for dir, replacing any earlier one.
func (t *Topology) attachImpair(h *Host, dir Direction, nlh *netlink.Handle, imp Impairment, line int) error {
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name:         impairName,
		Type:         ebpf.SchedCLS,
		License:      "GPL",
		Instructions: impairInstructions(imp, dir, line),
	})
	if err != nil {
		return fmt.Errorf("host %s %s: load impairment program: %w", h.Name, dir, err)
	}
	// The filter holds its own reference to the program.
	defer prog.Close()

	if err := addClsact(nlh, h.Ifindex); err != nil {
		return fmt.Errorf("host %s: %s: %w", h.Name, h.Ifname, err)
	}
	filter := impairFilter(h.Ifindex, dir)
	filter.Fd = prog.FD()
	filter.Name = impairName
	filter.DirectAction = true
	if err := nlh.FilterReplace(filter); err != nil {
		return fmt.Errorf("host %s: attach %s impairment filter to %s: %w", h.Name, dir, h.Ifname, err)
	}
	return nil
}

// makeLine makes (or updates) the delay line of h's direction dir for delay and returns the
// ifindex of its entry and whether it made the line. On error no new line is left.
func (t *Topology) makeLine(h *Host, dir Direction, nlh *netlink.Handle, delay time.Duration) (ifindex int, made bool, err error) {
	names := lineNames[dir]
	entry, err := nlh.LinkByName(names[0])
	var nf netlink.LinkNotFoundError
	switch {
	case errors.As(err, &nf):
		attrs := netlink.NewLinkAttrs()
		attrs.Name = names[0]
		attrs.MTU = lineMTU
		attrs.TxQLen = ReorderQueue // the limit of every lane's pfifo
		veth := &netlink.Veth{LinkAttrs: attrs, PeerName: names[1], PeerMTU: lineMTU, PeerTxQLen: -1}
		if err := nlh.LinkAdd(veth); err != nil {
			return 0, false, fmt.Errorf("host %s: create %s delay line %s/%s: %w", h.Name, dir, names[0], names[1], err)
		}
		made = true
		if entry, err = nlh.LinkByName(names[0]); err != nil {
			err = fmt.Errorf("host %s: find delay line %s: %w", h.Name, names[0], err)
		}
	case err != nil:
		return 0, false, fmt.Errorf("host %s: find delay line %s: %w", h.Name, names[0], err)
	}
	if err == nil {
		err = t.setUpLine(h, dir, nlh, entry, delay)
	}
	if err != nil {
		if made {
			// The old program never used this line; a line that was there stays for it.
			if derr := deleteLine(h, dir, nlh); derr != nil {
				err = errors.Join(err, derr)
			}
		}
		return 0, false, err
	}
	return entry.Attrs().Index, made, nil
}

// setUpLine brings the line up and (re)configures its lanes for delay and its return program.
func (t *Topology) setUpLine(h *Host, dir Direction, nlh *netlink.Handle, entry netlink.Link, delay time.Duration) error {
	names := lineNames[dir]
	exit, err := nlh.LinkByName(names[1])
	if err != nil {
		return fmt.Errorf("host %s: find delay line %s: %w", h.Name, names[1], err)
	}
	for _, l := range []netlink.Link{entry, exit} {
		if err := nlh.LinkSetUp(l); err != nil {
			return fmt.Errorf("host %s: bring delay line %s up: %w", h.Name, l.Attrs().Name, err)
		}
	}
	htb := netlink.NewHtb(netlink.QdiscAttrs{
		LinkIndex: entry.Attrs().Index,
		Parent:    netlink.HANDLE_ROOT,
		Handle:    netlink.MakeHandle(1, 0),
	})
	if err := nlh.QdiscAdd(htb); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("host %s: add htb qdisc to delay line %s: %w", h.Name, names[0], err)
	}
	// A lane's rate makes lineMPU bytes (every packet) take delay. HTB classes with a minimum
	// packet unit need a raw request: the netlink package sets only rates. Made in h's
	// namespace, by a socket opened there.
	rate := uint64(math.Round(float64(lineMPU) * float64(time.Second) / float64(delay)))
	err = DoHandle(t.nsHandles[h.NSName], func() error {
		for lane := range ReorderLanes {
			if err := addLane(entry.Attrs().Index, uint16(lane+1), rate); err != nil {
				return fmt.Errorf("lane %d: %w", lane+1, err)
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("host %s: htb classes of delay line %s: %w", h.Name, names[0], err)
	}

	back := uint32(0) // out of the interface again
	if dir == FromSwitch {
		back = 1 // BPF_F_INGRESS: into its receive path
	}
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name:    reorderName,
		Type:    ebpf.SchedCLS,
		License: "GPL",
		Instructions: asm.Instructions{
			asm.LoadMem(asm.R2, asm.R1, skbMarkOff, asm.Word),
			asm.JEq.Imm(asm.R2, heldMark, "back"),
			// The ballast, and anything else that might turn up.
			asm.Mov.Imm(asm.R0, 2), // TC_ACT_SHOT
			asm.Return(),
			asm.Mov.Imm(asm.R1, int32(h.Ifindex)).WithSymbol("back"),
			asm.Mov.Imm(asm.R2, int32(back)),
			asm.FnRedirect.Call(),
			asm.Return(),
		},
	})
	if err != nil {
		return fmt.Errorf("host %s %s: load delay line program: %w", h.Name, dir, err)
	}
	defer prog.Close()
	if err := addClsact(nlh, exit.Attrs().Index); err != nil {
		return fmt.Errorf("host %s: delay line %s: %w", h.Name, names[1], err)
	}
	filter := impairFilter(exit.Attrs().Index, FromSwitch) // its ingress
	filter.Fd = prog.FD()
	filter.Name = reorderName
	filter.DirectAction = true
	if err := nlh.FilterReplace(filter); err != nil {
		return fmt.Errorf("host %s: attach delay line filter to %s: %w", h.Name, names[1], err)
	}
	return nil
}

// addClsact adds a clsact qdisc to ifindex. An existing one (ours from an earlier Impair or
// ShapeLinks, or anyone's) is shared, not replaced: a replace would drop its other filters.
func addClsact(nlh *netlink.Handle, ifindex int) error {
	clsact := &netlink.Clsact{QdiscAttrs: netlink.QdiscAttrs{
		LinkIndex: ifindex,
		Parent:    netlink.HANDLE_CLSACT,
		Handle:    netlink.MakeHandle(0xffff, 0),
	}}
	if err := nlh.QdiscAdd(clsact); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("add clsact qdisc: %w", err)
	}
	return nil
}

// addLane creates or changes HTB class 1:minor of the qdisc 1: on ifindex: rate and ceil rate
// bytes/s, every packet counted as at least lineMPU bytes, no burst (so that the class sends
// one packet after a pause at once and the next only when the first is paid for).
func addLane(ifindex int, minor uint16, rate uint64) error {
	req := nl.NewNetlinkRequest(unix.RTM_NEWTCLASS, unix.NLM_F_CREATE|unix.NLM_F_ACK)
	req.AddData(&nl.TcMsg{
		Family:  nl.FAMILY_ALL,
		Ifindex: int32(ifindex),
		Handle:  netlink.MakeHandle(1, minor),
		Parent:  netlink.MakeHandle(1, 0),
	})
	req.AddData(nl.NewRtAttr(nl.TCA_KIND, nl.ZeroTerminated("htb")))
	spec := nl.TcRateSpec{
		// With a link layer the kernel needs no rate table.
		Linklayer: nl.LINKLAYER_ETHERNET,
		Mpu:       lineMPU,
		Rate:      uint32(min(rate, math.MaxUint32)),
	}
	opt := nl.TcHtbCopt{Rate: spec, Ceil: spec, Quantum: lineMPU}
	options := nl.NewRtAttr(nl.TCA_OPTIONS, nil)
	options.AddRtAttr(nl.TCA_HTB_PARMS, opt.Serialize())
	if rate > math.MaxUint32 {
		options.AddRtAttr(nl.TCA_HTB_RATE64, nl.Uint64Attr(rate))
		options.AddRtAttr(nl.TCA_HTB_CEIL64, nl.Uint64Attr(rate))
	}
	req.AddData(options)
	_, err := req.Execute(unix.NETLINK_ROUTE, 0)
	return err
}

// deleteLine removes the delay line of h's direction dir, if there is one.
func deleteLine(h *Host, dir Direction, nlh *netlink.Handle) error {
	name := lineNames[dir][0]
	if err := deleteLink(nlh, name); err != nil { // and its peer
		return fmt.Errorf("host %s: %s delay line %s: %w", h.Name, dir, name, err)
	}
	return nil
}

// ClearImpair removes h's impairment in direction dir, and its delay line; without one it does
// nothing. The clsact qdisc goes too once no filter is left on it, so that a cleared link is the
// link New made.
func (t *Topology) ClearImpair(h *Host, dir Direction) error {
	if err := t.checkImpair(h, dir); err != nil {
		return err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	nlh := t.nlHandles[h.NSName]
	if nlh == nil {
		return fmt.Errorf("%w: host %s: the topology is closed: Close already removed every impairment", ErrImpair, h.Name)
	}
	eth := &netlink.Device{LinkAttrs: netlink.LinkAttrs{Index: h.Ifindex, Name: h.Ifname}}
	qdiscs, err := nlh.QdiscList(eth)
	if err != nil {
		return fmt.Errorf("host %s: list qdiscs of %s: %w", h.Name, h.Ifname, err)
	}
	var clsact netlink.Qdisc
	for _, q := range qdiscs {
		if q.Type() == "clsact" {
			clsact = q
		}
	}
	if clsact == nil {
		return deleteLine(h, dir, nlh) // filters need a clsact: there is no impairment
	}
	filter := impairFilter(h.Ifindex, dir)
	filter.Handle = 0 // the whole filter chain of our priority
	if err := nlh.FilterDel(filter); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("host %s: delete %s impairment filter from %s: %w", h.Name, dir, h.Ifname, err)
	}
	// Only now: until the filter went, the program sent packets into the line.
	if err := deleteLine(h, dir, nlh); err != nil {
		return err
	}
	for _, parent := range []uint32{netlink.HANDLE_MIN_INGRESS, netlink.HANDLE_MIN_EGRESS} {
		left, err := nlh.FilterList(eth, parent)
		if err != nil {
			return fmt.Errorf("host %s: list tc filters of %s: %w", h.Name, h.Ifname, err)
		}
		if len(left) > 0 {
			return nil // someone else's filters still use the clsact
		}
	}
	if err := nlh.QdiscDel(clsact); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("host %s: delete clsact qdisc of %s: %w", h.Name, h.Ifname, err)
	}
	return nil
}

// checkImpair rejects a direction or host that Impair and ClearImpair cannot use.
func (t *Topology) checkImpair(h *Host, dir Direction) error {
	if dir != ToSwitch && dir != FromSwitch {
		return fmt.Errorf("%w: %v: use ToSwitch or FromSwitch", ErrImpair, dir)
	}
	if h == nil {
		return fmt.Errorf("%w: nil host: pass one of the topology's Hosts()", ErrImpair)
	}
	for _, o := range t.Hosts() {
		if o == h {
			return nil
		}
	}
	return fmt.Errorf("%w: host %s (%s) is not a host of topology %s: pass one of its Hosts()", ErrImpair, h.Name, h.NSName, t.Prefix)
}

// impairFilter is the identity (link, hook, priority, handle) of the impairment filter for dir
// on the interface ifindex.
func impairFilter(ifindex int, dir Direction) *netlink.BpfFilter {
	parent := uint32(netlink.HANDLE_MIN_EGRESS)
	if dir == FromSwitch {
		parent = netlink.HANDLE_MIN_INGRESS
	}
	return &netlink.BpfFilter{
		FilterAttrs: netlink.FilterAttrs{
			LinkIndex: ifindex,
			Parent:    parent,
			Priority:  impairPriority,
			Handle:    impairHandle,
			Protocol:  unix.ETH_P_ALL,
		},
		Fd: -1,
	}
}

// threshold maps a percentage onto the range of bpf_get_prandom_u32: a packet is hit when the
// random number is below it, so 100% (2^32) hits every packet and 0% none.
func threshold(percent float64) int64 {
	return int64(math.Round(percent / 100 * (1 << 32)))
}

// impairInstructions is a direct-action tc program: drop with probability imp.Loss, else copy
// with probability imp.Duplicate (bpf_clone_redirect of the packet back into the same hook's
// direction on the same device), then hold back with probability imp.Reorder (the copy too) by
// redirecting into the delay line whose entry is the interface line, else pass. A held packet
// that comes back passes. Only the blocks imp needs are emitted, because the verifier rejects
// unreachable instructions; line is only used with imp.Reorder.
func impairInstructions(imp Impairment, dir Direction, line int) asm.Instructions {
	const (
		tcActOK   = 0
		tcActShot = 2
	)
	var cloneFlags int64 // egress: the copy is transmitted again
	if dir == FromSwitch {
		cloneFlags = 1 // BPF_F_INGRESS: the copy is received again
	}
	dup, reorder := imp.Duplicate > 0, imp.Reorder > 0
	afterDup := "pass"
	if reorder {
		afterDup = "reorder"
	}
	insns := asm.Instructions{
		asm.Mov.Reg(asm.R6, asm.R1), // the skb, kept across calls
		asm.LoadMem(asm.R7, asm.R6, skbMarkOff, asm.Word),
		// A held packet back from the delay line, even of an earlier program.
		asm.JEq.Imm(asm.R7, heldMark, "untag"),
	}
	if dup {
		// A copy made below comes back through this hook.
		insns = append(insns, asm.JEq.Imm(asm.R7, impairMark, "copy"))
	}
	if imp.Loss > 0 {
		insns = append(insns,
			asm.FnGetPrandomU32.Call(),
			asm.LoadImm(asm.R1, threshold(imp.Loss), asm.DWord),
			asm.JLT.Reg(asm.R0, asm.R1, "drop"),
		)
	}
	if dup {
		insns = append(insns,
			asm.FnGetPrandomU32.Call(),
			asm.LoadImm(asm.R1, threshold(imp.Duplicate), asm.DWord),
			asm.JGE.Reg(asm.R0, asm.R1, afterDup),
			// Tag the packet so that the clone carries the tag, then restore the original's mark.
			asm.LoadImm(asm.R1, impairMark, asm.DWord),
			asm.StoreMem(asm.R6, skbMarkOff, asm.R1, asm.Word),
			asm.Mov.Reg(asm.R1, asm.R6),
			asm.LoadMem(asm.R2, asm.R6, skbIfindexOff, asm.Word),
			asm.Mov.Imm(asm.R3, int32(cloneFlags)),
			asm.FnCloneRedirect.Call(),
			asm.StoreMem(asm.R6, skbMarkOff, asm.R7, asm.Word),
		)
	}
	if reorder {
		insns = append(insns,
			asm.FnGetPrandomU32.Call().WithSymbol("reorder"),
			asm.LoadImm(asm.R1, threshold(imp.Reorder), asm.DWord),
			asm.JGE.Reg(asm.R0, asm.R1, "pass"),
			// A random lane: skb->priority names the HTB class 1:1..1:ReorderLanes.
			asm.FnGetPrandomU32.Call(),
			asm.And.Imm(asm.R0, ReorderLanes-1),
			asm.Add.Imm(asm.R0, int32(netlink.MakeHandle(1, 1))),
			asm.StoreMem(asm.R6, skbPriorityOff, asm.R0, asm.Word),
			// The ballast first, then the packet.
			asm.LoadImm(asm.R1, ballastMark, asm.DWord),
			asm.StoreMem(asm.R6, skbMarkOff, asm.R1, asm.Word),
			asm.Mov.Reg(asm.R1, asm.R6),
			asm.Mov.Imm(asm.R2, int32(line)),
			asm.Mov.Imm(asm.R3, 0),
			asm.FnCloneRedirect.Call(),
			asm.LoadImm(asm.R1, heldMark, asm.DWord),
			asm.StoreMem(asm.R6, skbMarkOff, asm.R1, asm.Word),
			asm.Mov.Imm(asm.R1, int32(line)),
			asm.Mov.Imm(asm.R2, 0),
			asm.FnRedirect.Call(), // TC_ACT_REDIRECT
			asm.Return(),
		)
	}
	insns = append(insns,
		asm.Mov.Imm(asm.R0, tcActOK).WithSymbol("pass"),
		asm.Return(),
	)
	if imp.Loss > 0 {
		insns = append(insns,
			asm.Mov.Imm(asm.R0, tcActShot).WithSymbol("drop"),
			asm.Return(),
		)
	}
	if dup {
		insns = append(insns,
			// Untag the copy and let it through, neither dropped nor copied again.
			asm.Mov.Imm(asm.R1, 0).WithSymbol("copy"),
			asm.StoreMem(asm.R6, skbMarkOff, asm.R1, asm.Word),
			asm.Ja.Label(afterDup),
		)
	}
	insns = append(insns,
		// Untag the held packet and let it through.
		asm.Mov.Imm(asm.R1, 0).WithSymbol("untag"),
		asm.StoreMem(asm.R6, skbMarkOff, asm.R1, asm.Word),
		asm.Mov.Imm(asm.R0, tcActOK),
		asm.Return(),
	)
	return insns
}
