package hostlib

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/wire"
)

// PS defaults and limits.
const (
	DefaultResultTTL  = 5 * time.Second
	DefaultStaleAfter = 30 * time.Second
	DefaultMaxEntries = 16384
	// MaxShards bounds PSConfig.Shards: one socket, receive goroutine and ~100 KB of batch
	// buffers each.
	MaxShards = 1024
)

// PSConfig configures a parameter server. Zero fields take their defaults (WithDefaults).
//
// Who may contribute: the PS sums DATA only of the jobs in Jobs, and of each only from its
// members, the way the switch admits them: worker_id w of job j must be Jobs[j].Workers[w], and
// the packet's source address (and port, unless the member's is 0) must be that member's. This
// holds for every DATA packet, including the partial aggregates the switch flushes on a resend
// (they keep the resender's source and worker_id) and collided fragments (forwarded unchanged).
// Anything else is dropped and counted (PSStats.UnknownJob, NotMember), so a host outside a job
// can neither add to its sums nor read them (the PS answers duplicate contributions with the
// stored result) nor occupy its memory. Without Jobs, NewPS fails unless Open is set.
//
// Memory per job: each job of Jobs gets an equal share, MaxEntries/len(Jobs), of the entries the
// PS holds (aggregations in progress and completed results kept for ResultTTL). A job at its
// share makes room only by dropping its own oldest completed result; if all its entries are
// still aggregating, its new fragments are dropped (PSStats.OverQuota) and its workers
// retransmit. No job ever evicts another's entries, so a tenant that floods the PS (F_RESEND
// DATA for ever new seqs, say) fills its own share and nothing else.
type PSConfig struct {
	Listen netip.AddrPort // PS address; its port is the agg port (port 0: wire.DefaultPort)
	// Switch is where results go: the switch's IP on the PS's subnet and the agg port (port 0:
	// Listen's port). The switch broadcasts them to the job's workers. Unused with Direct.
	Switch netip.AddrPort
	// Direct sends every completed sum straight back to each of its contributors (unicast, one
	// sendmmsg batch) instead of to Switch: the PS alone, with no switch help (the "ps"
	// baseline). The PS learns each contributor's address from the source address of its
	// contributions, per job and bitmap bit, so workers need no configuration beyond PS. Data
	// must then reach the PS on a port the switch does not intercept.
	Direct bool
	// Shards is how many sockets share Listen (SO_REUSEPORT), each with its own receive
	// goroutine, so the PS uses that many cores (default runtime.NumCPU()). The kernel spreads
	// workers over the sockets by flow; aggregation state is split into independently locked
	// tables by (job, seq), so the goroutines rarely wait for one another.
	Shards int
	// ResultTTL is how long a completed result is kept to answer retransmissions (default 5s).
	ResultTTL time.Duration
	// StaleAfter drops an incomplete aggregation untouched this long (default 30s): its workers
	// gave up or finished through the switch.
	StaleAfter time.Duration
	// SocketBuffer sizes SO_RCVBUF/SO_SNDBUF in bytes (default 8 MiB), per shard.
	SocketBuffer int
	// MaxEntries bounds the aggregations and results held at once (default 16384; about 1.5 KB
	// per result, 3-16 KB per aggregation in progress), split into equal shares among Jobs (at
	// least one entry each; see above). When a job's share (with Open: the whole) is full, an
	// old result of the same job goes first (the oldest of its table: tables are not globally
	// ordered); if every entry is still aggregating, new fragments are dropped (PSStats.OverQuota;
	// with Open, PSStats.Dropped) and their workers retransmit.
	MaxEntries int
	// PoolSize is the switch's slot pool. With it, a fragment that reached the PS through a
	// collision gets a new slot for its offset (ATP's rehash, F_REHASH; see slots.go). 0: no
	// rehash. Unused with Direct.
	PoolSize uint32
	// Jobs are the jobs this PS serves and their members (see above): the same jobs, worker ids
	// and worker addresses the switch admitted (`xdpagg job add`, and each worker's JOIN or
	// static member). Required unless Open.
	Jobs []PSJob
	// Open accepts DATA of any job from any source, with MaxEntries shared by everyone, as
	// before jobs were admitted: for the user-space PS baseline (Direct, no switch, one trusted
	// tenant on a private network; the benchmark's "ps" mode). Never behind a shared switch:
	// any host that can reach Listen can then add to any job's sums, read them, and crowd out
	// its memory. Exclusive with Jobs.
	Open bool
}

