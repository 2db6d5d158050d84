package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"net/netip"
	"os"
	"strings"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
)

// --reg-arrays and --reg-slots reach the loader's configuration, default to the loader's, and
// the help states the registers' memory.
func TestSwitchRegisterFlags(t *testing.T) {
	cfg, err := parseSwitch([]string{"--iface", "p0"})
	if err != nil {
		t.Fatalf("parseSwitch: %v", err)
	}
	if cfg.Switch.RegArrays != 512 || cfg.Switch.RegSlots != bpf.RegSlots {
		t.Errorf("default registers: %d arrays of %d slots, want 512 of %d", cfg.Switch.RegArrays, cfg.Switch.RegSlots, bpf.RegSlots)
	}
	cfg, err = parseSwitch([]string{"--iface", "p0", "--reg-arrays", "8192", "--reg-slots", "64"})
	if err != nil {
		t.Fatalf("parseSwitch: %v", err)
	}
	if cfg.Switch.RegArrays != 8192 || cfg.Switch.RegSlots != 64 {
		t.Errorf("--reg-arrays 8192 --reg-slots 64 gave %d arrays of %d slots", cfg.Switch.RegArrays, cfg.Switch.RegSlots)
	}
	if regArrayBytes != 3<<10 {
		t.Errorf("a register array takes %d bytes, want 3 KiB", regArrayBytes)
	}

	f, err := os.CreateTemp(t.TempDir(), "stderr")
	if err != nil {
		t.Fatal(err)
	}
	old := os.Stderr
	os.Stderr = f
	err = runSwitch([]string{"-h"}, &bytes.Buffer{})
	os.Stderr = old
	f.Close()
	if !errors.Is(err, flag.ErrHelp) {
		t.Errorf("switch -h = %v, want flag.ErrHelp", err)
	}
	help, _ := os.ReadFile(f.Name())
	for _, s := range []string{"-reg-arrays", "2 x arrays x 3 KiB (3 MiB at 512)", "(default 512)", "-reg-slots", "m x r hot parameters", "(default 256)"} {
		if !strings.Contains(string(help), s) {
			t.Errorf("switch -h does not say %q:\n%s", s, help)
		}
	}
}

// jobListed is a row of `job list --json` (or `job add --json`), decoded loosely.
type jobListed struct {
	JobID     uint32  `json:"job"`
	RegArrays *uint16 `json:"reg_arrays"`
	RegBase   *uint16 `json:"reg_base"`
	Key       string  `json:"key"`
}

