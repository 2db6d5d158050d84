package agent

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"log/slog"
	"net"
	"net/netip"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/wire"
)

const (
	testPort     = 7 // the ifindex the tests call a switch port
	testPort2    = 8 // another switch port
	notAPort     = 9 // an ifindex that is not a switch port
	testJob      = 42
	otherJob     = 43 // another admitted job, with its own key and PS
	testWorkers  = 4  // admitted workers of testJob and otherJob
	msgJoin      = wire.MsgJoin
	msgLeave     = wire.MsgLeave
	msgAck       = wire.MsgAck
	msgRtx       = wire.MsgRetransmit
	msgReset     = wire.MsgReset
	msgHalt      = wire.MsgHalt
	msgHeartbeat = wire.MsgHeartbeat
	failsafeFor  = time.Second // read deadline that only keeps a broken test from hanging
)

var (
	portMAC   = net.HardwareAddr{0x02, 0xaa, 0, 0, 0, 0x07}
	port2MAC  = net.HardwareAddr{0x02, 0xaa, 0, 0, 0, 0x08}
	workerMAC = net.HardwareAddr{0x02, 0xbb, 0, 0, 0, 0x01}
	// psAddr is testJob's PS (admitted behind testPort); otherPS is otherJob's.
	psAddr   = netip.MustParseAddrPort("10.200.3.2:9510")
	otherPS  = netip.MustParseAddrPort("10.200.4.2:9511")
	resultIP = psAddr.Addr()
)

// testStamps hands out the stamps of every message the tests seal: one strictly increasing
// sequence, as the agent keeps its replay window per <job, worker id> whoever sends.
var testStamps ctlauth.Stamper

// newControl builds a ControlServer over a real UDP socket on 127.0.0.1 (so that ACKs can be sent
// to a local listener) with two switch ports, testPort and testPort2.
func newControl(t *testing.T, m *maps.Maps) *ControlServer {
	t.Helper()
	raw, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("listen: %v", err)
	}
	t.Cleanup(func() { raw.Close() })
	return newControlServer(raw, m, map[int]net.HardwareAddr{testPort: portMAC, testPort2: port2MAC}, slog.New(slog.DiscardHandler))
}

// admitJob admits job with ps behind testPort, workers workers, a quota of the whole pool and a
// fresh key, which it returns.
func admitJob(t *testing.T, m *maps.Maps, job uint32, ps netip.AddrPort, workers uint8) []byte {
	t.Helper()
	key, err := ctlauth.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	j := maps.Job{JobID: job, PS: ps, PSIfindex: testPort, Workers: workers, MaxSlots: m.PoolSize()}
	if err := m.AddJob(j, key); err != nil {
		t.Fatalf("AddJob(%+v): %v", j, err)
	}
	return key
}

// ctlTest is a switch with testJob and otherJob admitted and a control server over its maps.
type ctlTest struct {
	sw       *loader.Switch
	c        *ControlServer
	key      []byte // testJob's
	otherKey []byte // otherJob's
}

func newCtlTest(t *testing.T) *ctlTest {
	t.Helper()
	sw := loadSwitch(t, 16)
	ct := &ctlTest{sw: sw, c: newControl(t, sw.Maps)}
	ct.key = admitJob(t, sw.Maps, testJob, psAddr, testWorkers)
	ct.otherKey = admitJob(t, sw.Maps, otherJob, otherPS, testWorkers)
	return ct
}

// worker is the test's stand-in for a worker host: a UDP socket that receives the agent's ACKs.
type worker struct {
	conn      *net.UDPConn
	addr      netip.AddrPort
	lastStamp uint64 // of the agent's last ACK
}

// newWorker opens a worker socket on 127.0.0.1; newWorkerAt on another loopback address (another
// host, as far as the agent can tell).
func newWorker(t *testing.T) *worker { return newWorkerAt(t, "127.0.0.1") }

func newWorkerAt(t *testing.T, ip string) *worker {
	t.Helper()
	conn, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.ParseIP(ip)})
	if err != nil {
		t.Fatalf("listen: %v", err)
	}
	t.Cleanup(func() { conn.Close() })
	return &worker{conn: conn, addr: conn.LocalAddr().(*net.UDPAddr).AddrPort()}
}

// readAck reads one datagram, which must be an ACK sealed under key with a fresh stamp above the
// previous ACK's, and returns its header and sender.
func (w *worker) readAck(t *testing.T, key []byte) (wire.Header, netip.AddrPort) {
	t.Helper()
	var h wire.Header
	b, from := w.read(t, "ACK")
	if n := len(b); n != wire.HdrSize+ctlauth.TrailerSize {
		t.Errorf("ACK is %d bytes, want a %d-byte header and a %d-byte trailer", n, wire.HdrSize, ctlauth.TrailerSize)
	}
	msg, stamp, err := ctlauth.Open(key, b)
	if err != nil {
		t.Fatalf("ACK does not open under the job's key: %v", err)
	}
	if d := time.Since(time.Unix(0, int64(stamp))); d > 5*time.Second || d < -5*time.Second {
		t.Errorf("ACK stamp %d is %v from now", stamp, d)
	}
	if stamp <= w.lastStamp {
		t.Errorf("ACK stamp %d not above the previous ACK's %d", stamp, w.lastStamp)
	}
	w.lastStamp = stamp
	if len(msg) < wire.HdrSize {
		t.Fatalf("ACK of %d bytes", len(msg))
	}
	wire.DecodeHeader(msg, &h)
	return h, from
}

// read reads one datagram (what it should be: for the failure message).
func (w *worker) read(t *testing.T, what string) ([]byte, netip.AddrPort) {
	t.Helper()
	if err := w.conn.SetReadDeadline(time.Now().Add(failsafeFor)); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4096)
	n, from, err := w.conn.ReadFromUDPAddrPort(buf)
	if err != nil {
		t.Fatalf("read %s: %v", what, err)
	}
	return buf[:n], from
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
		t.Errorf("unexpected datagram (%d bytes, err %v) on the worker socket %v", n, rerr, w.addr)
	}
}

// msg encodes a control message: header, then the join body if any (no trailer).
func msg(t testing.TB, h wire.Header, body *bpf.XdpaggJoinBody) []byte {
	t.Helper()
	b := wire.AppendHeader(nil, &h)
	if len(b) != wire.HdrSize {
		t.Fatalf("header encodes to %d bytes, want %d", len(b), wire.HdrSize)
	}
	if body != nil {
		var err error
		if b, err = binary.Append(b, binary.LittleEndian, body); err != nil {
			t.Fatal(err)
		}
	}
	return b
}

// sealAt appends the authentication trailer with stamp; seal with the next test stamp.
func sealAt(t testing.TB, key, m []byte, stamp uint64) []byte {
	t.Helper()
	out, err := ctlauth.Seal(key, append([]byte(nil), m...), stamp)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func seal(t testing.TB, key, m []byte) []byte {
	t.Helper()
	return sealAt(t, key, m, testStamps.Next())
}

// sealed is seal(msg(...)).
func sealed(t testing.TB, key []byte, h wire.Header, body *bpf.XdpaggJoinBody) []byte {
	t.Helper()
	return seal(t, key, msg(t, h, body))
}

func joinBody(mac net.HardwareAddr, rip netip.Addr) *bpf.XdpaggJoinBody {
	var body bpf.XdpaggJoinBody
	copy(body.Mac[:], mac)
	if rip.IsValid() {
		body.ResultIp = wire.IPv4ToMap(rip) // network-order bytes in memory
	}
	return &body
}

func hdr(typ uint8, job uint32, seq uint32, worker uint8) wire.Header {
	return wire.Header{Version: wire.Version, Type: typ, JobId: job, Seq: seq, WorkerId: worker}
}

// join, leave, ack and rtx are sealed messages of testJob (under key).
func join(t testing.TB, key []byte, seq uint32, w uint8) []byte {
	t.Helper()
	return sealed(t, key, hdr(msgJoin, testJob, seq, w), joinBody(workerMAC, netip.Addr{}))
}

func leave(t testing.TB, key []byte, seq uint32, w uint8) []byte {
	t.Helper()
	return sealed(t, key, hdr(msgLeave, testJob, seq, w), joinBody(workerMAC, netip.Addr{}))
}

func ack(t testing.TB, key []byte, seq uint32, w uint8) []byte {
	t.Helper()
	return sealed(t, key, hdr(msgAck, testJob, seq, w), nil)
}

func rtx(t testing.TB, key []byte, seq uint32, w uint8) []byte {
	t.Helper()
	return sealed(t, key, hdr(msgRtx, testJob, seq, w), nil)
}

func members(t *testing.T, m *maps.Maps) []maps.Member {
	t.Helper()
	ms, err := m.ListMembers()
	if err != nil {
		t.Fatalf("ListMembers: %v", err)
	}
	return ms
}

// reasonOf is the counter label of a refusal ("" for nil or an error that is not a refusal).
func reasonOf(err error) string {
	var r *rejection
	if errors.As(err, &r) {
		return r.reason
	}
	return ""
}

// wantRefused checks that err is a refusal for reason whose message says want.
func wantRefused(t *testing.T, err error, reason, want string) {
	t.Helper()
	if got := reasonOf(err); got != reason {
		t.Fatalf("handle = %v (reason %q), want a refusal %q", err, got, reason)
	}
	if !strings.Contains(err.Error(), want) {
		t.Errorf("error %q does not say %q", err, want)
	}
}

// accept runs handle and fails the test on an error.
func accept(t *testing.T, c *ControlServer, b []byte, ifindex int, from netip.AddrPort) {
	t.Helper()
	if err := c.handle(b, ifindex, from); err != nil {
		t.Fatalf("handle(%x from %v on %d): %v", b[:min(len(b), wire.HdrSize)], from, ifindex, err)
	}
}

// binding returns worker w of testJob's binding, or fails the test.
func binding(t *testing.T, m *maps.Maps, w uint8) maps.Contributor {
	t.Helper()
	b, err := m.Worker(testJob, w)
	if err != nil {
		t.Fatalf("worker %d of job %d: %v", w, testJob, err)
	}
	return b
}

func unbound(t *testing.T, m *maps.Maps, w uint8) {
	t.Helper()
	if b, err := m.Worker(testJob, w); !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Errorf("worker %d of job %d bound at %+v (%v), want unbound", w, testJob, b, err)
	}
}

