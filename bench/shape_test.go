package bench

import (
	"context"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/xdpagg/xdpagg/bench/gloo"
	"github.com/xdpagg/xdpagg/netns_tests/topo"
)

// Every mode's topology is shaped alike: every host link, both directions, at the requested rate;
// and the mode's own traffic really passes both shapers of every worker's link (the packet
// counters of the HTB classes move), its sums still right. Configuration and counts only: how
// fast the shaped links are is never asserted.
func TestShapedEnvironments(t *testing.T) {
	const rate = 2_000_000_000
	const w = 2
	opts := Options{MTU: 3388}.withDefaults()
	for _, name := range AllModes {
		t.Run(name, func(t *testing.T) {
			if name == ModeGloo {
				if err := gloo.Available(opts.Python); err != nil {
					t.Fatalf("gloo: %v (make deps-bench installs torch)", err)
				}
			}
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			m, err := setUp(ctx, name, opts, w, rate)
			if errors.Is(err, ebpf.ErrNotSupported) {
				t.Skipf("kernel lacks a feature (ebpf.ErrNotSupported): %v", err)
			}
			if err != nil {
				t.Fatal(err)
			}
			defer func() {
				if err := m.close(); err != nil {
					t.Errorf("close: %v", err)
				}
			}()
			tp := m.topology()
			before := map[string]topo.LinkShaping{}
			for _, h := range tp.Hosts() {
				s, err := tp.Shaping(h)
				if err != nil {
					t.Fatal(err)
				}
				if s.EgressRate != rate || s.IngressRate != rate || !s.IngressRedirect {
					t.Errorf("host %s: %+v, want %d bit/s both ways with the ingress redirected", h.Name, s, uint64(rate))
				}
				before[h.Name] = s
			}
			n := 64 << 10 / 4
			in, ref := makeInputs(w, n, 42)
			if _, err := m.run(ctx, in); err != nil {
				t.Fatal(err)
			}
			if err := m.verify(in, ref); err != nil {
				t.Fatalf("shaped allreduce: %v", err)
			}
			for _, h := range tp.Workers {
				s, err := tp.Shaping(h)
				if err != nil {
					t.Fatal(err)
				}
				b := before[h.Name]
				if s.EgressPackets == b.EgressPackets || s.IngressPackets == b.IngressPackets {
					t.Errorf("worker %s: the allreduce passed its shapers %d times out and %d in, want both > 0",
						h.Name, s.EgressPackets-b.EgressPackets, s.IngressPackets-b.IngressPackets)
				}
			}
		})
	}
}

