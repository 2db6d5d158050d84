package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/xdpagg/xdpagg/agent"
	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/maps"
)

// jobView is one job: its PS, joined workers, register arrays and the slots it holds by state.
type jobView struct {
	jobJSON
	Aggregating int `json:"slots_aggregating"`
	Complete    int `json:"slots_complete"`
}

// sparseCounters are the counters of the sparse datapath, in the order inspect prints them.
var sparseCounters = []maps.Counter{maps.CntSparsePairs, maps.CntSparseSpill, maps.CntSparseDone, maps.CntSparseStale,
	maps.CntRecirc, maps.CntPull, maps.CntPullPending, maps.CntRegOverflow, maps.CntTailcallErr}

// inspection is what `xdpagg inspect --json` prints.
type inspection struct {
	PinDir   string            `json:"pin_dir"`
	PoolSize uint32            `json:"pool_size"`
	Counters map[string]uint64 `json:"counters"`
	Ports    []uint32          `json:"ports"`
	Members  []maps.Member     `json:"members"`
	Jobs     []jobView         `json:"jobs"`
	Cache    *maps.CacheStats  `json:"retransmit_cache,omitempty"` // nil: the agent runs without it
	InUse    int               `json:"slots_in_use"`
	Slots    []maps.SlotInfo   `json:"slots,omitempty"`
	// RegArrays is the switch's register arrays per iteration parity (xdpagg switch
	// --reg-arrays); RegSlots the slots per array r when given with --reg-slots (the pinned
	// maps do not hold it), else absent.
	RegArrays uint32 `json:"reg_arrays"`
	RegSlots  uint32 `json:"reg_slots,omitempty"`
	// Sparse holds each sparse job's iteration records and register fill, by job id.
	Sparse []maps.SparseState `json:"sparse"`
	// Recirculation counts hot packets by the passes they took: index 0 empty markers, k for k
	// passes (k-1 recirculations), up to bpf.SparseMaxPasses; RecircMean is the mean
	// recirculations per non-empty hot packet.
	Recirculation []uint64 `json:"recirculation"`
	RecircMean    float64  `json:"recirculations_per_packet"`
}

