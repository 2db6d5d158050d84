package topo

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// newTopo builds a topology and registers a Close that also proves nothing was left behind.
func newTopo(t *testing.T, cfg Config) *Topology {
	t.Helper()
	if cfg.Prefix == "" {
		cfg.Prefix = NewPrefix()
	}
	topo, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() {
		if err := topo.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		assertNoLeftovers(t, cfg.Prefix)
	})
	return topo
}

func assertNoLeftovers(t *testing.T, prefix string) {
	t.Helper()
	left, err := Leftovers(prefix)
	if err != nil {
		t.Fatalf("Leftovers: %v", err)
	}
	if len(left) != 0 {
		t.Errorf("namespaces left behind: %v", left)
	}
}

// udpListen opens a UDP socket on addr inside h's namespace.
func udpListen(t *testing.T, topo *Topology, h *Host, port int) *net.UDPConn {
	t.Helper()
	var conn *net.UDPConn
	err := topo.InHost(h, func() (err error) {
		conn, err = net.ListenUDP("udp4", &net.UDPAddr{IP: h.IP.AsSlice(), Port: port})
		return err
	})
	if err != nil {
		t.Fatalf("listen in %s: %v", h.Name, err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// sendUDP sends payload from h (its own address) to dst.
func sendUDP(t *testing.T, topo *Topology, h *Host, dst netip.AddrPort, payload []byte) {
	t.Helper()
	var conn *net.UDPConn
	err := topo.InHost(h, func() (err error) {
		conn, err = net.DialUDP("udp4", nil, net.UDPAddrFromAddrPort(dst))
		return err
	})
	if err != nil {
		t.Fatalf("dial from %s: %v", h.Name, err)
	}
	defer conn.Close()
	// Sent from the test goroutine's thread: the socket stays in h's namespace.
	if _, err := conn.Write(payload); err != nil {
		t.Fatalf("send from %s: %v", h.Name, err)
	}
}

// checkWorkersReachPS sends one datagram from every worker to the PS and checks each arrives from
// the worker's own address.
func checkWorkersReachPS(t *testing.T, topo *Topology, port int) {
	t.Helper()
	ps := topo.PS
	conn := udpListen(t, topo, ps, port)
	for _, w := range topo.Workers {
		from := deliver(t, topo, w, conn, netip.AddrPortFrom(ps.IP, uint16(port)), fmt.Sprintf("hello from %s", w.Name))
		if from.Addr().Unmap() != w.IP {
			t.Errorf("datagram of %s came from %v, want %v", w.Name, from, w.IP)
		}
	}
}

// deliver sends msg from h to dst until conn (bound at dst) receives it, and returns the sender's
// address. UDP may lose a datagram, e.g. while a veth reconfigures for a newly attached XDP
// program under load, so one lost try must not fail the test; ten in a row do.
func deliver(t *testing.T, topo *Topology, h *Host, conn *net.UDPConn, dst netip.AddrPort, msg string) netip.AddrPort {
	t.Helper()
	buf := make([]byte, 1<<16)
	for try := 0; try < 10; try++ {
		sendUDP(t, topo, h, dst, []byte(msg))
		deadline := time.Now().Add(300 * time.Millisecond)
		for {
			_ = conn.SetReadDeadline(deadline)
			n, from, err := conn.ReadFromUDPAddrPort(buf)
			if err != nil {
				break // resend
			}
			if string(buf[:n]) == msg {
				return from
			}
			// A late copy of an earlier message: keep reading.
		}
	}
	t.Fatalf("%s -> %v: a %d-byte datagram never arrived in 10 tries", h.Name, dst, len(msg))
	return netip.AddrPort{}
}

// threadNS returns the inode of the calling thread's network namespace.
func threadNS(t *testing.T) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid()), &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

func TestTopology(t *testing.T) {
	prefix := NewPrefix()
	topo := newTopo(t, Config{Prefix: prefix, Workers: 3, PS: true})

	if topo.Prefix != prefix || topo.SwitchNS != prefix+"-sw" {
		t.Errorf("prefix %q switch %q", topo.Prefix, topo.SwitchNS)
	}
	if len(topo.Workers) != 3 || topo.PS == nil || len(topo.Hosts()) != 4 || topo.Hosts()[3] != topo.PS {
		t.Fatalf("hosts: %d workers, PS %v, Hosts %d", len(topo.Workers), topo.PS, len(topo.Hosts()))
	}
	want := []string{prefix + "-ps", prefix + "-sw", prefix + "-w0", prefix + "-w1", prefix + "-w2"}
	if left, err := Leftovers(prefix); err != nil || !slices.Equal(left, want) {
		t.Errorf("Leftovers = %v, %v; want %v", left, err, want)
	}
	for i, h := range topo.Hosts() {
		name := fmt.Sprintf("w%d", i)
		if i == 3 {
			name = "ps"
		}
		wantIP := netip.AddrFrom4([4]byte{10, 200, byte(i + 1), 2})
		wantGW := netip.AddrFrom4([4]byte{10, 200, byte(i + 1), 1})
		if h.Name != name || h.NSName != prefix+"-"+name || h.Ifname != "eth0" || h.IP != wantIP ||
			h.Gateway != wantGW || h.Prefix != netip.MustParsePrefix(fmt.Sprintf("10.200.%d.0/24", i+1)) ||
			h.Port != fmt.Sprintf("p%d", i) || h.Ifindex == 0 || h.PortIndex == 0 || len(h.MAC) != 6 || len(h.PortMAC) != 6 {
			t.Errorf("host %d: %+v", i, h)
		}
		// The recorded ifindexes and MACs match the interfaces, in the right namespaces.
		err := topo.InHost(h, func() error {
			l, err := netlink.LinkByIndex(h.Ifindex)
			if err != nil {
				return err
			}
			if l.Attrs().Name != "eth0" || l.Attrs().HardwareAddr.String() != h.MAC.String() || l.Attrs().MTU != 1500 {
				return fmt.Errorf("eth0 is %+v", l.Attrs())
			}
			if tx, err := ethtoolGet("eth0", unix.ETHTOOL_GTXCSUM); err != nil || tx != 0 {
				return fmt.Errorf("tx checksum offload = %d, %v; want 0", tx, err)
			}
			if gro, err := ethtoolGet("eth0", unix.ETHTOOL_GGRO); err != nil || gro != 1 {
				return fmt.Errorf("GRO = %d, %v; want 1", gro, err)
			}
			return nil
		})
		if err != nil {
			t.Errorf("host %s: %v", h.Name, err)
		}
		err = topo.InSwitch(func() error {
			l, err := netlink.LinkByIndex(h.PortIndex)
			if err != nil {
				return err
			}
			if l.Attrs().Name != h.Port || l.Attrs().HardwareAddr.String() != h.PortMAC.String() {
				return fmt.Errorf("port is %+v", l.Attrs())
			}
			if tx, err := ethtoolGet(h.Port, unix.ETHTOOL_GTXCSUM); err != nil || tx != 0 {
				return fmt.Errorf("tx checksum offload = %d, %v; want 0", tx, err)
			}
			return nil
		})
		if err != nil {
			t.Errorf("port %s: %v", h.Port, err)
		}
	}
	err := topo.InSwitch(func() error {
		b, err := os.ReadFile("/proc/sys/net/ipv4/ip_forward")
		if err != nil || string(b) != "1\n" {
			return fmt.Errorf("ip_forward = %q, %v", b, err)
		}
		return nil
	})
	if err != nil {
		t.Error(err)
	}

	t.Run("udp", func(t *testing.T) { checkWorkersReachPS(t, topo, 9510) })

	// Worker to worker goes through the switch's routing too.
	t.Run("worker-to-worker", func(t *testing.T) {
		w0, w2 := topo.Workers[0], topo.Workers[2]
		conn := udpListen(t, topo, w2, 9512)
		deliver(t, topo, w0, conn, netip.AddrPortFrom(w2.IP, 9512), "x")
	})
}

// dropARP is an XDP program that drops ARP and passes everything else.
// KernelOffloads leaves the veths as the kernel makes them (TX checksum offload on, GRO off):
// the plain kernel-forwarding topology the benchmark's baselines run on.
func TestKernelOffloads(t *testing.T) {
	topo := newTopo(t, Config{Workers: 2, PS: true, KernelOffloads: true})
	for _, h := range topo.Hosts() {
		check := func(ifname string) error {
			if tx, err := ethtoolGet(ifname, unix.ETHTOOL_GTXCSUM); err != nil || tx != 1 {
				return fmt.Errorf("%s: tx checksum offload = %d, %v; want 1", ifname, tx, err)
			}
			if gro, err := ethtoolGet(ifname, unix.ETHTOOL_GGRO); err != nil || gro != 0 {
				return fmt.Errorf("%s: GRO = %d, %v; want 0", ifname, gro, err)
			}
			return nil
		}
		if err := topo.InHost(h, func() error { return check(h.Ifname) }); err != nil {
			t.Errorf("host %s: %v", h.Name, err)
		}
		if err := topo.InSwitch(func() error { return check(h.Port) }); err != nil {
			t.Errorf("port %s: %v", h.Port, err)
		}
	}
	checkWorkersReachPS(t, topo, 9510)
}

func dropARP(t *testing.T) *ebpf.Program {
	t.Helper()
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:    ebpf.XDP,
		License: "GPL",
		Instructions: asm.Instructions{
			asm.LoadMem(asm.R2, asm.R1, 0, asm.Word), // data
			asm.LoadMem(asm.R3, asm.R1, 4, asm.Word), // data_end
			asm.Mov.Reg(asm.R4, asm.R2),
			asm.Add.Imm(asm.R4, 14),
			asm.JGT.Reg(asm.R4, asm.R3, "pass"),
			asm.LoadMem(asm.R5, asm.R2, 12, asm.Half), // EtherType, network order
			asm.JEq.Imm(asm.R5, 0x0608, "drop"),       // 0x0806 read little-endian
			asm.Mov.Imm(asm.R0, 2).WithSymbol("pass"), // XDP_PASS
			asm.Return(),
			asm.Mov.Imm(asm.R0, 1).WithSymbol("drop"), // XDP_DROP
			asm.Return(),
		},
	})
	if err != nil {
		t.Fatalf("load ARP-dropping XDP program: %v", err)
	}
	t.Cleanup(func() { prog.Close() })
	return prog
}

