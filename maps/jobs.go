package maps

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sort"

	"github.com/cilium/ebpf"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/wire"
)

// Sentinel errors of job admission and membership.
var (
	// ErrBadMember is returned for members that cannot be encoded.
	ErrBadMember = errors.New("invalid job member")
	// ErrNoJob: the job was never admitted (or was removed).
	ErrNoJob = errors.New("job not admitted")
	// ErrJobExists: AddJob for an id already admitted.
	ErrJobExists = errors.New("job already admitted")
	// ErrBadJob: a job that cannot be admitted as given.
	ErrBadJob = errors.New("invalid job")
)

// KeySize is the size of a job's control key.
const KeySize = wire.JobKeySize

// DefaultMaxSlots is the slot quota of a job admitted without one: a quarter of the pool, at
// least 2·64 (the default window's rotation, 2W) where the pool allows it. A quarter leaves
// three quarters of the pool to others whatever one tenant does, and still gives one job the
// 2W slots a full window rotates over on a pool of 512 or more.
func DefaultMaxSlots(pool uint32) uint32 {
	return min(pool, max(pool/4, 128))
}

// Job is a job as the operator admitted it (`xdpagg job add`).
type Job struct {
	JobID     uint32         `json:"job"`
	PS        netip.AddrPort `json:"ps"`         // the PS's IPv4 address and UDP port: the only RESULT source
	PSIfindex uint32         `json:"ps_ifindex"` // switch port the PS is behind
	Workers   uint8          `json:"workers"`    // admitted workers: ids 0..Workers-1 may join (the datapath takes a sum's fan-in from the packets)
	MaxSlots  uint32         `json:"max_slots"`  // slot quota
	Held      int32          `json:"held"`       // slots held now (read from the datapath; ignored by AddJob)
	Joined    uint32         `json:"joined"`     // bitmap of worker ids bound now (ListJobs/GetJob)
	// RegArrays makes a sparse job: the register arrays (m) it owns for hot parameters, of
	// each parity; 0 for a dense job. AddJob picks RegBase, the first of them.
	RegArrays uint16 `json:"reg_arrays,omitempty"`
	RegBase   uint16 `json:"reg_base,omitempty"`
	// Threshold is H, asynchronous aggregation (iSwitch): a dense fragment completes once H
	// distinct workers contributed to it (1..Workers); 0 means Workers, synchronous. Changed
	// at run time by SetThreshold (MSG_SETH). Sparse jobs take none.
	Threshold uint8 `json:"threshold,omitempty"`
}

func (j Job) encode() (bpf.XdpaggJob, error) {
	var v bpf.XdpaggJob
	switch {
	case j.JobID == 0:
		return v, fmt.Errorf("%w: job id 0 is reserved", ErrBadJob)
	case !j.PS.Addr().Is4() || j.PS.Port() == 0:
		return v, fmt.Errorf("%w: PS %v: need an IPv4 address and a port", ErrBadJob, j.PS)
	case j.PSIfindex == 0:
		return v, fmt.Errorf("%w: no switch port for the PS", ErrBadJob)
	case j.Workers == 0 || int(j.Workers) > wire.MaxWorkers:
		return v, fmt.Errorf("%w: %d workers: use 1..%d", ErrBadJob, j.Workers, wire.MaxWorkers)
	case j.MaxSlots == 0:
		return v, fmt.Errorf("%w: slot quota 0", ErrBadJob)
	case uint32(j.RegArrays) > bpf.JobMaxArrays:
		return v, fmt.Errorf("%w: %d register arrays: use at most %d", ErrBadJob, j.RegArrays, bpf.JobMaxArrays)
	}
	if err := j.checkThreshold(j.Threshold); err != nil {
		return v, err
	}
	v.PsIp = wire.IPv4ToMap(j.PS.Addr())
	v.PsPort = wire.PortToMap(j.PS.Port())
	v.PsIfindex = j.PSIfindex
	v.FanIn = j.Workers
	v.MaxSlots = j.MaxSlots
	v.RegBase = j.RegBase
	v.RegArrays = j.RegArrays
	v.Threshold = j.Threshold
	return v, nil
}

