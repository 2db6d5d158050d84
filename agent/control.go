package agent

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/net/ipv4"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/wire"
)

// Defaults of ControlConfig.
const (
	DefaultMemberTTL         = 30 * time.Second
	DefaultMaxMembersPerPort = 64
)

// ControlConfig holds the control plane's policy knobs (docs/security.md).
type ControlConfig struct {
	// MemberTTL is how long a bound worker id stays its holder's after the holder's last
	// authenticated control message; only then may a JOIN from another host take the id over
	// (default 30s). A binding is never dropped by age alone, only made takeable.
	MemberTTL time.Duration
	// MaxMembersPerPort caps the members behind one switch port over all jobs (one member per
	// job per port, so also the jobs one port takes part in; default 64).
	MaxMembersPerPort int
}

func (c ControlConfig) withDefaults() ControlConfig {
	if c.MemberTTL <= 0 {
		c.MemberTTL = DefaultMemberTTL
	}
	if c.MaxMembersPerPort <= 0 {
		c.MaxMembersPerPort = DefaultMaxMembersPerPort
	}
	return c
}

// Why the agent refused a control message: the label of its counter.
const (
	RejectMalformed   = "malformed"       // unparsable, reserved bits, unknown type
	RejectNotAPort    = "not_a_port"      // arrived on an interface the switch does not own
	RejectNotAdmitted = "not_admitted"    // job not admitted by the operator
	RejectUnauth      = "unauthenticated" // no trailer, or a tag that the job's key does not give
	RejectReplay      = "replayed"        // authentic, but stamp not newer or out of the freshness window
	RejectNotMember   = "not_member"      // ACK/RETRANSMIT/LEAVE not from the worker id's binding
	RejectBoundElse   = "bound_elsewhere" // JOIN for a worker id held by another live binding
	RejectBadWorker   = "bad_worker"      // worker id beyond the job's fan-in, or a JOIN naming another PS
	RejectBadH        = "bad_threshold"   // SETH with H outside 1..the job's workers, or for a sparse job
	RejectPortFull    = "port_full"       // the port has MaxMembersPerPort members already
	RejectUnsolicited = "unsolicited"     // a HELP answer for no result the agent asked that worker id for
	RejectInternal    = "internal"        // a map operation failed
	RejectQueueFull   = "queue_full"      // its port's queue of messages waiting for the agent was full (ctlqueue.go)
	errLogEvery       = time.Second       // at most one warning per port per this interval
)

// ControlServer answers control messages (iSwitch's Join/Leave/Reset/Halt, Help with the
// retransmit cache and the job's members, and the cache's Ack) that the XDP program passes up. Only admitted jobs exist; every message must be
// authenticated with its job's key (ctlauth) and fresh. A JOIN binds a worker id to the sender's
// address, UDP port and switch port; the job's PS is fixed at admission and never chosen by a
// JOIN. JOIN and LEAVE are answered with an authenticated MSG_ACK.
type ControlServer struct {
	conn  *ipv4.PacketConn
	raw   net.PacketConn
	maps  *maps.Maps
	log   *slog.Logger
	ports map[int]net.HardwareAddr // attached ifindex -> port MAC
	cache *ResultCache             // nil: no retransmit cache (RETRANSMIT answered as a miss)
	// sparse keeps sparse jobs' updates (a sparse RETRANSMIT); nil: none (answered as a miss).
	sparse *SparseCache
	cfg    ControlConfig
	start  time.Time

	stamper ctlauth.Stamper
	replay  ctlauth.Replay[workerRef]

	ctlKey    []byte                    // the controller's key (heartbeats); nil: none
	hbAnswers *ctlauth.HeartbeatAnswers // seals heartbeat answers under a key derived from ctlKey
	ctlReplay ctlauth.Replay[struct{}]  // the controller's stamps: one sender, whatever its address
	// Heartbeats are answered on the switch ports and on these management interfaces (the
	// controller's own network, not behind a port); hbAnyIface: on every interface.
	hbIfaces   map[int]bool
	hbAnyIface bool

	mu       sync.Mutex
	lastSeen map[workerRef]time.Time // last authenticated message from the worker id's current binding
	// joined: worker ids whose current binding a JOIN made here (not the controller's restore or
	// sync): a hot standby's mirror leaves them alone (Manager.Sync), as this switch took traffic.
	joined map[workerRef]bool
	halted map[uint32]haltNotice // jobs halted lately
	help   helpTable             // results asked of members lately (member-assisted Help)
	keys   map[uint32]string     // job -> the key its last authentic message opened under (admission)

	replySrc net.IP // destination of the message being handled (Serve's goroutine only); nil: kernel's choice

	rejected sync.Map // reason -> *atomic.Uint64
	helpSt   helpCounters
	warn     warnLimiter
}

