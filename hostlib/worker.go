package hostlib

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/bpf/host"

	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/wire"
)

// Worker defaults and limits.
const (
	DefaultPoolSize     = 4096 // the switch's default (loader.Config)
	DefaultWindow       = 64
	DefaultScaleLog2    = 24
	DefaultTimeout      = 20 * time.Millisecond
	DefaultMaxRetries   = 50
	DefaultSocketBuffer = 8 << 20

	// MaxScaleLog2 keeps one quantised value of magnitude >= 1 representable: at 2^30, |x| < 2.
	MaxScaleLog2 = 30
	// MaxWindow bounds the memory a worker pins for in-flight fragments (one packet buffer each,
	// about 1.5 KB): 64 Ki fragments is ~94 MiB.
	MaxWindow = 1 << 16
	// maxBackoffShift caps the exponential retransmit backoff at 2^3 = 8x Timeout.
	maxBackoffShift = 3
)

// WorkerConfig configures one worker of a job. Zero fields take their defaults (WithDefaults).
//
// Results are accepted only from PS, address and port (the switch broadcasts them, and answers
// resends from a slot's copy, with the PS's address and the agg port as source; a PS answering
// by itself sends from there too) and, after a Join, from the switch agent's address (its
// retransmit cache). Results from anywhere else count in WorkerStats.Foreign.
type WorkerConfig struct {
	JobID      uint32         // != 0
	WorkerID   uint8          // 0..NumWorkers-1: this worker's bit in the contributor bitmap
	NumWorkers uint8          // 1..32: the fan-in, workers whose fragments make a sum
	Local      netip.AddrPort // IPv4 address to bind; results arrive here (the switch is configured with it). Port 0 picks one (see LocalAddr)
	PS         netip.AddrPort // where data packets go: PS IP + agg port (port 0: wire.DefaultPort); the source results must come from
	PoolSize   uint32         // the switch's pool size (default 4096)
	Window     int            // fragments in flight (default min(64, PoolSize/2)); 2*Window <= PoolSize
	// ScaleLog2 is the fixed-point exponent: values travel as round(x * 2^ScaleLog2). Default 24,
	// max 30. Zero means the default, so an integer-only scale cannot be chosen.
	ScaleLog2 uint8
	// Timeout is the first retransmit timeout (default 20ms); it doubles per retry up to 8x.
	Timeout time.Duration
	// MaxRetries is how many times one fragment is resent before AllReduce fails with ErrTimeout
	// (default 50), counted afresh for a fragment's float32 repair.
	MaxRetries int
	// SocketBuffer sizes SO_RCVBUF/SO_SNDBUF in bytes (default 8 MiB), forced past the sysctl
	// limits when the process has CAP_NET_ADMIN.
	SocketBuffer int
	// NoGSO sends every DATA packet as its own datagram. By default a worker sends runs of
	// equal-size packets as UDP GSO messages (UDP_SEGMENT) and falls back to per-datagram sends
	// for good if the kernel refuses them (see Worker.GSO).
	NoGSO bool
	// BusyPoll, if nonzero, sets SO_BUSY_POLL (rounded to µs) and SO_PREFER_BUSY_POLL on the
	// worker's socket: a receive that finds no result polls the device's NAPI for up to that long
	// instead of waiting for its softirq. Off by default: measured not to pay on a CPU-bound host
	// (docs/benchmarks.md, Fast path).
	BusyPoll time.Duration
	// NoCongestionControl keeps Window fragments in flight whatever the network says. By
	// default the worker runs ATP's AIMD on its window: it halves (at most once per window of
	// data) on a result carrying F_ECN and grows by one fragment per window of clean results,
	// between 1 and Window.
	NoCongestionControl bool
	// ValuesPerPacket is K, the values one fragment carries: as many as the path MTU holds,
	// wire.ValuesForMTU(mtu). Default wire.StdValues (360, a 1500-byte MTU); at most wire.MaxValues
	// (832, MTU 3388). Every worker of a job must use the same K: it decides the fragments.
	ValuesPerPacket int
	// AFXDP receives results through an AF_XDP socket instead of the UDP socket: NewWorker loads
	// the host program xdpagg_host (package bpf/host) and attaches it, in native mode, to the
	// interface holding Local's address (which must be set), where it redirects this job's
	// results to Local into the socket, bound to receive queue 0 in copy mode; results never
	// become skbs. Everything else (control messages, results on other queues) still reaches
	// the UDP socket, and sending stays there. Both paths apply the same checks to what they
	// receive. The interface must run no other XDP program (on a veth, xdpagg_host also does
	// xdpagg_pass's job). NewWorker fails with ErrAFXDP if AF_XDP cannot be set up, unless
	// AFXDPFallback: then the worker receives on its UDP socket alone and Worker.AFXDP says why.
	AFXDP         bool
	AFXDPFallback bool
	// JobKey is the job's control key (ctlauth.KeySize bytes, from `xdpagg job add`; parse its
	// hex with ctlauth.ParseKey). Join and Leave need it: every control message the worker sends
	// (JOIN, LEAVE, and after a Join its ACKs and RETRANSMITs) is authenticated with it, and so
	// must be the agent's answers. A worker that never joins (members set by the operator, or a
	// PS in Direct mode) may leave it nil. NewWorker keeps a copy.
	JobKey []byte
}

// WithDefaults returns c with zero fields set to their defaults and addresses unmapped to IPv4.
func (c WorkerConfig) WithDefaults() WorkerConfig {
	if c.PoolSize == 0 {
		c.PoolSize = DefaultPoolSize
	}
	if c.Window == 0 {
		// Small pools (tests, tiny switches) still work out of the box.
		c.Window = int(min(uint32(DefaultWindow), c.PoolSize/2))
	}
	if c.ScaleLog2 == 0 {
		c.ScaleLog2 = DefaultScaleLog2
	}
	if c.Timeout == 0 {
		c.Timeout = DefaultTimeout
	}
	if c.MaxRetries == 0 {
		c.MaxRetries = DefaultMaxRetries
	}
	if c.SocketBuffer == 0 {
		c.SocketBuffer = DefaultSocketBuffer
	}
	if c.ValuesPerPacket == 0 {
		c.ValuesPerPacket = wire.StdValues
	}
	c.Local = netip.AddrPortFrom(c.Local.Addr().Unmap(), c.Local.Port())
	port := c.PS.Port()
	if port == 0 {
		port = wire.DefaultPort
	}
	c.PS = netip.AddrPortFrom(c.PS.Addr().Unmap(), port)
	return c
}

