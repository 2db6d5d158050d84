package bpf_test

// xdpagg_egress, the devmap program run on every broadcast copy of a result.
//
// Linux refuses BPF_PROG_TEST_RUN for programs loaded with expected attach type BPF_XDP_DEVMAP
// (bpf_prog_test_run_xdp returns EINVAL), and a plain XDP program may not read
// xdp_md.egress_ifindex, so the program cannot be run alone. TestEgress tries anyway (and runs the
// cases that way should a kernel allow it), then runs them for real: in a private network
// namespace with veth pairs as switch ports, xdpagg_switch is test-run in live-frame mode
// (BPF_F_TEST_XDP_LIVE_FRAMES), so its XDP_REDIRECT really broadcasts through the `ports` devmap,
// the kernel runs xdpagg_egress per port with the port's egress_ifindex, and the copies that
// survive are captured with AF_PACKET on the veth peers.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"runtime"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
)

// egressCopy is the copy of result frame res that xdpagg_egress sends to member mb.
func egressCopy(res frame, mb maps.Member) frame {
	return res.with(func(f *frame) {
		copy(f.DstMAC[:], mb.MAC)
		copy(f.SrcMAC[:], mb.PortMAC)
		f.SrcIP = mb.SrcIP.As4()
		f.DstIP = mb.Addr.Addr().As4()
		f.TTL = 64
		f.SrcPort = aggPort
		f.DstPort = mb.Addr.Port()
		f.NoUDPCsum = true
	})
}

func member(job uint32, w uint8, ifindex int, mac, portMAC net.HardwareAddr) maps.Member {
	ip := workerIP(w)
	return maps.Member{
		JobID: job, WorkerID: w, Ifindex: uint32(ifindex),
		Addr: netip.AddrPortFrom(netip.AddrFrom4(ip), 50000+uint16(w)),
		MAC:  mac, PortMAC: portMAC, SrcIP: netip.AddrFrom4(psIP),
	}
}

func TestEgress(t *testing.T) {
	t.Run("BPF_PROG_TEST_RUN", testEgressTestRun)
	t.Run("live frames through the ports devmap", testEgressLive)
}

func testEgressTestRun(t *testing.T) {
	s := load(t, 0)
	res := resultFrame(7, 1, 0, 2, 1, 2, 3).with(func(f *frame) { f.TTL = 9 })
	in := res.bytes()
	opts := &ebpf.RunOptions{Data: in, DataOut: make([]byte, len(in)+512)}
	_, err := s.Objects.XdpaggEgress.Run(opts)
	skipIfNotSupported(t, err)
	if errors.Is(err, unix.EINVAL) {
		// EINVAL is the kernel's answer for one reason only that this test accepts:
		// bpf_prog_test_run_xdp refuses programs whose expected attach type is BPF_XDP_DEVMAP
		// (or BPF_XDP_CPUMAP) before it looks at the input. Anything else returning EINVAL (the
		// frame, the options, a program that lost its devmap attach type) is a failure.
		egressRefusedAsDevmap(t, s, opts)
		t.Logf("kernel refuses BPF_PROG_TEST_RUN of xdpagg_egress (expected attach type BPF_XDP_DEVMAP): %v; "+
			"the egress cases run with live frames instead (next subtest)", err)
		return
	}
	if err != nil {
		t.Fatalf("test run of xdpagg_egress: %v", err)
	}
	// This kernel runs devmap programs alone; egress_ifindex is then 0.
	mb := member(7, 1, 0, net.HardwareAddr{2, 0, 0, 0, 1, 1}, net.HardwareAddr{2, 0, 0, 0, 0, 0xfe})
	if err := s.Maps.PutMember(mb); err != nil {
		t.Fatal(err)
	}
	s.expectDelta(t, cnt{maps.CntEgressSkip: 1}) // the probe above had no member yet
	for _, c := range []struct {
		name    string
		in      frame
		verdict uint32
		want    frame
		delta   cnt
	}{
		{"result of a member's job", res, xdpPass, egressCopy(res, mb), cnt{maps.CntEgressTx: 1}},
		{"result of a job without a member here", resultFrame(8, 1, 0, 2, 1), xdpDrop, resultFrame(8, 1, 0, 2, 1), cnt{maps.CntEgressSkip: 1}},
		{"data frame", dataFrame(7, 1, 0, 0, 2, 1), xdpPass, dataFrame(7, 1, 0, 0, 2, 1), cnt{}},
		{"malformed result", res.with(setHdr(func(h *bpf.XdpaggHdr) { h.Version = 2 })), xdpPass,
			res.with(setHdr(func(h *bpf.XdpaggHdr) { h.Version = 2 })), cnt{}},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, out := runProg(t, s.Objects.XdpaggEgress, c.in.bytes())
			if got != c.verdict {
				t.Errorf("verdict %s, want %s", verdictName(got), verdictName(c.verdict))
			}
			if got == xdpPass {
				expectFrame(t, out, c.want)
			}
			s.expectDelta(t, c.delta)
		})
	}
}

