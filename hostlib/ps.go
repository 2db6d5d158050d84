package hostlib

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"math/bits"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/bpf"
)

// PS defaults.
const (
	DefaultResultTTL  = 5 * time.Second
	DefaultStaleAfter = 30 * time.Second
	DefaultMaxEntries = 16384
)

// PSConfig configures a parameter server. Zero fields take their defaults (WithDefaults).
type PSConfig struct {
	Listen netip.AddrPort // PS address; its port is the agg port (port 0: bpf.DefaultPort)
	// Switch is where results go: the switch's IP on the PS's subnet and the agg port (port 0:
	// Listen's port). The switch broadcasts them to the job's workers.
	Switch netip.AddrPort
	// ResultTTL is how long a completed result is kept to answer retransmissions (default 5s).
	ResultTTL time.Duration
	// StaleAfter drops an incomplete aggregation untouched this long (default 30s): its workers
	// gave up or finished through the switch.
	StaleAfter time.Duration
	// SocketBuffer sizes SO_RCVBUF/SO_SNDBUF in bytes (default 8 MiB).
	SocketBuffer int
	// MaxEntries bounds the aggregations and results held at once (default 16384; about 1.5 KB
	// per result, 3-16 KB per aggregation in progress). When full, the oldest results go first;
	// if every entry is still aggregating, new fragments are dropped (PSStats.Dropped) and
	// their workers retransmit.
	MaxEntries int
}

// WithDefaults returns c with zero fields set to their defaults and addresses unmapped to IPv4.
func (c PSConfig) WithDefaults() PSConfig {
	port := c.Listen.Port()
	if port == 0 {
		port = bpf.DefaultPort
	}
	c.Listen = netip.AddrPortFrom(c.Listen.Addr().Unmap(), port)
	sport := c.Switch.Port()
	if sport == 0 {
		sport = port
	}
	c.Switch = netip.AddrPortFrom(c.Switch.Addr().Unmap(), sport)
	if c.ResultTTL == 0 {
		c.ResultTTL = DefaultResultTTL
	}
	if c.StaleAfter == 0 {
		c.StaleAfter = DefaultStaleAfter
	}
	if c.SocketBuffer == 0 {
		c.SocketBuffer = DefaultSocketBuffer
	}
	if c.MaxEntries == 0 {
		c.MaxEntries = DefaultMaxEntries
	}
	return c
}

// Validate reports what to change in a configuration that cannot work. Call it on WithDefaults'
// result (NewPS does).
func (c PSConfig) Validate() error {
	switch {
	case !c.Listen.Addr().Is4():
		return fmt.Errorf("%w: Listen %v: use an IPv4 address (xdpagg is UDP/IPv4)", ErrConfig, c.Listen)
	case !c.Switch.Addr().Is4() || c.Switch.Addr().IsUnspecified():
		return fmt.Errorf("%w: Switch %v: use the switch's IPv4 address on the PS's subnet", ErrConfig, c.Switch)
	case c.ResultTTL < time.Millisecond:
		return fmt.Errorf("%w: ResultTTL %v: use at least 1ms (longer than the workers' retransmit timeout)", ErrConfig, c.ResultTTL)
	case c.StaleAfter < time.Millisecond:
		return fmt.Errorf("%w: StaleAfter %v: use at least 1ms", ErrConfig, c.StaleAfter)
	case c.SocketBuffer < 0 || c.SocketBuffer > math.MaxInt32:
		return fmt.Errorf("%w: SocketBuffer %d: use 0..%d bytes", ErrConfig, c.SocketBuffer, math.MaxInt32)
	case c.MaxEntries < 1:
		return fmt.Errorf("%w: MaxEntries %d: use at least 1", ErrConfig, c.MaxEntries)
	}
	return nil
}

// PSStats are a PS's cumulative counters. Every received datagram counts in Received and in
// exactly one of Aggregated, Duplicates, Malformed and Dropped.
type PSStats struct {
	Received      uint64 // datagrams received
	Aggregated    uint64 // data packets summed into an aggregation
	Duplicates    uint64 // data packets whose contributors were already summed
	Completed     uint64 // sums completed and sent to the switch
	ResultsResent uint64 // of Duplicates: completed results re-sent to the packet's sender
	Malformed     uint64 // not a valid DATA packet, or disagreeing with its aggregation (count, fan-in, scale)
	Overflows     uint64 // of Completed: fixed-point sums sent with F_OVERFLOW for float repair
	Stale         uint64 // incomplete aggregations dropped after StaleAfter
	Dropped       uint64 // data packets dropped because MaxEntries aggregations were in progress
}

type psCounters struct {
	received, aggregated, duplicates, completed, resent, malformed, overflows, stale, dropped atomic.Uint64
}

