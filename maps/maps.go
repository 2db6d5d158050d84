// Package maps gives typed access to every map of a loaded or pinned xdpagg switch.
package maps

import (
	"encoding/json"
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
	Jobs     *ebpf.Map // job id -> bpf.XdpaggJob
	Results  *ebpf.Map // ring buffer of bpf.XdpaggResultRec (retransmit cache feed); nil when opened pinned
	owned    bool
}

// New wraps maps of a switch loaded in this process.
func New(m *bpf.XdpaggMaps) *Maps {
	return &Maps{Slots: m.Slots, Members: m.Members, Ports: m.Ports, Counters: m.Counters,
		Workers: m.Workers, Jobs: m.Jobs, Results: m.Results}
}

// OpenPinned opens the maps a switch pinned under dir (loader.Switch.Pin).
func OpenPinned(dir string) (*Maps, error) {
	m := &Maps{owned: true}
	for name, dst := range map[string]**ebpf.Map{
		bpf.XdpaggMapSlots:    &m.Slots,
		bpf.XdpaggMapMembers:  &m.Members,
		bpf.XdpaggMapPorts:    &m.Ports,
		bpf.XdpaggMapCounters: &m.Counters,
		bpf.XdpaggMapWorkers:  &m.Workers,
		bpf.XdpaggMapJobs:     &m.Jobs,
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
	return m, nil
}

// Close closes maps opened by OpenPinned (maps given to New belong to their loader).
func (m *Maps) Close() error {
	if !m.owned {
		return nil
	}
	var errs []error
	for _, mp := range []*ebpf.Map{m.Slots, m.Members, m.Ports, m.Counters, m.Workers, m.Jobs} {
		if mp != nil {
			errs = append(errs, mp.Close())
		}
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

// SlotsInUse lists every slot that is not free. Ages are against CLOCK_MONOTONIC, the clock of
// bpf_ktime_get_ns.
func (m *Maps) SlotsInUse() ([]SlotInfo, error) {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		return nil, fmt.Errorf("read monotonic clock: %w", err)
	}
	now := uint64(ts.Nano())
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
			Overflow: s.Flags&uint16(bpf.XdpaggFlagF_OVERFLOW) != 0,
			ECN:      s.Flags&uint16(bpf.XdpaggFlagF_ECN) != 0,
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
	return nil
}

// Member says where one worker of a job is reached from the switch.
type Member struct {
	JobID    uint32           `json:"job"`
	WorkerID uint8            `json:"worker"`
	Ifindex  uint32           `json:"ifindex"`  // switch port the worker is behind
	Addr     netip.AddrPort   `json:"addr"`     // worker's IPv4 address and UDP port
	MAC      net.HardwareAddr `json:"mac"`      // worker's MAC (next hop from that port)
	PortMAC  net.HardwareAddr `json:"port_mac"` // the switch port's MAC
	SrcIP    netip.Addr       `json:"src_ip"`   // source address results carry (the PS)
}

// MarshalJSON writes MACs as "02:00:..." strings rather than base64 bytes.
func (mb Member) MarshalJSON() ([]byte, error) {
	type plain Member // no methods: no recursion
	return json.Marshal(struct {
		plain
		MAC     string `json:"mac"`
		PortMAC string `json:"port_mac"`
	}{plain(mb), mb.MAC.String(), mb.PortMAC.String()})
}

// ErrBadMember is returned for members that cannot be encoded.
var ErrBadMember = errors.New("invalid job member")

func (mb Member) encode() (bpf.XdpaggMemberKey, bpf.XdpaggMember, error) {
	k := bpf.XdpaggMemberKey{JobId: mb.JobID, Ifindex: mb.Ifindex}
	var v bpf.XdpaggMember
	if mb.JobID == 0 {
		return k, v, fmt.Errorf("%w: job id 0 is reserved", ErrBadMember)
	}
	if !mb.Addr.Addr().Is4() || !mb.SrcIP.Is4() {
		return k, v, fmt.Errorf("%w: worker %v and source %v must be IPv4", ErrBadMember, mb.Addr, mb.SrcIP)
	}
	if len(mb.MAC) != 6 || len(mb.PortMAC) != 6 {
		return k, v, fmt.Errorf("%w: MACs %v / %v must be 6 bytes", ErrBadMember, mb.MAC, mb.PortMAC)
	}
	if int(mb.WorkerID) >= bpf.MaxWorkers {
		return k, v, fmt.Errorf("%w: worker id %d: use 0..%d", ErrBadMember, mb.WorkerID, bpf.MaxWorkers-1)
	}
	copy(v.DstMac[:], mb.MAC)
	copy(v.SrcMac[:], mb.PortMAC)
	v.DstIp = ipToNetwork(mb.Addr.Addr())
	v.SrcIp = ipToNetwork(mb.SrcIP)
	p := mb.Addr.Port()
	v.DstPort = p>>8 | p<<8 // network byte order in a host-order (little-endian) field
	v.WorkerId = mb.WorkerID
	return k, v, nil
}

// ipToNetwork returns the uint32 whose in-memory (little-endian) bytes are the address in network order.
func ipToNetwork(a netip.Addr) uint32 {
	b := a.As4()
	return uint32(b[0]) | uint32(b[1])<<8 | uint32(b[2])<<16 | uint32(b[3])<<24
}

func ipFromNetwork(v uint32) netip.Addr {
	return netip.AddrFrom4([4]byte{byte(v), byte(v >> 8), byte(v >> 16), byte(v >> 24)})
}

// PutMember adds or replaces a job member behind a port: where the job's results go out of that
// port (members), who may contribute (workers: the worker id, address, UDP port and port
// ifindex that the switch's ingress checks), and the job's PS, the only source of its RESULTs
// (jobs).
func (m *Maps) PutMember(mb Member) error {
	k, v, err := mb.encode()
	if err != nil {
		return err
	}
	// A member replaced behind this port (another worker id) loses its right to contribute.
	var old bpf.XdpaggMember
	if err := m.Members.Lookup(&k, &old); err == nil && old.WorkerId != mb.WorkerID {
		if err := m.DeleteMember(mb.JobID, mb.Ifindex); err != nil {
			return err
		}
	}
	if err := m.PutWorker(mb.JobID, mb.WorkerID, mb.Addr, mb.Ifindex); err != nil {
		return err
	}
	if err := m.PutJob(mb.JobID, mb.SrcIP, 1<<mb.WorkerID); err != nil {
		return err
	}
	if err := m.Members.Put(&k, &v); err != nil {
		return fmt.Errorf("write member job %d ifindex %d: %w", mb.JobID, mb.Ifindex, err)
	}
	return nil
}

// PutWorker lets worker id of job contribute from addr through switch port ifindex (the
// ingress half of PutMember, for senders that take no results there, and for tests).
func (m *Maps) PutWorker(job uint32, id uint8, addr netip.AddrPort, ifindex uint32) error {
	if job == 0 || int(id) >= bpf.MaxWorkers || !addr.Addr().Is4() {
		return fmt.Errorf("%w: job %d worker %d at %v: need job > 0, worker 0..%d, IPv4", ErrBadMember, job, id, addr, bpf.MaxWorkers-1)
	}
	k := bpf.XdpaggWorkerKey{JobId: job, WorkerId: uint32(id)}
	p := addr.Port()
	v := bpf.XdpaggWorker{Ip: ipToNetwork(addr.Addr()), Ifindex: ifindex, Port: p>>8 | p<<8}
	if err := m.Workers.Put(&k, &v); err != nil {
		return fmt.Errorf("write worker %d of job %d: %w", id, job, err)
	}
	return nil
}

// PutJob records job's PS address (the only source its RESULTs may come from) and ORs
// workerBits into its joined-workers bitmap.
func (m *Maps) PutJob(job uint32, ps netip.Addr, workerBits uint32) error {
	if job == 0 || !ps.Is4() {
		return fmt.Errorf("%w: job %d with PS %v: need job > 0 and an IPv4 PS", ErrBadMember, job, ps)
	}
	var v bpf.XdpaggJob
	if err := m.Jobs.Lookup(&job, &v); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("read job %d: %w", job, err)
	}
	v.PsIp = ipToNetwork(ps)
	v.Workers |= workerBits
	if err := m.Jobs.Put(&job, &v); err != nil {
		return fmt.Errorf("write job %d: %w", job, err)
	}
	return nil
}

// DeleteMember removes the member of job behind ifindex, its right to contribute, and the job
// itself when no worker is left.
func (m *Maps) DeleteMember(job, ifindex uint32) error {
	k := bpf.XdpaggMemberKey{JobId: job, Ifindex: ifindex}
	var v bpf.XdpaggMember
	if err := m.Members.Lookup(&k, &v); err != nil {
		return fmt.Errorf("delete member job %d ifindex %d: %w", job, ifindex, err)
	}
	wk := bpf.XdpaggWorkerKey{JobId: job, WorkerId: uint32(v.WorkerId)}
	if err := m.Workers.Delete(&wk); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("delete worker %d of job %d: %w", v.WorkerId, job, err)
	}
	var jv bpf.XdpaggJob
	if err := m.Jobs.Lookup(&job, &jv); err == nil {
		jv.Workers &^= 1 << v.WorkerId
		if jv.Workers == 0 {
			err = m.Jobs.Delete(&job)
		} else {
			err = m.Jobs.Put(&job, &jv)
		}
		if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("update job %d: %w", job, err)
		}
	}
	if err := m.Members.Delete(&k); err != nil {
		return fmt.Errorf("delete member job %d ifindex %d: %w", job, ifindex, err)
	}
	return nil
}