type workerRef struct {
	job    uint32
	worker uint8
	// answers: the stamps of the worker's HELP answers, which its receive goroutine sends while
	// its AllReduce may hold sealed ACKs and Help requests not yet sent: a sequence of their own,
	// so that neither overtaking the other looks like a replay.
	answers bool
}

// SetCache makes the server answer MSG_RETRANSMIT from c and feed it workers' MSG_ACKs. Call
// before Serve.
func (c *ControlServer) SetCache(rc *ResultCache) { c.cache = rc }

// SetSparseCache makes the server answer sparse MSG_RETRANSMITs from sc. Call before Serve.
func (c *ControlServer) SetSparseCache(sc *SparseCache) { c.sparse = sc }

// SetConfig sets the policy knobs. Call before Serve.
func (c *ControlServer) SetConfig(cfg ControlConfig) { c.cfg = cfg.withDefaults() }

// ListenControl opens the control socket on the xdpagg port of every local address. ports maps
// the switch ports' ifindexes to their MACs; messages arriving elsewhere are ignored.
func ListenControl(port uint16, m *maps.Maps, ports map[int]net.HardwareAddr, log *slog.Logger) (*ControlServer, error) {
	raw, err := net.ListenPacket("udp4", fmt.Sprintf("0.0.0.0:%d", port))
	if err != nil {
		return nil, fmt.Errorf("listen for control messages on port %d: %w", port, err)
	}
	// Room for a burst while the reader is off the CPU (best effort: capped by rmem_max).
	_ = raw.(*net.UDPConn).SetReadBuffer(4 << 20)
	c := newControlServer(raw, m, ports, log)
	if err := c.conn.SetControlMessage(ipv4.FlagInterface|ipv4.FlagDst, true); err != nil {
		raw.Close()
		return nil, fmt.Errorf("enable IP_PKTINFO: %w", err)
	}
	return c, nil
}

// newControlServer makes a server answering from raw (tests give it a plain loopback socket).
func newControlServer(raw net.PacketConn, m *maps.Maps, ports map[int]net.HardwareAddr, log *slog.Logger) *ControlServer {
	return &ControlServer{conn: ipv4.NewPacketConn(raw), raw: raw, maps: m, log: log, ports: ports,
		cfg: ControlConfig{}.withDefaults(), start: time.Now(), lastSeen: map[workerRef]time.Time{}, joined: map[workerRef]bool{}, keys: map[uint32]string{}, halted: map[uint32]haltNotice{},
		help: newHelpTable()}
}

// Close stops the server.
func (c *ControlServer) Close() error { return c.raw.Close() }

// Serve handles messages until ctx is done or the socket is closed. One goroutine reads the
// socket into per-interface queues, this one handles them in turn (ctlqueue.go).
func (c *ControlServer) Serve(ctx context.Context) error {
	go func() {
		<-ctx.Done()
		c.raw.Close()
	}()
	q := newPortQueues()
	readErr := make(chan error, 1)
	go func() { readErr <- c.read(ctx, q) }()
	for {
		m, ok := q.pop()
		if !ok {
			select {
			case <-q.wake:
				continue
			case err := <-readErr:
				return err
			}
		}
		// Answers leave from the address the message was sent to, which is the one workers
		// accept answers from (whatever address the kernel would pick for the route back).
		c.replySrc = m.dst
		if err := c.handle(m.b, m.ifindex, m.from); err != nil {
			c.reject(err, m.ifindex, m.from)
		}
		q.release(m.b)
	}
}

// read takes control messages off the socket into q until ctx is done or the socket is closed
// (nil), or it fails. A message whose interface's queue is full is dropped and counted.
func (c *ControlServer) read(ctx context.Context, q *portQueues) error {
	buf := make([]byte, 2048)
	for {
		n, cm, src, err := c.conn.ReadFrom(buf)
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return nil
			}
			return fmt.Errorf("read control socket: %w", err)
		}
		ua, ok := src.(*net.UDPAddr)
		if !ok || cm == nil {
			continue
		}
		from := ua.AddrPort()
		from = netip.AddrPortFrom(from.Addr().Unmap(), from.Port())
		m := ctlMsg{b: q.buffer(buf[:n]), ifindex: cm.IfIndex, from: from, dst: cm.Dst}
		if !q.push(m) {
			q.release(m.b)
			c.reject(refuse(RejectQueueFull, "%d control messages from ifindex %d wait already", PortQueueLen, cm.IfIndex), cm.IfIndex, from)
		}
	}
}

