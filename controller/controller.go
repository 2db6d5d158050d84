// Package controller watches xdpagg switches: it sends each switch's agent an authenticated
// MSG_HEARTBEAT at a fixed interval, takes the statistics the agent answers with, and decides by
// a stated policy whether the switch is healthy, suspect or failed (Libra §3.6: missed
// heartbeats, or statistics past thresholds). It does not log and does not exit: callers read
// Status and get state changes through Policy.OnChange.
//
// On top of the Monitor, a Controller (failover.go) owns switch groups — a primary and a standby
// with the same port names, addresses and MACs, dual-homed hosts — and their jobs: it admits each
// job on both switches, keeps a replica of the active switch's control state, and fails a group
// over to its standby when the active switch fails or degrades (DegradePolicy), or when an
// operator asks, restoring the state it could read there (docs/operations.md).
package controller

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/wire"
)

// ErrConfig reports an unusable configuration.
var ErrConfig = errors.New("invalid controller configuration")

// Target is one switch the controller watches.
type Target struct {
	Name string
	Addr netip.AddrPort // the switch's address the controller reaches its agent at, and the xdpagg port
	Key  []byte         // the switch's controller key (`xdpagg switch --controller-key-file`)
}

// Policy decides when a switch is failing.
type Policy struct {
	// Interval between heartbeats (default 200ms); a heartbeat not answered within it is missed.
	Interval time.Duration
	// SuspectAfter and FailAfter consecutive missed heartbeats make a switch suspect and failed
	// (defaults 1 and 3): a failed switch is declared within FailAfter x Interval of its last
	// answer.
	SuspectAfter, FailAfter int
	// MaxDropShare: a switch whose dropped packets (malformed, not_member, spoofed, ip_invalid,
	// ctl_limited) exceed this share of the xdpagg packets it saw between two answers, over at
	// least MinPackets of them, is suspect while that lasts (default 0.5 of 1000): it answers,
	// but is being flooded or misconfigured.
	MaxDropShare float64
	MinPackets   uint64
	// OnChange, if set, is called (from Run's goroutine) whenever a switch changes state.
	OnChange func(Status)
}

func (p Policy) withDefaults() Policy {
	if p.Interval == 0 {
		p.Interval = 200 * time.Millisecond
	}
	if p.SuspectAfter == 0 {
		p.SuspectAfter = 1
	}
	if p.FailAfter == 0 {
		p.FailAfter = 3
	}
	if p.MaxDropShare == 0 {
		p.MaxDropShare = 0.5
	}
	if p.MinPackets == 0 {
		p.MinPackets = 1000
	}
	return p
}

// States of a switch.
const (
	StateUnknown = "unknown" // no answer yet
	StateHealthy = "healthy"
	StateSuspect = "suspect"
	StateFailed  = "failed"
)

// Status is what the controller knows of one switch.
type Status struct {
	Name       string                   `json:"name"`
	Addr       netip.AddrPort           `json:"addr"`
	State      string                   `json:"state"`
	Reason     string                   `json:"reason,omitempty"`
	Since      time.Time                `json:"since"`               // when it entered State
	LastAnswer time.Time                `json:"last_answer"`         // zero: never
	RTT        time.Duration            `json:"rtt_ns"`              // of the last answer
	Misses     int                      `json:"consecutive_misses"`  // heartbeats unanswered since the last answer
	Sent       uint64                   `json:"heartbeats_sent"`     //
	Answered   uint64                   `json:"heartbeats_answered"` //
	Failures   int                      `json:"failures"`            // times it was declared failed
	Stats      bpf.XdpaggHeartbeatStats `json:"stats"`               // the last answer's
}

// Monitor heartbeats a set of switches.
type Monitor struct {
	policy  Policy
	targets []Target
	conn    *net.UDPConn
	stamper ctlauth.Stamper
	replay  ctlauth.Replay[netip.AddrPort]
	answers []*ctlauth.HeartbeatAnswers // per target: opens its answers

	mu     sync.Mutex
	status []Status
	sentAt []time.Time // per target: when the outstanding heartbeat left
	seq    []uint32    // per target: its nonce
	prev   []bpf.XdpaggHeartbeatStats
}

// NewMonitor binds the controller's socket at local (port 0: any) and returns a monitor of targets.
func NewMonitor(local netip.AddrPort, targets []Target, p Policy) (*Monitor, error) {
	if len(targets) == 0 {
		return nil, fmt.Errorf("%w: no switches to watch", ErrConfig)
	}
	seen := map[string]bool{}
	var answers []*ctlauth.HeartbeatAnswers
	for _, t := range targets {
		switch {
		case t.Name == "" || seen[t.Name]:
			return nil, fmt.Errorf("%w: switch name %q empty or given twice", ErrConfig, t.Name)
		case !t.Addr.Addr().Is4() || t.Addr.Port() == 0:
			return nil, fmt.Errorf("%w: switch %s at %v: need an IPv4 address and port", ErrConfig, t.Name, t.Addr)
		}
		a, err := ctlauth.NewHeartbeatAnswers(t.Key)
		if err != nil {
			return nil, fmt.Errorf("%w: switch %s: %w", ErrConfig, t.Name, err)
		}
		answers = append(answers, a)
		seen[t.Name] = true
	}
	p = p.withDefaults()
	if p.FailAfter < p.SuspectAfter || p.Interval < time.Millisecond {
		return nil, fmt.Errorf("%w: policy %+v", ErrConfig, p)
	}
	conn, err := net.ListenUDP("udp4", net.UDPAddrFromAddrPort(local))
	if err != nil {
		return nil, fmt.Errorf("listen on %v: %w", local, err)
	}
	m := &Monitor{policy: p, targets: slices.Clone(targets), answers: answers, conn: conn, status: make([]Status, len(targets)),
		sentAt: make([]time.Time, len(targets)), seq: make([]uint32, len(targets)),
		prev: make([]bpf.XdpaggHeartbeatStats, len(targets))}
	now := time.Now()
	for i, t := range targets {
		m.status[i] = Status{Name: t.Name, Addr: t.Addr, State: StateUnknown, Since: now}
	}
	return m, nil
}

