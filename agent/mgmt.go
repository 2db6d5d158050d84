package agent

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/mgmt"
	"github.com/xdpagg/xdpagg/wire"
)

// Map names of snapshot entries moved verbatim (mgmt.Raw). Keys are switch-independent: a sparse
// job's register arrays are counted from the job's first, since the standby allocates its own.
const (
	// RawRegisters: key job u32 | parity u32 | array u32 (from the job's first), little-endian;
	// value struct reg_array.
	RawRegisters = bpf.XdpaggMapRegisters
	// RawSparseJobs: key job u32, little-endian; value struct sparse_job with its lock zeroed.
	RawSparseJobs = bpf.XdpaggMapSparseJobs
)

// MgmtPort is a switch port as the management channel names it: ports are matched by name
// across switches (the primary's eth1 is the standby's eth1), ifindexes are per machine.
type MgmtPort struct {
	Name    string
	Ifindex int
	MAC     net.HardwareAddr
}

// Manager is the agent's side of the management channel (mgmt.Handler): the controller admits,
// resets and removes jobs, reads and writes the switch's state, and drains it, through it. It
// takes the paths the operator's CLI and the control plane take (maps.AddJob, RemoveJob,
// ResetJob, PutMember), so a job is the same whoever made it.
type Manager struct {
	name  string
	maps  *maps.Maps
	ctrl  *ControlServer
	ports []MgmtPort
	log   *slog.Logger
	// setDown takes a port administratively down (netlink; tests replace it).
	setDown func(ifindex int) error

	mu       sync.Mutex
	draining bool
}

var (
	_ mgmt.Handler = (*Manager)(nil)
	_ mgmt.Syncer  = (*Manager)(nil)
)

// NewManager makes the management handler of the switch name over m and its control server.
func NewManager(name string, m *maps.Maps, ctrl *ControlServer, ports []MgmtPort, log *slog.Logger) *Manager {
	return &Manager{name: name, maps: m, ctrl: ctrl, ports: ports, log: log, setDown: linkDown}
}

func linkDown(ifindex int) error {
	l, err := netlink.LinkByIndex(ifindex)
	if err != nil {
		return fmt.Errorf("port ifindex %d: %w", ifindex, err)
	}
	if err := netlink.LinkSetDown(l); err != nil {
		return fmt.Errorf("set %s down: %w", l.Attrs().Name, err)
	}
	return nil
}

func (g *Manager) portByName(name string) (MgmtPort, bool) {
	for _, p := range g.ports {
		if p.Name == name {
			return p, true
		}
	}
	return MgmtPort{}, false
}

func (g *Manager) portName(ifindex uint32) string {
	for _, p := range g.ports {
		if p.Ifindex == int(ifindex) {
			return p.Name
		}
	}
	return ""
}

// Admit admits a job (maps.AddJob) with its PS behind the port of that name and its threshold H
// (0: synchronous). Admitting a job again with the same key and parameters succeeds (the
// controller retries); another key or other parameters are refused. H is not compared: it is
// run-time state (MSG_SETH changes it), so a job admitted again keeps the H it has here.
func (g *Manager) Admit(j mgmt.Job) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	_, err := g.admit(j)
	if err == nil {
		g.log.Info("job admitted by the controller", "job", j.ID, "workers", j.Workers, "threshold", j.Threshold, "ps", j.PS, "ps_port", j.PSPort, "reg_arrays", j.RegArrays)
	}
	return err
}