// jobsUnchanged checks that the admitted jobs are exactly as admitted: a control message never
// changes a job's PS, fan-in or quota.
func (ct *ctlTest) jobsUnchanged(t *testing.T) {
	t.Helper()
	for id, ps := range map[uint32]netip.AddrPort{testJob: psAddr, otherJob: otherPS} {
		j, err := ct.sw.Maps.GetJob(id)
		if err != nil {
			t.Errorf("job %d: %v", id, err)
			continue
		}
		if j.PS != ps || j.PSIfindex != testPort || j.Workers != testWorkers || j.MaxSlots != ct.sw.Maps.PoolSize() {
			t.Errorf("job %d = %+v, want PS %v behind %d, %d workers, quota %d as admitted", id, j, ps, testPort, testWorkers, ct.sw.Maps.PoolSize())
		}
	}
}

func TestHandleJoinLeave(t *testing.T) {
	ct := newCtlTest(t)
	c, m := ct.c, ct.sw.Maps
	w := newWorker(t)
	srv := c.raw.LocalAddr().(*net.UDPAddr).AddrPort()

	accept(t, c, sealed(t, ct.key, hdr(msgJoin, testJob, 0xdeadbeef, 3), joinBody(workerMAC, resultIP)), testPort, w.addr)
	ms := members(t, m)
	if len(ms) != 1 {
		t.Fatalf("members after JOIN = %+v, want one", ms)
	}
	got := ms[0]
	if got.JobID != testJob || got.WorkerID != 3 || got.Ifindex != testPort || got.Addr != w.addr ||
		got.MAC.String() != workerMAC.String() || got.PortMAC.String() != portMAC.String() || got.SrcIP != resultIP {
		t.Errorf("member = %+v;\nwant job %d worker 3 ifindex %d addr %v mac %v port mac %v src %v",
			got, testJob, testPort, w.addr, workerMAC, portMAC, resultIP)
	}
	if b := binding(t, m, 3); b.Addr != w.addr || b.Ifindex != testPort {
		t.Errorf("binding of worker 3 = %+v, want %v on %d", b, w.addr, testPort)
	}
	a, from := w.readAck(t, ct.key)
	want := wire.Header{Version: wire.Version, Type: msgAck, JobId: testJob, Seq: 0xdeadbeef, WorkerId: 3}
	if a != want {
		t.Errorf("JOIN ACK = %+v, want %+v", a, want)
	}
	if from != srv {
		t.Errorf("ACK came from %v, want the control socket %v", from, srv)
	}

	// The same binding joins again (result address 0: the PS): the member is refreshed.
	newMAC := net.HardwareAddr{0x02, 0xbb, 0, 0, 0, 0x09}
	accept(t, c, sealed(t, ct.key, hdr(msgJoin, testJob, 2, 3), joinBody(newMAC, netip.Addr{})), testPort, w.addr)
	if ms := members(t, m); len(ms) != 1 || ms[0].MAC.String() != newMAC.String() || ms[0].SrcIP != resultIP {
		t.Errorf("members after re-JOIN = %+v, want one with MAC %v and the PS as source", ms, newMAC)
	}
	if a, _ := w.readAck(t, ct.key); a.Type != msgAck || a.Seq != 2 {
		t.Errorf("re-JOIN ACK = %+v", a)
	}

	accept(t, c, leave(t, ct.key, 77, 3), testPort, w.addr)
	if ms := members(t, m); len(ms) != 0 {
		t.Errorf("members after LEAVE = %+v, want none", ms)
	}
	unbound(t, m, 3)
	a, _ = w.readAck(t, ct.key)
	want = wire.Header{Version: wire.Version, Type: msgAck, JobId: testJob, Seq: 77, WorkerId: 3}
	if a != want {
		t.Errorf("LEAVE ACK = %+v, want %+v", a, want)
	}
	// A resent LEAVE (its ACK lost) finds no binding and is acknowledged again.
	accept(t, c, leave(t, ct.key, 78, 3), testPort, w.addr)
	if a, _ := w.readAck(t, ct.key); a.Seq != 78 {
		t.Errorf("second LEAVE ACK = %+v", a)
	}
	w.noDatagram(t)
	ct.jobsUnchanged(t)
	if r := c.Rejected(); len(r) != 0 {
		t.Errorf("Rejected() = %v after accepted messages only", r)
	}
}

// refusalCase is a message handle must refuse for reason, saying want, without changing the maps
// or answering.
type refusalCase struct {
	name    string
	before  func(t *testing.T) // accepted messages first (e.g. the original of a replay)
	b       func(t *testing.T) []byte
	ifindex int // 0: testPort
	from    *worker
	reason  string
	want    string
}

// runRefusals runs each case against ct (in order, one server: replay state carries over), after
// binding worker 1 of testJob to bound (127.0.0.1, testPort) and worker 1 of otherJob likewise.
func runRefusals(t *testing.T, ct *ctlTest, bound *worker, others []*worker, cases []refusalCase) {
	t.Helper()
	c, m := ct.c, ct.sw.Maps
	accept(t, c, join(t, ct.key, 1, 1), testPort, bound.addr)
	bound.readAck(t, ct.key)
	accept(t, c, sealed(t, ct.otherKey, hdr(msgJoin, otherJob, 1, 1), joinBody(workerMAC, otherPS.Addr())), testPort, bound.addr)
	bound.readAck(t, ct.otherKey)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.before != nil {
				tc.before(t)
			}
			ifindex := tc.ifindex
			if ifindex == 0 {
				ifindex = testPort
			}
			from := tc.from
			if from == nil {
				from = bound
			}
			b := tc.b(t)
			before := fzSnapshot(t, m)
			counted := c.Rejected()[tc.reason]
			err := c.handle(b, ifindex, from.addr)
			wantRefused(t, err, tc.reason, tc.want)
			if after := fzSnapshot(t, m); !reflect.DeepEqual(before, after) {
				t.Errorf("refused message changed the maps:\nbefore %+v\nafter  %+v", before, after)
			}
			for _, w := range append([]*worker{bound}, others...) {
				w.noDatagram(t)
			}
			// Serve counts what handle refuses: the same path.
			c.reject(err, ifindex, from.addr)
			if got := c.Rejected()[tc.reason]; got != counted+1 {
				t.Errorf("Rejected()[%q] = %d, want %d", tc.reason, got, counted+1)
			}
		})
	}
	ct.jobsUnchanged(t)
}

