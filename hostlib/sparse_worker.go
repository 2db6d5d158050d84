package hostlib

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"net"
	"net/netip"
	"slices"
	"sync/atomic"
	"time"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/sparse"
	"github.com/xdpagg/xdpagg/wire"
)

// Sparse (hot-parameter) aggregation, after Zebra (docs/sparse.md). In each training iteration a
// worker pushes <key, value> gradients and gets back the sum, over all workers, for every key any
// worker touched. Keys of the job's hot set go to the switch as <rank, fixed-point value> pairs,
// packed layout-aware (Zebra's Algorithm 1) and summed in the switch's register arrays; all other
// keys go to the PS as <key, float32> and are summed there exactly. The PS reads the hot sums out
// of the switch (MSG_PULL), merges them with its cold sums and sends the update to every worker.

// DefaultSparseTimeout is SparseWorkerConfig.Timeout's default.
const DefaultSparseTimeout = 100 * time.Millisecond

// ErrOverflow: a hot register overflowed int32 in the iteration (only possible when a member
// sends values beyond the bound SparseWorker keeps to); the PS cannot give an exact sum.
var ErrOverflow = errors.New("hot sum overflowed at the switch")

// SparseWorkerConfig configures one worker of a sparse job.
type SparseWorkerConfig struct {
	JobID      uint32         // != 0
	WorkerID   uint8          // 0..NumWorkers-1
	NumWorkers uint8          // 1..32
	Local      netip.AddrPort // address to bind (port 0: any)
	PS         netip.AddrPort // the job's PS (port 0: wire.DefaultPort): every packet is addressed to it
	// Hot is the job's hot set (keys to ranks, and its version); nil sends every pair to the PS
	// (the PS-only mode, for a switch without registers or the baseline).
	Hot *sparse.HotSet
	// Arrays is m, the register arrays the switch gave the job (`job add --reg-arrays`): ranks
	// live in array rank % m, and Algorithm 1 packs so a packet rarely holds two of one array.
	Arrays int
	// InOrder packs hot pairs in key order instead of Algorithm 1 (to measure what it saves).
	InOrder bool
	// ScaleLog2 is the fixed-point exponent of hot values (default 24, at most 30).
	ScaleLog2 uint8
	// MTU is the path MTU: pairs per packet follow from it (default 1500, at most 3388).
	MTU int
	// Timeout is the first retransmit timeout (default 100ms: an iteration's update needs
	// every worker's packets and the PS's merge, milliseconds for thousands of keys), doubling
	// up to 8x; MaxRetries resends of an iteration before Step fails with ErrTimeout (default 50).
	// After a Join, each resend is preceded by a timeout's wait for the update packets asked of
	// the switch agent's copy (a sparse MSG_RETRANSMIT), cut short by its miss.
	Timeout    time.Duration
	MaxRetries int
	// JobKey is the job's control key, for Join (ctlauth.KeySize bytes).
	JobKey []byte
}

// WithDefaults fills zero fields.
func (c SparseWorkerConfig) WithDefaults() SparseWorkerConfig {
	if c.PS.Port() == 0 {
		c.PS = netip.AddrPortFrom(c.PS.Addr(), wire.DefaultPort)
	}
	c.PS = netip.AddrPortFrom(c.PS.Addr().Unmap(), c.PS.Port())
	if c.ScaleLog2 == 0 {
		c.ScaleLog2 = DefaultScaleLog2
	}
	if c.MTU == 0 {
		c.MTU = 1500
	}
	if c.Timeout == 0 {
		c.Timeout = DefaultSparseTimeout
	}
	if c.MaxRetries == 0 {
		c.MaxRetries = DefaultMaxRetries
	}
	return c
}

