package agent

import (
	"fmt"
	"net/netip"
	"sync"
	"time"

	"github.com/xdpagg/xdpagg/wire"
)

// Defaults of the sparse retransmit cache.
const (
	// DefaultSparseKeep is how many iterations' updates a sparse job keeps: a worker steps
	// iteration t+1 only after it has t's update, so the last few cover every worker that is
	// still waiting (and a PS's late resends of older ones).
	DefaultSparseKeep = 4
	// DefaultSparseJobBytes caps one job's cached update packets, so that a job with large
	// updates evicts only its own older iterations, never another job's.
	DefaultSparseJobBytes = 4 << 20
	// sparseAskPackets is the most packets one sparse MSG_RETRANSMIT asks for: bitmap0's bits.
	sparseAskPackets = 32
)

// SparseCache is the switch CPU's copy of sparse updates (Libra §3.6 keeps the hot parameters'
// results at the switch CPU for retransmission): the XDP program copies every update packet the
// PS sends through the switch (ENC_SPARSE_HOT, ENC_SPARSE_COLD) into the `results` ring buffer,
// and the agent keeps each job's last few iterations here. A worker that lost update packets
// asks for them with a sparse MSG_RETRANSMIT before it resends its iteration to the PS.
//
// Workers do not acknowledge sparse updates: a job's store is bounded instead, by iterations
// (keep), bytes (jobBytes) and age, and each job only ever evicts its own.
type SparseCache struct {
	mu       sync.Mutex
	keep     int
	jobBytes int
	maxAge   time.Duration
	swept    time.Time // last age sweep
	jobs     map[uint32]*sparseJobCache
	st       SparseCacheStats
}

// SparseCacheStats counts what the sparse cache did.
type SparseCacheStats struct {
	Packets  uint64 // update packets held now
	Bytes    uint64 // their size
	Stored   uint64 // update packets taken from the ring buffer (or a restore)
	Requests uint64 // sparse MSG_RETRANSMITs asked of it
	Hits     uint64 // ... answered with at least one packet
	Misses   uint64 // ... it had none of the asked packets for: answered with MSG_ACK
	Sent     uint64 // update packets sent to workers (F_CACHED)
	Evicted  uint64 // packets dropped: older iterations beyond keep, age, or the job's byte cap
	Late     uint64 // packets of an iteration older than every one kept, not stored
}

// outcomes lists the counters by their metric label, in a stable order.
func (s SparseCacheStats) outcomes() []struct {
	label string
	n     uint64
} {
	return []struct {
		label string
		n     uint64
	}{{"stored", s.Stored}, {"evicted", s.Evicted}, {"late", s.Late}, {"requests", s.Requests}, {"hits", s.Hits},
		{"misses", s.Misses}, {"sent", s.Sent}}
}

// sparseJobCache is one job's kept iterations, oldest first (serial order).
type sparseJobCache struct {
	iters []*sparseIterCache
	bytes int
}

type sparseIterCache struct {
	iter uint32
	at   time.Time         // when its first packet was stored (age eviction)
	pkts map[uint32][]byte // by packet index (hdr.agg_index): header, sparse header, sums or pairs
}

// NewSparseCache makes a cache that keeps keep iterations of each job, at most jobBytes of
// packets per job, each for at most maxAge (zero values: the defaults, and no age limit).
func NewSparseCache(keep, jobBytes int, maxAge time.Duration) *SparseCache {
	if keep <= 0 {
		keep = DefaultSparseKeep
	}
	if jobBytes <= 0 {
		jobBytes = DefaultSparseJobBytes
	}
	return &SparseCache{keep: keep, jobBytes: jobBytes, maxAge: maxAge, jobs: map[uint32]*sparseJobCache{}}
}

// sparseRecord reports whether a `results` ring-buffer record (or an exported packet) is a
// sparse update, which the SparseCache takes, rather than a dense result.
func sparseRecord(rec []byte) bool {
	return len(rec) > wire.OffEncoding && (rec[wire.OffEncoding] == wire.EncSparseHot || rec[wire.OffEncoding] == wire.EncSparseCold)
}

