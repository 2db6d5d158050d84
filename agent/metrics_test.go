package agent

import (
	"net"
	"net/netip"
	"slices"
	"sort"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/xdpagg/xdpagg/bpf"
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