// Validate reports what is wrong with a configuration.
func (c SparseWorkerConfig) Validate() error {
	switch {
	case c.JobID == 0:
		return fmt.Errorf("%w: job id 0 is reserved", ErrConfig)
	case c.NumWorkers == 0 || int(c.NumWorkers) > wire.MaxWorkers || c.WorkerID >= c.NumWorkers:
		return fmt.Errorf("%w: worker %d of %d", ErrConfig, c.WorkerID, c.NumWorkers)
	case !c.PS.Addr().Is4():
		return fmt.Errorf("%w: PS %v: need an IPv4 address", ErrConfig, c.PS)
	case c.ScaleLog2 > 30:
		return fmt.Errorf("%w: scale 2^%d: use at most 2^30", ErrConfig, c.ScaleLog2)
	case c.MTU < 576 || c.MTU > 3388:
		return fmt.Errorf("%w: MTU %d: use 576..3388", ErrConfig, c.MTU)
	case c.Hot != nil && (c.Arrays <= 0 || uint32(c.Arrays) > bpf.JobMaxArrays):
		return fmt.Errorf("%w: %d register arrays: a hot set needs the job's m, 1..%d", ErrConfig, c.Arrays, bpf.JobMaxArrays)
	}
	return nil
}

// hotPairs and coldPairs are the pairs one packet carries at an MTU.
func hotPairs(mtu int) int {
	return min(wire.SparseMaxPairs, (mtu-28-wire.HdrSize-wire.SparseHdrSize)/wire.KVPairSize)
}
func coldPairs(mtu int) int {
	return min(wire.ColdMaxPairs, (mtu-28-wire.HdrSize-wire.SparseHdrSize)/wire.ColdPairSize)
}

// hotValues is the hot sums one ENC_SPARSE_HOT update packet carries at an MTU.
func hotValues(mtu int) int {
	return min(wire.HotMaxValues, (mtu-28-wire.HdrSize-wire.SparseHdrSize)/4)
}

// Update is the aggregated update of one iteration: every key any worker touched and its sum over
// the workers, in no particular order (hot keys by rank, then the cold ones), each key once.
type Update struct {
	Iteration uint32
	Keys      []uint64
	Vals      []float32
}

// SparseStats counts what a sparse worker did.
type SparseStats struct {
	Iterations  uint64 // Steps completed
	HotPairs    uint64 // pairs sent to the switch
	ColdPairs   uint64 // pairs sent to the PS (cold keys, and hot values beyond the fixed-point bound)
	HotPackets  uint64 // hot packets (including empty markers)
	ColdPackets uint64
	Resends     uint64 // iterations resent after a timeout
	Stale       uint64 // update packets of other iterations, or duplicates
	Foreign     uint64 // datagrams from anyone but the PS (and, after a Join, the switch agent)
	// The switch CPU's copy of updates (after a Join): sparse MSG_RETRANSMITs sent, update
	// packets they brought (F_CACHED, counted once each, in the update), and requests the agent
	// answered with a miss (the iteration was then resent to the PS at once).
	CacheRequests  uint64
	CacheRecovered uint64
	CacheMisses    uint64
	HotVersion     uint32 // the hot set in use: its version and keys (0, 0: none)
	HotKeys        int
}

// SparseWorker is one worker of a sparse job. Its methods must not be called concurrently.
type SparseWorker struct {
	cfg     SparseWorkerConfig
	conn    *net.UDPConn
	stamper ctlauth.Stamper
	bound   int64 // largest |fixed-point value| a hot pair may carry: W of them never overflow int32
	st      struct {
		iterations, hotPairs, coldPairs, hotPackets, coldPackets, resends, stale, foreign atomic.Uint64
		cacheRequests, cacheRecovered, cacheMisses                                        atomic.Uint64
	}
	rbuf []byte
	// agent is the switch agent this worker joined (invalid before a Join): lost update packets
	// are asked of its copy, and its answers (cached packets, a sealed miss) accepted from it.
	agent       netip.AddrPort
	agentReplay ctlauth.Replay[netip.AddrPort]
}