// updateLen is the length of the sparse update packet at the start of rec (a ring-buffer record
// is longer: its tail is undefined), checked as the switch checked it.
func updateLen(rec []byte) (int, error) {
	if len(rec) < wire.HdrSize+wire.SparseHdrSize {
		return 0, fmt.Errorf("%w: %d bytes", errBadRecord, len(rec))
	}
	var h wire.Header
	wire.DecodeHeader(rec, &h)
	psize := wire.ColdPairSize
	if h.Encoding == wire.EncSparseHot {
		psize = 4
	}
	n := min(len(rec), wire.HdrSize+wire.SparseHdrSize+psize*int(h.Count))
	if _, _, err := wire.ParsePacket(rec[:n]); err != nil || h.Type != wire.MsgResult {
		return 0, fmt.Errorf("%w: sparse update type %d encoding %d count %d in %d bytes: %v", errBadRecord, h.Type, h.Encoding, h.Count, len(rec), err)
	}
	return n, nil
}

// Store takes one sparse update packet (a `results` ring-buffer record, or a packet Export gave).
func (c *SparseCache) Store(rec []byte, now time.Time) error {
	n, err := updateLen(rec)
	if err != nil {
		return err
	}
	var h wire.Header
	wire.DecodeHeader(rec, &h)
	c.mu.Lock()
	defer c.mu.Unlock()
	if now.Sub(c.swept) >= time.Second {
		c.sweepLocked(now)
	}
	j := c.jobs[h.JobId]
	if j == nil {
		j = &sparseJobCache{}
		c.jobs[h.JobId] = j
	}
	it := j.iteration(h.Seq, now, c.keep)
	if it == nil {
		c.st.Late++
		return nil
	}
	if old, ok := it.pkts[h.AggIndex]; ok { // the PS sent it again (a worker's resend)
		j.bytes -= len(old)
		c.st.Bytes -= uint64(len(old))
		c.st.Packets--
	}
	it.pkts[h.AggIndex] = append([]byte(nil), rec[:n]...)
	j.bytes += n
	c.st.Bytes += uint64(n)
	c.st.Packets++
	c.st.Stored++
	// Over keep iterations (a new one is never the oldest then), or over the job's byte cap:
	// its oldest iterations go first, but not the one being stored; when that is the oldest, the
	// packet just stored goes instead (an update larger than the cap is kept only in part).
	for len(j.iters) > c.keep {
		c.evict(j, 0)
	}
	for j.bytes > c.jobBytes {
		if j.iters[0] != it {
			c.evict(j, 0)
			continue
		}
		delete(it.pkts, h.AggIndex)
		j.bytes -= n
		c.st.Bytes -= uint64(n)
		c.st.Packets--
		c.st.Evicted++
		if len(it.pkts) == 0 {
			c.evict(j, 0)
		}
		break
	}
	if len(j.iters) == 0 {
		delete(c.jobs, h.JobId)
	}
	return nil
}

// iteration returns the job's entry for iter, made (in serial order) if it is newer than the
// oldest kept or there is room; nil for an iteration too old to keep. Called with mu held.
func (j *sparseJobCache) iteration(iter uint32, now time.Time, keep int) *sparseIterCache {
	i := len(j.iters)
	for i > 0 && int32(iter-j.iters[i-1].iter) < 0 {
		i--
	}
	if i > 0 && j.iters[i-1].iter == iter {
		return j.iters[i-1]
	}
	if i == 0 && len(j.iters) >= keep {
		return nil
	}
	it := &sparseIterCache{iter: iter, at: now, pkts: map[uint32][]byte{}}
	j.iters = append(j.iters, nil)
	copy(j.iters[i+1:], j.iters[i:])
	j.iters[i] = it
	return it
}

// evict drops the job's i-th iteration. Called with mu held.
func (c *SparseCache) evict(j *sparseJobCache, i int) {
	for _, p := range j.iters[i].pkts {
		j.bytes -= len(p)
		c.st.Bytes -= uint64(len(p))
		c.st.Packets--
		c.st.Evicted++
	}
	j.iters = append(j.iters[:i], j.iters[i+1:]...)
}

