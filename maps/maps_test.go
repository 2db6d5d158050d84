package maps_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/internal/bpftest"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/wire"
)

// bpffsDir mounts a private bpffs in a temporary directory and unmounts it at cleanup.
func bpffsDir(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "bpf")
	if err := loader.MountBPFFS(dir); err != nil {
		t.Fatalf("MountBPFFS: %v", err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	return dir
}

func mac(last byte) net.HardwareAddr { return net.HardwareAddr{0x02, 0, 0, 0, 0, last} }

var snakeCase = regexp.MustCompile(`^[a-z][a-z0-9]*(_[a-z0-9]+)*$`)

func TestCounterNames(t *testing.T) {
	if maps.NumCounters != int(bpf.XdpaggCounterCNT_MAX) {
		t.Fatalf("NumCounters = %d, want CNT_MAX = %d", maps.NumCounters, bpf.XdpaggCounterCNT_MAX)
	}
	seen := map[string]maps.Counter{}
	for i := range maps.NumCounters {
		c := maps.Counter(i)
		name := maps.CounterName(c)
		if name == "" {
			t.Errorf("counter %d has no name", i)
			continue
		}
		if !snakeCase.MatchString(name) {
			t.Errorf("counter %d name %q is not snake_case", i, name)
		}
		if strings.HasPrefix(name, "counter_") {
			t.Errorf("counter %d has only the fallback name %q", i, name)
		}
		if prev, dup := seen[name]; dup {
			t.Errorf("counters %d and %d share the name %q", prev, i, name)
		}
		seen[name] = c
	}
	for c, want := range map[maps.Counter]string{
		maps.CntRx: "rx", maps.CntAggregated: "aggregated", maps.CntToPS: "to_ps",
		maps.CntRedirectErr: "redirect_err", maps.CntControl: "control",
	} {
		if got := maps.CounterName(c); got != want {
			t.Errorf("CounterName(%d) = %q, want %q", c, got, want)
		}
	}
	if got, want := maps.CounterName(maps.Counter(maps.NumCounters)), fmt.Sprintf("counter_%d", maps.NumCounters); got != want {
		t.Errorf("CounterName(NumCounters) = %q, want the fallback %s", got, want)
	}
}

func TestCountersSubAndMap(t *testing.T) {
	var a, b maps.Counters
	for i := range a {
		a[i] = uint64(10 * (i + 1))
		b[i] = uint64(i)
	}
	orig := a
	d := a.Sub(b)
	for i := range d {
		if want := uint64(9*i + 10); d[i] != want {
			t.Errorf("Sub: counter %d = %d, want %d", i, d[i], want)
		}
	}
	if a != orig {
		t.Error("Sub modified its receiver")
	}
	if z := a.Sub(a); z != (maps.Counters{}) {
		t.Errorf("c.Sub(c) = %v, want zeros", z)
	}

	m := a.Map()
	if len(m) != maps.NumCounters {
		t.Fatalf("Map has %d entries, want %d", len(m), maps.NumCounters)
	}
	for i := range a {
		name := maps.CounterName(maps.Counter(i))
		if v, ok := m[name]; !ok || v != a[i] {
			t.Errorf("Map()[%q] = %d, %v; want %d", name, v, ok, a[i])
		}
	}
	if m["rx"] != a[maps.CntRx] {
		t.Errorf(`Map()["rx"] = %d, want %d`, m["rx"], a[maps.CntRx])
	}
}

func TestStateName(t *testing.T) {
	for s, want := range map[uint8]string{
		uint8(bpf.XdpaggSlotStateSLOT_FREE):        "free",
		uint8(bpf.XdpaggSlotStateSLOT_AGGREGATING): "aggregating",
		uint8(bpf.XdpaggSlotStateSLOT_COMPLETE):    "complete",
		7:                                          "state_7",
	} {
		if got := maps.StateName(s); got != want {
			t.Errorf("StateName(%d) = %q, want %q", s, got, want)
		}
	}
}

func TestMembersRoundTrip(t *testing.T) {
	sw := load(t, 8)
	m := sw.Maps
	if got, err := m.ListMembers(); err != nil || len(got) != 0 {
		t.Fatalf("fresh switch: ListMembers = %v, %v; want none", got, err)
	}
	// Members exist only for admitted jobs, and their results come from the job's PS.
	admit(t, m, 7, "10.200.9.2:9510", 32)
	admit(t, m, 3, "172.16.0.1:9510", 32)
	admit(t, m, 1<<31, "4.3.2.1:1", 32)
	in := []maps.Member{
		{JobID: 7, WorkerID: 2, Ifindex: 5, Addr: netip.MustParseAddrPort("10.200.1.2:40000"),
			MAC: mac(1), PortMAC: mac(0x11), SrcIP: netip.MustParseAddr("10.200.9.2")},
		{JobID: 3, WorkerID: 31, Ifindex: 9, Addr: netip.MustParseAddrPort("192.168.7.8:9510"),
			MAC: mac(2), PortMAC: mac(0x12), SrcIP: netip.MustParseAddr("172.16.0.1")},
		{JobID: 7, WorkerID: 0, Ifindex: 4, Addr: netip.MustParseAddrPort("10.200.2.2:1"),
			MAC: mac(3), PortMAC: mac(0x13), SrcIP: netip.MustParseAddr("10.200.9.2")},
		{JobID: 1 << 31, WorkerID: 5, Ifindex: 5, Addr: netip.MustParseAddrPort("1.2.3.4:65535"),
			MAC: mac(4), PortMAC: mac(0x14), SrcIP: netip.MustParseAddr("4.3.2.1")},
	}
	for _, mb := range in {
		if err := m.PutMember(mb); err != nil {
			t.Fatalf("PutMember(%+v): %v", mb, err)
		}
	}
	got, err := m.ListMembers()
	if err != nil {
		t.Fatalf("ListMembers: %v", err)
	}
	want := []maps.Member{in[1], in[2], in[0], in[3]} // by job, then worker
	if len(got) != len(want) {
		t.Fatalf("ListMembers returned %d members, want %d: %+v", len(got), len(want), got)
	}
	for i := range want {
		if !memberEqual(got[i], want[i]) {
			t.Errorf("member %d = %+v, want %+v", i, got[i], want[i])
		}
	}

	// The map holds addresses and the port in network byte order, as the egress program reads them.
	var v bpf.XdpaggMember
	if err := m.Members.Lookup(&bpf.XdpaggMemberKey{JobId: 7, Ifindex: 5}, &v); err != nil {
		t.Fatalf("raw lookup: %v", err)
	}
	dst := [4]byte{byte(v.DstIp), byte(v.DstIp >> 8), byte(v.DstIp >> 16), byte(v.DstIp >> 24)}
	port := [2]byte{byte(v.DstPort), byte(v.DstPort >> 8)}
	if dst != [4]byte{10, 200, 1, 2} || port != [2]byte{40000 >> 8, 40000 & 0xff} {
		t.Errorf("raw member: dst ip bytes %v port bytes %v, want 10.200.1.2 and 40000 in network order", dst, port)
	}
	if v.WorkerId != 2 || net.HardwareAddr(v.DstMac[:]).String() != mac(1).String() ||
		net.HardwareAddr(v.SrcMac[:]).String() != mac(0x11).String() {
		t.Errorf("raw member = %+v", v)
	}

	// Same job and port: replaced, not added.
	repl := in[0]
	repl.WorkerID, repl.MAC = 9, mac(9)
	if err := m.PutMember(repl); err != nil {
		t.Fatalf("PutMember(replacement): %v", err)
	}
	got, _ = m.ListMembers()
	if len(got) != len(in) {
		t.Errorf("after replacing: %d members, want %d", len(got), len(in))
	}

	if err := m.DeleteMember(7, 5); err != nil {
		t.Fatalf("DeleteMember: %v", err)
	}
	if err := m.DeleteMember(7, 5); !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Errorf("DeleteMember of a missing member = %v, want ErrKeyNotExist", err)
	}
	got, _ = m.ListMembers()
	if len(got) != len(in)-1 {
		t.Errorf("after delete: %d members, want %d", len(got), len(in)-1)
	}
	for _, mb := range got {
		if mb.JobID == 7 && mb.Ifindex == 5 {
			t.Errorf("deleted member still listed: %+v", mb)
		}
	}
}