// NewSparseWorker binds the worker's socket.
func NewSparseWorker(cfg SparseWorkerConfig) (*SparseWorker, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	conn, err := net.ListenUDP("udp4", net.UDPAddrFromAddrPort(cfg.Local))
	if err != nil {
		return nil, fmt.Errorf("listen on %v: %w", cfg.Local, err)
	}
	_ = conn.SetReadBuffer(DefaultSocketBuffer)
	_ = conn.SetWriteBuffer(DefaultSocketBuffer)
	cfg.JobKey = slices.Clone(cfg.JobKey)
	return &SparseWorker{cfg: cfg, conn: conn, bound: math.MaxInt32 / int64(cfg.NumWorkers), rbuf: make([]byte, 65536)}, nil
}

// LocalAddr is the worker's bound address.
func (w *SparseWorker) LocalAddr() netip.AddrPort {
	return w.conn.LocalAddr().(*net.UDPAddr).AddrPort()
}

// Close closes the socket.
func (w *SparseWorker) Close() error { return w.conn.Close() }

// Stats returns the worker's counters.
func (w *SparseWorker) Stats() SparseStats {
	var version uint32
	if w.cfg.Hot != nil {
		version = w.cfg.Hot.Version
	}
	return SparseStats{Iterations: w.st.iterations.Load(), HotPairs: w.st.hotPairs.Load(), ColdPairs: w.st.coldPairs.Load(),
		HotPackets: w.st.hotPackets.Load(), ColdPackets: w.st.coldPackets.Load(), Resends: w.st.resends.Load(),
		Stale: w.st.stale.Load(), Foreign: w.st.foreign.Load(), CacheRequests: w.st.cacheRequests.Load(),
		CacheRecovered: w.st.cacheRecovered.Load(), CacheMisses: w.st.cacheMisses.Load(), HotVersion: version, HotKeys: w.cfg.Hot.Len()}
}

// SetHot replaces the hot set from the next Step on (a hot-set swap: every worker, the PS and the
// switch change at the same iteration; see SparsePS.SwapHot).
func (w *SparseWorker) SetHot(h *sparse.HotSet) { w.cfg.Hot = h }

// Join registers this worker with the switch's agent (as Worker.Join does), so the switch
// forwards the PS's updates to it; from then on update packets it misses are asked of the
// agent's copy before the iteration is resent to the PS. Synchronous: Step must not run meanwhile.
func (w *SparseWorker) Join(ctx context.Context, sw netip.AddrPort, mac net.HardwareAddr) error {
	msg, nonce, sw, err := controlRequest(wire.MsgJoin, w.cfg.JobID, w.cfg.WorkerID, w.cfg.NumWorkers, w.cfg.JobKey, sw, mac, ctlExtra{})
	if err != nil {
		return err
	}
	wait := 50 * time.Millisecond
	for {
		pkt, err := ctlauth.Seal(w.cfg.JobKey, slices.Clone(msg), w.stamper.Next())
		if err != nil {
			return fmt.Errorf("%w: %w", ErrConfig, err)
		}
		if _, err := w.conn.WriteToUDPAddrPort(pkt, sw); err != nil {
			return fmt.Errorf("send JOIN to %v: %w", sw, err)
		}
		deadline := time.Now().Add(wait)
		if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
			deadline = d
		}
		_ = w.conn.SetReadDeadline(deadline)
		for {
			n, from, err := w.conn.ReadFromUDPAddrPort(w.rbuf)
			if err != nil {
				if ctx.Err() != nil {
					return fmt.Errorf("%w: no acknowledgement from the switch agent at %v: %w", ErrTimeout, sw, ctx.Err())
				}
				break // resend
			}
			if netip.AddrPortFrom(from.Addr().Unmap(), from.Port()) != sw {
				w.st.foreign.Add(1)
				continue
			}
			b := w.rbuf[:n]
			m, stamp, err := ctlauth.Open(w.cfg.JobKey, b)
			if err != nil || len(m) != wire.HdrSize {
				continue
			}
			var a wire.Header
			wire.DecodeHeader(m, &a)
			if a.Type != wire.MsgAck || a.JobId != w.cfg.JobID || a.WorkerId != w.cfg.WorkerID || a.Seq != nonce {
				continue
			}
			if w.agentReplay.Check(sw, stamp) != nil {
				continue
			}
			w.agent = sw
			return nil
		}
		wait = min(2*wait, time.Second)
	}
}