// PS is the parameter server: it sums the fragments the switch could not (collisions, float32
// repairs, resends without a slot) and answers retransmissions of what it completed.
type PS struct {
	cfg      PSConfig
	bc       *batchConn
	switchSa unix.RawSockaddrInet4
	epoch    time.Time
	st       psCounters

	serving   atomic.Bool
	stop      atomic.Bool
	closeOnce sync.Once
	closed    atomic.Bool

	// Owned by Serve's goroutine.
	entries  map[psKey]*psEntry
	done     []*psEntry // completed entries, oldest first, from doneHead on: they expire in this order
	doneHead int
	freeE    []*psEntry
	freeFix  []*fixedAcc
	freeFlt  []*floatAcc
	shadow   [recvBatch][bpf.HdrSize]byte // per-message headers of re-sent results (F_SHADOW)
	nshadow  int
	batch    uint64 // number of the send batch being queued
}

// Aggregations are keyed by (job, seq, encoding): a fragment's fixed-point sum and its float32
// repair are separate sums, and the fixed one's result must keep answering late retransmissions.
type psKey struct {
	job, seq uint32
	enc      uint8
}

type psEntry struct {
	key      psKey
	tmpl     bpf.XdpaggHdr // first contribution's header: the result's header template
	bitmap   uint32
	fanIn    uint8
	level1   bool
	flags    uint16 // F_ECN | F_OVERFLOW | F_COLLISION seen in contributions
	complete bool
	touched  int64  // ns since epoch: last contribution, or completion
	queuedIn uint64 // send batch (PS.batch) that last queued this entry's result
	fix      *fixedAcc
	flt      *floatAcc
	plen     int
	pkt      [MaxPacket]byte // the result, once complete
}

type fixedAcc [bpf.MaxValues]int64

type floatAcc struct {
	sum [bpf.MaxValues]exactSum
	sp  [bpf.MaxValues]uint8
}

// NewPS validates cfg and binds the PS's socket now, in the calling thread's network namespace.
// Serve processes packets.
func NewPS(cfg PSConfig) (*PS, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	bc, err := listenBatch(cfg.Listen, cfg.SocketBuffer, recvBatch, recvBatch)
	if err != nil {
		return nil, fmt.Errorf("parameter server: %w", err)
	}
	return &PS{
		cfg:      cfg,
		bc:       bc,
		switchSa: sockaddr4(cfg.Switch),
		epoch:    time.Now(),
		entries:  make(map[psKey]*psEntry),
	}, nil
}

// LocalAddr is the address the PS is bound to.
func (p *PS) LocalAddr() netip.AddrPort { return p.bc.localAddr() }

// Config returns the PS's configuration with defaults applied.
func (p *PS) Config() PSConfig { return p.cfg }

// Stats returns the PS's cumulative counters.
func (p *PS) Stats() PSStats {
	s := &p.st
	return PSStats{
		Received: s.received.Load(), Aggregated: s.aggregated.Load(), Duplicates: s.duplicates.Load(),
		Completed: s.completed.Load(), ResultsResent: s.resent.Load(), Malformed: s.malformed.Load(),
		Overflows: s.overflows.Load(), Stale: s.stale.Load(), Dropped: s.dropped.Load(),
	}
}

// Close closes the socket; a running Serve returns ErrClosed. Closing twice returns ErrClosed.
func (p *PS) Close() error {
	err := ErrClosed
	p.closeOnce.Do(func() {
		p.closed.Store(true)
		err = p.bc.close()
	})
	return err
}

// Serve receives and sums data packets until ctx is done (it returns ctx's error, wrapped) or
// the PS is closed (ErrClosed). Only one Serve may run at a time (ErrBusy).
func (p *PS) Serve(ctx context.Context) error {
	if !p.serving.CompareAndSwap(false, true) {
		return fmt.Errorf("%w: the parameter server is already serving", ErrBusy)
	}
	defer p.serving.Store(false)
	if p.closed.Load() {
		return fmt.Errorf("serve: %w", ErrClosed)
	}
	p.stop.Store(false)
	// Cancellation interrupts the blocked receive through its deadline, and the stop flag tells
	// that apart from the eviction tick (the loop re-arms the deadline, then checks the flag).
	stopWatch := context.AfterFunc(ctx, func() {
		p.stop.Store(true)
		_ = p.bc.conn.SetReadDeadline(time.Unix(1, 0))
	})
	defer stopWatch()

	tick := min(p.cfg.ResultTTL, p.cfg.StaleAfter) / 4
	tick = min(max(tick, time.Millisecond), time.Second)
	nextTick := time.Now().Add(tick)
	if err := p.bc.conn.SetReadDeadline(nextTick); err != nil {
		return p.serveErr(ctx, err)
	}
	for {
		if p.stop.Load() {
			return fmt.Errorf("serve: %w", ctx.Err())
		}
		n, err := p.bc.recv()
		if err != nil && !isTimeout(err) {
			if transientRecv(err) {
				continue
			}
			return p.serveErr(ctx, err)
		}
		now := time.Now()
		nowNs := int64(now.Sub(p.epoch))
		for i := 0; i < n; i++ {
			p.handle(i, nowNs)
		}
		if err := p.flush(); err != nil {
			return p.serveErr(ctx, err)
		}
		if !now.Before(nextTick) {
			p.evict(nowNs)
			nextTick = now.Add(tick)
			if err := p.bc.conn.SetReadDeadline(nextTick); err != nil {
				return p.serveErr(ctx, err)
			}
		}
	}
}

