package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/internal/bpftest"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
)

func TestUsage(t *testing.T) {
	var b bytes.Buffer
	usage(&b)
	for _, c := range commands {
		if !strings.Contains(b.String(), c.name) || !strings.Contains(b.String(), c.summary) {
			t.Errorf("usage does not list %q: %q", c.name, b.String())
		}
	}
}

// quietStderr sends what the flag package prints (parse errors, -h) to /dev/null for the test.
func quietStderr(t *testing.T) {
	t.Helper()
	null, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	old := os.Stderr
	os.Stderr = null
	t.Cleanup(func() {
		os.Stderr = old
		null.Close()
	})
}

// usageCase is a command line that must be rejected before any work with a usage error saying want.
type usageCase struct {
	args []string
	want string
}

func checkUsage(t *testing.T, run func([]string, *bytes.Buffer) error, cases []usageCase) {
	t.Helper()
	quietStderr(t)
	for _, tc := range cases {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			var out bytes.Buffer
			err := run(tc.args, &out)
			if !errors.Is(err, errUsage) {
				t.Fatalf("error = %v, want a usage error", err)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q does not say %q", err, tc.want)
			}
			if out.Len() != 0 {
				t.Errorf("rejected command wrote to stdout: %q", out.String())
			}
		})
	}
}

func TestSwitchFlags(t *testing.T) {
	run := func(args []string, out *bytes.Buffer) error { return runSwitch(args, out) }
	checkUsage(t, run, []usageCase{
		{nil, "--iface is required"},
		{[]string{"--name", "x"}, "--iface is required"},
		{[]string{"--iface", "p0", "--port", "0"}, "--port 0: use 1..65535"},
		{[]string{"--iface", "p0", "--port", "65536"}, "--port 65536: use 1..65535"},
		{[]string{"--iface", "p0", "--pool", "0"}, "--pool 0: use 1..131072"},
		{[]string{"--iface", "p0", "--pool", "1048577"}, "--pool 1048577"},
		{[]string{"--iface", "p0", "stray"}, `unexpected argument "stray"`},
		{[]string{"stray", "--iface", "p0"}, `unexpected argument "stray"`},
		{[]string{"--iface", "p0", "--bogus"}, "flag provided but not defined: -bogus"},
		{[]string{"--iface", "p0", "--port", "x"}, "invalid value"},
		{[]string{"--iface", "p0,p0"}, `interface "p0" named twice`},
		{[]string{"--iface", "p0", "--name", "a/b"}, `switch name "a/b"`},
		{[]string{"--iface", "p0", "--name", ""}, `switch name ""`},
		{[]string{"--iface", "p0", "--slot-timeout", "10us"}, "slot timeout 10µs: use at least 1ms"},
		{[]string{"--iface", "p0", "--reg-arrays", "0"}, "--reg-arrays 0: use 1..8192 (kernel memory 2 x arrays x 3 KiB)"},
		{[]string{"--iface", "p0", "--reg-arrays", "8193"}, "--reg-arrays 8193: use 1..8192"},
		{[]string{"--iface", "p0", "--reg-slots", "0"}, "--reg-slots 0: use 1..256"},
		{[]string{"--iface", "p0", "--reg-slots", "257"}, "--reg-slots 257: use 1..256"},
	})
}

func TestDemoFlags(t *testing.T) {
	run := func(args []string, out *bytes.Buffer) error { return runDemo(args, out) }
	checkUsage(t, run, []usageCase{
		{[]string{"--workers", "0"}, "--workers 0: use 1..32"},
		{[]string{"--workers", "33"}, "--workers 33: use 1..32"},
		{[]string{"--workers", "-1"}, "--workers -1"},
		{[]string{"--values", "0"}, "--values 0: use at least 1"},
		{[]string{"--values", "-5"}, "--values -5"},
		{[]string{"--rounds", "0"}, "--rounds 0: use at least 1"},
		{[]string{"--workers", "2", "extra"}, `unexpected argument "extra"`},
		{[]string{"--nope"}, "flag provided but not defined: -nope"},
	})
}