// checkThreshold says whether j may aggregate with threshold h (admission and SetThreshold alike):
// 0 or 1..its workers, and 0 for a sparse job.
func (j Job) checkThreshold(h uint8) error {
	switch {
	case h > j.Workers:
		return fmt.Errorf("%w: threshold %d above the job's %d workers", ErrBadJob, h, j.Workers)
	case h != 0 && j.RegArrays > 0:
		return fmt.Errorf("%w: a sparse job takes no threshold", ErrBadJob)
	}
	return nil
}

func decodeJob(id uint32, v bpf.XdpaggJob) Job {
	return Job{JobID: id, PS: netip.AddrPortFrom(wire.IPv4FromMap(v.PsIp), wire.PortFromMap(v.PsPort)), PSIfindex: v.PsIfindex,
		Workers: v.FanIn, MaxSlots: v.MaxSlots, Held: v.Held, RegArrays: v.RegArrays, RegBase: v.RegBase, Threshold: v.Threshold}
}

// AddJob admits a job with its control key (KeySize bytes). It fails with ErrJobExists if the id
// is taken: a job's PS and fan-in never change while it exists (remove and add it again).
func (m *Maps) AddJob(j Job, key []byte) error {
	if j.RegArrays > 0 {
		base, err := m.allocArrays(j.RegArrays)
		if err != nil {
			return err
		}
		j.RegBase = base
	}
	v, err := j.encode()
	if err != nil {
		return err
	}
	if len(key) != KeySize {
		return fmt.Errorf("%w: key of %d bytes, want %d", ErrBadJob, len(key), KeySize)
	}
	var k bpf.XdpaggJobKey
	copy(k.Key[:], key)
	// The key first: a job whose entry exists always has its key.
	if err := m.JobKeys.Update(&j.JobID, &k, ebpf.UpdateNoExist); err != nil {
		if errors.Is(err, ebpf.ErrKeyExist) {
			return fmt.Errorf("%w: job %d", ErrJobExists, j.JobID)
		}
		return fmt.Errorf("write key of job %d: %w", j.JobID, err)
	}
	if err := m.Jobs.Update(&j.JobID, &v, ebpf.UpdateNoExist); err != nil {
		_ = m.JobKeys.Delete(&j.JobID)
		if errors.Is(err, ebpf.ErrKeyExist) {
			return fmt.Errorf("%w: job %d", ErrJobExists, j.JobID)
		}
		return fmt.Errorf("admit job %d: %w", j.JobID, err)
	}
	if j.RegArrays > 0 {
		if err := m.initSparse(j); err != nil {
			_ = m.Jobs.Delete(&j.JobID)
			_ = m.JobKeys.Delete(&j.JobID)
			return err
		}
	}
	return nil
}

// Admission returns an admitted job as `job add` made it, with Held read from the datapath and
// Joined left 0: one map lookup, for the agent's per-message checks. The error wraps ErrNoJob if
// there is none.
func (m *Maps) Admission(id uint32) (Job, error) {
	var v bpf.XdpaggJob
	if err := m.Jobs.Lookup(&id, &v); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return Job{}, fmt.Errorf("%w: job %d", ErrNoJob, id)
		}
		return Job{}, fmt.Errorf("read job %d: %w", id, err)
	}
	return decodeJob(id, v), nil
}

// GetJob returns an admitted job with its joined workers; the error wraps ErrNoJob if there is
// none. Joined comes from the job's own worker ids (at most its worker count of lookups), not from
// a walk of every job's workers.
func (m *Maps) GetJob(id uint32) (Job, error) {
	j, err := m.Admission(id)
	if err != nil {
		return j, err
	}
	for w := range j.Workers {
		if _, err := m.Worker(id, w); err == nil {
			j.Joined |= 1 << w
		} else if !errors.Is(err, ebpf.ErrKeyNotExist) {
			return j, err
		}
	}
	return j, nil
}