func memberEqual(a, b maps.Member) bool {
	return a.JobID == b.JobID && a.WorkerID == b.WorkerID && a.Ifindex == b.Ifindex &&
		a.Addr == b.Addr && slices.Equal(a.MAC, b.MAC) && slices.Equal(a.PortMAC, b.PortMAC) && a.SrcIP == b.SrcIP
}

func TestPutMemberRejects(t *testing.T) {
	sw := load(t, 4)
	admit(t, sw.Maps, 1, "10.0.0.9:9510", 32)
	good := maps.Member{JobID: 1, WorkerID: 0, Ifindex: 2, Addr: netip.MustParseAddrPort("10.0.0.2:9510"),
		MAC: mac(1), PortMAC: mac(2), SrcIP: netip.MustParseAddr("10.0.0.9")}
	for _, tc := range []struct {
		name string
		edit func(*maps.Member)
		is   error
		want string
	}{
		{"job 0", func(m *maps.Member) { m.JobID = 0 }, maps.ErrNoJob, "job 0"},
		{"IPv6 worker", func(m *maps.Member) { m.Addr = netip.MustParseAddrPort("[fd00::2]:9510") }, maps.ErrBadMember, "IPv4"},
		{"IPv4-mapped IPv6 worker", func(m *maps.Member) { m.Addr = netip.MustParseAddrPort("[::ffff:10.0.0.2]:9510") }, maps.ErrBadMember, "IPv4"},
		{"IPv6 source", func(m *maps.Member) { m.SrcIP = netip.MustParseAddr("fd00::9") }, maps.ErrBadMember, "from its PS 10.0.0.9"},
		{"IPv4-mapped PS as source", func(m *maps.Member) { m.SrcIP = netip.MustParseAddr("::ffff:10.0.0.9") }, maps.ErrBadMember, "from its PS 10.0.0.9"},
		{"another source", func(m *maps.Member) { m.SrcIP = netip.MustParseAddr("10.0.0.10") }, maps.ErrBadMember, "not 10.0.0.10"},
		{"no worker address", func(m *maps.Member) { m.Addr = netip.AddrPort{} }, maps.ErrBadMember, "IPv4"},
		{"short MAC", func(m *maps.Member) { m.MAC = m.MAC[:5] }, maps.ErrBadMember, "6 bytes"},
		{"nil MAC", func(m *maps.Member) { m.MAC = nil }, maps.ErrBadMember, "6 bytes"},
		{"broadcast MAC", func(m *maps.Member) { m.MAC = net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff} }, maps.ErrBadMember, "not a unicast"},
		{"multicast MAC", func(m *maps.Member) { m.MAC = net.HardwareAddr{0x01, 0x00, 0x5e, 0, 0, 1} }, maps.ErrBadMember, "not a unicast"},
		{"zero MAC", func(m *maps.Member) { m.MAC = make(net.HardwareAddr, 6) }, maps.ErrBadMember, "not a unicast"},
		{"long port MAC", func(m *maps.Member) { m.PortMAC = append(mac(2), 0, 0) }, maps.ErrBadMember, "6 bytes"},
		{"worker 32", func(m *maps.Member) { m.WorkerID = 32 }, maps.ErrBadMember, "worker id 32"},
		{"worker 255", func(m *maps.Member) { m.WorkerID = 255 }, maps.ErrBadMember, "workers 0..31"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mb := good
			mb.MAC = slices.Clone(good.MAC)
			mb.PortMAC = slices.Clone(good.PortMAC)
			tc.edit(&mb)
			err := sw.Maps.PutMember(mb)
			if !errors.Is(err, tc.is) {
				t.Fatalf("PutMember(%+v) = %v, want %v", mb, err, tc.is)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q does not say %q", err, tc.want)
			}
		})
	}
	if got, _ := sw.Maps.ListMembers(); len(got) != 0 {
		t.Errorf("rejected members were written: %+v", got)
	}
	if j, err := sw.Maps.GetJob(1); err != nil || j.Joined != 0 {
		t.Errorf("rejected members bound worker ids: %+v, %v", j, err)
	}
	good.WorkerID = 31
	if err := sw.Maps.PutMember(good); err != nil {
		t.Errorf("PutMember(worker 31) = %v", err)
	}
	// No source: the job's PS is filled in.
	good.WorkerID, good.Ifindex, good.SrcIP = 30, 3, netip.Addr{}
	if err := sw.Maps.PutMember(good); err != nil {
		t.Fatalf("PutMember(no source) = %v", err)
	}
	if got, err := sw.Maps.Member(1, 3); err != nil || got.SrcIP != netip.MustParseAddr("10.0.0.9") {
		t.Errorf("member without a source = %+v, %v; want the PS 10.0.0.9 as its source", got, err)
	}
	good.WorkerID, good.Ifindex, good.SrcIP = 29, 4, netip.IPv4Unspecified()
	if err := sw.Maps.PutMember(good); err != nil {
		t.Fatalf("PutMember(source 0.0.0.0) = %v", err)
	}
	if got, err := sw.Maps.Member(1, 4); err != nil || got.SrcIP != netip.MustParseAddr("10.0.0.9") {
		t.Errorf("member with source 0.0.0.0 = %+v, %v; want the PS 10.0.0.9 as its source", got, err)
	}
}