// Validate reports what to change in a configuration that cannot work. Call it on WithDefaults'
// result (NewWorker does).
func (c WorkerConfig) Validate() error {
	switch {
	case c.JobID == 0:
		return fmt.Errorf("%w: JobID is 0: use a nonzero job id (0 is reserved)", ErrConfig)
	case c.NumWorkers == 0 || int(c.NumWorkers) > wire.MaxWorkers:
		return fmt.Errorf("%w: NumWorkers %d: use 1..%d", ErrConfig, c.NumWorkers, wire.MaxWorkers)
	case c.WorkerID >= c.NumWorkers:
		return fmt.Errorf("%w: WorkerID %d: use 0..%d (NumWorkers-1)", ErrConfig, c.WorkerID, c.NumWorkers-1)
	case !c.Local.Addr().Is4():
		return fmt.Errorf("%w: Local %v: use an IPv4 address (xdpagg is UDP/IPv4)", ErrConfig, c.Local)
	case !c.PS.Addr().Is4() || c.PS.Addr().IsUnspecified():
		return fmt.Errorf("%w: PS %v: use the parameter server's IPv4 address", ErrConfig, c.PS)
	case c.PoolSize < 2:
		return fmt.Errorf("%w: PoolSize %d: use the switch's pool size, at least 2 (a job needs 2*Window slots)", ErrConfig, c.PoolSize)
	case c.Window < 1 || c.Window > MaxWindow:
		return fmt.Errorf("%w: Window %d: use 1..%d", ErrConfig, c.Window, MaxWindow)
	case uint64(2*c.Window) > uint64(c.PoolSize):
		return fmt.Errorf("%w: Window %d needs 2*Window = %d slots but PoolSize is %d: lower Window to at most %d or enlarge the switch pool",
			ErrConfig, c.Window, 2*c.Window, c.PoolSize, c.PoolSize/2)
	case c.ScaleLog2 > MaxScaleLog2:
		return fmt.Errorf("%w: ScaleLog2 %d: use 1..%d", ErrConfig, c.ScaleLog2, MaxScaleLog2)
	case c.Timeout < time.Microsecond:
		return fmt.Errorf("%w: Timeout %v: use a positive retransmit timeout of at least 1µs", ErrConfig, c.Timeout)
	case c.MaxRetries < 1:
		return fmt.Errorf("%w: MaxRetries %d: use at least 1", ErrConfig, c.MaxRetries)
	case c.ValuesPerPacket < 1 || c.ValuesPerPacket > wire.MaxValues:
		return fmt.Errorf("%w: ValuesPerPacket %d: use 1..%d (wire.ValuesForMTU(mtu) fills a packet)", ErrConfig, c.ValuesPerPacket, wire.MaxValues)
	case c.SocketBuffer < 0 || c.SocketBuffer > math.MaxInt32:
		return fmt.Errorf("%w: SocketBuffer %d: use 0..%d bytes", ErrConfig, c.SocketBuffer, math.MaxInt32)
	case c.JobKey != nil && len(c.JobKey) != ctlauth.KeySize:
		return fmt.Errorf("%w: JobKey has %d bytes: use the job's %d-byte key (ctlauth.ParseKey of what `xdpagg job add` prints), or nil without Join",
			ErrConfig, len(c.JobKey), ctlauth.KeySize)
	}
	return nil
}

// FastLossResults is how many results of later fragments must overtake a fragment before its
// worker deems it lost and resends it without waiting for the timeout (ATP's three out-of-order
// parameter packets).
const FastLossResults = 3

// WorkerStats are a worker's cumulative counters. Every datagram the worker receives counts in
// exactly one of ResultsReceived, DuplicateResults, OverflowRepairs, Malformed, Foreign,
// Unauthenticated, Replayed, ControlAcks, HelpAnswers and HelpUnknown, or, while it is kept for a
// fragment not sent yet (Async), in EarlyResults; ShadowResults, ResultsFromPS, Collisions and
// CacheResults break ResultsReceived down, CacheMisses ControlAcks.
type WorkerStats struct {
	DataSent         uint64        // DATA packets sent, retransmissions and float repairs included
	Retransmits      uint64        // DATA packets resent (F_RESEND) after a timeout or a fast loss detection
	FastResends      uint64        // of Retransmits (and cache requests): sent early because FastLossResults later results overtook the fragment
	CacheRequests    uint64        // Help requests (iSwitch's Help, MSG_RETRANSMIT) sent to the switch agent for a lost result
	CacheResults     uint64        // of ResultsReceived: answered through the agent (F_CACHED): its retransmit cache, or another member (member-assisted Help)
	CacheMisses      uint64        // Help requests the agent's cache could not answer at once (it asks the job's other members; the data timer goes on)
	CacheLatency     time.Duration // mean time from a fragment's first Help request to its result through the agent (cache or member)
	HelpAnswers      uint64        // results this worker sent the switch agent for another member (member-assisted Help, MSG_HELP)
	HelpUnknown      uint64        // authenticated member-Help requests for a result this worker does not keep: not answered
	ECNResults       uint64        // results that carried F_ECN (congestion on the job's path)
	WindowCuts       uint64        // multiplicative decreases of the congestion window
	Rehashes         uint64        // slot offsets moved by the PS after collisions (ATP's rehash)
	CongestionWindow float64       // fragments the worker may have in flight now (AIMD), at most Window
	MinWindow        float64       // the smallest congestion window so far
	ResultsReceived  uint64        // results that completed a fragment
	EarlyResults     uint64        // results held now for fragments not sent yet (Async; not cumulative)
	DuplicateResults uint64        // results for fragments already complete or not in the running AllReduce
	ShadowResults    uint64        // of ResultsReceived: unicast re-sends (F_SHADOW) of a completed sum
	ResultsFromPS    uint64        // of ResultsReceived: summed by the PS (no F_FROM_SWITCH)
	Collisions       uint64        // of ResultsReceived: some data went via the PS (F_COLLISION)
	OverflowRepairs  uint64        // fragments whose fixed-point sum saturated, repaired in float32
	Malformed        uint64        // packets dropped: unparsable, not a result of this job, or disagreeing with the fragment
	SendErrors       uint64        // DATA packets the kernel refused to send (the retransmit timer covers them)
	GSOMessages      uint64        // UDP GSO messages sent, each carrying several DATA packets
	// Foreign counts datagrams dropped unread for their source: results not from the PS address
	// and port (WorkerConfig.PS) nor, after a Join, from the switch agent; acknowledgements not
	// from the switch address the worker sent its control messages to.
	Foreign uint64
	// Unauthenticated counts acknowledgements from the switch agent's address that do not open
	// under JobKey (no trailer, a wrong tag); Replayed those that do but whose stamp is not newer
	// than the last accepted from that address, or too far from this host's clock (ctlauth.Replay).
	Unauthenticated uint64
	Replayed        uint64
	ControlAcks     uint64 // authenticated, fresh MSG_ACKs from the switch agent (Join/Leave answers, retransmit misses)
}

