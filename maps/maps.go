// Package maps gives typed access to every map of a loaded or pinned xdpagg switch.
package maps

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"path/filepath"
	"sort"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/wire"
)

// Sentinel errors.
var (
	ErrNoSwitch = errors.New("no xdpagg switch pinned there")
	ErrBadIndex = errors.New("slot index out of range")
)

// Counter identifies one switch counter (the C enum counter).
type Counter = bpf.XdpaggCounter

// Counter IDs under short Go names.
const (
	CntRx          = bpf.XdpaggCounterCNT_RX
	CntAggregated  = bpf.XdpaggCounterCNT_AGGREGATED
	CntCompleted   = bpf.XdpaggCounterCNT_COMPLETED
	CntDuplicate   = bpf.XdpaggCounterCNT_DUPLICATE
	CntCollision   = bpf.XdpaggCounterCNT_COLLISION
	CntOverflow    = bpf.XdpaggCounterCNT_OVERFLOW
	CntToPS        = bpf.XdpaggCounterCNT_TO_PS
	CntMalformed   = bpf.XdpaggCounterCNT_MALFORMED
	CntNonAgg      = bpf.XdpaggCounterCNT_NON_AGG
	CntPSResult    = bpf.XdpaggCounterCNT_PS_RESULT
	CntShadowTx    = bpf.XdpaggCounterCNT_SHADOW_TX
	CntReclaimed   = bpf.XdpaggCounterCNT_RECLAIMED
	CntEgressTx    = bpf.XdpaggCounterCNT_EGRESS_TX
	CntEgressSkip  = bpf.XdpaggCounterCNT_EGRESS_SKIP
	CntRedirectErr = bpf.XdpaggCounterCNT_REDIRECT_ERR
	CntControl     = bpf.XdpaggCounterCNT_CONTROL
	CntNotMember   = bpf.XdpaggCounterCNT_NOT_MEMBER
	CntFlushed     = bpf.XdpaggCounterCNT_FLUSHED
	CntCached      = bpf.XdpaggCounterCNT_CACHED
	CntCacheFull   = bpf.XdpaggCounterCNT_CACHE_FULL
	CntECNMarked   = bpf.XdpaggCounterCNT_ECN_MARKED
	CntSpoofed     = bpf.XdpaggCounterCNT_SPOOFED
	CntIPInvalid   = bpf.XdpaggCounterCNT_IP_INVALID
	CntOverQuota   = bpf.XdpaggCounterCNT_OVER_QUOTA
	CntCtlLimited  = bpf.XdpaggCounterCNT_CTL_LIMITED
	CntSparseStale = bpf.XdpaggCounterCNT_SPARSE_STALE
	CntSparsePairs = bpf.XdpaggCounterCNT_SPARSE_PAIRS
	CntSparseSpill = bpf.XdpaggCounterCNT_SPARSE_SPILLED
	CntSparseDone  = bpf.XdpaggCounterCNT_SPARSE_DONE
	CntRecirc      = bpf.XdpaggCounterCNT_RECIRCULATED
	CntPull        = bpf.XdpaggCounterCNT_PULL
	CntPullPending = bpf.XdpaggCounterCNT_PULL_PENDING
	CntRegOverflow = bpf.XdpaggCounterCNT_REG_OVERFLOW
	CntTailcallErr = bpf.XdpaggCounterCNT_TAILCALL_ERR
	NumCounters    = int(bpf.XdpaggCounterCNT_MAX)
)

// The C struct counters must have exactly one slot per enum counter.
var _ = [1]struct{}{}[len(bpf.XdpaggCounters{}.Cnt)-NumCounters]

