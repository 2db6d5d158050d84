package hostlib

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"math/bits"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/wire"
)

// Ring all-reduce over UDP: the aggregator-free exchange of INCEPTIONN (Alg. 1), i.e. the classic
// ring. It is both a baseline for the switch and a fallback that needs no switch and no PS.
//
// Algorithm. W ranks; rank r sends only to its successor r+1 and receives only from its
// predecessor r-1 (mod W). The tensor is cut into W chunks of n/W values (the first n mod W get
// one more; with n < W some are empty). In step s = 0..2W-3 rank r sends chunk (r-s) mod W and
// receives chunk (r-1-s) mod W:
//
//   - steps 0..W-2 (reduce-scatter): the received partial sum is added to the local chunk, so
//     after step W-2 rank r holds chunk r+1 summed over all ranks;
//   - steps W-1..2W-3 (all-gather): the received final chunk replaces the local one.
//
// Pipelining. Chunks travel as packets of K = ValuesPerPacket values, and the chunk sent in
// step s is the one received in step s-1, so packet p of step s depends only on packet p of step
// s-1: it goes out as soon as that one has arrived (and been added), not when the whole step is
// over. Packets of later steps therefore arrive while earlier steps are still incomplete; each
// lands in its own chunk, and every chunk is received at most once per phase, so they are applied
// at once, with no buffering. A sent packet is a copy: the chunk it came from is overwritten
// later (the all-gather writes the final sum over the partial sum a retransmission must repeat).
//
// Exactness. All arithmetic is float32, in ring order: element j of chunk c ends up as
// ((x[c] + x[c+1]) + x[c+2]) + ... + x[c-1], the ranks' values added starting at rank c. Float32
// addition is not associative, so this can differ from a tree or float64 sum in the last ulps,
// but every rank ends with the same bits: the all-gather copies them.
//
// Wire. The xdpagg header (bpf/xdpagg.h), little-endian, ENC_FLOAT32, sent to Peers[r+1]:
//
//   - MSG_DATA: a chunk piece of 1..K float32 values, unquantised. seq = the packet's number:
//     AllReduce calls are numbered consecutively in one 64-bit sequence that all ranks advance
//     identically (each call takes (2W-2)*P numbers, P = packets of the largest chunk, packet p
//     of step s getting base+s*P+p), of which the wire carries the low 32 bits, compared with
//     serial arithmetic. job_id = the ring's ID, agg_index = step, worker_id = sender rank,
//     fan_in0 = W, bitmap0 = 1<<rank, bitmap1 = n (the tensor length, low 32 bits: ranks that
//     disagree on it see malformed packets and time out instead of summing the wrong elements).
//   - MSG_ACK, header only (count 0), from the receiver back to Peers[r-1]: a selective
//     acknowledgement of 64 consecutive seqs. seq = the first (the call's base plus a multiple
//     of 64), bitmap0|bitmap1<<32 = which of them have arrived, worker_id = acknowledging rank.
//     The receiver sends one per block it touched in each receive batch, carrying the block's
//     whole state, so acks are cumulative within a block: a lost one is repaired by the next.
//
// Reliability. A sender keeps at most Window packets unacknowledged; each is retransmitted
// (F_RESEND) after Timeout, doubling up to 8x, and after MaxRetries resends AllReduce fails with
// ErrTimeout. A receiver that gets nothing new for as long as a sender's retries last (about 8 s
// with the defaults) fails the same way: ranks must enter each call within that of one another.
// Duplicates (retransmissions whose ack was lost) are acknowledged again and otherwise dropped,
// also after the call returned, so the predecessor's last packets always get their acks. A
// predecessor may finish a call and start the next before this rank did (its packets were all
// acknowledged while this rank still waits for its own acks): packets of the next call are kept,
// unacknowledged, until it starts here. There are at most Window of them (all the predecessor
// may have unacknowledged), so ranks should use the same Window.
//
// Engine. One goroutine per Ring owns the socket and all the state: it receives in recvmmsg
// batches, applies data, and sends acks, new packets and retransmissions in one sendmmsg batch
// per loop. AllReduce hands it the tensor and waits. Buffers are allocated once per Ring, and
// per-call tables grow to the largest tensor seen: no allocation per packet.

// Ring defaults.
const DefaultRingWindow = 256

