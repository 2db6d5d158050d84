package hostlib

import (
	"encoding/binary"
	"errors"
	"net/netip"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/internal/bpftest"
	"github.com/xdpagg/xdpagg/wire"
)

// xskFrameOf builds an Ethernet/IPv4/UDP frame from src to dst carrying payload, with a correct
// UDP checksum if csum (else 0: none).
func xskFrameOf(src, dst netip.AddrPort, payload []byte, csum bool) []byte {
	b := make([]byte, 14+20+8+len(payload))
	binary.BigEndian.PutUint16(b[12:], 0x0800)
	ip := b[14:]
	ip[0] = 0x45
	binary.BigEndian.PutUint16(ip[2:], uint16(20+8+len(payload)))
	ip[8], ip[9] = 64, unix.IPPROTO_UDP
	s, d := src.Addr().As4(), dst.Addr().As4()
	copy(ip[12:], s[:])
	copy(ip[16:], d[:])
	udp := ip[20:]
	binary.BigEndian.PutUint16(udp[0:], src.Port())
	binary.BigEndian.PutUint16(udp[2:], dst.Port())
	binary.BigEndian.PutUint16(udp[4:], uint16(8+len(payload)))
	copy(udp[8:], payload)
	if csum {
		c := ^udpChecksum(ip[12:20], udp)
		if c == 0 {
			c = 0xffff
		}
		binary.BigEndian.PutUint16(udp[6:], c)
	}
	return b
}

// TestParseFrame: what the AF_XDP path takes as a datagram is what the kernel would have handed
// the UDP socket; anything else is errFrame.
func TestParseFrame(t *testing.T) {
	local := netip.MustParseAddrPort("10.0.0.1:9600")
	src := netip.MustParseAddrPort("10.0.0.9:9510")
	payload := []byte("xdpagg result bytes, odd length!!")
	good := xskFrameOf(src, local, payload, false)
	mod := func(f func(b []byte)) []byte {
		b := append([]byte(nil), good...)
		f(b)
		return b
	}
	tests := []struct {
		name string
		f    []byte
		ok   bool
	}{
		{"no checksum", good, true},
		{"right checksum", xskFrameOf(src, local, payload, true), true},
		{"wrong checksum", mod(func(b []byte) { binary.BigEndian.PutUint16(b[14+20+6:], 0x1234) }), false},
		{"corrupt payload under a checksum", func() []byte {
			b := xskFrameOf(src, local, payload, true)
			b[len(b)-1] ^= 1
			return b
		}(), false},
		{"Ethernet padding after the datagram", append(append([]byte(nil), good...), 0, 0, 0, 0), true},
		{"not IPv4", mod(func(b []byte) { b[12] = 0x86 }), false},
		{"IP options", mod(func(b []byte) { b[14] = 0x46 }), false},
		{"TCP", mod(func(b []byte) { b[14+9] = unix.IPPROTO_TCP }), false},
		{"fragment", mod(func(b []byte) { b[14+6] = 0x20 }), false},
		{"other address", mod(func(b []byte) { b[14+19]++ }), false},
		{"other port", mod(func(b []byte) { b[14+20+3]++ }), false},
		{"IP length past the frame", mod(func(b []byte) { binary.BigEndian.PutUint16(b[14+2:], 2000) }), false},
		{"UDP length past IP", mod(func(b []byte) { binary.BigEndian.PutUint16(b[14+20+4:], 2000) }), false},
		{"UDP length under its header", mod(func(b []byte) { binary.BigEndian.PutUint16(b[14+20+4:], 7) }), false},
		{"runt", good[:40], false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var from unix.RawSockaddrInet4
			got, err := parseFrame(tc.f, local.Addr().As4(), local.Port(), &from)
			if !tc.ok {
				if err != errFrame {
					t.Fatalf("got %q, %v; want errFrame", got, err)
				}
				return
			}
			if err != nil || string(got) != string(payload) {
				t.Fatalf("got %q, %v; want the payload", got, err)
			}
			if want := sockaddr4(src); from != want {
				t.Errorf("from %+v, want %+v", from, want)
			}
		})
	}
}

