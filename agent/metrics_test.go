package agent

import (
	"net"
	"net/netip"
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

	fams := gather(t, c)
	if got := single(t, fams, "xdpagg_switch_members"); got != 1 {
		t.Errorf("xdpagg_switch_members = %v, want 1", got)
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
		if s.labels["counter"] == "non_agg" {
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