func TestSlots(t *testing.T) {
	const pool = 16
	sw := load(t, pool)
	m := sw.Maps
	if got := m.PoolSize(); got != pool {
		t.Fatalf("PoolSize = %d, want %d", got, pool)
	}
	for _, idx := range []uint32{pool, pool + 1, 1 << 31} {
		if _, err := m.Slot(idx); !errors.Is(err, maps.ErrBadIndex) {
			t.Errorf("Slot(%d) = %v, want ErrBadIndex", idx, err)
		}
	}
	s, err := m.Slot(pool - 1)
	if err != nil {
		t.Fatalf("Slot(last): %v", err)
	}
	if s.State != uint8(bpf.XdpaggSlotStateSLOT_FREE) || s.JobId != 0 {
		t.Errorf("fresh slot = %+v, want free", s)
	}
	used, err := m.SlotsInUse()
	if err != nil || len(used) != 0 {
		t.Fatalf("fresh switch: SlotsInUse = %v, %v; want none", used, err)
	}

	agg := bpf.XdpaggSlot{JobId: 7, Seq: 3, Bitmap: 0b101, Nvals: 360,
		State: uint8(bpf.XdpaggSlotStateSLOT_AGGREGATING), Counter: 2, FanIn: 4,
		Flags: wire.FlagOverflow, TsNs: ^uint64(0)} // in the future: age 0
	agg.Vals[0] = 42
	done := bpf.XdpaggSlot{JobId: 8, Seq: 1, Bitmap: 1, Nvals: 1,
		State: uint8(bpf.XdpaggSlotStateSLOT_COMPLETE), Counter: 1, FanIn: 1,
		Flags: wire.FlagECN, TsNs: 1}
	if err := m.Slots.Put(uint32(5), &agg); err != nil {
		t.Fatalf("put slot: %v", err)
	}
	if err := m.Slots.Put(uint32(pool-1), &done); err != nil {
		t.Fatalf("put slot: %v", err)
	}
	s, err = m.Slot(5)
	if err != nil || s.JobId != 7 || s.Vals[0] != 42 {
		t.Errorf("Slot(5) = job %d vals[0] %d, %v; want job 7 vals[0] 42", s.JobId, s.Vals[0], err)
	}
	used, err = m.SlotsInUse()
	if err != nil {
		t.Fatalf("SlotsInUse: %v", err)
	}
	slices.SortFunc(used, func(a, b maps.SlotInfo) int { return int(a.Index) - int(b.Index) })
	want := []maps.SlotInfo{
		{Index: 5, JobID: 7, Seq: 3, State: "aggregating", Bitmap: 0b101, Counter: 2, FanIn: 4, Values: 360, Overflow: true},
		{Index: pool - 1, JobID: 8, Seq: 1, State: "complete", Bitmap: 1, Counter: 1, FanIn: 1, Values: 1, ECN: true},
	}
	if len(used) != len(want) {
		t.Fatalf("SlotsInUse = %+v, want %+v", used, want)
	}
	if used[0] != want[0] {
		t.Errorf("SlotsInUse[0] = %+v, want %+v", used[0], want[0])
	}
	if used[1].Age <= 0 {
		t.Errorf("slot stamped at 1ns has age %v, want > 0", used[1].Age)
	}
	used[1].Age = 0
	if used[1] != want[1] {
		t.Errorf("SlotsInUse[1] = %+v, want %+v", used[1], want[1])
	}

	if err := m.ResetSlots(); err != nil {
		t.Fatalf("ResetSlots: %v", err)
	}
	if used, err := m.SlotsInUse(); err != nil || len(used) != 0 {
		t.Errorf("after ResetSlots: SlotsInUse = %+v, %v; want none", used, err)
	}
	if s, _ := m.Slot(5); s != (bpf.XdpaggSlot{}) {
		t.Errorf("after ResetSlots: slot 5 = job %d state %d, want zero", s.JobId, s.State)
	}
}