// job add --reg-arrays admits sparse jobs on consecutive runs of register arrays, refuses what
// does not fit with the switch's register state in the error, and list shows every job's arrays.
func TestJobAddSparse(t *testing.T) {
	sw, root := jobSwitchConfig(t, loader.Config{PoolSize: 64, RegArrays: 200})
	add := func(id, arrays string, extra ...string) (string, error) {
		return jobCmd(root, append([]string{"add", "--id", id, "--workers", "2", "--ps", "127.0.0.5", "--reg-arrays", arrays}, extra...)...)
	}

	out, err := add("1", "128")
	if err != nil {
		t.Fatalf("job add --reg-arrays 128: %+v", err)
	}
	if want := "job 1 admitted: 2 workers, PS 127.0.0.5:9510 (switch port ifindex 1), at most 64 slots, sparse: 128 register arrays from array 0 of each parity (m=128@0)\n"; !strings.HasPrefix(out, want) {
		t.Errorf("job add printed %q, want it to start with %q", out, want)
	}
	if !strings.Contains(out, "\nkey ") {
		t.Errorf("job add printed no key: %q", out)
	}
	if j, err := sw.Maps.GetJob(1); err != nil || j.RegArrays != 128 || j.RegBase != 0 {
		t.Errorf("job 1 = %+v, %v; want 128 arrays from 0", j, err)
	}
	if st, err := sw.Maps.Sparse(1); err != nil || st.Arrays != 128 || st.Records[0].State != "empty" {
		t.Errorf("sparse state of job 1 = %+v, %v", st, err)
	}

	// 72 arrays are left: 100 do not fit. The error says what the switch has and who holds it.
	out, err = add("2", "100")
	if !errors.Is(err, maps.ErrNoRegisters) || errors.Is(err, errUsage) {
		t.Fatalf("job add --reg-arrays 100 with 72 free = %v, want ErrNoRegisters", err)
	}
	for _, s := range []string{"job 2: --reg-arrays 100", "200 register arrays per parity, 72 free, at most 72 in one run",
		"owned: job 1 m=128@0", "xdpagg job rm", "larger --reg-arrays"} {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("error %q does not say %q", err, s)
		}
	}
	if out != "" {
		t.Errorf("refused job add printed %q", out)
	}
	if _, err := sw.Maps.GetJob(2); !errors.Is(err, maps.ErrNoJob) {
		t.Errorf("refused job 2 admitted: %v", err)
	}
	// More than the switch has at all: a usage error.
	if _, err := add("2", "201"); !errors.Is(err, errUsage) || !strings.Contains(err.Error(), "--reg-arrays 201: the switch has 200 register arrays in all") {
		t.Errorf("job add --reg-arrays 201 = %v, want a usage error", err)
	}

	// The rest fits; --json shows the arrays and their base.
	out, err = add("2", "72", "--json")
	if err != nil {
		t.Fatalf("job add --reg-arrays 72 --json: %+v", err)
	}
	var got jobListed
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("job add --json printed %q: %v", out, err)
	}
	if got.JobID != 2 || got.RegArrays == nil || *got.RegArrays != 72 || got.RegBase == nil || *got.RegBase != 128 || got.Key == "" {
		t.Errorf("job add --json = %s, want reg_arrays 72, reg_base 128 and a key", out)
	}
	// A dense job: reg_arrays 0, no base.
	out, err = jobCmd(root, "add", "--id", "3", "--workers", "2", "--ps", "127.0.0.5", "--json")
	if err != nil {
		t.Fatalf("dense job add: %+v", err)
	}
	got = jobListed{}
	if err := json.Unmarshal([]byte(out), &got); err != nil || got.RegArrays == nil || *got.RegArrays != 0 || got.RegBase != nil {
		t.Errorf("dense job add --json = %s (%v), want reg_arrays 0 and no reg_base", out, err)
	}

	// list: the SPARSE column and the JSON fields, the first sparse job's base 0 included.
	out, err = jobCmd(root, "list")
	if err != nil {
		t.Fatalf("job list: %v", err)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 4 || !strings.HasSuffix(strings.TrimSpace(lines[0]), "SPARSE") {
		t.Fatalf("job list printed %q, want a header ending in SPARSE and three jobs", out)
	}
	for i, want := range []string{"m=128@0", "m=72@128", "-"} {
		f := strings.Fields(lines[i+1])
		if f[len(f)-1] != want {
			t.Errorf("job list row %q: sparse %q, want %q", lines[i+1], f[len(f)-1], want)
		}
	}
	out, err = jobCmd(root, "list", "--json")
	if err != nil {
		t.Fatal(err)
	}
	var listed []jobListed
	if err := json.Unmarshal([]byte(out), &listed); err != nil || len(listed) != 3 {
		t.Fatalf("job list --json = %s (%v)", out, err)
	}
	for i, want := range []struct{ arrays, base int }{{128, 0}, {72, 128}, {0, -1}} {
		l := listed[i]
		if l.RegArrays == nil || int(*l.RegArrays) != want.arrays || (want.base < 0) != (l.RegBase == nil) ||
			(l.RegBase != nil && int(*l.RegBase) != want.base) {
			t.Errorf("job list --json row %d = %+v, want %d arrays from %d", i, l, want.arrays, want.base)
		}
	}
	// The output still decodes as maps.Job.
	var jobs []maps.Job
	if err := json.Unmarshal([]byte(out), &jobs); err != nil || jobs[1].RegArrays != 72 || jobs[1].RegBase != 128 {
		t.Errorf("job list --json as []maps.Job = %+v (%v)", jobs, err)
	}

	// Ending job 1 frees its run for the next sparse job.
	if _, err := jobCmd(root, "rm", "--id", "1"); err != nil {
		t.Fatal(err)
	}
	out, err = add("4", "100")
	if err != nil || !strings.Contains(out, "(m=100@0)") {
		t.Errorf("job add --reg-arrays 100 after job rm = %q, %v; want arrays from 0", out, err)
	}
}