// rejection is a refused message: its counter label and what to log.
type rejection struct {
	reason string
	err    error
}

func (r *rejection) Error() string { return r.reason + ": " + r.err.Error() }
func (r *rejection) Unwrap() error { return r.err }

func refuse(reason string, format string, args ...any) error {
	return &rejection{reason: reason, err: fmt.Errorf(format, args...)}
}

// reject counts a refused message and logs it, at most once per errLogEvery per port, so a flood
// costs the log one line a second and a count of what it suppressed.
func (c *ControlServer) reject(err error, ifindex int, from netip.AddrPort) {
	reason := RejectInternal
	var r *rejection
	if errors.As(err, &r) {
		reason = r.reason
	}
	v, _ := c.rejected.LoadOrStore(reason, new(atomic.Uint64))
	v.(*atomic.Uint64).Add(1)
	if suppressed, ok := c.warn.allow(ifindex, time.Now()); ok {
		c.log.Warn("control message rejected", "reason", reason, "from", from, "ifindex", ifindex, "err", err, "suppressed_since_last", suppressed)
	}
}

// Rejected returns how many control messages were refused, by reason.
func (c *ControlServer) Rejected() map[string]uint64 {
	out := map[string]uint64{}
	c.rejected.Range(func(k, v any) bool {
		out[k.(string)] = v.(*atomic.Uint64).Load()
		return true
	})
	return out
}

// warnLimiter lets one log line per port through per errLogEvery and counts the rest.
type warnLimiter struct {
	mu    sync.Mutex
	ports map[int]*warnState
}

type warnState struct {
	last       time.Time
	suppressed uint64
}

func (w *warnLimiter) allow(ifindex int, now time.Time) (suppressed uint64, ok bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.ports == nil {
		w.ports = map[int]*warnState{}
	}
	st := w.ports[ifindex]
	if st == nil {
		// Bounded: only the switch's own ports (and ifindex 0 for unknown ones) get here.
		st = &warnState{}
		w.ports[ifindex] = st
	}
	if !st.last.IsZero() && now.Sub(st.last) < errLogEvery {
		st.suppressed++
		return 0, false
	}
	suppressed, st.suppressed, st.last = st.suppressed, 0, now
	return suppressed, true
}

func msgName(t uint8) string {
	switch t {
	case wire.MsgJoin:
		return "JOIN"
	case wire.MsgLeave:
		return "LEAVE"
	case wire.MsgRetransmit:
		return "HELP (RETRANSMIT)"
	case wire.MsgHelp:
		return "HELP answer"
	case wire.MsgAck:
		return "ACK"
	case wire.MsgReset:
		return "RESET"
	case wire.MsgHalt:
		return "HALT"
	case wire.MsgSetH:
		return "SETH"
	case wire.MsgFBcast:
		return "FBCAST"
	case wire.MsgHeartbeat:
		return "HEARTBEAT"
	}
	return fmt.Sprintf("type %d", t)
}

// bodySize is the size of a message's body between header and trailer.
func bodySize(h wire.Header) (int, bool) {
	switch h.Type {
	case wire.MsgHelp:
		// A member's answer: the help body and one part of a result. (The agent's own requests
		// are header only, and go to members, never to it.)
		return wire.HelpBodySize + 4*int(h.Count), h.Count >= 1 && int(h.Count) <= wire.HelpPartValues
	case wire.MsgJoin, wire.MsgLeave:
		return binary.Size(bpf.XdpaggJoinBody{}), true
	case wire.MsgSetH:
		return binary.Size(bpf.XdpaggSethBody{}), true
	case wire.MsgAck, wire.MsgRetransmit, wire.MsgReset, wire.MsgHalt,
		wire.MsgFBcast:
		return 0, true
	}
	return 0, false
}

// isBinding reports whether the sender (address, UDP port, switch port) is worker id's binding.
func isBinding(b maps.Contributor, ifindex int, from netip.AddrPort) bool {
	return b.Addr == from && b.Ifindex == uint32(ifindex)
}

func (c *ControlServer) touch(ref workerRef, now time.Time) {
	c.mu.Lock()
	c.lastSeen[ref] = now
	c.mu.Unlock()
}

// idleSince is when the current binding of ref last sent an authenticated message (the agent's
// start if it has sent none since).
func (c *ControlServer) idleSince(ref workerRef) time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	if t, ok := c.lastSeen[ref]; ok {
		return t
	}
	return c.start
}