// egressRefusedAsDevmap checks that an EINVAL from test-running xdpagg_egress with opts can only
// be the kernel's refusal of devmap programs: xdpagg_egress is loaded with expected attach type
// BPF_XDP_DEVMAP (SEC("xdp/devmap"), as the `ports` devmap requires of its programs), and the
// same frame and options test-run fine through a plain XDP program of the same object.
func egressRefusedAsDevmap(t *testing.T, s *sw, opts *ebpf.RunOptions) {
	t.Helper()
	spec, err := loader.Spec(testConfig(0).WithDefaults()) // what load(t, 0) loaded
	if err != nil {
		t.Fatalf("the switch's collection spec: %v", err)
	}
	ps := spec.Programs[bpf.XdpaggProgXdpaggEgress]
	if ps == nil || ps.Type != ebpf.XDP || ps.AttachType != ebpf.AttachXDPDevMap {
		t.Fatalf("BPF_PROG_TEST_RUN of xdpagg_egress: EINVAL, but the program is not an XDP devmap program (spec %+v): "+
			"the kernel refuses test runs only of those", ps)
	}
	plain := *opts
	plain.DataOut = make([]byte, len(opts.Data)+512)
	ret, err := s.Objects.XdpaggPass.Run(&plain)
	if err != nil || ret != xdpPass {
		t.Fatalf("the same frame and options through xdpagg_pass (plain XDP): verdict %s, %v; want XDP_PASS, nil: "+
			"the EINVAL was not the devmap refusal", verdictName(ret), err)
	}
}

func skipIfNotSupported(t *testing.T, err error) {
	t.Helper()
	if errors.Is(err, ebpf.ErrNotSupported) {
		t.Skipf("kernel lacks a feature (ebpf.ErrNotSupported): %v", err)
	}
}

