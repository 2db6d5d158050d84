package agent

import (
	"net"
	"net/netip"
	"slices"
	"sort"
	"strconv"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
)

// series is one gathered sample: its labels and value.
type series struct {
	labels map[string]string
	value  float64
}

// gather registers c in a fresh registry and returns every family's samples by family name.
func gather(t *testing.T, c prometheus.Collector) map[string][]series {
	t.Helper()
	reg := prometheus.NewRegistry()
	if err := reg.Register(c); err != nil {
		t.Fatalf("register collector: %v", err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatalf("Gather: %v", err)
	}
	out := map[string][]series{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			s := series{labels: map[string]string{}}
			for _, l := range m.GetLabel() {
				s.labels[l.GetName()] = l.GetValue()
			}
			switch {
			case m.GetCounter() != nil:
				s.value = m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				s.value = m.GetGauge().GetValue()
			default:
				t.Errorf("family %s: sample is neither a counter nor a gauge", mf.GetName())
			}
			out[mf.GetName()] = append(out[mf.GetName()], s)
		}
	}
	return out
}

// single returns the value of a family with exactly one unlabelled sample.
func single(t *testing.T, fams map[string][]series, name string) float64 {
	t.Helper()
	s := fams[name]
	if len(s) != 1 || len(s[0].labels) != 0 {
		t.Fatalf("family %s = %+v, want one unlabelled sample", name, s)
	}
	return s[0].value
}

func TestCollector(t *testing.T) {
	const pool = 24
	sw := loadSwitch(t, pool)
	fams := gather(t, NewCollector(sw.Maps))

	pk := fams["xdpagg_switch_packets_total"]
	if len(pk) != maps.NumCounters {
		t.Errorf("xdpagg_switch_packets_total has %d series, want one per counter (%d)", len(pk), maps.NumCounters)
	}
	var names []string
	for _, s := range pk {
		if len(s.labels) != 1 {
			t.Errorf("packets series labels %v, want only counter", s.labels)
		}
		names = append(names, s.labels["counter"])
		if s.value != 0 {
			t.Errorf("fresh switch: counter %s = %v", s.labels["counter"], s.value)
		}
	}
	sort.Strings(names)
	var want []string
	for i := range maps.NumCounters {
		want = append(want, maps.CounterName(maps.Counter(i)))
	}
	sort.Strings(want)
	// The counters of trust and isolation are among them, by name.
	for _, n := range []string{"spoofed", "ip_invalid", "over_quota", "ctl_limited", "not_member", "control"} {
		if !slices.Contains(names, n) {
			t.Errorf("no xdpagg_switch_packets_total{counter=%q} in %v", n, names)
		}
	}
	if len(names) == len(want) {
		for i := range names {
			if names[i] != want[i] {
				t.Errorf("counter labels %v, want %v", names, want)
				break
			}
		}
	}

	if got := single(t, fams, "xdpagg_switch_pool_size"); got != pool {
		t.Errorf("xdpagg_switch_pool_size = %v, want %d", got, pool)
	}
	if got := single(t, fams, "xdpagg_switch_scrape_ok"); got != 1 {
		t.Errorf("xdpagg_switch_scrape_ok = %v, want 1", got)
	}
	if got := single(t, fams, "xdpagg_switch_members"); got != 0 {
		t.Errorf("xdpagg_switch_members = %v, want 0", got)
	}
	if got := single(t, fams, "xdpagg_switch_jobs"); got != 0 {
		t.Errorf("xdpagg_switch_jobs = %v, want 0", got)
	}
	if r, ok := fams["xdpagg_agent_control_rejected_total"]; ok {
		t.Errorf("control rejections %v exported without a control server", r)
	}
	slots := map[string]float64{}
	for _, s := range fams["xdpagg_switch_slots"] {
		slots[s.labels["state"]] = s.value
	}
	if len(slots) != 2 || slots["aggregating"] != 0 || slots["complete"] != 0 {
		t.Errorf("xdpagg_switch_slots = %v, want aggregating 0 and complete 0", slots)
	}
	// The recirculation histogram: every pass count from 0 (empty markers), at zero.
	recirc := map[string]float64{}
	for _, s := range fams["xdpagg_switch_recirculation_packets"] {
		if len(s.labels) != 1 {
			t.Errorf("recirculation series labels %v, want only passes", s.labels)
		}
		recirc[s.labels["passes"]] = s.value
	}
	if len(recirc) != bpf.SparseMaxPasses+1 {
		t.Errorf("xdpagg_switch_recirculation_packets = %v, want passes 0..%d", recirc, bpf.SparseMaxPasses)
	}
	for k := range bpf.SparseMaxPasses + 1 {
		if v, ok := recirc[strconv.Itoa(k)]; !ok || v != 0 {
			t.Errorf("fresh switch: recirculation_packets{passes=%q} = %v, %v; want 0", strconv.Itoa(k), v, ok)
		}
	}
	// No sparse job, no sparse series.
	for _, f := range []string{"xdpagg_switch_sparse_iteration", "xdpagg_switch_sparse_hot_version",
		"xdpagg_switch_sparse_register_filled", "xdpagg_switch_sparse_record_complete"} {
		if s, ok := fams[f]; ok {
			t.Errorf("%s = %v without a sparse job", f, s)
		}
	}
}

