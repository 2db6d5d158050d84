package topo

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/internal/bpftest"
)

// quiet is how long a receiver waits for one more datagram before it decides that no more come.
// Impairments act synchronously in the send or receive path, so a datagram that gets through at
// all arrives within microseconds; this only has to outlast a loaded CI machine's scheduling.
const quiet = 300 * time.Millisecond

// loadPass loads only the xdpagg_pass program of package bpf, for Config.HostXDP.
func loadPass(t *testing.T) *ebpf.Program {
	t.Helper()
	spec, err := bpf.LoadXdpagg()
	bpftest.Check(t, "xdpagg spec", err)
	var objs struct {
		Pass *ebpf.Program `ebpf:"xdpagg_pass"`
	}
	bpftest.Check(t, "load xdpagg_pass", spec.LoadAndAssign(&objs, nil))
	t.Cleanup(func() { objs.Pass.Close() })
	return objs.Pass
}

// impair is Topology.Impair that fails the test on an error (skips it on a missing kernel feature).
func impair(t *testing.T, topo *Topology, h *Host, dir Direction, imp Impairment) {
	t.Helper()
	bpftest.Check(t, fmt.Sprintf("impair %s %s with %+v", h.Name, dir, imp), topo.Impair(h, dir, imp))
}

func clearImpair(t *testing.T, topo *Topology, h *Host, dir Direction) {
	t.Helper()
	if err := topo.ClearImpair(h, dir); err != nil {
		t.Fatalf("ClearImpair %s %s: %v", h.Name, dir, err)
	}
}