func TestHandleMalformed(t *testing.T) {
	ct := newCtlTest(t)
	w := newWorker(t)
	key := ct.key
	j := msg(t, hdr(msgJoin, testJob, 1, 0), joinBody(workerMAC, resultIP))
	withHdr := func(f func(*wire.Header)) func(t *testing.T) []byte {
		return func(t *testing.T) []byte {
			h := hdr(msgJoin, testJob, 1, 0)
			f(&h)
			return seal(t, key, msg(t, h, joinBody(workerMAC, resultIP)))
		}
	}
	fixed := func(b []byte) func(t *testing.T) []byte { return func(*testing.T) []byte { return b } }
	malformed := func(name string, b func(t *testing.T) []byte, want string) refusalCase {
		return refusalCase{name: name, b: b, reason: RejectMalformed, want: want}
	}
	runRefusals(t, ct, w, nil, []refusalCase{
		malformed("empty", fixed(nil), "0 bytes"),
		malformed("truncated header", fixed(j[:wire.HdrSize-1]), "31 bytes"),
		malformed("JOIN without trailer", fixed(j), "JOIN of 44 bytes, want 68"),
		malformed("JOIN without body", func(t *testing.T) []byte { return seal(t, key, j[:wire.HdrSize]) }, "JOIN of 56 bytes, want 68"),
		malformed("JOIN with a truncated trailer", func(t *testing.T) []byte { b := seal(t, key, j); return b[:len(b)-1] }, "want 68"),
		malformed("JOIN with a byte more", func(t *testing.T) []byte { return append(seal(t, key, j), 0) }, "want 68"),
		malformed("LEAVE without body", func(t *testing.T) []byte { return sealed(t, key, hdr(msgLeave, testJob, 1, 0), nil) }, "LEAVE of 56 bytes"),
		malformed("ACK with a body", func(t *testing.T) []byte {
			return sealed(t, key, hdr(msgAck, testJob, 1, 0), joinBody(workerMAC, resultIP))
		}, "ACK of 68 bytes, want 56"),
		malformed("version 2", withHdr(func(h *wire.Header) { h.Version = 2 }), "version 2"),
		malformed("version 0", withHdr(func(h *wire.Header) { h.Version = 0 }), "version 0"),
		malformed("job 0", withHdr(func(h *wire.Header) { h.JobId = 0 }), "job 0"),
		malformed("reserved", withHdr(func(h *wire.Header) { h.Reserved = 1 }), "reserved 1"),
		malformed("count", withHdr(func(h *wire.Header) { h.Count = 3 }), "count 3"),
		malformed("DATA", withHdr(func(h *wire.Header) { h.Type = wire.MsgData }), "type 1 is not handled"),
		malformed("RESULT", withHdr(func(h *wire.Header) { h.Type = wire.MsgResult }), "not handled"),
		malformed("type 200", withHdr(func(h *wire.Header) { h.Type = 200 }), "not handled"),
		malformed("unknown type", withHdr(func(h *wire.Header) { h.Type = 200 }), "type 200"),
		malformed("join body reserved", func(t *testing.T) []byte {
			body := joinBody(workerMAC, resultIP)
			body.Reserved = 1
			return sealed(t, key, hdr(msgJoin, testJob, 1, 0), body)
		}, "join body reserved"),
		malformed("JOIN naming the broadcast MAC", func(t *testing.T) []byte {
			return sealed(t, key, hdr(msgJoin, testJob, 1, 0), joinBody(net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, resultIP))
		}, "not a unicast address"),
		malformed("JOIN naming a multicast MAC", func(t *testing.T) []byte {
			return sealed(t, key, hdr(msgJoin, testJob, 1, 0), joinBody(net.HardwareAddr{0x33, 0x33, 0, 0, 0, 1}, resultIP))
		}, "not a unicast address"),
		malformed("JOIN naming the zero MAC", func(t *testing.T) []byte {
			return sealed(t, key, hdr(msgJoin, testJob, 1, 0), joinBody(make(net.HardwareAddr, 6), resultIP))
		}, "not a unicast address"),
		{name: "not a switch port", b: func(t *testing.T) []byte { return join(t, key, 1, 0) }, ifindex: notAPort,
			reason: RejectNotAPort, want: "not a switch port"},
	})
}

func TestHandleUnauthenticated(t *testing.T) {
	ct := newCtlTest(t)
	w := newWorker(t)
	key := ct.key
	flip := func(i int, b func(t *testing.T) []byte) func(t *testing.T) []byte {
		return func(t *testing.T) []byte {
			out := b(t)
			at := i
			if at < 0 {
				at += len(out)
			}
			out[at] ^= 0x01
			return out
		}
	}
	j := func(t *testing.T) []byte { return join(t, key, 9, 0) }
	a := func(t *testing.T) []byte { return ack(t, key, 9, 1) }
	unauth := func(name string, b func(t *testing.T) []byte) refusalCase {
		return refusalCase{name: name, b: b, reason: RejectUnauth, want: "not authenticated"}
	}
	wrongKey, err := ctlauth.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	runRefusals(t, ct, w, nil, []refusalCase{
		unauth("zero trailer", func(t *testing.T) []byte {
			return append(msg(t, hdr(msgAck, testJob, 9, 1), nil), make([]byte, ctlauth.TrailerSize)...)
		}),
		unauth("JOIN under a random key", func(t *testing.T) []byte { return join(t, wrongKey, 9, 0) }),
		unauth("ACK under a random key", func(t *testing.T) []byte { return ack(t, wrongKey, 9, 1) }),
		unauth("JOIN under another job's key", func(t *testing.T) []byte { return join(t, ct.otherKey, 9, 0) }),
		unauth("ACK re-addressed to another job", func(t *testing.T) []byte {
			b := ack(t, ct.otherKey, 9, 1) // a member of otherJob, authentic there
			binary.LittleEndian.PutUint32(b[8:], testJob)
			return b
		}),
		unauth("flipped type (ACK to RETRANSMIT)", func(t *testing.T) []byte {
			b := a(t)
			b[1] = msgRtx
			return b
		}),
		unauth("flipped seq", flip(12, a)),
		unauth("flipped agg index", flip(16, a)),
		unauth("flipped worker id", flip(30, a)),
		unauth("flipped MAC", flip(wire.HdrSize, j)),
		unauth("flipped result address", flip(wire.HdrSize+8, j)),
		unauth("flipped stamp", flip(wire.HdrSize+12, j)),
		unauth("flipped first tag byte", flip(-ctlauth.TagSize, j)),
		unauth("flipped last tag byte", flip(-1, j)),
		unauth("tag of the message without its stamp", func(t *testing.T) []byte {
			// Someone who swaps in another stamp cannot keep the tag.
			b := a(t)
			binary.LittleEndian.PutUint64(b[wire.HdrSize:], binary.LittleEndian.Uint64(b[wire.HdrSize:])+1)
			return b
		}),
		{name: "JOIN for a job never admitted", b: func(t *testing.T) []byte {
			return sealed(t, key, hdr(msgJoin, 99, 9, 0), joinBody(workerMAC, netip.Addr{}))
		}, reason: RejectNotAdmitted, want: "JOIN for job 99"},
		{name: "ACK for a job never admitted", b: func(t *testing.T) []byte { return sealed(t, key, hdr(msgAck, 99, 9, 1), nil) },
			reason: RejectNotAdmitted, want: "ACK for job 99"},
	})
}

func TestHandleReplayed(t *testing.T) {
	ct := newCtlTest(t)
	c := ct.c
	w := newWorker(t)
	key := ct.key
	var orig []byte
	var origStamp uint64
	// first sends an ACK of worker 1 from its binding (accepted) and remembers it.
	first := func(t *testing.T) {
		orig = ack(t, key, 5, 1)
		origStamp = binary.LittleEndian.Uint64(orig[wire.HdrSize:])
		accept(t, c, orig, testPort, w.addr)
	}
	var joinOrig []byte
	replay := func(name string, before func(t *testing.T), b func(t *testing.T) []byte, want string) refusalCase {
		return refusalCase{name: name, before: before, b: b, reason: RejectReplay, want: want}
	}
	runRefusals(t, ct, w, nil, []refusalCase{
		replay("same ACK twice", first, func(*testing.T) []byte { return orig }, "not after the last accepted"),
		replay("older stamp", first, func(t *testing.T) []byte {
			return sealAt(t, key, msg(t, hdr(msgAck, testJob, 6, 1), nil), origStamp-1)
		}, "not after the last accepted"),
		replay("equal stamp, another message", first, func(t *testing.T) []byte {
			return sealAt(t, key, msg(t, hdr(msgRtx, testJob, 6, 1), nil), origStamp)
		}, "not after the last accepted"),
		replay("same JOIN twice", func(t *testing.T) {
			joinOrig = join(t, key, 7, 1)
			accept(t, c, joinOrig, testPort, w.addr)
			w.readAck(t, key)
		}, func(*testing.T) []byte { return joinOrig }, "not after the last accepted"),
		{name: "JOIN after the LEAVE that followed it", before: func(t *testing.T) {
			joinOrig = join(t, key, 8, 2)
			accept(t, c, joinOrig, testPort2, w.addr)
			w.readAck(t, key)
			accept(t, c, leave(t, key, 9, 2), testPort2, w.addr)
			w.readAck(t, key)
		}, b: func(*testing.T) []byte { return joinOrig }, ifindex: testPort2, reason: RejectReplay, want: "not after the last accepted"},
		replay("stamp a minute old", nil, func(t *testing.T) []byte {
			return sealAt(t, key, msg(t, hdr(msgAck, testJob, 6, 1), nil), uint64(time.Now().Add(-time.Minute).UnixNano()))
		}, "from this clock"),
		replay("stamp a minute ahead", nil, func(t *testing.T) []byte {
			return sealAt(t, key, msg(t, hdr(msgAck, testJob, 6, 1), nil), uint64(time.Now().Add(time.Minute).UnixNano()))
		}, "from this clock"),
		// Worker 3 could join behind testPort2 (empty again), but not with these stamps.
		{name: "JOIN a minute old", b: func(t *testing.T) []byte {
			return sealAt(t, key, msg(t, hdr(msgJoin, testJob, 6, 3), joinBody(workerMAC, netip.Addr{})), uint64(time.Now().Add(-time.Minute).UnixNano()))
		}, ifindex: testPort2, reason: RejectReplay, want: "from this clock"},
		{name: "stamp 0", b: func(t *testing.T) []byte {
			return sealAt(t, key, msg(t, hdr(msgJoin, testJob, 6, 3), joinBody(workerMAC, netip.Addr{})), 0)
		}, ifindex: testPort2, reason: RejectReplay, want: "from this clock"},
	})
	// Stamps are per <job, worker id>: another worker's and another job's older stamps are fine.
	old := testStamps.Next()
	accept(t, c, ack(t, key, 10, 1), testPort, w.addr)
	accept(t, c, sealAt(t, key, msg(t, hdr(msgJoin, testJob, 11, 3), joinBody(workerMAC, netip.Addr{})), old), testPort2, w.addr)
	w.readAck(t, key)
	accept(t, c, sealAt(t, ct.otherKey, msg(t, hdr(msgAck, otherJob, 11, 1), nil), old+1), testPort, w.addr)
	w.noDatagram(t)
}