// The sparse datapath as the collector exports it: each sparse job's records by parity (dense
// jobs have none) and the recirculation histogram, read at every scrape.
func TestCollectorSparse(t *testing.T) {
	sw := loadSwitch(t, 8)
	m := sw.Maps
	c := NewCollector(m)
	admitJob(t, m, 1, netip.MustParseAddrPort("10.0.0.9:9510"), 2) // dense
	key, err := ctlauth.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	if err := m.AddJob(maps.Job{JobID: 5, PS: netip.MustParseAddrPort("10.0.0.8:9510"), PSIfindex: testPort, Workers: 2,
		MaxSlots: 8, RegArrays: 2}, key); err != nil {
		t.Fatal(err)
	}
	j, err := m.GetJob(5)
	if err != nil {
		t.Fatal(err)
	}
	// sparse reads the sparse families by job and parity.
	sparse := func(fams map[string][]series) map[string]map[string]float64 {
		t.Helper()
		out := map[string]map[string]float64{}
		for _, f := range []string{"iteration", "hot_version", "register_filled", "record_complete"} {
			out[f] = map[string]float64{}
			for _, s := range fams["xdpagg_switch_sparse_"+f] {
				if len(s.labels) != 2 {
					t.Errorf("sparse_%s labels %v, want job and parity", f, s.labels)
				}
				out[f][s.labels["job"]+"/"+s.labels["parity"]] = s.value
			}
		}
		return out
	}
	got := sparse(gather(t, c))
	for f, byKey := range got {
		if len(byKey) != 2 || byKey["5/0"] != 0 || byKey["5/1"] != 0 {
			t.Errorf("fresh sparse job: sparse_%s = %v, want 0 for job 5 parities 0 and 1 only", f, byKey)
		}
	}

	// Iteration 6 complete in parity 0 with 3 slots summed, iteration 7 open in parity 1.
	var st bpf.XdpaggSparseJob
	st.It[0].Iter, st.It[0].Version, st.It[0].FanIn, st.It[0].State = 6, 2, 2, uint8(bpf.XdpaggSparseStateSPARSE_COMPLETE)
	st.It[1].Iter, st.It[1].Version, st.It[1].FanIn, st.It[1].State = 7, 3, 2, uint8(bpf.XdpaggSparseStateSPARSE_OPEN)
	if err := m.SparseJobs.Put(uint32(5), &st); err != nil {
		t.Fatal(err)
	}
	var ra bpf.XdpaggRegArray
	for s := range 3 {
		ra.Cells[s], ra.Hits[s] = 6<<32|1, 2
	}
	ra.Cells[4], ra.Hits[4] = 4<<32|1, 1 // an older iteration's: reads as zero
	if err := m.Registers.Put(uint32(j.RegBase)+1, &ra); err != nil {
		t.Fatal(err)
	}
	ncpu, err := ebpf.PossibleCPU()
	if err != nil {
		t.Fatal(err)
	}
	for k, n := range []uint64{1, 7, 3, 0, 1} {
		per := make([]uint64, ncpu)
		per[0] = n
		if err := m.RecircHist.Put(uint32(k), per); err != nil {
			t.Fatal(err)
		}
	}
	fams := gather(t, c)
	got = sparse(fams)
	want := map[string]map[string]float64{
		"iteration":       {"5/0": 6, "5/1": 7},
		"hot_version":     {"5/0": 2, "5/1": 3},
		"register_filled": {"5/0": 3, "5/1": 0},
		"record_complete": {"5/0": 1, "5/1": 0},
	}
	for f, w := range want {
		if len(got[f]) != len(w) || got[f]["5/0"] != w["5/0"] || got[f]["5/1"] != w["5/1"] {
			t.Errorf("sparse_%s = %v, want %v", f, got[f], w)
		}
	}
	recirc := map[string]float64{}
	for _, s := range fams["xdpagg_switch_recirculation_packets"] {
		recirc[s.labels["passes"]] = s.value
	}
	if w := map[string]float64{"0": 1, "1": 7, "2": 3, "3": 0, "4": 1}; len(recirc) != len(w) ||
		recirc["0"] != 1 || recirc["1"] != 7 || recirc["2"] != 3 || recirc["3"] != 0 || recirc["4"] != 1 {
		t.Errorf("xdpagg_switch_recirculation_packets = %v, want %v", recirc, w)
	}
	if got := single(t, fams, "xdpagg_switch_scrape_ok"); got != 1 {
		t.Errorf("xdpagg_switch_scrape_ok = %v, want 1", got)
	}

	// A sparse job whose records cannot be read: scrape_ok 0, the rest still exported.
	if err := m.SparseJobs.Delete(uint32(5)); err != nil {
		t.Fatal(err)
	}
	fams = gather(t, c)
	if got := single(t, fams, "xdpagg_switch_scrape_ok"); got != 0 {
		t.Errorf("xdpagg_switch_scrape_ok with a sparse job's records gone = %v, want 0", got)
	}
	if got := single(t, fams, "xdpagg_switch_jobs"); got != 2 {
		t.Errorf("xdpagg_switch_jobs = %v, want 2", got)
	}
	if s, ok := fams["xdpagg_switch_sparse_iteration"]; ok {
		t.Errorf("sparse_iteration = %v for unreadable records", s)
	}
}