func TestInspectFlags(t *testing.T) {
	run := func(args []string, out *bytes.Buffer) error { return runInspect(args, out) }
	checkUsage(t, run, []usageCase{
		{[]string{"--json", "extra"}, `unexpected argument "extra"`},
		{[]string{"--json=maybe"}, "invalid boolean value"},
		{[]string{"--reg-slots", "257"}, "--reg-slots 257: use 1..256, or 0 if unknown"},
	})
	quietStderr(t)
	if err := runInspect([]string{"-h"}, &bytes.Buffer{}); !errors.Is(err, flag.ErrHelp) {
		t.Errorf("inspect -h = %v, want flag.ErrHelp (exit 0)", err)
	}
}

func TestInspectNoSwitch(t *testing.T) {
	root := filepath.Join(t.TempDir(), "missing")
	var out bytes.Buffer
	err := runInspect([]string{"--pin-root", root, "--name", "sw"}, &out)
	if err == nil {
		t.Fatal("inspect of a missing switch succeeded")
	}
	if !errors.Is(err, maps.ErrNoSwitch) {
		t.Errorf("error %v does not wrap maps.ErrNoSwitch", err)
	}
	if errors.Is(err, errUsage) {
		t.Errorf("a missing switch is reported as a usage error: %v", err)
	}
	for _, s := range []string{"xdpagg switch", filepath.Join(root, "sw"), "--name sw"} {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("error %q does not mention %q", err, s)
		}
	}
	if out.Len() != 0 {
		t.Errorf("failed inspect wrote %q", out.String())
	}
}

// pinnedSwitch loads a switch, pins it under a private bpffs as <root>/<name> and returns it and
// the root. Everything is undone at cleanup.
func pinnedSwitch(t *testing.T, name string, pool uint32) (*loader.Switch, string) {
	t.Helper()
	return pinnedSwitchConfig(t, name, loader.Config{PoolSize: pool})
}

// pinnedSwitchConfig is pinnedSwitch for a switch of any configuration.
func pinnedSwitchConfig(t *testing.T, name string, cfg loader.Config) (*loader.Switch, string) {
	t.Helper()
	root := t.TempDir()
	if err := loader.MountBPFFS(root); err != nil {
		t.Fatalf("MountBPFFS: %v", err)
	}
	t.Cleanup(func() { _ = unix.Unmount(root, unix.MNT_DETACH) })
	sw, err := loader.Load(cfg)
	bpftest.Check(t, "load switch", err)
	t.Cleanup(func() {
		if err := sw.Close(); err != nil {
			t.Errorf("close switch: %v", err)
		}
	})
	if err := sw.Pin(filepath.Join(root, name)); err != nil {
		t.Fatalf("Pin: %v", err)
	}
	return sw, root
}

// inspectJSON is the part of `inspect --json` the tests read, decoded loosely so that a renamed
// field shows up as missing.
type inspectJSON struct {
	PinDir   *string           `json:"pin_dir"`
	PoolSize *uint32           `json:"pool_size"`
	Counters map[string]uint64 `json:"counters"`
	Ports    []uint32          `json:"ports"`
	Members  []struct {
		JobID   uint32 `json:"job"`
		Worker  uint8  `json:"worker"`
		Ifindex uint32 `json:"ifindex"`
		Addr    string `json:"addr"`
		SrcIP   string `json:"src_ip"`
	} `json:"members"`
	Jobs []struct {
		JobID       uint32 `json:"job"`
		PS          string `json:"ps"`
		Workers     uint8  `json:"workers"`
		Joined      uint32 `json:"joined"`
		MaxSlots    uint32 `json:"max_slots"`
		Aggregating int    `json:"slots_aggregating"`
		Complete    int    `json:"slots_complete"`
	} `json:"jobs"`
	InUse *int `json:"slots_in_use"`
	Slots []struct {
		Index uint32 `json:"index"`
		Job   uint32 `json:"job"`
		State string `json:"state"`
	} `json:"slots"`
	RegArrays     *uint32           `json:"reg_arrays"`
	RegSlots      *uint32           `json:"reg_slots"`
	Sparse        []sparseStateJSON `json:"sparse"`
	Recirculation []uint64          `json:"recirculation"`
	RecircMean    *float64          `json:"recirculations_per_packet"`
}