func TestListPorts(t *testing.T) {
	sw := load(t, 4)
	if got, err := sw.Maps.ListPorts(); err != nil || len(got) != 0 {
		t.Fatalf("fresh switch: ListPorts = %v, %v; want none", got, err)
	}
	// The loopback device (ifindex 1) exists in every namespace.
	if err := sw.Maps.Ports.Put(uint32(1), &bpf.XdpaggBpfDevmapVal{Ifindex: 1}); err != nil {
		skipIfUnsupported(t, "add lo to the devmap", err)
	}
	if got, err := sw.Maps.ListPorts(); err != nil || !slices.Equal(got, []uint32{1}) {
		t.Errorf("ListPorts = %v, %v; want [1]", got, err)
	}
}

// bumpCounters runs xdpagg_switch once on a non-IPv4 frame, which it passes to the kernel as
// non_agg.
func bumpCounters(t *testing.T, sw *loader.Switch) {
	t.Helper()
	frame := make([]byte, 64)
	copy(frame[0:6], mac(1))
	copy(frame[6:12], mac(2))
	frame[12], frame[13] = 0x08, 0x06 // ARP
	ret, err := sw.Objects.XdpaggSwitch.Run(&ebpf.RunOptions{Data: frame})
	skipIfUnsupported(t, "BPF_PROG_TEST_RUN", err)
	if ret != 2 { // XDP_PASS
		t.Fatalf("xdpagg_switch returned %d for an ARP frame, want XDP_PASS", ret)
	}
}

