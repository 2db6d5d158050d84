package loader_test

import (
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/internal/bpftest"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
)

// load loads a switch with cfg and closes it at cleanup.
func load(t *testing.T, cfg loader.Config) *loader.Switch {
	t.Helper()
	sw, err := loader.Load(cfg)
	skipIfUnsupported(t, "load switch", err)
	t.Cleanup(func() {
		if err := sw.Close(); err != nil {
			t.Errorf("close switch: %v", err)
		}
	})
	return sw
}

// bpffsDir mounts a private bpffs in a temporary directory and unmounts it at cleanup.
func bpffsDir(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "bpf")
	if err := loader.MountBPFFS(dir); err != nil {
		t.Fatalf("MountBPFFS: %v", err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
		}
	})
	return dir
}

// addVeth creates a veth pair (in the thread's namespace), sets both ends up and returns the
// ifindex of the first.
func addVeth(t *testing.T, name, peer string) int {
	t.Helper()
	if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name}, PeerName: peer}); err != nil {
		t.Fatalf("add veth %s: %v", name, err)
	}
	var idx int
	for _, n := range []string{name, peer} {
		l, err := netlink.LinkByName(n)
		if err != nil {
			t.Fatalf("find %s: %v", n, err)
		}
		if err := netlink.LinkSetUp(l); err != nil {
			t.Fatalf("set %s up: %v", n, err)
		}
		if n == name {
			idx = l.Attrs().Index
		}
	}
	return idx
}

// xdpProgID returns the id of the XDP program attached to ifindex, 0 if none.
func xdpProgID(t *testing.T, ifindex int) uint32 {
	t.Helper()
	l, err := netlink.LinkByIndex(ifindex)
	if err != nil {
		t.Fatalf("link %d: %v", ifindex, err)
	}
	if x := l.Attrs().Xdp; x != nil && x.Attached {
		return x.ProgId
	}
	return 0
}

func TestConfigWithDefaults(t *testing.T) {
	got := loader.Config{}.WithDefaults()
	want := loader.Config{Port: loader.DefaultPort, PoolSize: 4096, SlotTimeout: 5 * time.Second,
		ControlRate: 20000, ControlBurst: 2000, RegArrays: 512, RegSlots: bpf.RegSlots}
	if got != want {
		t.Errorf("Config{}.WithDefaults() = %+v, want %+v", got, want)
	}
	if got.NoSourceCheck {
		t.Error("defaults turn strict source validation off")
	}
	if loader.DefaultPort != 9510 {
		t.Errorf("DefaultPort = %d, want 9510 (docs/protocol.md)", loader.DefaultPort)
	}
	set := loader.Config{Port: 1, PoolSize: 2, SlotTimeout: time.Millisecond, Generic: true,
		NoSourceCheck: true, ControlRate: 1, ControlBurst: 1, RegArrays: 3, RegSlots: 4}
	if got := set.WithDefaults(); got != set {
		t.Errorf("WithDefaults changed set fields: %+v -> %+v", set, got)
	}
	if err := (loader.Config{}).WithDefaults().Validate(); err != nil {
		t.Errorf("defaults do not validate: %v", err)
	}
}

