package hostlib

// Who may talk to a worker and to the PS: results only from the PS's address (or a joined
// switch agent), acknowledgements only authenticated from the switch agent, DATA only from a
// job's admitted members, and per-job bounds on the PS's memory.

import (
	"context"
	"encoding/binary"
	"errors"
	"net"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/wire"
)

func testKey(t *testing.T) []byte {
	t.Helper()
	k, err := ctlauth.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// listenOn is a UDP socket on ip (any 127.0.0.0/8 address is local on Linux), closed at cleanup.
func listenOn(t *testing.T, ip string, port uint16) *net.UDPConn {
	t.Helper()
	c, err := net.ListenUDP("udp4", net.UDPAddrFromAddrPort(netip.AddrPortFrom(netip.MustParseAddr(ip), port)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func connAddr(c *net.UDPConn) netip.AddrPort { return c.LocalAddr().(*net.UDPAddr).AddrPort() }

// A worker takes results from its PS's address and port, and from the switch agent only once it
// has joined; from anywhere else they are dropped unread and counted Foreign.
func TestWorkerResultSources(t *testing.T) {
	ps := fzSink(t, 2) // the DATA the worker sends goes there
	at := func(ip string, port uint16) netip.AddrPort { return netip.AddrPortFrom(netip.MustParseAddr(ip), port) }
	agent := at("127.0.0.9", ps.Port())
	const (
		notJoined = iota
		joining   // a Join sent to agent waits for its ACK
		joined
		left // joined, then left
	)
	for _, c := range []struct {
		name   string
		state  int
		from   netip.AddrPort
		cached bool
		taken  bool
	}{
		{"from the PS", notJoined, ps, false, true},
		{"from the PS's host, another port", notJoined, at("127.0.0.1", ps.Port()+1), false, false},
		{"from another host, the PS's port", notJoined, at("127.0.0.2", ps.Port()), false, false},
		{"from the switch agent, not joined", notJoined, agent, true, false},
		{"from the switch agent, Join not acknowledged", joining, agent, true, false},
		{"from the switch agent, joined", joined, agent, true, true},
		{"from the PS, joined", joined, ps, false, true},
		{"from the switch agent's host, another port", joined, at("127.0.0.9", ps.Port()+1), true, false},
		{"from the switch agent after Leave", left, agent, true, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			w := newFuzzWorker(t)
			w.cfg.PS, w.psAddr = ps, sockaddr4(ps)
			data, _ := fzGuarded(fzWorkerN)
			w.mu.Lock()
			w.op.active, w.op.data, w.op.seqBase, w.op.nfrags = true, data, 0, (fzWorkerN+fzWorkerK-1)/fzWorkerK
			switch c.state {
			case joining:
				w.ackWant, w.ackFrom, w.ackPending = 1, sockaddr4(agent), true
			case joined:
				w.ctrl, w.ctrlRaw, w.ctrlSet = agent, sockaddr4(agent), true
			case left:
				w.ctrl, w.ctrlRaw, w.ctrlSet = agent, sockaddr4(agent), false
			}
			w.mu.Unlock()
			if _, err := w.step(); err != nil {
				t.Fatal(err)
			}
			var flags uint16
			if c.cached {
				flags = wire.FlagCached
			}
			fzInject(w.bc, 0, fzResult(0, flags, wire.EncFixed32, 5), c.from)
			before := slices.Clone(data)
			w.mu.Lock()
			w.handleResult(w.bc.datagram(0))
			w.mu.Unlock()
			s := w.Stats()
			if c.taken {
				if s.ResultsReceived != 1 || s.Foreign != 0 || data[0] != 5 {
					t.Fatalf("result not taken: %+v, data[0] = %v", s, data[0])
				}
				if c.cached && s.CacheResults != 1 {
					t.Fatalf("cached result not counted: %+v", s)
				}
				return
			}
			if s.Foreign != 1 || s.ResultsReceived+s.DuplicateResults+s.Malformed != 0 || !sameBits(data, before) {
				t.Fatalf("result from %v taken or miscounted: %+v", c.from, s)
			}
		})
	}
}

// fakeAgent is a switch agent's control socket on loopback: it records what workers send (opened
// under the job key) and answers JOIN and LEAVE with whatever answer returns, from reply (nil:
// its own socket).
type fakeAgent struct {
	t      *testing.T
	conn   *net.UDPConn
	key    []byte
	answer func(h wire.Header) []byte
	reply  *net.UDPConn

	mu      sync.Mutex
	msgs    []wire.Header // authentic messages received, in order
	stamps  []uint64
	bodies  [][]byte
	unauth  int
	stopped chan struct{}
}

func newFakeAgent(t *testing.T, key []byte, reply *net.UDPConn, answer func(h wire.Header) []byte) *fakeAgent {
	a := &fakeAgent{t: t, conn: listenOn(t, "127.0.0.1", 0), key: key, answer: answer, reply: reply, stopped: make(chan struct{})}
	go a.run()
	t.Cleanup(func() {
		a.conn.Close()
		<-a.stopped
	})
	return a
}

func (a *fakeAgent) addr() netip.AddrPort { return connAddr(a.conn) }

func (a *fakeAgent) run() {
	defer close(a.stopped)
	buf := make([]byte, 2048)
	for {
		n, from, err := a.conn.ReadFromUDPAddrPort(buf)
		if err != nil {
			return
		}
		msg, stamp, err := ctlauth.Open(a.key, buf[:n])
		a.mu.Lock()
		if err != nil || len(msg) < wire.HdrSize {
			a.unauth++
			a.mu.Unlock()
			continue
		}
		var h wire.Header
		wire.DecodeHeader(msg, &h)
		a.msgs = append(a.msgs, h)
		a.stamps = append(a.stamps, stamp)
		a.bodies = append(a.bodies, slices.Clone(msg[wire.HdrSize:]))
		a.mu.Unlock()
		if h.Type != wire.MsgJoin && h.Type != wire.MsgLeave &&
			h.Type != wire.MsgRetransmit && h.Type != wire.MsgSetH && h.Type != wire.MsgFBcast {
			continue
		}
		out := a.answer(h)
		if out == nil {
			continue
		}
		c := a.conn
		if a.reply != nil {
			c = a.reply
		}
		_, _ = c.WriteToUDPAddrPort(out, from)
	}
}

func (a *fakeAgent) received() ([]wire.Header, []uint64, [][]byte, int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return slices.Clone(a.msgs), slices.Clone(a.stamps), slices.Clone(a.bodies), a.unauth
}

// ackOf is the agent's MSG_ACK of h (seq and worker id as given), sealed under key with stamp
// (nil key: no trailer).
func ackOf(t *testing.T, key []byte, h wire.Header, seq uint32, worker uint8, stamp uint64) []byte {
	b := make([]byte, wire.HdrSize)
	wire.EncodeHeader(b, &wire.Header{Version: wire.Version, Type: wire.MsgAck, JobId: h.JobId, Seq: seq, WorkerId: worker})
	if key == nil {
		return b
	}
	b, err := ctlauth.Seal(key, b, stamp)
	if err != nil {
		t.Error(err)
	}
	return b
}

func newKeyedWorker(t *testing.T, cfg WorkerConfig) *Worker {
	t.Helper()
	if cfg.JobID == 0 {
		cfg.JobID, cfg.NumWorkers, cfg.WorkerID = 3, 2, 1
	}
	cfg.Local = netip.AddrPortFrom(loopback, 0)
	if !cfg.PS.IsValid() {
		cfg.PS = blackHole(t)
	}
	w, err := NewWorker(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	return w
}

var testMAC = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x42}

// Join completes only on an authenticated, fresh MSG_ACK of its nonce, from the switch address it
// was sent to; every (re)sent JOIN is authenticated, freshly stamped, and names no result source.
func TestJoinAuthenticatedAck(t *testing.T) {
	key := testKey(t)
	otherKey := testKey(t)
	now := func() uint64 { return uint64(time.Now().UnixNano()) }
	var agentStamps ctlauth.Stamper
	// answer is the agent's answer to the control message h; prior is the stamp of the ACK that
	// completed a first Join, for cases that run a Leave after one (0 otherwise).
	type answerFunc func(h wire.Header, prior uint64) []byte
	fresh := func(h wire.Header, _ uint64) []byte { return ackOf(t, key, h, h.Seq, h.WorkerId, agentStamps.Next()) }
	stats := func(f func(s WorkerStats) uint64) func(s WorkerStats) uint64 { return f }
	for _, c := range []struct {
		name      string
		answer    answerFunc
		prior     bool // a first Join succeeds, then a Leave gets answer
		elsewhere bool // answer from another port of the agent's host
		ok        bool // the Join (Leave) completes
		accepted  bool // the answers count as ControlAcks
		counter   func(s WorkerStats) uint64
	}{
		{name: "authentic", answer: fresh, ok: true, accepted: true, counter: stats(func(s WorkerStats) uint64 { return s.ControlAcks })},
		{name: "authentic, Leave after Join", answer: fresh, prior: true, ok: true, accepted: true,
			counter: stats(func(s WorkerStats) uint64 { return s.ControlAcks })},
		{name: "no trailer", answer: func(h wire.Header, _ uint64) []byte { return ackOf(t, nil, h, h.Seq, h.WorkerId, 0) },
			counter: stats(func(s WorkerStats) uint64 { return s.Unauthenticated })},
		{name: "another job's key", answer: func(h wire.Header, _ uint64) []byte { return ackOf(t, otherKey, h, h.Seq, h.WorkerId, now()) },
			counter: stats(func(s WorkerStats) uint64 { return s.Unauthenticated })},
		{name: "tampered", answer: func(h wire.Header, _ uint64) []byte {
			b := ackOf(t, key, h, h.Seq, h.WorkerId, now())
			b[len(b)-1] ^= 0x80
			return b
		}, counter: stats(func(s WorkerStats) uint64 { return s.Unauthenticated })},
		{name: "stale stamp", answer: func(h wire.Header, _ uint64) []byte {
			return ackOf(t, key, h, h.Seq, h.WorkerId, now()-uint64(2*ctlauth.MaxSkew))
		}, counter: stats(func(s WorkerStats) uint64 { return s.Replayed })},
		{name: "stamp from the future", answer: func(h wire.Header, _ uint64) []byte {
			return ackOf(t, key, h, h.Seq, h.WorkerId, now()+uint64(2*ctlauth.MaxSkew))
		}, counter: stats(func(s WorkerStats) uint64 { return s.Replayed })},
		{name: "stamp already accepted", prior: true, answer: func(h wire.Header, prior uint64) []byte {
			return ackOf(t, key, h, h.Seq, h.WorkerId, prior) // the right nonce, an authentic but used stamp
		}, counter: stats(func(s WorkerStats) uint64 { return s.Replayed })},
		{name: "wrong nonce", accepted: true, answer: func(h wire.Header, _ uint64) []byte {
			return ackOf(t, key, h, h.Seq+1, h.WorkerId, agentStamps.Next())
		}, counter: stats(func(s WorkerStats) uint64 { return s.ControlAcks })},
		{name: "another worker's", answer: func(h wire.Header, _ uint64) []byte {
			return ackOf(t, key, h, h.Seq, h.WorkerId+1, agentStamps.Next())
		}, counter: stats(func(s WorkerStats) uint64 { return s.Malformed })},
		{name: "from another port", elsewhere: true, answer: fresh, counter: stats(func(s WorkerStats) uint64 { return s.Foreign })},
	} {
		t.Run(c.name, func(t *testing.T) {
			w := newKeyedWorker(t, WorkerConfig{JobKey: key})
			var reply *net.UDPConn
			if c.elsewhere {
				reply = listenOn(t, "127.0.0.1", 0)
			}
			var mu sync.Mutex
			var priorStamp uint64
			a := newFakeAgent(t, key, reply, func(h wire.Header) []byte {
				mu.Lock()
				defer mu.Unlock()
				if c.prior && h.Type == wire.MsgJoin {
					priorStamp = agentStamps.Next()
					return ackOf(t, key, h, h.Seq, h.WorkerId, priorStamp)
				}
				return c.answer(h, priorStamp)
			})
			op := w.Join
			if c.prior {
				if err := w.Join(context.Background(), a.addr(), testMAC); err != nil {
					t.Fatalf("prior Join: %v", err)
				}
				op = w.Leave
			}
			before := w.Stats()
			ctx, cancelAll := context.WithTimeout(context.Background(), time.Minute) // a hang guard
			defer cancelAll()
			if !c.ok {
				// A refused answer leaves the Join resending: give up once it has been resent
				// and the answer counted (no timing assumed; waitFor is the hang guard).
				var cancel context.CancelFunc
				ctx, cancel = context.WithCancel(ctx)
				defer cancel()
				go func() {
					defer cancel()
					for i := 0; i < 100000; i++ {
						msgs, _, _, _ := a.received()
						if len(msgs) >= 2+b2i(c.prior) && c.counter(w.Stats()) > c.counter(before) {
							return
						}
						time.Sleep(100 * time.Microsecond)
					}
				}()
			}
			err := op(ctx, a.addr(), testMAC)
			s := w.Stats()
			if c.ok != (err == nil) || (!c.ok && !errors.Is(err, ErrTimeout)) {
				t.Fatalf("err = %v, want success %v or else ErrTimeout (stats %+v)", err, c.ok, s)
			}
			if c.counter(s) <= c.counter(before) {
				t.Fatalf("stats %+v: the expected counter did not move", s)
			}
			if !c.accepted && s.ControlAcks != before.ControlAcks {
				t.Fatalf("stats %+v: a refused ACK was counted accepted", s)
			}

			// What the agent got: authentic JOINs (LEAVEs) of one nonce per call, stamps
			// strictly increasing, body = the MAC and result_ip 0.
			msgs, stamps, bodies, unauth := a.received()
			if unauth != 0 || len(msgs) == 0 {
				t.Fatalf("agent: %d authentic messages, %d not", len(msgs), unauth)
			}
			for i, h := range msgs {
				if h.JobId != 3 || h.WorkerId != 1 || h.FanIn0 != 2 || h.Bitmap0 != 2 || h.Count != 0 {
					t.Fatalf("control message %d: %+v", i, h)
				}
				var jb bpf.XdpaggJoinBody
				if _, err := binary.Decode(bodies[i], binary.LittleEndian, &jb); err != nil || len(bodies[i]) != 12 {
					t.Fatalf("control message %d body %x: %v", i, bodies[i], err)
				}
				if !slices.Equal(jb.Mac[:], testMAC) || jb.ResultIp != 0 || jb.Reserved != 0 {
					t.Fatalf("control message %d body %+v: want the MAC and result_ip 0", i, jb)
				}
				if i > 0 && stamps[i] <= stamps[i-1] {
					t.Fatalf("stamps %v not strictly increasing", stamps)
				}
				if i > 0 && msgs[i].Type == msgs[i-1].Type && h.Seq != msgs[i-1].Seq {
					t.Fatalf("a resend changed the nonce: %+v after %+v", h, msgs[i-1])
				}
			}
			if !c.ok && len(msgs) < 2+b2i(c.prior) {
				t.Fatalf("%d control messages: the JOIN was not resent", len(msgs))
			}
		})
	}
}

// Join and Leave refuse to run without the job's key, or with a switch address that cannot work.
func TestJoinConfig(t *testing.T) {
	w := newKeyedWorker(t, WorkerConfig{})
	sw := netip.MustParseAddrPort("127.0.0.1:9510")
	if err := w.Join(context.Background(), sw, testMAC); !errors.Is(err, ErrConfig) {
		t.Errorf("Join without a key: %v, want ErrConfig", err)
	}
	if err := w.Leave(context.Background(), sw, testMAC); !errors.Is(err, ErrConfig) {
		t.Errorf("Leave without a key: %v, want ErrConfig", err)
	}
	w = newKeyedWorker(t, WorkerConfig{JobKey: testKey(t)})
	for _, bad := range []netip.AddrPort{netip.MustParseAddrPort("[::1]:9510"), netip.MustParseAddrPort("0.0.0.0:9510"),
		netip.MustParseAddrPort("127.0.0.1:0"), {}} {
		if err := w.Join(context.Background(), bad, testMAC); !errors.Is(err, ErrConfig) {
			t.Errorf("Join(%v): %v, want ErrConfig", bad, err)
		}
	}
	if err := w.Join(context.Background(), sw, testMAC[:5]); !errors.Is(err, ErrConfig) {
		t.Errorf("Join with a 5-byte MAC: %v, want ErrConfig", err)
	}
	if _, err := NewWorker(WorkerConfig{JobID: 1, NumWorkers: 1, Local: netip.AddrPortFrom(loopback, 0), PS: sw,
		JobKey: make([]byte, ctlauth.KeySize+1)}); !errors.Is(err, ErrConfig) {
		t.Errorf("NewWorker with a 33-byte key: %v, want ErrConfig", err)
	}
}

// A joined worker authenticates its RETRANSMITs and cumulative ACKs, with stamps that keep
// increasing after its JOIN's, and acts on the agent's cache-miss answer only when it is
// authentic and comes from the agent.
func TestJoinedWorkerControlPath(t *testing.T) {
	key := testKey(t)
	var stamps ctlauth.Stamper
	a := newFakeAgent(t, key, nil, func(h wire.Header) []byte {
		// JOIN: acknowledged; RETRANSMIT: a miss (ACK of its seq).
		return ackOf(t, key, h, h.Seq, h.WorkerId, stamps.Next())
	})
	// A PS of one worker: answers every DATA with its values as the sum, except the first
	// transmission of seq 0, which it drops (so the worker asks the cache, then resends).
	ps := listenOn(t, "127.0.0.1", 0)
	w := newKeyedWorker(t, WorkerConfig{JobID: 4, NumWorkers: 1, PS: connAddr(ps), JobKey: key,
		Timeout: 100 * time.Millisecond, Window: 4, PoolSize: 16, ValuesPerPacket: 4})
	go func() {
		buf := make([]byte, 2048)
		dropped := false
		for {
			n, from, err := ps.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			h, _, err := wire.ParsePacket(buf[:n])
			if err != nil || h.Type != wire.MsgData {
				continue
			}
			if h.Seq == 0 && !dropped {
				dropped = true
				continue
			}
			buf[wire.OffType] = wire.MsgResult
			binary.LittleEndian.PutUint16(buf[wire.OffFlags:], 0)
			_, _ = ps.WriteToUDPAddrPort(buf[:n], from)
		}
	}()
	if err := w.Join(context.Background(), a.addr(), testMAC); err != nil {
		t.Fatal(err)
	}
	// Forged and unauthenticated cache misses: FuzzWorkerResult's seeds.
	data := make([]float32, 10*fzWorkerK)
	for i := range data {
		data[i] = float32(i) / 4
	}
	want := slices.Clone(data)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := w.AllReduce(ctx, data); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(data, want) {
		t.Fatalf("sum of one worker changed the data")
	}
	nfrags := uint32((len(data) + w.cfg.ValuesPerPacket - 1) / w.cfg.ValuesPerPacket)
	waitFor(t, func() bool {
		msgs, _, _, _ := a.received()
		for _, h := range msgs {
			if h.Type == wire.MsgAck && h.Seq == nfrags {
				return true
			}
		}
		return false
	})
	waitFor(t, func() bool { return w.Stats().ControlAcks >= 2 }) // the Join's and the miss's
	msgs, st, _, unauth := a.received()
	if unauth != 0 {
		t.Fatalf("the agent got %d unauthenticated messages from the worker", unauth)
	}
	asked := false
	for i, h := range msgs {
		if i > 0 && st[i] <= st[i-1] {
			t.Fatalf("stamps %v not strictly increasing", st)
		}
		if h.JobId != 4 || h.WorkerId != 0 || h.Bitmap0 != 1 {
			t.Fatalf("control message %d: %+v", i, h)
		}
		asked = asked || (h.Type == wire.MsgRetransmit && h.Seq == 0)
	}
	if msgs[0].Type != wire.MsgJoin || !asked {
		t.Fatalf("agent got %+v: want the JOIN, then a RETRANSMIT of seq 0 (its DATA was lost)", msgs)
	}
	if s := w.Stats(); s.CacheRequests == 0 || s.Unauthenticated+s.Replayed+s.Foreign != 0 {
		t.Fatalf("worker stats %+v", s)
	}
}

// psMembersBench is a PS (serving) for job 5 (workers at A and B) and job 6 (worker 0 on any
// port of 127.0.0.1, worker 1 at C on 127.0.0.2), with sockets to send from.
type psMembersBench struct {
	ps            *PS
	sw            *net.UDPConn
	a, b, c       *net.UDPConn
	otherPort     *net.UDPConn // 127.0.0.1, no member's port
	otherIP       *net.UDPConn // 127.0.0.3, A's port
	otherIPAnyJob *net.UDPConn // 127.0.0.4
}

func newPSMembersBench(t *testing.T) *psMembersBench {
	t.Helper()
	m := &psMembersBench{sw: blackHoleConn(t), a: listenOn(t, "127.0.0.1", 0), b: listenOn(t, "127.0.0.1", 0),
		c: listenOn(t, "127.0.0.2", 0), otherPort: listenOn(t, "127.0.0.1", 0)}
	m.otherIP = listenOn(t, "127.0.0.3", connAddr(m.a).Port())
	m.otherIPAnyJob = listenOn(t, "127.0.0.4", 0)
	cfg := PSConfig{Listen: netip.AddrPortFrom(loopback, freePort(t)), Switch: connAddr(m.sw), Shards: 1,
		Jobs: []PSJob{
			{ID: 5, Workers: []netip.AddrPort{connAddr(m.a), connAddr(m.b)}},
			{ID: 6, Workers: []netip.AddrPort{netip.AddrPortFrom(loopback, 0), connAddr(m.c)}},
		}}
	ps, err := NewPS(cfg)
	if err != nil {
		t.Fatal(err)
	}
	m.ps = ps
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ps.Serve(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-done
		ps.Close()
	})
	return m
}

// send sends pkt from c and waits until the PS has handled it.
func (m *psMembersBench) send(t *testing.T, c *net.UDPConn, pkt []byte) PSStats {
	t.Helper()
	n := m.ps.Stats().Received
	if _, err := c.WriteToUDPAddrPort(pkt, m.ps.LocalAddr()); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { s := m.ps.Stats(); return s.Received > n && psSettled(s) })
	return m.ps.Stats()
}

// psSettled reports whether every datagram the PS counted as received has its verdict counted
// too (Received is counted first).
func psSettled(s PSStats) bool {
	return s.Aggregated+s.Duplicates+s.Malformed+s.Dropped+s.UnknownJob+s.NotMember+s.OverQuota+s.Unsupported == s.Received
}

// The PS sums DATA only of its jobs, from the member the worker id names, at that member's
// address and port (any port for a member given with port 0), in an encoding it can sum.
func TestPSAdmission(t *testing.T) {
	m := newPSMembersBench(t)
	type verdict int
	const (
		aggregated verdict = iota
		unknownJob
		notMember
		unsupported
		malformed
	)
	seq := uint32(100)
	type sender func(m *psMembersBench) *net.UDPConn
	a := func(m *psMembersBench) *net.UDPConn { return m.a }
	b := func(m *psMembersBench) *net.UDPConn { return m.b }
	for _, c := range []struct {
		name    string
		from    sender
		job     uint32
		worker  uint8
		fan     uint8
		enc     uint8
		verdict verdict
	}{
		{"member", a, 5, 0, 2, wire.EncFixed32, aggregated},
		{"second member", b, 5, 1, 2, wire.EncFixed32, aggregated},
		{"float32 from a member", b, 5, 1, 2, wire.EncFloat32, aggregated},
		{"unknown job", a, 7, 0, 2, wire.EncFixed32, unknownJob},
		{"job id 0", a, 0, 0, 2, wire.EncFixed32, malformed},
		{"worker id beyond the job", a, 5, 2, 3, wire.EncFixed32, notMember},
		{"another member's worker id", a, 5, 1, 2, wire.EncFixed32, notMember},
		{"member's address, another port", func(m *psMembersBench) *net.UDPConn { return m.otherPort }, 5, 0, 2, wire.EncFixed32, notMember},
		{"member's port, another address", func(m *psMembersBench) *net.UDPConn { return m.otherIP }, 5, 0, 2, wire.EncFixed32, notMember},
		{"a member of another job", func(m *psMembersBench) *net.UDPConn { return m.c }, 5, 0, 2, wire.EncFixed32, notMember},
		{"any-port member, some port", func(m *psMembersBench) *net.UDPConn { return m.otherPort }, 6, 0, 2, wire.EncFixed32, aggregated},
		{"any-port member, another address", func(m *psMembersBench) *net.UDPConn { return m.otherIPAnyJob }, 6, 0, 2, wire.EncFixed32, notMember},
		{"member on another host", func(m *psMembersBench) *net.UDPConn { return m.c }, 6, 1, 2, wire.EncFixed32, aggregated},
		{"sparse encoding from a member", b, 5, 1, 2, wire.EncSparseKV, unsupported},
		{"unknown encoding from a member", b, 5, 1, 2, wire.EncSparseKV + 1, unsupported},
		{"sparse encoding from an outsider", func(m *psMembersBench) *net.UDPConn { return m.otherPort }, 5, 1, 2, wire.EncSparseKV, notMember},
		{"fan-in not the job's", a, 5, 0, 3, wire.EncFixed32, malformed},
	} {
		t.Run(c.name, func(t *testing.T) {
			seq++
			d := dataPkt{job: c.job, seq: seq, enc: c.enc, worker: c.worker, fan: c.fan, scale: 24, vals: i32s(1, 2)}.bytes()
			was := m.ps.Stats()
			st := m.send(t, c.from(m), d)
			got := [...]uint64{st.Aggregated - was.Aggregated, st.UnknownJob - was.UnknownJob, st.NotMember - was.NotMember,
				st.Unsupported - was.Unsupported, st.Malformed - was.Malformed}
			want := [5]uint64{}
			want[c.verdict] = 1
			if got != want || st.Received != was.Received+1 {
				t.Fatalf("aggregated/unknownJob/notMember/unsupported/malformed moved by %v, want %v (stats %+v)", got, want, st)
			}
		})
	}
}

// An outsider cannot read a job's sum by sending a duplicate contribution: only the member whose
// worker id it names gets the stored result.
func TestPSOutsiderCannotReadSums(t *testing.T) {
	m := newPSMembersBench(t)
	d := func(worker uint8) []byte {
		return dataPkt{job: 5, seq: 1, enc: wire.EncFixed32, worker: worker, fan: 2, scale: 24, vals: i32s(7)}.bytes()
	}
	m.send(t, m.a, d(0))
	m.send(t, m.b, d(1))
	if h, vals := recvResult(t, m.sw); h.Bitmap0 != 3 || vals[0] != 14 {
		t.Fatalf("result %+v %v", h, vals)
	}
	for _, c := range []*net.UDPConn{m.otherPort, m.otherIP, m.c} {
		if st := m.send(t, c, d(0)); st.ResultsResent != 0 {
			t.Fatalf("an outsider got the result: %+v", st)
		}
	}
	m.send(t, m.a, d(0))
	waitFor(t, func() bool { return m.ps.Stats().ResultsResent > 0 }) // counted after the verdict
	if st := m.ps.Stats(); st.ResultsResent != 1 || st.NotMember != 3 {
		t.Fatalf("stats %+v: want the member's duplicate answered, 3 outsiders refused", st)
	}
	_ = m.a.SetReadDeadline(time.Now().Add(10 * time.Second))
	buf := make([]byte, 2048)
	n, err := m.a.Read(buf)
	if err != nil {
		t.Fatal(err)
	}
	if h, _, err := wire.ParsePacket(buf[:n]); err != nil || h.Type != wire.MsgResult || h.Flags&wire.FlagShadow == 0 {
		t.Fatalf("member got %+v (%v), want the stored result", h, err)
	}
}

// A job that floods the PS fills its own share of MaxEntries and nothing else: another job's
// aggregations in progress and kept results survive, and it can still admit new ones.
func TestPSJobShares(t *testing.T) {
	const jobA, jobB, share = 5, 6, 4
	for _, flood := range []struct {
		name     string
		complete bool // the flood's fragments complete (both workers send), or only one worker resends
	}{
		{"resends of ever new seqs", false},
		{"completed sums", true},
	} {
		t.Run(flood.name, func(t *testing.T) {
			var p *PS
			a, b := fzSink(t, 0), fzSink(t, 1)
			fzOnFreePort(t, func(listen netip.AddrPort) (err error) {
				p, err = NewPS(PSConfig{Listen: listen, Switch: fzSink(t, 2), Shards: 1, SocketBuffer: 1 << 16, MaxEntries: 2 * share,
					Jobs: []PSJob{{ID: jobA, Workers: []netip.AddrPort{a, a}}, {ID: jobB, Workers: []netip.AddrPort{b, b}}}})
				return err
			})
			t.Cleanup(func() { p.Close() })
			s := p.socks[0]
			now := int64(0)
			send := func(from netip.AddrPort, pkt []byte) PSStats {
				now += int64(time.Microsecond)
				fzInject(s.bc, 0, pkt, from)
				p.handle(s, 0, now)
				if err := s.flush(); err != nil {
					t.Fatal(err)
				}
				return p.Stats()
			}
			data := func(job, seq uint32, worker uint8, flags uint16, v int32) []byte {
				return fzPSData(job, seq, wire.EncFixed32, worker, 2, flags, fzI32s(v)...)
			}
			// Job B: one sum in progress (seq 1), one completed and kept (seq 2).
			send(b, data(jobB, 1, 0, 0, 10))
			send(b, data(jobB, 2, 0, 0, 1))
			send(b, data(jobB, 2, 1, 0, 2))

			// Job A floods.
			var st PSStats
			for seq := uint32(100); seq < 300; seq++ {
				if flood.complete {
					send(a, data(jobA, seq, 0, 0, 1))
					st = send(a, data(jobA, seq, 1, 0, 1))
				} else {
					st = send(a, data(jobA, seq, 0, wire.FlagResend, 1))
				}
			}
			accA, accB := p.jobs[jobA].acct, p.jobs[jobB].acct
			if n := accA.n.Load(); n != share {
				t.Fatalf("job A holds %d entries, want its share %d", n, share)
			}
			if n := accB.n.Load(); n != 2 {
				t.Fatalf("job B holds %d entries after A's flood, want its 2", n)
			}
			if flood.complete {
				if st.OverQuota != 0 || st.Completed != 1+200 {
					t.Fatalf("stats %+v: completing sums must make room among A's own results", st)
				}
			} else if st.OverQuota != 200-share || st.Aggregated != 3+share {
				t.Fatalf("stats %+v: want A's fragments beyond its share of %d dropped", st, share)
			}

			// B's sum in progress completes, its kept result still answers a resend, and it
			// still has room for new sums.
			was := st
			st = send(b, data(jobB, 1, 1, 0, 20))
			if st.Completed != was.Completed+1 {
				t.Fatalf("job B's pending sum did not complete: %+v", st)
			}
			e := p.table(psKey{job: jobB, seq: 1, enc: wire.EncFixed32}).entries[psKey{job: jobB, seq: 1, enc: wire.EncFixed32}]
			if e == nil || !e.complete || int32(binary.LittleEndian.Uint32(e.pkt[wire.HdrSize:])) != 30 {
				t.Fatalf("job B's sum: %+v", e)
			}
			if st = send(b, data(jobB, 2, 0, wire.FlagResend, 1)); st.ResultsResent != was.ResultsResent+1 {
				t.Fatalf("job B's kept result was evicted: %+v", st)
			}
			for seq := uint32(3); seq < 3+share; seq++ {
				if st = send(b, data(jobB, seq, 0, 0, 1)); st.OverQuota != was.OverQuota {
					t.Fatalf("job B could not admit seq %d after A's flood: %+v", seq, st)
				}
			}
		})
	}
}

// SetThreshold and FBcast send authenticated SETH (body: H, little-endian) and FBCAST (header
// only, naming the fragment's seq and slot) and complete on the agent's ACK of them; an H outside
// 1..NumWorkers fails at once, sending nothing.
func TestSetThresholdAndFBcastMessages(t *testing.T) {
	key := testKey(t)
	var stamps ctlauth.Stamper
	agent := newFakeAgent(t, key, nil, func(h wire.Header) []byte { return ackOf(t, key, h, h.Seq, h.WorkerId, stamps.Next()) })
	w := newKeyedWorker(t, WorkerConfig{JobID: 9, NumWorkers: 4, WorkerID: 2, JobKey: key, PoolSize: 64, Window: 8})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second) // a hang guard only
	defer cancel()
	for _, bad := range []uint8{0, 5} {
		if err := w.SetThreshold(ctx, agent.addr(), bad); !errors.Is(err, ErrConfig) {
			t.Errorf("SetThreshold(%d): %v, want ErrConfig", bad, err)
		}
	}
	if err := w.SetThreshold(ctx, agent.addr(), 3); err != nil {
		t.Fatal(err)
	}
	if err := w.FBcast(ctx, agent.addr(), 21); err != nil {
		t.Fatal(err)
	}
	msgs, _, bodies, unauth := agent.received()
	if len(msgs) != 2 || unauth != 0 {
		t.Fatalf("agent got %d authentic messages (%d not): %+v", len(msgs), unauth, msgs)
	}
	if h := msgs[0]; h.Type != wire.MsgSetH || h.JobId != 9 || h.WorkerId != 2 || len(bodies[0]) != 4 || binary.LittleEndian.Uint32(bodies[0]) != 3 {
		t.Errorf("SETH %+v body %x", h, bodies[0])
	}
	if h := msgs[1]; h.Type != wire.MsgFBcast || h.Seq != 21 || h.AggIndex != AggIndex(9, 21, 8, 64) || h.WorkerId != 2 || len(bodies[1]) != 0 {
		t.Errorf("FBCAST %+v body %x, want seq 21 slot %d", h, bodies[1], AggIndex(9, 21, 8, 64))
	}
}