func TestHandleRefusesWorkers(t *testing.T) {
	ct := newCtlTest(t)
	key := ct.key
	w := newWorker(t)
	other := newWorkerAt(t, "127.0.0.2")
	fromB := func(name string, b func(t *testing.T) []byte, ifindex int, reason, want string) refusalCase {
		return refusalCase{name: name, b: b, from: other, ifindex: ifindex, reason: reason, want: want}
	}
	runRefusals(t, ct, w, []*worker{other}, []refusalCase{
		{name: "worker id = admitted workers", b: func(t *testing.T) []byte { return join(t, key, 1, testWorkers) },
			reason: RejectBadWorker, want: "worker 4 of job 42, which has workers 0..3"},
		{name: "worker id 31", b: func(t *testing.T) []byte { return ack(t, key, 1, 31) }, reason: RejectBadWorker, want: "worker 31"},
		{name: "worker id 255", b: func(t *testing.T) []byte { return leave(t, key, 1, 255) }, reason: RejectBadWorker, want: "worker 255"},
		{name: "JOIN naming another PS", b: func(t *testing.T) []byte {
			return sealed(t, key, hdr(msgJoin, testJob, 1, 0), joinBody(workerMAC, netip.MustParseAddr("10.66.0.1")))
		}, reason: RejectBadWorker, want: "names 10.66.0.1 as the result source; the job's PS is 10.200.3.2"},
		{name: "JOIN naming another job's PS", b: func(t *testing.T) []byte {
			return sealed(t, key, hdr(msgJoin, testJob, 1, 0), joinBody(workerMAC, otherPS.Addr()))
		}, reason: RejectBadWorker, want: "names 10.200.4.2"},
		{name: "re-JOIN of the binding naming another PS", b: func(t *testing.T) []byte {
			return sealed(t, key, hdr(msgJoin, testJob, 1, 1), joinBody(workerMAC, netip.MustParseAddr("10.66.0.1")))
		}, reason: RejectBadWorker, want: "result source"},
		// Worker 1 is bound at w (127.0.0.1) on testPort and fresh.
		fromB("JOIN of a bound id from another host", func(t *testing.T) []byte { return join(t, key, 1, 1) }, testPort, RejectBoundElse, "bound at 127.0.0.1"),
		fromB("JOIN of a bound id from another host and port", func(t *testing.T) []byte { return join(t, key, 1, 1) }, testPort2, RejectBoundElse, "takeable after 30s"),
		{name: "JOIN of a bound id from its host on another switch port", b: func(t *testing.T) []byte { return join(t, key, 1, 1) },
			ifindex: testPort2, reason: RejectBoundElse, want: "on ifindex 7"},
		{name: "JOIN of another id behind the bound member's port", b: func(t *testing.T) []byte { return join(t, key, 1, 2) },
			reason: RejectBoundElse, want: "worker 1 of the job is behind that port"},
		fromB("JOIN of another id behind the bound member's port, another host", func(t *testing.T) []byte { return join(t, key, 1, 0) }, testPort, RejectBoundElse, "worker 1 of the job is behind that port"),
		fromB("LEAVE from another host", func(t *testing.T) []byte { return leave(t, key, 1, 1) }, testPort, RejectNotMember, "LEAVE of job 42 worker 1"),
		{name: "LEAVE from the binding's host, another UDP port", from: &worker{addr: netip.AddrPortFrom(w.addr.Addr(), w.addr.Port()+1)},
			b: func(t *testing.T) []byte { return leave(t, key, 1, 1) }, reason: RejectNotMember, want: "bound at"},
		{name: "LEAVE from the binding's address on another switch port", ifindex: testPort2,
			b: func(t *testing.T) []byte { return leave(t, key, 1, 1) }, reason: RejectNotMember, want: "on ifindex 7"},
		fromB("ACK from another host", func(t *testing.T) []byte { return ack(t, key, 1, 1) }, testPort, RejectNotMember, "ACK of job 42 worker 1"),
		fromB("RETRANSMIT from another host", func(t *testing.T) []byte { return rtx(t, key, 1, 1) }, testPort, RejectNotMember, "HELP (RETRANSMIT) of job 42 worker 1"),
		{name: "ACK from the binding's address on another switch port", ifindex: testPort2,
			b: func(t *testing.T) []byte { return ack(t, key, 1, 1) }, reason: RejectNotMember, want: "ACK"},
		{name: "RETRANSMIT from the binding's host, another UDP port", from: &worker{addr: netip.AddrPortFrom(w.addr.Addr(), w.addr.Port()+1)},
			b: func(t *testing.T) []byte { return rtx(t, key, 1, 1) }, reason: RejectNotMember, want: "RETRANSMIT"},
		{name: "ACK of an unbound worker id", b: func(t *testing.T) []byte { return ack(t, key, 1, 0) }, reason: RejectNotMember, want: "worker 0"},
		{name: "RETRANSMIT of an unbound worker id", b: func(t *testing.T) []byte { return rtx(t, key, 1, 3) }, reason: RejectNotMember, want: "worker 3"},
	})
}

