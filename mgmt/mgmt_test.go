package mgmt

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/ctlauth"
)

// fakeHandler records the calls it gets and answers from its fields.
type fakeHandler struct {
	mu       sync.Mutex
	calls    []string
	admitted []Job
	snap     *Snapshot
	restored *Snapshot
	err      error // returned by every call when set
}

func (f *fakeHandler) note(s string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, s)
	return f.err
}

func (f *fakeHandler) Admit(j Job) error {
	f.mu.Lock()
	f.admitted = append(f.admitted, j)
	f.mu.Unlock()
	return f.note("admit")
}
func (f *fakeHandler) Remove(id uint32) error { return f.note(fmt.Sprint("remove ", id)) }
func (f *fakeHandler) Reset(id uint32) error  { return f.note(fmt.Sprint("reset ", id)) }
func (f *fakeHandler) Snapshot(s Scope) (*Snapshot, error) {
	if err := f.note(fmt.Sprint("snapshot ", s)); err != nil {
		return nil, err
	}
	return f.snap, nil
}
func (f *fakeHandler) Restore(s *Snapshot) (RestoreStats, error) {
	f.mu.Lock()
	f.restored = s
	f.mu.Unlock()
	if err := f.note("restore"); err != nil {
		return RestoreStats{}, err
	}
	return RestoreStats{Jobs: len(s.Jobs), Members: len(s.Members), Slots: len(s.Slots), Skipped: 1}, nil
}
func (f *fakeHandler) Drain() error { return f.note("drain") }

func (f *fakeHandler) callList() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.calls...)
}

func testKey(t *testing.T) []byte {
	t.Helper()
	k, err := ctlauth.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// serve runs a Server of h on a loopback port (addr: "127.0.0.1:0" or a port to reuse) until the
// returned stop is called (also at cleanup).
func serve(t *testing.T, addr string, key []byte, h Handler) (*Server, netip.AddrPort, func()) {
	t.Helper()
	ln, err := net.Listen("tcp4", addr)
	if err != nil {
		t.Fatal(err)
	}
	s, err := NewServer(key, h)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, ln) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Serve: %v", err)
			}
		})
	}
	t.Cleanup(stop)
	return s, ln.Addr().(*net.TCPAddr).AddrPort(), stop
}

func testSnapshot() *Snapshot {
	return &Snapshot{
		Switch: "sw1", Taken: time.Unix(1700000000, 5).UTC(), Scope: ScopeAll, Pool: 64, Arrays: 8,
		Jobs: []Job{{ID: 7, Workers: 3, PS: netip.MustParseAddrPort("10.0.0.2:9510"), PSPort: "eth1", MaxSlots: 16, Key: make([]byte, 32)}},
		Members: []Member{{Job: 7, Worker: 1, Port: "eth2", Addr: netip.MustParseAddrPort("10.0.1.2:4000"),
			MAC: net.HardwareAddr{2, 0, 0, 0, 0, 1}}},
		Slots:  []Slot{{Index: 3, Value: []byte{1, 2, 3}, Idle: 5 * time.Millisecond}},
		Sparse: []Raw{{Map: "registers", Key: []byte{1}, Value: []byte{2}}},
		Cache:  [][]byte{{9, 9, 9}},
	}
}

// TestRoundTrip drives every operation through a Client and checks what the handler got and what
// came back.
func TestRoundTrip(t *testing.T) {
	key := testKey(t)
	h := &fakeHandler{snap: testSnapshot()}
	_, addr, _ := serve(t, "127.0.0.1:0", key, h)
	c, err := Dial(addr, key)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx := context.Background()
	j := Job{ID: 9, Workers: 2, PS: netip.MustParseAddrPort("10.1.0.2:9510"), PSPort: "eth3", Key: key}
	if err := c.Admit(ctx, j); err != nil {
		t.Fatalf("Admit: %v", err)
	}
	if err := c.Reset(ctx, 9); err != nil {
		t.Fatalf("Reset: %v", err)
	}
	if err := c.Remove(ctx, 9); err != nil {
		t.Fatalf("Remove: %v", err)
	}
	snap, err := c.Snapshot(ctx, ScopeAll)
	if err != nil {
		t.Fatalf("Snapshot: %v", err)
	}
	if !reflect.DeepEqual(snap, h.snap) {
		t.Errorf("snapshot\n got %+v\nwant %+v", snap, h.snap)
	}
	st, err := c.Restore(ctx, snap)
	if err != nil {
		t.Fatalf("Restore: %v", err)
	}
	if want := (RestoreStats{Jobs: 1, Members: 1, Slots: 1, Skipped: 1}); st != want {
		t.Errorf("restore stats %+v, want %+v", st, want)
	}
	if !reflect.DeepEqual(h.restored, h.snap) {
		t.Errorf("restored\n got %+v\nwant %+v", h.restored, h.snap)
	}
	if err := c.Drain(ctx); err != nil {
		t.Fatalf("Drain: %v", err)
	}
	want := []string{"admit", "reset 9", "remove 9", "snapshot 1", "restore", "drain"}
	if got := h.callList(); !reflect.DeepEqual(got, want) {
		t.Errorf("calls %v, want %v", got, want)
	}
	if !reflect.DeepEqual(h.admitted, []Job{j}) {
		t.Errorf("admitted %+v, want %+v", h.admitted, j)
	}
}