// TestControlCallBesideAllReduce: a control call made while the worker's AllReduce runs (a Halt
// stopping it, a SetH or FBcast of an asynchronous job) completes on the agent's first ACK. The
// agent here acknowledges each request once and ignores its resends, so a call that missed its
// ACK (AllReduce took the receive goroutine's wake-up, which both once waited on) would run out
// its context; every one of many calls must complete. Nothing here depends on timing but the
// hang guard.
func TestControlCallBesideAllReduce(t *testing.T) {
	key := testKey(t)
	var stamps ctlauth.Stamper
	var mu sync.Mutex
	acked := map[uint32]bool{}
	a := newFakeAgent(t, key, nil, func(h wire.Header) []byte {
		mu.Lock()
		defer mu.Unlock()
		if h.Type != wire.MsgJoin && acked[h.Seq] {
			return nil // a resend: its ACK went out already
		}
		acked[h.Seq] = true
		return ackOf(t, key, h, h.Seq, h.WorkerId, stamps.Next())
	})
	w := newKeyedWorker(t, WorkerConfig{JobID: 4, NumWorkers: 2, WorkerID: 1, JobKey: key, Timeout: time.Second})
	if err := w.Join(context.Background(), a.addr(), testMAC); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	reduced := make(chan error, 1)
	go func() { reduced <- w.AllReduce(ctx, make([]float32, 1<<16)) }() // the PS never answers
	waitFor(t, func() bool { return w.Stats().DataSent > 0 })
	for i := range 50 {
		cctx, ccancel := context.WithTimeout(context.Background(), time.Minute) // hang guard
		err := w.SetThreshold(cctx, a.addr(), uint8(1+i%2))
		ccancel()
		if err != nil {
			t.Fatalf("call %d beside a running AllReduce: %v", i, err)
		}
	}
	cancel()
	if err := <-reduced; !errors.Is(err, context.Canceled) {
		t.Fatalf("AllReduce: %v, want context.Canceled", err)
	}
}