type workerCounters struct {
	cacheReqs, cacheResults, cacheMisses, cacheLatNs, cacheLatN                                                         atomic.Uint64
	ecnResults, windowCuts, cwndMilli, minCwndMilli                                                                     atomic.Uint64
	rehashes, early                                                                                                     atomic.Uint64
	foreign, unauth, replayed, ctlAcks, helpAnswers, helpUnknown                                                        atomic.Uint64
	dataSent, retransmits, fastResends, results, duplicates, shadow, fromPS, collisions, repairs, malformed, sendErrors atomic.Uint64
}

// Worker all-reduces tensors with the other workers of its job through the switch (and the PS).
// Its methods may be called from any goroutine; AllReduce calls must not overlap.
type Worker struct {
	cfg      WorkerConfig
	bc       *batchConn
	psAddr   unix.RawSockaddrInet4
	slotBase uint32
	epoch    time.Time // monotonic origin of the fragment deadlines
	st       workerCounters

	// Owned by the running AllReduce (opMu).
	opMu        sync.Mutex
	timer       *time.Timer
	lastSendErr error

	// mu guards op, which the receive goroutine updates as results arrive, and nextSeq, which
	// Halt and Resume move too.
	mu      sync.Mutex
	op      operation
	nextSeq uint64        // first seq of the next AllReduce: job-wide, identical on every worker
	kick    chan struct{} // receive goroutine -> AllReduce: op changed

	// ctlTurn makes control calls (Join, Leave, Reset, Halt, SetH, FBcast) take turns, one ACK
	// awaited at a time: a call holds its one slot. A channel, not a mutex, so that a call
	// waiting for its turn still ends with its context.
	ctlTurn chan struct{}
	// Control acknowledgements, guarded by mu.
	ackWant    uint32                // nonce (seq) of the control message waiting for its MSG_ACK
	ackGot     bool                  // its authenticated MSG_ACK arrived
	ackPending bool                  // a control call waits for its MSG_ACK from ackFrom
	ackFrom    unix.RawSockaddrInet4 // the switch address that the control call sends to
	// acked wakes the waiting control call when its MSG_ACK arrives. Not kick: AllReduce takes
	// kicks too (a Halt runs beside the worker's own AllReduce), and an ACK whose wake-up it took
	// would leave the call waiting out its resend timer with the answer in hand.
	acked chan struct{}

	// Control-message authentication: this worker's stamps, and the agent's last accepted ones
	// (by its address).
	stamper ctlauth.Stamper
	replay  ctlauth.Replay[unix.RawSockaddrInet4]

	// The switch agent this worker joined (guarded by mu): lost results are asked of its
	// retransmit cache (MSG_RETRANSMIT), and received ones acknowledged (cumulative MSG_ACK).
	ctrl    netip.AddrPort
	ctrlRaw unix.RawSockaddrInet4
	ctrlSet bool
	ackPkt  [ctlMsgSize]byte // the last cumulative ACK queued, sealed (stays put until flushed)
	ackedTo int              // fragments of the running operation acknowledged so far
	cacheAt map[uint32]int64 // seq -> when its result was asked of the cache (ns since epoch)

	// Member-assisted Help (guarded by mu): a joined worker keeps its last 2*Window results, by
	// seq mod 2*Window, to answer the switch agent's MSG_HELP for a member that lost one.
	kept    []keptResult
	helpBuf []byte // one sealed answer part, built and sent by the receive goroutine

	// AIMD congestion window (guarded by mu): fragments allowed in flight, 1..Window. After a
	// cut, ECN on results of fragments sent before it is not cut again (one cut per RTT).
	cwnd    float64
	cutSeq  uint32
	cutDone bool

	// early holds results of fragments this worker has not sent yet (asynchronous aggregation:
	// a round completed at the threshold H without it), by seq, from earlyLow on; nil unless an
	// Async runs the worker. Guarded by mu. earlyKick tells the Async that one arrived.
	early     map[uint32]earlyResult
	earlyLow  uint64
	earlyKick chan struct{}

	remap map[uint32]slotRemap // slot offset (seq % 2W) -> ATP rehash from the PS; guarded by mu
	srtt  int64                // smoothed result round trip (ns), for fast loss detection; guarded by mu

	// halted: the switch's agent said the job is halted (authenticated MSG_HALT), or this worker
	// asked it to (Halt). haltSeq is that halt's seq (its resume point, the 32 bits of the
	// sequence number every member goes on from), resumedHalt the one Resume last resumed from
	// (guarded by mu).
	halted      atomic.Bool
	haltSeq     uint32
	resumedHalt uint32
	resumed     bool

	// AF_XDP receive (WorkerConfig.AFXDP): the socket, the host program and its attachment, the
	// socket's receive goroutine (xskDone, xskErr as recvDone, recvErr), or why it is off.
	xsk      *xskConn
	xskObjs  *host.HostObjects
	xskLink  link.Link
	xskDone  chan struct{}
	xskErr   error
	xskFallb error

	closeOnce sync.Once
	closing   chan struct{}
	recvDone  chan struct{}
	recvErr   error // why the receive goroutine stopped; read after recvDone is closed
}