var counterNames = [NumCounters]string{
	CntRx:          "rx",
	CntAggregated:  "aggregated",
	CntCompleted:   "completed",
	CntDuplicate:   "duplicate",
	CntCollision:   "collision",
	CntOverflow:    "overflow",
	CntToPS:        "to_ps",
	CntMalformed:   "malformed",
	CntNonAgg:      "non_agg",
	CntPSResult:    "ps_result",
	CntShadowTx:    "shadow_tx",
	CntReclaimed:   "reclaimed",
	CntEgressTx:    "egress_tx",
	CntEgressSkip:  "egress_skip",
	CntRedirectErr: "redirect_err",
	CntControl:     "control",
	CntNotMember:   "not_member",
	CntFlushed:     "flushed",
	CntCached:      "cached",
	CntCacheFull:   "cache_full",
	CntECNMarked:   "ecn_marked",
	CntSpoofed:     "spoofed",
	CntIPInvalid:   "ip_invalid",
	CntOverQuota:   "over_quota",
	CntCtlLimited:  "ctl_limited",
	CntSparseStale: "sparse_stale",
	CntSparsePairs: "sparse_pairs",
	CntSparseSpill: "sparse_spilled",
	CntSparseDone:  "sparse_done",
	CntRecirc:      "recirculated",
	CntPull:        "pull",
	CntPullPending: "pull_pending",
	CntRegOverflow: "reg_overflow",
	CntTailcallErr: "tailcall_err",
}

// CounterName is the stable snake_case name of a counter (used in JSON and metrics).
func CounterName(c Counter) string {
	if int(c) < NumCounters && counterNames[c] != "" {
		return counterNames[c]
	}
	return fmt.Sprintf("counter_%d", uint32(c))
}

// Counters is a snapshot of all counters, summed over CPUs, indexed by Counter.
type Counters [NumCounters]uint64

// Map returns the counters by name.
func (c Counters) Map() map[string]uint64 {
	out := make(map[string]uint64, NumCounters)
	for i, v := range c {
		out[CounterName(Counter(i))] = v
	}
	return out
}

// Sub returns c - prev, counter by counter.
func (c Counters) Sub(prev Counters) Counters {
	for i := range c {
		c[i] -= prev[i]
	}
	return c
}

// Maps holds the switch's maps.
type Maps struct {
	Slots    *ebpf.Map // agg_index -> bpf.XdpaggSlot
	Members  *ebpf.Map // bpf.XdpaggMemberKey -> bpf.XdpaggMember
	Ports    *ebpf.Map // ifindex -> bpf.XdpaggBpfDevmapVal
	Counters *ebpf.Map // 0 -> per-CPU bpf.XdpaggCounters, indexed by Counter
	Workers  *ebpf.Map // bpf.XdpaggWorkerKey -> bpf.XdpaggWorker (ingress membership)
	Jobs     *ebpf.Map // job id -> bpf.XdpaggJob (admitted jobs)
	JobKeys  *ebpf.Map // job id -> bpf.XdpaggJobKey (control keys; read by the agent only)
	// CtlBudget is ifindex -> bpf.XdpaggCtlBucket, the per-port control-message budget.
	CtlBudget *ebpf.Map
	Results   *ebpf.Map // ring buffer of bpf.XdpaggResultRec (retransmit cache feed); nil when opened pinned
	// Registers is parity*arrays+array -> bpf.XdpaggRegArray, the hot-parameter registers.
	Registers *ebpf.Map
	// SparseJobs is job id -> bpf.XdpaggSparseJob, sparse jobs' iteration records.
	SparseJobs *ebpf.Map
	// RecircHist is passes -> per-CPU u64, the recirculation histogram of hot packets.
	RecircHist *ebpf.Map
	// GC is the xdpagg_gc program (slot garbage collector, run with BPF_PROG_TEST_RUN).
	GC    *ebpf.Program
	owned bool
}