func TestConfigValidate(t *testing.T) {
	ok := loader.Config{}.WithDefaults()
	for _, tc := range []struct {
		name string
		cfg  loader.Config
		want []string // substrings of the error; nil = valid
	}{
		{"defaults", ok, nil},
		{"pool 1", loader.Config{Port: 1, PoolSize: 1, SlotTimeout: time.Millisecond}, nil},
		{"pool max", loader.Config{Port: 1, PoolSize: loader.MaxPoolSize, SlotTimeout: time.Hour}, nil},
		{"pool 0", loader.Config{Port: 1, PoolSize: 0, SlotTimeout: time.Second},
			[]string{"pool size 0", "use 1..131072 slots"}},
		{"pool too big", loader.Config{Port: 1, PoolSize: loader.MaxPoolSize + 1, SlotTimeout: time.Second},
			[]string{"pool size 131073", "use 1..131072 slots"}},
		{"tiny slot timeout", loader.Config{Port: 1, PoolSize: 8, SlotTimeout: 999 * time.Microsecond},
			[]string{"slot timeout 999µs", "at least 1ms"}},
		{"negative slot timeout", loader.Config{Port: 1, PoolSize: 8, SlotTimeout: -time.Second},
			[]string{"slot timeout -1s", "at least 1ms"}},
		{"zero slot timeout without defaults", loader.Config{Port: 1, PoolSize: 8},
			[]string{"slot timeout 0s", "at least 1ms"}},
		{"control rate 1e9", loader.Config{Port: 1, PoolSize: 8, SlotTimeout: time.Second, ControlRate: 1e9, ControlBurst: 1}, nil},
		{"control rate too high", loader.Config{Port: 1, PoolSize: 8, SlotTimeout: time.Second, ControlRate: 1e9 + 1},
			[]string{"control rate 1000000001/s", "at most 1e9"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.cfg.Validate()
			if tc.want == nil {
				if err != nil {
					t.Fatalf("Validate(%+v) = %v, want nil", tc.cfg, err)
				}
				return
			}
			if !errors.Is(err, loader.ErrConfig) {
				t.Fatalf("Validate(%+v) = %v, want an error wrapping ErrConfig", tc.cfg, err)
			}
			for _, s := range tc.want {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("error %q does not say %q", err, s)
				}
			}
		})
	}
}

func TestLoadRejectsBadConfig(t *testing.T) {
	for _, cfg := range []loader.Config{
		{PoolSize: loader.MaxPoolSize + 1},
		{SlotTimeout: time.Microsecond},
		{ControlRate: 2e9},
	} {
		sw, err := loader.Load(cfg)
		if !errors.Is(err, loader.ErrConfig) {
			if sw != nil {
				sw.Close()
			}
			t.Errorf("Load(%+v) = %v, want ErrConfig", cfg, err)
		}
	}
}

