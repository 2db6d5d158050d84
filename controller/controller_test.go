package controller

import (
	"context"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/wire"
)

// fakeAgent answers heartbeats on loopback like the agent does, with statistics the test sets;
// silent makes it stop answering.
type fakeAgent struct {
	conn    *net.UDPConn
	key     []byte
	stamper ctlauth.Stamper
	silent  atomic.Bool
	delay   atomic.Int64 // nanoseconds to wait before answering
	mu      sync.Mutex
	stats   bpf.XdpaggHeartbeatStats
}

func newFakeAgent(t *testing.T, key []byte) *fakeAgent {
	t.Helper()
	conn, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeAgent{conn: conn, key: key}
	answers, err := ctlauth.NewHeartbeatAnswers(key)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	go func() {
		buf := make([]byte, 512)
		for {
			n, from, err := conn.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			msg, _, err := ctlauth.Open(key, buf[:n])
			if err != nil || f.silent.Load() {
				continue
			}
			var h wire.Header
			wire.DecodeHeader(msg, &h)
			time.Sleep(time.Duration(f.delay.Load()))
			f.mu.Lock()
			st := f.stats
			f.mu.Unlock()
			out, _ := answers.Seal(h.Seq, f.stamper.Next(), &st)
			_, _ = conn.WriteToUDPAddrPort(out, from)
		}
	}()
	return f
}

func (f *fakeAgent) addr() netip.AddrPort { return f.conn.LocalAddr().(*net.UDPAddr).AddrPort() }

func (f *fakeAgent) set(st bpf.XdpaggHeartbeatStats) {
	f.mu.Lock()
	f.stats = st
	f.mu.Unlock()
}

func wait(t *testing.T, m *Monitor, i int, state string) Status {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		s := m.Status()[i]
		if s.State == state {
			return s
		}
		if time.Now().After(deadline) {
			t.Fatalf("switch %d is %s (%s), want %s", i, s.State, s.Reason, state)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestPolicy: answering switches are healthy; one that stops answering is suspect after one miss
// and failed after FailAfter; one whose drop share passes the threshold is suspect while it
// lasts; a switch answering under another key never becomes healthy.
func TestPolicy(t *testing.T) {
	key, _ := ctlauth.NewKey()
	other, _ := ctlauth.NewKey()
	a, b, c := newFakeAgent(t, key), newFakeAgent(t, key), newFakeAgent(t, other)
	var mu sync.Mutex
	var changes []Status
	m, err := NewMonitor(netip.MustParseAddrPort("127.0.0.1:0"), []Target{
		{Name: "a", Addr: a.addr(), Key: key}, {Name: "b", Addr: b.addr(), Key: key}, {Name: "c", Addr: c.addr(), Key: key},
	}, Policy{Interval: 20 * time.Millisecond, FailAfter: 3, OnChange: func(s Status) {
		mu.Lock()
		changes = append(changes, s)
		mu.Unlock()
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go m.Run(ctx)

	wait(t, m, 0, StateHealthy)
	wait(t, m, 1, StateHealthy)
	a.silent.Store(true)
	wait(t, m, 0, StateFailed)
	if s := m.Status()[0]; s.Failures != 1 || s.Misses < 3 {
		t.Errorf("failed switch: %+v", s)
	}
	a.silent.Store(false)
	wait(t, m, 0, StateHealthy)

	// b drops most of what it sees between two answers.
	b.set(bpf.XdpaggHeartbeatStats{Rx: 10_000, Dropped: 9_000})
	wait(t, m, 1, StateSuspect)
	b.set(bpf.XdpaggHeartbeatStats{Rx: 20_000, Dropped: 9_000})
	wait(t, m, 1, StateHealthy)

	if s := m.Status()[2]; s.State == StateHealthy || s.Answered != 0 {
		t.Errorf("a switch answering under another key: %+v", s)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(changes) == 0 {
		t.Error("OnChange was never called")
	}
}

func TestNewRefuses(t *testing.T) {
	key, _ := ctlauth.NewKey()
	ok := Target{Name: "a", Addr: netip.MustParseAddrPort("127.0.0.1:9510"), Key: key}
	for _, c := range []struct {
		name string
		ts   []Target
	}{
		{"none", nil},
		{"twice", []Target{ok, ok}},
		{"short key", []Target{{Name: "a", Addr: ok.Addr, Key: key[:5]}}},
		{"no port", []Target{{Name: "a", Addr: netip.AddrPortFrom(ok.Addr.Addr(), 0), Key: key}}},
	} {
		if _, err := NewMonitor(netip.MustParseAddrPort("127.0.0.1:0"), c.ts, Policy{}); err == nil {
			t.Errorf("%s: New accepted it", c.name)
		}
	}
}