// Get returns the cached packets of job's update for iter whose index is first+i for a bit i set
// in mask, in index order, counting the request as a hit (some) or a miss (none).
func (c *SparseCache) Get(job, iter, first, mask uint32) [][]byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.st.Requests++
	var out [][]byte
	if j := c.jobs[job]; j != nil {
		for _, it := range j.iters {
			if it.iter != iter || (c.maxAge > 0 && time.Since(it.at) > c.maxAge) { // aged out, not swept yet
				continue
			}
			for i := range uint32(sparseAskPackets) {
				if mask&(1<<i) == 0 {
					continue
				}
				if p, ok := it.pkts[first+i]; ok {
					out = append(out, p)
				}
			}
		}
	}
	if len(out) == 0 {
		c.st.Misses++
		return nil
	}
	c.st.Hits++
	c.st.Sent += uint64(len(out))
	return out
}

// Sweep drops iterations older than the maximum age (none without one). Store sweeps too, at
// most once a second.
func (c *SparseCache) Sweep(now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.sweepLocked(now)
}

func (c *SparseCache) sweepLocked(now time.Time) {
	c.swept = now
	if c.maxAge <= 0 {
		return
	}
	for id, j := range c.jobs {
		for len(j.iters) > 0 && now.Sub(j.iters[0].at) > c.maxAge {
			c.evict(j, 0)
		}
		if len(j.iters) == 0 {
			delete(c.jobs, id)
		}
	}
}

// ForgetJobs drops the cached updates of every job drop returns true for (removed, or admitted
// again: its iterations start afresh).
func (c *SparseCache) ForgetJobs(drop func(job uint32) bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for id, j := range c.jobs {
		if !drop(id) {
			continue
		}
		for len(j.iters) > 0 {
			c.evict(j, 0)
		}
		delete(c.jobs, id)
	}
}

// Stats returns the cache's counters.
func (c *SparseCache) Stats() SparseCacheStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.st
}

// Export returns copies of the cached update packets, each job's oldest iteration first: what a
// standby switch's cache takes over (Store) when the controller moves the switch's jobs there.
func (c *SparseCache) Export() [][]byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out [][]byte
	for _, j := range c.jobs {
		for _, it := range j.iters {
			for _, p := range it.pkts {
				out = append(out, append([]byte(nil), p...))
			}
		}
	}
	return out
}

// storeResult files a `results` record (or a snapshot's cached packet) with the cache it belongs
// to: a sparse update with the sparse cache, a dense sum with the result cache.
func (c *ControlServer) storeResult(rec []byte, now time.Time) error {
	if sparseRecord(rec) {
		if c.sparse == nil {
			return fmt.Errorf("%w: a sparse update, and no sparse cache", errBadRecord)
		}
		return c.sparse.Store(rec, now)
	}
	if c.cache == nil {
		return fmt.Errorf("%w: a result, and no result cache", errBadRecord)
	}
	return c.cache.Store(rec, now)
}

// SparseCacheStats returns the sparse retransmit cache's counters (zero without one).
func (c *ControlServer) SparseCacheStats() SparseCacheStats {
	if c.sparse == nil {
		return SparseCacheStats{}
	}
	return c.sparse.Stats()
}

// sparseRetransmit answers a sparse MSG_RETRANSMIT (encoding ENC_SPARSE_HOT; seq the iteration,
// agg_index the first update packet asked for, bitmap0 which of the 32 from there) from the
// worker id's binding: the cached packets it has, flagged F_CACHED, to the binding alone. It
// reports whether it sent any; a miss is answered with MSG_ACK by the caller, and the worker
// resends its iteration to the PS.
func (c *ControlServer) sparseRetransmit(h wire.Header, to netip.AddrPort) (bool, error) {
	if c.sparse == nil {
		return false, nil
	}
	pkts := c.sparse.Get(h.JobId, h.Seq, h.AggIndex, h.Bitmap0)
	for _, p := range pkts {
		out := append([]byte(nil), p...)
		wire.SetPacketFlags(out, wire.PacketFlags(out)|wire.FlagCached)
		if err := c.send(out, to); err != nil {
			return true, fmt.Errorf("send cached sparse update: %w", err)
		}
	}
	return len(pkts) > 0, nil
}
