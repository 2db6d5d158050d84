package agent

import (
	"context"
	"encoding/binary"
	"errors"
	"log/slog"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/ipv4"
	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/maps"
)

const (
	testPort    = 7 // the ifindex the tests call a switch port
	msgJoin     = uint8(bpf.XdpaggMsgTypeMSG_JOIN)
	msgLeave    = uint8(bpf.XdpaggMsgTypeMSG_LEAVE)
	msgAck      = uint8(bpf.XdpaggMsgTypeMSG_ACK)
	failsafeFor = time.Second // read deadline that only keeps a broken test from hanging
)

var (
	portMAC   = net.HardwareAddr{0x02, 0xaa, 0, 0, 0, 0x07}
	workerMAC = net.HardwareAddr{0x02, 0xbb, 0, 0, 0, 0x01}
	resultIP  = netip.MustParseAddr("10.200.3.2")
)

// newControl builds a ControlServer over a real UDP socket on 127.0.0.1 (so that ACKs can be sent
// to a local listener) with one switch port, testPort.
func newControl(t *testing.T, m *maps.Maps) *ControlServer {
	t.Helper()
	raw, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("listen: %v", err)
	}
	t.Cleanup(func() { raw.Close() })
	return &ControlServer{conn: ipv4.NewPacketConn(raw), raw: raw, maps: m,
		log: slog.New(slog.DiscardHandler), ports: map[int]net.HardwareAddr{testPort: portMAC}}
}

// worker is the test's stand-in for a worker: a UDP socket that receives the agent's ACKs.
type worker struct {
	conn *net.UDPConn
	addr netip.AddrPort
}

func newWorker(t *testing.T) *worker {
	t.Helper()
	conn, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatalf("listen: %v", err)
	}
	t.Cleanup(func() { conn.Close() })
	return &worker{conn: conn, addr: conn.LocalAddr().(*net.UDPAddr).AddrPort()}
}

// readAck reads one datagram and decodes it as an xdpagg header.
func (w *worker) readAck(t *testing.T) (bpf.XdpaggHdr, netip.AddrPort) {
	t.Helper()
	var h bpf.XdpaggHdr
	if err := w.conn.SetReadDeadline(time.Now().Add(failsafeFor)); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 256)
	n, from, err := w.conn.ReadFromUDPAddrPort(buf)
	if err != nil {
		t.Fatalf("read ACK: %v", err)
	}
	if n != bpf.HdrSize {
		t.Errorf("ACK is %d bytes, want a bare %d-byte header", n, bpf.HdrSize)
	}
	if _, err := binary.Decode(buf[:n], binary.LittleEndian, &h); err != nil {
		t.Fatalf("decode ACK: %v", err)
	}
	return h, from
}

// noDatagram fails the test if a datagram is waiting on the worker's socket. The agent sends its
// ACKs to loopback before handle returns, so there is nothing to wait for.
func (w *worker) noDatagram(t *testing.T) {
	t.Helper()
	rc, err := w.conn.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var n int
	var rerr error
	buf := make([]byte, 256)
	if err := rc.Read(func(fd uintptr) bool {
		n, _, rerr = unix.Recvfrom(int(fd), buf, unix.MSG_DONTWAIT)
		return true
	}); err != nil {
		t.Fatal(err)
	}
	if !errors.Is(rerr, unix.EAGAIN) {
		t.Errorf("unexpected datagram (%d bytes, err %v) on the worker socket", n, rerr)
	}
}

// msg encodes a control message: header, then the join body if any.
func msg(t *testing.T, h bpf.XdpaggHdr, body *bpf.XdpaggJoinBody) []byte {
	t.Helper()
	b, err := binary.Append(nil, binary.LittleEndian, &h)
	if err != nil {
		t.Fatal(err)
	}
	if len(b) != bpf.HdrSize {
		t.Fatalf("header encodes to %d bytes, want %d", len(b), bpf.HdrSize)
	}
	if body != nil {
		if b, err = binary.Append(b, binary.LittleEndian, body); err != nil {
			t.Fatal(err)
		}
	}
	return b
}

func joinBody(mac net.HardwareAddr, rip netip.Addr) *bpf.XdpaggJoinBody {
	var body bpf.XdpaggJoinBody
	copy(body.Mac[:], mac)
	a := rip.As4()
	body.ResultIp = binary.LittleEndian.Uint32(a[:]) // network-order bytes in memory
	return &body
}