// putSparseState writes a sparse job's datapath state as the datapath would have left it: a
// complete record of iteration 3 (parity 1) with filled slots, an open one of iteration 2 (parity
// 0), and a recirculation histogram.
func putSparseState(t *testing.T, m *maps.Maps, id uint32) {
	t.Helper()
	j, err := m.GetJob(id)
	if err != nil {
		t.Fatal(err)
	}
	var st bpf.XdpaggSparseJob
	st.It[0].Iter, st.It[0].Version, st.It[0].FanIn, st.It[0].State = 2, 7, 2, uint8(bpf.XdpaggSparseStateSPARSE_OPEN)
	st.It[0].Npkts[0], st.It[0].Done[0] = 3, 1
	st.It[1].Iter, st.It[1].Version, st.It[1].FanIn, st.It[1].State = 3, 7, 2, uint8(bpf.XdpaggSparseStateSPARSE_COMPLETE)
	st.It[1].Npkts[0], st.It[1].Npkts[1], st.It[1].Done[0], st.It[1].Done[1], st.It[1].Spilled = 2, 1, 2, 1, 1
	if err := m.SparseJobs.Put(id, &st); err != nil {
		t.Fatalf("write sparse state: %v", err)
	}
	// Parity 1: five slots of iteration 3, one left from iteration 1 (reads as zero).
	total := m.RegArrays()
	for a := range uint32(j.RegArrays) {
		var ra bpf.XdpaggRegArray
		if a == 0 {
			for s := range 5 {
				ra.Cells[s], ra.Hits[s] = 3<<32|uint64(s+1), 2
			}
			ra.Cells[9], ra.Hits[9] = 1<<32|9, 1
		}
		k := total + uint32(j.RegBase) + a
		if err := m.Registers.Put(k, &ra); err != nil {
			t.Fatalf("write register array %d: %v", k, err)
		}
	}
	// 2 empty markers, 10 packets of one pass, 4 of two, 2 of four: 10 recirculations over 16.
	ncpu, err := ebpf.PossibleCPU()
	if err != nil {
		t.Fatal(err)
	}
	for k, n := range []uint64{2, 10, 4, 0, 2} {
		per := make([]uint64, ncpu)
		per[ncpu-1] = n
		if err := m.RecircHist.Put(uint32(k), per); err != nil {
			t.Fatalf("write recirculation histogram: %v", err)
		}
	}
}