func TestSpec(t *testing.T) {
	cfg := loader.Config{Port: 12345, PoolSize: 77, SlotTimeout: 1500 * time.Millisecond}
	spec, err := loader.Spec(cfg)
	if err != nil {
		t.Fatalf("Spec: %v", err)
	}
	if got := spec.Maps[bpf.XdpaggMapSlots].MaxEntries; got != 77 {
		t.Errorf("slots MaxEntries = %d, want 77", got)
	}
	var port uint16
	if err := spec.Variables[bpf.XdpaggVarAggPort].Get(&port); err != nil {
		t.Fatalf("get agg_port: %v", err)
	}
	if port != 12345 {
		t.Errorf("agg_port = %d, want 12345", port)
	}
	var pool uint32
	if err := spec.Variables[bpf.XdpaggVarPoolSize].Get(&pool); err != nil {
		t.Fatalf("get pool_size: %v", err)
	}
	if pool != 77 {
		t.Errorf("pool_size = %d, want 77", pool)
	}
	var timeout uint64
	if err := spec.Variables[bpf.XdpaggVarSlotTimeoutNs].Get(&timeout); err != nil {
		t.Fatalf("get slot_timeout_ns: %v", err)
	}
	if timeout != 1_500_000_000 {
		t.Errorf("slot_timeout_ns = %d, want 1500000000", timeout)
	}
	var check uint32
	if err := spec.Variables[bpf.XdpaggVarSourceCheck].Get(&check); err != nil {
		t.Fatalf("get source_check: %v", err)
	}
	if check != 1 {
		t.Errorf("source_check = %d, want 1 (strict uRPF unless NoSourceCheck)", check)
	}

	// Control budget: one message per 1e9/rate ns, bursts of burst messages.
	for _, tc := range []struct {
		cfg             loader.Config
		interval, burst uint64
		sourceCheck     uint32
	}{
		{loader.Config{}.WithDefaults(), 50_000, 100_000_000, 1},
		{loader.Config{ControlRate: 1000, ControlBurst: 10, NoSourceCheck: true}, 1_000_000, 10_000_000, 0},
		{loader.Config{ControlRate: 3, ControlBurst: 0}, 333_333_333, 333_333_333, 1}, // burst at least one message
		{loader.Config{ControlRate: 1e9, ControlBurst: 5}, 1, 5, 1},
	} {
		spec, err := loader.Spec(tc.cfg)
		if err != nil {
			t.Fatalf("Spec(%+v): %v", tc.cfg, err)
		}
		var interval, burst uint64
		var check uint32
		for name, dst := range map[string]any{bpf.XdpaggVarCtlIntervalNs: &interval, bpf.XdpaggVarCtlBurstNs: &burst, bpf.XdpaggVarSourceCheck: &check} {
			if err := spec.Variables[name].Get(dst); err != nil {
				t.Fatalf("get %s: %v", name, err)
			}
		}
		if interval != tc.interval || burst != tc.burst || check != tc.sourceCheck {
			t.Errorf("Spec(%+v): ctl_interval_ns %d ctl_burst_ns %d source_check %d; want %d %d %d",
				tc.cfg, interval, burst, check, tc.interval, tc.burst, tc.sourceCheck)
		}
	}

	// Every call starts from the embedded object: one configuration does not leak into the next.
	spec2, err := loader.Spec(loader.Config{Port: 1, PoolSize: 3, SlotTimeout: time.Second})
	if err != nil {
		t.Fatalf("Spec: %v", err)
	}
	if got := spec2.Maps[bpf.XdpaggMapSlots].MaxEntries; got != 3 {
		t.Errorf("second spec: slots MaxEntries = %d, want 3", got)
	}
	if got := spec.Maps[bpf.XdpaggMapSlots].MaxEntries; got != 77 {
		t.Errorf("first spec changed by the second: slots MaxEntries = %d, want 77", got)
	}
}

func TestLoadAppliesConfig(t *testing.T) {
	sw := load(t, loader.Config{PoolSize: 33})
	want := loader.Config{Port: loader.DefaultPort, PoolSize: 33, SlotTimeout: 5 * time.Second,
		ControlRate: 20000, ControlBurst: 2000, RegArrays: 512, RegSlots: bpf.RegSlots}
	if sw.Config != want {
		t.Errorf("Config = %+v, want the defaults applied: %+v", sw.Config, want)
	}
	if got := sw.Maps.PoolSize(); got != 33 {
		t.Errorf("Maps.PoolSize() = %d, want 33", got)
	}
	if sw.Maps.Slots != sw.Objects.Slots || sw.Maps.Members != sw.Objects.Members ||
		sw.Maps.Ports != sw.Objects.Ports || sw.Maps.Counters != sw.Objects.Counters ||
		sw.Maps.Workers != sw.Objects.Workers || sw.Maps.Jobs != sw.Objects.Jobs ||
		sw.Maps.JobKeys != sw.Objects.JobKeys || sw.Maps.CtlBudget != sw.Objects.CtlBudget ||
		sw.Maps.Results != sw.Objects.Results {
		t.Error("Maps does not wrap the loaded objects' maps")
	}
	if sw.Maps.GC != sw.Objects.XdpaggGc || sw.Maps.GC == nil {
		t.Error("Maps does not wrap the loaded garbage collector program")
	}
	if p := sw.Ports(); len(p) != 0 {
		t.Errorf("fresh switch has ports %v", p)
	}
}

