package hostlib

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"net"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/xdpagg/xdpagg/sparse"
	"github.com/xdpagg/xdpagg/wire"
)

// SparsePSConfig configures the parameter server of sparse jobs.
type SparsePSConfig struct {
	Listen netip.AddrPort // the PS's address and xdpagg port (port 0: wire.DefaultPort)
	// Switch is the switch's address on the PS's subnet and the xdpagg port: read-outs (MSG_PULL)
	// go there, and so do updates, which the switch forwards to the job's workers. Zero: no
	// switch (the PS-only mode): updates go straight to each worker, and no job may have a hot
	// set.
	Switch netip.AddrPort
	Jobs   []SparsePSJob
	// PullTimeout is how long a read-out waits for its answer before it is asked again, and how
	// long the PS waits for the switch's completion notice once every worker's cold packets are
	// in before it asks anyway (default 5ms).
	PullTimeout time.Duration
	// MTU is the path MTU of updates (default 1500).
	MTU int
	// Keep is how many completed iterations per job are kept to answer late resends (default 4).
	Keep int
}

// SparsePSJob is one sparse job at the PS.
type SparsePSJob struct {
	ID      uint32
	Workers []netip.AddrPort // by worker id; port 0 admits any port of that address
	// Hot is the job's hot set (nil: every key is cold). Arrays is the m the switch gave it, and
	// ScaleLog2 the fixed-point exponent its workers use.
	Hot       *sparse.HotSet
	Arrays    int
	ScaleLog2 uint8
	// Online, when set, re-ranks the job's keys every Online.Period iterations from what the PS
	// saw (cold keys) and the switch's per-register counters (hot keys), and swaps the hot set
	// when the Kendall tau distance says the ranking changed enough (SparsePS.Proposal).
	Online *sparse.Online
}

// SparsePSStats counts what the PS did.
type SparsePSStats struct {
	Received, Malformed, NotMember, Duplicates, Stale uint64
	Iterations                                        uint64 // updates sent
	Pulls, PullsPending, Spilled, ResendsServed       uint64
	Overflows                                         uint64 // iterations refused for a hot overflow
	// ReadOuts counts iterations read out of the switch, ReadOutTime their total time from the
	// first MSG_PULL sent to the last answer in.
	ReadOuts    uint64
	ReadOutTime time.Duration
}

// SparsePS serves sparse jobs: it sums cold pairs exactly, reads hot sums from the switch, and
// sends each iteration's update.
type SparsePS struct {
	cfg  SparsePSConfig
	conn *net.UDPConn
	jobs map[uint32]*spJob
	mu   sync.Mutex
	st   struct {
		received, malformed, notMember, dup, stale, iterations, pulls, pending, spilled, resends, overflows atomic.Uint64
		readOuts, readOutNs                                                                                 atomic.Uint64
	}
}

type spJob struct {
	cfg      SparsePSJob
	hots     map[uint32]*sparse.HotSet // by version: an iteration uses the one its packets name
	iters    map[uint32]*spIter
	done     []uint32       // completed iterations, oldest first
	prevHits [2][]uint32    // per parity: each rank's hit counter at the last read-out (for Online)
	lastHot  int            // hot keys in the last update (to size the next)
	latest   *sparse.HotSet // the newest hot set registered (what Online compares against)
	proposal *Proposal      // Online's last swap proposal not yet taken
}

// Proposal is a hot-set swap the online identification proposes (SparsePS.Proposal).
type Proposal struct {
	Hot       *sparse.HotSet // the new hot set, its version one past the newest registered
	Distance  float64        // normalized Kendall tau distance to the current hot set
	Iteration uint32         // the iteration whose completion triggered it
}

