package hostlib

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"time"

	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/wire"
)

// Join registers this worker with the switch's agent (iSwitch's Join): the switch learns where
// the job's results must reach this worker — the packet's source address and arrival port, and
// mac (this worker's MAC on its link to the switch). sw is the switch's own address on this
// worker's subnet and the xdpagg port. The job must have been admitted at the switch (`xdpagg job
// add`), and WorkerConfig.JobKey must hold the key that printed: the JOIN is authenticated with it
// (ctlauth), and so must be the agent's MSG_ACK, which has to come from sw. Results always carry
// the admitted PS's address: a JOIN cannot choose another (its body's result_ip is 0).
//
// The message is resent, freshly stamped, until the agent acknowledges it or ctx ends. Without a
// valid JobKey it fails at once with ErrConfig. After a Join the worker also accepts results
// from sw (the agent's retransmit cache, or another member's result through it: Help) besides the
// PS, asks sw first for results it lost (iSwitch's Help), and keeps its last 2*Window results to
// answer sw's requests for other members (MSG_HELP; docs/protocol.md, HELP).
func (w *Worker) Join(ctx context.Context, sw netip.AddrPort, mac net.HardwareAddr) error {
	return w.control(ctx, wire.MsgJoin, sw, mac)
}

// Reset asks the switch's agent to clear what the switch holds of this worker's job: its
// aggregator slots and, for a sparse job, its registers and iteration records (iSwitch's Reset).
// Only a joined worker may, from its binding; authenticated like Join. Sums in flight then
// complete through resends at the PS; nothing of another job is touched.
func (w *Worker) Reset(ctx context.Context, sw netip.AddrPort) error {
	return w.control(ctx, wire.MsgReset, sw, nil)
}

// Halt asks the switch's agent to halt this worker's job (iSwitch's Halt): the agent tells every
// member of the job, this one included, with an authenticated MSG_HALT, after which their
// AllReduce calls fail with ErrHalted (a running one returns at once) until Resume. Only a joined
// worker may, from its binding. A member whose notice is lost hears it again with the agent's
// answer to its next RETRANSMIT or ACK.
//
// The HALT's seq is the halt's resume point: this worker's next sequence number plus haltGap.
// Members stop in different calls (one that had not yet taken the last result of a call fails
// it, while the others completed it and fail the next), so the sequence numbers they have used
// differ by up to one call; Resume moves each to the resume point, which lies past all of them,
// and they go on in step. This worker halts itself at once, before the agent's notice comes
// back, so that it starts no call past the point it chose (no other member can then complete a
// call it has not sent). If Halt fails it stays halted: call Halt again (it resends the same
// resume point, and the agent tells the members again) until it succeeds, and only then Resume.
// Until the agent has acknowledged the HALT, whether the other members heard of it is unknown:
// a Resume then moves this worker to the resume point while they may still be where they were,
// and the job's calls stop completing.
func (w *Worker) Halt(ctx context.Context, sw netip.AddrPort) error {
	return w.controlWith(ctx, wire.MsgHalt, sw, nil, ctlExtra{fragment: true, seq: w.haltHere()})
}

// haltHere halts this worker, if it is not halted yet, at the resume point haltGap past its
// sequence, and returns the resume point of its halt.
func (w *Worker) haltHere() uint32 {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.halted.Load() {
		w.markHalted(uint32(w.nextSeq + haltGap))
	}
	return w.haltSeq
}

const (
	// maxCallFragments bounds one AllReduce's fragments, and with it how far apart the members'
	// sequence numbers can be when a halt stops them: one call.
	maxCallFragments = 1 << 28
	// haltGap puts a halt's resume point past every member's sequence number (the halter's +
	// up to one call) and within 2^31 of all of them, so that each member finds the same 64-bit
	// sequence number from the point's 32 bits, and the switch sees the resumed fragments as
	// later than the job's abandoned ones (it reclaims the job's own older slots at once).
	haltGap = 1 << 30
)

// resumeAt is the sequence number a member at next goes on from after the halt whose resume
// point is point: the one with point's low 32 bits nearest to next. By haltGap and
// maxCallFragments it is ahead of next; if it were not, the member stays where it is rather
// than reuse sequence numbers.
func resumeAt(next uint64, point uint32) uint64 {
	if d := int32(point - uint32(next)); d > 0 {
		return next + uint64(d)
	}
	return next
}

// Halted reports whether the switch's agent told this worker its job is halted.
func (w *Worker) Halted() bool { return w.halted.Load() }