// Job is a job as the switch knows it.
type Job struct {
	JobID   uint32     `json:"job"`
	PS      netip.Addr `json:"ps"`
	Workers uint32     `json:"workers"` // bitmap of joined worker ids
}

// ListJobs returns every job, ordered by id.
func (m *Maps) ListJobs() ([]Job, error) {
	var (
		k   uint32
		v   bpf.XdpaggJob
		out []Job
	)
	it := m.Jobs.Iterate()
	for it.Next(&k, &v) {
		out = append(out, Job{JobID: k, PS: ipFromNetwork(v.PsIp), Workers: v.Workers})
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("iterate jobs: %w", err)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].JobID < out[j].JobID })
	return out, nil
}

func decodeMember(k bpf.XdpaggMemberKey, v bpf.XdpaggMember) Member {
	p := v.DstPort>>8 | v.DstPort<<8
	return Member{
		JobID: k.JobId, WorkerID: v.WorkerId, Ifindex: k.Ifindex,
		Addr:    netip.AddrPortFrom(ipFromNetwork(v.DstIp), p),
		MAC:     net.HardwareAddr(append([]byte(nil), v.DstMac[:]...)),
		PortMAC: net.HardwareAddr(append([]byte(nil), v.SrcMac[:]...)),
		SrcIP:   ipFromNetwork(v.SrcIp),
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

// ReclaimIdle frees every slot (half-filled or completed) idle for longer than idle, and returns
// how many it freed. The switch does the same lazily, when a packet reaches such a slot; the
// agent does it eagerly so that an idle pool ends up empty (ATP's aggregator garbage collection).
// Freeing any slot is safe for the sums: contributors without a result resend their data, and
// resends find no slot and go to the PS. Only the slot's state is written, under its spin lock.
func (m *Maps) ReclaimIdle(idle time.Duration) (int, error) {
	used, err := m.SlotsInUse()
	if err != nil {
		return 0, err
	}
	freed := 0
	for _, u := range used {
		if u.Age <= idle {
			continue
		}
		var s bpf.XdpaggSlot
		if err := m.Slots.LookupWithFlags(u.Index, &s, ebpf.LookupLock); err != nil {
			return freed, fmt.Errorf("read slot %d: %w", u.Index, err)
		}
		// Re-check under the lock: a packet may have taken the slot since the listing.
		if s.State == uint8(bpf.XdpaggSlotStateSLOT_FREE) || s.JobId != u.JobID || s.Seq != u.Seq {
			continue
		}
		s.State = uint8(bpf.XdpaggSlotStateSLOT_FREE)
		if err := m.Slots.Update(u.Index, &s, ebpf.UpdateLock); err != nil {
			return freed, fmt.Errorf("free slot %d: %w", u.Index, err)
		}
		freed++
	}
	return freed, nil
}