// RingConfig configures one rank of a ring. Zero fields take their defaults (WithDefaults).
// Every rank must use the same Peers (and ID), and should use the same Window.
type RingConfig struct {
	Rank int // 0..len(Peers)-1
	// Peers is every rank's UDP/IPv4 address, index = rank; Peers[Rank] is bound locally. Use a
	// port the XDP switch does not intercept (not its agg port): ring packets carry the xdpagg
	// header, and the switch would try to sum them.
	Peers []netip.AddrPort
	// ID tells this ring's packets from other traffic (the header's job_id). Default: a hash of
	// Peers, the same on every rank.
	ID uint32
	// Timeout is the first retransmit timeout (default 20ms); it doubles per retry up to 8x.
	Timeout time.Duration
	// MaxRetries is how many times one packet is resent before AllReduce fails with ErrTimeout
	// (default 50).
	MaxRetries int
	// Window is the number of packets sent and not yet acknowledged (default 256). Steps are
	// pipelined, so it bounds all steps together.
	Window int
	// SocketBuffer sizes SO_RCVBUF/SO_SNDBUF in bytes (default 8 MiB), forced past the sysctl
	// limits when the process has CAP_NET_ADMIN.
	SocketBuffer int
	// ValuesPerPacket is how many float32 one DATA packet carries: as many as the path MTU
	// holds, wire.ValuesForMTU(mtu). Default wire.StdValues (360, a 1500-byte MTU); at most
	// wire.MaxValues. Every rank must use the same: it decides the packets.
	ValuesPerPacket int
}

// WithDefaults returns c with zero fields set to their defaults and addresses unmapped to IPv4.
// Peers is copied.
func (c RingConfig) WithDefaults() RingConfig {
	peers := make([]netip.AddrPort, len(c.Peers))
	for i, p := range c.Peers {
		peers[i] = netip.AddrPortFrom(p.Addr().Unmap(), p.Port())
	}
	c.Peers = peers
	if c.ID == 0 {
		h := fnv.New32a()
		for _, p := range c.Peers {
			b, _ := p.MarshalBinary()
			h.Write(b)
		}
		c.ID = max(h.Sum32(), 1) // 0 is never a job
	}
	if c.Timeout == 0 {
		c.Timeout = DefaultTimeout
	}
	if c.MaxRetries == 0 {
		c.MaxRetries = DefaultMaxRetries
	}
	if c.Window == 0 {
		c.Window = DefaultRingWindow
	}
	if c.SocketBuffer == 0 {
		c.SocketBuffer = DefaultSocketBuffer
	}
	if c.ValuesPerPacket == 0 {
		c.ValuesPerPacket = wire.StdValues
	}
	return c
}

// Validate reports what to change in a configuration that cannot work. Call it on WithDefaults'
// result (NewRing does).
func (c RingConfig) Validate() error {
	switch {
	case len(c.Peers) == 0 || len(c.Peers) > wire.MaxWorkers:
		return fmt.Errorf("%w: %d Peers: use 1..%d ranks (the header has one bitmap bit per rank)", ErrConfig, len(c.Peers), wire.MaxWorkers)
	case c.Rank < 0 || c.Rank >= len(c.Peers):
		return fmt.Errorf("%w: Rank %d: use 0..%d (len(Peers)-1)", ErrConfig, c.Rank, len(c.Peers)-1)
	case c.Timeout < time.Microsecond:
		return fmt.Errorf("%w: Timeout %v: use a retransmit timeout of at least 1µs", ErrConfig, c.Timeout)
	case c.MaxRetries < 1:
		return fmt.Errorf("%w: MaxRetries %d: use at least 1", ErrConfig, c.MaxRetries)
	case c.Window < 1 || c.Window > MaxWindow:
		return fmt.Errorf("%w: Window %d: use 1..%d", ErrConfig, c.Window, MaxWindow)
	case c.SocketBuffer < 0 || c.SocketBuffer > math.MaxInt32:
		return fmt.Errorf("%w: SocketBuffer %d: use 0..%d bytes", ErrConfig, c.SocketBuffer, math.MaxInt32)
	case c.ValuesPerPacket < 1 || c.ValuesPerPacket > wire.MaxValues:
		return fmt.Errorf("%w: ValuesPerPacket %d: use 1..%d (wire.ValuesForMTU(mtu) fills a packet)", ErrConfig, c.ValuesPerPacket, wire.MaxValues)
	}
	for i, p := range c.Peers {
		if !p.Addr().Is4() || p.Addr().IsUnspecified() || p.Port() == 0 {
			return fmt.Errorf("%w: Peers[%d] %v: use the rank's IPv4 address and a nonzero UDP port", ErrConfig, i, p)
		}
		for j := range i {
			if c.Peers[j] == p {
				return fmt.Errorf("%w: Peers[%d] and Peers[%d] are both %v: give every rank its own address", ErrConfig, j, i, p)
			}
		}
	}
	return nil
}

