package agent

import (
	"fmt"
	"sync"
	"time"

	"github.com/xdpagg/xdpagg/bpf"

	"github.com/xdpagg/xdpagg/wire"
)

// ResultCache is the switch CPU's copy of completed in-switch sums (Libra §3.6): the XDP program
// copies every sum it completes (not the PS's results, which it only broadcasts) into the
// `results` ring buffer, the agent keeps it here until every worker of the job has acknowledged
// it (or it ages out), and a worker that lost a result asks for it with MSG_RETRANSMIT instead of
// making the switch (and its partners) redo work.
//
// The shadow copy in the slot answers most losses too; the cache still answers after the slot
// was taken by another fragment or job, and it answers without touching the data path.
//
// Its size limit is shared fairly among jobs: a result over the limit pushes out the oldest
// result of the job holding the most (the storing job's own on a tie), so a job whose results
// go unacknowledged (a tenant that never ACKs, or floods sums of its own) evicts its own, and a
// job holding no more than the others never loses a result to another job's.
type ResultCache struct {
	mu      sync.Mutex
	maxAge  time.Duration
	maxSize int
	entries map[cacheKey]*cacheEntry
	jobs    map[uint32]*jobAcks
	order   keyQueue // every stored key, oldest first: age and size eviction pop from its front
	st      bpf.XdpaggCacheStats
}

// keyQueue is a FIFO of cache keys in storing order. Removed entries are skipped lazily, so
// eviction costs what it evicts, not a scan of the cache.
type keyQueue struct {
	keys []cacheKey
	head int
}

func (q *keyQueue) push(k cacheKey) { q.keys = append(q.keys, k) }

// front returns the oldest key still in entries, dropping those that are gone.
func (q *keyQueue) front(entries map[cacheKey]*cacheEntry) (cacheKey, *cacheEntry, bool) {
	for q.head < len(q.keys) {
		k := q.keys[q.head]
		if e, ok := entries[k]; ok {
			return k, e, true
		}
		q.pop()
	}
	return cacheKey{}, nil, false
}

// compact drops the keys no longer in entries, and the later copies of a key stored twice,
// keeping the others in order.
func (q *keyQueue) compact(entries map[cacheKey]*cacheEntry) {
	live := q.keys[:0]
	seen := make(map[cacheKey]bool, len(q.keys)-q.head)
	for _, k := range q.keys[q.head:] {
		if _, ok := entries[k]; ok && !seen[k] {
			seen[k] = true
			live = append(live, k)
		}
	}
	clear(q.keys[len(live):])
	q.keys, q.head = live, 0
}

func (q *keyQueue) pop() {
	q.head++
	if q.head > 64 && q.head*2 > len(q.keys) { // compact: keep the backing array bounded
		q.keys = append(q.keys[:0], q.keys[q.head:]...)
		q.head = 0
	}
}

type cacheKey struct{ job, seq uint32 }

type cacheEntry struct {
	pkt  []byte // header + values as on the wire (MSG_RESULT, little-endian)
	want uint32 // workers that must acknowledge it: every worker of the fan-in
	at   time.Time
}

// jobAcks holds each worker's cumulative acknowledgement (it has every result of seq < upTo),
// and the job's cached keys in storing order, which is about seq order: acknowledgement
// eviction pops from the front until the first result some worker still lacks.
type jobAcks struct {
	upTo  map[uint8]uint32
	order keyQueue
	n     int // results of the job in the cache: its share of the size limit
}

// NewResultCache makes a cache that keeps results at most maxAge and holds at most maxEntries.
func NewResultCache(maxAge time.Duration, maxEntries int) *ResultCache {
	return &ResultCache{maxAge: maxAge, maxSize: maxEntries, entries: map[cacheKey]*cacheEntry{}, jobs: map[uint32]*jobAcks{}}
}

// errBadRecord reports a ring-buffer record that is not a result.
var errBadRecord = fmt.Errorf("malformed result record")

// Store takes one `results` ring-buffer record (struct result_rec).
func (c *ResultCache) Store(rec []byte, now time.Time) error {
	if len(rec) < wire.HdrSize {
		return fmt.Errorf("%w: %d bytes", errBadRecord, len(rec))
	}
	var h wire.Header
	wire.DecodeHeader(rec, &h)
	n := wire.HdrSize + 4*int(h.Count)
	if h.Type != wire.MsgResult || h.Count == 0 || int(h.Count) > wire.MaxValues || n > len(rec) {
		return fmt.Errorf("%w: type %d count %d in %d bytes", errBadRecord, h.Type, h.Count, len(rec))
	}
	// Every worker of the job must acknowledge it, not only its contributors: with a
	// threshold H below the fan-in (asynchronous aggregation) a slow worker that is not in the
	// sum still needs the result, and may have to ask for it here.
	// (A Go shift of 32 or more gives 0, so a fan-in of 32 wants every bit.)
	_, fan := h.LevelBits()
	want := uint32(1)<<fan - 1
	c.mu.Lock()
	defer c.mu.Unlock()
	k := cacheKey{h.JobId, h.Seq}
	// Drop what a worker already acknowledged having (a late copy of an old result).
	if c.ackedByAll(h.JobId, h.Seq, want) {
		c.st.Stored++
		c.st.EvictedAcked++
		return nil
	}
	ja := c.job(h.JobId)
	if old, ok := c.entries[k]; ok {
		c.st.Bytes -= uint64(len(old.pkt))
		c.st.Entries--
	} else {
		ja.n++
	}
	c.entries[k] = &cacheEntry{pkt: append([]byte(nil), rec[:n]...), want: want, at: now}
	c.order.push(k)
	ja.order.push(k)
	c.st.Stored++
	c.st.Entries++
	c.st.Bytes += uint64(n)
	if c.maxSize > 0 && len(c.entries) > c.maxSize {
		c.evictLargest(h.JobId)
	}
	// Keys evicted from a job's queue stay in the age queue until they reach its front; a job's
	// result held there (up to maxAge) must not let them pile up. Likewise keys aged out stay in
	// their job's queue until an ACK or a size eviction reaches them: a job that never ACKs would
	// grow it by a key per result for ever.
	c.order.compactIf(len(c.entries), c.entries)
	ja.order.compactIf(ja.n, c.entries)
	return nil
}