// Resume lets AllReduce run again after a halt: the application decides when its job goes on
// (all members must, or their sums will not complete). Reminders of the halt it resumes from
// (the agent repeats a halt to members that still ask for results) are ignored from then on.
//
// Resume moves the worker's sequence to the halt's resume point (see Halt), so every member of
// the job must resume from the same halt, and none may have an AllReduce running.
func (w *Worker) Resume() {
	w.mu.Lock()
	if w.halted.Load() {
		w.nextSeq = resumeAt(w.nextSeq, w.haltSeq)
	}
	w.resumedHalt, w.resumed = w.haltSeq, true
	w.halted.Store(false)
	w.mu.Unlock()
}

// handleHalt applies an MSG_HALT from `from`: accepted only from the switch address the worker
// joined through, authenticated under JobKey, for this job and worker id, with a fresh stamp.
// Called with mu held.
func (w *Worker) handleHalt(b []byte, h *wire.Header, from *unix.RawSockaddrInet4) {
	if !w.agentMessage(b, h, from) {
		return
	}
	if w.resumed && h.Seq == w.resumedHalt {
		return // a reminder of the halt this worker was resumed from
	}
	w.markHalted(h.Seq)
}

// markHalted halts the worker: its running AllReduce fails at once, and so do the next ones
// until Resume, which goes on from resume point at. Called with mu held.
func (w *Worker) markHalted(at uint32) {
	w.haltSeq = at
	w.halted.Store(true)
	select {
	case w.kick <- struct{}{}:
	default:
	}
}

// SetThreshold asks the switch's agent to set this worker's job's aggregation threshold H
// (iSwitch's SetH, MSG_SETH): from then on a fragment completes at the switch once h of the job's
// workers contributed (1..NumWorkers; NumWorkers is synchronous). Only a joined worker may, from
// its binding; authenticated like Join. The PS keeps its own threshold (PS.SetThreshold).
func (w *Worker) SetThreshold(ctx context.Context, sw netip.AddrPort, h uint8) error {
	if h < 1 || h > w.cfg.NumWorkers {
		return fmt.Errorf("%w: threshold %d: use 1..%d (NumWorkers)", ErrConfig, h, w.cfg.NumWorkers)
	}
	body, err := binary.Append(nil, binary.LittleEndian, &bpf.XdpaggSethBody{Threshold: uint32(h)})
	if err != nil {
		return fmt.Errorf("encode SETH body: %w", err)
	}
	return w.controlWith(ctx, wire.MsgSetH, sw, nil, ctlExtra{body: body})
}

// FBcast asks the switch's agent to force the partial aggregate of fragment seq (the job's
// sequence number; its slot is this worker's rotation's) out now (iSwitch's FBcast,
// MSG_FBCAST): if the switch holds the fragment half-filled, it completes it with the
// contributions it has, and every member of the job gets the sum as a RESULT whose bitmap names
// them. Only a joined worker may, from its binding. A fragment the switch does not hold (complete
// and broadcast already, not started, or handed to the PS) flushes nothing; the call succeeds
// once the agent acknowledges it either way.
func (w *Worker) FBcast(ctx context.Context, sw netip.AddrPort, seq uint64) error {
	w.mu.Lock()
	idx := w.aggIndex(seq)
	w.mu.Unlock()
	return w.controlWith(ctx, wire.MsgFBcast, sw, nil, ctlExtra{seq: uint32(seq), fragment: true, aggIndex: idx})
}

// Leave removes this worker from the switch's members of its job, authenticated like Join.
func (w *Worker) Leave(ctx context.Context, sw netip.AddrPort, mac net.HardwareAddr) error {
	return w.control(ctx, wire.MsgLeave, sw, mac)
}

// ctlExtra is what a SETH or FBCAST adds to a control request: a body, and the fragment the
// header names (its seq, which the ACK echoes, instead of a nonce, and its slot).
type ctlExtra struct {
	body     []byte
	fragment bool
	seq      uint32
	aggIndex uint32
}