// spIter is one iteration at the PS.
type spIter struct {
	iter     uint32
	version  uint32
	coldN    []int                 // cold packets each worker announced (0: none seen)
	coldSeen []map[uint32]struct{} // by worker
	coldDone int                   // workers whose cold packets are all in
	cold     map[uint64]*spAcc
	spill    map[[2]uint32]struct{} // spilled hot packets seen: (worker, index)
	spillSum map[uint32]int64       // spilled hot pairs by rank
	notice   bool                   // the switch's F_SPARSE_DONE arrived
	spilled  int                    // spilled packets the switch reported (-1: unknown)
	coldAt   time.Time              // when the last cold packet came in
	ranges   map[uint32][]byte      // read-out answers by first rank: reg_reads
	pullAt   time.Time              // when pulls were last sent
	pull0    time.Time              // when the first pull was sent
	overflow bool
	update   [][]byte // the update's packets once complete
}

// hitDelta is the adds a hot slot touched in this iteration took since the PS last read its
// counter (prev), for the online ranking's counts. A counter not above prev restarted: registers
// start at zero on a standby that took over from a dead primary and on a job reset. The new
// reading is then the count, so a restart never yields a huge count; the counter's own wrap at
// 2^31 looks the same and undercounts once. At least 1: the slot was touched.
func hitDelta(hits, prev uint32) uint64 {
	if hits > prev {
		return uint64(hits - prev)
	}
	return uint64(max(hits, 1))
}

// updatePair is one key of an update and its sum's float32 bits.
type updatePair struct {
	key  uint64
	bits uint32
}

type spAcc struct {
	sum exactSum
	sp  uint8
	n   uint32 // workers that sent the key cold
}

// NewSparsePS binds the PS's socket.
func NewSparsePS(cfg SparsePSConfig) (*SparsePS, error) {
	if cfg.Listen.Port() == 0 {
		cfg.Listen = netip.AddrPortFrom(cfg.Listen.Addr(), wire.DefaultPort)
	}
	if cfg.PullTimeout == 0 {
		cfg.PullTimeout = 5 * time.Millisecond
	}
	if cfg.MTU == 0 {
		cfg.MTU = 1500
	}
	if cfg.Keep == 0 {
		cfg.Keep = 4
	}
	p := &SparsePS{cfg: cfg, jobs: map[uint32]*spJob{}}
	for _, j := range cfg.Jobs {
		switch {
		case j.ID == 0 || len(j.Workers) == 0 || len(j.Workers) > wire.MaxWorkers:
			return nil, fmt.Errorf("%w: sparse job %d with %d workers", ErrConfig, j.ID, len(j.Workers))
		case j.Hot != nil && !cfg.Switch.IsValid():
			return nil, fmt.Errorf("%w: job %d has a hot set but the PS has no switch", ErrConfig, j.ID)
		case j.Hot != nil && (j.Arrays <= 0 || j.ScaleLog2 == 0 || j.ScaleLog2 > 30):
			return nil, fmt.Errorf("%w: job %d: a hot set needs Arrays and ScaleLog2 (1..30)", ErrConfig, j.ID)
		case p.jobs[j.ID] != nil:
			return nil, fmt.Errorf("%w: job %d twice", ErrConfig, j.ID)
		}
		sj := &spJob{cfg: j, hots: map[uint32]*sparse.HotSet{}, iters: map[uint32]*spIter{}}
		if j.Hot != nil {
			sj.hots[j.Hot.Version] = j.Hot
			sj.latest = j.Hot
		}
		p.jobs[j.ID] = sj
	}
	conn, err := net.ListenUDP("udp4", net.UDPAddrFromAddrPort(cfg.Listen))
	if err != nil {
		return nil, fmt.Errorf("listen on %v: %w", cfg.Listen, err)
	}
	_ = conn.SetReadBuffer(DefaultSocketBuffer)
	_ = conn.SetWriteBuffer(DefaultSocketBuffer)
	p.conn = conn
	return p, nil
}