// RingStats are a ring rank's cumulative counters.
type RingStats struct {
	DataSent     uint64 // DATA packets sent, retransmissions included
	Retransmits  uint64 // of DataSent: resent after a timeout
	DataReceived uint64 // DATA packets applied (each chunk piece once)
	Duplicates   uint64 // DATA packets already applied (a lost ack): acknowledged again
	Early        uint64 // DATA packets of the next AllReduce, kept until it starts
	EarlyDropped uint64 // ... dropped for lack of room (the sender's Window is larger): resent
	AcksSent     uint64
	AcksReceived uint64
	Malformed    uint64 // packets dropped: unparsable, foreign, or disagreeing with the running call
	SendErrors   uint64 // packets the kernel refused to send (the retransmit timer covers them)
}

type ringCounters struct {
	dataSent, retransmits, dataReceived, duplicates, early, earlyDropped, acksSent, acksReceived, malformed, sendErrors atomic.Uint64
}

// Ring is one rank of a ring all-reduce. Its methods may be called from any goroutine;
// AllReduce calls must not overlap.
type Ring struct {
	cfg    RingConfig
	w      int // ranks
	k      int // values per packet
	rank   int
	pred   int
	succ   int
	bc     *batchConn
	predSa unix.RawSockaddrInet4
	succSa unix.RawSockaddrInet4
	epoch  time.Time
	st     ringCounters
	stall  int64 // ns without news after which a waiting receiver gives up: a sender's retry budget

	opMu sync.Mutex // one AllReduce at a time

	// AllReduce -> loop handoff. reqData is written before reqPending is set and read after it
	// is seen (atomics order them); done carries exactly one answer per request.
	reqData    []float32
	reqPending atomic.Bool
	cancelReq  atomic.Bool
	done       chan error

	closeOnce sync.Once
	closing   chan struct{}
	loopDone  chan struct{}
	loopErr   error // why the loop stopped; read after loopDone is closed

	dropTx func() bool // test hook: drop this outgoing packet

	// Everything below is owned by the loop goroutine.
	op         ringOp
	nextBase   uint64 // seq of the next call's first packet
	doneBelow  uint64 // every seq below this belongs to a call that completed here: safe to re-ack
	slots      []ringSlot
	freeSlots  []int32
	earliest   int64     // no slot's deadline is before this
	armed      time.Time // the receive deadline set (zero: none), if armedKnown
	armedKnown bool
	ackBlocks  []uint32 // blocks touched by the current receive batch
	nack       int
	ackBufs    [][wire.HdrSize]byte // acks queued in the current send batch
	stash      []ringStashed        // packets of the next call
	nstash     int
}

// ringOp is the running AllReduce.
type ringOp struct {
	active   bool
	data     []float32
	n        int
	base     uint64 // seq of packet 0 of step 0
	per      int    // seq numbers per step: packets of the largest chunk
	total    int    // seq numbers of the call: (2W-2)*per
	sendLeft int    // packets to send and have acknowledged
	recvLeft int    // packets to receive
	recvBits []uint64
	slotOf   []int32  // by seq offset: the slot of a packet in flight, -1 if none
	ready    []uint32 // seq offsets whose packet may go out, FIFO from readyHead
	readyAt  int
	progress int64 // ns since epoch of the last new packet or ack
}

type ringSlot struct {
	busy     bool
	off      uint32 // seq offset in the call
	retries  int
	deadline int64
	plen     int
	pkt      []byte // wire.HdrSize + 4*k bytes of one shared allocation
}

type ringStashed struct {
	n   int
	pkt []byte // as ringSlot.pkt
}

// errCanceled: the loop abandoned the call because AllReduce's context ended.
var errCanceled = errors.New("canceled")

// NewRing validates cfg and binds Peers[Rank] now, in the calling thread's network namespace. It
// starts the goroutine that runs the protocol; Close stops it.
func NewRing(cfg RingConfig) (*Ring, error) { return newRing(cfg, nil) }