// Status returns every switch's status, in the order given to New.
func (m *Monitor) Status() []Status {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Clone(m.status)
}

// Close closes the socket; Run returns.
func (m *Monitor) Close() error { return m.conn.Close() }

// Run heartbeats every switch each Interval until ctx ends or the monitor is closed.
func (m *Monitor) Run(ctx context.Context) error {
	stop := context.AfterFunc(ctx, func() { _ = m.conn.SetReadDeadline(time.Unix(1, 0)) })
	defer stop()
	buf := make([]byte, 1024)
	next := time.Now()
	for {
		if ctx.Err() != nil {
			return nil
		}
		if now := time.Now(); !now.Before(next) {
			m.tick(now)
			next = now.Add(m.policy.Interval)
		}
		_ = m.conn.SetReadDeadline(next)
		n, from, err := m.conn.ReadFromUDPAddrPort(buf)
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			if errors.Is(err, net.ErrClosed) || ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("receive: %w", err)
		}
		m.answer(buf[:n], netip.AddrPortFrom(from.Addr().Unmap(), from.Port()), time.Now())
	}
}

// tick counts the outstanding heartbeats as missed and sends the next ones.
func (m *Monitor) tick(now time.Time) {
	m.mu.Lock()
	var changed []Status
	for i, t := range m.targets {
		st := &m.status[i]
		if !m.sentAt[i].IsZero() {
			st.Misses++ // the last one went unanswered
			switch {
			case st.Misses >= m.policy.FailAfter && st.State != StateFailed:
				st.Failures++
				changed = append(changed, m.enter(i, StateFailed, fmt.Sprintf("%d heartbeats unanswered", st.Misses), now))
			case st.Misses >= m.policy.SuspectAfter && st.State != StateFailed && st.State != StateSuspect:
				changed = append(changed, m.enter(i, StateSuspect, fmt.Sprintf("%d heartbeats unanswered", st.Misses), now))
			}
		}
		m.seq[i]++
		h := wire.Header{Version: wire.Version, Type: wire.MsgHeartbeat, Seq: m.seq[i]}
		b, err := ctlauth.Seal(t.Key, wire.AppendHeader(nil, &h), m.stamper.Next())
		if err == nil {
			_, err = m.conn.WriteToUDPAddrPort(b, t.Addr)
		}
		if err == nil {
			m.sentAt[i] = now
			st.Sent++
		}
	}
	m.mu.Unlock()
	m.notify(changed)
}

// answer takes a heartbeat answer: from the target's address, sealed under its key
// (ctlauth.HeartbeatAnswers), for the outstanding nonce, with a fresh stamp.
func (m *Monitor) answer(b []byte, from netip.AddrPort, now time.Time) {
	m.mu.Lock()
	i := slices.IndexFunc(m.targets, func(t Target) bool { return t.Addr == from })
	if i < 0 {
		m.mu.Unlock()
		return
	}
	seq, stamp, st, err := m.answers[i].Open(b)
	if err != nil || seq != m.seq[i] || m.sentAt[i].IsZero() || m.replay.Check(from, stamp) != nil {
		m.mu.Unlock()
		return
	}
	s := &m.status[i]
	s.RTT = now.Sub(m.sentAt[i])
	m.sentAt[i] = time.Time{}
	s.LastAnswer, s.Misses = now, 0
	s.Answered++
	prev := m.prev[i]
	m.prev[i], s.Stats = st, st
	var changed []Status
	rx, dropped := st.Rx-prev.Rx, st.Dropped-prev.Dropped
	if st.Rx < prev.Rx || st.Dropped < prev.Dropped {
		rx, dropped = 0, 0 // a new switch (restarted without its maps): counters started over
	}
	switch {
	case rx >= m.policy.MinPackets && float64(dropped) > m.policy.MaxDropShare*float64(rx):
		if s.State != StateSuspect {
			changed = append(changed, m.enter(i, StateSuspect, fmt.Sprintf("%d of %d packets dropped since the last heartbeat", dropped, rx), now))
		}
	case s.State != StateHealthy:
		changed = append(changed, m.enter(i, StateHealthy, "answering", now))
	}
	m.mu.Unlock()
	m.notify(changed)
}

// enter moves target i to state; called with mu held. It returns the new status.
func (m *Monitor) enter(i int, state, reason string, now time.Time) Status {
	s := &m.status[i]
	s.State, s.Reason, s.Since = state, reason, now
	return *s
}

func (m *Monitor) notify(changed []Status) {
	if m.policy.OnChange == nil {
		return
	}
	for _, s := range changed {
		m.policy.OnChange(s)
	}
}