// PSJob is one job a PS serves and its members.
type PSJob struct {
	ID uint32 // the job id, nonzero
	// Workers are the job's members, indexed by worker id; their number is the job's fan-in
	// (level-0 DATA must carry fan_in0 = len(Workers)). Each is the IPv4 address and UDP port
	// the worker sends from; port 0 accepts any port from that address (a worker bound to an
	// ephemeral port; weaker: any process on that host may then contribute).
	Workers []netip.AddrPort
	// Threshold is the job's H (asynchronous aggregation, as admitted at the switch: `xdpagg
	// job add --threshold`): a level-0 fragment completes once H distinct workers contributed,
	// 1..len(Workers); 0 is len(Workers). Contributions reaching a completed fragment are
	// answered with its result (F_SHADOW), the sum without them, as at the switch. A SETH at
	// the switch does not reach the PS: change it here too (PS.SetThreshold).
	Threshold uint8
}

// WithDefaults returns c with zero fields set to their defaults and addresses unmapped to IPv4.
func (c PSConfig) WithDefaults() PSConfig {
	port := c.Listen.Port()
	if port == 0 {
		port = wire.DefaultPort
	}
	c.Listen = netip.AddrPortFrom(c.Listen.Addr().Unmap(), port)
	sport := c.Switch.Port()
	if sport == 0 {
		sport = port
	}
	c.Switch = netip.AddrPortFrom(c.Switch.Addr().Unmap(), sport)
	if c.Shards == 0 {
		c.Shards = runtime.NumCPU()
	}
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
	if c.Jobs != nil {
		jobs := make([]PSJob, len(c.Jobs))
		for j, pj := range c.Jobs {
			jobs[j] = PSJob{ID: pj.ID, Workers: make([]netip.AddrPort, len(pj.Workers)), Threshold: pj.Threshold}
			for i, a := range pj.Workers {
				jobs[j].Workers[i] = netip.AddrPortFrom(a.Addr().Unmap(), a.Port())
			}
		}
		c.Jobs = jobs
	}
	return c
}

// Validate reports what to change in a configuration that cannot work. Call it on WithDefaults'
// result (NewPS does).
func (c PSConfig) Validate() error {
	switch {
	case !c.Listen.Addr().Is4():
		return fmt.Errorf("%w: Listen %v: use an IPv4 address (xdpagg is UDP/IPv4)", ErrConfig, c.Listen)
	case !c.Direct && (!c.Switch.Addr().Is4() || c.Switch.Addr().IsUnspecified()):
		return fmt.Errorf("%w: Switch %v: use the switch's IPv4 address on the PS's subnet (or set Direct to answer workers without a switch)", ErrConfig, c.Switch)
	case c.Shards < 1 || c.Shards > MaxShards:
		return fmt.Errorf("%w: Shards %d: use 1..%d (about one per core)", ErrConfig, c.Shards, MaxShards)
	case c.ResultTTL < time.Millisecond:
		return fmt.Errorf("%w: ResultTTL %v: use at least 1ms (longer than the workers' retransmit timeout)", ErrConfig, c.ResultTTL)
	case c.StaleAfter < time.Millisecond:
		return fmt.Errorf("%w: StaleAfter %v: use at least 1ms", ErrConfig, c.StaleAfter)
	case c.SocketBuffer < 0 || c.SocketBuffer > math.MaxInt32:
		return fmt.Errorf("%w: SocketBuffer %d: use 0..%d bytes", ErrConfig, c.SocketBuffer, math.MaxInt32)
	case c.MaxEntries < 1:
		return fmt.Errorf("%w: MaxEntries %d: use at least 1", ErrConfig, c.MaxEntries)
	case c.Open && len(c.Jobs) > 0:
		return fmt.Errorf("%w: Open with %d Jobs: list the jobs' members in Jobs, or set Open for an unrestricted baseline PS, not both", ErrConfig, len(c.Jobs))
	case !c.Open && len(c.Jobs) == 0:
		return fmt.Errorf("%w: no Jobs: list each job's id and worker addresses in Jobs (only they may contribute), or set Open for a trusted single-tenant baseline", ErrConfig)
	case c.MaxEntries < len(c.Jobs):
		return fmt.Errorf("%w: MaxEntries %d for %d Jobs: use at least one entry per job (each job gets MaxEntries/len(Jobs))", ErrConfig, c.MaxEntries, len(c.Jobs))
	}
	ids := make(map[uint32]bool, len(c.Jobs))
	for j, pj := range c.Jobs {
		switch {
		case pj.ID == 0:
			return fmt.Errorf("%w: Jobs[%d].ID is 0: job ids are nonzero", ErrConfig, j)
		case ids[pj.ID]:
			return fmt.Errorf("%w: Jobs[%d].ID %d given twice", ErrConfig, j, pj.ID)
		case len(pj.Workers) == 0 || len(pj.Workers) > wire.MaxWorkers:
			return fmt.Errorf("%w: Jobs[%d] (job %d) has %d Workers: use 1..%d, one address per worker id", ErrConfig, j, pj.ID, len(pj.Workers), wire.MaxWorkers)
		}
		ids[pj.ID] = true
		for i, a := range pj.Workers {
			if !a.Addr().Is4() || a.Addr().IsUnspecified() {
				return fmt.Errorf("%w: Jobs[%d] (job %d) Workers[%d] %v: use the worker's IPv4 address and UDP port (port 0: any)", ErrConfig, j, pj.ID, i, a)
			}
		}
	}
	return nil
}