// JobKey returns the control key of an admitted job; the error wraps ErrNoJob if there is none.
func (m *Maps) JobKey(id uint32) ([]byte, error) {
	var k bpf.XdpaggJobKey
	if err := m.JobKeys.Lookup(&id, &k); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return nil, fmt.Errorf("%w: job %d", ErrNoJob, id)
		}
		return nil, fmt.Errorf("read key of job %d: %w", id, err)
	}
	return append([]byte(nil), k.Key[:]...), nil
}

// joined returns the bitmap of bound worker ids per job.
func (m *Maps) joined() (map[uint32]uint32, error) {
	var (
		k   bpf.XdpaggWorkerKey
		v   bpf.XdpaggWorker
		out = map[uint32]uint32{}
	)
	it := m.Workers.Iterate()
	for it.Next(&k, &v) {
		if k.WorkerId < uint32(wire.MaxWorkers) {
			out[k.JobId] |= 1 << k.WorkerId
		}
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("iterate workers: %w", err)
	}
	return out, nil
}

// ListJobs returns every admitted job, ordered by id.
func (m *Maps) ListJobs() ([]Job, error) {
	var (
		k   uint32
		v   bpf.XdpaggJob
		out []Job
	)
	it := m.Jobs.Iterate()
	for it.Next(&k, &v) {
		out = append(out, decodeJob(k, v))
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("iterate jobs: %w", err)
	}
	joined, err := m.joined()
	if err != nil {
		return nil, err
	}
	for i := range out {
		out[i].Joined = joined[out[i].JobID]
	}
	sort.Slice(out, func(i, j int) bool { return out[i].JobID < out[j].JobID })
	return out, nil
}

// RemoveJob ends a job: its entry and key go first (from then on the datapath drops its DATA and
// RESULTs and the agent its control messages), then its members and contributors, then every slot
// it holds is freed. It returns how many slots were freed; the error wraps ErrNoJob if the job
// was not admitted.
func (m *Maps) RemoveJob(id uint32) (int, error) {
	if err := m.Jobs.Delete(&id); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return 0, fmt.Errorf("%w: job %d", ErrNoJob, id)
		}
		return 0, fmt.Errorf("remove job %d: %w", id, err)
	}
	var errs []error
	if err := m.JobKeys.Delete(&id); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		errs = append(errs, fmt.Errorf("remove key of job %d: %w", id, err))
	}
	members, err := m.ListMembers()
	errs = append(errs, err)
	for _, mb := range members {
		if mb.JobID == id {
			errs = append(errs, m.DeleteMember(id, mb.Ifindex))
		}
	}
	var (
		wk   bpf.XdpaggWorkerKey
		wv   bpf.XdpaggWorker
		left []bpf.XdpaggWorkerKey
	)
	it := m.Workers.Iterate()
	for it.Next(&wk, &wv) {
		if wk.JobId == id {
			left = append(left, wk)
		}
	}
	errs = append(errs, it.Err())
	for _, k := range left {
		if err := m.Workers.Delete(&k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, err)
		}
	}
	if m.SparseJobs != nil {
		if err := m.SparseJobs.Delete(&id); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, fmt.Errorf("remove sparse state of job %d: %w", id, err))
		}
	}
	freed, err := m.collect(id)
	errs = append(errs, err)
	return freed, errors.Join(errs...)
}