// operation is the state of the running AllReduce. Only fragments [low, next) are in flight, at
// most Window of them, each in ring[index % Window].
type operation struct {
	active  bool
	data    []float32
	seqBase uint64
	nfrags  int
	low     int // lowest fragment without its result
	next    int // next fragment to send for the first time
	ring    []fragment
	// Asynchronous rounds (Async): listen only, sending no data (the worker has no gradient for
	// the round), and the contributor bitmap of each fragment's result.
	listen  bool
	bitmaps []uint32
}

type fragState uint8

const (
	fragFixed  fragState = iota // fixed-point data sent, waiting for its result
	fragRepair                  // saturated: float32 data sent (or to send), waiting for the float result
	fragDone                    // result written into data
)

type fragment struct {
	idx          int
	state        fragState
	repairQueued bool             // the receive goroutine asks AllReduce to send the float32 repair data
	retries      int              // resends in the current state
	later        int              // results of later fragments received since this one was (re)sent
	sentAt       int64            // when it was last sent (ns since epoch)
	fast         bool             // deemed lost early (FastLossResults): the next resend counts in FastResends
	askedCache   bool             // a MSG_RETRANSMIT went to the switch agent for this fragment's result
	ctl          [ctlMsgSize]byte // the sealed MSG_RETRANSMIT packet (stays put until flushed)
	deadline     int64            // ns since epoch at which to resend
	plen         int
	pkt          [wire.MaxPacket]byte // the DATA packet as sent: resends repeat it byte for byte
}

// keptResult is a result this worker received, kept for other members (member-assisted Help):
// its header as received and its values (wire bytes) in vals[:4*h.Count].
type keptResult struct {
	ok   bool
	h    wire.Header
	vals []byte // cap 4*ValuesPerPacket, in one allocation for the whole ring
}

// recvBatch is how many datagrams one recvmmsg takes.
const recvBatch = 64

// ctlMsgSize is a header-only control message (ACK, RETRANSMIT) with its authentication trailer.
const ctlMsgSize = wire.HdrSize + ctlauth.TrailerSize

// NewWorker validates cfg and binds the worker's UDP socket now, in the calling thread's network
// namespace (callers place workers in a namespace by creating them on a locked thread inside it).
// It starts the goroutine that receives results; Close stops it.
func NewWorker(cfg WorkerConfig) (*Worker, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.JobKey = bytes.Clone(cfg.JobKey)
	// One step queues at most two packets per fragment in flight (data, repair or Help request;
	// a resend of a joined worker's data goes with a new Help request) plus one cumulative ACK.
	bc, err := listenBatch(cfg.Local, cfg.SocketBuffer, recvBatch, 2*cfg.Window+1)
	if err != nil {
		return nil, fmt.Errorf("worker %d of job %d: %w", cfg.WorkerID, cfg.JobID, err)
	}
	w := &Worker{
		cfg:      cfg,
		bc:       bc,
		psAddr:   sockaddr4(cfg.PS),
		slotBase: SlotBase(cfg.JobID, cfg.PoolSize),
		epoch:    time.Now(),
		timer:    time.NewTimer(time.Hour),
		kick:     make(chan struct{}, 1),
		acked:    make(chan struct{}, 1),
		ctlTurn:  make(chan struct{}, 1),
		closing:  make(chan struct{}),
		recvDone: make(chan struct{}),
	}
	w.timer.Stop()
	w.op.ring = make([]fragment, cfg.Window)
	w.cwnd = float64(cfg.Window)
	w.srtt = int64(cfg.Timeout) / 4
	w.st.cwndMilli.Store(uint64(cfg.Window) * 1000)
	w.st.minCwndMilli.Store(uint64(cfg.Window) * 1000)
	if cfg.BusyPoll > 0 {
		if err := bc.setBusyPoll(cfg.BusyPoll); err != nil {
			bc.close()
			return nil, fmt.Errorf("worker %d of job %d: %w", cfg.WorkerID, cfg.JobID, err)
		}
	}
	if !cfg.NoGSO {
		bc.enableGSO()
	}
	if cfg.AFXDP {
		if err := w.startAFXDP(); err != nil {
			if !cfg.AFXDPFallback {
				bc.close()
				return nil, fmt.Errorf("worker %d of job %d: %w", cfg.WorkerID, cfg.JobID, err)
			}
			w.xskFallb = err
		}
	}
	go w.receive(w.bc, w.recvDone, &w.recvErr)
	if w.xsk != nil {
		go w.receive(w.xsk, w.xskDone, &w.xskErr)
	}
	return w, nil
}

// LocalAddr is the address the worker is bound to: where the switch must send its results.
func (w *Worker) LocalAddr() netip.AddrPort { return w.bc.localAddr() }

// Config returns the worker's configuration with defaults applied.
func (w *Worker) Config() WorkerConfig { return w.cfg }

// Stats returns the worker's cumulative counters.
func (w *Worker) Stats() WorkerStats {
	s := &w.st
	return WorkerStats{
		DataSent: s.dataSent.Load(), Retransmits: s.retransmits.Load(), FastResends: s.fastResends.Load(),
		CacheRequests: s.cacheReqs.Load(), CacheResults: s.cacheResults.Load(), CacheMisses: s.cacheMisses.Load(),
		CacheLatency: time.Duration(s.cacheLatNs.Load() / max(s.cacheLatN.Load(), 1)),
		ECNResults:   s.ecnResults.Load(), WindowCuts: s.windowCuts.Load(),
		Rehashes:         s.rehashes.Load(),
		CongestionWindow: float64(s.cwndMilli.Load()) / 1000, MinWindow: float64(s.minCwndMilli.Load()) / 1000,
		ResultsReceived: s.results.Load(), EarlyResults: s.early.Load(), DuplicateResults: s.duplicates.Load(),
		ShadowResults: s.shadow.Load(), ResultsFromPS: s.fromPS.Load(), Collisions: s.collisions.Load(),
		OverflowRepairs: s.repairs.Load(), Malformed: s.malformed.Load(), SendErrors: s.sendErrors.Load(),
		GSOMessages: w.bc.gsoMsgs.Load(),
		Foreign:     s.foreign.Load(), Unauthenticated: s.unauth.Load(), Replayed: s.replayed.Load(), ControlAcks: s.ctlAcks.Load(),
		HelpAnswers: s.helpAnswers.Load(), HelpUnknown: s.helpUnknown.Load(),
	}
}