// With every ARP packet dropped on every interface (host side through Config.HostXDP, switch side
// attached here), hosts still reach each other: only the static neighbours are used. Nothing uses
// ICMP either.
func TestNoARPNeeded(t *testing.T) {
	prog := dropARP(t)
	topo := newTopo(t, Config{Workers: 3, PS: true, HostXDP: prog})
	for _, h := range topo.Hosts() {
		err := topo.InSwitch(func() error {
			l, err := link.AttachXDP(link.XDPOptions{Program: prog, Interface: h.PortIndex, Flags: link.XDPDriverMode})
			if err != nil {
				return err
			}
			t.Cleanup(func() { l.Close() })
			return nil
		})
		if err != nil {
			t.Fatalf("attach to port %s: %v", h.Port, err)
		}
	}
	checkWorkersReachPS(t, topo, 9510)
	w0, w2 := topo.Workers[0], topo.Workers[2]
	conn := udpListen(t, topo, w2, 9512)
	deliver(t, topo, w0, conn, netip.AddrPortFrom(w2.IP, 9512), "x")
	// Control: without its static neighbour, w1 cannot reach anything (its ARP requests are
	// dropped), so the program really drops ARP; with the neighbour back, it can again.
	w1 := topo.Workers[1]
	gwNeigh := &netlink.Neigh{
		LinkIndex: w1.Ifindex, Family: netlink.FAMILY_V4, State: netlink.NUD_PERMANENT,
		IP: w1.Gateway.AsSlice(), HardwareAddr: w1.PortMAC,
	}
	if err := topo.InHost(w1, func() error { return netlink.NeighDel(gwNeigh) }); err != nil {
		t.Fatal(err)
	}
	sendUDP(t, topo, w1, netip.AddrPortFrom(w2.IP, 9512), []byte("lost"))
	_ = conn.SetReadDeadline(time.Now().Add(1500 * time.Millisecond))
	if _, from, err := conn.ReadFromUDPAddrPort(make([]byte, 16)); err == nil {
		t.Fatalf("w1 reached w2 (from %v) without a static neighbour: ARP was not dropped", from)
	}
	if err := topo.InHost(w1, func() error {
		if err := netlink.NeighDel(gwNeigh); err != nil && !errors.Is(err, unix.ENOENT) {
			return err // remove the FAILED/INCOMPLETE entry the attempt left
		}
		return netlink.NeighSet(gwNeigh)
	}); err != nil {
		t.Fatal(err)
	}
	deliver(t, topo, w1, conn, netip.AddrPortFrom(w2.IP, 9512), "found")
	// No IPv4 neighbour anywhere was learned: all are permanent (or NOARP, which never resolves).
	for _, ns := range append([]string{topo.SwitchNS}, hostNSNames(topo)...) {
		err := Do(ns, func() error {
			neighs, err := netlink.NeighList(0, netlink.FAMILY_V4)
			if err != nil {
				return err
			}
			for _, n := range neighs {
				if n.State != netlink.NUD_PERMANENT && n.State != netlink.NUD_NOARP {
					return fmt.Errorf("non-static neighbour %+v", n)
				}
			}
			return nil
		})
		if err != nil {
			t.Errorf("%s: %v", ns, err)
		}
	}
}