// TestWorkerAFXDPRings: frames into a worker's AF_XDP socket, several times the UMEM over, each
// reach the worker's checks once (results of no running allreduce count as duplicates, foreign
// sources as foreign, bad frames as malformed) or are counted dropped by the kernel: the fill
// ring gets every frame back. The interface is free again after Close.
func TestWorkerAFXDPRings(t *testing.T) {
	bpftest.InNewNetns(t)
	nl, err := netlink.NewHandle() // made in the test's namespace
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nl.Close)
	if err := nl.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "xsk0"}, PeerName: "xsk1"}); err != nil {
		t.Fatalf("add veth: %v", err)
	}
	a, err := nl.LinkByName("xsk0")
	if err != nil {
		t.Fatal(err)
	}
	b, err := nl.LinkByName("xsk1")
	if err != nil {
		t.Fatal(err)
	}
	addr, _ := netlink.ParseAddr("10.0.0.1/24")
	if err := nl.AddrAdd(a, addr); err != nil {
		t.Fatal(err)
	}
	for _, l := range []netlink.Link{a, b} {
		if err := nl.LinkSetUp(l); err != nil {
			t.Fatal(err)
		}
	}
	local := netip.MustParseAddrPort("10.0.0.1:9600")
	ps := netip.MustParseAddrPort("10.0.0.9:9510")
	cfg := WorkerConfig{JobID: 3, NumWorkers: 2, Local: local, PS: ps, AFXDP: true}
	w, err := NewWorker(cfg)
	bpftest.Check(t, "AF_XDP worker", err) // skips on ebpf.ErrNotSupported, wrapped through ErrAFXDP
	if on, _ := w.AFXDP(); !on {
		t.Fatal("AF_XDP off")
	}

	// A second worker on the same interface cannot have it: the interface runs xdpagg_host.
	cfg2 := cfg
	cfg2.Local = netip.AddrPortFrom(local.Addr(), 9601)
	if w2, err := NewWorker(cfg2); !errors.Is(err, ErrAFXDP) {
		if w2 != nil {
			w2.Close()
		}
		t.Errorf("second AF_XDP worker on the interface: %v, want ErrAFXDP", err)
	}
	cfg2.AFXDPFallback = true
	w2, err := NewWorker(cfg2)
	if err != nil {
		t.Fatalf("second worker with fallback: %v", err)
	}
	if on, why := w2.AFXDP(); on || !errors.Is(why, ErrAFXDP) {
		t.Errorf("second worker with fallback: AF_XDP %v (%v), want off with ErrAFXDP", on, why)
	}
	w2.Close()

	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	to := &unix.SockaddrLinklayer{Ifindex: b.Attrs().Index, Halen: 6}
	copy(to.Addr[:], a.Attrs().HardwareAddr)
	res := make([]byte, wire.HdrSize+4*wire.StdValues)
	wire.EncodeHeader(res, &wire.Header{Version: wire.Version, Type: wire.MsgResult, JobId: 3, Count: wire.StdValues})
	withMAC := func(f []byte) []byte {
		copy(f[0:], a.Attrs().HardwareAddr)
		copy(f[6:], b.Attrs().HardwareAddr)
		return f
	}
	good := withMAC(xskFrameOf(ps, local, res, false))
	foreign := withMAC(xskFrameOf(netip.MustParseAddrPort("10.0.0.7:9510"), local, res, false))
	bad := withMAC(xskFrameOf(ps, local, res, false))
	binary.BigEndian.PutUint16(bad[14+20+6:], 0x1234)
	const n = 3*xskFrames + 7
	var sent [3]uint64
	for i := range n {
		f := [3][]byte{good, foreign, bad}[i%3]
		for {
			err := unix.Sendto(fd, f, 0, to)
			if err == unix.ENOBUFS || err == unix.EAGAIN {
				time.Sleep(time.Millisecond)
				continue
			}
			if err != nil {
				t.Fatalf("send: %v", err)
			}
			break
		}
		sent[i%3]++
	}
	var st WorkerStats
	var red, drops uint64
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		st = w.Stats()
		if red, drops, err = w.AFXDPCounters(); err != nil {
			t.Fatal(err)
		}
		if st.DuplicateResults+st.Foreign+st.Malformed+drops >= n {
			break
		}
	}
	t.Logf("sent %v (results, foreign, bad checksum); worker: %d duplicates, %d foreign, %d malformed; %d redirected, %d dropped by the kernel",
		sent, st.DuplicateResults, st.Foreign, st.Malformed, red, drops)
	if red != n {
		t.Errorf("host program redirected %d of %d frames", red, n)
	}
	if got := st.DuplicateResults + st.Foreign + st.Malformed + drops; got != n {
		t.Errorf("%d frames accounted for, %d sent", got, n)
	}
	if st.DuplicateResults > sent[0] || st.Foreign > sent[1] || st.Malformed > sent[2] || st.ResultsReceived != 0 {
		t.Errorf("a frame counted under the wrong heading: %+v", st)
	}
	if drops == 0 && (st.DuplicateResults != sent[0] || st.Foreign != sent[1] || st.Malformed != sent[2]) {
		t.Errorf("no drops, yet counts %d/%d/%d differ from sent %v", st.DuplicateResults, st.Foreign, st.Malformed, sent)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	// Closed: the program is detached, and the interface takes a new AF_XDP worker.
	w3, err := NewWorker(cfg)
	if err != nil {
		t.Fatalf("AF_XDP worker after the first closed: %v", err)
	}
	w3.Close()
}