// AddHot registers another hot set of a job that has one (a swap): iterations whose packets
// carry its version use it. Register it before any worker sends with it; workers switch with
// SparseWorker.SetHot at the same iteration (the switch takes the version from the iteration's
// packets). Versions must differ from every one registered.
func (p *SparsePS) AddHot(job uint32, h *sparse.HotSet) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	j := p.jobs[job]
	switch {
	case j == nil:
		return fmt.Errorf("%w: no sparse job %d", ErrConfig, job)
	case j.cfg.Hot == nil || h == nil:
		return fmt.Errorf("%w: job %d has no hot set to swap", ErrConfig, job)
	case j.hots[h.Version] != nil:
		return fmt.Errorf("%w: job %d already has hot-set version %d", ErrConfig, job, h.Version)
	}
	j.hots[h.Version] = h
	if h.Version > j.latest.Version {
		j.latest = h
	}
	return nil
}

// Proposal returns (and forgets) the job's pending hot-set swap proposed by its Online
// identification, if any. The caller, the job's scheduler, makes it happen at an iteration
// boundary t: AddHot(job, p.Hot), then every worker's SetHot before it steps t.
func (p *SparsePS) Proposal(job uint32) (Proposal, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	j := p.jobs[job]
	if j == nil || j.proposal == nil {
		return Proposal{}, false
	}
	pr := *j.proposal
	j.proposal = nil
	return pr, true
}

// hot is the hot set of an iteration (nil for a job without one).
func (j *spJob) hot(it *spIter) *sparse.HotSet {
	if j.cfg.Hot == nil {
		return nil
	}
	return j.hots[it.version]
}

// Close closes the socket (Serve returns).
func (p *SparsePS) Close() error { return p.conn.Close() }

// LocalAddr is the PS's bound address.
func (p *SparsePS) LocalAddr() netip.AddrPort { return p.conn.LocalAddr().(*net.UDPAddr).AddrPort() }

// Stats returns the PS's counters.
func (p *SparsePS) Stats() SparsePSStats {
	return SparsePSStats{Received: p.st.received.Load(), Malformed: p.st.malformed.Load(), NotMember: p.st.notMember.Load(),
		Duplicates: p.st.dup.Load(), Stale: p.st.stale.Load(), Iterations: p.st.iterations.Load(), Pulls: p.st.pulls.Load(),
		PullsPending: p.st.pending.Load(), Spilled: p.st.spilled.Load(), ResendsServed: p.st.resends.Load(),
		Overflows: p.st.overflows.Load(), ReadOuts: p.st.readOuts.Load(), ReadOutTime: time.Duration(p.st.readOutNs.Load())}
}

// Serve runs the PS until ctx ends or the PS is closed.
func (p *SparsePS) Serve(ctx context.Context) error {
	stop := context.AfterFunc(ctx, func() { _ = p.conn.SetReadDeadline(time.Unix(1, 0)) })
	defer stop()
	buf := make([]byte, 65536)
	tick := p.cfg.PullTimeout
	for {
		_ = p.conn.SetReadDeadline(time.Now().Add(tick))
		n, from, err := p.conn.ReadFromUDPAddrPort(buf)
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				p.timers(time.Now())
				continue
			}
			if errors.Is(err, net.ErrClosed) {
				return nil
			}
			return fmt.Errorf("receive: %w", err)
		}
		p.handle(buf[:n], netip.AddrPortFrom(from.Addr().Unmap(), from.Port()), time.Now())
	}
}

func (p *SparsePS) send(b []byte, to netip.AddrPort) {
	_, _ = p.conn.WriteToUDPAddrPort(b, to) // loss is repaired by resends and pull timeouts
}