// New wraps the maps (and the garbage collector program) of a switch loaded in this process.
func New(o *bpf.XdpaggObjects) *Maps {
	m := &o.XdpaggMaps
	return &Maps{Slots: m.Slots, Members: m.Members, Ports: m.Ports, Counters: m.Counters,
		Workers: m.Workers, Jobs: m.Jobs, JobKeys: m.JobKeys, CtlBudget: m.CtlBudget,
		Results: m.Results, Registers: m.Registers, SparseJobs: m.SparseJobs, RecircHist: m.RecircHist,
		GC: o.XdpaggGc}
}

// PinnedGC is where a switch pins its garbage collector program, relative to its pin directory.
const PinnedGC = "progs/xdpagg_gc"

// PinnedMaps names the maps a switch pins under dir/maps (the ring buffer is the agent's alone).
var PinnedMaps = []string{bpf.XdpaggMapSlots, bpf.XdpaggMapMembers, bpf.XdpaggMapPorts,
	bpf.XdpaggMapCounters, bpf.XdpaggMapWorkers, bpf.XdpaggMapJobs, bpf.XdpaggMapJobKeys,
	bpf.XdpaggMapCtlBudget, bpf.XdpaggMapRegisters, bpf.XdpaggMapSparseJobs, bpf.XdpaggMapRecircHist}

// OpenPinned opens the maps a switch pinned under dir (loader.Switch.Pin).
func OpenPinned(dir string) (*Maps, error) {
	m := &Maps{owned: true}
	for name, dst := range map[string]**ebpf.Map{
		bpf.XdpaggMapSlots:      &m.Slots,
		bpf.XdpaggMapMembers:    &m.Members,
		bpf.XdpaggMapPorts:      &m.Ports,
		bpf.XdpaggMapCounters:   &m.Counters,
		bpf.XdpaggMapWorkers:    &m.Workers,
		bpf.XdpaggMapJobs:       &m.Jobs,
		bpf.XdpaggMapJobKeys:    &m.JobKeys,
		bpf.XdpaggMapCtlBudget:  &m.CtlBudget,
		bpf.XdpaggMapRegisters:  &m.Registers,
		bpf.XdpaggMapSparseJobs: &m.SparseJobs,
		bpf.XdpaggMapRecircHist: &m.RecircHist,
	} {
		mp, err := ebpf.LoadPinnedMap(filepath.Join(dir, "maps", name), &ebpf.LoadPinOptions{ReadOnly: false})
		if err != nil {
			m.Close()
			if errors.Is(err, unix.ENOENT) {
				return nil, fmt.Errorf("%w: %s: %w", ErrNoSwitch, dir, err)
			}
			return nil, fmt.Errorf("open pinned map %s: %w", name, err)
		}
		*dst = mp
	}
	gc, err := ebpf.LoadPinnedProgram(filepath.Join(dir, PinnedGC), nil)
	if err != nil {
		m.Close()
		return nil, fmt.Errorf("open pinned garbage collector: %w", err)
	}
	m.GC = gc
	return m, nil
}

// Close closes maps opened by OpenPinned (maps given to New belong to their loader).
func (m *Maps) Close() error {
	if !m.owned {
		return nil
	}
	var errs []error
	for _, mp := range []*ebpf.Map{m.Slots, m.Members, m.Ports, m.Counters, m.Workers, m.Jobs, m.JobKeys, m.CtlBudget,
		m.Registers, m.SparseJobs, m.RecircHist} {
		if mp != nil {
			errs = append(errs, mp.Close())
		}
	}
	if m.GC != nil {
		errs = append(errs, m.GC.Close())
	}
	return errors.Join(errs...)
}

// ReadCounters sums every counter over all CPUs.
func (m *Maps) ReadCounters() (Counters, error) {
	var out Counters
	var percpu []bpf.XdpaggCounters
	if err := m.Counters.Lookup(uint32(0), &percpu); err != nil {
		return out, fmt.Errorf("read counters: %w", err)
	}
	for _, c := range percpu {
		for i, v := range c.Cnt {
			out[i] += v
		}
	}
	return out, nil
}