// TestErrorsCrossTheWire: the handler's sentinels come back as the client's.
func TestErrorsCrossTheWire(t *testing.T) {
	key := testKey(t)
	h := &fakeHandler{}
	_, addr, _ := serve(t, "127.0.0.1:0", key, h)
	c, _ := Dial(addr, key)
	for _, tc := range []struct {
		err, want error
	}{
		{fmt.Errorf("%w: job 9 has another key", ErrRefused), ErrRefused},
		{fmt.Errorf("%w: pool 64, this switch 128", ErrIncompatible), ErrIncompatible},
		{errors.New("map update: ENOMEM"), ErrFailed},
	} {
		h.err = tc.err
		err := c.Admit(context.Background(), Job{ID: 1})
		if !errors.Is(err, tc.want) {
			t.Errorf("handler error %v: client got %v, want %v", tc.err, err, tc.want)
		}
	}
}

// rawExchange sends one frame payload on a new connection and returns the answer's payload
// (io.EOF if the server closed the connection without one).
func rawExchange(t *testing.T, addr netip.AddrPort, payload []byte) ([]byte, error) {
	t.Helper()
	conn, err := net.Dial("tcp4", addr.String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(30 * time.Second)) // only keeps a broken test from hanging
	if err := writeFrame(conn, payload); err != nil {
		t.Fatal(err)
	}
	return readFrame(bufio.NewReader(conn))
}

func sealedRequest(t *testing.T, keys frameKeys, stamp uint64, op string, args any) []byte {
	t.Helper()
	req := request{Op: op}
	if args != nil {
		req.Args, _ = json.Marshal(args)
	}
	body, _ := json.Marshal(req)
	p, err := seal(keys.req, stamp, body)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// TestAttacks: frames a host on the management network can send without the key (or with
// recorded frames) are dropped, counted, and never reach the handler.
func TestAttacks(t *testing.T) {
	key := testKey(t)
	keys, _ := deriveKeys(key)
	otherKeys, _ := deriveKeys(testKey(t))
	h := &fakeHandler{snap: testSnapshot()}
	srv, addr, _ := serve(t, "127.0.0.1:0", key, h)
	var st ctlauth.Stamper

	// A genuine request, answered once, and its answer.
	good := sealedRequest(t, keys, st.Next(), opRemove, uint32(5))
	answer, err := rawExchange(t, addr, good)
	if err != nil {
		t.Fatalf("genuine request: %v", err)
	}

	tampered := append([]byte(nil), good...)
	tampered[len(tampered)-20] ^= 1
	stale := sealedRequest(t, keys, uint64(time.Now().Add(-2*ctlauth.MaxSkew).UnixNano()), opRemove, uint32(6))
	future := sealedRequest(t, keys, uint64(time.Now().Add(2*ctlauth.MaxSkew).UnixNano()), opRemove, uint32(6))
	garbage, _ := seal(keys.req, st.Next(), []byte("not json"))

	for _, tc := range []struct {
		name, reason string
		payload      []byte
	}{
		{"replayed request", BadFrameReplay, good},
		{"tampered request", BadFrameAuth, tampered},
		{"wrong key", BadFrameAuth, sealedRequest(t, otherKeys, st.Next(), opRemove, uint32(6))},
		{"response replayed as request", BadFrameAuth, answer},
		{"request sealed under the response key", BadFrameAuth, func() []byte { p, _ := seal(keys.resp, st.Next(), []byte(`{"op":"drain"}`)); return p }()},
		{"stale stamp", BadFrameReplay, stale},
		{"stamp from the future", BadFrameReplay, future},
		{"short frame", BadFrameAuth, []byte{1, 2, 3}},
		{"authentic garbage", BadFrameBody, garbage},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := srv.BadFrames()[tc.reason]
			if _, err := rawExchange(t, addr, tc.payload); !errors.Is(err, io.EOF) {
				t.Fatalf("answered (%v), want the connection closed", err)
			}
			if got := srv.BadFrames()[tc.reason]; got != before+1 {
				t.Errorf("bad frames %q: %d, want %d", tc.reason, got, before+1)
			}
		})
	}
	if got := h.callList(); !reflect.DeepEqual(got, []string{"remove 5"}) {
		t.Errorf("handler calls %v, want only the genuine request", got)
	}

	// A client with the wrong key: no answer, ErrFrame; the right one still works after all that.
	bad, _ := Dial(addr, testKey(t))
	if err := bad.Drain(context.Background()); !errors.Is(err, ErrFrame) {
		t.Errorf("wrong-key client: %v, want ErrFrame", err)
	}
	c, _ := Dial(addr, key)
	if err := c.Reset(context.Background(), 5); err != nil {
		t.Errorf("genuine client after the attacks: %v", err)
	}
}