// Member says where one worker of a job is reached from the switch.
type Member struct {
	JobID    uint32           `json:"job"`
	WorkerID uint8            `json:"worker"`
	Ifindex  uint32           `json:"ifindex"`  // switch port the worker is behind
	Addr     netip.AddrPort   `json:"addr"`     // worker's IPv4 address and UDP port
	MAC      net.HardwareAddr `json:"mac"`      // worker's MAC (next hop from that port)
	PortMAC  net.HardwareAddr `json:"port_mac"` // the switch port's MAC
	// SrcIP is the source address results carry: always the job's PS. PutMember fills it from
	// the admitted job; any other value is refused.
	SrcIP netip.Addr `json:"src_ip"`
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
	if !wire.UnicastMAC(mb.MAC) {
		// The job's results go out to it: a group address would reach every host on the link.
		return k, v, fmt.Errorf("%w: MAC %v is not a unicast address (group bit set, or all zeros)", ErrBadMember, mb.MAC)
	}
	if int(mb.WorkerID) >= wire.MaxWorkers {
		return k, v, fmt.Errorf("%w: worker id %d: use 0..%d", ErrBadMember, mb.WorkerID, wire.MaxWorkers-1)
	}
	copy(v.DstMac[:], mb.MAC)
	copy(v.SrcMac[:], mb.PortMAC)
	v.DstIp = wire.IPv4ToMap(mb.Addr.Addr())
	v.SrcIp = wire.IPv4ToMap(mb.SrcIP)
	v.DstPort = wire.PortToMap(mb.Addr.Port()) // network byte order in a host-order (little-endian) field
	v.WorkerId = mb.WorkerID
	return k, v, nil
}

// PutMember adds or replaces a member of an admitted job behind a port: where the job's results
// go out of that port (members) and who may contribute (workers: the worker id, address, UDP
// port and port ifindex that the switch's ingress checks). Results carry the job's PS address
// (mb.SrcIP zero is filled in; another address is refused). The error wraps ErrNoJob for a job
// that was not admitted, and ErrBadMember for a worker id beyond the job's fan-in.
func (m *Maps) PutMember(mb Member) error {
	var jv bpf.XdpaggJob
	if err := m.Jobs.Lookup(&mb.JobID, &jv); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("%w: job %d", ErrNoJob, mb.JobID)
		}
		return fmt.Errorf("read job %d: %w", mb.JobID, err)
	}
	ps := wire.IPv4FromMap(jv.PsIp)
	if !mb.SrcIP.IsValid() || mb.SrcIP.IsUnspecified() {
		mb.SrcIP = ps
	}
	if mb.SrcIP != ps {
		return fmt.Errorf("%w: results of job %d come from its PS %v, not %v", ErrBadMember, mb.JobID, ps, mb.SrcIP)
	}
	if mb.WorkerID >= jv.FanIn {
		return fmt.Errorf("%w: worker id %d: job %d has workers 0..%d", ErrBadMember, mb.WorkerID, mb.JobID, jv.FanIn-1)
	}
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
	// The worker id bound elsewhere before (another port) stops receiving there.
	if prev, err := m.Worker(mb.JobID, mb.WorkerID); err == nil && prev.Ifindex != mb.Ifindex {
		if err := m.DeleteMember(mb.JobID, prev.Ifindex); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return err
		}
	}
	if err := m.PutWorker(mb.JobID, mb.WorkerID, mb.Addr, mb.Ifindex); err != nil {
		return err
	}
	if err := m.Members.Put(&k, &v); err != nil {
		return fmt.Errorf("write member job %d ifindex %d: %w", mb.JobID, mb.Ifindex, err)
	}
	return nil
}

// Contributor is a worker id's binding for the ingress membership check.
type Contributor struct {
	Addr    netip.AddrPort // source IPv4 address and UDP port
	Ifindex uint32         // switch port
}

// Worker returns the binding of worker id of job; the error wraps ebpf.ErrKeyNotExist if none.
func (m *Maps) Worker(job uint32, id uint8) (Contributor, error) {
	k := bpf.XdpaggWorkerKey{JobId: job, WorkerId: uint32(id)}
	var v bpf.XdpaggWorker
	if err := m.Workers.Lookup(&k, &v); err != nil {
		return Contributor{}, fmt.Errorf("read worker %d of job %d: %w", id, job, err)
	}
	return Contributor{Addr: netip.AddrPortFrom(wire.IPv4FromMap(v.Ip), wire.PortFromMap(v.Port)), Ifindex: v.Ifindex}, nil
}