func testEgressLive(t *testing.T) {
	// Never unlocked: the thread, in its own network namespace, exits with this test goroutine.
	runtime.LockOSThread()
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		t.Fatalf("enter a new network namespace: %v", err)
	}
	s := load(t, 0)
	nl := newNetlink(t)
	// Two switch ports: p0 (peer h0, where job 7's worker 1 lives) and p1 (peer h1).
	p0, h0 := nl.veth(t, "xagg-p0", "xagg-h0")
	p1, h1 := nl.veth(t, "xagg-p1", "xagg-h1")
	for _, ifc := range []*net.Interface{p0, p1} {
		// The devmap entry AttachPort makes, without the switch program itself on the port
		// (its counters would see the veth's own IPv6 chatter).
		val := bpf.XdpaggBpfDevmapVal{Ifindex: uint32(ifc.Index)}
		val.BpfProg.Fd = int32(s.Objects.XdpaggEgress.FD())
		if err := s.Objects.Ports.Put(uint32(ifc.Index), &val); err != nil {
			t.Fatalf("add %s to the ports devmap: %v", ifc.Name, err)
		}
	}
	for _, ifc := range []*net.Interface{h0, h1} {
		// A veth delivers XDP frames only if its peer runs XDP: that is what xdpagg_pass is for.
		l, err := link.AttachXDP(link.XDPOptions{Program: s.Objects.XdpaggPass, Interface: ifc.Index, Flags: link.XDPDriverMode})
		skipIfNotSupported(t, err)
		if err != nil {
			t.Fatalf("attach xdpagg_pass to %s: %v", ifc.Name, err)
		}
		t.Cleanup(func() { l.Close() })
	}
	cap0, cap1 := newCapture(t, h0), newCapture(t, h1)
	m7 := member(7, 1, p0.Index, h0.HardwareAddr, p0.HardwareAddr)
	if err := s.Maps.PutMember(m7); err != nil {
		t.Fatal(err)
	}
	// bcast puts a frame straight into the ports devmap, as xdpagg_switch does with results: the
	// way to hand xdpagg_egress what the switch never broadcasts (non-results, malformed ones).
	bcast := broadcastProg(t, s.Objects.Ports)
	live := func(t *testing.T, prog *ebpf.Program, f frame) {
		t.Helper()
		if prog == nil {
			prog = s.Objects.XdpaggSwitch
		}
		_, err := prog.Run(&ebpf.RunOptions{Data: f.bytes(), Flags: unix.BPF_F_TEST_XDP_LIVE_FRAMES, Repeat: 1})
		skipIfNotSupported(t, err)
		if err != nil {
			t.Fatalf("live-frame run: %v", err)
		}
	}

	data := dataFrame(7, 3, 1, 0, 1, 5, -6, 7).with(func(f *frame) { f.TTL = 3 })
	psRes := resultFrame(7, 4, 2, 2, 100, 200)
	m8 := member(8, 0, p1.Index, h1.HardwareAddr, p1.HardwareAddr)
	direct := resultFrame(7, 5, 0, 2, 1, 2, 3).with(func(f *frame) { f.TTL = 9 })
	otherData := dataFrame(7, 1, 0, 0, 2, 1)
	badVersion := direct.with(setHdr(func(h *bpf.XdpaggHdr) { h.Version = 2 }))
	cases := []struct {
		name      string
		setup     func(t *testing.T)
		via       *ebpf.Program // what runs on the frame: nil for xdpagg_switch, or bcast
		in        frame
		delta     cnt
		want0     *frame // copy expected on h0 (nil: none)
		want1     *frame // copy expected on h1
		untouched bool   // the copies are the frame as it came (else rewritten by xdpagg_egress)
	}{
		{name: "switch-completed result: rewritten for job 7's member on p0, dropped on p1",
			in:    data,
			delta: cnt{maps.CntRx: 1, maps.CntAggregated: 1, maps.CntCompleted: 1, maps.CntEgressTx: 1, maps.CntEgressSkip: 1},
			want0: ptr(egressCopy(asResult(data, 1, fFromSwitch, data.Vals), m7))},
		{name: "PS result for job 7",
			in:    psRes,
			delta: cnt{maps.CntRx: 1, maps.CntPSResult: 1, maps.CntEgressTx: 1, maps.CntEgressSkip: 1},
			want0: ptr(egressCopy(psRes, m7))},
		{name: "PS result for job 8 without members: dropped on both ports",
			in:    resultFrame(8, 1, 0, 1, 9),
			delta: cnt{maps.CntRx: 1, maps.CntPSResult: 1, maps.CntEgressSkip: 2}},
		{name: "PS result for job 8 once it has a member on p1",
			setup: func(t *testing.T) {
				if err := s.Maps.PutMember(m8); err != nil {
					t.Fatal(err)
				}
			},
			in:    resultFrame(8, 2, 0, 1, 9),
			delta: cnt{maps.CntRx: 1, maps.CntPSResult: 1, maps.CntEgressTx: 1, maps.CntEgressSkip: 1},
			want1: ptr(egressCopy(resultFrame(8, 2, 0, 1, 9), m8))},
		// The cases a kernel that test-runs devmap programs alone covers in the first subtest,
		// here for every kernel.
		{name: "result straight into the devmap: rewritten for job 7's member on p0, dropped on p1",
			via: bcast, in: direct,
			delta: cnt{maps.CntEgressTx: 1, maps.CntEgressSkip: 1},
			want0: ptr(egressCopy(direct, m7))},
		{name: "data frame straight into the devmap: out untouched (XDP_PASS) on both ports",
			via: bcast, in: otherData, delta: cnt{}, want0: &otherData, want1: &otherData, untouched: true},
		{name: "malformed result straight into the devmap: out untouched (XDP_PASS) on both ports",
			via: bcast, in: badVersion, delta: cnt{}, want0: &badVersion, want1: &badVersion, untouched: true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if c.setup != nil {
				c.setup(t)
			}
			live(t, c.via, c.in)
			got0 := cap0.frames(t, c.want0 != nil)
			got1 := cap1.frames(t, c.want1 != nil)
			for _, x := range []struct {
				port string
				got  [][]byte
				want *frame
			}{{"h0", got0, c.want0}, {"h1", got1, c.want1}} {
				switch {
				case x.want == nil && len(x.got) > 0:
					t.Errorf("%s received %d xdpagg frames, want none", x.port, len(x.got))
				case x.want != nil && len(x.got) != 1:
					t.Errorf("%s received %d xdpagg frames, want 1", x.port, len(x.got))
				case x.want != nil && c.untouched:
					expectFrame(t, x.got[0], *x.want)
				case x.want != nil:
					out := x.got[0]
					expectFrame(t, out, *x.want)
					d := decode(t, out)
					if !ipChecksumOK(out[offIP:offUDP]) || d.ttl != 64 || d.udpCsum != 0 {
						t.Errorf("%s: IP checksum ok %v, TTL %d, UDP checksum %#x", x.port, ipChecksumOK(out[offIP:offUDP]), d.ttl, d.udpCsum)
					}
				}
			}
			s.expectDelta(t, c.delta)
		})
	}
}