// admit admits j unless it is admitted already as given; fresh says whether it was admitted now.
func (g *Manager) admit(j mgmt.Job) (fresh bool, err error) {
	if len(j.Key) != maps.KeySize {
		return false, fmt.Errorf("%w: job %d: key of %d bytes, want %d", mgmt.ErrRefused, j.ID, len(j.Key), maps.KeySize)
	}
	p, ok := g.portByName(j.PSPort)
	if !ok {
		return false, fmt.Errorf("%w: job %d: no port named %q for its PS", mgmt.ErrIncompatible, j.ID, j.PSPort)
	}
	quota := j.MaxSlots
	if quota == 0 {
		quota = maps.DefaultMaxSlots(g.maps.PoolSize())
	}
	mj := maps.Job{JobID: j.ID, PS: j.PS, PSIfindex: uint32(p.Ifindex), Workers: j.Workers, MaxSlots: quota, RegArrays: j.RegArrays, Threshold: j.Threshold}
	err = g.maps.AddJob(mj, j.Key)
	switch {
	case err == nil:
		g.ctrl.admission(j.ID, j.Key) // a previous admission's control state goes
		return true, nil
	case errors.Is(err, maps.ErrJobExists):
		have, err := g.maps.Admission(j.ID)
		if err != nil {
			return false, err
		}
		key, err := g.maps.JobKey(j.ID)
		if err != nil {
			return false, err
		}
		if !bytes.Equal(key, j.Key) {
			return false, fmt.Errorf("%w: job %d is admitted here with another key", mgmt.ErrRefused, j.ID)
		}
		if have.PS != mj.PS || have.PSIfindex != mj.PSIfindex || have.Workers != mj.Workers || have.MaxSlots != mj.MaxSlots || have.RegArrays != mj.RegArrays {
			return false, fmt.Errorf("%w: job %d is admitted here as %+v, not %+v", mgmt.ErrRefused, j.ID, have, mj)
		}
		return false, nil
	case errors.Is(err, maps.ErrBadJob), errors.Is(err, maps.ErrNoRegisters):
		return false, fmt.Errorf("%w: %w", mgmt.ErrRefused, err)
	}
	return false, err
}

// Remove ends a job as `xdpagg job rm` does, and the control server forgets it. Removing a job
// that is not admitted succeeds (a retried Remove whose answer was lost).
func (g *Manager) Remove(id uint32) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	freed, removed, err := g.removeJob(id)
	if removed {
		g.log.Info("job removed by the controller", "job", id, "slots_freed", freed)
	}
	return err
}

// removeJob ends job id and makes the control server forget it; removed is false (and err nil)
// if it was not admitted.
func (g *Manager) removeJob(id uint32) (freed int, removed bool, err error) {
	freed, err = g.maps.RemoveJob(id)
	if errors.Is(err, maps.ErrNoJob) {
		return 0, false, nil
	}
	g.ctrl.forgetJob(id)
	return freed, err == nil, err
}

// Reset clears a job's slots, registers and iteration records as MSG_RESET does.
func (g *Manager) Reset(id uint32) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	freed, err := g.maps.ResetJob(id)
	if errors.Is(err, maps.ErrNoJob) {
		return fmt.Errorf("%w: %w", mgmt.ErrRefused, err)
	}
	if err != nil {
		return err
	}
	g.log.Info("job reset by the controller", "job", id, "slots_freed", freed)
	return nil
}

// Drain takes every switch port administratively down: the dual-homed hosts behind them move
// to the standby. XDP, the maps and the agent stay, so snapshots and heartbeats keep working.
func (g *Manager) Drain() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	var errs []error
	for _, p := range g.ports {
		if err := g.setDown(p.Ifindex); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("drain: %w", err)
	}
	if !g.draining {
		g.log.Warn("switch drained by the controller: every port is down", "ports", len(g.ports))
	}
	g.draining = true
	return nil
}

// le32s encodes u32s little-endian (snapshot keys).
func le32s(vs ...uint32) []byte {
	out := make([]byte, 0, 4*len(vs))
	for _, v := range vs {
		out = binary.LittleEndian.AppendUint32(out, v)
	}
	return out
}

func encode(v any) ([]byte, error) {
	b, err := binary.Append(nil, binary.LittleEndian, v)
	if err != nil {
		return nil, fmt.Errorf("encode %T: %w", v, err)
	}
	return b, nil
}

// decode reads b into v, which must take exactly len(b) bytes.
func decode(b []byte, v any) error {
	if n := binary.Size(v); n != len(b) {
		return fmt.Errorf("%w: %T of %d bytes, want %d", mgmt.ErrIncompatible, v, len(b), n)
	}
	_, err := binary.Decode(b, binary.LittleEndian, v)
	return err
}