func TestPinAndClose(t *testing.T) {
	root := bpffsDir(t)
	sw, err := loader.Load(loader.Config{PoolSize: 16})
	skipIfUnsupported(t, "load switch", err)
	closed := false
	t.Cleanup(func() {
		if !closed {
			sw.Close()
		}
	})
	dir := filepath.Join(root, "sw")
	if err := sw.Pin(dir); err != nil {
		t.Fatalf("Pin: %v", err)
	}
	names := []string{bpf.XdpaggMapSlots, bpf.XdpaggMapMembers, bpf.XdpaggMapPorts, bpf.XdpaggMapCounters,
		bpf.XdpaggMapWorkers, bpf.XdpaggMapJobs, bpf.XdpaggMapJobKeys, bpf.XdpaggMapCtlBudget,
		bpf.XdpaggMapRegisters, bpf.XdpaggMapSparseJobs, bpf.XdpaggMapRecircHist}
	if !slices.Equal(maps.PinnedMaps, names) {
		t.Errorf("maps.PinnedMaps = %v, want %v", maps.PinnedMaps, names)
	}
	for _, name := range names {
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, "maps", name), nil)
		if err != nil {
			t.Errorf("open pinned map %s: %v", name, err)
			continue
		}
		if name == bpf.XdpaggMapSlots && m.MaxEntries() != 16 {
			t.Errorf("pinned slots map has %d entries, want 16", m.MaxEntries())
		}
		m.Close()
	}
	if fi, err := os.Stat(filepath.Join(dir, "links")); err != nil || !fi.IsDir() {
		t.Errorf("links directory: %v", err)
	}
	// The garbage collector is pinned for `xdpagg job rm` (maps.OpenPinned), and nothing else is.
	gc, err := ebpf.LoadPinnedProgram(filepath.Join(dir, maps.PinnedGC), nil)
	if err != nil {
		t.Errorf("open pinned garbage collector: %v", err)
	} else {
		if info, err := gc.Info(); err != nil || info.Name != "xdpagg_gc" {
			t.Errorf("pinned program %v, %v; want xdpagg_gc", info, err)
		}
		gc.Close()
	}
	if progs, err := os.ReadDir(filepath.Join(dir, "progs")); err != nil || len(progs) != 1 || progs[0].Name() != "xdpagg_gc" {
		t.Errorf("progs directory: %v, %v; want only xdpagg_gc", progs, err)
	}
	// The pins open as a whole through maps.OpenPinned.
	pm, err := maps.OpenPinned(dir)
	if err != nil {
		t.Fatalf("OpenPinned: %v", err)
	}
	if err := pm.AddJob(maps.Job{JobID: 3, PS: netip.MustParseAddrPort("10.0.0.1:9510"), PSIfindex: 1, Workers: 1, MaxSlots: 1},
		make([]byte, maps.KeySize)); err != nil {
		t.Errorf("AddJob through the pins: %v", err)
	}
	if _, err := pm.RemoveJob(3); err != nil {
		t.Errorf("RemoveJob through the pins (runs the pinned garbage collector): %v", err)
	}
	if err := pm.Close(); err != nil {
		t.Errorf("close pinned maps: %v", err)
	}
	entries, err := os.ReadDir(filepath.Join(dir, "maps"))
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range entries {
		got = append(got, e.Name())
	}
	slices.Sort(got)
	want := slices.Clone(names)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("pinned maps %v, want %v", got, want)
	}

	closed = true
	if err := sw.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	for _, p := range append([]string{dir, filepath.Join(dir, maps.PinnedGC), filepath.Join(dir, "progs")}, names...) {
		if !filepath.IsAbs(p) {
			p = filepath.Join(dir, "maps", p)
		}
		if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s after Close: %v, want it gone", p, err)
		}
	}
	if _, err := os.Stat(root); err != nil {
		t.Errorf("Close removed the bpffs root too: %v", err)
	}
	if _, err := maps.OpenPinned(dir); !errors.Is(err, maps.ErrNoSwitch) {
		t.Errorf("OpenPinned after Close = %v, want ErrNoSwitch", err)
	}
}