func (p *PS) serveErr(ctx context.Context, err error) error {
	switch {
	case p.stop.Load() && ctx.Err() != nil:
		return fmt.Errorf("serve: %w", ctx.Err())
	case isClosed(err) || p.closed.Load():
		return fmt.Errorf("serve: %w", ErrClosed)
	}
	return fmt.Errorf("serve: %w", err)
}

// flush sends the results queued by handle.
func (p *PS) flush() error {
	p.nshadow = 0
	p.batch++
	if p.bc.sq == 0 {
		return nil
	}
	// A result the kernel refuses is like one lost on the wire: the workers retransmit and get
	// it from the stored copy.
	_, _, err := p.bc.flush()
	return err
}

// handle processes datagram i of the last receive batch.
func (p *PS) handle(i int, now int64) {
	p.st.received.Add(1)
	b, err := p.bc.rpkt(i)
	if err != nil {
		p.st.malformed.Add(1)
		return
	}
	h, vals, err := ParsePacket(b)
	if err != nil || h.Type != msgData || (h.Encoding != encFixed32 && h.Encoding != encFloat32) {
		p.st.malformed.Add(1)
		return
	}
	bm, fan := levelBits(&h)
	level1 := h.Flags&fLevel1 != 0
	key := psKey{job: h.JobId, seq: h.Seq, enc: h.Encoding}
	e := p.entries[key]
	if e == nil {
		if len(p.entries) >= p.cfg.MaxEntries && !p.makeRoom() {
			p.st.dropped.Add(1)
			return
		}
		e = p.newEntry(key, &h, now)
	} else if e.tmpl.Count != h.Count || e.fanIn != fan || e.level1 != level1 ||
		(h.Encoding == encFixed32 && e.tmpl.ScaleLog2 != h.ScaleLog2) {
		p.st.malformed.Add(1) // cannot be summed with what is there
		return
	}

	if e.bitmap&bm != 0 {
		// Already summed (a retransmission, or a partial sum overlapping one we have): it adds
		// nothing. If the sum is complete the sender evidently missed it: answer it alone,
		// straight to its address, like the switch's shadow copy.
		p.st.duplicates.Add(1)
		if e.complete {
			p.resend(e, p.bc.rfrom(i))
		}
		return
	}

	n := int(h.Count)
	if e.fix != nil {
		for j := 0; j < n; j++ {
			e.fix[j] += int64(int32(binary.LittleEndian.Uint32(vals[4*j:])))
		}
	} else {
		for j := 0; j < n; j++ {
			e.flt.sum[j].add(binary.LittleEndian.Uint32(vals[4*j:]), &e.flt.sp[j])
		}
	}
	e.bitmap |= bm
	e.flags |= h.Flags & (fECN | fOverflow | fCollision)
	e.touched = now
	p.st.aggregated.Add(1)
	if bits.OnesCount32(e.bitmap) == int(fan) {
		p.complete(e, now)
	}
}

func (p *PS) newEntry(key psKey, h *bpf.XdpaggHdr, now int64) *psEntry {
	var e *psEntry
	if k := len(p.freeE); k > 0 {
		e = p.freeE[k-1]
		p.freeE = p.freeE[:k-1]
	} else {
		e = new(psEntry)
	}
	_, fan := levelBits(h)
	e.key, e.tmpl, e.bitmap, e.fanIn, e.level1 = key, *h, 0, fan, h.Flags&fLevel1 != 0
	e.flags, e.complete, e.touched, e.plen = 0, false, now, 0
	if key.enc == encFixed32 {
		if k := len(p.freeFix); k > 0 {
			e.fix = p.freeFix[k-1]
			p.freeFix = p.freeFix[:k-1]
		} else {
			e.fix = new(fixedAcc)
		}
		clear(e.fix[:h.Count])
	} else {
		if k := len(p.freeFlt); k > 0 {
			e.flt = p.freeFlt[k-1]
			p.freeFlt = p.freeFlt[:k-1]
		} else {
			e.flt = new(floatAcc)
		}
		clear(e.flt.sum[:h.Count])
		clear(e.flt.sp[:h.Count])
	}
	p.entries[key] = e
	return e
}