// PutWorker lets worker id of job contribute from addr through switch port ifindex (the
// ingress half of PutMember, for senders that take no results there, and for tests).
func (m *Maps) PutWorker(job uint32, id uint8, addr netip.AddrPort, ifindex uint32) error {
	if job == 0 || int(id) >= wire.MaxWorkers || !addr.Addr().Is4() {
		return fmt.Errorf("%w: job %d worker %d at %v: need job > 0, worker 0..%d, IPv4", ErrBadMember, job, id, addr, wire.MaxWorkers-1)
	}
	k := bpf.XdpaggWorkerKey{JobId: job, WorkerId: uint32(id)}
	v := bpf.XdpaggWorker{Ip: wire.IPv4ToMap(addr.Addr()), Ifindex: ifindex, Port: wire.PortToMap(addr.Port())}
	if err := m.Workers.Put(&k, &v); err != nil {
		return fmt.Errorf("write worker %d of job %d: %w", id, job, err)
	}
	return nil
}

// DeleteWorker removes worker id's right to contribute to job (the ingress half of
// DeleteMember, for a binding without an egress entry); none is not an error.
func (m *Maps) DeleteWorker(job uint32, id uint8) error {
	k := bpf.XdpaggWorkerKey{JobId: job, WorkerId: uint32(id)}
	if err := m.Workers.Delete(&k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("delete worker %d of job %d: %w", id, job, err)
	}
	return nil
}

// DeleteMember removes the member of job behind ifindex and its right to contribute. The error
// wraps ebpf.ErrKeyNotExist if there is none.
func (m *Maps) DeleteMember(job, ifindex uint32) error {
	k := bpf.XdpaggMemberKey{JobId: job, Ifindex: ifindex}
	var v bpf.XdpaggMember
	if err := m.Members.Lookup(&k, &v); err != nil {
		return fmt.Errorf("delete member job %d ifindex %d: %w", job, ifindex, err)
	}
	wk := bpf.XdpaggWorkerKey{JobId: job, WorkerId: uint32(v.WorkerId)}
	var wv bpf.XdpaggWorker
	// Only the binding behind this port: the id may have moved to another port since.
	if err := m.Workers.Lookup(&wk, &wv); err == nil && wv.Ifindex == ifindex {
		if err := m.Workers.Delete(&wk); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("delete worker %d of job %d: %w", v.WorkerId, job, err)
		}
	}
	if err := m.Members.Delete(&k); err != nil {
		return fmt.Errorf("delete member job %d ifindex %d: %w", job, ifindex, err)
	}
	return nil
}

// ReclaimIdle frees every slot (half-filled or completed) idle for longer than the switch's slot
// timeout, and returns how many it freed. The switch does the same lazily, when a packet reaches
// such a slot; the agent does it eagerly so that an idle pool ends up empty (ATP's aggregator
// garbage collection). Freeing any slot is safe for the sums: contributors without a result
// resend their data, and resends find no slot and go to the PS. The work is done by the
// xdpagg_gc program: one compare-and-free per slot under its spin lock, on the datapath's clock.
func (m *Maps) ReclaimIdle() (int, error) { return m.collect(0) }

// DatapathNow reads the clock the switch stamps slots with (bpf_ktime_get_ns, the host's
// CLOCK_MONOTONIC), by running the garbage collector over no slot. User space in a time namespace
// (unshare -T) sees another CLOCK_MONOTONIC; this one is right there too.
func (m *Maps) DatapathNow() (uint64, error) {
	if m.GC == nil {
		return 0, fmt.Errorf("no garbage collector program")
	}
	res, err := m.runGC(bpf.XdpaggGcArgs{})
	return res.NowNs, err
}

func (m *Maps) runGC(args bpf.XdpaggGcArgs) (bpf.XdpaggGcArgs, error) {
	return runInKernel(m.GC, "garbage collector", args)
}

// runInKernel runs xdpagg_gc (prog) on args as its packet, which the program answers in place:
// a struct gc_args is a collection, a struct slot_op a slot operation (told apart by size).
func runInKernel[T any](prog *ebpf.Program, what string, args T) (T, error) {
	var res T
	if prog == nil {
		return res, fmt.Errorf("no garbage collector program")
	}
	in, err := binary.Append(nil, binary.LittleEndian, &args)
	if err != nil {
		return res, fmt.Errorf("encode %s arguments: %w", what, err)
	}
	out := make([]byte, len(in))
	ret, err := prog.Run(&ebpf.RunOptions{Data: in, DataOut: out})
	if err != nil {
		return res, fmt.Errorf("run %s: %w", what, err)
	}
	if ret != 2 { // XDP_PASS
		return res, fmt.Errorf("%s returned %d", what, ret)
	}
	if _, err := binary.Decode(out, binary.LittleEndian, &res); err != nil {
		return res, fmt.Errorf("decode %s answer: %w", what, err)
	}
	return res, nil
}