// Snapshot reads the jobs (with their keys) and members; ScopeAll adds every slot in use, sparse
// jobs' registers and iteration records, the retransmit cache and the sparse updates. Slots and
// records are read under their spin locks, one at a time: the snapshot of a switch still running is each value
// at some moment, not the whole switch at one moment (the controller drains a switch first
// where it needs the latter).
func (g *Manager) Snapshot(scope mgmt.Scope) (*mgmt.Snapshot, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	s := &mgmt.Snapshot{Switch: g.name, Taken: time.Now(), Scope: scope, Pool: g.maps.PoolSize(),
		Arrays: g.maps.RegArrays(), Draining: g.draining}
	jobs, err := g.maps.ListJobs()
	if err != nil {
		return nil, err
	}
	for _, j := range jobs {
		key, err := g.maps.JobKey(j.JobID)
		if err != nil {
			return nil, err
		}
		s.Jobs = append(s.Jobs, mgmt.Job{ID: j.JobID, Workers: j.Workers, PS: j.PS, PSPort: g.portName(j.PSIfindex),
			MaxSlots: j.MaxSlots, RegArrays: j.RegArrays, Threshold: j.Threshold, Key: key})
	}
	ms, err := g.maps.ListMembers()
	if err != nil {
		return nil, err
	}
	for _, mb := range ms {
		b, err := g.maps.Worker(mb.JobID, mb.WorkerID)
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			continue // unbound between the two reads
		} else if err != nil {
			return nil, err
		}
		if b.Ifindex != mb.Ifindex {
			continue // rebound behind another port between the two reads: its entry there counts
		}
		s.Members = append(s.Members, mgmt.Member{Job: mb.JobID, Worker: mb.WorkerID, Port: g.portName(mb.Ifindex),
			Addr: b.Addr, MAC: mb.MAC, PortMAC: mb.PortMAC})
	}
	if scope != mgmt.ScopeAll {
		return s, nil
	}
	if err := g.snapshotSlots(s); err != nil {
		return nil, err
	}
	for _, j := range jobs {
		if j.RegArrays == 0 {
			continue
		}
		if err := g.snapshotSparse(s, j); err != nil {
			return nil, err
		}
	}
	if g.ctrl.cache != nil {
		s.Cache = g.ctrl.cache.Export()
	}
	if g.ctrl.sparse != nil {
		s.Cache = append(s.Cache, g.ctrl.sparse.Export()...) // told apart by their encoding
	}
	return s, nil
}

func (g *Manager) snapshotSlots(s *mgmt.Snapshot) error {
	now, err := g.maps.DatapathNow()
	if err != nil {
		return err
	}
	for i := range g.maps.PoolSize() {
		sl, err := g.maps.SlotLocked(i)
		if err != nil {
			return err
		}
		if sl.State == uint8(bpf.XdpaggSlotStateSLOT_FREE) {
			continue
		}
		v, err := encode(&sl)
		if err != nil {
			return err
		}
		var idle time.Duration
		if now > sl.TsNs {
			idle = time.Duration(now - sl.TsNs)
		}
		s.Slots = append(s.Slots, mgmt.Slot{Index: i, Value: v, Idle: idle})
	}
	return nil
}

func (g *Manager) snapshotSparse(s *mgmt.Snapshot, j maps.Job) error {
	for parity := range uint32(2) {
		for a := range uint32(j.RegArrays) {
			ra, err := g.maps.JobRegisters(j, parity, a)
			if err != nil {
				return err
			}
			v, err := encode(&ra)
			if err != nil {
				return err
			}
			s.Sparse = append(s.Sparse, mgmt.Raw{Map: RawRegisters, Key: le32s(j.JobID, parity, a), Value: v})
		}
	}
	rec, err := g.maps.SparseRecords(j.JobID)
	if err != nil {
		return err
	}
	v, err := encode(&rec)
	if err != nil {
		return err
	}
	s.Sparse = append(s.Sparse, mgmt.Raw{Map: RawSparseJobs, Key: le32s(j.JobID), Value: v})
	return nil
}