func (c *ControlServer) handle(b []byte, ifindex int, from netip.AddrPort) error {
	var h wire.Header
	if len(b) < wire.HdrSize {
		return refuse(RejectMalformed, "%d bytes", len(b))
	}
	wire.DecodeHeader(b, &h)
	if h.Version == wire.Version && h.Reserved == 0 && h.Type == wire.MsgHeartbeat {
		return c.heartbeat(b, h, ifindex, from) // the controller's, under its own key
	}
	if h.Version != wire.Version || h.JobId == 0 || h.Reserved != 0 || (h.Count != 0 && h.Type != wire.MsgHelp) {
		return refuse(RejectMalformed, "version %d job %d reserved %d count %d", h.Version, h.JobId, h.Reserved, h.Count)
	}
	typ := h.Type
	body, ok := bodySize(h)
	if !ok && typ == wire.MsgHelp {
		return refuse(RejectMalformed, "HELP answer of %d values: a part holds 1..%d", h.Count, wire.HelpPartValues)
	}
	if !ok {
		return refuse(RejectMalformed, "type %d is not handled by the agent", h.Type)
	}
	if len(b) != wire.HdrSize+body+ctlauth.TrailerSize {
		return refuse(RejectMalformed, "%s of %d bytes, want %d", msgName(h.Type), len(b), wire.HdrSize+body+ctlauth.TrailerSize)
	}
	portMAC, ok := c.ports[ifindex]
	if !ok {
		return refuse(RejectNotAPort, "arrived on ifindex %d, not a switch port", ifindex)
	}
	key, err := c.maps.JobKey(h.JobId)
	if errors.Is(err, maps.ErrNoJob) {
		return refuse(RejectNotAdmitted, "%s for job %d", msgName(h.Type), h.JobId)
	} else if err != nil {
		return err
	}
	msg, stamp, err := ctlauth.Open(key, b)
	if err != nil {
		return refuse(RejectUnauth, "%s for job %d: %w", msgName(h.Type), h.JobId, err)
	}
	// Authentic from here: the sender holds the job's key.
	c.admission(h.JobId, key)
	ref := workerRef{job: h.JobId, worker: h.WorkerId}
	job, err := c.maps.Admission(h.JobId)
	if err != nil {
		return err
	}
	if h.WorkerId >= job.Workers {
		return refuse(RejectBadWorker, "worker %d of job %d, which has workers 0..%d", h.WorkerId, h.JobId, job.Workers-1)
	}
	binding, berr := c.maps.Worker(h.JobId, h.WorkerId)
	bound := berr == nil
	if berr != nil && !errors.Is(berr, ebpf.ErrKeyNotExist) {
		return berr
	}
	now := time.Now()

	// Whether the message may act, decided before its stamp is: a refused message uses up no
	// stamp, so a key holder who is not the binding cannot lock the binding out by sending a
	// stamp near the end of the freshness window under its worker id.
	var jb bpf.XdpaggJoinBody
	var hb bpf.XdpaggHelpBody
	lateHelp := false
	switch typ {
	case wire.MsgJoin:
		if _, err := binary.Decode(msg[wire.HdrSize:], binary.LittleEndian, &jb); err != nil {
			return refuse(RejectMalformed, "join body: %w", err)
		}
		if jb.Reserved != 0 {
			return refuse(RejectMalformed, "join body reserved %#x, must be 0", jb.Reserved)
		}
		if mac := net.HardwareAddr(jb.Mac[:]); !wire.UnicastMAC(mac) {
			// Results go out to this MAC: a group address would have every host on the
			// member's link (or the whole segment) take the job's sums.
			return refuse(RejectMalformed, "JOIN of job %d worker %d names MAC %v: not a unicast address", h.JobId, h.WorkerId, mac)
		}
		if rip := netip.AddrFrom4(le32bytes(jb.ResultIp)); jb.ResultIp != 0 && rip != job.PS.Addr() {
			return refuse(RejectBadWorker, "JOIN of job %d names %v as the result source; the job's PS is %v", h.JobId, rip, job.PS.Addr())
		}
		if err := c.mayJoin(h, ifindex, from, bound, binding, now); err != nil {
			return err
		}
	case wire.MsgLeave:
		// Only the binding itself may leave; a resent LEAVE (its ACK lost) finds none and is
		// acknowledged again.
		if bound && !isBinding(binding, ifindex, from) {
			return refuse(RejectNotMember, "LEAVE of job %d worker %d from %v on ifindex %d; bound at %v on ifindex %d", h.JobId, h.WorkerId, from, ifindex, binding.Addr, binding.Ifindex)
		}
	case wire.MsgRetransmit, wire.MsgAck, wire.MsgReset, wire.MsgHalt,
		wire.MsgSetH, wire.MsgFBcast, wire.MsgHelp:
		// Only the worker id's binding may ask for (or acknowledge) its job's results, reset,
		// halt, re-threshold or flush its job, or answer the agent's Help request with a result
		// (members are trusted with their job's state and sums, and only with them).
		if !bound || !isBinding(binding, ifindex, from) {
			return refuse(RejectNotMember, "%s of job %d worker %d from %v on ifindex %d", msgName(h.Type), h.JobId, h.WorkerId, from, ifindex)
		}
		if typ != wire.MsgHelp {
			break
		}
		// A HELP answer only from a worker id the agent asked for that result.
		if hb, err = c.checkHelpAnswer(h, msg, now); errors.Is(err, errLateHelp) {
			lateHelp = true // another member answered first: nothing to do, nothing refused
		} else if err != nil {
			return err
		}
	}
	var newH uint8
	if typ == wire.MsgSetH {
		var sb bpf.XdpaggSethBody
		if _, err := binary.Decode(msg[wire.HdrSize:], binary.LittleEndian, &sb); err != nil {
			return refuse(RejectMalformed, "seth body: %w", err)
		}
		if sb.Threshold < 1 || sb.Threshold > uint32(job.Workers) || job.RegArrays > 0 {
			return refuse(RejectBadH, "SETH of job %d (%d workers, sparse %v) to %d: use 1..%d", h.JobId, job.Workers, job.RegArrays > 0, sb.Threshold, job.Workers)
		}
		newH = uint8(sb.Threshold)
	}
	// The stamp is checked (and used up) before anything changes, so a recorded message cannot
	// be played again.
	rref := ref
	rref.answers = typ == wire.MsgHelp
	if err := c.replay.Check(rref, stamp); err != nil {
		return refuse(RejectReplay, "%s of job %d worker %d: %w", msgName(h.Type), h.JobId, h.WorkerId, err)
	}

	switch typ {
	case wire.MsgHelp:
		c.touch(ref, now)
		if lateHelp {
			c.helpSt.late.Add(1)
			return nil
		}
		return c.takeHelpAnswer(h, hb, msg, now) // answers are not acknowledged
	case wire.MsgJoin:
		m := maps.Member{JobID: h.JobId, WorkerID: h.WorkerId, Ifindex: uint32(ifindex), Addr: from,
			MAC: net.HardwareAddr(jb.Mac[:]), PortMAC: portMAC, SrcIP: job.PS.Addr()}
		if err := c.maps.PutMember(m); err != nil {
			return err
		}
		c.touch(ref, now)
		c.mu.Lock()
		c.joined[workerRef{job: h.JobId, worker: h.WorkerId}] = true
		c.mu.Unlock()
		if !bound || !isBinding(binding, ifindex, from) {
			c.log.Info("worker joined", "job", h.JobId, "worker", h.WorkerId, "addr", from, "ifindex", ifindex, "mac", m.MAC)
		}
	case wire.MsgLeave:
		if bound {
			if err := c.maps.DeleteMember(h.JobId, uint32(ifindex)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
				return err
			}
			c.mu.Lock()
			delete(c.lastSeen, ref)
			delete(c.joined, workerRef{job: h.JobId, worker: h.WorkerId})
			c.mu.Unlock()
			c.log.Info("worker left", "job", h.JobId, "worker", h.WorkerId, "addr", from)
		}
	case wire.MsgReset:
		c.touch(ref, now)
		freed, err := c.maps.ResetJob(h.JobId)
		if err != nil {
			return err
		}
		// The retransmit cache keeps the job's completed sums: they are still right.
		c.log.Info("job reset", "job", h.JobId, "by_worker", h.WorkerId, "slots_freed", freed)
	case wire.MsgHalt:
		c.touch(ref, now)
		c.mu.Lock()
		c.halted[h.JobId] = haltNotice{seq: h.Seq, until: now.Add(HaltWindow)}
		c.mu.Unlock()
		n, err := c.tellHalt(h.JobId, h.Seq, key)
		if err != nil {
			return err
		}
		c.log.Info("job halted", "job", h.JobId, "by_worker", h.WorkerId, "members_told", n)
	case wire.MsgSetH:
		c.touch(ref, now)
		if err := c.maps.SetThreshold(h.JobId, newH); err != nil {
			return err
		}
		c.log.Info("job threshold set", "job", h.JobId, "by_worker", h.WorkerId, "threshold", newH, "workers", job.Workers)
	case wire.MsgFBcast:
		c.touch(ref, now)
		if err := c.fbcast(h, from); err != nil {
			return err
		}
	case wire.MsgRetransmit, wire.MsgAck:
		c.touch(ref, now)
		// A member of a job halted a moment ago that is still asking for results did not hear
		// of it (the notice was lost): tell it again.
		c.mu.Lock()
		hn, halted := c.halted[h.JobId]
		c.mu.Unlock()
		if halted && now.Before(hn.until) {
			if err := c.sendHeaderFrom(wire.MsgHalt, h.JobId, hn.seq, h.WorkerId, key, from, c.replySrc); err != nil {
				return err
			}
		}
		if typ == wire.MsgAck {
			if c.cache != nil {
				c.cache.Ack(h.JobId, h.WorkerId, h.Seq) // cumulative: every result before seq
			}
			return nil // acknowledgements are not acknowledged
		}
		if h.Encoding == wire.EncSparseHot {
			// A sparse worker's lost update packets: the switch CPU's copy, else the worker
			// resends its iteration to the PS (members keep no sparse updates to ask).
			if sent, err := c.sparseRetransmit(h, from); sent || err != nil {
				return err
			}
			return c.ack(h, key, from)
		}
		c.helpSt.requests.Add(1)
		if c.cache != nil {
			if pkt, ok := c.cache.Get(h.JobId, h.Seq); ok {
				c.helpSt.cacheHits.Add(1)
				out := append([]byte(nil), pkt...)
				wire.SetPacketFlags(out, wire.PacketFlags(out)|wire.FlagCached)
				if err := c.send(out, from); err != nil {
					return fmt.Errorf("send cached result: %w", err)
				}
				return nil
			}
		}
		// A miss: the job's other members may still have the result (member-assisted Help);
		// whatever one answers reaches the worker as a cached result. The miss is answered
		// with ACK (same job and seq) all the same: the worker's data timer goes on, and
		// decides when it resends (and asks again).
		if _, err := c.helpFromMembers(h, key, from, now); err != nil {
			return err
		}
	}
	return c.ack(h, key, from)
}