func hostNSNames(topo *Topology) []string {
	var out []string
	for _, h := range topo.Hosts() {
		out = append(out, h.NSName)
	}
	return out
}

func TestHostXDPAndMTU(t *testing.T) {
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:    ebpf.XDP,
		License: "GPL",
		Instructions: asm.Instructions{
			asm.Mov.Imm(asm.R0, 2), // XDP_PASS
			asm.Return(),
		},
	})
	if err != nil {
		t.Fatalf("load XDP_PASS program: %v", err)
	}
	defer prog.Close()
	topo := newTopo(t, Config{Workers: 2, PS: true, MTU: 3000, HostXDP: prog})
	for _, h := range topo.Hosts() {
		err := topo.InHost(h, func() error {
			l, err := netlink.LinkByIndex(h.Ifindex)
			if err != nil {
				return err
			}
			if x := l.Attrs().Xdp; x == nil || !x.Attached {
				return fmt.Errorf("no XDP program on eth0: %+v", x)
			}
			if l.Attrs().MTU != 3000 {
				return fmt.Errorf("MTU %d", l.Attrs().MTU)
			}
			return nil
		})
		if err != nil {
			t.Errorf("host %s: %v", h.Name, err)
		}
		err = topo.InSwitch(func() error {
			l, err := netlink.LinkByIndex(h.PortIndex)
			if err != nil {
				return err
			}
			if l.Attrs().MTU != 3000 {
				return fmt.Errorf("port MTU %d", l.Attrs().MTU)
			}
			return nil
		})
		if err != nil {
			t.Errorf("port %s: %v", h.Port, err)
		}
	}
	checkWorkersReachPS(t, topo, 9510)
	// A datagram bigger than 1500 bytes but within the MTU crosses unfragmented.
	conn := udpListen(t, topo, topo.PS, 9513)
	big := strings.Repeat("b", 2900)
	deliver(t, topo, topo.Workers[1], conn, netip.AddrPortFrom(topo.PS.IP, 9513), big)
	// Close releases the XDP links.
	if err := topo.Close(); err != nil {
		t.Fatal(err)
	}
	if err := topo.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