// PSStats are a PS's cumulative counters. Every received datagram counts in Received and in
// exactly one of Aggregated, Duplicates, Malformed, Dropped, UnknownJob, NotMember, OverQuota and
// Unsupported.
type PSStats struct {
	Received      uint64 // datagrams received
	Aggregated    uint64 // data packets summed into an aggregation
	Duplicates    uint64 // data packets whose contributors were already summed
	Completed     uint64 // sums completed and sent to the switch (Direct: to their contributors)
	ResultsResent uint64 // of Duplicates: completed results re-sent to the packet's sender
	Malformed     uint64 // not a valid DATA packet, or disagreeing with its aggregation (count, fan-in, scale)
	Overflows     uint64 // of Completed: fixed-point sums sent with F_OVERFLOW for float repair
	Stale         uint64 // incomplete aggregations dropped after StaleAfter
	Dropped       uint64 // Open: data packets dropped because MaxEntries aggregations were in progress
	// Unaddressed counts, in Direct mode, results not sent to a contributor whose address is
	// unknown (it only ever contributed inside a multi-bit partial sum); it gets the result when
	// it retransmits.
	Unaddressed uint64
	Rehashes    uint64 // of Completed: collided fragments whose result moved their offset to a new slot (F_REHASH)
	UnknownJob  uint64 // DATA of a job not in PSConfig.Jobs: dropped
	// NotMember counts DATA of a known job whose worker_id is not one of its members, or whose
	// source address or port is not that member's: dropped.
	NotMember uint64
	// OverQuota counts new fragments dropped because their job held its share of MaxEntries, all
	// still aggregating: its workers retransmit.
	OverQuota uint64
	// Unsupported counts DATA from an admitted source whose encoding the PS cannot sum: anything
	// but ENC_FIXED32 and ENC_FLOAT32 (ENC_SPARSE_KV is reserved). Dropped.
	Unsupported uint64
}

type psCounters struct {
	received, aggregated, duplicates, completed, resent, malformed, overflows, stale, dropped, unaddressed, rehashes atomic.Uint64
	unknownJob, notMember, overQuota, unsupported                                                                    atomic.Uint64
}

// PS is the parameter server: it sums the fragments the switch could not (collisions, float32
// repairs, resends without a slot) and answers retransmissions of what it completed. In Direct
// mode it sums everything itself and answers the workers directly.
//
// Concurrency: Shards sockets bound to one address, each drained by its own goroutine (psSock).
// The contributions of one fragment may arrive on different sockets, so the aggregation state
// lives in tables (psTable) picked by a hash of (job, seq), each behind its own mutex: two
// goroutines contend only when they touch the same table at the same moment. A goroutine copies
// the results it must send out of the table into its own buffers, so no entry is pinned by a
// send queued on another goroutine and tables can recycle entries freely.
type PS struct {
	cfg      PSConfig
	socks    []*psSock
	tables   []psTable // len is a power of two
	switchSa unix.RawSockaddrInet4
	epoch    time.Time

	// Who may contribute and how much each may hold; read-only after NewPS. jobs is nil with
	// Open, whose one account is open.
	jobs  map[uint32]*psAdmitted
	open  *psAccount
	accts []*psAccount // every account, by index

	serving   atomic.Bool
	stop      atomic.Bool // ctx of Serve is done
	halt      atomic.Bool // one receive goroutine failed: the others stop too
	closeOnce sync.Once
	closed    atomic.Bool

	remapMu sync.Mutex
	remaps  map[uint32]*jobRemaps // ATP rehash state by job
}

// psSock is one shard's socket and what its receive goroutine owns.
type psSock struct {
	bc   *batchConn
	st   psCounters
	nout int
	// out holds the packets queued in the current send batch: completed results and re-sent
	// ones (F_SHADOW), at most one per datagram received.
	out [recvBatch][wire.MaxPacket]byte
}

// psAccount is the entry budget of one admitted job (or, with Open, of everyone).
type psAccount struct {
	idx   int          // index in PS.accts and in each table's done queues
	share int64        // entries it may hold
	n     atomic.Int64 // entries it holds, over all tables
	done  atomic.Int64 // of n, completed results (which can make room)
}

// psAdmitted is a job of PSConfig.Jobs.
type psAdmitted struct {
	acct      *psAccount
	members   []psMember    // by worker id
	threshold atomic.Uint32 // H (0: the fan-in); PSJob.Threshold, PS.SetThreshold
}