// A JOIN binds a worker id to its sender: the binding itself may refresh, the same host (address
// and switch port) may rebind from a new UDP port at once, anyone else only after the binding was
// silent for MemberTTL; one member per job per port unless the other is silent too.
func TestHandleJoinBinding(t *testing.T) {
	const tiny = 20 * time.Millisecond
	// silence lets MemberTTL pass for every binding: a tiny TTL, and a wait longer than it.
	silence := func(c *ControlServer) {
		c.SetConfig(ControlConfig{MemberTTL: tiny})
		time.Sleep(2 * tiny)
	}
	t.Run("refresh", func(t *testing.T) {
		ct := newCtlTest(t)
		c, m := ct.c, ct.sw.Maps
		a := newWorker(t)
		for seq := range uint32(3) {
			accept(t, c, join(t, ct.key, seq, 1), testPort, a.addr)
			if h, _ := a.readAck(t, ct.key); h.Seq != seq {
				t.Errorf("ACK of JOIN %d: %+v", seq, h)
			}
		}
		if ms := members(t, m); len(ms) != 1 || ms[0].Addr != a.addr {
			t.Errorf("members = %+v, want one at %v", ms, a.addr)
		}
		ct.jobsUnchanged(t)
	})
	t.Run("same host, new UDP port", func(t *testing.T) {
		ct := newCtlTest(t)
		c, m := ct.c, ct.sw.Maps
		a, a2 := newWorker(t), newWorker(t) // a restarted worker: same address, another port
		accept(t, c, join(t, ct.key, 1, 1), testPort, a.addr)
		a.readAck(t, ct.key)
		accept(t, c, join(t, ct.key, 2, 1), testPort, a2.addr)
		a2.readAck(t, ct.key)
		if b := binding(t, m, 1); b.Addr != a2.addr || b.Ifindex != testPort {
			t.Errorf("binding = %+v, want %v on %d", b, a2.addr, testPort)
		}
		if ms := members(t, m); len(ms) != 1 || ms[0].Addr != a2.addr {
			t.Errorf("members = %+v, want one at %v", ms, a2.addr)
		}
		// The old socket is no longer the binding.
		wantRefused(t, c.handle(ack(t, ct.key, 3, 1), testPort, a.addr), RejectNotMember, "ACK")
		accept(t, c, ack(t, ct.key, 3, 1), testPort, a2.addr)
		a.noDatagram(t)
		a2.noDatagram(t)
		ct.jobsUnchanged(t)
	})
	t.Run("another host, same port, after MemberTTL", func(t *testing.T) {
		ct := newCtlTest(t)
		c, m := ct.c, ct.sw.Maps
		a, b := newWorker(t), newWorkerAt(t, "127.0.0.2")
		accept(t, c, join(t, ct.key, 1, 1), testPort, a.addr)
		a.readAck(t, ct.key)
		wantRefused(t, c.handle(join(t, ct.key, 2, 1), testPort, b.addr), RejectBoundElse, "bound at")
		silence(c)
		accept(t, c, join(t, ct.key, 3, 1), testPort, b.addr)
		if h, _ := b.readAck(t, ct.key); h.Seq != 3 {
			t.Errorf("ACK = %+v", h)
		}
		if bd := binding(t, m, 1); bd.Addr != b.addr || bd.Ifindex != testPort {
			t.Errorf("binding = %+v, want %v", bd, b.addr)
		}
		if ms := members(t, m); len(ms) != 1 || ms[0].Addr != b.addr || ms[0].WorkerID != 1 {
			t.Errorf("members = %+v, want worker 1 at %v", ms, b.addr)
		}
		// The new holder is fresh now: the old one cannot take the id back, nor speak for it.
		c.SetConfig(ControlConfig{MemberTTL: time.Hour})
		wantRefused(t, c.handle(join(t, ct.key, 4, 1), testPort, a.addr), RejectBoundElse, "bound at 127.0.0.2")
		wantRefused(t, c.handle(ack(t, ct.key, 4, 1), testPort, a.addr), RejectNotMember, "ACK")
		wantRefused(t, c.handle(leave(t, ct.key, 4, 1), testPort, a.addr), RejectNotMember, "LEAVE")
		a.noDatagram(t)
		b.noDatagram(t)
		ct.jobsUnchanged(t)
	})
	t.Run("another host, another port, after MemberTTL", func(t *testing.T) {
		ct := newCtlTest(t)
		c, m := ct.c, ct.sw.Maps
		a, b := newWorker(t), newWorkerAt(t, "127.0.0.2")
		accept(t, c, join(t, ct.key, 1, 1), testPort, a.addr)
		a.readAck(t, ct.key)
		wantRefused(t, c.handle(join(t, ct.key, 2, 1), testPort2, b.addr), RejectBoundElse, "bound at")
		silence(c)
		accept(t, c, join(t, ct.key, 3, 1), testPort2, b.addr)
		b.readAck(t, ct.key)
		// The id moved: no member behind the old port, the new one behind testPort2.
		ms := members(t, m)
		if len(ms) != 1 || ms[0].Ifindex != testPort2 || ms[0].Addr != b.addr || ms[0].PortMAC.String() != port2MAC.String() {
			t.Errorf("members = %+v, want worker 1 behind %d only", ms, testPort2)
		}
		if bd := binding(t, m, 1); bd.Ifindex != testPort2 || bd.Addr != b.addr {
			t.Errorf("binding = %+v", bd)
		}
		ct.jobsUnchanged(t)
	})
	t.Run("another worker id behind the same port", func(t *testing.T) {
		ct := newCtlTest(t)
		c, m := ct.c, ct.sw.Maps
		a, b := newWorker(t), newWorkerAt(t, "127.0.0.2")
		accept(t, c, join(t, ct.key, 1, 1), testPort, a.addr)
		a.readAck(t, ct.key)
		wantRefused(t, c.handle(join(t, ct.key, 2, 2), testPort, b.addr), RejectBoundElse, "worker 1 of the job is behind that port")
		// Behind another port, worker 2 joins at once; the other job's member behind testPort is fine.
		accept(t, c, join(t, ct.key, 3, 2), testPort2, b.addr)
		b.readAck(t, ct.key)
		accept(t, c, sealed(t, ct.otherKey, hdr(msgJoin, otherJob, 1, 2), joinBody(workerMAC, netip.Addr{})), testPort, b.addr)
		b.readAck(t, ct.otherKey)
		silence(c)
		// Worker 3 replaces the silent worker 1 behind testPort; worker 1 loses its binding.
		accept(t, c, join(t, ct.key, 4, 3), testPort, a.addr)
		a.readAck(t, ct.key)
		unbound(t, m, 1)
		if bd := binding(t, m, 3); bd.Ifindex != testPort || bd.Addr != a.addr {
			t.Errorf("binding of worker 3 = %+v", bd)
		}
		got := map[uint32]uint8{}
		for _, mb := range members(t, m) {
			if mb.JobID == testJob {
				got[mb.Ifindex] = mb.WorkerID
			}
		}
		if !reflect.DeepEqual(got, map[uint32]uint8{testPort: 3, testPort2: 2}) {
			t.Errorf("members of job %d by port = %v, want worker 3 behind %d and worker 2 behind %d", testJob, got, testPort, testPort2)
		}
		ct.jobsUnchanged(t)
	})
	t.Run("kept alive by ACKs", func(t *testing.T) {
		ct := newCtlTest(t)
		c := ct.c
		// No sleeping: the binding's last message is moved into the past instead, so the test
		// means the same however the machine schedules it.
		const ttl = time.Minute
		c.SetConfig(ControlConfig{MemberTTL: ttl})
		age := func() {
			c.mu.Lock()
			c.lastSeen[workerRef{job: testJob, worker: 1}] = time.Now().Add(-2 * ttl)
			c.mu.Unlock()
		}
		a, b := newWorker(t), newWorkerAt(t, "127.0.0.2")
		accept(t, c, join(t, ct.key, 1, 1), testPort, a.addr)
		a.readAck(t, ct.key)
		age()                                                // silent for longer than the TTL since the JOIN...
		accept(t, c, ack(t, ct.key, 2, 1), testPort, a.addr) // ...but the holder speaks
		wantRefused(t, c.handle(join(t, ct.key, 3, 1), testPort, b.addr), RejectBoundElse, "bound at")
		// Refused JOINs do not keep the binding alive, nor do refused ACKs from elsewhere.
		age()
		wantRefused(t, c.handle(ack(t, ct.key, 4, 1), testPort, b.addr), RejectNotMember, "ACK")
		accept(t, c, join(t, ct.key, 5, 1), testPort, b.addr)
		b.readAck(t, ct.key)
	})
	t.Run("left ids are free", func(t *testing.T) {
		ct := newCtlTest(t)
		c, m := ct.c, ct.sw.Maps
		a, b := newWorker(t), newWorkerAt(t, "127.0.0.2")
		accept(t, c, join(t, ct.key, 1, 1), testPort, a.addr)
		a.readAck(t, ct.key)
		accept(t, c, leave(t, ct.key, 2, 1), testPort, a.addr)
		a.readAck(t, ct.key)
		accept(t, c, join(t, ct.key, 3, 1), testPort2, b.addr) // at once, from anywhere
		b.readAck(t, ct.key)
		if bd := binding(t, m, 1); bd.Addr != b.addr {
			t.Errorf("binding = %+v", bd)
		}
	})
}

// An authentic message that is refused (not from the binding) must not use up the worker id's
// stamps: otherwise any key holder could send one with a stamp near the end of the freshness
// window and have every message of the real holder refused as replayed, until the holder looks
// silent and its id can be taken over.
func TestRefusedMessagesUseNoStamps(t *testing.T) {
	ct := newCtlTest(t)
	c, m := ct.c, ct.sw.Maps
	a, b := newWorker(t), newWorkerAt(t, "127.0.0.2")
	accept(t, c, join(t, ct.key, 1, 1), testPort, a.addr)
	a.readAck(t, ct.key)
	ahead := uint64(time.Now().Add(ctlauth.MaxSkew - 5*time.Second).UnixNano())
	for i, mk := range []func(seq uint32) []byte{
		func(seq uint32) []byte { return msg(t, hdr(msgAck, testJob, seq, 1), nil) },
		func(seq uint32) []byte { return msg(t, hdr(msgRtx, testJob, seq, 1), nil) },
		func(seq uint32) []byte {
			return msg(t, hdr(msgLeave, testJob, seq, 1), joinBody(workerMAC, netip.Addr{}))
		},
		func(seq uint32) []byte {
			return msg(t, hdr(msgJoin, testJob, seq, 1), joinBody(workerMAC, netip.Addr{}))
		},
	} {
		err := c.handle(sealAt(t, ct.key, mk(uint32(10+i)), ahead+uint64(i)), testPort, b.addr)
		if r := reasonOf(err); r != RejectNotMember && r != RejectBoundElse {
			t.Fatalf("message %d from another host: %v, want refused as not the binding", i, err)
		}
	}
	// The holder goes on with its own (current) stamps.
	accept(t, c, ack(t, ct.key, 20, 1), testPort, a.addr)
	accept(t, c, join(t, ct.key, 21, 1), testPort, a.addr)
	a.readAck(t, ct.key)
	if bd := binding(t, m, 1); bd.Addr != a.addr {
		t.Errorf("binding = %+v, want %v", bd, a.addr)
	}
	b.noDatagram(t)
}