func newRing(cfg RingConfig, dropTx func() bool) (*Ring, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	w := len(cfg.Peers)
	// One send batch holds every slot's packet, plus the acks of a receive batch (queueing
	// flushes early if a batch ever needs more).
	sbatch := cfg.Window + recvBatch
	bc, err := listenBatch(cfg.Peers[cfg.Rank], cfg.SocketBuffer, recvBatch, sbatch)
	if err != nil {
		return nil, fmt.Errorf("ring rank %d: %w", cfg.Rank, err)
	}
	// Every data packet goes to the successor at one size: UDP GSO sends runs of them as one
	// message (falling back for good if the kernel refuses), as the worker does.
	bc.enableGSO()
	r := &Ring{
		cfg:       cfg,
		w:         w,
		k:         cfg.ValuesPerPacket,
		rank:      cfg.Rank,
		pred:      (cfg.Rank + w - 1) % w,
		succ:      (cfg.Rank + 1) % w,
		bc:        bc,
		epoch:     time.Now(),
		done:      make(chan error, 1),
		closing:   make(chan struct{}),
		loopDone:  make(chan struct{}),
		dropTx:    dropTx,
		slots:     make([]ringSlot, cfg.Window),
		freeSlots: make([]int32, 0, cfg.Window),
		ackBlocks: make([]uint32, 0, recvBatch),
		ackBufs:   make([][wire.HdrSize]byte, sbatch),
		stash:     make([]ringStashed, cfg.Window),
	}
	psize := wire.HdrSize + 4*r.k
	buf := make([]byte, 2*cfg.Window*psize)
	for i := range r.slots {
		r.slots[i].pkt, buf = buf[:psize:psize], buf[psize:]
		r.stash[i].pkt, buf = buf[:psize:psize], buf[psize:]
	}
	r.predSa = sockaddr4(cfg.Peers[r.pred])
	r.succSa = sockaddr4(cfg.Peers[r.succ])
	for i := cfg.Window - 1; i >= 0; i-- {
		r.freeSlots = append(r.freeSlots, int32(i))
	}
	r.stall = int64(cfg.Timeout)
	for i := 1; i <= cfg.MaxRetries; i++ {
		r.stall += int64(cfg.Timeout) << min(i, maxBackoffShift)
	}
	go r.loop()
	return r, nil
}

// LocalAddr is the address the rank is bound to.
func (r *Ring) LocalAddr() netip.AddrPort { return r.bc.localAddr() }

// Config returns the rank's configuration with defaults applied.
func (r *Ring) Config() RingConfig { return r.cfg }

// Stats returns the rank's cumulative counters.
func (r *Ring) Stats() RingStats {
	s := &r.st
	return RingStats{
		DataSent: s.dataSent.Load(), Retransmits: s.retransmits.Load(), DataReceived: s.dataReceived.Load(),
		Duplicates: s.duplicates.Load(), Early: s.early.Load(), EarlyDropped: s.earlyDropped.Load(),
		AcksSent: s.acksSent.Load(), AcksReceived: s.acksReceived.Load(), Malformed: s.malformed.Load(),
		SendErrors: s.sendErrors.Load(),
	}
}

// Close closes the socket and stops the protocol goroutine. A running AllReduce fails with
// ErrClosed. Closing twice returns ErrClosed.
func (r *Ring) Close() error {
	err := ErrClosed
	r.closeOnce.Do(func() {
		close(r.closing)
		err = r.bc.close()
		<-r.loopDone
	})
	return err
}

