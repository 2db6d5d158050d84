package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"sort"
	"text/tabwriter"
	"time"

	"github.com/xdpagg/xdpagg/agent"
	"github.com/xdpagg/xdpagg/maps"
)

// jobView is one job: its PS, joined workers and the slots it holds by state.
type jobView struct {
	maps.Job
	Aggregating int `json:"slots_aggregating"`
	Complete    int `json:"slots_complete"`
}

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
}

func runInspect(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("inspect", flag.ContinueOnError)
	var (
		name    = fs.String("name", "default", "switch name (as given to xdpagg switch --name)")
		pinRoot = fs.String("pin-root", agent.DefaultPinRoot, "bpffs directory the switch pinned under")
		asJSON  = fs.Bool("json", false, "print JSON")
		slots   = fs.Bool("slots", false, "list every slot in use, not just the count")
	)
	if err := parseFlags(fs, args); err != nil {
		return err
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
		in.Jobs = append(in.Jobs, jobView{Job: j})
	}
	for i := range in.Jobs {
		byJob[in.Jobs[i].JobID] = &in.Jobs[i]
	}
	for _, s := range used {
		jv := byJob[s.JobID]
		if jv == nil { // slots of a job that left (held until reused or reclaimed)
			in.Jobs = append(in.Jobs, jobView{Job: maps.Job{JobID: s.JobID}})
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
		fmt.Fprintln(tw, "JOB\tPS\tWORKERS\tJOINED\tSLOTS AGGREGATING\tSLOTS COMPLETE\tMAX SLOTS")
		for _, j := range in.Jobs {
			ps := "-" // slots of a job no longer admitted, until they are freed
			if j.PS.IsValid() {
				ps = j.PS.String()
			}
			fmt.Fprintf(tw, "%d\t%s\t%d\t%#x\t%d\t%d\t%d\n", j.JobID, ps, j.Workers, j.Joined, j.Aggregating, j.Complete, j.MaxSlots)
		}
		tw.Flush()
	}
	if c := in.Cache; c != nil {
		fmt.Fprintf(stdout, "\nretransmit cache: %d results (%d bytes); stored %d, hits %d, misses %d, evicted %d acknowledged + %d by age; %d worker acks\n",
			c.Entries, c.Bytes, c.Stored, c.Hits, c.Misses, c.EvictedAcked, c.EvictedAge, c.Acks)
	}
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