// The report's link-rate dimension and theory, and the CPU split, from made-up cells.
func TestReportLinkRatesAndCPUSplit(t *testing.T) {
	const gbit = 1_000_000_000
	secs := func(v ...float64) []float64 { return v }
	r := &Report{Environments: Environments, CPUSplit: CPUSplit, LinkShaping: LinkShaping}
	for _, rate := range []uint64{0, gbit} {
		r.Cells = append(r.Cells,
			Cell{Mode: ModeXdpagg, Workers: 4, Bytes: 4 << 20, LinkRate: rate, Seconds: secs(1, 1, 1)},
			Cell{Mode: ModeRing, Workers: 4, Bytes: 4 << 20, LinkRate: rate, Seconds: secs(1.2, 1.2, 1.2)},
			Cell{Mode: ModeGloo, Workers: 4, Bytes: 4 << 20, LinkRate: rate, Seconds: secs(1.5, 1.5, 1.5)},
			Cell{Mode: ModePS, Workers: 4, Bytes: 4 << 20, LinkRate: rate, Seconds: secs(4, 4, 4)})
	}
	r.ratios(AllModes)
	type key struct {
		other string
		rate  uint64
	}
	got := map[key]Ratio{}
	for _, x := range r.Ratios {
		if x.Mode == ModeXdpagg {
			got[key{x.Other, x.LinkRate}] = x
		}
	}
	for k, want := range map[key]struct{ median, theory float64 }{
		{ModeRing, 0}: {1.2, 0}, {ModeGloo, 0}: {1.5, 0}, {ModePS, 0}: {4, 0},
		{ModeRing, gbit}: {1.2, 1.5}, {ModeGloo, gbit}: {1.5, 1.5}, {ModePS, gbit}: {4, 4},
	} {
		x, ok := got[k]
		if !ok {
			t.Errorf("no ratio xdpagg vs %s at %s", k.other, FormatRate(k.rate))
			continue
		}
		if math.Abs(x.Median-want.median) > 1e-9 || x.Theory != want.theory {
			t.Errorf("xdpagg vs %s at %s: median %v theory %v, want %v and %v", k.other, FormatRate(k.rate), x.Median, x.Theory, want.median, want.theory)
		}
		if want.theory > 0 && math.Abs(x.FromTheory-(want.median/want.theory-1)) > 1e-9 {
			t.Errorf("xdpagg vs %s: from theory %v, want %v", k.other, x.FromTheory, want.median/want.theory-1)
		}
	}
	var b strings.Builder
	r.Table(&b)
	for _, s := range []string{"1gbit", "none", "theory", "-20%", "+0%", "HTB", "worker", "switch"} {
		if !strings.Contains(b.String(), s) {
			t.Errorf("table lacks %q:\n%s", s, b.String())
		}
	}

	// The split: xdpagg's sides add up to its total; the baselines without switch help have a
	// switch side of 0; the PS's is not separated.
	w, s := splitCPU(ModeXdpagg, 3, 0.5, 2, 1e9/2) // 0.25 s per 0.5 GB run: 0.5 s/GB
	if w == nil || s == nil || math.Abs(*s-0.5) > 1e-9 || math.Abs(*w-2.5) > 1e-9 {
		t.Errorf("xdpagg split %v %v, want 2.5 and 0.5", w, s)
	}
	if w, s := splitCPU(ModeXdpagg, 3, 0, 0, 1e9); w != nil || s != nil {
		t.Errorf("xdpagg without metered runs: %v %v, want no split", w, s)
	}
	for _, m := range []string{ModeRing, ModeGloo} {
		if w, s := splitCPU(m, 2, 0, 0, 1e9); w == nil || s == nil || *w != 2 || *s != 0 {
			t.Errorf("%s split %v %v, want 2 and 0", m, w, s)
		}
	}
	if w, s := splitCPU(ModePS, 2, 0, 0, 1e9); w == nil || *w != 2 || s != nil {
		t.Errorf("ps split %v %v, want 2 and none", w, s)
	}
	for _, m := range AllModes {
		if CPUSplit[m] == "" {
			t.Errorf("CPUSplit says nothing about %s", m)
		}
	}
}

func TestParseLinkRates(t *testing.T) {
	for in, want := range map[string][]uint64{
		"none":                  {0},
		"1gbit,10gbit":          {1e9, 10e9},
		"none, 100mbit,2.5Gbit": {0, 100e6, 2.5e9},
		"0,500kbit":             {0, 500e3},
	} {
		got, err := ParseLinkRates(in)
		if err != nil || len(got) != len(want) {
			t.Errorf("%q: %v %v, want %v", in, got, err, want)
			continue
		}
		for i := range want {
			if got[i] != want[i] {
				t.Errorf("%q: %v, want %v", in, got, want)
			}
		}
	}
	for _, bad := range []string{"", "1gb", "fast", "-1gbit", "1e30tbit", "gbit"} {
		if _, err := ParseLinkRates(bad); !errors.Is(err, ErrConfig) {
			t.Errorf("%q: %v, want ErrConfig", bad, err)
		}
	}
	for r, want := range map[uint64]string{0: "none", 1e9: "1gbit", 2.5e9: "2.5gbit", 100e6: "100mbit", 999: "999bit"} {
		if got := FormatRate(r); got != want {
			t.Errorf("FormatRate(%d) = %q, want %q", r, got, want)
		}
	}
}

// On shaped links the UDP modes wait for their busiest link to drain its in-flight packets
// before resending; unshaped they keep hostlib's default.
func TestRetransmitTimeout(t *testing.T) {
	if got := retransmitTimeout(0, 64, 3388); got != 0 {
		t.Errorf("unshaped: %v, want 0 (hostlib's default)", got)
	}
	// 64 packets of 3402 bytes (1,741,824 bits) at 200 Mbit/s drain in 8.70912 ms.
	want := 20*time.Millisecond + 2*8709120*time.Nanosecond
	if got := retransmitTimeout(200_000_000, 64, 3388); got != want {
		t.Errorf("200mbit: %v, want %v", got, want)
	}
}