// sparseIter is one iteration's packets, kept for resends until its update is in, and the hot
// set they used (which maps the update's ranks back to keys).
type sparseIter struct {
	pkts [][]byte
	hot  *sparse.HotSet
}

// updatePkt is one packet of an update: hot sums from rank first on, or cold pairs.
type updatePkt struct {
	enc   uint8
	first uint32
	data  []byte
}

// Step pushes this worker's gradients of iteration iter (keys distinct; vals[i] is keys[i]'s
// gradient) and returns the iteration's update. Every worker of the job calls Step for the same
// iterations in the same order; an iteration a worker has no gradient for is still stepped
// (with no keys), so the others' sums complete. It fails with ErrTimeout after MaxRetries
// resends, ErrOverflow if the switch could not sum a hot key exactly, ctx's error, or
// ErrConfig for bad input (a duplicate key).
func (w *SparseWorker) Step(ctx context.Context, iter uint32, keys []uint64, vals []float32) (Update, error) {
	if len(keys) != len(vals) {
		return Update{}, fmt.Errorf("%w: %d keys but %d values", ErrConfig, len(keys), len(vals))
	}
	it, err := w.build(iter, keys, vals)
	if err != nil {
		return Update{}, err
	}
	for _, p := range it.pkts {
		if _, err := w.conn.WriteToUDPAddrPort(p, w.cfg.PS); err != nil {
			return Update{}, fmt.Errorf("send iteration %d: %w", iter, err)
		}
	}
	var (
		got     map[uint32]updatePkt // update packets by index
		npkts   = -1
		rto     = w.cfg.Timeout
		retries int
		asked   bool // the agent's copy was asked since the last resend
	)
	deadline := time.Now().Add(rto)
	for {
		d := deadline
		if cd, ok := ctx.Deadline(); ok && cd.Before(d) {
			d = cd
		}
		_ = w.conn.SetReadDeadline(d)
		n, from, err := w.conn.ReadFromUDPAddrPort(w.rbuf)
		if err != nil {
			if ctx.Err() != nil {
				return Update{}, ctx.Err()
			}
			var ne net.Error
			if !errors.As(err, &ne) || !ne.Timeout() {
				return Update{}, fmt.Errorf("receive: %w", err)
			}
			if retries >= w.cfg.MaxRetries {
				return Update{}, fmt.Errorf("%w: iteration %d: no complete update after %d resends", ErrTimeout, iter, retries)
			}
			if w.agent.IsValid() && !asked {
				// Ask the switch CPU's copy for what is missing first (Libra §3.6): the
				// PS and the other workers are spared a resend when only the update was lost.
				asked = true
				if err := w.askAgent(iter, got, npkts); err != nil {
					return Update{}, err
				}
				deadline = time.Now().Add(rto)
				continue
			}
			// Resend everything: the switch and the PS drop what they already have.
			asked = false
			retries++
			w.st.resends.Add(1)
			for _, p := range it.pkts {
				wire.SetPacketFlags(p, wire.PacketFlags(p)|wire.FlagResend)
				if _, err := w.conn.WriteToUDPAddrPort(p, w.cfg.PS); err != nil {
					return Update{}, fmt.Errorf("resend iteration %d: %w", iter, err)
				}
			}
			rto = min(2*rto, 8*w.cfg.Timeout)
			deadline = time.Now().Add(rto)
			continue
		}
		from = netip.AddrPortFrom(from.Addr().Unmap(), from.Port())
		b := w.rbuf[:n]
		fromAgent := w.agent.IsValid() && from == w.agent
		if from != w.cfg.PS && !fromAgent {
			w.st.foreign.Add(1)
			continue
		}
		if fromAgent && len(b) > wire.OffType && b[wire.OffType] == wire.MsgAck {
			// A miss answers one of up to 8 requests of the last ask: the first one sends the
			// iteration to the PS now; the others, and any after that resend (asked false
			// again), are stale, or each would count a resend and ask again, and the worker
			// would run out its MaxRetries in round trips while the PS's answer is on its way.
			if w.agentMiss(b, iter) && asked {
				deadline = time.Now() // resend to the PS now
			} else {
				w.st.stale.Add(1) // a miss of an earlier request (or not the agent's)
			}
			continue
		}
		h, rest, err := wire.ParsePacket(b)
		if err != nil || h.Type != wire.MsgResult || (h.Encoding != wire.EncSparseCold && h.Encoding != wire.EncSparseHot) || h.JobId != w.cfg.JobID {
			w.st.foreign.Add(1)
			continue
		}
		if h.Seq != iter {
			w.st.stale.Add(1)
			continue
		}
		if h.Flags&wire.FlagOverflow != 0 {
			return Update{}, fmt.Errorf("%w: iteration %d", ErrOverflow, iter)
		}
		var sh wire.SparseHeader
		wire.DecodeSparseHeader(rest, &sh)
		if got == nil {
			got = make(map[uint32]updatePkt, sh.Npkts)
			npkts = int(sh.Npkts)
		}
		if int(sh.Npkts) != npkts || (h.Encoding == wire.EncSparseHot && (it.hot == nil || sh.HotVersion != it.hot.Version)) {
			w.st.stale.Add(1)
			continue
		}
		if _, dup := got[h.AggIndex]; dup {
			w.st.stale.Add(1)
			continue
		}
		psize := wire.ColdPairSize
		if h.Encoding == wire.EncSparseHot {
			psize = 4
		}
		got[h.AggIndex] = updatePkt{enc: h.Encoding, first: h.Bitmap1,
			data: slices.Clone(rest[wire.SparseHdrSize : wire.SparseHdrSize+psize*int(h.Count)])}
		if fromAgent && h.Flags&wire.FlagCached != 0 {
			w.st.cacheRecovered.Add(1)
		}
		if len(got) == npkts {
			break
		}
	}
	// Hot sums by rank first (keys from the iteration's hot set), then the cold pairs.
	up := Update{Iteration: iter}
	for i := range uint32(npkts) {
		p := got[i]
		if p.enc != wire.EncSparseHot {
			continue
		}
		for j := range len(p.data) / 4 {
			v := binary.LittleEndian.Uint32(p.data[4*j:])
			r := p.first + uint32(j)
			if v == wire.HotUntouched || int(r) >= it.hot.Len() {
				continue
			}
			up.Keys = append(up.Keys, it.hot.Key(r))
			up.Vals = append(up.Vals, math.Float32frombits(v))
		}
	}
	for i := range uint32(npkts) {
		p := got[i]
		if p.enc != wire.EncSparseCold {
			continue
		}
		for j := range len(p.data) / wire.ColdPairSize {
			k, v := wire.Cold(p.data, j)
			up.Keys = append(up.Keys, k)
			up.Vals = append(up.Vals, math.Float32frombits(v))
		}
	}
	w.st.iterations.Add(1)
	return up, nil
}