// PoolSize is the number of aggregator slots.
func (m *Maps) PoolSize() uint32 { return m.Slots.MaxEntries() }

// Slot reads one aggregator slot.
func (m *Maps) Slot(idx uint32) (bpf.XdpaggSlot, error) {
	var s bpf.XdpaggSlot
	if idx >= m.PoolSize() {
		return s, fmt.Errorf("%w: %d of %d", ErrBadIndex, idx, m.PoolSize())
	}
	if err := m.Slots.Lookup(idx, &s); err != nil {
		return s, fmt.Errorf("read slot %d: %w", idx, err)
	}
	return s, nil
}

// SlotInfo summarises a slot in use.
type SlotInfo struct {
	Index    uint32        `json:"index"`
	JobID    uint32        `json:"job"`
	Seq      uint32        `json:"seq"`
	State    string        `json:"state"`
	Bitmap   uint32        `json:"bitmap"`
	Counter  uint8         `json:"counter"`
	FanIn    uint8         `json:"fan_in"`
	Values   uint16        `json:"values"`
	Overflow bool          `json:"overflow"`
	ECN      bool          `json:"ecn"`
	Age      time.Duration `json:"age_ns"`
}

// StateName names a slot state.
func StateName(s uint8) string {
	switch bpf.XdpaggSlotState(s) {
	case bpf.XdpaggSlotStateSLOT_FREE:
		return "free"
	case bpf.XdpaggSlotStateSLOT_AGGREGATING:
		return "aggregating"
	case bpf.XdpaggSlotStateSLOT_COMPLETE:
		return "complete"
	}
	return fmt.Sprintf("state_%d", s)
}

// SlotsInUse lists every slot that is not free. Ages are against the datapath's own clock
// (DatapathNow), the clock of
// bpf_ktime_get_ns.
func (m *Maps) SlotsInUse() ([]SlotInfo, error) {
	now, err := m.DatapathNow()
	if err != nil {
		return nil, err
	}
	var out []SlotInfo
	var (
		idx uint32
		s   bpf.XdpaggSlot
	)
	it := m.Slots.Iterate()
	for it.Next(&idx, &s) {
		if s.State == uint8(bpf.XdpaggSlotStateSLOT_FREE) {
			continue
		}
		info := SlotInfo{
			Index: idx, JobID: s.JobId, Seq: s.Seq, State: StateName(s.State), Bitmap: s.Bitmap,
			Counter: s.Counter, FanIn: s.FanIn, Values: s.Nvals,
			Overflow: s.Flags&wire.FlagOverflow != 0,
			ECN:      s.Flags&wire.FlagECN != 0,
		}
		if now > s.TsNs {
			info.Age = time.Duration(now - s.TsNs)
		}
		out = append(out, info)
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("iterate slots: %w", err)
	}
	return out, nil
}

// ResetSlots frees every slot (a fresh pool). Only safe while no job is running.
func (m *Maps) ResetSlots() error {
	var zero bpf.XdpaggSlot
	for i := range m.PoolSize() {
		if err := m.Slots.Put(i, &zero); err != nil {
			return fmt.Errorf("reset slot %d: %w", i, err)
		}
	}
	// No job holds a slot now. Rewriting a job entry would lose the datapath's concurrent adds
	// to held, which is why this is only safe while no job is running.
	var (
		id  uint32
		v   bpf.XdpaggJob
		ids []uint32
	)
	it := m.Jobs.Iterate()
	for it.Next(&id, &v) {
		ids = append(ids, id)
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("iterate jobs: %w", err)
	}
	for _, id := range ids {
		if err := m.Jobs.Lookup(&id, &v); err != nil {
			continue // removed meanwhile
		}
		v.Held = 0
		if err := m.Jobs.Update(&id, &v, ebpf.UpdateExist); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("reset held slots of job %d: %w", id, err)
		}
	}
	return nil
}