// FuzzParseFrame: whatever the frame, parseFrame never reads out of it, and what it accepts is a
// UDP/IPv4 datagram to the worker, its payload the bytes after the UDP header within both
// length fields.
func FuzzParseFrame(f *testing.F) {
	local := netip.MustParseAddrPort("10.0.0.1:9600")
	src := netip.MustParseAddrPort("10.0.0.9:9510")
	f.Add(xskFrameOf(src, local, []byte("result"), false))
	f.Add(xskFrameOf(src, local, []byte("result"), true))
	f.Add(xskFrameOf(src, local, nil, true))
	f.Fuzz(func(t *testing.T, fr []byte) {
		var from unix.RawSockaddrInet4
		p, err := parseFrame(fr, local.Addr().As4(), local.Port(), &from)
		if err != nil {
			if err != errFrame || p != nil {
				t.Fatalf("refused with %q, %v", p, err)
			}
			return
		}
		ulen := int(binary.BigEndian.Uint16(fr[14+20+4:]))
		tot := int(binary.BigEndian.Uint16(fr[14+2:]))
		switch {
		case fr[14] != 0x45 || fr[14+9] != unix.IPPROTO_UDP:
			t.Fatal("accepted a frame that is not UDP/IPv4 without options")
		case [4]byte(fr[14+16:14+20]) != local.Addr().As4() || binary.BigEndian.Uint16(fr[14+20+2:]) != local.Port():
			t.Fatal("accepted a frame to another address or port")
		case len(p) != ulen-8 || 20+ulen > tot || 14+tot > len(fr):
			t.Fatalf("payload of %d bytes for UDP length %d, IP length %d, frame %d", len(p), ulen, tot, len(fr))
		case len(p) > 0 && &p[0] != &fr[14+20+8]:
			t.Fatal("payload is not the bytes after the UDP header")
		case from.Family != unix.AF_INET || from.Addr != [4]byte(fr[14+12:14+16]):
			t.Fatalf("source %+v", from)
		}
	})
}