// sparseAskMax bounds the sparse MSG_RETRANSMITs one timeout sends (32 packets each).
const sparseAskMax = 8

// askAgent asks the switch agent for the update packets of iter this worker lacks (got holds
// those it has, of npkts; npkts < 0: none yet, so it asks for the first 32): one sealed
// MSG_RETRANSMIT (encoding ENC_SPARSE_HOT) per run of up to 32 packets from the first missing
// one on, agg_index that first one, bitmap0 which of the 32 (docs/protocol.md).
func (w *SparseWorker) askAgent(iter uint32, got map[uint32]updatePkt, npkts int) error {
	ask := func(first, mask uint32) error {
		h := wire.Header{Version: wire.Version, Type: wire.MsgRetransmit, Encoding: wire.EncSparseHot, JobId: w.cfg.JobID,
			Seq: iter, AggIndex: first, Bitmap0: mask, WorkerId: w.cfg.WorkerID}
		pkt, err := ctlauth.Seal(w.cfg.JobKey, wire.AppendHeader(nil, &h), w.stamper.Next())
		if err != nil {
			return fmt.Errorf("%w: %w", ErrConfig, err)
		}
		w.st.cacheRequests.Add(1)
		_, _ = w.conn.WriteToUDPAddrPort(pkt, w.agent) // a lost request: the next timeout resends to the PS
		return nil
	}
	if npkts < 0 {
		return ask(0, math.MaxUint32)
	}
	sent := 0
	for i := uint32(0); int(i) < npkts && sent < sparseAskMax; i++ {
		if _, ok := got[i]; ok {
			continue
		}
		var mask uint32
		for b := uint32(0); b < 32 && int(i+b) < npkts; b++ {
			if _, ok := got[i+b]; !ok {
				mask |= 1 << b
			}
		}
		if err := ask(i, mask); err != nil {
			return err
		}
		sent++
		i += 31
	}
	return nil
}