func runInspect(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("inspect", flag.ContinueOnError)
	var (
		name    = fs.String("name", "default", "switch name (as given to xdpagg switch --name)")
		pinRoot = fs.String("pin-root", agent.DefaultPinRoot, "bpffs directory the switch pinned under")
		asJSON  = fs.Bool("json", false, "print JSON")
		slots   = fs.Bool("slots", false, "list every slot in use, not just the count")
		rSlots  = fs.Uint("reg-slots", 0, fmt.Sprintf("the switch's slots per register array r (xdpagg switch --reg-slots, 1..%d), to show sparse jobs' register fill as a share of m x r; 0: unknown (fill as a count)", bpf.RegSlots))
		ctlView = fs.String("controller-status", "", "instead of a switch, show the controller's view from this status file (or its --state-dir): groups, active switches, members, jobs, thresholds, the last failover")
	)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *ctlView != "" {
		return inspectController(*ctlView, *asJSON, stdout)
	}
	if *rSlots > uint(bpf.RegSlots) {
		return fmt.Errorf("%w: --reg-slots %d: use 1..%d, or 0 if unknown", errUsage, *rSlots, bpf.RegSlots)
	}
	dir := agent.PinDir(*pinRoot, *name)
	m, err := maps.OpenPinned(dir)
	if err != nil {
		return fmt.Errorf("%w (is `xdpagg switch --name %s` running?)", err, *name)
	}
	defer m.Close()

	var in inspection
	in.PinDir = dir
	in.PoolSize = m.PoolSize()
	cnt, err := m.ReadCounters()
	if err != nil {
		return err
	}
	in.Counters = cnt.Map()
	if in.Ports, err = m.ListPorts(); err != nil {
		return err
	}
	if in.Members, err = m.ListMembers(); err != nil {
		return err
	}
	used, err := m.SlotsInUse()
	if err != nil {
		return err
	}
	in.InUse = len(used)
	if cs, ok, err := maps.ReadCacheStats(dir); err != nil {
		return err
	} else if ok {
		in.Cache = &cs
	}
	jobs, err := m.ListJobs()
	if err != nil {
		return err
	}
	byJob := map[uint32]*jobView{}
	for _, j := range jobs {
		in.Jobs = append(in.Jobs, jobView{jobJSON: newJobJSON(j)})
	}
	for i := range in.Jobs {
		byJob[in.Jobs[i].JobID] = &in.Jobs[i]
	}
	for _, s := range used {
		jv := byJob[s.JobID]
		if jv == nil { // slots of a job that left (held until reused or reclaimed)
			in.Jobs = append(in.Jobs, jobView{jobJSON: newJobJSON(maps.Job{JobID: s.JobID})})
			for i := range in.Jobs {
				byJob[in.Jobs[i].JobID] = &in.Jobs[i]
			}
			jv = byJob[s.JobID]
		}
		if s.State == "aggregating" {
			jv.Aggregating++
		} else {
			jv.Complete++
		}
	}
	if *slots {
		in.Slots = used
	}
	in.RegArrays = m.RegArrays()
	in.RegSlots = uint32(*rSlots)
	in.Sparse = []maps.SparseState{}
	for _, j := range jobs {
		if j.RegArrays == 0 {
			continue
		}
		st, err := m.Sparse(j.JobID)
		if errors.Is(err, maps.ErrNoJob) {
			continue // removed since it was listed
		}
		if err != nil {
			return err
		}
		in.Sparse = append(in.Sparse, st)
	}
	if in.Recirculation, err = m.RecircHistogram(); err != nil {
		return err
	}
	in.RecircMean = maps.RecirculationsPerPacket(in.Recirculation)
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(in)
	}

	fmt.Fprintf(stdout, "switch %s  pool %d slots, %d in use, ports %v\n\n", dir, in.PoolSize, in.InUse, in.Ports)
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "COUNTER\tVALUE")
	for i := range maps.NumCounters {
		fmt.Fprintf(tw, "%s\t%d\n", maps.CounterName(maps.Counter(i)), cnt[i])
	}
	tw.Flush()
	if len(in.Members) > 0 {
		fmt.Fprintln(stdout)
		tw = tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "JOB\tWORKER\tIFINDEX\tADDR\tMAC")
		for _, mb := range in.Members {
			fmt.Fprintf(tw, "%d\t%d\t%d\t%v\t%v\n", mb.JobID, mb.WorkerID, mb.Ifindex, mb.Addr, mb.MAC)
		}
		tw.Flush()
	}
	if len(in.Jobs) > 0 {
		fmt.Fprintln(stdout)
		tw = tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "JOB\tPS\tWORKERS\tTHRESHOLD\tJOINED\tSLOTS AGGREGATING\tSLOTS COMPLETE\tMAX SLOTS\tSPARSE")
		for _, j := range in.Jobs {
			ps := "-" // slots of a job no longer admitted, until they are freed
			if j.PS.IsValid() {
				ps = j.PS.String()
			}
			th := "-"
			if j.PS.IsValid() {
				th = thresholdDesc(j.Job)
			}
			fmt.Fprintf(tw, "%d\t%s\t%d\t%s\t%#x\t%d\t%d\t%d\t%s\n", j.JobID, ps, j.Workers, th, j.Joined, j.Aggregating, j.Complete, j.MaxSlots, sparseDesc(j.Job))
		}
		tw.Flush()
	}
	if c := in.Cache; c != nil {
		fmt.Fprintf(stdout, "\nretransmit cache: %d results (%d bytes); stored %d, hits %d, misses %d, evicted %d acknowledged + %d by age; %d worker acks\n",
			c.Entries, c.Bytes, c.Stored, c.Hits, c.Misses, c.EvictedAcked, c.EvictedAge, c.Acks)
	}
	printSparse(stdout, &in, cnt)
	if *slots && len(used) > 0 {
		sort.Slice(used, func(i, j int) bool { return used[i].Index < used[j].Index })
		fmt.Fprintln(stdout)
		tw = tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "SLOT\tJOB\tSEQ\tSTATE\tFILL\tVALUES\tAGE\tFLAGS")
		for _, s := range used {
			flags := ""
			if s.Overflow {
				flags += "overflow "
			}
			if s.ECN {
				flags += "ecn"
			}
			fmt.Fprintf(tw, "%d\t%d\t%d\t%s\t%d/%d\t%d\t%v\t%s\n", s.Index, s.JobID, s.Seq, s.State,
				s.Counter, s.FanIn, s.Values, s.Age.Round(time.Millisecond), flags)
		}
		tw.Flush()
	}
	return nil
}