// dialFrom opens a UDP socket in h's namespace connected to dst.
func dialFrom(t *testing.T, topo *Topology, h *Host, dst netip.AddrPort) *net.UDPConn {
	t.Helper()
	var conn *net.UDPConn
	err := topo.InHost(h, func() (err error) {
		conn, err = net.DialUDP("udp4", nil, net.UDPAddrFromAddrPort(dst))
		return err
	})
	if err != nil {
		t.Fatalf("dial %v from %s: %v", dst, h.Name, err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// sendAll sends n datagrams "<tag>-<i>" on conn and returns them.
func sendAll(t *testing.T, conn *net.UDPConn, tag string, n int) []string {
	t.Helper()
	var sent []string
	for i := range n {
		msg := fmt.Sprintf("%s-%d", tag, i)
		// ENOBUFS is a packet dropped on the way out; with IP_RECVERR off the kernel reports
		// it as success anyway, but accept it either way.
		if _, err := conn.Write([]byte(msg)); err != nil && !errors.Is(err, unix.ENOBUFS) {
			t.Fatalf("send %s: %v", msg, err)
		}
		sent = append(sent, msg)
	}
	return sent
}

// collect reads datagrams from conn in the background until none came for `quiet`, and counts
// them by payload. Start it before sending so that a burst cannot overflow the socket buffer.
func collect(conn *net.UDPConn) func() (map[string]int, error) {
	done := make(chan struct{})
	got := map[string]int{}
	var rerr error
	go func() {
		defer close(done)
		buf := make([]byte, 2048)
		for {
			_ = conn.SetReadDeadline(time.Now().Add(quiet))
			n, err := conn.Read(buf)
			if errors.Is(err, os.ErrDeadlineExceeded) {
				return
			}
			if err != nil {
				rerr = err
				return
			}
			got[string(buf[:n])]++
		}
	}()
	return func() (map[string]int, error) { <-done; return got, rerr }
}

// exchange sends n datagrams tagged tag from src to dst (where ln listens) and returns how often
// each arrived.
func exchange(t *testing.T, topo *Topology, src *Host, ln *net.UDPConn, dst netip.AddrPort, tag string, n int) ([]string, map[string]int) {
	t.Helper()
	conn := dialFrom(t, topo, src, dst)
	bigRcvbuf(t, ln)
	wait := collect(ln)
	sent := sendAll(t, conn, tag, n)
	got, err := wait()
	if err != nil {
		t.Fatalf("receive %s: %v", tag, err)
	}
	delete(got, warmUpMsg)
	for msg := range got {
		if !slices.Contains(sent, msg) {
			t.Fatalf("unexpected datagram %q", msg)
		}
	}
	return sent, got
}

// bigRcvbuf makes ln's receive buffer big enough for a burst: buffer drops would pass for
// impairment losses. SO_RCVBUFFORCE (root) ignores net.core.rmem_max.
func bigRcvbuf(t *testing.T, ln *net.UDPConn) {
	t.Helper()
	rc, err := ln.SyscallConn()
	if err == nil {
		cerr := rc.Control(func(fd uintptr) {
			err = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 8<<20)
		})
		err = errors.Join(cerr, err)
	}
	if err != nil {
		t.Fatalf("enlarge the receive buffer: %v", err)
	}
}

// warmUp delivers one datagram from src to ln before a test counts datagrams: until the kernel's
// link watcher has activated a new veth's queueing (asynchronously, and late when rtnl is busy,
// e.g. deleting other tests' namespaces), transmissions are silently dropped.
func warmUp(t *testing.T, topo *Topology, src *Host, ln *net.UDPConn, dst netip.AddrPort) {
	t.Helper()
	deliver(t, topo, src, ln, dst, warmUpMsg)
}

const warmUpMsg = "warm-up" // exchange ignores late copies of it

// expectNone checks that none of n datagrams from src reaches ln.
func expectNone(t *testing.T, topo *Topology, src *Host, ln *net.UDPConn, dst netip.AddrPort, tag string, n int) {
	t.Helper()
	if _, got := exchange(t, topo, src, ln, dst, tag, n); len(got) != 0 {
		t.Fatalf("%s -> %v: %d of %d datagrams arrived, want none: %v", src.Name, dst, len(got), n, got)
	}
}

// qdiscs describes the qdiscs of h's interface, to compare before and after.
func qdiscs(t *testing.T, topo *Topology, h *Host) []string {
	t.Helper()
	var out []string
	err := topo.InHost(h, func() error {
		l, err := netlink.LinkByIndex(h.Ifindex)
		if err != nil {
			return err
		}
		qs, err := netlink.QdiscList(l)
		if err != nil {
			return err
		}
		for _, q := range qs {
			a := q.Attrs()
			out = append(out, fmt.Sprintf("%s parent %x handle %x", q.Type(), a.Parent, a.Handle))
		}
		return nil
	})
	if err != nil {
		t.Fatalf("qdiscs of %s: %v", h.Name, err)
	}
	slices.Sort(out)
	return out
}

// impairProgIDs returns the IDs of the BPF programs of h's impairment filters.
func impairProgIDs(t *testing.T, topo *Topology, h *Host) []ebpf.ProgramID {
	t.Helper()
	var ids []ebpf.ProgramID
	err := topo.InHost(h, func() error {
		l, err := netlink.LinkByIndex(h.Ifindex)
		if err != nil {
			return err
		}
		for _, parent := range []uint32{netlink.HANDLE_MIN_INGRESS, netlink.HANDLE_MIN_EGRESS} {
			fs, err := netlink.FilterList(l, parent)
			if err != nil {
				return err
			}
			for _, f := range fs {
				if bf, ok := f.(*netlink.BpfFilter); ok && f.Attrs().Priority == impairPriority {
					ids = append(ids, ebpf.ProgramID(bf.Id))
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("filters of %s: %v", h.Name, err)
	}
	return ids
}

// lineProgIDs returns the IDs of the BPF programs on h's delay line for dir (none without one).
func lineProgIDs(t *testing.T, topo *Topology, h *Host, dir Direction) []ebpf.ProgramID {
	t.Helper()
	var ids []ebpf.ProgramID
	err := topo.InHost(h, func() error {
		l, err := netlink.LinkByName(lineNames[dir][1])
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) {
			return nil
		}
		if err != nil {
			return err
		}
		fs, err := netlink.FilterList(l, netlink.HANDLE_MIN_INGRESS)
		for _, f := range fs {
			if bf, ok := f.(*netlink.BpfFilter); ok {
				ids = append(ids, ebpf.ProgramID(bf.Id))
			}
		}
		return err
	})
	if err != nil {
		t.Fatalf("delay line filters of %s: %v", h.Name, err)
	}
	return ids
}

// waitFreed waits until no program has id: the kernel frees a detached program after an RCU
// grace period, not at once.
func waitFreed(t *testing.T, id ebpf.ProgramID) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		p, err := ebpf.NewProgramFromID(id)
		if errors.Is(err, os.ErrNotExist) {
			return
		}
		if err != nil {
			t.Fatalf("look up program %d: %v", id, err)
		}
		p.Close()
		if time.Now().After(deadline) {
			t.Fatalf("impairment program %d still exists", id)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestImpairToSwitch(t *testing.T) {
	topo := newTopo(t, Config{Workers: 1, PS: true})
	w0, ps := topo.Workers[0], topo.PS
	dst := netip.AddrPortFrom(ps.IP, 9520)
	ln := udpListen(t, topo, ps, 9520)
	deliver(t, topo, w0, ln, dst, "before")
	pristine := qdiscs(t, topo, w0)

	impair(t, topo, w0, ToSwitch, Impairment{Loss: 100})
	expectNone(t, topo, w0, ln, dst, "lost", 20)
	// Only the host's sending side is impaired: it still receives.
	back := udpListen(t, topo, w0, 9521)
	deliver(t, topo, ps, back, netip.AddrPortFrom(w0.IP, 9521), "to w0")

	clearImpair(t, topo, w0, ToSwitch)
	deliver(t, topo, w0, ln, dst, "after")
	if got := qdiscs(t, topo, w0); !slices.Equal(got, pristine) {
		t.Errorf("qdiscs after ClearImpair = %v, want %v as before Impair", got, pristine)
	}
	clearImpair(t, topo, w0, ToSwitch) // without an impairment: nothing to do
}

func TestImpairFromSwitch(t *testing.T) {
	for _, hostXDP := range []bool{false, true} {
		t.Run(fmt.Sprintf("host-xdp=%v", hostXDP), func(t *testing.T) {
			cfg := Config{Workers: 1, PS: true}
			if hostXDP {
				// After the host's XDP_PASS the frame becomes an skb and still reaches tc ingress.
				cfg.HostXDP = loadPass(t)
			}
			topo := newTopo(t, cfg)
			w0, ps := topo.Workers[0], topo.PS
			dst := netip.AddrPortFrom(w0.IP, 9520)
			ln := udpListen(t, topo, w0, 9520)
			deliver(t, topo, ps, ln, dst, "before")
			pristine := qdiscs(t, topo, w0)

			impair(t, topo, w0, FromSwitch, Impairment{Loss: 100})
			expectNone(t, topo, ps, ln, dst, "lost", 20)
			// Only the host's receiving side is impaired: it still sends.
			out := udpListen(t, topo, ps, 9521)
			deliver(t, topo, w0, out, netip.AddrPortFrom(ps.IP, 9521), "from w0")

			clearImpair(t, topo, w0, FromSwitch)
			deliver(t, topo, ps, ln, dst, "after")
			if got := qdiscs(t, topo, w0); !slices.Equal(got, pristine) {
				t.Errorf("qdiscs after ClearImpair = %v, want %v as before Impair", got, pristine)
			}
		})
	}
}

// redirectTo is an XDP program for a switch port: it rewrites the Ethernet addresses for h's link
// and XDP_REDIRECTs every frame into h's port, the way the switch sends results.
func redirectTo(t *testing.T, h *Host) *ebpf.Program {
	t.Helper()
	le32 := func(b []byte) int64 { return int64(int32(binary.LittleEndian.Uint32(b))) }
	le16 := func(b []byte) int64 { return int64(binary.LittleEndian.Uint16(b)) }
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:    ebpf.XDP,
		License: "GPL",
		Instructions: asm.Instructions{
			asm.LoadMem(asm.R2, asm.R1, 0, asm.Word), // data
			asm.LoadMem(asm.R3, asm.R1, 4, asm.Word), // data_end
			asm.Mov.Reg(asm.R4, asm.R2),
			asm.Add.Imm(asm.R4, 14),
			asm.JGT.Reg(asm.R4, asm.R3, "pass"),
			asm.StoreImm(asm.R2, 0, le32(h.MAC[0:4]), asm.Word),
			asm.StoreImm(asm.R2, 4, le16(h.MAC[4:6]), asm.Half),
			asm.StoreImm(asm.R2, 6, le16(h.PortMAC[0:2]), asm.Half),
			asm.StoreImm(asm.R2, 8, le32(h.PortMAC[2:6]), asm.Word),
			asm.Mov.Imm(asm.R1, int32(h.PortIndex)),
			asm.Mov.Imm(asm.R2, 0),
			asm.FnRedirect.Call(),
			asm.Return(),
			asm.Mov.Imm(asm.R0, 2).WithSymbol("pass"), // XDP_PASS
			asm.Return(),
		},
	})
	bpftest.Check(t, "load redirecting XDP program", err)
	t.Cleanup(func() { prog.Close() })
	return prog
}

// The reason FromSwitch impairs the host's ingress: frames that the switch XDP_REDIRECTs to a host
// bypass the tc egress hook of the switch port (an impairment there changes nothing), enter the
// host's veth through ndo_xdp_xmit, pass its XDP program, and then do meet tc ingress.
func TestImpairFromSwitchXDPRedirect(t *testing.T) {
	topo := newTopo(t, Config{Workers: 1, PS: true, HostXDP: loadPass(t)})
	w0, ps := topo.Workers[0], topo.PS
	dst := netip.AddrPortFrom(w0.IP, 9520)
	ln := udpListen(t, topo, w0, 9520)
	deliver(t, topo, ps, ln, dst, "routed")

	// 100% loss on the tc egress of w0's switch port stops what the switch's stack forwards...
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type: ebpf.SchedCLS, License: "GPL", Instructions: impairInstructions(Impairment{Loss: 100}, ToSwitch, 0),
	})
	bpftest.Check(t, "load impairment program", err)
	defer prog.Close()
	err = topo.InSwitch(func() error {
		if err := netlink.QdiscAdd(&netlink.Clsact{QdiscAttrs: netlink.QdiscAttrs{
			LinkIndex: w0.PortIndex, Parent: netlink.HANDLE_CLSACT, Handle: netlink.MakeHandle(0xffff, 0),
		}}); err != nil {
			return err
		}
		return netlink.FilterAdd(&netlink.BpfFilter{
			FilterAttrs: netlink.FilterAttrs{
				LinkIndex: w0.PortIndex, Parent: netlink.HANDLE_MIN_EGRESS, Priority: 1, Handle: 1, Protocol: unix.ETH_P_ALL,
			},
			Fd: prog.FD(), DirectAction: true,
		})
	})
	if err != nil {
		t.Fatalf("impair tc egress of %s: %v", w0.Port, err)
	}
	expectNone(t, topo, ps, ln, dst, "routed into impaired port", 5)

	// ...but not what XDP redirects into that port: from now on every datagram that arrives
	// went through ndo_xdp_xmit.
	redirect := redirectTo(t, w0)
	err = topo.InSwitch(func() error {
		l, err := link.AttachXDP(link.XDPOptions{Program: redirect, Interface: ps.PortIndex, Flags: link.XDPDriverMode})
		if err != nil {
			return err
		}
		t.Cleanup(func() { l.Close() })
		return nil
	})
	bpftest.Check(t, "attach redirecting XDP program to "+ps.Port, err)
	deliver(t, topo, ps, ln, dst, "redirected past switch egress")

	// Held packets go back into w0's receive path after the delay line.
	impair(t, topo, w0, FromSwitch, Impairment{Reorder: 10})
	s := seqExchange(t, topo, ps, ln, dst, "reordered", 1000)
	t.Logf("reorder 10%%: %s", s.describe())
	for i, c := range s.counts() {
		if c != 1 {
			t.Errorf("datagram %d arrived %d times, want once", i, c)
		}
	}
	if len(s.late()) == 0 {
		t.Errorf("no redirected datagram arrived after a later one with 10%% reordering")
	}
	impair(t, topo, w0, FromSwitch, Impairment{Loss: 100})
	expectNone(t, topo, ps, ln, dst, "lost", 20)
	clearImpair(t, topo, w0, FromSwitch)
	deliver(t, topo, ps, ln, dst, "after")
}

func TestImpairDuplicate(t *testing.T) {
	topo := newTopo(t, Config{Workers: 1, PS: true})
	w0, ps := topo.Workers[0], topo.PS
	for _, dir := range []Direction{ToSwitch, FromSwitch} {
		t.Run(dir.String(), func(t *testing.T) {
			src, rcv := w0, ps
			if dir == FromSwitch {
				src, rcv = ps, w0
			}
			dst := netip.AddrPortFrom(rcv.IP, 9520+uint16(dir))
			ln := udpListen(t, topo, rcv, int(dst.Port()))
			warmUp(t, topo, src, ln, dst)
			// A second Impair replaces the first: total loss becomes duplication.
			impair(t, topo, w0, dir, Impairment{Loss: 100})
			impair(t, topo, w0, dir, Impairment{Duplicate: 100})
			sent, got := exchange(t, topo, src, ln, dst, "dup", 20)
			for _, msg := range sent {
				if got[msg] != 2 {
					t.Errorf("%s arrived %d times, want 2", msg, got[msg])
				}
			}
			clearImpair(t, topo, w0, dir)
			sent, got = exchange(t, topo, src, ln, dst, "once", 20)
			for _, msg := range sent {
				if got[msg] > 1 {
					t.Errorf("after ClearImpair %s arrived %d times, want at most once", msg, got[msg])
				}
			}
		})
	}
}

func TestImpairLossRate(t *testing.T) {
	topo := newTopo(t, Config{Workers: 1, PS: true})
	w0, ps := topo.Workers[0], topo.PS
	for _, dir := range []Direction{ToSwitch, FromSwitch} {
		t.Run(dir.String(), func(t *testing.T) {
			src, rcv := w0, ps
			if dir == FromSwitch {
				src, rcv = ps, w0
			}
			dst := netip.AddrPortFrom(rcv.IP, 9520+uint16(dir))
			ln := udpListen(t, topo, rcv, int(dst.Port()))
			warmUp(t, topo, src, ln, dst)
			impair(t, topo, w0, dir, Impairment{Loss: 50})
			const n = 400
			_, got := exchange(t, topo, src, ln, dst, "half", n)
			// 50% of 400 is 200 ± 10 (one standard deviation): the bounds are 10 of them away.
			if len(got) < n/4 || len(got) > 3*n/4 {
				t.Errorf("%d of %d datagrams arrived with 50%% loss, want %d..%d", len(got), n, n/4, 3*n/4)
			}
			for msg, c := range got {
				if c != 1 {
					t.Errorf("%s arrived %d times", msg, c)
				}
			}
			t.Logf("%d of %d arrived", len(got), n)
			clearImpair(t, topo, w0, dir)
		})
	}
}

func TestImpairErrors(t *testing.T) {
	topo := newTopo(t, Config{Workers: 1, PS: true})
	w0 := topo.Workers[0]
	copied := *w0 // equal fields, but not a host of the topology
	for _, tc := range []struct {
		h   *Host
		dir Direction
		imp Impairment
	}{
		{w0, ToSwitch, Impairment{Loss: -1}},
		{w0, ToSwitch, Impairment{Loss: 100.5}},
		{w0, FromSwitch, Impairment{Duplicate: 101}},
		{w0, FromSwitch, Impairment{Duplicate: math.NaN()}},
		{w0, FromSwitch, Impairment{Loss: math.Inf(1)}},
		{w0, ToSwitch, Impairment{Reorder: -0.1}},
		{w0, FromSwitch, Impairment{Reorder: 100.1}},
		{w0, FromSwitch, Impairment{Reorder: math.NaN()}},
		{w0, ToSwitch, Impairment{Reorder: 1, ReorderDelay: -time.Millisecond}},
		{w0, ToSwitch, Impairment{Reorder: 1, ReorderDelay: MinReorderDelay - 1}},
		{w0, FromSwitch, Impairment{Reorder: 1, ReorderDelay: MaxReorderDelay + 1}},
		{w0, FromSwitch, Impairment{ReorderDelay: -1}},
		{w0, Direction(2), Impairment{Loss: 1}},
		{w0, Direction(-1), Impairment{Loss: 1}},
		{nil, ToSwitch, Impairment{Loss: 1}},
		{&copied, ToSwitch, Impairment{Loss: 1}},
	} {
		err := topo.Impair(tc.h, tc.dir, tc.imp)
		if !errors.Is(err, ErrImpair) {
			t.Errorf("Impair(%v, %v, %+v) = %v, want ErrImpair", tc.h, tc.dir, tc.imp, err)
		} else {
			t.Logf("Impair(%+v): %v", tc.imp, err)
		}
	}
	for _, h := range []*Host{nil, &copied} {
		if err := topo.ClearImpair(h, ToSwitch); !errors.Is(err, ErrImpair) {
			t.Errorf("ClearImpair(%v) = %v, want ErrImpair", h, err)
		}
	}
	if err := topo.ClearImpair(w0, Direction(5)); !errors.Is(err, ErrImpair) {
		t.Errorf("ClearImpair(Direction(5)) = %v, want ErrImpair", err)
	}
	// Nothing was attached or made by the failed calls.
	if ids := impairProgIDs(t, topo, w0); len(ids) != 0 {
		t.Errorf("impairment programs %v after failed calls", ids)
	}
	pristine := hostLinks(t, topo, w0)
	if slices.ContainsFunc(pristine, func(name string) bool { return strings.HasPrefix(name, "dly-") }) {
		t.Errorf("links %v after failed calls", pristine)
	}
	// A zero Impairment clears, whatever its ReorderDelay.
	impair(t, topo, w0, ToSwitch, Impairment{Loss: 10, Reorder: 10})
	impair(t, topo, w0, ToSwitch, Impairment{ReorderDelay: time.Second})
	if ids := impairProgIDs(t, topo, w0); len(ids) != 0 {
		t.Errorf("impairment programs %v after a zero Impairment", ids)
	}
	if got := hostLinks(t, topo, w0); !slices.Equal(got, pristine) {
		t.Errorf("links %v after a zero Impairment, want %v", got, pristine)
	}
	// The limits themselves are fine.
	impair(t, topo, w0, ToSwitch, Impairment{Reorder: 100, ReorderDelay: MinReorderDelay})
	impair(t, topo, w0, FromSwitch, Impairment{Reorder: 100, ReorderDelay: MaxReorderDelay})
	if err := topo.Close(); err != nil {
		t.Fatal(err)
	}
	if err := topo.Impair(w0, ToSwitch, Impairment{Loss: 1}); !errors.Is(err, ErrImpair) {
		t.Errorf("Impair after Close = %v, want ErrImpair", err)
	}
	if err := topo.ClearImpair(w0, ToSwitch); !errors.Is(err, ErrImpair) {
		t.Errorf("ClearImpair after Close = %v, want ErrImpair", err)
	}
}

// ClearImpair and Close free the impairment programs, even while a socket keeps the host's
// namespace alive.
func TestImpairCleanup(t *testing.T) {
	topo := newTopo(t, Config{Workers: 1, PS: true})
	w0 := topo.Workers[0]
	udpListen(t, topo, w0, 9520) // holds w0's namespace past Close
	impair(t, topo, w0, ToSwitch, Impairment{Loss: 1})
	// Every block: the verifier takes it.
	impair(t, topo, w0, FromSwitch, Impairment{Loss: 1, Duplicate: 1, Reorder: 1})
	lineIDs := lineProgIDs(t, topo, w0, FromSwitch)
	if len(lineIDs) != 1 {
		t.Fatalf("delay line programs %v, want 1", lineIDs)
	}
	ids := impairProgIDs(t, topo, w0)
	if len(ids) != 2 {
		t.Fatalf("impairment programs %v, want 2", ids)
	}
	// Replacing swaps the program and frees the old one.
	impair(t, topo, w0, ToSwitch, Impairment{Loss: 2})
	after := impairProgIDs(t, topo, w0)
	if len(after) != 2 || slices.Equal(after, ids) {
		t.Fatalf("impairment programs %v after replacing one of %v", after, ids)
	}
	for _, id := range ids {
		if !slices.Contains(after, id) {
			waitFreed(t, id)
		}
	}
	clearImpair(t, topo, w0, FromSwitch)
	waitFreed(t, lineIDs[0]) // with the line
	left := impairProgIDs(t, topo, w0)
	if len(left) != 1 {
		t.Fatalf("impairment programs %v after clearing one of %v", left, after)
	}
	for _, id := range after {
		if !slices.Contains(left, id) {
			waitFreed(t, id)
		}
	}
	if err := topo.Close(); err != nil {
		t.Fatal(err)
	}
	waitFreed(t, left[0])
}

// arrival is one datagram as a receiver got it.
type arrival struct {
	seq int // the number the sender gave it
	at  time.Time
}

// sequence is how numbered datagrams arrived: in order of arrival, with the send times.
type sequence struct {
	sent []time.Time // by number
	got  []arrival
}

// sendSeq sends n datagrams "<tag>-<i>", i = 0..n-1, on conn in one burst and returns their
// send times.
func sendSeq(t *testing.T, conn *net.UDPConn, tag string, n int) []time.Time {
	t.Helper()
	sent := make([]time.Time, n)
	for i := range n {
		sent[i] = time.Now()
		if _, err := conn.Write(fmt.Appendf(nil, "%s-%d", tag, i)); err != nil && !errors.Is(err, unix.ENOBUFS) {
			t.Fatalf("send %s-%d: %v", tag, i, err)
		}
	}
	return sent
}

// seqExchange sends n numbered datagrams from src to dst, where ln listens, and returns how they
// arrived. Anything but "<tag>-<number>" (a late warm-up copy) is ignored.
func seqExchange(t *testing.T, topo *Topology, src *Host, ln *net.UDPConn, dst netip.AddrPort, tag string, n int) sequence {
	t.Helper()
	conn := dialFrom(t, topo, src, dst)
	bigRcvbuf(t, ln)
	done := make(chan error, 1)
	var got []arrival
	go func() {
		buf := make([]byte, 2048)
		for {
			_ = ln.SetReadDeadline(time.Now().Add(quiet))
			k, err := ln.Read(buf)
			if errors.Is(err, os.ErrDeadlineExceeded) {
				done <- nil
				return
			}
			if err != nil {
				done <- err
				return
			}
			at := time.Now()
			num, ok := strings.CutPrefix(string(buf[:k]), tag+"-")
			if !ok {
				continue
			}
			seq, err := strconv.Atoi(num)
			if err != nil || seq < 0 || seq >= n {
				done <- fmt.Errorf("unexpected datagram %q", buf[:k])
				return
			}
			got = append(got, arrival{seq, at})
		}
	}()
	sent := sendSeq(t, conn, tag, n)
	if err := <-done; err != nil {
		t.Fatalf("receive %s: %v", tag, err)
	}
	return sequence{sent: sent, got: got}
}

// counts returns how often each datagram arrived.
func (s sequence) counts() []int {
	c := make([]int, len(s.sent))
	for _, a := range s.got {
		c[a.seq]++
	}
	return c
}

// late returns the arrivals of datagrams after a higher-numbered one: the reordered ones.
func (s sequence) late() []arrival {
	var out []arrival
	highest := -1
	for _, a := range s.got {
		if a.seq < highest {
			out = append(out, a)
		}
		highest = max(highest, a.seq)
	}
	return out
}

// firstInOrder reports whether the first arrivals of the datagrams came in sending order.
func (s sequence) firstInOrder() bool {
	seen := make([]bool, len(s.sent))
	highest := -1
	for _, a := range s.got {
		if seen[a.seq] {
			continue
		}
		seen[a.seq] = true
		if a.seq < highest {
			return false
		}
		highest = a.seq
	}
	return true
}

// median returns the median transit time of arrivals as.
func (s sequence) median(as []arrival) time.Duration {
	if len(as) == 0 {
		return 0
	}
	d := make([]time.Duration, len(as))
	for i, a := range as {
		d[i] = a.at.Sub(s.sent[a.seq])
	}
	slices.Sort(d)
	return d[len(d)/2]
}

// describe summarizes the reordering of s for the test log.
func (s sequence) describe() string {
	late := s.late()
	lateSeq := map[int]bool{}
	for _, a := range late {
		lateSeq[a.seq] = true
	}
	var onTime []arrival
	for _, a := range s.got {
		if !lateSeq[a.seq] {
			onTime = append(onTime, a)
		}
	}
	// How far a late datagram fell back: how many higher-numbered ones arrived before it.
	var back []int
	for i, a := range s.got {
		n := 0
		for _, b := range s.got[:i] {
			if b.seq > a.seq {
				n++
			}
		}
		if n > 0 {
			back = append(back, n)
		}
	}
	slices.Sort(back)
	mb := 0
	if len(back) > 0 {
		mb = back[len(back)/2]
	}
	return fmt.Sprintf("%d arrivals of %d datagrams, %d late (median overtaken by %d), median transit %v on time, %v late",
		len(s.got), len(s.sent), len(late), mb, s.median(onTime), s.median(late))
}

// hostLinks returns the sorted names of the links in h's namespace.
func hostLinks(t *testing.T, topo *Topology, h *Host) []string {
	t.Helper()
	var out []string
	err := topo.InHost(h, func() error {
		ls, err := netlink.LinkList()
		for _, l := range ls {
			out = append(out, l.Attrs().Name)
		}
		return err
	})
	if err != nil {
		t.Fatalf("links of %s: %v", h.Name, err)
	}
	slices.Sort(out)
	return out
}

// noLinesHere checks that no delay line leaked into the test's own (root) namespace.
func noLinesHere(t *testing.T) {
	t.Helper()
	for _, names := range lineNames {
		for _, name := range names {
			if _, err := netlink.LinkByName(name); err == nil {
				t.Errorf("delay line %s in the test's namespace", name)
			}
		}
	}
}

func TestImpairReorder(t *testing.T) {
	topo := newTopo(t, Config{Workers: 1, PS: true})
	w0, ps := topo.Workers[0], topo.PS
	pristine := hostLinks(t, topo, w0)
	for _, dir := range []Direction{ToSwitch, FromSwitch} {
		t.Run(dir.String(), func(t *testing.T) {
			src, rcv := w0, ps
			if dir == FromSwitch {
				src, rcv = ps, w0
			}
			dst := netip.AddrPortFrom(rcv.IP, 9520+uint16(dir))
			ln := udpListen(t, topo, rcv, int(dst.Port()))
			warmUp(t, topo, src, ln, dst)
			qs := qdiscs(t, topo, w0)

			// A second Impair changes the line in place.
			impair(t, topo, w0, dir, Impairment{Reorder: 50, ReorderDelay: 5 * time.Millisecond})
			impair(t, topo, w0, dir, Impairment{Reorder: 10})
			if got := hostLinks(t, topo, w0); !slices.Contains(got, lineNames[dir][0]) || !slices.Contains(got, lineNames[dir][1]) {
				t.Errorf("links of %s = %v, want the delay line %v", w0.Name, got, lineNames[dir])
			}
			const n = 2000
			s := seqExchange(t, topo, src, ln, dst, "reorder", n)
			t.Logf("reorder 10%%: %s", s.describe())
			for i, c := range s.counts() {
				if c != 1 {
					t.Errorf("datagram %d arrived %d times, want once", i, c)
				}
			}
			if len(s.late()) == 0 {
				t.Errorf("no datagram of %d arrived after a later one with 10%% reordering", n)
			}

			clearImpair(t, topo, w0, dir)
			if got := hostLinks(t, topo, w0); !slices.Equal(got, pristine) {
				t.Errorf("links of %s after ClearImpair = %v, want %v", w0.Name, got, pristine)
			}
			if got := qdiscs(t, topo, w0); !slices.Equal(got, qs) {
				t.Errorf("qdiscs after ClearImpair = %v, want %v as before Impair", got, qs)
			}
		})
	}
	noLinesHere(t)
}

// Reordering composes with loss and duplication; replacing it by an impairment without Reorder
// removes the line, and the order is kept again.
func TestImpairReorderLossDuplicate(t *testing.T) {
	topo := newTopo(t, Config{Workers: 1, PS: true})
	w0, ps := topo.Workers[0], topo.PS
	dst := netip.AddrPortFrom(ps.IP, 9520)
	ln := udpListen(t, topo, ps, 9520)
	warmUp(t, topo, w0, ln, dst)
	pristine := [][]string{hostLinks(t, topo, w0), hostLinks(t, topo, ps)}

	// The receiving side too: a host impaired both ways.
	impair(t, topo, w0, ToSwitch, Impairment{Loss: 10, Duplicate: 10, Reorder: 10})
	impair(t, topo, ps, FromSwitch, Impairment{Reorder: 10})
	const n = 2000
	s := seqExchange(t, topo, w0, ln, dst, "all", n)
	t.Logf("loss, duplicate, reorder 10%%, then reorder 10%%: %s", s.describe())
	arrived, twice := 0, 0
	for i, c := range s.counts() {
		switch {
		case c > 2:
			t.Errorf("datagram %d arrived %d times, want at most twice", i, c)
		case c == 2:
			twice++
		}
		if c > 0 {
			arrived++
		}
	}
	// 90% of 2000 is 1800 ± 13 (one standard deviation), 10% of that 180 ± 13.
	if arrived < 1600 || arrived > 1960 {
		t.Errorf("%d of %d datagrams arrived with 10%% loss, want 1600..1960", arrived, n)
	}
	if twice < 80 || twice > 300 {
		t.Errorf("%d of %d datagrams arrived twice with 10%% duplication, want 80..300", twice, arrived)
	}
	if len(s.late()) == 0 {
		t.Errorf("no datagram arrived after a later one with 10%% reordering twice")
	}
	t.Logf("%d arrived, %d of them twice", arrived, twice)

	// Without Reorder both ways the datagrams keep their order (a copy may come late).
	impair(t, topo, w0, ToSwitch, Impairment{Loss: 10, Duplicate: 10})
	impair(t, topo, ps, FromSwitch, Impairment{Duplicate: 10, ReorderDelay: time.Second})
	for i, h := range []*Host{w0, ps} {
		if got := hostLinks(t, topo, h); !slices.Equal(got, pristine[i]) {
			t.Errorf("links of %s without Reorder = %v, want %v", h.Name, got, pristine[i])
		}
	}
	s = seqExchange(t, topo, w0, ln, dst, "no-reorder", n)
	t.Logf("loss, duplicate 10%%, then duplicate 10%%: %s", s.describe())
	if !s.firstInOrder() {
		t.Errorf("without Reorder the datagrams came out of order: %s", s.describe())
	}
}