// ErrNoSlot: FlushSlot found no aggregation of the fragment in its slot.
var ErrNoSlot = errors.New("slot holds no aggregation of the fragment")

// SetThreshold changes job's aggregation threshold H at run time (MSG_SETH): 1..its workers, or 0
// for its worker count (synchronous). Fragments completing from then on complete at the new H;
// a slot that already holds H or more completes with its next contribution. The byte is written
// in place by xdpagg_gc (OP_SET_H), not by a map update, which would replace the entry and lose
// the datapath's concurrent changes to its held-slot count. The error wraps ErrNoJob or ErrBadJob.
func (m *Maps) SetThreshold(job uint32, h uint8) error {
	j, err := m.Admission(job)
	if err != nil {
		return err
	}
	if err := j.checkThreshold(h); err != nil {
		return fmt.Errorf("job %d: %w", job, err)
	}
	res, err := m.runOp(bpf.XdpaggSlotOp{Op: uint32(bpf.XdpaggSlotOpKindOP_SET_H), JobId: job, Threshold: uint32(h)})
	if err != nil {
		return err
	}
	if res.Status != uint32(bpf.XdpaggSlotOpStatusOPS_SET) {
		return fmt.Errorf("%w: job %d", ErrNoJob, job) // removed in between
	}
	return nil
}

// FlushSlot forces the partial aggregate of <job, seq> in slot idx out (MSG_FBCAST): in the
// kernel, under the slot's lock, a slot aggregating the fragment becomes complete with the
// contributions it holds, so later contributions get its shadow copy, as after completing at H.
// It returns the sum as a RESULT (header and Count values; bitmap0 names the contributors), and
// whether the slot was complete already. The error wraps ErrNoSlot if the slot holds no
// aggregation of the fragment (free, another fragment's, or an index beyond the pool).
func (m *Maps) FlushSlot(job, seq, idx uint32) (rec bpf.XdpaggResultRec, already bool, err error) {
	res, err := m.runOp(bpf.XdpaggSlotOp{Op: uint32(bpf.XdpaggSlotOpKindOP_FLUSH), JobId: job, Seq: seq, AggIndex: idx})
	if err != nil {
		return rec, false, err
	}
	switch bpf.XdpaggSlotOpStatus(res.Status) {
	case bpf.XdpaggSlotOpStatusOPS_FLUSHED:
		return res.Rec, false, nil
	case bpf.XdpaggSlotOpStatusOPS_COMPLETE:
		return res.Rec, true, nil
	}
	return rec, false, fmt.Errorf("%w: job %d seq %d slot %d", ErrNoSlot, job, seq, idx)
}

// runOp runs one slot operation through xdpagg_gc.
func (m *Maps) runOp(op bpf.XdpaggSlotOp) (bpf.XdpaggSlotOp, error) {
	return runInKernel(m.GC, fmt.Sprintf("slot operation %d", op.Op), op)
}

// collect runs xdpagg_gc over the whole pool: idle slots for job 0, else job's slots.
func (m *Maps) collect(job uint32) (int, error) {
	if m.GC == nil {
		return 0, fmt.Errorf("no garbage collector program")
	}
	pool := m.PoolSize()
	batch := uint32(bpf.XdpaggLimitLIMIT_GC_BATCH)
	freed := 0
	for first := uint32(0); first < pool; first += batch {
		res, err := m.runGC(bpf.XdpaggGcArgs{First: first, Count: min(batch, pool-first), JobId: job})
		if err != nil {
			return freed, err
		}
		freed += int(res.Freed)
	}
	return freed, nil
}