// mayJoin decides whether worker h.WorkerId of job may be bound to the sender, changing nothing:
// a worker id held by another live binding is not taken over; the same host (address and switch
// port) may rebind at once (a restarted worker on a new UDP port), anyone holding the key after
// the binding has been silent for MemberTTL. One member per job per port, and at most
// MaxMembersPerPort members behind a port.
func (c *ControlServer) mayJoin(h wire.Header, ifindex int, from netip.AddrPort, bound bool, binding maps.Contributor, now time.Time) error {
	ref := workerRef{job: h.JobId, worker: h.WorkerId}
	if bound && !isBinding(binding, ifindex, from) {
		sameHost := binding.Addr.Addr() == from.Addr() && binding.Ifindex == uint32(ifindex)
		idle := now.Sub(c.idleSince(ref))
		if !sameHost && idle < c.cfg.MemberTTL {
			return refuse(RejectBoundElse, "JOIN of job %d worker %d from %v on ifindex %d: bound at %v on ifindex %d, last heard %v ago (takeable after %v)",
				h.JobId, h.WorkerId, from, ifindex, binding.Addr, binding.Ifindex, idle.Round(time.Millisecond), c.cfg.MemberTTL)
		}
	}
	// Another worker of the job behind this port: one member per job per port; it is replaced
	// only if it has gone silent.
	existing, err := c.maps.Member(h.JobId, uint32(ifindex))
	if err == nil && existing.WorkerID != h.WorkerId {
		other := workerRef{job: h.JobId, worker: existing.WorkerID}
		if idle := now.Sub(c.idleSince(other)); idle < c.cfg.MemberTTL {
			return refuse(RejectBoundElse, "JOIN of job %d worker %d on ifindex %d: worker %d of the job is behind that port, last heard %v ago",
				h.JobId, h.WorkerId, ifindex, existing.WorkerID, idle.Round(time.Millisecond))
		}
	} else if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return err
	}
	if err != nil { // a new member behind this port: the port's quota
		all, err := c.maps.ListMembers()
		if err != nil {
			return err
		}
		n := 0
		for _, m := range all {
			if m.Ifindex == uint32(ifindex) {
				n++
			}
		}
		if n >= c.cfg.MaxMembersPerPort {
			return refuse(RejectPortFull, "JOIN of job %d worker %d on ifindex %d: the port has %d members (at most %d)", h.JobId, h.WorkerId, ifindex, n, c.cfg.MaxMembersPerPort)
		}
	}
	return nil
}