func TestCollectorFollowsMaps(t *testing.T) {
	sw := loadSwitch(t, 8)
	c := NewCollector(sw.Maps)
	admitJob(t, sw.Maps, 1, netip.MustParseAddrPort("10.0.0.9:9510"), 2)
	admitJob(t, sw.Maps, 2, netip.MustParseAddrPort("10.0.0.8:9510"), 2)
	mb := maps.Member{JobID: 1, WorkerID: 0, Ifindex: 2, Addr: netip.MustParseAddrPort("10.0.0.2:9510"),
		MAC: net.HardwareAddr{2, 0, 0, 0, 0, 1}, PortMAC: net.HardwareAddr{2, 0, 0, 0, 0, 2},
		SrcIP: netip.MustParseAddr("10.0.0.9")}
	if err := sw.Maps.PutMember(mb); err != nil {
		t.Fatal(err)
	}
	for i, st := range []bpf.XdpaggSlotState{bpf.XdpaggSlotStateSLOT_AGGREGATING, bpf.XdpaggSlotStateSLOT_COMPLETE, bpf.XdpaggSlotStateSLOT_COMPLETE} {
		s := bpf.XdpaggSlot{JobId: 1, Seq: uint32(i), State: uint8(st)}
		if err := sw.Maps.Slots.Put(uint32(i), &s); err != nil {
			t.Fatal(err)
		}
	}
	frame := make([]byte, 64)
	frame[12], frame[13] = 0x08, 0x06 // ARP: passed as non_agg
	if _, err := sw.Objects.XdpaggSwitch.Run(&ebpf.RunOptions{Data: frame}); err != nil {
		skipIfUnsupported(t, "BPF_PROG_TEST_RUN", err)
	}
	// An IPv4 frame from an address no route puts behind the arrival port (lo): spoofed.
	spoof := make([]byte, 64)
	spoof[12], spoof[13], spoof[14] = 0x08, 0x00, 0x45
	copy(spoof[14+12:], []byte{10, 99, 0, 1})
	if _, err := sw.Objects.XdpaggSwitch.Run(&ebpf.RunOptions{Data: spoof}); err != nil {
		skipIfUnsupported(t, "BPF_PROG_TEST_RUN", err)
	}

	fams := gather(t, c)
	if got := single(t, fams, "xdpagg_switch_members"); got != 1 {
		t.Errorf("xdpagg_switch_members = %v, want 1", got)
	}
	if got := single(t, fams, "xdpagg_switch_jobs"); got != 2 {
		t.Errorf("xdpagg_switch_jobs = %v, want 2", got)
	}
	slots := map[string]float64{}
	for _, s := range fams["xdpagg_switch_slots"] {
		slots[s.labels["state"]] = s.value
	}
	if slots["aggregating"] != 1 || slots["complete"] != 2 {
		t.Errorf("xdpagg_switch_slots = %v, want aggregating 1, complete 2", slots)
	}
	for _, s := range fams["xdpagg_switch_packets_total"] {
		want := 0.0
		if s.labels["counter"] == "non_agg" || s.labels["counter"] == "spoofed" {
			want = 1
		}
		if s.value != want {
			t.Errorf("counter %s = %v, want %v", s.labels["counter"], s.value, want)
		}
	}
}

