package maps

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"

	"github.com/xdpagg/xdpagg/bpf"
)

// What moves a switch's aggregation state to another switch (the management channel's Snapshot
// and Restore): whole map values read and written under their spin locks (BPF_F_LOCK), so a
// value is never read or written half-updated by the datapath.

// SlotLocked reads slot idx under its spin lock (the lock field reads as zero).
func (m *Maps) SlotLocked(idx uint32) (bpf.XdpaggSlot, error) {
	var s bpf.XdpaggSlot
	if idx >= m.PoolSize() {
		return s, fmt.Errorf("%w: %d of %d", ErrBadIndex, idx, m.PoolSize())
	}
	if err := m.Slots.LookupWithFlags(idx, &s, ebpf.LookupLock); err != nil {
		return s, fmt.Errorf("read slot %d: %w", idx, err)
	}
	return s, nil
}

// PutSlotLocked writes slot idx under its spin lock (the value's lock field is ignored). The
// caller accounts the slot to its job (AddHeld).
func (m *Maps) PutSlotLocked(idx uint32, s *bpf.XdpaggSlot) error {
	if idx >= m.PoolSize() {
		return fmt.Errorf("%w: %d of %d", ErrBadIndex, idx, m.PoolSize())
	}
	if err := m.Slots.Update(idx, s, ebpf.UpdateLock); err != nil {
		return fmt.Errorf("write slot %d: %w", idx, err)
	}
	return nil
}

// AddHeld adds delta to the slots job holds (slots written by PutSlotLocked). The job entry is
// read and written back: an add the datapath makes in between is lost, so call it only while no
// traffic of the job reaches this switch (a restore before the job's traffic moves here). A count
// off by one costs the job one slot of quota, never a sum.
func (m *Maps) AddHeld(job uint32, delta int32) error {
	var v bpf.XdpaggJob
	if err := m.Jobs.Lookup(&job, &v); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("%w: job %d", ErrNoJob, job)
		}
		return fmt.Errorf("read job %d: %w", job, err)
	}
	v.Held += delta
	if err := m.Jobs.Update(&job, &v, ebpf.UpdateExist); err != nil {
		return fmt.Errorf("write job %d: %w", job, err)
	}
	return nil
}

// registerKey is the `registers` key of array a (0..RegArrays-1) of job j of one parity.
func (m *Maps) registerKey(j Job, parity, a uint32) (uint32, error) {
	if parity > 1 || a >= uint32(j.RegArrays) || m.Registers == nil {
		return 0, fmt.Errorf("%w: register array %d parity %d of job %d (it has %d)", ErrBadIndex, a, parity, j.JobID, j.RegArrays)
	}
	return parity*m.RegArrays() + uint32(j.RegBase) + a, nil
}

// JobRegisters reads array a (counted from the job's first) of one parity of sparse job j.
func (m *Maps) JobRegisters(j Job, parity, a uint32) (bpf.XdpaggRegArray, error) {
	var v bpf.XdpaggRegArray
	k, err := m.registerKey(j, parity, a)
	if err != nil {
		return v, err
	}
	if err := m.Registers.Lookup(&k, &v); err != nil {
		return v, fmt.Errorf("read register array %d: %w", k, err)
	}
	return v, nil
}

// PutJobRegisters writes array a (counted from the job's first) of one parity of sparse job j.
func (m *Maps) PutJobRegisters(j Job, parity, a uint32, v *bpf.XdpaggRegArray) error {
	k, err := m.registerKey(j, parity, a)
	if err != nil {
		return err
	}
	if err := m.Registers.Put(&k, v); err != nil {
		return fmt.Errorf("write register array %d: %w", k, err)
	}
	return nil
}

// SparseRecords reads a sparse job's iteration records under their lock; the error wraps
// ebpf.ErrKeyNotExist for a job that has none (a dense job).
func (m *Maps) SparseRecords(job uint32) (bpf.XdpaggSparseJob, error) {
	var v bpf.XdpaggSparseJob
	if m.SparseJobs == nil {
		return v, fmt.Errorf("read sparse state of job %d: %w", job, ebpf.ErrKeyNotExist)
	}
	if err := m.SparseJobs.LookupWithFlags(&job, &v, ebpf.LookupLock); err != nil {
		return v, fmt.Errorf("read sparse state of job %d: %w", job, err)
	}
	return v, nil
}

// PutSparseRecords writes the iteration records of a sparse job admitted here, under their lock.
func (m *Maps) PutSparseRecords(job uint32, v *bpf.XdpaggSparseJob) error {
	if m.SparseJobs == nil {
		return fmt.Errorf("write sparse state of job %d: %w", job, ebpf.ErrKeyNotExist)
	}
	if err := m.SparseJobs.Update(&job, v, ebpf.UpdateExist|ebpf.UpdateLock); err != nil {
		return fmt.Errorf("write sparse state of job %d: %w", job, err)
	}
	return nil
}