// fbcast forces the partial aggregate of <h.JobId, h.Seq> in slot h.AggIndex out (iSwitch's
// FBcast): xdpagg_gc completes the slot under its lock with the contributions it holds and copies
// the sum out; the agent sends it as a RESULT (bitmap0: who is in it) to every member of the job,
// from the switch's address on the member's port (where workers take results from after a Join),
// and keeps it in the retransmit cache. A slot that was complete already is sent to the asker
// alone (it evidently lacks it; the others had the broadcast). A slot that holds no aggregation
// of the fragment (never started, reused, freed) flushes nothing: the sender gets only the ACK.
func (c *ControlServer) fbcast(h wire.Header, from netip.AddrPort) error {
	rec, already, err := c.maps.FlushSlot(h.JobId, h.Seq, h.AggIndex)
	if errors.Is(err, maps.ErrNoSlot) {
		c.log.Info("fbcast: nothing to flush", "job", h.JobId, "seq", h.Seq, "slot", h.AggIndex, "by_worker", h.WorkerId)
		return nil
	} else if err != nil {
		return err
	}
	pkt, err := binary.Append(nil, binary.LittleEndian, &rec)
	if err != nil {
		return fmt.Errorf("encode flushed result: %w", err)
	}
	pkt = pkt[:wire.HdrSize+4*int(rec.H.Count)]
	if already {
		return c.send(pkt, from)
	}
	if c.cache != nil {
		if err := c.cache.Store(pkt, time.Now()); err != nil {
			return err
		}
	}
	n, err := c.toMembers(h.JobId, "flushed result", func(m maps.Member, src net.IP) error { return c.sendFrom(pkt, m.Addr, src) })
	if err != nil {
		return err
	}
	c.log.Info("fbcast: partial aggregate sent", "job", h.JobId, "seq", h.Seq, "slot", h.AggIndex, "by_worker", h.WorkerId,
		"contributors", fmt.Sprintf("%#x", rec.H.Bitmap0), "members_told", n)
	return nil
}

