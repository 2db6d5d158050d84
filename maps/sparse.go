package maps

import (
	"errors"
	"fmt"
	"sort"

	"github.com/cilium/ebpf"

	"github.com/xdpagg/xdpagg/bpf"
)

// ErrNoRegisters: a sparse job asks for more register arrays than the switch has free in one run.
var ErrNoRegisters = errors.New("not enough free register arrays")

// RegArrays is how many register arrays the switch holds per iteration parity (loader.Config).
func (m *Maps) RegArrays() uint32 {
	if m.Registers == nil {
		return 0
	}
	return m.Registers.MaxEntries() / 2
}

// allocArrays finds the lowest run of n register arrays no admitted job owns. Admission is the
// operator's (one `job add` at a time), so reading the jobs and then writing one is not a race.
func (m *Maps) allocArrays(n uint16) (uint16, error) {
	total := m.RegArrays()
	jobs, err := m.ListJobs()
	if err != nil {
		return 0, err
	}
	type run struct{ base, n uint32 }
	var used []run
	for _, j := range jobs {
		if j.RegArrays > 0 {
			used = append(used, run{uint32(j.RegBase), uint32(j.RegArrays)})
		}
	}
	sort.Slice(used, func(a, b int) bool { return used[a].base < used[b].base })
	next := uint32(0)
	for _, u := range used {
		if u.base >= next+uint32(n) {
			break
		}
		next = max(next, u.base+u.n)
	}
	if next+uint32(n) > total || next > 0xffff {
		return 0, fmt.Errorf("%w: want %d of %d arrays", ErrNoRegisters, n, total)
	}
	return uint16(next), nil
}

// initSparse zeroes a sparse job's register arrays (of both parities; a previous owner's cells
// would otherwise count as this job's if their iteration tags matched) and makes its iteration
// records.
func (m *Maps) initSparse(j Job) error {
	total := m.RegArrays()
	var zero bpf.XdpaggRegArray
	for parity := range uint32(2) {
		for a := range uint32(j.RegArrays) {
			k := parity*total + uint32(j.RegBase) + a
			if err := m.Registers.Put(&k, &zero); err != nil {
				return fmt.Errorf("clear register array %d of job %d: %w", k, j.JobID, err)
			}
		}
	}
	var st bpf.XdpaggSparseJob
	if err := m.SparseJobs.Update(&j.JobID, &st, ebpf.UpdateAny); err != nil {
		return fmt.Errorf("make sparse state of job %d: %w", j.JobID, err)
	}
	return nil
}

// SparseIteration is one of a sparse job's two iteration records, as the datapath keeps it.
type SparseIteration struct {
	Iteration uint32   `json:"iteration"`
	Version   uint32   `json:"hot_version"`
	State     string   `json:"state"` // "empty", "open" or "complete"
	FanIn     uint8    `json:"fan_in"`
	Announced []uint16 `json:"announced"` // hot packets each worker announced (0: none yet)
	Done      []uint16 `json:"done"`      // packets of each worker through the switch
	Spilled   uint16   `json:"spilled"`   // packets handed to the PS with pairs left
}

// SparseState is a sparse job's datapath state: both iteration records and register fill.
type SparseState struct {
	JobID   uint32             `json:"job"`
	Arrays  int                `json:"reg_arrays"` // m
	Records [2]SparseIteration `json:"records"`    // by iteration parity
	// Filled counts, per parity, the job's register slots that hold a sum of the record's
	// iteration (the rest read as zero): the hot keys the workers touched in it.
	Filled [2]int `json:"filled"`
}

// Sparse reads a sparse job's iteration records and register fill. ErrNoJob if the job is not an
// admitted sparse job.
func (m *Maps) Sparse(id uint32) (SparseState, error) {
	j, err := m.GetJob(id)
	if err != nil {
		return SparseState{}, err
	}
	if j.RegArrays == 0 || m.SparseJobs == nil {
		return SparseState{}, fmt.Errorf("%w: job %d is not sparse", ErrNoJob, id)
	}
	var st bpf.XdpaggSparseJob
	if err := m.SparseJobs.Lookup(&id, &st); err != nil {
		return SparseState{}, fmt.Errorf("read sparse state of job %d: %w", id, err)
	}
	out := SparseState{JobID: id, Arrays: int(j.RegArrays)}
	total := m.RegArrays()
	for p := range 2 {
		it := st.It[p]
		rec := SparseIteration{Iteration: it.Iter, Version: it.Version, FanIn: it.FanIn, Spilled: it.Spilled,
			State: [...]string{"empty", "open", "complete"}[min(int(it.State), 2)]}
		for w := range int(it.FanIn) {
			rec.Announced = append(rec.Announced, it.Npkts[w])
			rec.Done = append(rec.Done, it.Done[w])
		}
		out.Records[p] = rec
		if it.State == 0 {
			continue
		}
		var ra bpf.XdpaggRegArray
		for a := range uint32(j.RegArrays) {
			k := uint32(p)*total + uint32(j.RegBase) + a
			if err := m.Registers.Lookup(&k, &ra); err != nil {
				return out, fmt.Errorf("read register array %d: %w", k, err)
			}
			for s := range ra.Cells {
				// Ever added to, and last for this iteration (an untouched cell is all
				// zero: iteration 0's tag).
				if ra.Hits[s] != 0 && uint32(ra.Cells[s]>>32)&0x7fffffff == it.Iter&0x7fffffff {
					out.Filled[p]++
				}
			}
		}
	}
	return out, nil
}

// RecircHistogram returns hot packets by passes taken: index 0 counts empty markers, index k
// packets that took k passes (k-1 recirculations), up to bpf.SparseMaxPasses.
func (m *Maps) RecircHistogram() ([]uint64, error) {
	out := make([]uint64, bpf.SparseMaxPasses+1)
	if m.RecircHist == nil {
		return out, nil
	}
	for k := range uint32(len(out)) {
		var per []uint64
		if err := m.RecircHist.Lookup(&k, &per); err != nil {
			return nil, fmt.Errorf("read recirculation histogram: %w", err)
		}
		for _, v := range per {
			out[k] += v
		}
	}
	return out, nil
}

// RecirculationsPerPacket is the mean recirculations (passes - 1) of the non-empty hot packets
// in a RecircHistogram.
func RecirculationsPerPacket(h []uint64) float64 {
	var n, r uint64
	for k := 1; k < len(h); k++ {
		n += h[k]
		r += uint64(k-1) * h[k]
	}
	if n == 0 {
		return 0
	}
	return float64(r) / float64(n)
}

// ResetJob clears what the switch holds of a job without ending it (iSwitch's Reset): it frees
// the job's aggregator slots, and for a sparse job zeroes its register arrays and iteration
// records. Its admission, key and members stay. Returns the slots freed. Contributions that were
// in the freed state are gone: their workers' resends bring them to the PS.
func (m *Maps) ResetJob(id uint32) (int, error) {
	j, err := m.GetJob(id)
	if err != nil {
		return 0, err
	}
	freed, err := m.collect(id)
	if err != nil {
		return freed, err
	}
	if j.RegArrays > 0 && m.Registers != nil {
		if err := m.initSparse(j); err != nil {
			return freed, err
		}
	}
	return freed, nil
}