// SetThreshold changes job's H (see PSJob.Threshold) while the PS runs: fragments completing from
// then on complete at it. Keep it equal to the switch's (MSG_SETH, Worker.SetThreshold).
func (p *PS) SetThreshold(job uint32, h uint8) error {
	a := p.jobs[job]
	if a == nil || int(h) > len(a.members) {
		return fmt.Errorf("%w: %d for job %d", ErrThreshold, h, job)
	}
	a.threshold.Store(uint32(h))
	return nil
}

// psMember is where a worker may send from: address, and port unless anyPort.
type psMember struct {
	addr    [4]byte
	port    uint16 // network byte order, as in unix.RawSockaddrInet4
	anyPort bool
}

// admits reports whether a datagram from `from` may come from member m.
func (m *psMember) admits(from *unix.RawSockaddrInet4) bool {
	return from.Family == unix.AF_INET && from.Addr == m.addr && (m.anyPort || from.Port == m.port)
}

// psTable is one lock's share of the aggregation state.
type psTable struct {
	mu      sync.Mutex
	entries map[psKey]*psEntry
	jobs    map[uint32]*psJob // Direct: where each job's contributors are
	// done holds the completed entries per account (PS.accts), oldest first: they expire, and
	// make room for their own account's new aggregations, in this order.
	done    []psDoneQueue
	freeE   []*psEntry
	freeFix []*fixedAcc
	freeFlt []*floatAcc
	_       [64]byte // keep neighbouring tables' locks off one cache line
}

// psDoneQueue is a FIFO of completed entries: q[head:].
type psDoneQueue struct {
	q    []*psEntry
	head int
}

// psJob records, in Direct mode, the address each contributor (bitmap bit) of a job sends from,
// learnt from its single-contributor packets: results go back there.
type psJob struct {
	known uint32 // bits whose address is known
	used  int64  // ns since epoch of the last contribution
	addrs [wire.MaxWorkers]unix.RawSockaddrInet4
}

// Aggregations are keyed by (job, seq, encoding): a fragment's fixed-point sum and its float32
// repair are separate sums, and the fixed one's result must keep answering late retransmissions.
type psKey struct {
	job, seq uint32
	enc      uint8
}

type psEntry struct {
	key      psKey
	acct     *psAccount  // whose share it counts in
	tmpl     wire.Header // first contribution's header: the result's header template
	bitmap   uint32
	fanIn    uint8
	level1   bool
	flags    uint16 // F_ECN | F_OVERFLOW | F_COLLISION seen in contributions
	complete bool
	touched  int64  // ns since epoch: last contribution, or completion
	job      *psJob // Direct only
	fix      *fixedAcc
	flt      *floatAcc
	plen     int
	pkt      [wire.MaxPacket]byte // the result, once complete
}

type fixedAcc [wire.MaxValues]int64

type floatAcc struct {
	sum [wire.MaxValues]exactSum
	sp  [wire.MaxValues]uint8
}

// NewPS validates cfg and binds the PS's sockets now, in the calling thread's network namespace.
// Serve processes packets.
func NewPS(cfg PSConfig) (*PS, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	// A result goes to one address, or in Direct mode to each of up to 32 contributors.
	sbatch := recvBatch
	if cfg.Direct {
		sbatch = recvBatch * wire.MaxWorkers
	}
	p := &PS{cfg: cfg, epoch: time.Now(), remaps: map[uint32]*jobRemaps{}}
	if !cfg.Direct {
		p.switchSa = sockaddr4(cfg.Switch)
	}
	if cfg.Open {
		p.open = &psAccount{share: int64(cfg.MaxEntries)}
		p.accts = []*psAccount{p.open}
	} else {
		p.jobs = make(map[uint32]*psAdmitted, len(cfg.Jobs))
		share := int64(cfg.MaxEntries / len(cfg.Jobs))
		for j, pj := range cfg.Jobs {
			a := &psAdmitted{acct: &psAccount{idx: j, share: share}}
			a.threshold.Store(uint32(pj.Threshold))
			for _, w := range pj.Workers {
				sa := sockaddr4(w)
				a.members = append(a.members, psMember{addr: sa.Addr, port: sa.Port, anyPort: w.Port() == 0})
			}
			p.jobs[pj.ID] = a
			p.accts = append(p.accts, a.acct)
		}
	}
	for i := 0; i < cfg.Shards; i++ {
		bc, err := listenBatchOpt(cfg.Listen, cfg.SocketBuffer, recvBatch, sbatch, cfg.Shards > 1)
		if err != nil {
			for _, s := range p.socks {
				s.bc.close()
			}
			return nil, fmt.Errorf("parameter server, socket %d of %d: %w", i+1, cfg.Shards, err)
		}
		// Results to the switch (or to one worker) come in runs of one size: send them with UDP
		// GSO where the kernel allows, as the worker does.
		bc.enableGSO()
		p.socks = append(p.socks, &psSock{bc: bc})
	}
	// Several tables per goroutine, so two goroutines rarely want the same one at once.
	ntab := 16
	for ntab < 4*cfg.Shards {
		ntab *= 2
	}
	p.tables = make([]psTable, ntab)
	for i := range p.tables {
		p.tables[i].entries = make(map[psKey]*psEntry)
		p.tables[i].jobs = make(map[uint32]*psJob)
		p.tables[i].done = make([]psDoneQueue, len(p.accts))
	}
	return p, nil
}