// agentMiss reports whether b, an ACK from the switch agent's address, is its authenticated answer that it has
// none of the update packets of iter asked for (a sealed MSG_ACK of iter).
func (w *SparseWorker) agentMiss(b []byte, iter uint32) bool {
	if len(b) != wire.HdrSize+ctlauth.TrailerSize {
		return false
	}
	m, stamp, err := ctlauth.Open(w.cfg.JobKey, b)
	if err != nil {
		return false
	}
	var h wire.Header
	wire.DecodeHeader(m, &h)
	if h.JobId != w.cfg.JobID || h.WorkerId != w.cfg.WorkerID || h.Seq != iter || w.agentReplay.Check(w.agent, stamp) != nil {
		return false
	}
	w.st.cacheMisses.Add(1)
	return true
}

// build splits an iteration's gradients into hot packets for the switch (with an empty marker
// when there is none) and cold packets for the PS (at least one, so the PS knows this worker is
// done).
// hotPair is a hot gradient as the switch takes it.
type hotPair struct {
	rank uint32
	q    int32
}

// distinct returns an ErrConfig error naming a key that appears twice. Sorted keys (what a
// sparse gradient's coalesced indices are) are checked in one pass; others through a set.
func distinct(keys []uint64) error {
	if slices.IsSorted(keys) {
		for i := 1; i < len(keys); i++ {
			if keys[i] == keys[i-1] {
				return fmt.Errorf("%w: key %d twice", ErrConfig, keys[i])
			}
		}
		return nil
	}
	seen := make(map[uint64]struct{}, len(keys))
	for _, k := range keys {
		if _, dup := seen[k]; dup {
			return fmt.Errorf("%w: key %d twice", ErrConfig, k)
		}
		seen[k] = struct{}{}
	}
	return nil
}