func decodeMember(k bpf.XdpaggMemberKey, v bpf.XdpaggMember) Member {
	p := wire.PortFromMap(v.DstPort)
	return Member{
		JobID: k.JobId, WorkerID: v.WorkerId, Ifindex: k.Ifindex,
		Addr:    netip.AddrPortFrom(wire.IPv4FromMap(v.DstIp), p),
		MAC:     net.HardwareAddr(append([]byte(nil), v.DstMac[:]...)),
		PortMAC: net.HardwareAddr(append([]byte(nil), v.SrcMac[:]...)),
		SrcIP:   wire.IPv4FromMap(v.SrcIp),
	}
}

// Member returns the member of job behind switch port ifindex; the error wraps
// ebpf.ErrKeyNotExist if there is none.
func (m *Maps) Member(job, ifindex uint32) (Member, error) {
	k := bpf.XdpaggMemberKey{JobId: job, Ifindex: ifindex}
	var v bpf.XdpaggMember
	if err := m.Members.Lookup(&k, &v); err != nil {
		return Member{}, fmt.Errorf("member of job %d behind ifindex %d: %w", job, ifindex, err)
	}
	return decodeMember(k, v), nil
}

// ListMembers returns every member, ordered by job then worker.
func (m *Maps) ListMembers() ([]Member, error) {
	var (
		k   bpf.XdpaggMemberKey
		v   bpf.XdpaggMember
		out []Member
	)
	it := m.Members.Iterate()
	for it.Next(&k, &v) {
		out = append(out, decodeMember(k, v))
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("iterate members: %w", err)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].JobID != out[j].JobID {
			return out[i].JobID < out[j].JobID
		}
		return out[i].WorkerID < out[j].WorkerID
	})
	return out, nil
}

// ListPorts returns the ifindexes of the broadcast ports.
func (m *Maps) ListPorts() ([]uint32, error) {
	var (
		k   uint32
		v   bpf.XdpaggBpfDevmapVal
		out []uint32
	)
	it := m.Ports.Iterate()
	for it.Next(&k, &v) {
		out = append(out, k)
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("iterate ports: %w", err)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out, nil
}

// CacheStatsName is the map the agent pins next to the switch's maps with its retransmit
// cache's statistics (one bpf.XdpaggCacheStats at key 0).
const CacheStatsName = "cache_stats"

// CacheStats is the agent's retransmit cache as `xdpagg inspect` shows it.
type CacheStats struct {
	Entries      uint64 `json:"entries"`
	Bytes        uint64 `json:"bytes"`
	Stored       uint64 `json:"stored"`
	Hits         uint64 `json:"hits"`
	Misses       uint64 `json:"misses"`
	EvictedAcked uint64 `json:"evicted_acked"`
	EvictedAge   uint64 `json:"evicted_age"`
	Acks         uint64 `json:"acks"`
}

// ReadCacheStats reads the retransmit-cache statistics of the switch pinned under dir. ok is
// false when its agent runs without the cache.
func ReadCacheStats(dir string) (st CacheStats, ok bool, err error) {
	m, err := ebpf.LoadPinnedMap(filepath.Join(dir, "maps", CacheStatsName), &ebpf.LoadPinOptions{ReadOnly: true})
	if errors.Is(err, unix.ENOENT) {
		return st, false, nil
	}
	if err != nil {
		return st, false, fmt.Errorf("open %s: %w", CacheStatsName, err)
	}
	defer m.Close()
	var v bpf.XdpaggCacheStats
	if err := m.Lookup(uint32(0), &v); err != nil {
		return st, false, fmt.Errorf("read %s: %w", CacheStatsName, err)
	}
	return CacheStats{Entries: v.Entries, Bytes: v.Bytes, Stored: v.Stored, Hits: v.Hits, Misses: v.Misses,
		EvictedAcked: v.EvictedAcked, EvictedAge: v.EvictedAge, Acks: v.Acks}, true, nil
}