// Restore writes another switch's snapshot here: its jobs are admitted (or found admitted with
// the same key and parameters) and given the snapshot's threshold H (maps.SetThreshold, in place
// as MSG_SETH does, so the job's held-slot count is kept), its members bound behind the ports of
// the same names (worker ids bound here already keep their bindings), its slots written into the
// same indexes where those are free here (ages kept: their timestamps are rebased on this
// switch's datapath clock), sparse registers and records where the job has none here yet (both
// iteration records empty), and cached results and sparse updates. What belongs to a job admitted here with another
// key, and slots this switch uses, are skipped and counted. A snapshot of another pool size or
// register array count, naming a port this switch does not have, or giving a job a threshold
// beyond its workers, is refused with mgmt.ErrIncompatible before anything is written.
//
// Restore writes the jobs' slot counts (maps.AddHeld) assuming none of their traffic reaches this
// switch yet: the controller restores before it moves the traffic.
func (g *Manager) Restore(s *mgmt.Snapshot) (mgmt.RestoreStats, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	var st mgmt.RestoreStats
	if err := g.fits(s); err != nil {
		return st, err
	}
	ours, err := g.admitAll(s, &st, "restore")
	if err != nil {
		return st, err
	}
	for _, mb := range s.Members {
		if _, ok := ours[mb.Job]; !ok {
			st.Skipped++
			continue
		}
		p, _ := g.portByName(mb.Port)
		// A worker id bound here already keeps its binding (it joined this switch itself, which
		// is newer than any snapshot); the same binding is a member restored before.
		if have, err := g.maps.Worker(mb.Job, mb.Worker); err == nil {
			if have.Ifindex == uint32(p.Ifindex) && have.Addr == mb.Addr {
				st.Members++
			} else {
				st.Skipped++
			}
			continue
		} else if !errors.Is(err, ebpf.ErrKeyNotExist) {
			return st, err
		}
		err := g.maps.PutMember(maps.Member{JobID: mb.Job, WorkerID: mb.Worker, Ifindex: uint32(p.Ifindex), Addr: mb.Addr, MAC: mb.MAC, PortMAC: p.MAC})
		if errors.Is(err, maps.ErrBadMember) {
			st.Skipped++
			continue
		} else if err != nil {
			return st, err
		}
		g.ctrl.restoredMember(mb.Job, mb.Worker)
		st.Members++
	}
	if err := g.restoreSlots(s, ours, &st); err != nil {
		return st, err
	}
	if err := g.restoreSparse(s, ours, &st); err != nil {
		return st, err
	}
	if g.ctrl.cache != nil || g.ctrl.sparse != nil {
		now := time.Now()
		for _, rec := range s.Cache {
			if len(rec) < wire.HdrSize {
				st.Skipped++
				continue
			}
			var h wire.Header
			wire.DecodeHeader(rec, &h)
			if _, ok := ours[h.JobId]; !ok || g.ctrl.storeResult(rec, now) != nil {
				st.Skipped++
				continue
			}
			st.Cache++
		}
	}
	g.log.Info("snapshot restored", "from", s.Switch, "taken", s.Taken, "jobs", st.Jobs, "members", st.Members,
		"slots", st.Slots, "sparse", st.Sparse, "cache", st.Cache, "skipped", st.Skipped)
	return st, nil
}

// fits refuses, with mgmt.ErrIncompatible and before anything is written, a snapshot of another
// pool size or register array count, naming a port this switch does not have, or giving a job a
// threshold beyond its workers.
func (g *Manager) fits(s *mgmt.Snapshot) error {
	if s.Pool != g.maps.PoolSize() || s.Arrays != g.maps.RegArrays() {
		return fmt.Errorf("%w: pool %d and %d register arrays, this switch has %d and %d", mgmt.ErrIncompatible, s.Pool, s.Arrays, g.maps.PoolSize(), g.maps.RegArrays())
	}
	for _, j := range s.Jobs {
		if _, ok := g.portByName(j.PSPort); !ok {
			return fmt.Errorf("%w: job %d's PS is behind port %q, which this switch does not have", mgmt.ErrIncompatible, j.ID, j.PSPort)
		}
		if j.Threshold > j.Workers || (j.Threshold != 0 && j.RegArrays > 0) {
			return fmt.Errorf("%w: job %d: threshold %d for %d workers (sparse %v)", mgmt.ErrIncompatible, j.ID, j.Threshold, j.Workers, j.RegArrays > 0)
		}
	}
	for _, mb := range s.Members {
		if _, ok := g.portByName(mb.Port); !ok {
			return fmt.Errorf("%w: worker %d of job %d is behind port %q, which this switch does not have", mgmt.ErrIncompatible, mb.Worker, mb.Job, mb.Port)
		}
	}
	return nil
}