func TestReadCounters(t *testing.T) {
	sw := load(t, 4)
	c, err := sw.Maps.ReadCounters()
	if err != nil {
		t.Fatalf("ReadCounters: %v", err)
	}
	if c != (maps.Counters{}) {
		t.Errorf("fresh switch counters = %v, want zeros", c)
	}
	bumpCounters(t, sw)
	bumpCounters(t, sw)
	c2, err := sw.Maps.ReadCounters()
	if err != nil {
		t.Fatalf("ReadCounters: %v", err)
	}
	d := c2.Sub(c)
	if d[maps.CntNonAgg] != 2 {
		t.Errorf("non_agg moved by %d after two ARP frames, want 2 (all: %v)", d[maps.CntNonAgg], d.Map())
	}
	if d[maps.CntRx] != 0 {
		t.Errorf("rx moved by %d for frames not at the xdpagg port", d[maps.CntRx])
	}
}

func TestOpenPinnedMissing(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "nothing")
	m, err := maps.OpenPinned(dir)
	if !errors.Is(err, maps.ErrNoSwitch) {
		if m != nil {
			m.Close()
		}
		t.Fatalf("OpenPinned(missing) = %v, want ErrNoSwitch", err)
	}
	if !strings.Contains(err.Error(), dir) {
		t.Errorf("error %q does not name the directory", err)
	}
	// An empty bpffs is no switch either.
	if _, err := maps.OpenPinned(filepath.Join(bpffsDir(t), "sw")); !errors.Is(err, maps.ErrNoSwitch) {
		t.Errorf("OpenPinned(empty bpffs) = %v, want ErrNoSwitch", err)
	}
}