func TestConfigErrors(t *testing.T) {
	prefix := NewPrefix()
	for _, cfg := range []Config{
		{Prefix: prefix, Workers: 0},
		{Prefix: prefix, Workers: MaxWorkers + 1},
		{Prefix: prefix + "/x", Workers: 1},
		{Prefix: prefix, Workers: 1, MTU: 20},
	} {
		topo, err := New(cfg)
		if !errors.Is(err, ErrConfig) || topo != nil {
			t.Errorf("New(%+v) = %v, %v; want ErrConfig", cfg, topo, err)
		}
		if err := topo.Close(); err != nil { // nil topology: a no-op
			t.Errorf("Close of nil topology: %v", err)
		}
	}
	assertNoLeftovers(t, prefix)
}

// A New that fails half-way tears down what it made, and leaves alone a namespace it did not make.
func TestFailedNewCleansUp(t *testing.T) {
	t.Run("attach-fails", func(t *testing.T) {
		// A socket filter cannot be attached as XDP: New fails after namespaces, veths and
		// addresses exist.
		prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
			Type:         ebpf.SocketFilter,
			License:      "GPL",
			Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 0), asm.Return()},
		})
		if err != nil {
			t.Fatal(err)
		}
		defer prog.Close()
		prefix := NewPrefix()
		topo, err := New(Config{Prefix: prefix, Workers: 2, PS: true, HostXDP: prog})
		if err == nil || topo != nil {
			t.Fatalf("New = %v, %v; want an attach error", topo, err)
		}
		t.Logf("New failed as expected: %v", err)
		assertNoLeftovers(t, prefix)
	})
	t.Run("name-taken", func(t *testing.T) {
		prefix := NewPrefix()
		squat, created, err := newNamed(prefix + "-w1")
		if err != nil || !created {
			t.Fatalf("pre-create namespace: %v", err)
		}
		squat.Close()
		defer deleteNamed(prefix + "-w1")
		topo, err := New(Config{Prefix: prefix, Workers: 3})
		if err == nil || topo != nil || !errors.Is(err, os.ErrExist) {
			t.Fatalf("New = %v, %v; want a name clash", topo, err)
		}
		left, err := Leftovers(prefix)
		if err != nil || !slices.Equal(left, []string{prefix + "-w1"}) {
			t.Fatalf("Leftovers = %v, %v; want only the pre-existing namespace", left, err)
		}
		if err := deleteNamed(prefix + "-w1"); err != nil {
			t.Fatal(err)
		}
		assertNoLeftovers(t, prefix)
	})
}

