package topo

import (
	"errors"
	"fmt"
	"math"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// ErrImpair is wrapped by the errors of Impair and ClearImpair about an unusable request.
var ErrImpair = errors.New("invalid impairment")

// Impairment is a fault to inject into one direction of a host's link. Percentages are 0..100
// and apply per packet (per skb: a GRO or GSO aggregate counts as one).
//
// There is no delay, jitter or reordering: those need a qdisc that holds packets back (netem, or
// fq/etf for BPF-set departure times), and the kernel the tests run on (6.18, without modules:
// CONFIG_NET_SCH_NETEM, _FQ, _ETF and CONFIG_NET_CLS_MATCHALL unset) has none of them. Loss and
// duplication need no queue, so a tc BPF program does them, which also makes an ifb device
// unnecessary for FromSwitch.
type Impairment struct {
	// Loss is the percentage of packets dropped.
	Loss float64
	// Duplicate is the percentage of the packets that survive Loss which are delivered twice.
	// The copy is not subject to Loss again.
	Duplicate float64
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
	// impairMark tags the copies the program makes: a copy re-enters the same hook and must
	// pass untouched instead of being dropped or copied again.
	impairMark = 0x1a7e0d0b
)

// Offsets in struct __sk_buff.
const (
	skbMarkOff    = 8
	skbIfindexOff = 40
)

// Impair injects imp into h's link in direction dir, replacing any earlier impairment of that
// host and direction (atomically: no packet slips through unimpaired in between). A zero
// Impairment is ClearImpair. Close removes impairments with the topology.
//
// It attaches a direct-action tc BPF filter to a clsact qdisc on h's interface, both made in h's
// namespace; the kernel keeps the program alive through the filter, so nothing here needs
// closing.
func (t *Topology) Impair(h *Host, dir Direction, imp Impairment) error {
	if err := t.checkImpair(h, dir); err != nil {
		return err
	}
	for _, p := range []struct {
		name string
		v    float64
	}{{"Loss", imp.Loss}, {"Duplicate", imp.Duplicate}} {
		if !(p.v >= 0 && p.v <= 100) { // also rejects NaN
			return fmt.Errorf("%w: %s %v%%: use a percentage in 0..100", ErrImpair, p.name, p.v)
		}
	}
	if imp == (Impairment{}) {
		return t.ClearImpair(h, dir)
	}
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name:         impairName,
		Type:         ebpf.SchedCLS,
		License:      "GPL",
		Instructions: impairInstructions(imp, dir),
	})
	if err != nil {
		return fmt.Errorf("host %s %s: load impairment program: %w", h.Name, dir, err)
	}
	// The filter holds its own reference to the program.
	defer prog.Close()

	t.mu.Lock()
	defer t.mu.Unlock()
	nlh := t.nlHandles[h.NSName]
	if nlh == nil {
		return fmt.Errorf("%w: host %s: the topology is closed: impair before Close", ErrImpair, h.Name)
	}
	clsact := &netlink.Clsact{QdiscAttrs: netlink.QdiscAttrs{
		LinkIndex: h.Ifindex,
		Parent:    netlink.HANDLE_CLSACT,
		Handle:    netlink.MakeHandle(0xffff, 0),
	}}
	// An existing clsact (ours from an earlier Impair, or anyone's) is shared, not replaced: a
	// replace would drop its other filters.
	if err := nlh.QdiscAdd(clsact); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("host %s: add clsact qdisc to %s: %w", h.Name, h.Ifname, err)
	}
	filter := impairFilter(h, dir)
	filter.Fd = prog.FD()
	filter.Name = impairName
	filter.DirectAction = true
	if err := nlh.FilterReplace(filter); err != nil {
		return fmt.Errorf("host %s: attach %s impairment filter to %s: %w", h.Name, dir, h.Ifname, err)
	}
	return nil
}

// ClearImpair removes h's impairment in direction dir; without one it does nothing. The clsact
// qdisc goes too once no filter is left on it, so that a cleared link is the link New made.
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
		return nil // filters need a clsact: there is no impairment
	}
	filter := impairFilter(h, dir)
	filter.Handle = 0 // the whole filter chain of our priority
	if err := nlh.FilterDel(filter); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("host %s: delete %s impairment filter from %s: %w", h.Name, dir, h.Ifname, err)
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

// impairFilter is the identity (link, hook, priority, handle) of h's filter for dir.
func impairFilter(h *Host, dir Direction) *netlink.BpfFilter {
	parent := uint32(netlink.HANDLE_MIN_EGRESS)
	if dir == FromSwitch {
		parent = netlink.HANDLE_MIN_INGRESS
	}
	return &netlink.BpfFilter{
		FilterAttrs: netlink.FilterAttrs{
			LinkIndex: h.Ifindex,
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
// direction on the same device) and pass. Only the blocks imp needs are emitted, because the
// verifier rejects unreachable instructions.
func impairInstructions(imp Impairment, dir Direction) asm.Instructions {
	const (
		tcActOK   = 0
		tcActShot = 2
	)
	var cloneFlags int64 // egress: the copy is transmitted again
	if dir == FromSwitch {
		cloneFlags = 1 // BPF_F_INGRESS: the copy is received again
	}
	dup := imp.Duplicate > 0
	insns := asm.Instructions{asm.Mov.Reg(asm.R6, asm.R1)} // the skb, kept across calls
	if dup {
		insns = append(insns,
			// A copy made below comes back through this hook.
			asm.LoadMem(asm.R7, asm.R6, skbMarkOff, asm.Word),
			asm.JEq.Imm(asm.R7, impairMark, "copy"),
		)
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
			asm.JGE.Reg(asm.R0, asm.R1, "pass"),
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
			asm.Mov.Imm(asm.R0, tcActOK),
			asm.Return(),
		)
	}
	return insns
}