// controlRequest checks a worker's control message to the switch agent sw and encodes it,
// trailer not yet added: the header (with a fresh nonce as seq) and, for JOIN and LEAVE, the body
// naming mac, or x's. It returns the message, its nonce and sw unmapped to IPv4.
func controlRequest(typ uint8, job uint32, worker, fan uint8, key []byte, sw netip.AddrPort, mac net.HardwareAddr, x ctlExtra) ([]byte, uint32, netip.AddrPort, error) {
	withBody := typ == wire.MsgJoin || typ == wire.MsgLeave // RESET and HALT have none
	if len(key) != ctlauth.KeySize {
		return nil, 0, sw, fmt.Errorf("%w: JobKey has %d bytes: control messages need the job's %d-byte key (`xdpagg job add` prints it)",
			ErrConfig, len(key), ctlauth.KeySize)
	}
	if withBody && !wire.UnicastMAC(mac) {
		return nil, 0, sw, fmt.Errorf("%w: MAC %v: need this worker's 6-byte unicast Ethernet address (the agent refuses group and all-zero ones)", ErrConfig, mac)
	}
	sw = netip.AddrPortFrom(sw.Addr().Unmap(), sw.Port())
	if !sw.Addr().Is4() || sw.Addr().IsUnspecified() || sw.Port() == 0 {
		return nil, 0, sw, fmt.Errorf("%w: switch %v: use the switch's IPv4 address on this worker's subnet and the xdpagg port", ErrConfig, sw)
	}
	nonce := uint32(time.Now().UnixNano())
	h := wire.Header{Version: wire.Version, Type: typ, JobId: job, Seq: nonce, FanIn0: fan, WorkerId: worker, Bitmap0: 1 << worker}
	if x.fragment {
		nonce, h.Seq, h.AggIndex = x.seq, x.seq, x.aggIndex
	}
	msg := make([]byte, wire.HdrSize, wire.HdrSize+12+ctlauth.TrailerSize)
	wire.EncodeHeader(msg, &h)
	msg = append(msg, x.body...)
	if withBody {
		var body bpf.XdpaggJoinBody // result_ip 0: the switch uses the job's admitted PS
		copy(body.Mac[:], mac)
		var err error
		if msg, err = binary.Append(msg, binary.LittleEndian, &body); err != nil {
			return nil, 0, sw, fmt.Errorf("encode control body: %w", err)
		}
	}
	return msg, nonce, sw, nil
}

func (w *Worker) control(ctx context.Context, typ uint8, sw netip.AddrPort, mac net.HardwareAddr) error {
	return w.controlWith(ctx, typ, sw, mac, ctlExtra{})
}

func (w *Worker) controlWith(ctx context.Context, typ uint8, sw netip.AddrPort, mac net.HardwareAddr, x ctlExtra) error {
	msg, nonce, sw, err := controlRequest(typ, w.cfg.JobID, w.cfg.WorkerID, w.cfg.NumWorkers, w.cfg.JobKey, sw, mac, x)
	if err != nil {
		return err
	}
	pkt := make([]byte, 0, len(msg)+ctlauth.TrailerSize)
	select {
	case w.ctlTurn <- struct{}{}:
		defer func() { <-w.ctlTurn }()
	case <-ctx.Done():
		return fmt.Errorf("%w: another control call to the switch agent is still waiting for its acknowledgement: %w", ErrTimeout, ctx.Err())
	case <-w.closing:
		return ErrClosed
	}

	swRaw := sockaddr4(sw)
	w.mu.Lock()
	w.ackWant, w.ackGot = nonce, false
	w.ackFrom, w.ackPending = swRaw, true
	w.mu.Unlock()
	select { // a wake-up left by an earlier call's ACK that came after it gave up
	case <-w.acked:
	default:
	}
	defer func() {
		w.mu.Lock()
		w.ackPending = false
		w.mu.Unlock()
	}()
	// done reports (under mu) whether the ACK is in, and applies it.
	done := func() bool {
		w.mu.Lock()
		defer w.mu.Unlock()
		if !w.ackGot {
			return false
		}
		if typ == wire.MsgJoin || typ == wire.MsgLeave {
			// From now on, results this worker misses are asked of the switch agent's
			// retransmit cache first, and its answers accepted; LEAVE turns that off.
			w.ctrl, w.ctrlSet = sw, typ == wire.MsgJoin
			w.ctrlRaw = swRaw
			if w.ctrlSet && w.kept == nil {
				w.startKeeping()
			}
		}
		return true
	}
	wait := 50 * time.Millisecond
	for !done() {
		// Every send gets a fresh stamp: the agent refuses a stamp it has seen (a resend after a
		// lost ACK would otherwise be taken for a replay).
		pkt, err = ctlauth.Seal(w.cfg.JobKey, append(pkt[:0], msg...), w.stamper.Next())
		if err != nil {
			return fmt.Errorf("%w: %w", ErrConfig, err)
		}
		if _, err := w.bc.conn.WriteToUDPAddrPort(pkt, sw); err != nil {
			return fmt.Errorf("send control message to %v: %w", sw, err)
		}
		// Wait for the ACK or the resend timer; either way done() decides. A lost message (or
		// ACK) costs one resend interval, doubling to a second: it is resent, never waited out.
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			if done() { // answered just as ctx ended: the agent did act on it
				return nil
			}
			return fmt.Errorf("%w: no acknowledgement from the switch agent at %v: %w", ErrTimeout, sw, ctx.Err())
		case <-w.closing:
			t.Stop()
			return ErrClosed
		case <-t.C:
		case <-w.acked:
			t.Stop()
		}
		wait = min(2*wait, time.Second)
	}
	return nil
}