// GSO reports whether the worker sends its DATA packets with UDP GSO, and, if it turned GSO off
// after the kernel refused it (no UDP_SEGMENT, or a route or device that cannot segment), why.
// Both are false/nil with WorkerConfig.NoGSO.
func (w *Worker) GSO() (on bool, fallback error) {
	on, _, fallback = w.bc.gsoState()
	return on, fallback
}

// Close closes the socket and stops the receive goroutine. A running AllReduce fails with
// ErrClosed. Closing twice returns ErrClosed.
func (w *Worker) Close() error {
	err := ErrClosed
	w.closeOnce.Do(func() {
		close(w.closing)
		err = w.bc.close()
		<-w.recvDone
		if w.xsk != nil {
			w.stopAFXDP()
		}
	})
	return err
}

// AllReduce replaces data, in place, by the element-wise sum of the same-length tensors that the
// job's NumWorkers workers pass to their own AllReduce. All workers must call AllReduce with equal
// lengths in the same order: each call takes the next ceil(len/K) sequence numbers of the job
// (K = ValuesPerPacket values per fragment), so that is how fragments of one sum find each other.
// An empty tensor is a no-op.
//
// Fixed-point sums are within the bound documented in fixed.go; fragments that saturate are
// repaired in float32 by the PS and come out as the correctly rounded float32 of the exact sum.
//
// On error (ctx done, ErrTimeout, ErrClosed) data is partly summed and the job's sequence has moved
// past this call anyway, so the workers stay in step only if they all fail it; recovering a job
// is the caller's business (a new job id is simplest). ErrHalted is the exception: members may
// fail different calls (one whose last result came after the halt fails the call that the others
// completed), and Resume puts every member at the halt's resume point, so they go on in step.
func (w *Worker) AllReduce(ctx context.Context, data []float32) error {
	return w.allReduce(ctx, data, false, nil)
}

// allReduce is AllReduce; with listen it sends no data and only takes the results of its
// fragments (a round of an Async that has no gradient for it), and bitmaps, if not nil, gets
// each fragment's contributors.
func (w *Worker) allReduce(ctx context.Context, data []float32, listen bool, bitmaps []uint32) error {
	if len(data) == 0 {
		return nil
	}
	if !w.opMu.TryLock() {
		return fmt.Errorf("%w: AllReduce already running on worker %d", ErrBusy, w.cfg.WorkerID)
	}
	defer w.opMu.Unlock()
	select {
	case <-w.closing:
		return fmt.Errorf("allreduce: %w", ErrClosed)
	default:
	}
	k := w.cfg.ValuesPerPacket
	nfrags := (len(data) + k - 1) / k
	if nfrags > maxCallFragments {
		// The wire's 32-bit seq must tell this call's fragments apart, and a halt's resume
		// point must lie past every member's sequence (haltGap).
		return fmt.Errorf("%w: tensor of %d values: split it into tensors of at most %d values", ErrConfig,
			len(data), int64(maxCallFragments)*int64(k))
	}
	w.mu.Lock()
	if w.halted.Load() {
		// Takes no sequence numbers: Resume moves every member to the halt's resume point.
		w.mu.Unlock()
		return fmt.Errorf("allreduce: %w", ErrHalted)
	}
	base := w.nextSeq
	w.nextSeq += uint64(nfrags)
	w.mu.Unlock()
	w.lastSendErr = nil
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("allreduce of %d values: %w", len(data), err)
	}

	w.mu.Lock()
	w.op.active, w.op.data, w.op.seqBase = true, data, base
	w.op.nfrags, w.op.low, w.op.next = nfrags, 0, 0
	w.op.listen, w.op.bitmaps = listen, bitmaps
	if w.early != nil {
		w.dropEarly(base)
	}
	w.ackedTo = 0
	clear(w.cacheAt)
	w.mu.Unlock()
	defer func() {
		if r := recover(); r != nil {
			panic(r) // surface it: mu may be held by the panicking step, so taking it would hang
		}
		// After this, the receive goroutine no longer touches data.
		w.mu.Lock()
		w.op.active, w.op.data, w.op.bitmaps = false, nil, nil
		w.earlyLow = base + uint64(nfrags)
		w.mu.Unlock()
		w.timer.Stop()
	}()

	for {
		if w.halted.Load() {
			return fmt.Errorf("allreduce of %d values: %w", len(data), ErrHalted)
		}
		wait, err := w.step()
		if err != nil || wait < 0 {
			return err
		}
		w.timer.Reset(time.Duration(wait))
		select {
		case <-w.kick:
		case <-w.timer.C:
		case <-ctx.Done():
			return fmt.Errorf("allreduce of %d values: %w", len(data), ctx.Err())
		case <-w.closing:
			return fmt.Errorf("allreduce: %w", ErrClosed)
		case <-w.recvDone:
			return fmt.Errorf("allreduce: receive: %w", w.recvErr)
		case <-w.xskDone: // nil without AF_XDP: never ready
			return fmt.Errorf("allreduce: AF_XDP receive: %w", w.xskErr)
		}
	}
}