// complete turns e's sum into its result packet, frees the accumulator and sends the result to
// the switch for broadcast.
func (p *PS) complete(e *psEntry, now int64) {
	n := int(e.tmpl.Count)
	out := e.pkt[bpf.HdrSize : bpf.HdrSize+4*n]
	flags := e.flags & (fECN | fCollision)
	if e.level1 {
		flags |= fLevel1
	}
	if e.fix != nil {
		// A contribution that could not be quantised makes the whole sum wrong; a sum beyond
		// int32 cannot be sent. Either way: saturate and flag, and the workers repair in float32.
		overflow := e.flags&fOverflow != 0
		for j := 0; j < n; j++ {
			s := e.fix[j]
			if s > math.MaxInt32 {
				s, overflow = math.MaxInt32, true
			} else if s < math.MinInt32 {
				s, overflow = math.MinInt32, true
			}
			binary.LittleEndian.PutUint32(out[4*j:], uint32(int32(s)))
		}
		if overflow {
			flags |= fOverflow
			p.st.overflows.Add(1)
		}
		p.freeFix = append(p.freeFix, e.fix)
		e.fix = nil
	} else {
		for j := 0; j < n; j++ {
			binary.LittleEndian.PutUint32(out[4*j:], math.Float32bits(e.flt.sum[j].float32(e.flt.sp[j])))
		}
		p.freeFlt = append(p.freeFlt, e.flt)
		e.flt = nil
	}
	h := e.tmpl
	h.Type = msgResult
	h.Flags = flags
	if e.level1 {
		h.Bitmap1 = e.bitmap
	} else {
		h.Bitmap0 = e.bitmap
	}
	EncodeHeader(e.pkt[:], &h)
	e.plen = bpf.HdrSize + 4*n
	e.complete = true
	e.touched = now
	p.done = append(p.done, e)
	p.st.completed.Add(1)
	if p.bc.free() > 0 { // always true: one message at most per datagram received
		p.bc.queue(&p.switchSa, e.pkt[:e.plen], nil)
		e.queuedIn = p.batch
	}
}

// resend queues e's stored result, marked F_SHADOW, to one sender.
func (p *PS) resend(e *psEntry, to *unix.RawSockaddrInet4) {
	if p.bc.free() == 0 || p.nshadow == len(p.shadow) {
		return
	}
	hdr := p.shadow[p.nshadow][:]
	p.nshadow++
	copy(hdr, e.pkt[:bpf.HdrSize])
	binary.LittleEndian.PutUint16(hdr[offFlags:], binary.LittleEndian.Uint16(hdr[offFlags:])|fShadow)
	p.bc.queue(to, hdr, e.pkt[bpf.HdrSize:e.plen])
	e.queuedIn = p.batch
	p.st.resent.Add(1)
}

// makeRoom frees the oldest completed result to admit a new aggregation. If a queued send still
// points into it (it completed or was re-sent in this very batch), the batch goes out first.
func (p *PS) makeRoom() bool {
	if p.doneHead == len(p.done) {
		return false
	}
	if p.done[p.doneHead].queuedIn == p.batch {
		_ = p.flush()
	}
	p.release(p.popDone())
	return true
}

// evict drops completed results older than ResultTTL and incomplete aggregations untouched for
// StaleAfter. Called between batches, when no queued send points into an entry.
func (p *PS) evict(now int64) {
	ttl, stale := int64(p.cfg.ResultTTL), int64(p.cfg.StaleAfter)
	for p.doneHead < len(p.done) && now-p.done[p.doneHead].touched >= ttl {
		p.release(p.popDone())
	}
	for _, e := range p.entries {
		if !e.complete && now-e.touched >= stale {
			p.st.stale.Add(1)
			p.release(e)
		}
	}
}

func (p *PS) popDone() *psEntry {
	e := p.done[p.doneHead]
	p.done[p.doneHead] = nil
	p.doneHead++
	// Compact once the consumed prefix dominates: amortised O(1), and the backing array stops
	// growing at about twice the live results.
	if p.doneHead > 64 && p.doneHead*2 > len(p.done) {
		k := copy(p.done, p.done[p.doneHead:])
		clear(p.done[k:])
		p.done = p.done[:k]
		p.doneHead = 0
	}
	return e
}

// release removes e from the table and recycles it and its accumulator.
func (p *PS) release(e *psEntry) {
	delete(p.entries, e.key)
	if e.fix != nil {
		p.freeFix = append(p.freeFix, e.fix)
		e.fix = nil
	}
	if e.flt != nil {
		p.freeFlt = append(p.freeFlt, e.flt)
		e.flt = nil
	}
	p.freeE = append(p.freeE, e)
}