// sealCtl appends the authentication trailer to the control message buf[:wire.HdrSize] in place
// (buf has room for it) and returns the sealed message, or nil if the worker has no valid key.
// Called with mu held, so stamps follow the order messages are queued in.
func (w *Worker) sealCtl(buf []byte) []byte {
	out, err := ctlauth.Seal(w.cfg.JobKey, buf[:wire.HdrSize], w.stamper.Next())
	if err != nil {
		return nil // unreachable: ctrlSet needs a successful Join, which needs a valid key
	}
	return out
}

// agentMessage checks a message from the switch agent (b, parsed into h, from `from`): it must
// come from the switch address the worker sends its control messages to, open under JobKey, be a
// bare header for this job and worker id, and carry a stamp newer than the last one accepted from
// that address. What fails is counted (Foreign, Unauthenticated, Malformed, Replayed). Called with
// mu held.
func (w *Worker) agentMessage(b []byte, h *wire.Header, from *unix.RawSockaddrInet4) bool {
	var agent unix.RawSockaddrInet4
	switch {
	case w.ackPending && sameSource(from, &w.ackFrom):
		agent = w.ackFrom
	case w.ctrlSet && sameSource(from, &w.ctrlRaw):
		agent = w.ctrlRaw
	default:
		w.st.foreign.Add(1)
		return false
	}
	if len(w.cfg.JobKey) != ctlauth.KeySize {
		w.st.unauth.Add(1)
		return false
	}
	msg, stamp, err := ctlauth.Open(w.cfg.JobKey, b)
	if err != nil {
		w.st.unauth.Add(1)
		return false
	}
	if len(msg) != wire.HdrSize || h.Count != 0 || h.JobId != w.cfg.JobID || h.WorkerId != w.cfg.WorkerID {
		w.st.malformed.Add(1) // authentic, but not for this worker
		return false
	}
	if err := w.replay.Check(agent, stamp); err != nil {
		w.st.replayed.Add(1)
		return false
	}
	return true
}

// sameSource reports whether a datagram's source (as recvmmsg wrote it) is the address a.
func sameSource(from, a *unix.RawSockaddrInet4) bool {
	return from.Family == unix.AF_INET && from.Port == a.Port && from.Addr == a.Addr
}

// handleAck applies an MSG_ACK (b, parsed into h) that came from `from`: the answer to a pending
// Join/Leave, or a retransmit-cache miss. It is accepted only from the switch address the worker
// sent its control messages to, authenticated under JobKey, with a stamp newer than the last one
// accepted from that address, for this job and worker id. Called with mu held.
func (w *Worker) handleAck(b []byte, h *wire.Header, from *unix.RawSockaddrInet4) {
	if !w.agentMessage(b, h, from) {
		return
	}
	w.st.ctlAcks.Add(1)
	if w.ackPending && h.Seq == w.ackWant {
		w.ackGot = true
		select {
		case w.acked <- struct{}{}:
		default: // a wake-up is pending already
		}
		return
	}
	if !w.ctrlSet || !sameSource(from, &w.ctrlRaw) {
		return
	}
	// The agent's answer to a retransmit request it could not serve.
	op := &w.op
	off := int64(h.Seq - uint32(op.seqBase))
	if op.active && off >= int64(op.low) && off < int64(op.next) {
		if f := &op.ring[int(off)%len(op.ring)]; f.idx == int(off) && f.askedCache && f.state == fragFixed {
			// Not cached (not complete yet, or evicted): the data timer decides, and a member
			// may still answer through the agent (its latency then counts from the request).
			w.st.cacheMisses.Add(1)
		}
	}
}