// compactIf compacts q once it holds more than twice its live keys (and 1,024 more): the cost
// of compacting is then paid by the stores that queued the dead keys.
func (q *keyQueue) compactIf(live int, entries map[cacheKey]*cacheEntry) {
	if len(q.keys)-q.head > 2*live+1024 {
		q.compact(entries)
	}
}

// Get returns the cached result <job, seq> for a retransmit request, counting a hit or a miss.
func (c *ResultCache) Get(job, seq uint32) ([]byte, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.entries[cacheKey{job, seq}]
	if !ok {
		c.st.Misses++
		return nil, false
	}
	c.st.Hits++
	return e.pkt, true
}

// Ack records that worker id of job has every result with seq before upTo (serial arithmetic),
// and evicts what all of the job's workers now have.
func (c *ResultCache) Ack(job uint32, id uint8, upTo uint32) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.st.Acks++
	ja := c.job(job)
	if old, ok := ja.upTo[id]; ok && int32(upTo-old) <= 0 {
		return // stale or repeated watermark
	}
	ja.upTo[id] = upTo
	for {
		k, e, ok := ja.order.front(c.entries)
		if !ok || !c.ackedByAll(job, k.seq, e.want) {
			return
		}
		c.remove(k, e)
		ja.order.pop()
		c.st.EvictedAcked++
	}
}

// job returns job's acknowledgement state, made on first use. Called with mu held.
func (c *ResultCache) job(job uint32) *jobAcks {
	ja := c.jobs[job]
	if ja == nil {
		ja = &jobAcks{upTo: map[uint8]uint32{}}
		c.jobs[job] = ja
	}
	return ja
}

// ackedByAll: every worker in want has acknowledged <job, seq>. Called with mu held.
func (c *ResultCache) ackedByAll(job, seq, want uint32) bool {
	ja := c.jobs[job]
	if ja == nil || want == 0 {
		return false
	}
	for id := range uint8(wire.MaxWorkers) {
		if want&(1<<id) == 0 {
			continue
		}
		up, ok := ja.upTo[id]
		if !ok || int32(seq-up) >= 0 {
			return false
		}
	}
	return true
}

// Sweep evicts results older than the cache's maximum age.
func (c *ResultCache) Sweep(now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for {
		k, e, ok := c.order.front(c.entries)
		if !ok || now.Sub(e.at) <= c.maxAge {
			return
		}
		c.remove(k, e)
		c.order.pop()
		c.st.EvictedAge++
	}
}

// ForgetJob drops a job's cached results and acknowledgement state: the job was removed (or
// removed and admitted again, whose results and sequence numbers start afresh).
func (c *ResultCache) ForgetJob(job uint32) { c.ForgetJobs(func(j uint32) bool { return j == job }) }

// ForgetJobs is ForgetJob for every job drop returns true for. Dropped results count as evicted
// unacknowledged (EvictedAge).
func (c *ResultCache) ForgetJobs(drop func(job uint32) bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for id, ja := range c.jobs {
		if !drop(id) {
			continue
		}
		// Every stored key is in its job's queue (those gone already are skipped).
		for _, k := range ja.order.keys[ja.order.head:] {
			if e, ok := c.entries[k]; ok {
				c.remove(k, e)
				c.st.EvictedAge++
			}
		}
		delete(c.jobs, id)
	}
}

// Stats returns the cache's counters.
func (c *ResultCache) Stats() bpf.XdpaggCacheStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.st
}

func (c *ResultCache) remove(k cacheKey, e *cacheEntry) {
	delete(c.entries, k)
	c.st.Entries--
	c.st.Bytes -= uint64(len(e.pkt))
	if ja := c.jobs[k.job]; ja != nil {
		ja.n--
	}
}

// evictLargest drops the oldest result of the job holding the most, storing's own on a tie
// (size limit): each job's results push out its own before another job's.
func (c *ResultCache) evictLargest(storing uint32) {
	big := c.jobs[storing]
	for _, ja := range c.jobs {
		if ja.n > big.n {
			big = ja
		}
	}
	if k, e, ok := big.order.front(c.entries); ok {
		c.remove(k, e)
		big.order.pop()
		c.st.EvictedAge++
	}
}

// Export returns copies of the cached results (struct result_rec as stored: header and values),
// oldest first: what a standby switch's cache takes over (Import) when the controller moves the
// switch's jobs there. Acknowledgements are not exported: the standby learns them from the
// workers' next ACKs, and until then keeps the results (or ages them out).
func (c *ResultCache) Export() [][]byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([][]byte, 0, len(c.entries))
	seen := make(map[cacheKey]bool, len(c.entries))
	for _, k := range c.order.keys[c.order.head:] {
		if e, ok := c.entries[k]; ok && !seen[k] { // a key stored twice is queued twice
			seen[k] = true
			out = append(out, append([]byte(nil), e.pkt...))
		}
	}
	return out
}