func hdr(typ uint8, job uint32, seq uint32, worker uint8) bpf.XdpaggHdr {
	return bpf.XdpaggHdr{Version: bpf.Version, Type: typ, JobId: job, Seq: seq, WorkerId: worker}
}

func members(t *testing.T, m *maps.Maps) []maps.Member {
	t.Helper()
	ms, err := m.ListMembers()
	if err != nil {
		t.Fatalf("ListMembers: %v", err)
	}
	return ms
}

func TestHandleJoinLeave(t *testing.T) {
	sw := loadSwitch(t, 4)
	c := newControl(t, sw.Maps)
	w := newWorker(t)
	srv := c.raw.LocalAddr().(*net.UDPAddr).AddrPort()

	if err := c.handle(msg(t, hdr(msgJoin, 42, 0xdeadbeef, 3), joinBody(workerMAC, resultIP)), testPort, w.addr); err != nil {
		t.Fatalf("JOIN: %v", err)
	}
	ms := members(t, sw.Maps)
	if len(ms) != 1 {
		t.Fatalf("members after JOIN = %+v, want one", ms)
	}
	got := ms[0]
	if got.JobID != 42 || got.WorkerID != 3 || got.Ifindex != testPort || got.Addr != w.addr ||
		got.MAC.String() != workerMAC.String() || got.PortMAC.String() != portMAC.String() || got.SrcIP != resultIP {
		t.Errorf("member = %+v;\nwant job 42 worker 3 ifindex %d addr %v mac %v port mac %v src %v",
			got, testPort, w.addr, workerMAC, portMAC, resultIP)
	}
	ack, from := w.readAck(t)
	want := bpf.XdpaggHdr{Version: bpf.Version, Type: msgAck, JobId: 42, Seq: 0xdeadbeef, WorkerId: 3}
	if ack != want {
		t.Errorf("JOIN ACK = %+v, want %+v", ack, want)
	}
	if from != srv {
		t.Errorf("ACK came from %v, want the control socket %v", from, srv)
	}

	// A second JOIN of the same job on the same port replaces the member (e.g. a restarted worker).
	newMAC := net.HardwareAddr{0x02, 0xbb, 0, 0, 0, 0x09}
	if err := c.handle(msg(t, hdr(msgJoin, 42, 2, 3), joinBody(newMAC, resultIP)), testPort, w.addr); err != nil {
		t.Fatalf("re-JOIN: %v", err)
	}
	if ms := members(t, sw.Maps); len(ms) != 1 || ms[0].MAC.String() != newMAC.String() {
		t.Errorf("members after re-JOIN = %+v, want one with MAC %v", ms, newMAC)
	}
	if ack, _ := w.readAck(t); ack.Type != msgAck || ack.Seq != 2 {
		t.Errorf("re-JOIN ACK = %+v", ack)
	}

	if err := c.handle(msg(t, hdr(msgLeave, 42, 77, 3), joinBody(newMAC, resultIP)), testPort, w.addr); err != nil {
		t.Fatalf("LEAVE: %v", err)
	}
	if ms := members(t, sw.Maps); len(ms) != 0 {
		t.Errorf("members after LEAVE = %+v, want none", ms)
	}
	ack, _ = w.readAck(t)
	want = bpf.XdpaggHdr{Version: bpf.Version, Type: msgAck, JobId: 42, Seq: 77, WorkerId: 3}
	if ack != want {
		t.Errorf("LEAVE ACK = %+v, want %+v", ack, want)
	}
	w.noDatagram(t)
}

func TestHandleJoinUnknownPort(t *testing.T) {
	sw := loadSwitch(t, 4)
	c := newControl(t, sw.Maps)
	w := newWorker(t)
	err := c.handle(msg(t, hdr(msgJoin, 1, 1, 0), joinBody(workerMAC, resultIP)), testPort+1, w.addr)
	if !errors.Is(err, errBadControl) {
		t.Fatalf("JOIN from an unknown ifindex = %v, want errBadControl", err)
	}
	if !strings.Contains(err.Error(), "not a switch port") {
		t.Errorf("error %q does not say the ifindex is not a switch port", err)
	}
	if ms := members(t, sw.Maps); len(ms) != 0 {
		t.Errorf("members = %+v, want none", ms)
	}
	w.noDatagram(t)
}