func TestPinNotBPFFS(t *testing.T) {
	sw := load(t, loader.Config{PoolSize: 4})
	dir := filepath.Join(t.TempDir(), "sw")
	err := sw.Pin(dir)
	if !errors.Is(err, loader.ErrNotBPFFS) {
		t.Fatalf("Pin on a non-bpffs directory = %v, want ErrNotBPFFS", err)
	}
	if !strings.Contains(err.Error(), "mount -t bpf") {
		t.Errorf("error %q does not say how to mount a bpffs", err)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("failed Pin created %s: %v", dir, err)
	}
	// The switch is still usable and closes cleanly (cleanup).
	if err := sw.Maps.ResetSlots(); err != nil {
		t.Errorf("ResetSlots after a failed Pin: %v", err)
	}
}

func TestCheckBPFFS(t *testing.T) {
	if err := loader.CheckBPFFS(t.TempDir()); !errors.Is(err, loader.ErrNotBPFFS) {
		t.Errorf("CheckBPFFS(tmpdir) = %v, want ErrNotBPFFS", err)
	}
	missing := filepath.Join(t.TempDir(), "missing")
	if err := loader.CheckBPFFS(missing); !errors.Is(err, loader.ErrNotBPFFS) || !errors.Is(err, unix.ENOENT) {
		t.Errorf("CheckBPFFS(missing) = %v, want ErrNotBPFFS wrapping ENOENT", err)
	}
	root := bpffsDir(t)
	if err := loader.CheckBPFFS(root); err != nil {
		t.Errorf("CheckBPFFS(bpffs) = %v", err)
	}
}

// mountsAt counts the mounts at dir in this process's mount namespace.
func mountsAt(t *testing.T, dir string) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for line := range strings.Lines(string(b)) {
		f := strings.Fields(line)
		if len(f) > 4 && f[4] == dir {
			n++
		}
	}
	return n
}

func TestMountBPFFSIdempotent(t *testing.T) {
	root := bpffsDir(t) // creates the directory and mounts
	if err := loader.MountBPFFS(root); err != nil {
		t.Fatalf("second MountBPFFS: %v", err)
	}
	if n := mountsAt(t, root); n != 1 {
		t.Errorf("%d mounts at %s after two MountBPFFS calls, want 1", n, root)
	}
}

func TestAttachDetach(t *testing.T) {
	bpftest.InNewNetns(t)
	ifindex := addVeth(t, "xsw0", "xsw0p")
	sw := load(t, loader.Config{PoolSize: 8})

	if err := sw.AttachPort(ifindex); err != nil {
		skipIfUnsupported(t, "attach XDP (native) to a veth", err)
	}
	if id := xdpProgID(t, ifindex); id == 0 {
		t.Error("no XDP program on the port after AttachPort")
	} else if info, err := sw.Objects.XdpaggSwitch.Info(); err == nil {
		if pid, ok := info.ID(); ok && pid != ebpf.ProgramID(id) {
			t.Errorf("port runs program %d, want xdpagg_switch (%d)", id, pid)
		}
	}
	var val bpf.XdpaggBpfDevmapVal
	if err := sw.Objects.Ports.Lookup(uint32(ifindex), &val); err != nil {
		t.Fatalf("ports devmap has no entry for the attached port: %v", err)
	}
	if val.Ifindex != uint32(ifindex) || val.BpfProg.Fd == 0 {
		t.Errorf("ports[%d] = %+v, want the ifindex and the egress program", ifindex, val)
	}
	if got := sw.Ports(); !slices.Equal(got, []int{ifindex}) {
		t.Errorf("Ports() = %v, want [%d]", got, ifindex)
	}

	if err := sw.AttachPort(ifindex); !errors.Is(err, loader.ErrAttached) {
		t.Errorf("second AttachPort = %v, want ErrAttached", err)
	}
	if err := sw.DetachPort(ifindex + 1000); !errors.Is(err, loader.ErrNotAttached) {
		t.Errorf("DetachPort(unknown) = %v, want ErrNotAttached", err)
	}

	if err := sw.DetachPort(ifindex); err != nil {
		t.Fatalf("DetachPort: %v", err)
	}
	if err := sw.Objects.Ports.Lookup(uint32(ifindex), &val); !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Errorf("ports devmap after DetachPort: lookup = %v, want ErrKeyNotExist", err)
	}
	if id := xdpProgID(t, ifindex); id != 0 {
		t.Errorf("XDP program %d still attached after DetachPort", id)
	}
	if got := sw.Ports(); len(got) != 0 {
		t.Errorf("Ports() after DetachPort = %v", got)
	}
	if err := sw.DetachPort(ifindex); !errors.Is(err, loader.ErrNotAttached) {
		t.Errorf("DetachPort twice = %v, want ErrNotAttached", err)
	}

	// A detached port can be attached again.
	if err := sw.AttachPort(ifindex); err != nil {
		t.Fatalf("re-attach: %v", err)
	}
	if id := xdpProgID(t, ifindex); id == 0 {
		t.Error("no XDP program after re-attach")
	}
}