// AllReduce replaces data, in place, by the element-wise float32 sum, in ring order, of the
// same-length tensors that every rank passes to its own AllReduce (see the ring order above:
// identical bits on every rank). All ranks must make the same sequence of calls with equal
// lengths. With one rank, or an empty tensor, it is a no-op.
//
// On error (ctx done, ErrTimeout, ErrClosed) data is partly reduced and the ranks are out of
// step; recovering is the caller's business (a new Ring on new ports is simplest).
func (r *Ring) AllReduce(ctx context.Context, data []float32) error {
	if r.w == 1 || len(data) == 0 {
		return nil
	}
	if !r.opMu.TryLock() {
		return fmt.Errorf("%w: AllReduce already running on ring rank %d", ErrBusy, r.rank)
	}
	defer r.opMu.Unlock()
	select {
	case <-r.closing:
		return fmt.Errorf("ring allreduce: %w", ErrClosed)
	default:
	}
	if int64(2*r.w-2)*int64(r.pieces((len(data)+r.w-1)/r.w)) > 1<<30 {
		// The wire's 32-bit seq must tell this call's packets from its neighbours'.
		return fmt.Errorf("%w: tensor of %d values: split it into tensors of at most %d values", ErrConfig,
			len(data), (1<<30)/int64(2*r.w-2)*int64(r.k)*int64(r.w))
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("ring allreduce of %d values: %w", len(data), err)
	}
	r.reqData = data
	r.reqPending.Store(true)
	r.poke()
	select {
	case err := <-r.done:
		// A cancel that lost the race with the end of the call must not cancel the next one:
		// the loop looks at the flag again only once it has the next request.
		r.cancelReq.Store(false)
		return err
	case <-ctx.Done():
		r.cancelReq.Store(true)
		r.poke()
		select {
		case err := <-r.done:
			if errors.Is(err, errCanceled) {
				return fmt.Errorf("ring allreduce of %d values: %w", len(data), ctx.Err())
			}
			return err // finished meanwhile
		case <-r.loopDone:
			return fmt.Errorf("ring allreduce: %w", r.loopErr)
		}
	case <-r.loopDone:
		return fmt.Errorf("ring allreduce: %w", r.loopErr)
	}
}

// poke wakes the loop from its receive.
func (r *Ring) poke() { _ = r.bc.conn.SetReadDeadline(time.Unix(1, 0)) }

// loop is the ring's one protocol goroutine.
func (r *Ring) loop() {
	defer close(r.loopDone)
	for {
		if r.reqPending.Load() {
			r.start()
		}
		if r.op.active && r.cancelReq.Load() {
			r.finish(errCanceled)
		}
		now := r.now()
		if r.op.active {
			if err := r.pump(now); err != nil {
				r.finish(err)
			}
		}
		if err := r.flush(); err != nil {
			r.stop(err)
			return
		}
		if r.op.active && r.op.sendLeft == 0 && r.op.recvLeft == 0 {
			r.finish(nil)
			continue
		}
		// Arm the receive deadline, then look at the handoff flags again: a poke after this
		// point interrupts the receive, one before it set a flag seen here.
		if err := r.arm(); err != nil {
			r.stop(err)
			return
		}
		if r.reqPending.Load() || (r.op.active && r.cancelReq.Load()) {
			continue
		}

		n, err := r.bc.recv()
		if err != nil {
			switch {
			case isTimeout(err):
				r.armedKnown = false // a poke may have moved the deadline: set it afresh
			case transientRecv(err):
			default:
				r.stop(err)
				return
			}
			continue
		}
		now = r.now()
		for i := 0; i < n; i++ {
			b, err := r.bc.rpkt(i)
			if err != nil {
				r.st.malformed.Add(1)
				continue
			}
			r.handle(b, now, true)
		}
		r.queueAcks()
	}
}

func (r *Ring) now() int64 { return int64(time.Since(r.epoch)) }

// stop ends the loop: the running call, if any, fails with err.
func (r *Ring) stop(err error) {
	if isClosed(err) {
		err = ErrClosed
	}
	r.loopErr = err
	if r.op.active {
		r.finish(err)
	}
}

// arm sets the receive deadline to the next retransmission or stall check, unless the one set
// comes first and still lies ahead (an early wake-up is harmless). Idle, there is none: a poke
// wakes the loop.
func (r *Ring) arm() error {
	if !r.op.active {
		if r.armedKnown && r.armed.IsZero() {
			return nil
		}
		r.armed, r.armedKnown = time.Time{}, true
		return r.bc.conn.SetReadDeadline(time.Time{})
	}
	want := r.epoch.Add(time.Duration(min(r.earliest, r.op.progress+r.stall)))
	if r.armedKnown && !r.armed.IsZero() && !want.Before(r.armed) && time.Now().Before(r.armed) {
		return nil
	}
	r.armed, r.armedKnown = want, true
	return r.bc.conn.SetReadDeadline(want)
}