// step sends whatever is due and returns how long to wait (ns) before the next deadline, or -1
// when every fragment has its result.
func (w *Worker) step() (wait int64, err error) {
	w.mu.Lock()
	op := &w.op
	now := int64(time.Since(w.epoch))
	win := len(op.ring)
	for op.low < op.next && op.ring[op.low%win].state == fragDone {
		op.low++
	}
	if op.low == op.nfrags {
		// Every result is in: acknowledge them all to the switch agent's retransmit cache.
		var ack []byte
		var to netip.AddrPort
		if w.ctrlSet && w.ackedTo < op.nfrags {
			ack, to = w.encodeAck(uint32(op.seqBase+uint64(op.nfrags))), w.ctrl
			w.ackedTo = op.nfrags
		}
		w.mu.Unlock()
		if ack != nil {
			_, _ = w.bc.conn.WriteToUDPAddrPort(ack, to) // best effort: the cache also ages out
		}
		return -1, nil
	}
	earliest := int64(math.MaxInt64)
	var queued, resent, ctlQueued uint64
	// Acknowledge results in steps of half a window, so the cache can let go of them early.
	if w.ctrlSet && op.low-w.ackedTo >= max(win/2, 1) {
		if ack := w.encodeAck(uint32(op.seqBase + uint64(op.low))); ack != nil {
			w.bc.queue(&w.ctrlRaw, ack, nil)
			ctlQueued++
		}
		w.ackedTo = op.low
	}
	for i := op.low; i < op.next; i++ {
		f := &op.ring[i%win]
		switch {
		case f.state == fragDone:
			continue
		case f.repairQueued && op.listen:
			// Not a contributor: the contributors' float32 repair completes it at the PS.
			f.repairQueued = false
			f.retries = 0
			f.deadline = now + int64(w.cfg.Timeout)
		case f.repairQueued:
			f.repairQueued = false
			w.encode(f, wire.EncFloat32, wire.FlagOverflow)
			f.retries = 0
			f.deadline = now + int64(w.cfg.Timeout)
			w.bc.queue(&w.psAddr, f.pkt[:f.plen], nil)
			queued++
		case now >= f.deadline:
			if f.retries >= w.cfg.MaxRetries {
				seq := op.seqBase + uint64(i)
				err := w.lastSendErr
				w.mu.Unlock()
				w.bc.sq = 0 // nothing queued goes out: the operation is over
				if err != nil {
					return 0, fmt.Errorf("%w: fragment %d (seq %d) of job %d got no result after %d resends (last send error: %w)",
						ErrTimeout, i, uint32(seq), w.cfg.JobID, f.retries, err)
				}
				return 0, fmt.Errorf("%w: fragment %d (seq %d) of job %d got no result after %d resends",
					ErrTimeout, i, uint32(seq), w.cfg.JobID, f.retries)
			}
			f.later = 0
			if f.fast {
				f.fast = false
				w.st.fastResends.Add(1)
			}
			if w.ctrlSet && !f.askedCache && f.state == fragFixed {
				// Libra: a result lost on the way to this worker alone is in the switch CPU's
				// cache; asking it costs no partner anything. So a joined worker asks at half
				// its timeout (or on three later results), and resends its data, which would
				// make the switch flush the slot to the PS, only at the full timeout. A miss
				// (MSG_ACK) means the sum is not complete: the data timer stays.
				f.askedCache = true
				seq := uint32(op.seqBase + uint64(i))
				wire.EncodeHeader(f.ctl[:], &wire.Header{Version: wire.Version, Type: wire.MsgRetransmit,
					JobId: w.cfg.JobID, Seq: seq, AggIndex: w.aggIndex(op.seqBase + uint64(i)), WorkerId: w.cfg.WorkerID, Bitmap0: 1 << w.cfg.WorkerID})
				if w.cacheAt == nil {
					w.cacheAt = map[uint32]int64{}
				}
				w.cacheAt[seq] = now
				f.deadline = now + int64(w.cfg.Timeout)/2
				if req := w.sealCtl(f.ctl[:]); req != nil {
					w.bc.queue(&w.ctrlRaw, req, nil)
					ctlQueued++
					w.st.cacheReqs.Add(1)
				}
				earliest = min(earliest, f.deadline)
				continue
			}
			if w.ctrlSet && f.askedCache && f.state == fragFixed && i == op.low {
				// The Help request went unanswered (its answer, or a member's, was lost, or no
				// member had the result yet): ask again with every resend, which alone can
				// never complete a sum the switch lost after the other members got it. Only
				// for the oldest fragment: the others wait behind it (a worker stalled behind
				// a partner asks for sums nobody has, and each miss costs the agent a request
				// to every member), and each becomes the oldest in turn.
				if req := w.sealCtl(f.ctl[:]); req != nil {
					w.bc.queue(&w.ctrlRaw, req, nil)
					ctlQueued++
					w.st.cacheReqs.Add(1)
				}
			}
			f.retries++
			if op.listen {
				// No data to resend: ask the retransmit cache again at the next deadline.
				f.askedCache = false
				f.deadline = now + int64(w.cfg.Timeout)<<min(f.retries, maxBackoffShift)
				earliest = min(earliest, f.deadline)
				continue
			}
			f.sentAt = now
			flags := binary.LittleEndian.Uint16(f.pkt[wire.OffFlags:])
			binary.LittleEndian.PutUint16(f.pkt[wire.OffFlags:], flags|wire.FlagResend)
			f.deadline = now + int64(w.cfg.Timeout)<<min(f.retries, maxBackoffShift)
			w.bc.queue(&w.psAddr, f.pkt[:f.plen], nil)
			queued++
			resent++
		}
		earliest = min(earliest, f.deadline)
	}
	limit := win
	if !w.cfg.NoCongestionControl {
		limit = max(1, min(win, int(w.cwnd)))
	}
	for op.next < op.nfrags && op.next < op.low+limit {
		f := &op.ring[op.next%win]
		f.idx, f.state, f.repairQueued, f.retries, f.later, f.askedCache = op.next, fragFixed, false, 0, 0, false
		if w.early != nil && w.takeEarly(op, now) {
			earliest = now // its result came before it was sent: nothing to send; step again
			continue
		}
		if op.listen {
			f.sentAt = now
			f.deadline = now + int64(w.cfg.Timeout)
			earliest = min(earliest, f.deadline)
			op.next++
			continue
		}
		w.encode(f, wire.EncFixed32, 0)
		f.sentAt = now
		f.deadline = now + int64(w.cfg.Timeout)
		if w.ctrlSet {
			f.deadline = now + int64(w.cfg.Timeout)/2 // first ask the retransmit cache
		}
		earliest = min(earliest, f.deadline)
		w.bc.queue(&w.psAddr, f.pkt[:f.plen], nil)
		queued++
		op.next++
	}
	w.mu.Unlock()

	// Send outside the lock: the receive goroutine keeps taking results meanwhile. The queued
	// buffers stay put: a ring entry is reused only for a fragment past low+Window, which a later
	// step queues after this flush.
	if queued > 0 || ctlQueued > 0 {
		w.st.dataSent.Add(queued)
		w.st.retransmits.Add(resent)
		refused, lastErr, err := w.bc.flush()
		if refused > 0 {
			w.st.sendErrors.Add(uint64(refused))
			w.lastSendErr = lastErr
		}
		if err != nil {
			if isClosed(err) {
				return 0, fmt.Errorf("allreduce: %w", ErrClosed)
			}
			return 0, fmt.Errorf("allreduce: send: %w", err)
		}
	}
	return max(earliest-int64(time.Since(w.epoch)), 0), nil
}