// sparseStateJSON is one sparse job in `inspect --json`, decoded loosely.
type sparseStateJSON struct {
	Job       *uint32 `json:"job"`
	RegArrays *int    `json:"reg_arrays"`
	Records   []struct {
		Iteration *uint32  `json:"iteration"`
		Version   *uint32  `json:"hot_version"`
		State     *string  `json:"state"`
		FanIn     *uint8   `json:"fan_in"`
		Announced []uint16 `json:"announced"`
		Done      []uint16 `json:"done"`
		Spilled   *uint16  `json:"spilled"`
	} `json:"records"`
	Filled []int `json:"filled"`
}

func TestInspectJSON(t *testing.T) {
	_, root := pinnedSwitch(t, "t", 48)
	var out bytes.Buffer
	if err := runInspect([]string{"--pin-root", root, "--name", "t", "--json"}, &out); err != nil {
		t.Fatalf("inspect --json: %+v", err)
	}
	var in inspectJSON
	if err := json.Unmarshal(out.Bytes(), &in); err != nil {
		t.Fatalf("inspect --json printed %q: %v", out.String(), err)
	}
	if in.PoolSize == nil || *in.PoolSize != 48 {
		t.Errorf("pool_size = %v, want 48 (output %s)", in.PoolSize, out.String())
	}
	if in.PinDir == nil || *in.PinDir != filepath.Join(root, "t") {
		t.Errorf("pin_dir = %v, want %s", in.PinDir, filepath.Join(root, "t"))
	}
	if _, ok := in.Counters["rx"]; !ok {
		t.Errorf(`counters %v have no "rx"`, in.Counters)
	}
	if len(in.Counters) != maps.NumCounters {
		t.Errorf("counters has %d entries, want %d", len(in.Counters), maps.NumCounters)
	}
	for name, v := range in.Counters {
		if v != 0 {
			t.Errorf("fresh switch: counter %s = %d", name, v)
		}
	}
	if in.InUse == nil || *in.InUse != 0 {
		t.Errorf("slots_in_use = %v, want 0", in.InUse)
	}
	if len(in.Ports) != 0 || len(in.Members) != 0 || len(in.Slots) != 0 {
		t.Errorf("fresh switch: ports %v members %v slots %v, want none", in.Ports, in.Members, in.Slots)
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(out.Bytes(), &raw); err != nil {
		t.Fatal(err)
	}
	if _, ok := raw["slots"]; ok {
		t.Error("slots listed without --slots")
	}
	// The sparse datapath: the default registers, no sparse job (an empty list, not null), an
	// empty recirculation histogram of every pass count.
	if in.RegArrays == nil || *in.RegArrays != 512 {
		t.Errorf("reg_arrays = %v, want the default 512", in.RegArrays)
	}
	if in.RegSlots != nil {
		t.Errorf("reg_slots = %d without --reg-slots, want absent", *in.RegSlots)
	}
	if s := string(raw["sparse"]); s != "[]" {
		t.Errorf("sparse = %s, want []", s)
	}
	if len(in.Recirculation) != bpf.SparseMaxPasses+1 || in.RecircMean == nil || *in.RecircMean != 0 {
		t.Errorf("recirculation = %v (mean %v), want %d zeros and mean 0", in.Recirculation, in.RecircMean, bpf.SparseMaxPasses+1)
	}
	for k, n := range in.Recirculation {
		if n != 0 {
			t.Errorf("fresh switch: %d packets took %d passes", n, k)
		}
	}
}

func TestInspectShowsState(t *testing.T) {
	sw, root := pinnedSwitch(t, "t", 8)
	if err := sw.Maps.AddJob(maps.Job{JobID: 3, PS: netip.MustParseAddrPort("10.200.9.2:9510"), PSIfindex: 11, Workers: 4, MaxSlots: 8},
		make([]byte, maps.KeySize)); err != nil {
		t.Fatal(err)
	}
	mb := maps.Member{JobID: 3, WorkerID: 2, Ifindex: 11, Addr: netip.MustParseAddrPort("10.200.1.2:40001"),
		MAC: net.HardwareAddr{2, 0, 0, 0, 0, 1}, PortMAC: net.HardwareAddr{2, 0, 0, 0, 0, 2},
		SrcIP: netip.MustParseAddr("10.200.9.2")}
	if err := sw.Maps.PutMember(mb); err != nil {
		t.Fatal(err)
	}
	slot := bpf.XdpaggSlot{JobId: 3, Seq: 5, Bitmap: 1, Nvals: 4, FanIn: 2, Counter: 1,
		State: uint8(bpf.XdpaggSlotStateSLOT_AGGREGATING), TsNs: ^uint64(0)}
	if err := sw.Maps.Slots.Put(uint32(6), &slot); err != nil {
		t.Fatal(err)
	}
	gone := bpf.XdpaggSlot{JobId: 9, Seq: 1, Bitmap: 3, Nvals: 4, FanIn: 2, Counter: 2,
		State: uint8(bpf.XdpaggSlotStateSLOT_COMPLETE), TsNs: ^uint64(0)} // of a job no longer admitted
	if err := sw.Maps.Slots.Put(uint32(7), &gone); err != nil {
		t.Fatal(err)
	}
	frame := make([]byte, 64)
	frame[12], frame[13] = 0x08, 0x06 // ARP: counted as non_agg
	if _, err := sw.Objects.XdpaggSwitch.Run(&ebpf.RunOptions{Data: frame}); err != nil {
		bpftest.Check(t, "BPF_PROG_TEST_RUN", err)
	}

	var out bytes.Buffer
	if err := runInspect([]string{"--pin-root", root, "--name", "t", "--json", "--slots"}, &out); err != nil {
		t.Fatalf("inspect --json --slots: %+v", err)
	}
	var in inspectJSON
	if err := json.Unmarshal(out.Bytes(), &in); err != nil {
		t.Fatalf("inspect --json printed %q: %v", out.String(), err)
	}
	if in.Counters["non_agg"] != 1 {
		t.Errorf("counters %v, want non_agg 1", in.Counters)
	}
	if len(in.Members) != 1 || in.Members[0].JobID != 3 || in.Members[0].Worker != 2 ||
		in.Members[0].Ifindex != 11 || in.Members[0].Addr != "10.200.1.2:40001" || in.Members[0].SrcIP != "10.200.9.2" {
		t.Errorf("members = %+v, want job 3 worker 2 ifindex 11 at 10.200.1.2:40001", in.Members)
	}
	if in.InUse == nil || *in.InUse != 2 {
		t.Errorf("slots_in_use = %v, want 2", in.InUse)
	}
	if len(in.Slots) != 2 || in.Slots[0].Index != 6 || in.Slots[0].Job != 3 || in.Slots[0].State != "aggregating" ||
		in.Slots[1].Index != 7 || in.Slots[1].Job != 9 || in.Slots[1].State != "complete" {
		t.Errorf("slots = %+v, want slot 6 of job 3 aggregating, slot 7 of job 9 complete", in.Slots)
	}
	if len(in.Jobs) != 2 || in.Jobs[0].JobID != 3 || in.Jobs[0].PS != "10.200.9.2:9510" || in.Jobs[0].Workers != 4 ||
		in.Jobs[0].Joined != 1<<2 || in.Jobs[0].MaxSlots != 8 || in.Jobs[0].Aggregating != 1 || in.Jobs[0].Complete != 0 ||
		in.Jobs[1].JobID != 9 || in.Jobs[1].Complete != 1 {
		t.Errorf("jobs = %+v, want job 3 (PS 10.200.9.2:9510, 4 workers, worker 2 joined, 1 slot aggregating) and job 9's slot", in.Jobs)
	}

	out.Reset()
	if err := runInspect([]string{"--pin-root", root, "--name", "t", "--slots"}, &out); err != nil {
		t.Fatalf("inspect --slots: %+v", err)
	}
	text := out.String()
	for _, s := range []string{
		"pool 8 slots, 2 in use", "COUNTER", "non_agg", "rx",
		"JOB", "10.200.1.2:40001", "02:00:00:00:00:01",
		"SLOT", "aggregating", "1/2", "2/2",
	} {
		if !strings.Contains(text, s) {
			t.Errorf("text output does not contain %q:\n%s", s, text)
		}
	}
	// The jobs table: admitted workers as a count, joined ones as a bitmap.
	row := ""
	for line := range strings.Lines(text) {
		if f := strings.Fields(line); len(f) > 1 && f[0] == "3" && f[1] == "10.200.9.2:9510" {
			row = strings.Join(f, " ")
		}
	}
	if want := "3 10.200.9.2:9510 4 sync 0x4 1 0 8 -"; row != want {
		t.Errorf("job 3 row %q, want %q:\n%s", row, want, text)
	}
}