// chunk returns the start and length of chunk c of an n-value tensor.
func (r *Ring) chunk(c int) (lo, n int) {
	q, rem := r.op.n/r.w, r.op.n%r.w
	return c*q + min(c, rem), q + b2i(c < rem)
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// sendChunk and recvChunk are the chunks rank r sends and receives in step s (both phases: in
// the all-gather, r+1-(s-(W-1)) = r-s mod W).
func (r *Ring) sendChunk(s int) int { return ((r.rank-s)%r.w + r.w) % r.w }
func (r *Ring) recvChunk(s int) int { return ((r.rank-1-s)%r.w + r.w) % r.w }

// pieces is the number of packets of an n-value chunk.
func (r *Ring) pieces(n int) int { return (n + r.k - 1) / r.k }

// start takes the requested call: lays out its seq space, makes step 0 ready and applies the
// packets of it that arrived early.
func (r *Ring) start() {
	data := r.reqData
	r.reqData = nil
	r.reqPending.Store(false)
	op := &r.op
	steps := 2*r.w - 2
	op.active, op.data, op.n, op.base = true, data, len(data), r.nextBase
	_, big := r.chunk(0)
	op.per = r.pieces(big)
	op.total = steps * op.per
	r.nextBase += uint64(op.total)
	op.sendLeft, op.recvLeft = 0, 0
	for s := 0; s < steps; s++ {
		_, sn := r.chunk(r.sendChunk(s))
		_, rn := r.chunk(r.recvChunk(s))
		op.sendLeft += r.pieces(sn)
		op.recvLeft += r.pieces(rn)
	}
	words := (op.total + 63) / 64
	if cap(op.recvBits) < words {
		op.recvBits = make([]uint64, words)
	}
	op.recvBits = op.recvBits[:words]
	clear(op.recvBits)
	if cap(op.slotOf) < op.total {
		op.slotOf = make([]int32, op.total)
		op.ready = make([]uint32, 0, op.total)
	}
	op.slotOf = op.slotOf[:op.total]
	for i := range op.slotOf {
		op.slotOf[i] = -1
	}
	op.ready, op.readyAt = op.ready[:0], 0
	_, n0 := r.chunk(r.sendChunk(0))
	for p := 0; p < r.pieces(n0); p++ {
		op.ready = append(op.ready, uint32(p))
	}
	now := r.now()
	op.progress = now
	r.earliest = math.MaxInt64

	stashed := r.nstash
	r.nstash = 0
	for i := 0; i < stashed; i++ {
		r.handle(r.stash[i].pkt[:r.stash[i].n], now, false)
	}
	r.queueAcks()
}

// finish ends the running call with err (nil: success) and answers AllReduce.
func (r *Ring) finish(err error) {
	op := &r.op
	if err == nil {
		r.doneBelow = r.nextBase
	}
	op.active, op.data = false, nil
	// Packets still in flight are abandoned; their acks will match nothing.
	r.freeSlots = r.freeSlots[:0]
	for i := len(r.slots) - 1; i >= 0; i-- {
		r.slots[i].busy = false
		r.freeSlots = append(r.freeSlots, int32(i))
	}
	r.earliest = math.MaxInt64
	r.done <- err
}

// pump queues due retransmissions and as many ready packets as the window allows.
func (r *Ring) pump(now int64) error {
	op := &r.op
	if now >= r.earliest {
		r.earliest = math.MaxInt64
		var resent uint64
		for i := range r.slots {
			sl := &r.slots[i]
			if !sl.busy {
				continue
			}
			if now >= sl.deadline {
				if sl.retries >= r.cfg.MaxRetries {
					s, p := int(sl.off)/op.per, int(sl.off)%op.per
					return fmt.Errorf("%w: ring rank %d: packet %d of step %d to rank %d unacknowledged after %d resends",
						ErrTimeout, r.rank, p, s, r.succ, sl.retries)
				}
				sl.retries++
				flags := binary.LittleEndian.Uint16(sl.pkt[wire.OffFlags:])
				binary.LittleEndian.PutUint16(sl.pkt[wire.OffFlags:], flags|wire.FlagResend)
				sl.deadline = now + int64(r.cfg.Timeout)<<min(sl.retries, maxBackoffShift)
				r.queue(&r.succSa, sl.pkt[:sl.plen])
				resent++
			}
			r.earliest = min(r.earliest, sl.deadline)
		}
		r.st.dataSent.Add(resent)
		r.st.retransmits.Add(resent)
	}
	var sent uint64
	for op.readyAt < len(op.ready) && len(r.freeSlots) > 0 {
		off := op.ready[op.readyAt]
		op.readyAt++
		k := r.freeSlots[len(r.freeSlots)-1]
		r.freeSlots = r.freeSlots[:len(r.freeSlots)-1]
		sl := &r.slots[k]
		sl.busy, sl.off, sl.retries, sl.deadline = true, off, 0, now+int64(r.cfg.Timeout)
		r.encode(sl)
		op.slotOf[off] = k
		r.earliest = min(r.earliest, sl.deadline)
		r.queue(&r.succSa, sl.pkt[:sl.plen])
		sent++
	}
	r.st.dataSent.Add(sent)
	if now-op.progress >= r.stall {
		return fmt.Errorf("%w: ring rank %d: nothing new from rank %d or %d for %v", ErrTimeout, r.rank,
			r.pred, r.succ, time.Duration(now-op.progress))
	}
	return nil
}

// encode writes slot sl's DATA packet from the tensor's current values.
func (r *Ring) encode(sl *ringSlot) {
	op := &r.op
	s, p := int(sl.off)/op.per, int(sl.off)%op.per
	lo, n := r.chunk(r.sendChunk(s))
	lo += p * r.k
	vals := op.data[lo : lo+min(r.k, n-p*r.k)]
	out := sl.pkt[wire.HdrSize : wire.HdrSize+4*len(vals)]
	for j, x := range vals {
		binary.LittleEndian.PutUint32(out[4*j:], math.Float32bits(x))
	}
	h := wire.Header{
		Version:  wire.Version,
		Type:     wire.MsgData,
		Encoding: wire.EncFloat32,
		Count:    uint16(len(vals)),
		JobId:    r.cfg.ID,
		Seq:      uint32(op.base + uint64(sl.off)),
		AggIndex: uint32(s),
		Bitmap0:  1 << r.rank,
		Bitmap1:  uint32(op.n),
		FanIn0:   uint8(r.w),
		WorkerId: uint8(r.rank),
	}
	wire.EncodeHeader(sl.pkt, &h)
	sl.plen = wire.HdrSize + 4*len(vals)
}

// handle processes one received datagram (fresh: straight from the socket, else from the stash).
func (r *Ring) handle(b []byte, now int64, fresh bool) {
	h, vals, err := wire.ParsePacket(b)
	if err != nil || h.JobId != r.cfg.ID || h.Encoding != wire.EncFloat32 {
		r.st.malformed.Add(1)
		return
	}
	op := &r.op
	switch {
	case h.Type == wire.MsgAck && len(b) == wire.HdrSize && int(h.WorkerId) == r.succ:
		r.st.acksReceived.Add(1)
		if op.active {
			r.acked(h.Seq, uint64(h.Bitmap1)<<32|uint64(h.Bitmap0), now)
		}
		return
	case h.Type != wire.MsgData || int(h.WorkerId) != r.pred || int(h.FanIn0) != r.w || h.Bitmap0 != 1<<r.pred:
		r.st.malformed.Add(1)
		return
	}

	// Where does the packet belong? Relative to the running call (or, idle, to the next one).
	base, total := r.nextBase, 0
	if op.active {
		base, total = op.base, op.total
	}
	d := int64(int32(h.Seq - uint32(base)))
	switch {
	case d < 0:
		// An earlier call's packet whose ack was lost. Re-ack it if that call completed here
		// (then it was received); otherwise the ranks are out of step anyway.
		r.st.duplicates.Add(1)
		if int32(h.Seq-uint32(r.doneBelow)) < 0 {
			r.queueAck(h.Seq, 1)
		}
		return
	case d >= int64(total):
		if !fresh || d >= 1<<30 {
			r.st.malformed.Add(1)
			return
		}
		r.keep(b, h.Seq)
		return
	}

	off := int(d)
	s, p := off/op.per, off%op.per
	lo, n := r.chunk(r.recvChunk(s))
	if p >= r.pieces(n) || h.AggIndex != uint32(s) || h.Bitmap1 != uint32(op.n) ||
		int(h.Count) != min(r.k, n-p*r.k) {
		r.st.malformed.Add(1)
		return
	}
	r.noteAck(off)
	if op.recvBits[off/64]&(1<<(off%64)) != 0 {
		r.st.duplicates.Add(1)
		return
	}
	op.recvBits[off/64] |= 1 << (off % 64)
	dst := op.data[lo+p*r.k:][:h.Count]
	if s < r.w-1 {
		for j := range dst { // reduce-scatter: the partial sum so far, plus this rank's value
			dst[j] = math.Float32frombits(binary.LittleEndian.Uint32(vals[4*j:])) + dst[j]
		}
	} else {
		for j := range dst { // all-gather: the final sum
			dst[j] = math.Float32frombits(binary.LittleEndian.Uint32(vals[4*j:]))
		}
	}
	op.recvLeft--
	op.progress = now
	r.st.dataReceived.Add(1)
	if s+1 < 2*r.w-2 {
		// The same piece of the same chunk goes on in the next step.
		op.ready = append(op.ready, uint32(off+op.per))
	}
}

// acked applies an acknowledgement of the 64 seqs from seq on.
func (r *Ring) acked(seq uint32, mask uint64, now int64) {
	op := &r.op
	d := int64(int32(seq - uint32(op.base)))
	for ; mask != 0; mask &= mask - 1 {
		off := d + int64(bits.TrailingZeros64(mask))
		if off < 0 || off >= int64(op.total) {
			continue
		}
		k := op.slotOf[off]
		if k < 0 {
			continue
		}
		op.slotOf[off] = -1
		r.slots[k].busy = false
		r.freeSlots = append(r.freeSlots, k)
		op.sendLeft--
		op.progress = now
	}
}

// keep stashes a packet of the next call, unacknowledged: its sender resends it until the call
// starts here and the ack goes out.
func (r *Ring) keep(b []byte, seq uint32) {
	for i := 0; i < r.nstash; i++ {
		if binary.LittleEndian.Uint32(r.stash[i].pkt[wire.OffSeq:]) == seq {
			return // a retransmission of one already kept
		}
	}
	if len(b) > len(r.stash[0].pkt) {
		r.st.malformed.Add(1) // more values than ValuesPerPacket: never a packet of this ring
		return
	}
	if r.nstash == len(r.stash) {
		r.st.earlyDropped.Add(1)
		return
	}
	st := &r.stash[r.nstash]
	r.nstash++
	st.n = copy(st.pkt, b)
	r.st.early.Add(1)
}

// noteAck records that the ack block of seq offset off must be sent after this batch.
func (r *Ring) noteAck(off int) {
	blk := uint32(off / 64)
	for _, b := range r.ackBlocks {
		if b == blk {
			return
		}
	}
	if len(r.ackBlocks) == cap(r.ackBlocks) {
		r.queueAcks()
	}
	r.ackBlocks = append(r.ackBlocks, blk)
}

// queueAcks queues one ack per block touched since the last call, with the block's state.
func (r *Ring) queueAcks() {
	op := &r.op
	for _, blk := range r.ackBlocks {
		r.queueAck(uint32(op.base+64*uint64(blk)), op.recvBits[blk])
	}
	r.ackBlocks = r.ackBlocks[:0]
}

func (r *Ring) queueAck(seq uint32, mask uint64) {
	if r.nack == len(r.ackBufs) || r.bc.free() == 0 {
		_ = r.flush() // a failed socket shows again at the loop's flush
	}
	buf := r.ackBufs[r.nack][:]
	r.nack++
	h := wire.Header{
		Version:  wire.Version,
		Type:     wire.MsgAck,
		Encoding: wire.EncFloat32,
		JobId:    r.cfg.ID,
		Seq:      seq,
		Bitmap0:  uint32(mask),
		Bitmap1:  uint32(mask >> 32),
		FanIn0:   uint8(r.w),
		WorkerId: uint8(r.rank),
	}
	wire.EncodeHeader(buf, &h)
	r.st.acksSent.Add(1)
	if r.dropTx != nil && r.dropTx() {
		return
	}
	r.bc.queue(&r.predSa, buf, nil)
}

// queue adds a data packet to the send batch (the caller keeps the batch within its size).
func (r *Ring) queue(to *unix.RawSockaddrInet4, pkt []byte) {
	if r.dropTx != nil && r.dropTx() {
		return
	}
	if r.bc.free() == 0 {
		_ = r.flush()
	}
	r.bc.queue(to, pkt, nil)
}

// flush sends the queued batch.
func (r *Ring) flush() error {
	r.nack = 0
	if r.bc.sq == 0 {
		return nil
	}
	refused, _, err := r.bc.flush()
	r.st.sendErrors.Add(uint64(refused))
	return err
}