// The port quota: at most MaxMembersPerPort members behind one port over all jobs; joining again
// where one is a member already is not a new member.
func TestHandlePortQuota(t *testing.T) {
	ct := newCtlTest(t)
	c, m := ct.c, ct.sw.Maps
	c.SetConfig(ControlConfig{MaxMembersPerPort: 2})
	third := admitJob(t, m, 44, netip.MustParseAddrPort("10.200.5.2:9510"), 2)
	w := newWorker(t)
	accept(t, c, join(t, ct.key, 1, 0), testPort, w.addr)
	w.readAck(t, ct.key)
	accept(t, c, sealed(t, ct.otherKey, hdr(msgJoin, otherJob, 1, 0), joinBody(workerMAC, netip.Addr{})), testPort, w.addr)
	w.readAck(t, ct.otherKey)
	full := sealed(t, third, hdr(msgJoin, 44, 1, 0), joinBody(workerMAC, netip.Addr{}))
	before := fzSnapshot(t, m)
	wantRefused(t, c.handle(full, testPort, w.addr), RejectPortFull, "the port has 2 members (at most 2)")
	if after := fzSnapshot(t, m); !reflect.DeepEqual(before, after) {
		t.Error("a JOIN refused for the port quota changed the maps")
	}
	w.noDatagram(t)
	// Members already behind the port may join again.
	accept(t, c, join(t, ct.key, 2, 0), testPort, w.addr)
	w.readAck(t, ct.key)
	// Another port has room.
	accept(t, c, sealed(t, third, hdr(msgJoin, 44, 2, 0), joinBody(workerMAC, netip.Addr{})), testPort2, w.addr)
	w.readAck(t, third)
	// A member leaving makes room (worker 1 of job 44 joins behind testPort).
	accept(t, c, leave(t, ct.key, 3, 0), testPort, w.addr)
	w.readAck(t, ct.key)
	accept(t, c, sealed(t, third, hdr(msgJoin, 44, 3, 1), joinBody(workerMAC, netip.Addr{})), testPort, w.addr)
	w.readAck(t, third)
	n := 0
	for _, mb := range members(t, m) {
		if mb.Ifindex == testPort {
			n++
		}
	}
	if n != 2 {
		t.Errorf("%d members behind the port, want 2", n)
	}
}

// Removed jobs are refused, and what the server remembers of them is forgotten: a job admitted
// again under the same id starts with a clean replay window.
func TestHandleRemovedJob(t *testing.T) {
	ct := newCtlTest(t)
	c, m := ct.c, ct.sw.Maps
	w := newWorker(t)
	late := join(t, ct.key, 1, 1) // stamped first, sent last
	accept(t, c, join(t, ct.key, 2, 1), testPort, w.addr)
	w.readAck(t, ct.key)
	if _, err := m.RemoveJob(testJob); err != nil {
		t.Fatal(err)
	}
	wantRefused(t, c.handle(ack(t, ct.key, 3, 1), testPort, w.addr), RejectNotAdmitted, "ACK for job 42")
	c.forgetRemoved(map[uint32]bool{otherJob: true})
	c.mu.Lock()
	for r := range c.lastSeen {
		if r.job == testJob {
			t.Errorf("forgetRemoved kept %+v", r)
		}
	}
	if _, ok := c.keys[testJob]; ok {
		t.Error("forgetRemoved kept the removed job's key")
	}
	c.mu.Unlock()
	key := admitJob(t, m, testJob, psAddr, testWorkers)
	// The old key opens nothing now.
	wantRefused(t, c.handle(late, testPort, w.addr), RejectUnauth, "not authenticated")
	// An older stamp than the removed job's last is fine for the new job.
	old := binary.LittleEndian.Uint64(late[len(late)-ctlauth.TrailerSize:])
	accept(t, c, sealAt(t, key, msg(t, hdr(msgJoin, testJob, 4, 1), joinBody(workerMAC, netip.Addr{})), old), testPort, w.addr)
	w.readAck(t, key)
}

func TestWarnLimiter(t *testing.T) {
	var w warnLimiter
	t0 := time.Unix(1000, 0)
	if _, ok := w.allow(testPort, t0); !ok {
		t.Fatal("first warning suppressed")
	}
	for i := range 5 {
		if _, ok := w.allow(testPort, t0.Add(time.Duration(i)*100*time.Millisecond)); ok {
			t.Errorf("warning %d within a second of the first was let through", i)
		}
	}
	if _, ok := w.allow(testPort2, t0.Add(time.Millisecond)); !ok {
		t.Error("another port's first warning was suppressed")
	}
	n, ok := w.allow(testPort, t0.Add(errLogEvery))
	if !ok || n != 5 {
		t.Errorf("warning a second later = %d suppressed, %v; want 5, let through", n, ok)
	}
	if n, ok := w.allow(testPort, t0.Add(3*errLogEvery)); !ok || n != 0 {
		t.Errorf("warning after a quiet interval = %d, %v; want 0, let through", n, ok)
	}
}

// syncBuffer is a bytes.Buffer safe for a logger's concurrent writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// A flood of refused messages costs one log line per port per second, and every one is counted
// by reason.
func TestRejectCountsAndLimitsLogs(t *testing.T) {
	ct := newCtlTest(t)
	c := ct.c
	var logs syncBuffer
	c.log = slog.New(slog.NewTextHandler(&logs, nil))
	w := newWorker(t)
	for i := range 100 {
		b := join(t, ct.key, uint32(i), 0)
		b[len(b)-1] ^= 1
		ifindex := testPort
		if i%2 == 1 {
			ifindex = testPort2
		}
		err := c.handle(b, ifindex, w.addr)
		c.reject(err, ifindex, w.addr)
	}
	c.reject(c.handle(nil, testPort, w.addr), testPort, w.addr)
	c.reject(errors.New("a map operation failed"), testPort, w.addr)
	want := map[string]uint64{RejectUnauth: 100, RejectMalformed: 1, RejectInternal: 1}
	if got := c.Rejected(); !reflect.DeepEqual(got, want) {
		t.Errorf("Rejected() = %v, want %v", got, want)
	}
	if n := strings.Count(logs.String(), "control message rejected"); n != 2 {
		t.Errorf("%d warnings logged for a flood on two ports, want 2:\n%s", n, logs.String())
	}
	for _, s := range []string{"reason=unauthenticated", "ifindex=7", "ifindex=8"} {
		if !strings.Contains(logs.String(), s) {
			t.Errorf("log does not say %q:\n%s", s, logs.String())
		}
	}
	w.noDatagram(t)
}

// TestServe runs the real receive loop: ListenControl with IP_PKTINFO, an authenticated JOIN sent
// over loopback (ifindex 1, declared a switch port), the sealed ACK back, refusals counted, and a
// clean stop when the context ends (serve).
func TestServe(t *testing.T) {
	sw := loadSwitch(t, 4)
	lo, err := net.InterfaceByName("lo")
	if err != nil {
		t.Fatalf("loopback interface: %v", err)
	}
	key := admitJob(t, sw.Maps, 9, psAddr, 2)
	c, err := ListenControl(0, sw.Maps, map[int]net.HardwareAddr{lo.Index: portMAC}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatalf("ListenControl: %v", err)
	}
	to := serve(t, c)
	w := newWorker(t)
	// Refused messages first: counted and skipped, the loop goes on.
	if _, err := w.conn.WriteTo([]byte("junk"), to); err != nil {
		t.Fatal(err)
	}
	if _, err := w.conn.WriteTo(msg(t, hdr(msgJoin, 9, 1233, 1), joinBody(workerMAC, resultIP)), to); err != nil {
		t.Fatal(err)
	}
	if _, err := w.conn.WriteTo(sealed(t, key, hdr(msgJoin, 9, 1234, 1), joinBody(workerMAC, resultIP)), to); err != nil {
		t.Fatal(err)
	}
	a, _ := w.readAck(t, key)
	if a.Type != msgAck || a.JobId != 9 || a.Seq != 1234 || a.WorkerId != 1 {
		t.Errorf("ACK = %+v", a)
	}
	ms := members(t, sw.Maps)
	if len(ms) != 1 || ms[0].Ifindex != uint32(lo.Index) || ms[0].Addr != w.addr || ms[0].JobID != 9 || ms[0].SrcIP != resultIP {
		t.Errorf("members = %+v, want job 9 behind ifindex %d at %v", ms, lo.Index, w.addr)
	}
	if got := c.Rejected(); got[RejectMalformed] != 2 {
		t.Errorf("Rejected() = %v, want 2 malformed (junk, and a JOIN without its trailer)", got)
	}
}

// serve runs c's receive loop until the test ends, then checks that it returns nil once its
// context ends and closes c. It returns the loop's address on 127.0.0.1.
func serve(t *testing.T, c *ControlServer) *net.UDPAddr {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Serve(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Serve after cancel = %v, want nil", err)
			}
		case <-time.After(failsafeFor):
			t.Error("Serve did not return after its context ended")
		}
		c.Close()
	})
	return &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: c.raw.LocalAddr().(*net.UDPAddr).Port}
}