// admitAll admits the snapshot's jobs (or finds them admitted with the same key and parameters)
// and gives them the snapshot's H; it returns the jobs whose state the caller may write. A job
// admitted here with another key or other parameters is skipped and counted.
func (g *Manager) admitAll(s *mgmt.Snapshot, st *mgmt.RestoreStats, what string) (map[uint32]maps.Job, error) {
	ours := map[uint32]maps.Job{}
	for _, j := range s.Jobs {
		if _, err := g.admit(j); err != nil {
			if errors.Is(err, mgmt.ErrRefused) {
				g.log.Warn(what+": job skipped", "job", j.ID, "err", err)
				st.Skipped++
				continue
			}
			return nil, err
		}
		have, err := g.maps.Admission(j.ID)
		if err != nil {
			return nil, err
		}
		if have.Threshold != j.Threshold {
			// The snapshot's H is the one its switch aggregated with last (MSG_SETH may have
			// moved it since the admission).
			if err := g.maps.SetThreshold(j.ID, j.Threshold); err != nil {
				return nil, err
			}
			have.Threshold = j.Threshold
		}
		ours[j.ID] = have
		st.Jobs++
	}
	return ours, nil
}

// Sync mirrors the active switch's control snapshot here (mgmt.SyncRequest), so that this
// standby aggregates for the job's members the moment the hosts' traffic reaches it. For the
// snapshot's jobs it makes the bindings equal to the snapshot's: a worker id bound here as in
// the snapshot (address, UDP port, port name, MAC) is kept; one bound otherwise is replaced; one
// the snapshot does not bind (it left, or its job lost it) is removed, with its right to
// contribute. A binding a worker made by a JOIN to this switch is left as it is unless r.Force
// (it joined here because its traffic reached this switch: this switch is serving it, and the
// snapshot of the other one is older news); such entries are counted skipped. The jobs in Gone
// are removed. Slots, registers, records and the cache are not
// touched (a snapshot carrying any is refused): what this switch aggregates is its own.
// Bindings are exactly the active switch's, so this switch admits no packet the active one would
// not (docs/security.md).
func (g *Manager) Sync(r mgmt.SyncRequest) (mgmt.RestoreStats, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	var st mgmt.RestoreStats
	s := r.Snapshot
	if s.Scope != mgmt.ScopeControl || len(s.Slots) > 0 || len(s.Sparse) > 0 || len(s.Cache) > 0 {
		return st, fmt.Errorf("%w: sync takes a control snapshot (jobs and members) only", mgmt.ErrRefused)
	}
	for _, id := range r.Gone {
		if slices.ContainsFunc(s.Jobs, func(j mgmt.Job) bool { return j.ID == id }) {
			return st, fmt.Errorf("%w: job %d both in the snapshot and gone", mgmt.ErrRefused, id)
		}
	}
	if err := g.fits(s); err != nil {
		return st, err
	}
	ours, err := g.admitAll(s, &st, "sync")
	if err != nil {
		return st, err
	}
	want := map[workerRef]maps.Member{}
	for _, mb := range s.Members {
		if _, ok := ours[mb.Job]; !ok {
			st.Skipped++
			continue
		}
		p, _ := g.portByName(mb.Port)
		want[workerRef{job: mb.Job, worker: mb.Worker}] = maps.Member{JobID: mb.Job, WorkerID: mb.Worker, Ifindex: uint32(p.Ifindex), Addr: mb.Addr, MAC: mb.MAC, PortMAC: p.MAC}
	}
	// Egress entries first: one that is not exactly a wanted member goes (with the binding
	// behind its port).
	have, err := g.maps.ListMembers()
	if err != nil {
		return st, err
	}
	keep := func(job uint32, w uint8) bool { return !r.Force && g.ctrl.joinedHere(job, w) }
	for _, mb := range have {
		if _, ok := ours[mb.JobID]; !ok {
			continue
		}
		w, ok := want[workerRef{job: mb.JobID, worker: mb.WorkerID}]
		if ok && w.Ifindex == mb.Ifindex && w.Addr == mb.Addr && bytes.Equal(w.MAC, mb.MAC) {
			continue
		}
		if keep(mb.JobID, mb.WorkerID) {
			continue // counted below, with its worker id
		}
		if err := g.maps.DeleteMember(mb.JobID, mb.Ifindex); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return st, err
		}
		g.ctrl.unboundMember(mb.JobID, mb.WorkerID)
		st.Unbound++
	}
	// Then every worker id of the jobs: bound exactly as wanted, or not at all.
	for id, j := range ours {
		for w := range j.Workers {
			mb, wanted := want[workerRef{job: id, worker: w}]
			b, err := g.maps.Worker(id, w)
			bound := err == nil
			if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
				return st, err
			}
			if wanted && bound && b.Ifindex == mb.Ifindex && b.Addr == mb.Addr {
				if _, err := g.maps.Member(id, mb.Ifindex); err == nil {
					st.Members++
					continue
				}
			}
			if bound && keep(id, w) {
				st.Skipped++ // joined here: not the mirror's to change
				continue
			}
			if wanted {
				// Behind the port it goes to, another worker id that joined here keeps its place.
				if other, err := g.maps.Member(id, mb.Ifindex); err == nil && other.WorkerID != w && keep(id, other.WorkerID) {
					st.Skipped++
					continue
				}
			}
			if !wanted {
				if bound {
					if err := g.maps.DeleteWorker(id, w); err != nil {
						return st, err
					}
					g.ctrl.unboundMember(id, w)
					st.Unbound++
				}
				continue
			}
			if bound && (b.Ifindex != mb.Ifindex || b.Addr != mb.Addr) {
				st.Unbound++ // replaced: the worker rebound on the active switch
			}
			if err := g.maps.PutMember(mb); errors.Is(err, maps.ErrBadMember) {
				st.Skipped++
				continue
			} else if err != nil {
				return st, err
			}
			g.ctrl.restoredMember(id, w)
			st.Members++
		}
	}
	for _, id := range r.Gone {
		freed, removed, err := g.removeJob(id)
		if err != nil {
			return st, err
		}
		if !removed {
			continue
		}
		g.log.Info("sync: job removed (the active switch no longer has it)", "job", id, "slots_freed", freed)
		st.Removed++
	}
	if st.Unbound > 0 || st.Removed > 0 || st.Skipped > 0 {
		g.log.Info("control state synced", "from", s.Switch, "taken", s.Taken, "jobs", st.Jobs, "members", st.Members,
			"unbound", st.Unbound, "removed", st.Removed, "skipped", st.Skipped)
	}
	return st, nil
}