func TestAttachUnknownInterface(t *testing.T) {
	bpftest.InNewNetns(t)
	sw := load(t, loader.Config{PoolSize: 4})
	const missing = 4242
	err := sw.AttachPort(missing)
	if err == nil {
		t.Fatal("AttachPort of a missing ifindex succeeded")
	}
	if !strings.Contains(err.Error(), strconv.Itoa(missing)) {
		t.Errorf("error %q does not name the ifindex", err)
	}
	if got := sw.Ports(); len(got) != 0 {
		t.Errorf("failed AttachPort left ports %v", got)
	}
	if err := sw.AttachPort(missing); errors.Is(err, loader.ErrAttached) {
		t.Errorf("failed AttachPort was recorded as attached: %v", err)
	}
}

// xdpAttachedSKB is XDP_ATTACHED_SKB of the IFLA_XDP_ATTACHED attribute (include/uapi/linux/if_link.h).
const xdpAttachedSKB = 2

func TestAttachGeneric(t *testing.T) {
	bpftest.InNewNetns(t)
	ifindex := addVeth(t, "xgen0", "xgen0p")
	sw := load(t, loader.Config{PoolSize: 4, Generic: true})
	if err := sw.AttachPort(ifindex); err != nil {
		skipIfUnsupported(t, "attach XDP (generic) to a veth", err)
	}
	l, err := netlink.LinkByIndex(ifindex)
	if err != nil {
		t.Fatal(err)
	}
	if x := l.Attrs().Xdp; x == nil || !x.Attached || x.AttachMode != xdpAttachedSKB {
		t.Errorf("XDP on the port = %+v, want attached in generic (skb) mode", x)
	}
	if err := sw.DetachPort(ifindex); err != nil {
		t.Errorf("DetachPort: %v", err)
	}
}

func TestPinnedLinks(t *testing.T) {
	bpftest.InNewNetns(t)
	a := addVeth(t, "xpa", "xpap")
	b := addVeth(t, "xpb", "xpbp")
	root := bpffsDir(t)
	sw, err := loader.Load(loader.Config{PoolSize: 4})
	skipIfUnsupported(t, "load switch", err)
	closed := false
	t.Cleanup(func() {
		if !closed {
			sw.Close()
		}
	})
	// A port attached before Pin is pinned by Pin; one attached after, by AttachPort.
	if err := sw.AttachPort(a); err != nil {
		skipIfUnsupported(t, "attach XDP", err)
	}
	dir := filepath.Join(root, "sw")
	if err := sw.Pin(dir); err != nil {
		t.Fatalf("Pin: %v", err)
	}
	if err := sw.AttachPort(b); err != nil {
		t.Fatalf("AttachPort after Pin: %v", err)
	}
	for _, idx := range []int{a, b} {
		if _, err := os.Stat(filepath.Join(dir, "links", strconv.Itoa(idx))); err != nil {
			t.Errorf("link of ifindex %d not pinned: %v", idx, err)
		}
	}
	if err := sw.DetachPort(a); err != nil {
		t.Fatalf("DetachPort: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "links", strconv.Itoa(a))); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("link pin of a detached port: %v, want it gone", err)
	}
	closed = true
	if err := sw.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pin directory after Close: %v, want it gone", err)
	}
	if id := xdpProgID(t, b); id != 0 {
		t.Errorf("Close left XDP program %d on ifindex %d", id, b)
	}
}