// TestOversizeFrame: a length beyond MaxFrame is refused from the prefix alone, before anything is
// buffered; the client refuses to send one too.
func TestOversizeFrame(t *testing.T) {
	key := testKey(t)
	srv, addr, _ := serve(t, "127.0.0.1:0", key, &fakeHandler{})
	conn, err := net.Dial("tcp4", addr.String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(30 * time.Second))
	var l [4]byte
	binary.BigEndian.PutUint32(l[:], MaxFrame+1)
	if _, err := conn.Write(l[:]); err != nil {
		t.Fatal(err)
	}
	if _, err := readFrame(bufio.NewReader(conn)); !errors.Is(err, io.EOF) {
		t.Fatalf("answered (%v), want the connection closed", err)
	}
	if got := srv.BadFrames()[BadFrameFormat]; got != 1 {
		t.Errorf("bad frames %q: %d, want 1", BadFrameFormat, got)
	}
	if err := writeFrame(io.Discard, make([]byte, MaxFrame+1)); !errors.Is(err, ErrFrame) {
		t.Errorf("writeFrame of MaxFrame+1 bytes: %v, want ErrFrame", err)
	}

	// A frame cut short: counted as a bad frame too.
	conn2, err := net.Dial("tcp4", addr.String())
	if err != nil {
		t.Fatal(err)
	}
	binary.BigEndian.PutUint32(l[:], 1000)
	conn2.Write(append(l[:], make([]byte, 10)...))
	conn2.(*net.TCPConn).CloseWrite()
	_ = conn2.SetDeadline(time.Now().Add(30 * time.Second))
	if _, err := readFrame(bufio.NewReader(conn2)); !errors.Is(err, io.EOF) {
		t.Fatalf("answered (%v), want the connection closed", err)
	}
	conn2.Close()
	if got := srv.BadFrames()[BadFrameFormat]; got != 2 {
		t.Errorf("bad frames %q after a cut frame: %d, want 2", BadFrameFormat, got)
	}
}

// TestAgentRestart: one Client keeps working across the agent's restart (a new Server, with a
// fresh replay window, on the same port), and fails cleanly while it is down.
func TestAgentRestart(t *testing.T) {
	key := testKey(t)
	h := &fakeHandler{}
	_, addr, stop := serve(t, "127.0.0.1:0", key, h)
	c, _ := Dial(addr, key)
	ctx := context.Background()
	if err := c.Reset(ctx, 1); err != nil {
		t.Fatal(err)
	}
	stop()
	if err := c.Reset(ctx, 2); err == nil {
		t.Fatal("call to a stopped agent succeeded")
	}
	serve(t, addr.String(), key, h)
	if err := c.Reset(ctx, 3); err != nil {
		t.Fatalf("after the restart: %v", err)
	}
	if got, want := h.callList(), []string{"reset 1", "reset 3"}; !reflect.DeepEqual(got, want) {
		t.Errorf("calls %v, want %v", got, want)
	}
}