// broadcastProg is an XDP program that redirects every frame to all ports of the devmap ports
// (bpf_redirect_map with BPF_F_BROADCAST), where each port's program, xdpagg_egress, runs on it.
func broadcastProg(t *testing.T, ports *ebpf.Map) *ebpf.Program {
	t.Helper()
	const bpfFBroadcast = 1 << 3 // BPF_F_BROADCAST, include/uapi/linux/bpf.h
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type: ebpf.XDP,
		Instructions: asm.Instructions{
			asm.LoadMapPtr(asm.R1, ports.FD()),
			asm.Mov.Imm(asm.R2, 0),
			asm.Mov.Imm(asm.R3, bpfFBroadcast),
			asm.FnRedirectMap.Call(),
			asm.Return(),
		},
		License: "GPL",
	})
	skipIfNotSupported(t, err)
	if err != nil {
		t.Fatalf("load the broadcast program: %v", err)
	}
	t.Cleanup(func() { prog.Close() })
	return prog
}

// ---- minimal rtnetlink, to make veth pairs without external tools ----

type netlinkConn struct{ fd, seq int }

func newNetlink(t *testing.T) *netlinkConn {
	t.Helper()
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
	if err != nil {
		t.Fatalf("netlink socket: %v", err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		t.Fatalf("bind netlink socket: %v", err)
	}
	return &netlinkConn{fd: fd}
}

func rtattr(typ uint16, data []byte) []byte {
	b := binary.NativeEndian.AppendUint16(nil, uint16(4+len(data)))
	b = binary.NativeEndian.AppendUint16(b, typ)
	b = append(b, data...)
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

func ifinfomsg(index int, flags, change uint32) []byte {
	b := make([]byte, unix.SizeofIfInfomsg)
	binary.NativeEndian.PutUint32(b[4:], uint32(index))
	binary.NativeEndian.PutUint32(b[8:], flags)
	binary.NativeEndian.PutUint32(b[12:], change)
	return b
}

func (c *netlinkConn) request(typ, flags uint16, body []byte) error {
	c.seq++
	msg := binary.NativeEndian.AppendUint32(nil, uint32(unix.SizeofNlMsghdr+len(body)))
	msg = binary.NativeEndian.AppendUint16(msg, typ)
	msg = binary.NativeEndian.AppendUint16(msg, flags|unix.NLM_F_REQUEST|unix.NLM_F_ACK)
	msg = binary.NativeEndian.AppendUint32(msg, uint32(c.seq))
	msg = binary.NativeEndian.AppendUint32(msg, 0)
	msg = append(msg, body...)
	if err := unix.Sendto(c.fd, msg, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return err
	}
	buf := make([]byte, 8192)
	for {
		n, _, err := unix.Recvfrom(c.fd, buf, 0)
		if err != nil {
			return err
		}
		for b := buf[:n]; len(b) >= unix.SizeofNlMsghdr; {
			l := int(binary.NativeEndian.Uint32(b))
			if l < unix.SizeofNlMsghdr || l > len(b) {
				return fmt.Errorf("bad netlink message length %d", l)
			}
			if binary.NativeEndian.Uint16(b[4:]) == unix.NLMSG_ERROR && int(binary.NativeEndian.Uint32(b[8:])) == c.seq {
				if e := int32(binary.NativeEndian.Uint32(b[16:])); e != 0 {
					return unix.Errno(-e)
				}
				return nil
			}
			b = b[(l+3)&^3:]
		}
	}
}

// veth creates an up veth pair and returns both ends.
func (c *netlinkConn) veth(t *testing.T, name, peer string) (*net.Interface, *net.Interface) {
	t.Helper()
	const vethInfoPeer = 1
	peerInfo := append(ifinfomsg(0, 0, 0), rtattr(unix.IFLA_IFNAME, append([]byte(peer), 0))...)
	body := append(ifinfomsg(0, 0, 0), rtattr(unix.IFLA_IFNAME, append([]byte(name), 0))...)
	body = append(body, rtattr(unix.IFLA_LINKINFO, append(rtattr(unix.IFLA_INFO_KIND, []byte("veth")),
		rtattr(unix.IFLA_INFO_DATA, rtattr(vethInfoPeer, peerInfo))...))...)
	if err := c.request(unix.RTM_NEWLINK, unix.NLM_F_CREATE|unix.NLM_F_EXCL, body); err != nil {
		t.Fatalf("create veth %s/%s: %v", name, peer, err)
	}
	var out []*net.Interface
	for _, n := range []string{name, peer} {
		ifc, err := net.InterfaceByName(n)
		if err != nil {
			t.Fatalf("find %s: %v", n, err)
		}
		if err := c.request(unix.RTM_NEWLINK, 0, ifinfomsg(ifc.Index, unix.IFF_UP, unix.IFF_UP)); err != nil {
			t.Fatalf("set %s up: %v", n, err)
		}
		out = append(out, ifc)
	}
	return out[0], out[1]
}

// ---- AF_PACKET capture of xdpagg frames arriving at an interface ----

type capture struct {
	fd  int
	ifc *net.Interface
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

func newCapture(t *testing.T, ifc *net.Interface) *capture {
	t.Helper()
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_ALL)))
	if err != nil {
		t.Fatalf("packet socket: %v", err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: ifc.Index}); err != nil {
		t.Fatalf("bind packet socket to %s: %v", ifc.Name, err)
	}
	return &capture{fd: fd, ifc: ifc}
}