// LocalAddr is the address the PS is bound to.
func (p *PS) LocalAddr() netip.AddrPort { return p.socks[0].bc.localAddr() }

// Config returns the PS's configuration with defaults applied.
func (p *PS) Config() PSConfig { return p.cfg }

// Stats returns the PS's cumulative counters.
func (p *PS) Stats() PSStats {
	var t PSStats
	for _, sk := range p.socks {
		s := &sk.st
		t.Received += s.received.Load()
		t.Aggregated += s.aggregated.Load()
		t.Duplicates += s.duplicates.Load()
		t.Completed += s.completed.Load()
		t.ResultsResent += s.resent.Load()
		t.Malformed += s.malformed.Load()
		t.Overflows += s.overflows.Load()
		t.Stale += s.stale.Load()
		t.Dropped += s.dropped.Load()
		t.Unaddressed += s.unaddressed.Load()
		t.Rehashes += s.rehashes.Load()
		t.UnknownJob += s.unknownJob.Load()
		t.NotMember += s.notMember.Load()
		t.OverQuota += s.overQuota.Load()
		t.Unsupported += s.unsupported.Load()
	}
	return t
}

// Close closes the sockets; a running Serve returns ErrClosed. Closing twice returns ErrClosed.
func (p *PS) Close() error {
	err := ErrClosed
	p.closeOnce.Do(func() {
		p.closed.Store(true)
		err = nil
		for _, s := range p.socks {
			if e := s.bc.close(); e != nil && err == nil {
				err = e
			}
		}
	})
	return err
}

// errHalted: a receive goroutine stopped because another one failed first.
var errHalted = errors.New("halted")

// Serve receives and sums data packets until ctx is done (it returns ctx's error, wrapped) or
// the PS is closed (ErrClosed). It runs one receive goroutine per shard. Only one Serve may run
// at a time (ErrBusy).
func (p *PS) Serve(ctx context.Context) error {
	if !p.serving.CompareAndSwap(false, true) {
		return fmt.Errorf("%w: the parameter server is already serving", ErrBusy)
	}
	defer p.serving.Store(false)
	if p.closed.Load() {
		return fmt.Errorf("serve: %w", ErrClosed)
	}
	p.stop.Store(false)
	p.halt.Store(false)
	// Cancellation interrupts the blocked receives through their deadlines, and the stop flag
	// tells that apart from the eviction tick (each loop re-arms its deadline, then checks the
	// flag).
	stopWatch := context.AfterFunc(ctx, func() {
		p.stop.Store(true)
		p.poke()
	})
	defer stopWatch()

	errs := make(chan error, len(p.socks))
	for g := range p.socks {
		go func() { errs <- p.serveSock(ctx, g) }()
	}
	// The first goroutine to return says why Serve ends; the others are then told to stop.
	first := <-errs
	p.halt.Store(true)
	p.poke()
	for range len(p.socks) - 1 {
		if err := <-errs; errors.Is(first, errHalted) {
			first = err
		}
	}
	return first
}

// poke wakes every receive goroutine by passing its read deadline.
func (p *PS) poke() {
	for _, s := range p.socks {
		_ = s.bc.conn.SetReadDeadline(time.Unix(1, 0))
	}
}