func (g *Manager) restoreSlots(s *mgmt.Snapshot, ours map[uint32]maps.Job, st *mgmt.RestoreStats) (err error) {
	if len(s.Slots) == 0 {
		return nil
	}
	now, err := g.maps.DatapathNow()
	if err != nil {
		return err
	}
	held := map[uint32]int32{}
	defer func() {
		for job, n := range held {
			if herr := g.maps.AddHeld(job, n); herr != nil {
				err = errors.Join(err, herr)
			}
		}
	}()
	for _, in := range s.Slots {
		var sl bpf.XdpaggSlot
		if err := decode(in.Value, &sl); err != nil {
			return err
		}
		state := bpf.XdpaggSlotState(sl.State)
		if _, ok := ours[sl.JobId]; !ok || in.Index >= g.maps.PoolSize() || in.Idle < 0 ||
			(state != bpf.XdpaggSlotStateSLOT_AGGREGATING && state != bpf.XdpaggSlotStateSLOT_COMPLETE) {
			st.Skipped++
			continue
		}
		have, err := g.maps.SlotLocked(in.Index)
		if err != nil {
			return err
		}
		if have.State != uint8(bpf.XdpaggSlotStateSLOT_FREE) {
			st.Skipped++ // this switch's own (or restored before): never overwritten
			continue
		}
		sl.Lock.Val = 0
		sl.TsNs = 0
		if idle := uint64(in.Idle); idle < now {
			sl.TsNs = now - idle
		}
		if err := g.maps.PutSlotLocked(in.Index, &sl); err != nil {
			return err
		}
		held[sl.JobId]++
		st.Slots++
	}
	return nil
}