func skipIfUnsupported(t *testing.T, what string, err error) { t.Helper(); bpftest.Check(t, what, err) }

// TestAdopt: a switch whose process died leaves its maps pinned; Adopt loads new programs over
// them, keeping what they hold (here an admitted job and a counter), and refuses a configuration
// the pinned maps were not made with.
func TestAdopt(t *testing.T) {
	root := bpffsDir(t)
	dir := filepath.Join(root, "sw")
	cfg := loader.Config{PoolSize: 16, RegArrays: 8}
	old, err := loader.Load(cfg)
	skipIfUnsupported(t, "load switch", err)
	if err := old.Pin(dir); err != nil {
		old.Close()
		t.Fatalf("Pin: %v", err)
	}
	job := maps.Job{JobID: 9, PS: netip.MustParseAddrPort("10.0.0.1:9510"), PSIfindex: 1, Workers: 2, MaxSlots: 4, RegArrays: 4}
	key := make([]byte, maps.KeySize)
	if err := old.Maps.AddJob(job, key); err != nil {
		old.Close()
		t.Fatalf("AddJob: %v", err)
	}
	// The process "dies": its file descriptors close, its pins stay.
	if err := old.Objects.Close(); err != nil {
		t.Fatal(err)
	}

	if _, err := loader.Adopt(loader.Config{PoolSize: 32, RegArrays: 8}, dir); !errors.Is(err, loader.ErrIncompatible) {
		t.Fatalf("Adopt with another pool size: %v, want ErrIncompatible", err)
	}
	sw, err := loader.Adopt(cfg, dir)
	if err != nil {
		t.Fatalf("Adopt: %v", err)
	}
	t.Cleanup(func() { sw.Close() })
	got, err := sw.Maps.GetJob(9)
	if err != nil || got.RegArrays != 4 || got.Workers != 2 {
		t.Fatalf("the adopted switch lost the job: %+v, %v", got, err)
	}
	if _, err := sw.Maps.Sparse(9); err != nil {
		t.Fatalf("the adopted switch lost the sparse job's records: %v", err)
	}
	if err := sw.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("after Close the pin directory is still there: %v", err)
	}
}

// Config.Object loads another build of the switch (benchmarks' A/B runs) with the same
// configuration applied; a missing object is an error, never the embedded one in its place.
func TestSpecObject(t *testing.T) {
	obj := filepath.Join("..", "bpf", "xdpagg_bpfel.o")
	spec, err := loader.Spec(loader.Config{PoolSize: 77, Object: obj})
	if err != nil {
		t.Fatalf("Spec with Object: %v", err)
	}
	if got := spec.Maps[bpf.XdpaggMapSlots].MaxEntries; got != 77 {
		t.Errorf("slots MaxEntries = %d, want 77", got)
	}
	var pool uint32
	if err := spec.Variables[bpf.XdpaggVarPoolSize].Get(&pool); err != nil || pool != 77 {
		t.Errorf("pool_size = %d (%v), want 77", pool, err)
	}
	if _, err := loader.Spec(loader.Config{PoolSize: 77, Object: filepath.Join(t.TempDir(), "missing.o")}); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Spec with a missing Object: %v, want an error wrapping os.ErrNotExist", err)
	}
}