// A job removed and admitted again under its id (xdpagg job rm; job add) before the agent's next
// garbage collection tick is a new job: its first authentic message drops what the agent kept of
// the old one. Otherwise a RETRANSMIT of the new job would be answered with the old job's sum of
// the same seq from the retransmit cache, the old job's acknowledgements would keep the new job's
// results out of the cache, and the old job's stamps would refuse the new workers'.
func TestHandleReadmittedJob(t *testing.T) {
	ct := newCtlTest(t)
	c, m := ct.c, ct.sw.Maps
	cache := NewResultCache(time.Minute, 100)
	c.SetCache(cache)
	w0, w1 := newWorker(t), newWorkerAt(t, "127.0.0.2")
	early := testStamps.Next()
	accept(t, c, join(t, ct.key, 1, 0), testPort, w0.addr)
	w0.readAck(t, ct.key)
	accept(t, c, join(t, ct.key, 1, 1), testPort2, w1.addr)
	w1.readAck(t, ct.key)
	if err := cache.Store(resultRecord(t, testJob, 5, 0b11, 7), time.Now()); err != nil {
		t.Fatal(err)
	}
	if err := cache.Store(resultRecord(t, otherJob, 5, 0b11, 8), time.Now()); err != nil {
		t.Fatal(err)
	}
	accept(t, c, ack(t, ct.key, 3, 0), testPort, w0.addr) // seq 5 still wanted by both
	accept(t, c, ack(t, ct.key, 3, 1), testPort2, w1.addr)

	if _, err := m.RemoveJob(testJob); err != nil {
		t.Fatal(err)
	}
	key := admitJob(t, m, testJob, psAddr, testWorkers)
	// The new job's worker 0 joins with a stamp older than the old job's last (its clock is
	// behind, or it was stamped earlier): a new job, a new window.
	accept(t, c, sealAt(t, key, msg(t, hdr(msgJoin, testJob, 1, 0), joinBody(workerMAC, netip.Addr{})), early), testPort, w0.addr)
	w0.readAck(t, key)
	// The old job's result is gone: a miss, answered with an ACK.
	accept(t, c, rtx(t, key, 5, 0), testPort, w0.addr)
	if a, _ := w0.readAck(t, key); a.Type != msgAck || a.Seq != 5 {
		t.Fatalf("RETRANSMIT of seq 5 of the new job answered with %+v, want a miss (ACK)", a)
	}
	// The old job's watermarks are gone: seq 2 of the new job is cached...
	if err := cache.Store(resultRecord(t, testJob, 2, 0b1, 9), time.Now()); err != nil {
		t.Fatal(err)
	}
	if _, ok := cache.Get(testJob, 2); !ok {
		t.Error("the new job's result below the old job's acknowledgements was not cached")
	}
	// ...and the other job's result stays.
	if _, ok := cache.Get(otherJob, 5); !ok {
		t.Error("another job's cached result was dropped")
	}
	w0.noDatagram(t)
	w1.noDatagram(t)
}

