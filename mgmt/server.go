package mgmt

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/xdpagg/xdpagg/ctlauth"
)

// Why the server dropped a connection: the label of its counter (Server.BadFrames).
const (
	BadFrameFormat = "frame"   // length beyond MaxFrame, or a connection cut inside a frame
	BadFrameAuth   = "auth"    // does not open under the request key (wrong key, tampered, a response)
	BadFrameReplay = "replay"  // authentic, stamp not newer than the last accepted or out of the window
	BadFrameBody   = "body"    // authentic, but its JSON is not a request
	BadFrameBusy   = "busy"    // over MaxConns connections at once, none of them to be closed for it
	BadFrameSlow   = "timeout" // no request begun within IdleTimeout, or none complete within ReadTimeout
	// BadFrameSourceBusy: MaxConnsPerSource connections from the address already, each with a
	// request being handled.
	BadFrameSourceBusy = "source_busy"
	// BadFrameEvicted: closed, while waiting for (or receiving) a request, to make room for a new
	// connection: its address held MaxConnsPerSource, or the most of MaxConns.
	BadFrameEvicted = "evicted"
)

// Limits of a Server.
const (
	// MaxConns is how many connections a server serves at once. The controller makes one at a
	// time per switch, and sends its request as soon as it is connected.
	MaxConns = 32
	// MaxConnsPerSource is how many of them one source address holds at most. A new connection
	// beyond it closes the address's own connection that has waited longest for a request; a
	// new connection beyond MaxConns closes that of the address holding the most, if it holds
	// more than the newcomer's. Only connections waiting for (or receiving) a request are
	// closed so, never one whose authentic request is being handled: so a host, whatever it
	// connects, holds no more than its share, and the controller's connection gets in unless
	// MaxConns addresses hold one each.
	MaxConnsPerSource = 4
	// IdleTimeout is how long a connection may wait before its next request begins (the
	// controller sends its request at once, and does not keep connections).
	IdleTimeout = 10 * time.Second
	// ReadTimeout is how long a connection may take to deliver a request once begun (a
	// snapshot of MaxFrame at a few MB/s).
	ReadTimeout = 2 * time.Minute
)

// Server answers management connections for a Handler. Requests are handled one at a time (a
// Restore and an Admit never interleave), in the order their stamps were accepted.
type Server struct {
	keys    frameKeys
	h       Handler
	stamper ctlauth.Stamper
	replay  ctlauth.Replay[struct{}] // one sender: whoever holds the controller key
	do      sync.Mutex               // one request at a time
	bad     sync.Map                 // reason -> *atomic.Uint64
	conns   connTable
	idle    time.Duration // IdleTimeout (tests shorten it)
	// OnBadFrame, if set before Serve, is told of every connection dropped (reason and error),
	// e.g. for the agent's rate-limited log.
	OnBadFrame func(reason string, err error)
}

// NewServer makes a server of h under the switch's controller key.
func NewServer(key []byte, h Handler) (*Server, error) {
	keys, err := deriveKeys(key)
	if err != nil {
		return nil, err
	}
	return &Server{keys: keys, h: h, idle: IdleTimeout,
		conns: connTable{conns: map[net.Conn]*connState{}, perSrc: map[netip.Addr]int{}}}, nil
}

// BadFrames returns how many connections were dropped, by reason (labels Bad*).
func (s *Server) BadFrames() map[string]uint64 {
	out := map[string]uint64{}
	for _, r := range BadFrameReasons() {
		out[r] = 0
	}
	s.bad.Range(func(k, v any) bool {
		out[k.(string)] = v.(*atomic.Uint64).Load()
		return true
	})
	return out
}

// BadFrameReasons lists the labels of BadFrames in a stable order.
func BadFrameReasons() []string {
	r := []string{BadFrameFormat, BadFrameAuth, BadFrameReplay, BadFrameBody, BadFrameBusy, BadFrameSlow, BadFrameSourceBusy, BadFrameEvicted}
	sort.Strings(r)
	return r
}

func (s *Server) dropped(reason string, err error) {
	v, _ := s.bad.LoadOrStore(reason, new(atomic.Uint64))
	v.(*atomic.Uint64).Add(1)
	if s.OnBadFrame != nil {
		s.OnBadFrame(reason, err)
	}
}