// serveSock is receive goroutine g: it drains socket g and evicts tables g, g+Shards, ...
func (p *PS) serveSock(ctx context.Context, g int) error {
	s := p.socks[g]
	tick := min(p.cfg.ResultTTL, p.cfg.StaleAfter) / 4
	tick = min(max(tick, time.Millisecond), time.Second)
	nextTick := time.Now().Add(tick)
	if err := s.bc.conn.SetReadDeadline(nextTick); err != nil {
		return p.serveErr(ctx, err)
	}
	for {
		if p.stop.Load() {
			return fmt.Errorf("serve: %w", ctx.Err())
		}
		if p.halt.Load() {
			return errHalted
		}
		n, err := s.bc.recv()
		if err != nil && !isTimeout(err) {
			if transientRecv(err) {
				continue
			}
			return p.serveErr(ctx, err)
		}
		now := time.Now()
		nowNs := int64(now.Sub(p.epoch))
		for i := 0; i < n; i++ {
			p.handle(s, i, nowNs)
		}
		if err := s.flush(); err != nil {
			return p.serveErr(ctx, err)
		}
		if !now.Before(nextTick) {
			for t := g; t < len(p.tables); t += len(p.socks) {
				p.evict(&p.tables[t], s, nowNs)
			}
			nextTick = now.Add(tick)
			if err := s.bc.conn.SetReadDeadline(nextTick); err != nil {
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
func (s *psSock) flush() error {
	s.nout = 0
	if s.bc.sq == 0 {
		return nil
	}
	// A result the kernel refuses is like one lost on the wire: the workers retransmit and get
	// it from the stored copy.
	_, _, err := s.bc.flush()
	return err
}

// table returns the table of a (job, seq): consecutive fragments land in different tables, so
// a window of them in flight spreads over all the locks.
func (p *PS) table(k psKey) *psTable {
	h := (k.seq ^ k.job*0x9e3779b9) * 0x85ebca6b
	return &p.tables[(h>>16)&uint32(len(p.tables)-1)]
}

// handle processes datagram i of s's last receive batch. The checks run in this order, each
// with its counter: a well-formed DATA packet (Malformed), of an admitted job (UnknownJob), from
// the member its worker_id names (NotMember), in an encoding the PS sums (Unsupported), with the
// job's fan-in (Malformed), room in the job's share for a new aggregation (OverQuota; Open:
// Dropped), agreeing with the aggregation it joins (Malformed).
func (p *PS) handle(s *psSock, i int, now int64) {
	st := &s.st
	st.received.Add(1)
	b, err := s.bc.rpkt(i)
	if err != nil {
		st.malformed.Add(1)
		return
	}
	h, vals, err := wire.ParsePacket(b)
	// An unknown encoding (wire.ErrEncoding) and the sparse encodings, which SparsePS serves, are
	// not this PS's; their header still names a sender that can be checked, and they are
	// counted as unsupported rather than malformed.
	unsupported := err == wire.ErrEncoding ||
		(len(b) >= wire.HdrSize && h.Version == wire.Version && h.Reserved == 0 && h.Type == wire.MsgData && wire.Sparse(h.Encoding))
	if (err != nil && !unsupported) || h.Type != wire.MsgData {
		st.malformed.Add(1)
		return
	}
	bm, fan := h.LevelBits()
	level1 := h.Flags&wire.FlagLevel1 != 0
	acct := p.open
	need := int(fan)
	if p.jobs != nil {
		job := p.jobs[h.JobId]
		if job == nil {
			st.unknownJob.Add(1)
			return
		}
		if int(h.WorkerId) >= len(job.members) || !job.members[h.WorkerId].admits(s.bc.rfrom(i)) {
			st.notMember.Add(1)
			return
		}
		if unsupported {
			st.unsupported.Add(1)
			return
		}
		if !level1 && int(fan) != len(job.members) {
			st.malformed.Add(1) // the job's fan-in is its member count, as at the switch
			return
		}
		acct = job.acct
		if th := int(job.threshold.Load()); !level1 && th > 0 && th < need {
			need = th // asynchronous: H distinct contributions complete it, as at the switch
		}
	} else if unsupported {
		st.unsupported.Add(1)
		return
	}
	key := psKey{job: h.JobId, seq: h.Seq, enc: h.Encoding}
	t := p.table(key)
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.entries[key]
	if e == nil {
		if !p.admit(t, acct) {
			if acct == p.open {
				st.dropped.Add(1)
			} else {
				st.overQuota.Add(1)
			}
			return
		}
		e = p.newEntry(t, key, acct, &h, now)
	} else if e.tmpl.Count != h.Count || e.fanIn != fan || e.level1 != level1 ||
		(h.Encoding == wire.EncFixed32 && e.tmpl.ScaleLog2 != h.ScaleLog2) {
		st.malformed.Add(1) // cannot be summed with what is there
		return
	}
	if e.job != nil && bits.OnesCount32(bm) == 1 {
		// Learn (or update: a restarted worker has a new port) where this contributor is.
		src := s.bc.rfrom(i)
		j, bit := e.job, bits.TrailingZeros32(bm)
		if j.known&bm == 0 || j.addrs[bit] != *src {
			j.addrs[bit] = *src
			j.known |= bm
		}
		j.used = now
	}

	if e.bitmap&bm != 0 || e.complete {
		// Already summed (a retransmission, or a partial sum overlapping one we have), or late
		// for a sum completed at the threshold H: it adds nothing. If the sum is complete the
		// sender evidently missed it: answer it alone, straight to its address, like the
		// switch's shadow copy.
		st.duplicates.Add(1)
		if e.complete {
			p.resend(s, e, s.bc.rfrom(i))
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
	e.flags |= h.Flags & (wire.FlagECN | wire.FlagOverflow | wire.FlagCollision)
	e.touched = now
	st.aggregated.Add(1)
	if bits.OnesCount32(e.bitmap) >= need {
		p.complete(s, t, e, now)
	}
}

// rehash picks a new slot for the offset of a collided fragment (header h: its job, seq and, in
// bitmap1, its workers' window).
func (p *PS) rehash(h *wire.Header) (uint32, bool) {
	pool, win := p.cfg.PoolSize, h.Bitmap1
	if pool == 0 || p.cfg.Direct || win == 0 || 2*win >= pool {
		return 0, false
	}
	p.remapMu.Lock()
	defer p.remapMu.Unlock()
	r := p.remaps[h.JobId]
	if r == nil || r.window != win {
		r = &jobRemaps{window: win, targets: map[uint32]uint32{}, owner: map[uint32]uint32{}}
		p.remaps[h.JobId] = r
	}
	return r.pick(h.JobId, h.Seq, h.Seq%(2*win), SlotBase(h.JobId, pool), pool)
}

// admit makes room for one more entry of account a in t (whose lock is held), within a's share.
func (p *PS) admit(t *psTable, a *psAccount) bool {
	if a.n.Add(1) <= a.share || p.makeRoom(t, a) {
		return true
	}
	a.n.Add(-1)
	return false
}

// makeRoom frees a completed result of account a (never another's) to admit a new aggregation
// of a: a's oldest in t if it has one, else a's oldest in another table that is free at the
// moment. TryLock, because the caller holds t's lock: waiting for a second lock could deadlock
// with a goroutine doing the same the other way round.
func (p *PS) makeRoom(t *psTable, a *psAccount) bool {
	if a.done.Load() == 0 {
		return false // all still aggregating: a flood over its share costs no table scan
	}
	if q := &t.done[a.idx]; q.len() > 0 {
		p.release(t, q.pop())
		return true
	}
	for i := range p.tables {
		o := &p.tables[i]
		if o == t || !o.mu.TryLock() {
			continue
		}
		q := &o.done[a.idx]
		ok := q.len() > 0
		if ok {
			p.release(o, q.pop())
		}
		o.mu.Unlock()
		if ok {
			return true
		}
	}
	return false
}

func (p *PS) newEntry(t *psTable, key psKey, a *psAccount, h *wire.Header, now int64) *psEntry {
	var e *psEntry
	if k := len(t.freeE); k > 0 {
		e = t.freeE[k-1]
		t.freeE = t.freeE[:k-1]
	} else {
		e = new(psEntry)
	}
	_, fan := h.LevelBits()
	e.key, e.acct, e.tmpl, e.bitmap, e.fanIn, e.level1 = key, a, *h, 0, fan, h.Flags&wire.FlagLevel1 != 0
	e.flags, e.complete, e.touched, e.plen, e.job = 0, false, now, 0, nil
	if p.cfg.Direct {
		j := t.jobs[key.job]
		if j == nil {
			j = new(psJob)
			t.jobs[key.job] = j
		}
		j.used = now
		e.job = j
	}
	if key.enc == wire.EncFixed32 {
		if k := len(t.freeFix); k > 0 {
			e.fix = t.freeFix[k-1]
			t.freeFix = t.freeFix[:k-1]
		} else {
			e.fix = new(fixedAcc)
		}
		clear(e.fix[:h.Count])
	} else {
		if k := len(t.freeFlt); k > 0 {
			e.flt = t.freeFlt[k-1]
			t.freeFlt = t.freeFlt[:k-1]
		} else {
			e.flt = new(floatAcc)
		}
		clear(e.flt.sum[:h.Count])
		clear(e.flt.sp[:h.Count])
	}
	t.entries[key] = e
	return e
}

// complete turns e's sum into its result packet, frees the accumulator and queues the result to
// the switch for broadcast, or in Direct mode to every contributor.
func (p *PS) complete(s *psSock, t *psTable, e *psEntry, now int64) {
	n := int(e.tmpl.Count)
	out := e.pkt[wire.HdrSize : wire.HdrSize+4*n]
	flags := e.flags & (wire.FlagECN | wire.FlagCollision)
	if e.level1 {
		flags |= wire.FlagLevel1
	}
	if e.fix != nil {
		// A contribution that could not be quantised makes the whole sum wrong; a sum beyond
		// int32 cannot be sent. Either way: saturate and flag, and the workers repair in float32.
		overflow := e.flags&wire.FlagOverflow != 0
		for j := 0; j < n; j++ {
			v := e.fix[j]
			if v > math.MaxInt32 {
				v, overflow = math.MaxInt32, true
			} else if v < math.MinInt32 {
				v, overflow = math.MinInt32, true
			}
			binary.LittleEndian.PutUint32(out[4*j:], uint32(int32(v)))
		}
		if overflow {
			flags |= wire.FlagOverflow
			s.st.overflows.Add(1)
		}
		t.freeFix = append(t.freeFix, e.fix)
		e.fix = nil
	} else {
		for j := 0; j < n; j++ {
			binary.LittleEndian.PutUint32(out[4*j:], math.Float32bits(e.flt.sum[j].float32(e.flt.sp[j])))
		}
		t.freeFlt = append(t.freeFlt, e.flt)
		e.flt = nil
	}
	h := e.tmpl
	h.Type = wire.MsgResult
	if !e.level1 {
		h.Bitmap1 = 0
		if flags&wire.FlagCollision != 0 {
			if t, ok := p.rehash(&e.tmpl); ok {
				flags |= wire.FlagRehash
				h.Bitmap1 = t
				s.st.rehashes.Add(1)
			}
		}
	}
	h.Flags = flags
	if e.level1 {
		h.Bitmap1 = e.bitmap
	} else {
		h.Bitmap0 = e.bitmap
	}
	wire.EncodeHeader(e.pkt[:], &h)
	e.plen = wire.HdrSize + 4*n
	e.complete = true
	e.touched = now
	q := &t.done[e.acct.idx]
	q.q = append(q.q, e)
	e.acct.done.Add(1)
	s.st.completed.Add(1)

	if s.nout == len(s.out) { // never: one packet out at most per datagram received
		return
	}
	buf := s.out[s.nout][:e.plen]
	s.nout++
	copy(buf, e.pkt[:e.plen])
	if e.job == nil {
		s.bc.queue(&p.switchSa, buf, nil)
		return
	}
	for rest := e.bitmap; rest != 0; rest &= rest - 1 {
		bit := bits.TrailingZeros32(rest)
		if e.job.known&(1<<bit) == 0 {
			s.st.unaddressed.Add(1)
			continue
		}
		s.bc.queue(&e.job.addrs[bit], buf, nil)
	}
}

// resend queues e's stored result, marked F_SHADOW, to one sender.
func (p *PS) resend(s *psSock, e *psEntry, to *unix.RawSockaddrInet4) {
	if s.nout == len(s.out) || s.bc.free() == 0 {
		return
	}
	buf := s.out[s.nout][:e.plen]
	s.nout++
	copy(buf, e.pkt[:e.plen])
	binary.LittleEndian.PutUint16(buf[wire.OffFlags:], binary.LittleEndian.Uint16(buf[wire.OffFlags:])|wire.FlagShadow)
	s.bc.queue(to, buf, nil)
	s.st.resent.Add(1)
}

// evict drops t's completed results older than ResultTTL and incomplete aggregations untouched
// for StaleAfter, and in Direct mode the addresses of jobs idle for longer than both.
func (p *PS) evict(t *psTable, s *psSock, now int64) {
	ttl, stale := int64(p.cfg.ResultTTL), int64(p.cfg.StaleAfter)
	t.mu.Lock()
	defer t.mu.Unlock()
	for a := range t.done {
		q := &t.done[a]
		for q.len() > 0 && now-q.q[q.head].touched >= ttl {
			p.release(t, q.pop())
		}
	}
	for _, e := range t.entries {
		if !e.complete && now-e.touched >= stale {
			s.st.stale.Add(1)
			p.release(t, e)
		}
	}
	// An entry of the job that is still held is younger than this (a contribution or its
	// completion updated used), so it never needs a deleted record.
	for id, j := range t.jobs {
		if now-j.used >= max(ttl, stale) {
			delete(t.jobs, id)
		}
	}
}

func (q *psDoneQueue) len() int { return len(q.q) - q.head }

// pop removes and returns the oldest entry; q.len() must be > 0.
func (q *psDoneQueue) pop() *psEntry {
	e := q.q[q.head]
	q.q[q.head] = nil
	q.head++
	// Compact once the consumed prefix dominates: amortised O(1), and the backing array stops
	// growing at about twice the live results.
	if q.head > 64 && q.head*2 > len(q.q) {
		k := copy(q.q, q.q[q.head:])
		clear(q.q[k:])
		q.q = q.q[:k]
		q.head = 0
	}
	return e
}

// release removes e from t and recycles it and its accumulator.
func (p *PS) release(t *psTable, e *psEntry) {
	delete(t.entries, e.key)
	e.acct.n.Add(-1)
	if e.complete {
		e.acct.done.Add(-1)
	}
	e.acct = nil
	if e.fix != nil {
		t.freeFix = append(t.freeFix, e.fix)
		e.fix = nil
	}
	if e.flt != nil {
		t.freeFlt = append(t.freeFlt, e.flt)
		e.flt = nil
	}
	e.job = nil
	t.freeE = append(t.freeE, e)
}