// printSparse prints the sparse datapath: the register arrays, each sparse job's iteration
// records and register fill, the recirculation histogram and the sparse counters.
func printSparse(w io.Writer, in *inspection, cnt maps.Counters) {
	owned := 0
	for _, st := range in.Sparse {
		owned += st.Arrays
	}
	jobs := "jobs"
	if len(in.Sparse) == 1 {
		jobs = "job"
	}
	fmt.Fprintf(w, "\nregisters: %d arrays per parity (%d KiB of kernel memory), %d owned by %d sparse %s",
		in.RegArrays, 2*uint64(in.RegArrays)*regArrayBytes>>10, owned, len(in.Sparse), jobs)
	if in.RegSlots > 0 {
		fmt.Fprintf(w, ", r = %d slots per array", in.RegSlots)
	}
	fmt.Fprintln(w)
	for _, st := range in.Sparse {
		fmt.Fprintf(w, "\nsparse job %d: m=%d register arrays\n", st.JobID, st.Arrays)
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "PARITY\tITERATION\tHOT VERSION\tSTATE\tFAN-IN\tDONE/ANNOUNCED BY WORKER\tSPILLED\tFILLED")
		for p, r := range st.Records {
			pkts := "-"
			if len(r.Announced) > 0 {
				var per []string
				for i := range r.Announced {
					per = append(per, fmt.Sprintf("%d/%d", r.Done[i], r.Announced[i]))
				}
				pkts = strings.Join(per, " ")
			}
			fmt.Fprintf(tw, "%d\t%d\t%d\t%s\t%d\t%s\t%d\t%s\n", p, r.Iteration, r.Version, r.State, r.FanIn, pkts, r.Spilled,
				fillDesc(st.Filled[p], st.Arrays, in.RegSlots))
		}
		tw.Flush()
	}
	h := in.Recirculation
	var packets uint64
	for _, n := range h {
		packets += n
	}
	if packets == 0 && len(in.Sparse) == 0 {
		nonzero := false
		for _, c := range sparseCounters {
			nonzero = nonzero || cnt[c] != 0
		}
		if !nonzero {
			return // a dense-only switch: nothing more to say
		}
	}
	fmt.Fprint(w, "\nhot packets by passes:")
	for k, n := range h {
		if k == 0 {
			fmt.Fprintf(w, " empty %d", n)
		} else {
			fmt.Fprintf(w, ", %d: %d", k, n)
		}
	}
	fmt.Fprintf(w, "; %.3f recirculations per non-empty packet\n", in.RecircMean)
	var parts []string
	for _, c := range sparseCounters {
		parts = append(parts, fmt.Sprintf("%s %d", maps.CounterName(c), cnt[c]))
	}
	fmt.Fprintf(w, "sparse counters: %s\n", strings.Join(parts, ", "))
}

// fillDesc is a parity's register fill: the slots holding a sum of its iteration, and their
// share of the job's m x r slots when r is known.
func fillDesc(filled, m int, r uint32) string {
	if r == 0 {
		return fmt.Sprintf("%d (m=%d)", filled, m)
	}
	total := m * int(r)
	return fmt.Sprintf("%d/%d (%.1f%%)", filled, total, 100*float64(filled)/float64(total))
}