// Serve answers connections on ln until ctx ends (then it closes ln, waits for the connections
// being served, and returns nil) or ln fails.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer stop()
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		open = map[net.Conn]bool{}
	)
	// However Serve ends (ctx's end closes ln, which ends the loop below), the connections it
	// serves end with it (a request being handled finishes first: the handler is not
	// interrupted, only its connection).
	defer wg.Wait()
	defer func() {
		mu.Lock()
		defer mu.Unlock()
		for c := range open {
			c.Close()
		}
	}()
	for {
		conn, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return fmt.Errorf("accept management connection: %w", err)
		}
		evict, refused := s.conns.admit(conn)
		if refused != "" {
			conn.Close()
			s.dropped(refused, fmt.Errorf("connection from %v: %d connections already, %d from its address, each with a request being handled",
				conn.RemoteAddr(), MaxConns, MaxConnsPerSource))
			continue
		}
		if evict != nil {
			evict.Close()
			s.dropped(BadFrameEvicted, fmt.Errorf("connection from %v, waiting for a request, closed for one from %v", evict.RemoteAddr(), conn.RemoteAddr()))
		}
		mu.Lock()
		open[conn] = true
		mu.Unlock()
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer s.conns.release(conn)
			defer func() {
				mu.Lock()
				delete(open, conn)
				mu.Unlock()
				conn.Close()
			}()
			s.serveConn(conn)
		}()
	}
}

// serveConn answers the requests of one connection until it ends or sends a bad frame.
func (s *Server) serveConn(conn net.Conn) {
	r := bufio.NewReader(conn)
	w := bufio.NewWriter(conn)
	for {
		_ = conn.SetReadDeadline(time.Now().Add(s.idle))
		_, err := r.Peek(1)
		var payload []byte
		if err == nil {
			_ = conn.SetReadDeadline(time.Now().Add(ReadTimeout))
			payload, err = readFrame(r)
		}
		if err != nil {
			var ne net.Error
			switch {
			case !s.conns.held(conn):
				// Closed for another connection: counted then.
			case errors.As(err, &ne) && ne.Timeout():
				s.dropped(BadFrameSlow, fmt.Errorf("connection from %v: %w", conn.RemoteAddr(), err))
			case errors.Is(err, ErrFrame):
				s.dropped(BadFrameFormat, fmt.Errorf("connection from %v: %w", conn.RemoteAddr(), err))
			}
			return // or a clean end between frames
		}
		stamp, body, err := open(s.keys.req, payload)
		if err != nil {
			s.dropped(BadFrameAuth, fmt.Errorf("connection from %v: %w", conn.RemoteAddr(), err))
			return
		}
		if !s.conns.handling(conn, true) {
			return // closed for another connection meanwhile
		}
		var req request
		if err := json.Unmarshal(body, &req); err != nil {
			s.dropped(BadFrameBody, fmt.Errorf("connection from %v: %w", conn.RemoteAddr(), err))
			return
		}
		resp, ok := s.handle(stamp, req, conn.RemoteAddr())
		if !ok {
			return
		}
		out, err := json.Marshal(resp)
		if err != nil {
			out, _ = json.Marshal(response{Re: stamp, Kind: kindFailed, Err: "encode the answer: " + err.Error()})
		}
		sealed, err := seal(s.keys.resp, s.stamper.Next(), out)
		if err != nil {
			return
		}
		_ = conn.SetWriteDeadline(time.Now().Add(ReadTimeout))
		if writeFrame(w, sealed) != nil || w.Flush() != nil {
			return
		}
		s.conns.handling(conn, false)
	}
}

// connTable is who holds the server's connections: each one's source address, since when it
// waits for a request, and whether a request of it is being handled.
type connTable struct {
	mu     sync.Mutex
	conns  map[net.Conn]*connState
	perSrc map[netip.Addr]int
	ticks  uint64 // orders the connections' waits
}

type connState struct {
	src      netip.Addr
	waiting  uint64 // when it began to wait for a request, in ticks: the lowest waited longest
	handling bool   // an authentic request of it is being handled: never closed for another
}

// admit takes conn in, closing (returning) another connection to make room if its address holds
// MaxConnsPerSource, or all MaxConns are held (see MaxConnsPerSource), or returns the reason it is
// refused.
func (t *connTable) admit(conn net.Conn) (evict net.Conn, refused string) {
	ap, _ := netip.ParseAddrPort(conn.RemoteAddr().String())
	src := ap.Addr().Unmap()
	t.mu.Lock()
	defer t.mu.Unlock()
	n := t.perSrc[src]
	switch {
	case n >= MaxConnsPerSource:
		if evict = t.longestWaiting(func(s *connState) bool { return s.src == src }); evict == nil {
			return nil, BadFrameSourceBusy
		}
	case len(t.conns) >= MaxConns:
		if evict = t.longestWaiting(func(s *connState) bool { return t.perSrc[s.src] > n }); evict == nil {
			return nil, BadFrameBusy
		}
	}
	if evict != nil {
		t.dropLocked(evict)
	}
	t.ticks++
	t.conns[conn] = &connState{src: src, waiting: t.ticks}
	t.perSrc[src]++
	return evict, ""
}