func TestHandleRejects(t *testing.T) {
	sw := loadSwitch(t, 4)
	c := newControl(t, sw.Maps)
	w := newWorker(t)
	join := msg(t, hdr(msgJoin, 5, 1, 0), joinBody(workerMAC, resultIP))
	withHdr := func(f func(*bpf.XdpaggHdr)) []byte {
		h := hdr(msgJoin, 5, 1, 0)
		f(&h)
		return msg(t, h, joinBody(workerMAC, resultIP))
	}
	for _, tc := range []struct {
		name string
		b    []byte
		is   error
		want string
	}{
		{"empty", nil, errBadControl, "0 bytes"},
		{"truncated header", join[:bpf.HdrSize-1], errBadControl, "31 bytes"},
		{"JOIN without body", join[:bpf.HdrSize], errBadControl, "join body"},
		{"JOIN with truncated body", join[:len(join)-1], errBadControl, "join body"},
		{"LEAVE without body", msg(t, hdr(msgLeave, 5, 1, 0), nil), errBadControl, "join body"},
		{"version 2", withHdr(func(h *bpf.XdpaggHdr) { h.Version = 2 }), errBadControl, "version 2"},
		{"version 0", withHdr(func(h *bpf.XdpaggHdr) { h.Version = 0 }), errBadControl, "version 0"},
		{"job 0", withHdr(func(h *bpf.XdpaggHdr) { h.JobId = 0 }), errBadControl, "job 0"},
		{"DATA", withHdr(func(h *bpf.XdpaggHdr) { h.Type = uint8(bpf.XdpaggMsgTypeMSG_DATA) }), errBadControl, "type 1 not handled"},
		{"ACK from a non-member", withHdr(func(h *bpf.XdpaggHdr) { h.Type = msgAck }), errBadControl, "non-member"},
		{"RETRANSMIT from a non-member", withHdr(func(h *bpf.XdpaggHdr) { h.Type = uint8(bpf.XdpaggMsgTypeMSG_RETRANSMIT) }), errBadControl, "non-member"},
		{"unknown type", withHdr(func(h *bpf.XdpaggHdr) { h.Type = 200 }), errBadControl, "type 200"},
		{"worker 32", withHdr(func(h *bpf.XdpaggHdr) { h.WorkerId = 32 }), maps.ErrBadMember, "worker id 32"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := c.handle(tc.b, testPort, w.addr)
			if !errors.Is(err, tc.is) {
				t.Fatalf("handle = %v, want an error wrapping %v", err, tc.is)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q does not say %q", err, tc.want)
			}
			if ms := members(t, sw.Maps); len(ms) != 0 {
				t.Errorf("rejected message changed the members: %+v", ms)
			}
			w.noDatagram(t)
		})
	}
}

// TestServe runs the real receive loop: ListenControl with IP_PKTINFO, a JOIN sent over loopback
// (ifindex 1, declared a switch port), the ACK back, and a clean stop when the context ends.
func TestServe(t *testing.T) {
	sw := loadSwitch(t, 4)
	lo, err := net.InterfaceByName("lo")
	if err != nil {
		t.Fatalf("loopback interface: %v", err)
	}
	c, err := ListenControl(0, sw.Maps, map[int]net.HardwareAddr{lo.Index: portMAC}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatalf("ListenControl: %v", err)
	}
	defer c.Close()
	port := c.raw.LocalAddr().(*net.UDPAddr).Port
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Serve(ctx) }()

	w := newWorker(t)
	to := &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: port}
	// A malformed message first: logged and skipped, the loop goes on.
	if _, err := w.conn.WriteTo([]byte("junk"), to); err != nil {
		t.Fatal(err)
	}
	if _, err := w.conn.WriteTo(msg(t, hdr(msgJoin, 9, 1234, 1), joinBody(workerMAC, resultIP)), to); err != nil {
		t.Fatal(err)
	}
	ack, _ := w.readAck(t)
	if ack.Type != msgAck || ack.JobId != 9 || ack.Seq != 1234 || ack.WorkerId != 1 {
		t.Errorf("ACK = %+v", ack)
	}
	ms := members(t, sw.Maps)
	if len(ms) != 1 || ms[0].Ifindex != uint32(lo.Index) || ms[0].Addr != w.addr || ms[0].JobID != 9 {
		t.Errorf("members = %+v, want job 9 behind ifindex %d at %v", ms, lo.Index, w.addr)
	}

	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Serve after cancel = %v, want nil", err)
		}
	case <-time.After(failsafeFor):
		t.Fatal("Serve did not return after its context ended")
	}
}