// TestConcurrentCalls: calls from many goroutines on one Client are all answered (they queue, so
// the agent sees their stamps in order).
func TestConcurrentCalls(t *testing.T) {
	key := testKey(t)
	h := &fakeHandler{}
	_, addr, _ := serve(t, "127.0.0.1:0", key, h)
	c, _ := Dial(addr, key)
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for i := range 16 {
		wg.Go(func() { errs <- c.Reset(context.Background(), uint32(i)) })
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	if n := len(h.callList()); n != 16 {
		t.Errorf("%d calls handled, want 16", n)
	}
}

// TestCancel: a call whose context ends while the agent is silent returns the context's error.
func TestCancel(t *testing.T) {
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() { // accepts and never answers
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			defer conn.Close()
		}
	}()
	c, _ := Dial(ln.Addr().(*net.TCPAddr).AddrPort(), testKey(t))
	ctx, cancel := context.WithCancel(context.Background())
	go func() { time.Sleep(50 * time.Millisecond); cancel() }()
	if err := c.Drain(ctx); !errors.Is(err, context.Canceled) {
		t.Errorf("Drain: %v, want context.Canceled", err)
	}
}

// syncHandler is a fakeHandler with the optional Sync.
type syncHandler struct {
	fakeHandler
	synced []SyncRequest
}

func (h *syncHandler) Sync(r SyncRequest) (RestoreStats, error) {
	h.mu.Lock()
	h.synced = append(h.synced, r)
	h.mu.Unlock()
	if err := h.note("sync"); err != nil {
		return RestoreStats{}, err
	}
	return RestoreStats{Jobs: len(r.Snapshot.Jobs), Members: len(r.Snapshot.Members), Unbound: 1, Removed: len(r.Gone)}, nil
}

// TestSync: the sync operation crosses the wire to a handler that has it; a handler without it
// (an agent of before it) refuses it as an unknown operation, and nothing else is called; a
// sync without a snapshot is refused before the handler.
func TestSync(t *testing.T) {
	key := testKey(t)
	h := &syncHandler{}
	_, addr, _ := serve(t, "127.0.0.1:0", key, h)
	c, _ := Dial(addr, key)
	ctx := context.Background()
	snap := testSnapshot()
	st, err := c.Sync(ctx, SyncRequest{Snapshot: snap, Gone: []uint32{5}})
	if want := (RestoreStats{Jobs: 1, Members: 1, Unbound: 1, Removed: 1}); err != nil || st != want {
		t.Fatalf("Sync: %+v %v, want %+v", st, err, want)
	}
	if len(h.synced) != 1 || !reflect.DeepEqual(h.synced[0].Snapshot, snap) || !slices.Equal(h.synced[0].Gone, []uint32{5}) {
		t.Errorf("synced %+v", h.synced)
	}
	if _, err := c.Sync(ctx, SyncRequest{}); !errors.Is(err, ErrRefused) || len(h.synced) != 1 {
		t.Errorf("Sync without a snapshot: %v (handler called %d times)", err, len(h.synced))
	}

	old := &fakeHandler{}
	_, addr, _ = serve(t, "127.0.0.1:0", key, old)
	c, _ = Dial(addr, key)
	if _, err := c.Sync(ctx, SyncRequest{Snapshot: snap}); !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "unknown operation") {
		t.Errorf("Sync to a handler without it: %v, want ErrRefused (unknown operation)", err)
	}
	if got := old.callList(); len(got) != 0 {
		t.Errorf("calls %v", got)
	}
}

// fakeConn is a connection from addr, for the connection table alone.
type fakeConn struct {
	net.Conn
	addr net.Addr
}

func (c *fakeConn) RemoteAddr() net.Addr { return c.addr }

func connFrom(ip string) *fakeConn {
	return &fakeConn{addr: &net.TCPAddr{IP: net.ParseIP(ip), Port: 40000}}
}