// longestWaiting returns, of the connections that wait for a request and satisfy ok, one of the
// address holding the most, the one that has waited longest (nil: none). Called with mu held.
func (t *connTable) longestWaiting(ok func(*connState) bool) net.Conn {
	var best net.Conn
	var bs *connState
	for c, s := range t.conns {
		if s.handling || !ok(s) {
			continue
		}
		if bs == nil {
			best, bs = c, s
			continue
		}
		if n, bn := t.perSrc[s.src], t.perSrc[bs.src]; n > bn || n == bn && s.waiting < bs.waiting {
			best, bs = c, s
		}
	}
	return best
}

// handling marks whether a request of conn is being handled (false: it waits for the next one,
// from now on); it reports whether conn is still held (not closed for another).
func (t *connTable) handling(conn net.Conn, on bool) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := t.conns[conn]
	if s == nil {
		return false
	}
	s.handling = on
	if !on {
		t.ticks++
		s.waiting = t.ticks
	}
	return true
}

// held reports whether conn is still held: not closed for another connection.
func (t *connTable) held(conn net.Conn) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.conns[conn] != nil
}

// release forgets a connection that ended.
func (t *connTable) release(conn net.Conn) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.dropLocked(conn)
}

func (t *connTable) dropLocked(conn net.Conn) {
	s := t.conns[conn]
	if s == nil {
		return
	}
	delete(t.conns, conn)
	if t.perSrc[s.src]--; t.perSrc[s.src] <= 0 {
		delete(t.perSrc, s.src)
	}
}

// handle checks an authentic request's stamp and runs it, one request at a time. ok is false if
// the request is not answered (a replayed or stale stamp).
func (s *Server) handle(stamp uint64, req request, from net.Addr) (response, bool) {
	s.do.Lock()
	defer s.do.Unlock()
	// Checked under the lock that orders the requests, so the stamps of requests handled are
	// increasing in the order they act.
	if err := s.replay.Check(struct{}{}, stamp); err != nil {
		s.dropped(BadFrameReplay, fmt.Errorf("request %s from %v: %w", req.Op, from, err))
		return response{}, false
	}
	resp := response{Re: stamp}
	result, err := s.run(req)
	if err != nil {
		resp.Err = err.Error()
		switch {
		case errors.Is(err, ErrIncompatible):
			resp.Kind = kindIncompatible
		case errors.Is(err, ErrRefused):
			resp.Kind = kindRefused
		default:
			resp.Kind = kindFailed
		}
		return resp, true
	}
	if result != nil {
		b, err := json.Marshal(result)
		if err != nil {
			return response{Re: stamp, Kind: kindFailed, Err: "encode the result: " + err.Error()}, true
		}
		resp.Result = b
	}
	return resp, true
}

// run decodes a request's arguments and calls the handler.
func (s *Server) run(req request) (any, error) {
	args := func(v any) error {
		if err := json.Unmarshal(req.Args, v); err != nil {
			return fmt.Errorf("%w: arguments of %s: %w", ErrRefused, req.Op, err)
		}
		return nil
	}
	switch req.Op {
	case opAdmit:
		var j Job
		if err := args(&j); err != nil {
			return nil, err
		}
		return nil, s.h.Admit(j)
	case opRemove, opReset:
		var id uint32
		if err := args(&id); err != nil {
			return nil, err
		}
		if req.Op == opRemove {
			return nil, s.h.Remove(id)
		}
		return nil, s.h.Reset(id)
	case opSnapshot:
		var sc Scope
		if err := args(&sc); err != nil {
			return nil, err
		}
		if sc != ScopeControl && sc != ScopeAll {
			return nil, fmt.Errorf("%w: snapshot scope %d", ErrRefused, sc)
		}
		snap, err := s.h.Snapshot(sc)
		if err != nil {
			return nil, err
		}
		return snap, nil
	case opRestore:
		var snap Snapshot
		if err := args(&snap); err != nil {
			return nil, err
		}
		st, err := s.h.Restore(&snap)
		return st, err
	case opDrain:
		return nil, s.h.Drain()
	case opSync:
		sy, ok := s.h.(Syncer)
		if !ok {
			break // a handler without it: an unknown operation, as for an older agent
		}
		var r SyncRequest
		if err := args(&r); err != nil {
			return nil, err
		}
		if r.Snapshot == nil {
			return nil, fmt.Errorf("%w: sync without a snapshot", ErrRefused)
		}
		return sy.Sync(r)
	}
	return nil, fmt.Errorf("%w: unknown operation %q", ErrRefused, req.Op)
}