// forgetRemoved (the agent's garbage collection tick) drops removed jobs' state, the retransmit
// cache's included.
func TestForgetRemovedDropsCache(t *testing.T) {
	ct := newCtlTest(t)
	c, m := ct.c, ct.sw.Maps
	cache := NewResultCache(time.Minute, 100)
	c.SetCache(cache)
	w := newWorker(t)
	accept(t, c, join(t, ct.key, 1, 0), testPort, w.addr)
	w.readAck(t, ct.key)
	for _, job := range []uint32{testJob, otherJob} {
		if err := cache.Store(resultRecord(t, job, 5, 0b11, 7), time.Now()); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := m.RemoveJob(testJob); err != nil {
		t.Fatal(err)
	}
	c.forgetRemoved(map[uint32]bool{otherJob: true})
	if _, ok := cache.Get(testJob, 5); ok {
		t.Error("a removed job's result is still cached")
	}
	if _, ok := cache.Get(otherJob, 5); !ok {
		t.Error("an admitted job's result was dropped")
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.lastSeen) != 0 || len(c.keys) != 0 {
		t.Errorf("forgetRemoved kept lastSeen %v, keys of jobs %d", c.lastSeen, len(c.keys))
	}
}

// TestHandleReset: a bound worker's authenticated RESET frees its job's slots (and nothing of
// another job's) and is acknowledged; anyone else's RESET is refused and changes nothing.
func TestHandleReset(t *testing.T) {
	ct := newCtlTest(t)
	c, m := ct.c, ct.sw.Maps
	w, other := newWorker(t), newWorkerAt(t, "127.0.0.2")
	accept(t, c, sealed(t, ct.key, hdr(msgJoin, testJob, 1, 0), joinBody(workerMAC, resultIP)), testPort, w.addr)
	w.readAck(t, ct.key)

	// Slots held by both jobs: a half-filled one each.
	hold := func(idx, job uint32) {
		var s bpf.XdpaggSlot
		s.JobId, s.Seq, s.State, s.FanIn, s.Nvals, s.Bitmap = job, 7, uint8(bpf.XdpaggSlotStateSLOT_AGGREGATING), 2, 1, 1
		if err := m.Slots.Update(&idx, &s, ebpf.UpdateExist); err != nil {
			t.Fatal(err)
		}
	}
	hold(3, testJob)
	hold(4, otherJob)
	reset := sealed(t, ct.key, hdr(msgReset, testJob, 2, 0), nil)

	// Not from the binding: refused, nothing freed.
	wantRefused(t, c.handle(sealed(t, ct.key, hdr(msgReset, testJob, 3, 0), nil), testPort, other.addr), RejectNotMember, "RESET")
	if s, _ := m.Slot(3); s.State == uint8(bpf.XdpaggSlotStateSLOT_FREE) {
		t.Fatal("a refused RESET freed a slot")
	}
	// Under another job's key: unauthenticated.
	wantRefused(t, c.handle(sealed(t, ct.otherKey, hdr(msgReset, testJob, 4, 0), nil), testPort, w.addr), RejectUnauth, "RESET")

	accept(t, c, reset, testPort, w.addr)
	a, _ := w.readAck(t, ct.key)
	if a.Type != msgAck || a.Seq != 2 {
		t.Errorf("RESET answered with %+v, want an ACK of seq 2", a)
	}
	if s, _ := m.Slot(3); s.State != uint8(bpf.XdpaggSlotStateSLOT_FREE) {
		t.Errorf("the job's slot after RESET: state %d, want free", s.State)
	}
	if s, _ := m.Slot(4); s.State != uint8(bpf.XdpaggSlotStateSLOT_AGGREGATING) {
		t.Errorf("another job's slot after RESET: state %d, want still aggregating", s.State)
	}
	// A replay of the accepted RESET is refused.
	wantRefused(t, c.handle(reset, testPort, w.addr), RejectReplay, "RESET")
}

// TestHandleHalt: a bound worker's authenticated HALT reaches every member of its job as an
// authenticated MSG_HALT (its own included), and is acknowledged; a member that asks for a result
// soon after hears it again; a HALT from anyone but a binding is refused and tells nobody.
func TestHandleHalt(t *testing.T) {
	ct := newCtlTest(t)
	c := ct.c
	w0, w1, other := newWorker(t), newWorkerAt(t, "127.0.0.3"), newWorkerAt(t, "127.0.0.2")
	accept(t, c, sealed(t, ct.key, hdr(msgJoin, testJob, 1, 0), joinBody(workerMAC, resultIP)), testPort, w0.addr)
	w0.readAck(t, ct.key)
	accept(t, c, sealed(t, ct.key, hdr(msgJoin, testJob, 2, 1), joinBody(workerMAC, resultIP)), testPort2, w1.addr)
	w1.readAck(t, ct.key)

	wantRefused(t, c.handle(sealed(t, ct.key, hdr(msgHalt, testJob, 3, 0), nil), testPort, other.addr), RejectNotMember, "HALT")
	w0.noDatagram(t)
	w1.noDatagram(t)

	accept(t, c, sealed(t, ct.key, hdr(msgHalt, testJob, 0xabc, 0), nil), testPort, w0.addr)
	got := map[uint8]bool{}
	read := func(w *worker) wire.Header {
		h, _ := w.readAck(t, ct.key)
		if h.Type == msgHalt {
			if h.Seq != 0xabc || h.JobId != testJob {
				t.Errorf("halt notice %+v", h)
			}
			got[h.WorkerId] = true
		}
		return h
	}
	read(w0) // w0: its notice and the ACK of its HALT, in either order
	read(w0)
	read(w1) // w1: its notice
	if !got[0] || !got[1] {
		t.Errorf("halt notices reached workers %v, want 0 and 1", got)
	}
	// Worker 1 did not hear it (say) and asks for a result: reminded.
	accept(t, c, rtx(t, ct.key, 5, 1), testPort2, w1.addr)
	if h, _ := w1.readAck(t, ct.key); h.Type != msgHalt || h.Seq != 0xabc {
		t.Errorf("answer to a halted member's RETRANSMIT starts with %+v, want the halt notice", h)
	}
}

// TestHandleHeartbeat: the controller's heartbeat, under the switch's controller key, is answered
// with the switch's statistics sealed under a key derived from it; the wrong key, a replay, or a
// switch without a controller key get no answer.
func TestHandleHeartbeat(t *testing.T) {
	ct := newCtlTest(t)
	c := ct.c
	ctl := newWorkerAt(t, "127.0.0.5")
	ctlKey := make([]byte, ctlauth.KeySize)
	ctlKey[0] = 0x42
	beat := func(seq uint32, key []byte) []byte {
		return seal(t, key, wire.AppendHeader(nil, &wire.Header{Version: wire.Version, Type: msgHeartbeat, Seq: seq}))
	}
	wantRefused(t, c.handle(beat(1, ctlKey), testPort, ctl.addr), RejectUnauth, "no controller key")

	c.SetControllerKey(ctlKey)
	wantRefused(t, c.handle(beat(2, ct.key), testPort, ctl.addr), RejectUnauth, "HEARTBEAT")
	b := beat(3, ctlKey)
	accept(t, c, b, testPort, ctl.addr)
	seq, st, _ := ctl.readHeartbeat(t, ctlKey)
	if seq != 3 || st.PoolSize != 16 || st.Jobs != 2 || st.UptimeNs == 0 {
		t.Errorf("answer for seq %d with %+v", seq, st)
	}
	wantRefused(t, c.handle(b, testPort, ctl.addr), RejectReplay, "HEARTBEAT")
}

// readResult reads one datagram, which must be an (unauthenticated) MSG_RESULT, and returns its
// header and values.
func (w *worker) readResult(t *testing.T) (wire.Header, []int32) {
	t.Helper()
	b, _ := w.read(t, "result")
	h, vals, err := wire.ParsePacket(b)
	if err != nil || h.Type != wire.MsgResult {
		t.Fatalf("not a result: %+v, %v", h, err)
	}
	out := make([]int32, h.Count)
	for i := range out {
		out[i] = int32(binary.LittleEndian.Uint32(vals[4*i:]))
	}
	return h, out
}

// setH is a sealed SETH of testJob from worker w, asking for threshold h.
func setH(t testing.TB, key []byte, seq uint32, w uint8, h uint32) []byte {
	t.Helper()
	return seal(t, key, binary.LittleEndian.AppendUint32(msg(t, hdr(wire.MsgSetH, testJob, seq, w), nil), h))
}

// TestHandleSetH: a bound worker's authenticated SETH sets its job's threshold in the datapath
// (the jobs entry, in place) and is acknowledged; no trailer, another job's key, a sender that is
// not the binding, a replay and an H outside 1..workers are refused and change nothing.
func TestHandleSetH(t *testing.T) {
	ct := newCtlTest(t)
	c, m := ct.c, ct.sw.Maps
	w, other := newWorker(t), newWorkerAt(t, "127.0.0.2")
	accept(t, c, join(t, ct.key, 1, 0), testPort, w.addr)
	w.readAck(t, ct.key)
	threshold := func() uint8 {
		t.Helper()
		j, err := m.Admission(testJob)
		if err != nil {
			t.Fatal(err)
		}
		return j.Threshold
	}

	wantRefused(t, c.handle(binary.LittleEndian.AppendUint32(msg(t, hdr(wire.MsgSetH, testJob, 2, 0), nil), 3), testPort, w.addr), RejectMalformed, "SETH")
	wantRefused(t, c.handle(seal(t, ct.key, msg(t, hdr(wire.MsgSetH, testJob, 2, 0), nil)), testPort, w.addr), RejectMalformed, "SETH")
	wantRefused(t, c.handle(seal(t, ct.otherKey, binary.LittleEndian.AppendUint32(msg(t, hdr(wire.MsgSetH, testJob, 2, 0), nil), 3)), testPort, w.addr), RejectUnauth, "SETH")
	wantRefused(t, c.handle(setH(t, ct.key, 3, 0, 3), testPort, other.addr), RejectNotMember, "SETH")
	wantRefused(t, c.handle(setH(t, ct.key, 4, 1, 3), testPort, w.addr), RejectNotMember, "SETH") // worker 1 is not bound
	for _, bad := range []uint32{0, testWorkers + 1, 1 << 8, 1<<32 - 1} {
		wantRefused(t, c.handle(setH(t, ct.key, 5, 0, bad), testPort, w.addr), RejectBadH, "SETH")
	}
	w.noDatagram(t)
	if h := threshold(); h != 0 {
		t.Fatalf("refused SETHs left threshold %d", h)
	}

	ok := setH(t, ct.key, 6, 0, 3)
	accept(t, c, ok, testPort, w.addr)
	if a, _ := w.readAck(t, ct.key); a.Type != msgAck || a.Seq != 6 {
		t.Errorf("SETH answered with %+v, want an ACK of seq 6", a)
	}
	if h := threshold(); h != 3 {
		t.Errorf("threshold after SETH 3: %d", h)
	}
	wantRefused(t, c.handle(ok, testPort, w.addr), RejectReplay, "SETH")
	accept(t, c, setH(t, ct.key, 7, 0, testWorkers), testPort, w.addr)
	w.readAck(t, ct.key)
	if h := threshold(); h != testWorkers {
		t.Errorf("threshold after SETH %d: %d", testWorkers, h)
	}
	if j, _ := m.Admission(otherJob); j.Threshold != 0 {
		t.Errorf("another job's threshold changed to %d", j.Threshold)
	}
}

// TestHandleFBcast: a bound worker's authenticated FBCAST completes the named slot with the
// contributions it holds; every member of the job gets the partial sum as a RESULT whose bitmap
// names them, the retransmit cache keeps it, and the sender gets the ACK. Asked again, only the
// sender gets the (now complete) sum; a fragment the slot does not hold gets only the ACK. A
// sender that is not the binding, another job's key and a replay are refused and flush nothing.
func TestHandleFBcast(t *testing.T) {
	ct := newCtlTest(t)
	c, m := ct.c, ct.sw.Maps
	cache := NewResultCache(time.Minute, 100)
	c.SetCache(cache)
	w0, w1, other := newWorker(t), newWorkerAt(t, "127.0.0.3"), newWorkerAt(t, "127.0.0.2")
	accept(t, c, join(t, ct.key, 1, 0), testPort, w0.addr)
	w0.readAck(t, ct.key)
	accept(t, c, join(t, ct.key, 2, 1), testPort2, w1.addr)
	w1.readAck(t, ct.key)

	// Slot 3 aggregates <testJob, 7>: workers 0 and 2 of 4 are in.
	idx := uint32(3)
	s := bpf.XdpaggSlot{JobId: testJob, Seq: 7, State: uint8(bpf.XdpaggSlotStateSLOT_AGGREGATING), FanIn: testWorkers,
		Nvals: 2, Bitmap: 0b101, Counter: 2, ScaleLog2: 24, TsNs: 1}
	s.Vals[0], s.Vals[1] = 5, -6
	if err := m.Slots.Update(&idx, &s, ebpf.UpdateExist); err != nil {
		t.Fatal(err)
	}
	fb := func(seq, slot uint32, w uint8, key []byte) []byte {
		h := hdr(wire.MsgFBcast, testJob, seq, w)
		h.AggIndex = slot
		return sealed(t, key, h, nil)
	}
	state := func() uint8 {
		sl, err := m.Slot(idx)
		if err != nil {
			t.Fatal(err)
		}
		return sl.State
	}
	wantRefused(t, c.handle(fb(7, idx, 0, ct.key), testPort, other.addr), RejectNotMember, "FBCAST")
	wantRefused(t, c.handle(fb(7, idx, 0, ct.otherKey), testPort, w0.addr), RejectUnauth, "FBCAST")
	w0.noDatagram(t)
	w1.noDatagram(t)
	if st := state(); st != uint8(bpf.XdpaggSlotStateSLOT_AGGREGATING) {
		t.Fatalf("refused FBCASTs left the slot in state %d", st)
	}

	ok := fb(7, idx, 0, ct.key)
	accept(t, c, ok, testPort, w0.addr)
	want := wire.Header{Version: wire.Version, Type: wire.MsgResult, ScaleLog2: 24, Flags: wire.FlagFromSwitch, Count: 2,
		JobId: testJob, Seq: 7, AggIndex: idx, Bitmap0: 0b101, FanIn0: testWorkers}
	for _, w := range []*worker{w0, w1} {
		h, vals := w.readResult(t)
		if h != want || len(vals) != 2 || vals[0] != 5 || vals[1] != -6 {
			t.Errorf("flushed result %+v %v, want %+v [5 -6]", h, vals, want)
		}
	}
	if a, _ := w0.readAck(t, ct.key); a.Type != msgAck || a.Seq != 7 {
		t.Errorf("FBCAST answered with %+v, want an ACK of seq 7", a)
	}
	if st := state(); st != uint8(bpf.XdpaggSlotStateSLOT_COMPLETE) {
		t.Errorf("slot state after FBCAST: %d, want complete", st)
	}
	if pkt, hit := cache.Get(testJob, 7); !hit || len(pkt) != wire.HdrSize+8 {
		t.Errorf("flushed result not in the retransmit cache (%d bytes, %v)", len(pkt), hit)
	}
	wantRefused(t, c.handle(ok, testPort, w0.addr), RejectReplay, "FBCAST")

	// Again, from worker 1: the slot is complete; only the asker gets the sum.
	accept(t, c, fb(7, idx, 1, ct.key), testPort2, w1.addr)
	if h, _ := w1.readResult(t); h != want {
		t.Errorf("complete slot's result %+v, want %+v", h, want)
	}
	w1.readAck(t, ct.key)
	w0.noDatagram(t)
	// A fragment the slot does not hold: nothing flushed, only the ACK.
	accept(t, c, fb(8, idx, 0, ct.key), testPort, w0.addr)
	if a, _ := w0.readAck(t, ct.key); a.Type != msgAck || a.Seq != 8 {
		t.Errorf("FBCAST of nothing answered with %+v, want an ACK of seq 8", a)
	}
	w0.noDatagram(t)
	w1.noDatagram(t)
}