func TestOpenPinned(t *testing.T) {
	root := bpffsDir(t)
	sw := load(t, 12)
	dir := filepath.Join(root, "sw")
	if err := sw.Pin(dir); err != nil {
		t.Fatalf("Pin: %v", err)
	}
	bumpCounters(t, sw)
	key := admit(t, sw.Maps, 4, "10.1.2.2:9510", 2)
	mb := maps.Member{JobID: 4, WorkerID: 1, Ifindex: 3, Addr: netip.MustParseAddrPort("10.1.1.2:5000"),
		MAC: mac(1), PortMAC: mac(2), SrcIP: netip.MustParseAddr("10.1.2.2")}
	if err := sw.Maps.PutMember(mb); err != nil {
		t.Fatal(err)
	}

	p, err := maps.OpenPinned(dir)
	if err != nil {
		t.Fatalf("OpenPinned: %v", err)
	}
	defer p.Close()
	if got := p.PoolSize(); got != 12 {
		t.Errorf("pinned PoolSize = %d, want 12", got)
	}
	want, err := sw.Maps.ReadCounters()
	if err != nil {
		t.Fatal(err)
	}
	got, err := p.ReadCounters()
	if err != nil {
		t.Fatalf("pinned ReadCounters: %v", err)
	}
	if got != want {
		t.Errorf("pinned counters %v, want %v", got.Map(), want.Map())
	}
	if got[maps.CntNonAgg] == 0 {
		t.Error("pinned counters do not show the packet run through the loaded switch")
	}
	ms, err := p.ListMembers()
	if err != nil || len(ms) != 1 || !memberEqual(ms[0], mb) {
		t.Errorf("pinned ListMembers = %+v, %v; want [%+v]", ms, err, mb)
	}
	// The pinned maps hold the admitted job and its key.
	if j, err := p.GetJob(4); err != nil || j.PS != netip.MustParseAddrPort("10.1.2.2:9510") || j.Joined != 1<<1 {
		t.Errorf("pinned GetJob(4) = %+v, %v; want PS 10.1.2.2:9510, worker 1 joined", j, err)
	}
	if k, err := p.JobKey(4); err != nil || !slices.Equal(k, key) {
		t.Errorf("pinned JobKey(4) = %x, %v; want %x", k, err, key)
	}
	// Writes through the pinned maps reach the loaded switch.
	if err := p.DeleteMember(4, 3); err != nil {
		t.Fatalf("pinned DeleteMember: %v", err)
	}
	if ms, _ := sw.Maps.ListMembers(); len(ms) != 0 {
		t.Errorf("member deleted through the pins still in the loaded switch: %+v", ms)
	}
	// The pinned garbage collector runs on the loaded switch's slots.
	if p.GC == nil {
		t.Fatal("OpenPinned did not open the garbage collector")
	}
	s := bpf.XdpaggSlot{JobId: 4, Seq: 1, State: uint8(bpf.XdpaggSlotStateSLOT_AGGREGATING), FanIn: 2, Nvals: 1}
	if err := sw.Maps.Slots.Put(uint32(5), &s); err != nil {
		t.Fatal(err)
	}
	if n, err := p.RemoveJob(4); err != nil || n != 1 {
		t.Errorf("pinned RemoveJob(4) = %d, %v; want 1 slot freed", n, err)
	}
	if _, err := sw.Maps.GetJob(4); !errors.Is(err, maps.ErrNoJob) {
		t.Errorf("job removed through the pins: loaded GetJob = %v, want ErrNoJob", err)
	}
	if used, err := sw.Maps.SlotsInUse(); err != nil || len(used) != 0 {
		t.Errorf("slots after pinned RemoveJob: %+v, %v; want none", used, err)
	}
	if err := p.Close(); err != nil {
		t.Errorf("Close pinned maps: %v", err)
	}
}

func TestCloseOfNewLeavesMapsOpen(t *testing.T) {
	sw := load(t, 4)
	m := maps.New(&sw.Objects)
	if err := m.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if _, err := sw.Maps.ReadCounters(); err != nil {
		t.Errorf("maps given to New were closed by its Close: %v", err)
	}
}

func TestMemberJSONMACs(t *testing.T) {
	mb := maps.Member{JobID: 1, MAC: net.HardwareAddr{2, 0, 0, 0, 0, 1}, PortMAC: net.HardwareAddr{2, 0, 0, 0, 0, 2}}
	b, err := json.Marshal(mb)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"mac":"02:00:00:00:00:01"`, `"port_mac":"02:00:00:00:00:02"`, `"job":1`} {
		if !strings.Contains(string(b), want) {
			t.Errorf("%s lacks %s", b, want)
		}
	}
}

// load loads a switch with pool slots for this package's tests.
func load(t *testing.T, pool uint32) *loader.Switch {
	t.Helper()
	return bpftest.LoadSwitch(t, loader.Config{PoolSize: pool})
}

func skipIfUnsupported(t *testing.T, what string, err error) { t.Helper(); bpftest.Check(t, what, err) }