func (w *SparseWorker) build(iter uint32, keys []uint64, vals []float32) (*sparseIter, error) {
	if err := distinct(keys); err != nil {
		return nil, fmt.Errorf("%w in iteration %d", err, iter)
	}
	var (
		hot  []hotPair
		cold []int
	)
	for i, k := range keys {
		if w.cfg.Hot != nil {
			if r, ok := w.cfg.Hot.Rank(k); ok {
				// A hot value must fit the fixed point with room for W of them in an int32;
				// one that does not (or is not finite) goes to the PS, exact in float32.
				if q, ok := Quantize(vals[i], w.cfg.ScaleLog2); ok && int64(q) <= w.bound && int64(q) >= -w.bound {
					hot = append(hot, hotPair{r, q})
					continue
				}
			}
		}
		cold = append(cold, i)
	}
	it := &sparseIter{hot: w.cfg.Hot}
	version := uint32(0)
	if w.cfg.Hot != nil {
		version = w.cfg.Hot.Version
		// Ranks ascending (hottest first) before packing: Algorithm 1 walks them in that order.
		slices.SortFunc(hot, func(a, b hotPair) int { return cmp.Compare(a.rank, b.rank) })
		sorted := make([]uint32, len(hot))
		for i, hp := range hot {
			sorted[i] = hp.rank
		}
		per := hotPairs(w.cfg.MTU)
		var pkts [][]int
		if w.cfg.InOrder {
			pkts = sparse.PackInOrder(sorted, per)
		} else {
			// A packet with more pairs than arrays cannot take one pass: Algorithm 1 then
			// estimates its packets for at most m pairs each.
			pkts = sparse.Pack(sorted, w.cfg.Arrays, min(per, w.cfg.Arrays))
		}
		if len(pkts) == 0 {
			pkts = [][]int{nil} // the empty marker
		}
		if len(pkts) > wire.SparseMaxPkts {
			return nil, fmt.Errorf("%w: %d hot packets in iteration %d: at most %d (a larger MTU or fewer hot keys)", ErrConfig, len(pkts), iter, wire.SparseMaxPkts)
		}
		for i, p := range pkts {
			b := w.packet(wire.EncSparseKV, iter, version, uint32(i), len(pkts), len(p))
			pairs := b[wire.HdrSize+wire.SparseHdrSize:]
			for j, idx := range p {
				wire.PutKV(pairs, j, hot[idx].rank, hot[idx].q)
			}
			it.pkts = append(it.pkts, b)
			w.st.hotPairs.Add(uint64(len(p)))
			w.st.hotPackets.Add(1)
		}
	}
	per := coldPairs(w.cfg.MTU)
	n := max(1, (len(cold)+per-1)/per)
	if n > math.MaxUint16 {
		return nil, fmt.Errorf("%w: %d cold packets in iteration %d", ErrConfig, n, iter)
	}
	for i := range n {
		chunk := cold[min(i*per, len(cold)):min((i+1)*per, len(cold))]
		b := w.packet(wire.EncSparseCold, iter, version, uint32(i), n, len(chunk))
		pairs := b[wire.HdrSize+wire.SparseHdrSize:]
		for j, idx := range chunk {
			wire.PutCold(pairs, j, keys[idx], math.Float32bits(vals[idx]))
		}
		it.pkts = append(it.pkts, b)
		w.st.coldPairs.Add(uint64(len(chunk)))
		w.st.coldPackets.Add(1)
	}
	return it, nil
}

// packet makes a sparse DATA packet with room for count pairs of encoding enc.
func (w *SparseWorker) packet(enc uint8, iter, version, index uint32, npkts, count int) []byte {
	psize := wire.KVPairSize
	if enc == wire.EncSparseCold {
		psize = wire.ColdPairSize
	}
	b := make([]byte, wire.HdrSize+wire.SparseHdrSize+psize*count)
	h := wire.Header{Version: wire.Version, Type: wire.MsgData, Encoding: enc, ScaleLog2: w.cfg.ScaleLog2,
		Count: uint16(count), JobId: w.cfg.JobID, Seq: iter, AggIndex: index, Bitmap0: 1 << w.cfg.WorkerID,
		FanIn0: w.cfg.NumWorkers, WorkerId: w.cfg.WorkerID}
	wire.EncodeHeader(b, &h)
	wire.EncodeSparseHeader(b[wire.HdrSize:], &wire.SparseHeader{HotVersion: version, Npkts: uint16(npkts)})
	return b
}