// HaltWindow is how long after a HALT the agent answers a member's RETRANSMIT or ACK with the
// halt notice again (its first copy may have been lost).
const HaltWindow = 10 * time.Second

// haltNotice is a job's last HALT: its nonce, and until when members are reminded of it.
type haltNotice struct {
	seq   uint32
	until time.Time
}

// tellHalt sends an authenticated MSG_HALT notice to every member of the job, from the switch's
// address on each member's port (the address it joined through). It returns how many it told.
func (c *ControlServer) tellHalt(job, seq uint32, key []byte) (int, error) {
	return c.toMembers(job, "halt notice", func(m maps.Member, src net.IP) error {
		return c.sendHeaderFrom(wire.MsgHalt, job, seq, m.WorkerID, key, m.Addr, src)
	})
}

// toMembers calls send for every member of job with the switch's address on the member's port
// (the address it joined through), logging the ones that fail; it returns how many succeeded.
func (c *ControlServer) toMembers(job uint32, what string, send func(m maps.Member, src net.IP) error) (int, error) {
	ms, err := c.maps.ListMembers()
	if err != nil {
		return 0, err
	}
	n := 0
	for _, m := range ms {
		if m.JobID != job {
			continue
		}
		if err := send(m, portAddress(int(m.Ifindex))); err != nil {
			c.log.Warn(what+" not sent", "job", job, "worker", m.WorkerID, "err", err)
			continue
		}
		n++
	}
	return n, nil
}

// sendHeaderFrom sends an authenticated bare header of type typ (a HALT notice, a HELP request,
// an ACK) for job, seq and worker id under the job's key to `to`, from address src.
func (c *ControlServer) sendHeaderFrom(typ uint8, job, seq uint32, worker uint8, key []byte, to netip.AddrPort, src net.IP) error {
	h := wire.Header{Version: wire.Version, Type: typ, JobId: job, Seq: seq, WorkerId: worker}
	out, err := ctlauth.Seal(key, wire.AppendHeader(nil, &h), c.stamper.Next())
	if err != nil {
		return err
	}
	return c.sendFrom(out, to, src)
}

// portAddress is the switch's IPv4 address on a port (nil: none, or unknown).
func portAddress(ifindex int) net.IP {
	ifc, err := net.InterfaceByIndex(ifindex)
	if err != nil {
		return nil
	}
	addrs, err := ifc.Addrs()
	if err != nil {
		return nil
	}
	for _, a := range addrs {
		if ipn, ok := a.(*net.IPNet); ok && ipn.IP.To4() != nil {
			return ipn.IP.To4()
		}
	}
	return nil
}

// ack answers h with an authenticated MSG_ACK (same job, seq and worker id).
func (c *ControlServer) ack(h wire.Header, key []byte, to netip.AddrPort) error {
	if err := c.sendHeaderFrom(wire.MsgAck, h.JobId, h.Seq, h.WorkerId, key, to, c.replySrc); err != nil {
		return fmt.Errorf("send ack: %w", err)
	}
	return nil
}