func (p *SparsePS) handle(b []byte, from netip.AddrPort, now time.Time) {
	p.st.received.Add(1)
	h, rest, err := wire.ParsePacket(b)
	if err != nil || !wire.Sparse(h.Encoding) {
		p.st.malformed.Add(1)
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	j := p.jobs[h.JobId]
	if j == nil {
		p.st.notMember.Add(1)
		return
	}
	var sh wire.SparseHeader
	wire.DecodeSparseHeader(rest, &sh)
	pairs := rest[wire.SparseHdrSize:]
	switch {
	case h.Type == wire.MsgPull:
		if !p.cfg.Switch.IsValid() || from != p.cfg.Switch || h.Flags&wire.FlagFromSwitch == 0 {
			p.st.notMember.Add(1)
			return
		}
		p.pulled(j, &h, &sh, pairs, now)
	case h.Type == wire.MsgData:
		if int(h.WorkerId) >= len(j.cfg.Workers) || int(h.FanIn0) != len(j.cfg.Workers) || !admits(j.cfg.Workers[h.WorkerId], from) {
			p.st.notMember.Add(1)
			return
		}
		if h.Encoding == wire.EncSparseCold {
			p.coldData(j, &h, &sh, pairs, from, now)
		} else {
			p.hotData(j, &h, &sh, pairs, now)
		}
	default:
		p.st.malformed.Add(1)
	}
}

func admits(member, from netip.AddrPort) bool {
	return member.Addr().Unmap() == from.Addr() && (member.Port() == 0 || member.Port() == from.Port())
}

// iteration returns the record of iteration iter, made on first use, or nil for one already
// forgotten.
func (p *SparsePS) iteration(j *spJob, iter, version uint32) *spIter {
	if it := j.iters[iter]; it != nil {
		return it
	}
	if len(j.done) > 0 && int32(iter-j.done[0]) < 0 {
		return nil // older than what is kept
	}
	w := len(j.cfg.Workers)
	it := &spIter{iter: iter, version: version, coldN: make([]int, w), coldSeen: make([]map[uint32]struct{}, w),
		cold: map[uint64]*spAcc{}, spill: map[[2]uint32]struct{}{}, spillSum: map[uint32]int64{}, spilled: -1,
		ranges: map[uint32][]byte{}}
	j.iters[iter] = it
	return it
}

func (p *SparsePS) coldData(j *spJob, h *wire.Header, sh *wire.SparseHeader, pairs []byte, from netip.AddrPort, now time.Time) {
	if j.cfg.Hot != nil && j.hots[sh.HotVersion] == nil {
		p.st.malformed.Add(1) // a hot-set version this PS was never given
		return
	}
	it := p.iteration(j, h.Seq, sh.HotVersion)
	if it == nil {
		p.st.stale.Add(1)
		return
	}
	if it.update != nil {
		// Complete: the worker resent because it missed some of the update.
		p.st.dup.Add(1)
		if h.Flags&wire.FlagResend != 0 {
			p.st.resends.Add(1)
			for _, u := range it.update {
				p.send(u, p.updateDest(from))
			}
		}
		return
	}
	w := h.WorkerId
	if it.coldN[w] == 0 {
		it.coldN[w] = int(sh.Npkts)
		it.coldSeen[w] = map[uint32]struct{}{}
	} else if it.coldN[w] != int(sh.Npkts) || it.version != sh.HotVersion {
		p.st.malformed.Add(1)
		return
	}
	if _, dup := it.coldSeen[w][h.AggIndex]; dup {
		p.st.dup.Add(1)
		return
	}
	it.coldSeen[w][h.AggIndex] = struct{}{}
	for i := range int(h.Count) {
		k, v := wire.Cold(pairs, i)
		a := it.cold[k]
		if a == nil {
			a = &spAcc{}
			it.cold[k] = a
		}
		a.sum.add(v, &a.sp)
		a.n++
	}
	if len(it.coldSeen[w]) == it.coldN[w] {
		it.coldDone++
		it.coldAt = now
	}
	p.progress(j, it, now)
}

// hotData takes what the switch handed on of a hot packet: pairs it left unsummed (F_COLLISION)
// and its completion notice (F_SPARSE_DONE, with the iteration's spilled-packet count).
func (p *SparsePS) hotData(j *spJob, h *wire.Header, sh *wire.SparseHeader, pairs []byte, now time.Time) {
	if j.cfg.Hot == nil {
		p.st.malformed.Add(1)
		return
	}
	it := p.iteration(j, h.Seq, sh.HotVersion)
	if it == nil || it.update != nil {
		p.st.stale.Add(1)
		return
	}
	if h.Flags&wire.FlagSparseDone != 0 {
		it.notice = true
		it.spilled = int(sh.Spilled)
	}
	if h.Flags&wire.FlagCollision != 0 {
		key := [2]uint32{uint32(h.WorkerId), h.AggIndex}
		if _, dup := it.spill[key]; !dup {
			it.spill[key] = struct{}{}
			p.st.spilled.Add(1)
			for i := range int(h.Count) {
				r, v := wire.KV(pairs, i)
				if r != wire.RankPlaced {
					it.spillSum[r] += int64(v)
				}
			}
		}
	}
	p.progress(j, it, now)
}

// pulled takes a read-out answer.
func (p *SparsePS) pulled(j *spJob, h *wire.Header, sh *wire.SparseHeader, pairs []byte, now time.Time) {
	it := j.iters[h.Seq]
	if it == nil || it.update != nil || j.cfg.Hot == nil {
		p.st.stale.Add(1)
		return
	}
	if h.Flags&wire.FlagPending != 0 {
		p.st.pending.Add(1)
		return // the pull timer asks again
	}
	if _, have := it.ranges[h.AggIndex]; have {
		p.st.dup.Add(1)
		return
	}
	it.ranges[h.AggIndex] = slices.Clone(pairs[:wire.KVPairSize*int(h.Count)])
	it.spilled = int(sh.Spilled)
	it.overflow = it.overflow || h.Flags&wire.FlagOverflow != 0
	p.progress(j, it, now)
}

// pullRanges lists a hot set's read-out ranges of n ranks each: n <= m, so a range touches each
// register array once (one pass at the switch), and n fills at most one packet.
func pullRanges(k, m int) [][2]uint32 {
	var out [][2]uint32
	for first := 0; first < k; first += m {
		out = append(out, [2]uint32{uint32(first), uint32(min(m, k-first))})
	}
	return out
}

// progress pulls hot sums once the iteration can be read out, and completes it when all is in.
func (p *SparsePS) progress(j *spJob, it *spIter, now time.Time) {
	if it.coldDone < len(j.cfg.Workers) {
		return
	}
	if hs := j.hot(it); hs != nil && hs.Len() > 0 {
		ranges := pullRanges(hs.Len(), min(j.cfg.Arrays, hotPairs(p.cfg.MTU)))
		if len(it.ranges) < len(ranges) {
			// Ask when the switch said it is done, or when it has been quiet for a while (its
			// notice may have been lost; a premature pull is answered F_PENDING).
			if (it.notice || now.Sub(it.coldAt) >= p.cfg.PullTimeout) && now.Sub(it.pullAt) >= p.cfg.PullTimeout {
				p.pull(j, it, ranges, now)
			}
			return
		}
		if !it.pull0.IsZero() {
			p.st.readOuts.Add(1)
			p.st.readOutNs.Add(uint64(now.Sub(it.pull0)))
			it.pull0 = time.Time{}
		}
		if it.spilled < 0 || len(it.spill) < it.spilled {
			return // spilled pairs still on their way
		}
	}
	p.complete(j, it)
}

func (p *SparsePS) pull(j *spJob, it *spIter, ranges [][2]uint32, now time.Time) {
	it.pullAt = now
	if it.pull0.IsZero() {
		it.pull0 = now
	}
	for _, r := range ranges {
		if _, have := it.ranges[r[0]]; have {
			continue
		}
		b := make([]byte, wire.HdrSize+wire.SparseHdrSize+wire.KVPairSize*int(r[1]))
		h := wire.Header{Version: wire.Version, Type: wire.MsgPull, Encoding: wire.EncSparseKV, Count: uint16(r[1]),
			JobId: j.cfg.ID, Seq: it.iter, AggIndex: r[0]}
		wire.EncodeHeader(b, &h)
		p.send(b, p.cfg.Switch)
		p.st.pulls.Add(1)
	}
}

// timers re-drives iterations waiting on the switch (lost notices or answers).
func (p *SparsePS) timers(now time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, j := range p.jobs {
		for _, it := range j.iters {
			if it.update == nil {
				p.progress(j, it, now)
			}
		}
	}
}

// complete merges the hot and cold sums and sends the update.
func (p *SparsePS) complete(j *spJob, it *spIter) {
	scale := j.cfg.ScaleLog2
	online := j.cfg.Online != nil && j.latest != nil
	var touched map[uint64]uint64 // key -> workers that touched it (for Online)
	if online {
		touched = make(map[uint64]uint64, len(it.cold))
		for k, a := range it.cold {
			touched[k] += uint64(a.n)
		}
	}
	// The update: the hot keys' sums by rank (ENC_SPARSE_HOT, 4 bytes a key: workers know the
	// hot set), then the cold keys' as (key, float32) pairs. A hot key's sum S·2^-s is one float64
	// product (|S| < 2^53 is exact) rounded to float32 once, unless the key also has cold values:
	// their exact sum takes it in and it goes out with the cold keys.
	flags := uint16(0)
	var hotVals []uint32 // by rank; wire.HotUntouched where not in the hot part
	if it.overflow {
		flags = wire.FlagOverflow
		p.st.overflows.Add(1)
	} else if hs := j.hot(it); hs != nil {
		parity := it.iter & 1
		hot := make([]int64, hs.Len())
		moved := make([]bool, hs.Len())
		prev := j.prevHits[parity]
		if len(prev) < hs.Len() {
			prev = append(prev, make([]uint32, hs.Len()-len(prev))...)
			j.prevHits[parity] = prev
		}
		for first, reads := range it.ranges {
			for i := range len(reads) / wire.KVPairSize {
				rank := first + uint32(i)
				if int(rank) >= len(hot) {
					break
				}
				// The switch says whether the slot holds a sum of this iteration: that
				// alone decides the key list (a key whose sum is 0 is still touched).
				s, hits, mine := wire.RegRead(reads, i)
				if mine {
					hot[rank] += int64(s)
					moved[rank] = true
					if online {
						touched[hs.Key(rank)] += hitDelta(hits, prev[rank])
					}
				}
				prev[rank] = hits
			}
		}
		for r, s := range it.spillSum {
			if int(r) < len(hot) {
				hot[r] += s
				moved[r] = true
				if online {
					touched[hs.Key(r)]++
				}
			}
		}
		hotVals = make([]uint32, hs.Len())
		for r, ok := range moved {
			hotVals[r] = wire.HotUntouched
			if !ok {
				continue
			}
			if a := it.cold[hs.Key(uint32(r))]; a != nil {
				addFixed(&a.sum, &a.sp, hot[r], scale)
				continue // goes out with the cold keys
			}
			hotVals[r] = math.Float32bits(float32(float64(hot[r]) * invPow2[scale]))
		}
	}
	var cold []updatePair
	if !it.overflow {
		cold = make([]updatePair, 0, len(it.cold))
		for k, a := range it.cold {
			cold = append(cold, updatePair{k, math.Float32bits(a.sum.float32(a.sp))})
		}
	}
	perHot, perCold := hotValues(p.cfg.MTU), coldPairs(p.cfg.MTU)
	nHot := (len(hotVals) + perHot - 1) / perHot
	nCold := max(1, (len(cold)+perCold-1)/perCold) // at least one packet: the update exists
	n := nHot + nCold
	mk := func(enc uint8, index, first uint32, count, psize int) []byte {
		b := make([]byte, wire.HdrSize+wire.SparseHdrSize+psize*count)
		h := wire.Header{Version: wire.Version, Type: wire.MsgResult, Encoding: enc, Flags: flags,
			Count: uint16(count), JobId: j.cfg.ID, Seq: it.iter, AggIndex: index, Bitmap1: first,
			Bitmap0: uint32(1)<<len(j.cfg.Workers) - 1, FanIn0: uint8(len(j.cfg.Workers))}
		if len(j.cfg.Workers) == 32 {
			h.Bitmap0 = math.MaxUint32
		}
		wire.EncodeHeader(b, &h)
		wire.EncodeSparseHeader(b[wire.HdrSize:], &wire.SparseHeader{HotVersion: it.version, Npkts: uint16(n)})
		return b
	}
	for i := range nHot {
		chunk := hotVals[i*perHot : min((i+1)*perHot, len(hotVals))]
		b := mk(wire.EncSparseHot, uint32(i), uint32(i*perHot), len(chunk), 4)
		vals := b[wire.HdrSize+wire.SparseHdrSize:]
		for x, v := range chunk {
			binary.LittleEndian.PutUint32(vals[4*x:], v)
		}
		it.update = append(it.update, b)
	}
	for i := range nCold {
		chunk := cold[min(i*perCold, len(cold)):min((i+1)*perCold, len(cold))]
		b := mk(wire.EncSparseCold, uint32(nHot+i), 0, len(chunk), wire.ColdPairSize)
		pairs := b[wire.HdrSize+wire.SparseHdrSize:]
		for x, u := range chunk {
			wire.PutCold(pairs, x, u.key, u.bits)
		}
		it.update = append(it.update, b)
	}
	for _, u := range it.update {
		if p.cfg.Switch.IsValid() {
			p.send(u, p.cfg.Switch)
		} else {
			for _, w := range j.cfg.Workers {
				p.send(u, w)
			}
		}
	}
	p.st.iterations.Add(1)
	if o := j.cfg.Online; online {
		o.Observe(touched)
		if o.Due() {
			o.K = j.latest.Len()
			next, dist, swap := o.Propose(j.latest.Keys())
			if swap {
				if h, err := sparse.NewHotSet(j.latest.Version+1, next); err == nil {
					j.proposal = &Proposal{Hot: h, Distance: dist, Iteration: it.iter}
				}
			}
		}
	}
	// Keep the last few iterations for resends; forget older ones and anything older still
	// that never completed (its workers have moved on).
	j.done = append(j.done, it.iter)
	for len(j.done) > p.cfg.Keep {
		old := j.done[0]
		j.done = j.done[1:]
		for k := range j.iters {
			if int32(k-old) <= 0 {
				delete(j.iters, k)
			}
		}
	}
	// Cold packets carry the cold-pair sums' inputs only: drop them now the update is built.
	it.cold, it.ranges, it.spillSum = nil, nil, nil
}

// updateDest is where a resent update goes: through the switch (which forwards it to every
// member), or straight to the worker that asked when there is no switch.
func (p *SparsePS) updateDest(from netip.AddrPort) netip.AddrPort {
	if p.cfg.Switch.IsValid() {
		return p.cfg.Switch
	}
	return from
}

// addFixed adds the fixed-point integer s * 2^-scale to an exact sum, as float32 parts that are
// each exact: s = hi * 2^24 + lo with 0 <= lo < 2^24 (|s| < 2^40 here: 32 values of 2^31 and
// spilled ones).
func addFixed(sum *exactSum, sp *uint8, s int64, scale uint8) {
	lo := s & (1<<24 - 1)
	hi := s >> 24
	sum.add(math.Float32bits(float32(float64(lo)*invPow2[scale])), sp)
	if hi != 0 {
		sum.add(math.Float32bits(float32(float64(hi)*pow2[24]*invPow2[scale])), sp)
	}
}