// aggIndex is fragment seq's slot: the job's rotation, or the PS's rehash of its offset. Called
// with mu held.
func (w *Worker) aggIndex(seq uint64) uint32 {
	if r, ok := w.remap[uint32(seq%uint64(2*w.cfg.Window))]; ok && seq > r.from {
		return r.idx
	}
	return aggIndexFrom(w.slotBase, seq, w.cfg.Window, w.cfg.PoolSize)
}

// adjustWindow runs ATP's AIMD on a result: halve on F_ECN (once per window of data: ECN on
// results of fragments sent before the last cut is the same congestion), else grow by 1/cwnd
// (one fragment per window of results). Called with mu held.
func (w *Worker) adjustWindow(ecn bool, seq uint32) {
	if ecn {
		w.st.ecnResults.Add(1)
		if !w.cutDone || int32(seq-w.cutSeq) >= 0 {
			w.cwnd = max(1, w.cwnd/2)
			w.cutSeq = uint32(w.op.seqBase + uint64(w.op.next))
			w.cutDone = true
			w.st.windowCuts.Add(1)
		}
	} else {
		w.cwnd = min(float64(w.cfg.Window), w.cwnd+1/w.cwnd)
	}
	m := uint64(w.cwnd * 1000)
	w.st.cwndMilli.Store(m)
	if m < w.st.minCwndMilli.Load() {
		w.st.minCwndMilli.Store(m)
	}
}

// encodeAck writes the cumulative MSG_ACK "every result before seq upTo is here", sealed with
// the job key, into ackPkt (nil without a valid key). Called with mu held; the buffer stays put
// until the next ack, which a later step queues only after this one's flush.
func (w *Worker) encodeAck(upTo uint32) []byte {
	wire.EncodeHeader(w.ackPkt[:], &wire.Header{Version: wire.Version, Type: wire.MsgAck, JobId: w.cfg.JobID, Seq: upTo,
		WorkerId: w.cfg.WorkerID, Bitmap0: 1 << w.cfg.WorkerID})
	return w.sealCtl(w.ackPkt[:])
}

// encode writes fragment f's DATA packet from the (still original) tensor values. Called with mu
// held: the receive goroutine writes results into the same tensor.
func (w *Worker) encode(f *fragment, enc uint8, flags uint16) {
	op := &w.op
	k := w.cfg.ValuesPerPacket
	lo := f.idx * k
	vals := op.data[lo:min(lo+k, len(op.data))]
	out := f.pkt[wire.HdrSize : wire.HdrSize+4*len(vals)]
	if enc == wire.EncFixed32 {
		if !quantizeTo(out, vals, w.cfg.ScaleLog2) {
			flags |= wire.FlagOverflow // the sum cannot be right in fixed point: ask for the float repair
		}
	} else {
		for j, x := range vals {
			binary.LittleEndian.PutUint32(out[4*j:], math.Float32bits(x))
		}
	}
	seq := op.seqBase + uint64(f.idx)
	h := wire.Header{
		Version:   wire.Version,
		Type:      wire.MsgData,
		Encoding:  enc,
		ScaleLog2: w.cfg.ScaleLog2,
		Flags:     flags,
		Count:     uint16(len(vals)),
		JobId:     w.cfg.JobID,
		Seq:       uint32(seq),
		AggIndex:  w.aggIndex(seq),
		Bitmap0:   1 << w.cfg.WorkerID,
		Bitmap1:   uint32(w.cfg.Window), // level 0: tells the PS the job's rotation (rehash)
		FanIn0:    w.cfg.NumWorkers,
		WorkerId:  w.cfg.WorkerID,
	}
	wire.EncodeHeader(f.pkt[:], &h)
	f.plen = wire.HdrSize + 4*len(vals)
}

// recvSource is where a worker's receive goroutine takes datagrams from, in batches: its UDP
// socket (batchConn), and with WorkerConfig.AFXDP its AF_XDP socket (xskConn).
type recvSource interface {
	recv() (int, error)
	datagram(i int) (from *unix.RawSockaddrInet4, b []byte, err error)
}

// receive is a receive goroutine of the worker (one per recvSource): it takes results in batches
// and writes them straight into the running AllReduce's tensor. When it stops it sets *errp and
// closes done.
func (w *Worker) receive(src recvSource, done chan struct{}, errp *error) {
	defer close(done)
	for {
		n, err := src.recv()
		if err != nil {
			if isClosed(err) {
				*errp = ErrClosed
				return
			}
			if transientRecv(err) {
				continue
			}
			*errp = err
			return
		}
		w.mu.Lock()
		for i := 0; i < n; i++ {
			w.handleResult(src.datagram(i))
		}
		w.mu.Unlock()
		select { // wake AllReduce; a pending kick already will
		case w.kick <- struct{}{}:
		default:
		}
	}
}