// inspect shows sparse jobs' iteration records and register fill, the recirculation histogram
// and the sparse counters, in text and JSON.
func TestInspectSparse(t *testing.T) {
	sw, root := pinnedSwitchConfig(t, "t", loader.Config{PoolSize: 8, RegArrays: 16})
	for _, j := range []maps.Job{
		{JobID: 3, PS: netip.MustParseAddrPort("10.200.9.2:9510"), PSIfindex: 11, Workers: 2, MaxSlots: 8}, // dense
		{JobID: 9, PS: netip.MustParseAddrPort("10.200.9.3:9510"), PSIfindex: 11, Workers: 2, MaxSlots: 8, RegArrays: 4},
	} {
		if err := sw.Maps.AddJob(j, make([]byte, maps.KeySize)); err != nil {
			t.Fatal(err)
		}
	}
	putSparseState(t, sw.Maps, 9)

	var out bytes.Buffer
	if err := runInspect([]string{"--pin-root", root, "--name", "t", "--json"}, &out); err != nil {
		t.Fatalf("inspect --json: %+v", err)
	}
	var in inspectJSON
	if err := json.Unmarshal(out.Bytes(), &in); err != nil {
		t.Fatalf("inspect --json printed %q: %v", out.String(), err)
	}
	if in.RegArrays == nil || *in.RegArrays != 16 {
		t.Errorf("reg_arrays = %v, want 16", in.RegArrays)
	}
	if len(in.Sparse) != 1 {
		t.Fatalf("sparse = %+v, want job 9 only:\n%s", in.Sparse, out.String())
	}
	sp := in.Sparse[0]
	if sp.Job == nil || *sp.Job != 9 || sp.RegArrays == nil || *sp.RegArrays != 4 || len(sp.Records) != 2 || len(sp.Filled) != 2 {
		t.Fatalf("sparse[0] = %+v", sp)
	}
	r0, r1 := sp.Records[0], sp.Records[1]
	if r0.Iteration == nil || *r0.Iteration != 2 || *r0.State != "open" || *r0.Version != 7 || *r0.FanIn != 2 ||
		!equalU16(r0.Announced, 3, 0) || !equalU16(r0.Done, 1, 0) || *r0.Spilled != 0 {
		t.Errorf("parity 0 record = %+v, want iteration 2 open, worker 0 1 of 3 packets", r0)
	}
	if r1.Iteration == nil || *r1.Iteration != 3 || *r1.State != "complete" || *r1.Version != 7 || *r1.FanIn != 2 ||
		!equalU16(r1.Announced, 2, 1) || !equalU16(r1.Done, 2, 1) || *r1.Spilled != 1 {
		t.Errorf("parity 1 record = %+v, want iteration 3 complete, 1 spilled", r1)
	}
	if sp.Filled[0] != 0 || sp.Filled[1] != 5 {
		t.Errorf("filled = %v, want [0 5]", sp.Filled)
	}
	if !equalU64(in.Recirculation, 2, 10, 4, 0, 2) || in.RecircMean == nil || *in.RecircMean != 0.625 {
		t.Errorf("recirculation = %v, mean %v; want [2 10 4 0 2] and 0.625", in.Recirculation, in.RecircMean)
	}
	for _, name := range []string{"sparse_pairs", "sparse_spilled", "sparse_done", "sparse_stale", "recirculated", "pull", "pull_pending", "reg_overflow", "tailcall_err"} {
		if _, ok := in.Counters[name]; !ok {
			t.Errorf("counters have no %q", name)
		}
	}
	// The jobs list shows both jobs' arrays.
	var raw struct {
		Jobs []jobListed `json:"jobs"`
	}
	if err := json.Unmarshal(out.Bytes(), &raw); err != nil || len(raw.Jobs) != 2 {
		t.Fatalf("jobs = %+v (%v)", raw.Jobs, err)
	}
	if j := raw.Jobs[1]; j.JobID != 9 || j.RegArrays == nil || *j.RegArrays != 4 || j.RegBase == nil || *j.RegBase != 0 {
		t.Errorf("job 9 in inspect --json = %+v, want 4 arrays from 0", j)
	}

	// Text, with r given: fill as a share of m x r.
	out.Reset()
	if err := runInspect([]string{"--pin-root", root, "--name", "t", "--reg-slots", "256"}, &out); err != nil {
		t.Fatalf("inspect: %+v", err)
	}
	text := out.String()
	for _, s := range []string{
		"registers: 16 arrays per parity (96 KiB of kernel memory), 4 owned by 1 sparse job, r = 256 slots per array",
		"sparse job 9: m=4 register arrays",
		"PARITY", "HOT VERSION", "DONE/ANNOUNCED BY WORKER", "FILLED",
		"hot packets by passes: empty 2, 1: 10, 2: 4, 3: 0, 4: 2; 0.625 recirculations per non-empty packet",
		"sparse counters: sparse_pairs 0, sparse_spilled 0, sparse_done 0, sparse_stale 0, recirculated 0, pull 0, pull_pending 0, reg_overflow 0, tailcall_err 0",
	} {
		if !strings.Contains(text, s) {
			t.Errorf("inspect does not say %q:\n%s", s, text)
		}
	}
	rows := map[string]string{}
	for line := range strings.Lines(text) {
		if f := strings.Fields(line); len(f) > 2 && (f[0] == "0" || f[0] == "1") && (f[3] == "open" || f[3] == "complete") {
			rows[f[0]] = strings.Join(f, " ")
		}
		if f := strings.Fields(line); len(f) > 1 && f[0] == "9" && f[1] == "10.200.9.3:9510" && f[len(f)-1] != "m=4@0" {
			t.Errorf("job 9 row %q does not end in m=4@0", line)
		}
	}
	if want := "0 2 7 open 2 1/3 0/0 0 0/1024 (0.0%)"; rows["0"] != want {
		t.Errorf("parity 0 row %q, want %q:\n%s", rows["0"], want, text)
	}
	if want := "1 3 7 complete 2 2/2 1/1 1 5/1024 (0.5%)"; rows["1"] != want {
		t.Errorf("parity 1 row %q, want %q:\n%s", rows["1"], want, text)
	}
	// Without r: the count and m.
	out.Reset()
	if err := runInspect([]string{"--pin-root", root, "--name", "t"}, &out); err != nil {
		t.Fatalf("inspect: %+v", err)
	}
	if !strings.Contains(out.String(), "5 (m=4)") {
		t.Errorf("inspect without --reg-slots does not show the fill as 5 (m=4):\n%s", out.String())
	}
}

// A switch with no sparse job and no hot traffic prints only the registers line of the sparse
// section.
func TestInspectDenseOnly(t *testing.T) {
	_, root := pinnedSwitch(t, "t", 8)
	var out bytes.Buffer
	if err := runInspect([]string{"--pin-root", root, "--name", "t"}, &out); err != nil {
		t.Fatalf("inspect: %+v", err)
	}
	text := out.String()
	if !strings.Contains(text, "registers: 512 arrays per parity (3072 KiB of kernel memory), 0 owned by 0 sparse jobs") {
		t.Errorf("inspect has no registers line:\n%s", text)
	}
	for _, s := range []string{"\nsparse job", "hot packets by passes", "sparse counters"} {
		if strings.Contains(text, s) {
			t.Errorf("dense-only inspect says %q:\n%s", s, text)
		}
	}
}

func equalU16(got []uint16, want ...uint16) bool {
	if len(got) != len(want) {
		return false
	}
	for i := range got {
		if got[i] != want[i] {
			return false
		}
	}
	return true
}

func equalU64(got []uint64, want ...uint64) bool {
	if len(got) != len(want) {
		return false
	}
	for i := range got {
		if got[i] != want[i] {
			return false
		}
	}
	return true
}