// frames returns the xdpagg frames (IPv4/UDP from or to the agg port) that arrived, waiting up
// to 5 s when one is expected (a bound for a loaded machine, where softirqs can be late; it
// returns as soon as one is there and 100 ms have passed) and a little while otherwise.
func (c *capture) frames(t *testing.T, expect bool) [][]byte {
	t.Helper()
	wait := 200 * time.Millisecond
	if expect {
		wait = 5 * time.Second
	}
	deadline := time.Now().Add(wait)
	var out [][]byte
	buf := make([]byte, 4096)
	for {
		left := time.Until(deadline)
		if left <= 0 || (expect && len(out) > 0 && left < wait-100*time.Millisecond) {
			return out
		}
		tv := unix.NsecToTimeval(min(left, 50*time.Millisecond).Nanoseconds())
		if err := unix.SetsockoptTimeval(c.fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
			t.Fatalf("SO_RCVTIMEO: %v", err)
		}
		n, from, err := unix.Recvfrom(c.fd, buf, 0)
		if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			t.Fatalf("read %s: %v", c.ifc.Name, err)
		}
		if ll, ok := from.(*unix.SockaddrLinklayer); ok && ll.Pkttype == unix.PACKET_OUTGOING {
			continue
		}
		b := buf[:n]
		if n < offHdr || binary.BigEndian.Uint16(b[12:]) != 0x0800 || b[offIP+9] != 17 {
			continue
		}
		if binary.BigEndian.Uint16(b[offUDP:]) != aggPort && binary.BigEndian.Uint16(b[offUDP+2:]) != aggPort {
			continue
		}
		out = append(out, append([]byte(nil), b...))
	}
}