// handleResult applies a datagram of the last receive batch: b from `from`, or the error reading
// it. Called with mu held.
//
// What is accepted depends on where it comes from, checked first and cheaply (the source
// address recvmmsg wrote next to each datagram): results from the PS's address and port, or
// after a Join from the switch agent's (its retransmit cache); acknowledgements only from the
// switch address the worker sends control messages to, and only authenticated (handleAck).
// Anything else is counted Foreign and not even parsed.
func (w *Worker) handleResult(from *unix.RawSockaddrInet4, b []byte, err error) {
	if err == errFrame {
		w.st.malformed.Add(1) // not even a datagram to this worker: no source to check
		return
	}
	fromPS := sameSource(from, &w.psAddr)
	fromAgent := (w.ctrlSet && sameSource(from, &w.ctrlRaw)) || (w.ackPending && sameSource(from, &w.ackFrom))
	if !fromPS && !fromAgent {
		w.st.foreign.Add(1)
		return
	}
	if err != nil {
		w.st.malformed.Add(1)
		return
	}
	h, vals, err := wire.ParsePacket(b)
	if err == nil && h.Type == wire.MsgAck {
		w.handleAck(b, &h, from)
		return
	}
	if err == nil && h.Type == wire.MsgHalt {
		w.handleHalt(b, &h, from)
		return
	}
	if err == nil && h.Type == wire.MsgHelp {
		w.handleHelp(b, &h, from)
		return
	}
	if err != nil || h.Type != wire.MsgResult || h.JobId != w.cfg.JobID {
		w.st.malformed.Add(1)
		return
	}
	if !fromPS && !(w.ctrlSet && sameSource(from, &w.ctrlRaw)) {
		w.st.foreign.Add(1) // a result from a switch this worker has not (yet) joined
		return
	}
	op := &w.op
	off := int64(h.Seq - uint32(op.seqBase)) // serial arithmetic: the op's fragments are 0..nfrags-1
	if !op.active || off < int64(op.low) || off >= int64(op.next) {
		if w.early != nil && w.keepEarly(&h, vals) {
			return
		}
		w.st.duplicates.Add(1)
		return
	}
	w.applyResult(off, &h, vals)
}

// applyResult takes the result h (values vals) of the running operation's fragment off, sent and
// without its result yet. Called with mu held.
func (w *Worker) applyResult(off int64, h *wire.Header, vals []byte) {
	op := &w.op
	f := &op.ring[int(off)%len(op.ring)]
	if f.idx != int(off) || f.state == fragDone {
		w.st.duplicates.Add(1)
		return
	}
	k := w.cfg.ValuesPerPacket
	lo := f.idx * k
	dst := op.data[lo:min(lo+k, len(op.data))]
	if int(h.Count) != len(dst) || h.AggIndex != w.aggIndex(op.seqBase+uint64(off)) {
		w.st.malformed.Add(1)
		return
	}
	switch h.Encoding {
	case wire.EncFixed32:
		if f.state == fragRepair {
			w.st.duplicates.Add(1) // another copy of the saturated sum: the repair is under way
			return
		}
		if h.Flags&wire.FlagOverflow != 0 {
			// ATP's overflow repair: the sum saturated somewhere, so resend the original floats
			// to the PS, which sums them exactly. Every worker got this same result, so every
			// worker repairs, and the float sum completes.
			f.state, f.repairQueued = fragRepair, true
			w.st.repairs.Add(1)
			return
		}
		dequantizeFrom(dst, vals, h.ScaleLog2)
	case wire.EncFloat32:
		for j := range dst {
			dst[j] = math.Float32frombits(binary.LittleEndian.Uint32(vals[4*j:]))
		}
	default:
		w.st.malformed.Add(1)
		return
	}
	if w.kept != nil {
		w.keep(h, vals)
	}
	if f.retries == 0 && !f.askedCache && f.state == fragFixed {
		if rtt := int64(time.Since(w.epoch)) - f.sentAt; rtt > 0 {
			w.srtt += (rtt - w.srtt) / 8
		}
	}
	f.state, f.repairQueued = fragDone, false
	if op.bitmaps != nil {
		op.bitmaps[off], _ = h.LevelBits()
	}
	w.st.results.Add(1)
	if !w.cfg.NoCongestionControl {
		w.adjustWindow(h.Flags&wire.FlagECN != 0, h.Seq)
	}
	// ATP's loss detection: results arrive in order unless something was lost, so a fragment
	// that FastLossResults later results have overtaken is resent now rather than at its
	// timeout (the resend flushes a half-filled slot to the PS, or gets the shadow copy). With
	// several workers, results are reordered without any loss (a fragment completes when its
	// slowest contribution arrives, and the slowest worker differs per fragment), and a
	// spurious resend flushes a slot that was about to complete; so a fragment must also have
	// waited a smoothed round trip (results of fragments sent once, as TCP's SRTT).
	win := len(op.ring)
	var now int64
	for i := op.low; i < int(off); i++ {
		g := &op.ring[i%win]
		if g.idx != i || g.state != fragFixed || g.deadline == 0 {
			continue
		}
		if g.later++; g.later >= FastLossResults {
			if now == 0 {
				now = int64(time.Since(w.epoch))
			}
			if now-g.sentAt >= w.srtt {
				g.deadline = 0 // due now: the next step resends it (counted there)
				g.fast = true
			}
		}
	}
	if h.Flags&wire.FlagShadow != 0 {
		w.st.shadow.Add(1)
	}
	if h.Flags&wire.FlagCached != 0 {
		w.st.cacheResults.Add(1)
		if at, ok := w.cacheAt[h.Seq]; ok {
			w.st.cacheLatNs.Add(uint64(int64(time.Since(w.epoch)) - at))
			w.st.cacheLatN.Add(1)
			delete(w.cacheAt, h.Seq)
		}
	} else if len(w.cacheAt) > 0 {
		delete(w.cacheAt, h.Seq) // the sum came the usual way after all
	}
	if h.Flags&wire.FlagFromSwitch == 0 {
		w.st.fromPS.Add(1)
	}
	if h.Flags&wire.FlagCollision != 0 {
		w.st.collisions.Add(1)
	}
	if h.Flags&wire.FlagRehash != 0 && h.Flags&wire.FlagLevel1 == 0 && h.Bitmap1 < w.cfg.PoolSize {
		// ATP: this offset's later fragments use the PS's new slot. Every worker gets this
		// result before it sends the offset's next fragment (seq + 2W), so they move together.
		seq := op.seqBase + uint64(off)
		o := uint32(seq % uint64(2*w.cfg.Window))
		if r, ok := w.remap[o]; !ok || seq > r.from {
			if w.remap == nil {
				w.remap = map[uint32]slotRemap{}
			}
			w.remap[o] = slotRemap{idx: h.Bitmap1, from: seq}
			w.st.rehashes.Add(1)
		}
	}
}