// restoreSparse writes sparse jobs' registers and iteration records, only of jobs whose records
// here are both empty: a job that has started an iteration on this switch keeps its own state.
func (g *Manager) restoreSparse(s *mgmt.Snapshot, ours map[uint32]maps.Job, st *mgmt.RestoreStats) error {
	fresh := map[uint32]bool{}
	for id, j := range ours {
		if j.RegArrays == 0 {
			continue
		}
		rec, err := g.maps.SparseRecords(id)
		if err != nil {
			return err
		}
		fresh[id] = rec.It[0].State == 0 && rec.It[1].State == 0
	}
	for _, r := range s.Sparse {
		var job uint32
		if len(r.Key) >= 4 {
			job = binary.LittleEndian.Uint32(r.Key)
		}
		j, ok := ours[job]
		if !ok || !fresh[job] {
			st.Skipped++
			continue
		}
		switch {
		case r.Map == RawRegisters && len(r.Key) == 12:
			parity, a := binary.LittleEndian.Uint32(r.Key[4:]), binary.LittleEndian.Uint32(r.Key[8:])
			var ra bpf.XdpaggRegArray
			if err := decode(r.Value, &ra); err != nil {
				return err
			}
			if err := g.maps.PutJobRegisters(j, parity, a, &ra); errors.Is(err, maps.ErrBadIndex) {
				st.Skipped++
				continue
			} else if err != nil {
				return err
			}
		case r.Map == RawSparseJobs && len(r.Key) == 4:
			var rec bpf.XdpaggSparseJob
			if err := decode(r.Value, &rec); err != nil {
				return err
			}
			rec.Lock.Val = 0
			if err := g.maps.PutSparseRecords(job, &rec); err != nil {
				return err
			}
		default:
			st.Skipped++
			continue
		}
		st.Sparse++
	}
	return nil
}

// listenMgmt opens the management channel's TCP listener and makes its server, and lets the
// control server answer heartbeats arriving on the interface of its address.
func listenMgmt(addr string, key []byte, h mgmt.Handler, ctrl *ControlServer, log *slog.Logger) (*mgmt.Server, net.Listener, error) {
	srv, err := mgmt.NewServer(key, h)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	var warn warnLimiter
	srv.OnBadFrame = func(reason string, err error) {
		if suppressed, ok := warn.allow(0, time.Now()); ok {
			log.Warn("management connection dropped", "reason", reason, "err", err, "suppressed_since_last", suppressed)
		}
	}
	host, _, _ := net.SplitHostPort(addr)
	ip := net.ParseIP(host)
	if host != "" && ip == nil {
		return nil, nil, fmt.Errorf("%w: management address %q: give an IP address, not a name", ErrConfig, addr)
	}
	var lc net.ListenConfig
	if ip == nil || ip.IsUnspecified() {
		// Every interface, the switch ports too: only the controller key keeps hosts behind the
		// ports out (docs/operations.md says so; give the management address instead).
		ctrl.SetHeartbeatInterfaces(true)
	} else {
		ifindex, err := interfaceOf(ip)
		if err != nil {
			return nil, nil, err
		}
		if _, port := ctrl.ports[ifindex]; port {
			return nil, nil, fmt.Errorf("%w: management address %v is on switch port ifindex %d: give the address of an interface on the management network, not an --iface port (a drain takes the ports down)", ErrConfig, ip, ifindex)
		}
		ifc, err := net.InterfaceByIndex(ifindex)
		if err != nil {
			return nil, nil, fmt.Errorf("management interface %d: %w", ifindex, err)
		}
		ctrl.SetHeartbeatInterfaces(false, ifindex)
		// Bound to the management interface: Linux would otherwise take a connection to this
		// address arriving on any interface (the weak host model), a switch port included, so a
		// host behind a port could reach the channel. Bound, such a SYN finds no listener.
		lc.Control = func(_, _ string, rc syscall.RawConn) error {
			var serr error
			if err := rc.Control(func(fd uintptr) {
				serr = unix.SetsockoptString(int(fd), unix.SOL_SOCKET, unix.SO_BINDTODEVICE, ifc.Name)
			}); err != nil {
				return err
			}
			return serr
		}
	}
	ln, err := lc.Listen(context.Background(), "tcp", addr)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: management address %q: %w", ErrConfig, addr, err)
	}
	return srv, ln, nil
}

// interfaceOf returns the interface that has address ip.
func interfaceOf(ip net.IP) (int, error) {
	ifs, err := net.Interfaces()
	if err != nil {
		return 0, fmt.Errorf("list interfaces: %w", err)
	}
	for _, ifc := range ifs {
		addrs, err := ifc.Addrs()
		if err != nil {
			continue
		}
		for _, a := range addrs {
			if ipn, ok := a.(*net.IPNet); ok && ipn.IP.Equal(ip) {
				return ifc.Index, nil
			}
		}
	}
	return 0, fmt.Errorf("%w: management address %v is on no interface here", ErrConfig, ip)
}