func TestDo(t *testing.T) {
	topo := newTopo(t, Config{Workers: 1})
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	before := threadNS(t)
	var inside uint64
	if err := topo.InSwitch(func() error { inside = threadNS(t); return nil }); err != nil {
		t.Fatal(err)
	}
	if inside == before {
		t.Error("InSwitch ran in the caller's namespace")
	}
	sentinel := errors.New("sentinel")
	if err := topo.InHost(topo.Workers[0], func() error { return sentinel }); !errors.Is(err, sentinel) {
		t.Errorf("InHost error = %v, want the sentinel", err)
	}
	if after := threadNS(t); after != before {
		t.Error("caller's thread changed namespace")
	}
	// A panic in fn reaches the caller.
	func() {
		defer func() {
			if v := recover(); v != "boom" {
				t.Errorf("recovered %v, want boom", v)
			}
		}()
		_ = topo.InSwitch(func() error { panic("boom") })
	}()
	if err := Do(NewPrefix()+"-nope", func() error { return nil }); err == nil {
		t.Error("Do in a missing namespace succeeded")
	}
	// The switch namespace is not the host's.
	swh, err := netns.GetFromName(topo.SwitchNS)
	if err != nil {
		t.Fatal(err)
	}
	defer swh.Close()
	hh, err := netns.GetFromName(topo.Workers[0].NSName)
	if err != nil {
		t.Fatal(err)
	}
	defer hh.Close()
	if swh.Equal(hh) {
		t.Error("switch and host share a namespace")
	}
}

// SetThreadedNAPI switches every veth with NAPI (the switch's ports and the hosts' interfaces,
// GRO on as the XDP testbed sets them) to threaded NAPI and back, read back from each namespace's
// own sysfs.
func TestSetThreadedNAPI(t *testing.T) {
	topo := newTopo(t, Config{Workers: 2, PS: true})
	read := func() map[string]string {
		got := map[string]string{}
		byNS := map[string][]string{topo.SwitchNS: nil}
		for _, h := range topo.Hosts() {
			byNS[topo.SwitchNS] = append(byNS[topo.SwitchNS], h.Port)
			byNS[h.NSName] = append(byNS[h.NSName], h.Ifname)
		}
		for ns, devs := range byNS {
			err := inNetSysfs(topo.nsHandles[ns], func(sys string) error {
				for _, d := range devs {
					b, err := os.ReadFile(sys + "/class/net/" + d + "/threaded")
					if err != nil {
						return err
					}
					got[ns+"/"+d] = strings.TrimSpace(string(b))
				}
				return nil
			})
			if err != nil {
				t.Fatalf("read threaded in %s: %v", ns, err)
			}
		}
		return got
	}
	for _, on := range []bool{true, false} {
		if err := topo.SetThreadedNAPI(on); err != nil {
			t.Fatalf("SetThreadedNAPI(%v): %v", on, err)
		}
		want := map[bool]string{true: "1", false: "0"}[on]
		got := read()
		if len(got) != 2*len(topo.Hosts()) {
			t.Fatalf("read %d devices, want %d", len(got), 2*len(topo.Hosts()))
		}
		for dev, v := range got {
			if v != want {
				t.Errorf("SetThreadedNAPI(%v): %s threaded = %q", on, dev, v)
			}
		}
	}
}