func TestCollectorScrapeFailure(t *testing.T) {
	sw, err := loader.Load(loader.Config{PoolSize: 4})
	skipIfUnsupported(t, "load switch", err)
	c := NewCollector(sw.Maps)
	if err := sw.Close(); err != nil {
		t.Fatalf("close switch: %v", err)
	}
	fams := gather(t, c)
	if got := single(t, fams, "xdpagg_switch_scrape_ok"); got != 0 {
		t.Errorf("xdpagg_switch_scrape_ok with closed maps = %v, want 0", got)
	}
	if n := len(fams["xdpagg_switch_packets_total"]); n != 0 {
		t.Errorf("%d packet series from closed maps, want none", n)
	}
}

// With a control server, the collector exports its refusals by reason: every reason, from zero.
func TestCollectorControlRejections(t *testing.T) {
	ct := newCtlTest(t)
	c := ct.c
	w := newWorker(t)
	col := NewCollector(ct.sw.Maps).WithControl(c)
	rejected := func() map[string]float64 {
		t.Helper()
		out := map[string]float64{}
		for _, s := range gather(t, col)["xdpagg_agent_control_rejected_total"] {
			if len(s.labels) != 1 {
				t.Errorf("rejected series labels %v, want only reason", s.labels)
			}
			out[s.labels["reason"]] = s.value
		}
		return out
	}
	got := rejected()
	if len(got) != len(rejectReasons()) {
		t.Errorf("rejected series %v, want one per reason %v", got, rejectReasons())
	}
	for _, r := range rejectReasons() {
		if v, ok := got[r]; !ok || v != 0 {
			t.Errorf("fresh server: rejected{reason=%q} = %v, %v; want 0", r, v, ok)
		}
	}
	for _, r := range []string{"malformed", "not_a_port", "not_admitted", "unauthenticated", "replayed", "not_member",
		"bound_elsewhere", "bad_worker", "port_full", "internal"} {
		if _, ok := got[r]; !ok {
			t.Errorf("no series for reason %q", r)
		}
	}
	refuse := func(b []byte, ifindex int) {
		t.Helper()
		err := c.handle(b, ifindex, w.addr)
		if err == nil {
			t.Fatal("message accepted")
		}
		c.reject(err, ifindex, w.addr)
	}
	refuse([]byte("junk"), testPort)
	refuse(join(t, ct.key, 1, 0), notAPort)
	bad := join(t, ct.key, 1, 0)
	bad[len(bad)-1] ^= 1
	refuse(bad, testPort)
	refuse(bad, testPort)
	refuse(ack(t, ct.key, 1, 0), testPort)
	got = rejected()
	want := map[string]float64{"malformed": 1, "not_a_port": 1, "unauthenticated": 2, "not_member": 1}
	for _, r := range rejectReasons() {
		if got[r] != want[r] {
			t.Errorf("rejected{reason=%q} = %v, want %v (all: %v)", r, got[r], want[r], got)
		}
	}
	if got := single(t, gather(t, col), "xdpagg_switch_jobs"); got != 2 {
		t.Errorf("xdpagg_switch_jobs = %v, want 2", got)
	}
}