// TestConnShares: one address holds at most MaxConnsPerSource connections (a new one closes the
// address's own that waited longest), and a full table makes room for a newcomer by closing one
// of the address holding the most, if it holds more; a connection whose request is being handled
// is never closed for another.
func TestConnShares(t *testing.T) {
	tb := connTable{conns: map[net.Conn]*connState{}, perSrc: map[netip.Addr]int{}}
	admit := func(c net.Conn, wantEvict net.Conn, wantRefused string) {
		t.Helper()
		ev, refused := tb.admit(c)
		if ev != wantEvict || refused != wantRefused {
			t.Fatalf("admit %v: closes %v, refused %q; want %v, %q", c.RemoteAddr(), ev, refused, wantEvict, wantRefused)
		}
	}
	// One address: its fifth and sixth connections close its first two.
	var a []net.Conn
	for i := range MaxConnsPerSource + 2 {
		a = append(a, connFrom("10.0.0.1"))
		var ev net.Conn
		if i >= MaxConnsPerSource {
			ev = a[i-MaxConnsPerSource]
		}
		admit(a[i], ev, "")
	}
	if tb.held(a[0]) || tb.held(a[1]) || !tb.held(a[2]) || tb.perSrc[netip.MustParseAddr("10.0.0.1")] != MaxConnsPerSource {
		t.Fatalf("after six connections from one address: %v", tb.perSrc)
	}
	// A request of a[2] is being handled: the next closes a[3] instead.
	tb.handling(a[2], true)
	extra := connFrom("10.0.0.1")
	admit(extra, a[3], "")
	// Seven more addresses fill the table with MaxConnsPerSource each.
	for s := range MaxConns/MaxConnsPerSource - 1 {
		for range MaxConnsPerSource {
			admit(connFrom(fmt.Sprintf("10.0.1.%d", s)), nil, "")
		}
	}
	// A newcomer (the controller) gets in: a[4], the longest waiting of an address holding the
	// most, is closed.
	admit(connFrom("10.0.9.9"), a[4], "")
	// With every connection of an address being handled, a fifth from it is refused.
	for _, c := range []net.Conn{a[5], extra} {
		tb.handling(c, true)
	}
	// 10.0.0.1 now holds a[2], a[5], extra (handling) and nothing else: give it a fourth, handled.
	fourth := connFrom("10.0.0.1")
	ev, refused := tb.admit(fourth)
	if refused != "" || ev == nil {
		t.Fatalf("fourth connection of 10.0.0.1: closes %v, refused %q", ev, refused)
	}
	tb.handling(fourth, true)
	admit(connFrom("10.0.0.1"), nil, BadFrameSourceBusy)

	// MaxConns addresses holding one each: another connection from one of them is refused, as
	// nobody holds more.
	tb = connTable{conns: map[net.Conn]*connState{}, perSrc: map[netip.Addr]int{}}
	for i := range MaxConns {
		admit(connFrom(fmt.Sprintf("10.0.2.%d", i)), nil, "")
	}
	admit(connFrom("10.0.2.0"), nil, BadFrameBusy)
	// Released connections make room.
	for c := range tb.conns {
		tb.release(c)
		break
	}
	admit(connFrom("10.0.2.0"), nil, "")
}

// TestConnFlood: silent connections from one address, and from as many addresses as fill the
// table, do not keep the controller out: its call is answered, every connection beyond the table
// was closed for another (or timed out), and a silent connection is closed after the idle timeout.
func TestConnFlood(t *testing.T) {
	key := testKey(t)
	srv, addr, _ := serve(t, "127.0.0.1:0", key, &fakeHandler{})
	dial := func(src string) net.Conn {
		t.Helper()
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
		c, err := d.Dial("tcp4", addr.String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	opened := 0
	for range 2 * MaxConns {
		dial("127.0.0.2")
		opened++
	}
	for s := range MaxConns/MaxConnsPerSource - 1 {
		for range MaxConnsPerSource {
			dial(fmt.Sprintf("127.0.1.%d", s+1))
			opened++
		}
	}
	c, _ := Dial(addr, key)
	if err := c.Reset(context.Background(), 1); err != nil {
		t.Fatalf("the controller's call during the flood: %v", err)
	}
	opened++
	// The table never holds more than MaxConns: every other connection left it by then.
	bad := srv.BadFrames()
	if left := bad[BadFrameEvicted] + bad[BadFrameSlow]; left < uint64(opened-MaxConns) {
		t.Errorf("%d connections opened, %d closed for others and %d timed out: the table held more than %d", opened, bad[BadFrameEvicted], bad[BadFrameSlow], MaxConns)
	}
	if bad[BadFrameBusy] != 0 || bad[BadFrameSourceBusy] != 0 {
		t.Errorf("connections refused: %v", bad)
	}

	// A connection that sends nothing is closed after the idle timeout.
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv2, err := NewServer(key, &fakeHandler{})
	if err != nil {
		t.Fatal(err)
	}
	srv2.idle = 50 * time.Millisecond
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go srv2.Serve(ctx, ln)
	silent, err := net.Dial("tcp4", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	_ = silent.SetReadDeadline(time.Now().Add(30 * time.Second)) // only a hang guard
	if _, err := silent.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Fatalf("silent connection: %v, want it closed", err)
	}
	if got := srv2.BadFrames()[BadFrameSlow]; got != 1 {
		t.Errorf("bad frames %q: %d, want 1", BadFrameSlow, got)
	}
}