// send writes an answer to `to`, from the address the message being handled was sent to.
func (c *ControlServer) send(b []byte, to netip.AddrPort) error { return c.sendFrom(b, to, c.replySrc) }

// sendFrom writes b to `to` from address src (nil or unspecified: the kernel's choice).
func (c *ControlServer) sendFrom(b []byte, to netip.AddrPort, src net.IP) error {
	dst := net.UDPAddrFromAddrPort(to)
	if src != nil && !src.IsUnspecified() {
		_, err := c.conn.WriteTo(b, &ipv4.ControlMessage{Src: src}, dst)
		return err
	}
	_, err := c.raw.WriteTo(b, dst)
	return err
}

// le32bytes returns the in-memory bytes of a host-order (little-endian) u32 field that holds an
// address in network order.
func le32bytes(v uint32) [4]byte { return [4]byte{byte(v), byte(v >> 8), byte(v >> 16), byte(v >> 24)} }

// forgetRemoved drops what the server remembers of jobs that are no longer admitted (their
// workers' stamps and liveness, their cached results and acknowledgements), so its memory
// follows the jobs table.
func (c *ControlServer) forgetRemoved(admitted map[uint32]bool) {
	c.forget(func(job uint32) bool { return !admitted[job] })
}

func (c *ControlServer) forget(drop func(job uint32) bool) {
	c.replay.Forget(func(r workerRef) bool { return drop(r.job) })
	c.mu.Lock()
	for r := range c.lastSeen {
		if drop(r.job) {
			delete(c.lastSeen, r)
		}
	}
	for r := range c.joined {
		if drop(r.job) {
			delete(c.joined, r)
		}
	}
	for j := range c.keys {
		if drop(j) {
			delete(c.keys, j)
		}
	}
	for k := range c.help.reqs {
		if drop(k.job) {
			c.help.del(k)
		}
	}
	c.sweepHelpLocked(time.Now())
	c.mu.Unlock()
	if c.cache != nil {
		c.cache.ForgetJobs(drop)
	}
	if c.sparse != nil {
		c.sparse.ForgetJobs(drop)
	}
}

// admission notes the key an authentic message of job opened under. A job removed and admitted
// again under the same id (xdpagg job rm, job add) has a new key: what the server remembers of
// the old admission (stamps, liveness, cached results and acknowledgements, whose sequence
// numbers the new job reuses) is forgotten at the new one's first authentic message, before it
// can act on any of it. forgetRemoved only runs every half slot timeout, and misses a removal
// followed by an admission in between.
func (c *ControlServer) admission(job uint32, key []byte) {
	c.mu.Lock()
	old, seen := c.keys[job]
	changed := seen && old != string(key)
	c.keys[job] = string(key)
	c.mu.Unlock()
	if changed {
		c.log.Info("job admitted again: its previous admission's control state is dropped", "job", job)
		c.forget(func(j uint32) bool { return j == job })
		c.mu.Lock()
		c.keys[job] = string(key)
		c.mu.Unlock()
	}
}

// rejectReasons lists the labels in a stable order (metrics).
func rejectReasons() []string {
	r := []string{RejectMalformed, RejectNotAPort, RejectNotAdmitted, RejectUnauth, RejectReplay,
		RejectNotMember, RejectBoundElse, RejectBadWorker, RejectBadH, RejectPortFull, RejectUnsolicited, RejectInternal, RejectQueueFull}
	sort.Strings(r)
	return r
}

// forgetJob drops what the server remembers of job (its workers' stamps and liveness, its
// admission key, its cached results): the job was removed.
func (c *ControlServer) forgetJob(job uint32) { c.forget(func(j uint32) bool { return j == job }) }

// restoredMember starts the member TTL of a worker id bound by a restore now, as if the worker had
// just sent an authenticated message: its binding is not takeable until it has been silent here
// for MemberTTL.
func (c *ControlServer) restoredMember(job uint32, worker uint8) {
	ref := workerRef{job: job, worker: worker}
	c.touch(ref, time.Now())
	c.mu.Lock()
	delete(c.joined, ref) // the binding is the controller's now
	c.mu.Unlock()
}

// unboundMember forgets the member TTL of a worker id whose binding the controller removed (a
// sync), as a LEAVE does.
func (c *ControlServer) unboundMember(job uint32, worker uint8) {
	ref := workerRef{job: job, worker: worker}
	c.mu.Lock()
	delete(c.lastSeen, ref)
	delete(c.joined, ref)
	c.mu.Unlock()
}

// joinedHere says whether worker's current binding was made by a JOIN to this switch.
func (c *ControlServer) joinedHere(job uint32, worker uint8) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.joined[workerRef{job: job, worker: worker}]
}
