package netns_tests

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/netns_tests/testbed"
	"github.com/xdpagg/xdpagg/netns_tests/topo"
)

// A link impairment of one fault scenario.
type impairSpec struct {
	ps   bool // the PS's link instead of every worker's
	dir  topo.Direction
	impr topo.Impairment
}

// Loss, duplication and reordering on worker and PS links, alone and together: every allreduce
// completes with exact results and no half-filled slot is left behind. (This kernel has no netem:
// topo.Impair drops and copies with a tc BPF program and reorders through an HTB delay line.)
func TestFaultScenarios(t *testing.T) {
	const w = 4
	loss := func(p float64) topo.Impairment { return topo.Impairment{Loss: p} }
	dup := func(p float64) topo.Impairment { return topo.Impairment{Duplicate: p} }
	both := func(dir topo.Direction, im topo.Impairment) []impairSpec {
		return []impairSpec{{dir: dir, impr: im}}
	}
	scenarios := []struct {
		name string
		imp  []impairSpec
	}{
		{"no faults", nil},
		{"0.1% loss worker->switch", both(topo.ToSwitch, loss(0.1))},
		{"1% loss worker->switch", both(topo.ToSwitch, loss(1))},
		{"5% loss worker->switch", both(topo.ToSwitch, loss(5))},
		{"0.1% loss switch->worker", both(topo.FromSwitch, loss(0.1))},
		{"1% loss switch->worker", both(topo.FromSwitch, loss(1))},
		{"5% loss switch->worker", both(topo.FromSwitch, loss(5))},
		{"5% duplication both ways", []impairSpec{{dir: topo.ToSwitch, impr: dup(5)}, {dir: topo.FromSwitch, impr: dup(5)}}},
		{"1% reordering worker->switch", both(topo.ToSwitch, topo.Impairment{Reorder: 1})},
		{"5% reordering switch->worker", both(topo.FromSwitch, topo.Impairment{Reorder: 5})},
		{"5% reordering both ways, 500us", []impairSpec{
			{dir: topo.ToSwitch, impr: topo.Impairment{Reorder: 5, ReorderDelay: 500 * time.Microsecond}},
			{dir: topo.FromSwitch, impr: topo.Impairment{Reorder: 5, ReorderDelay: 500 * time.Microsecond}}}},
		{"5% loss on the PS link", []impairSpec{{ps: true, dir: topo.ToSwitch, impr: loss(5)}, {ps: true, dir: topo.FromSwitch, impr: loss(5)}}},
		{"1% loss + 1% duplication + 1% reordering everywhere", []impairSpec{
			{dir: topo.ToSwitch, impr: topo.Impairment{Loss: 1, Duplicate: 1, Reorder: 1}},
			{dir: topo.FromSwitch, impr: topo.Impairment{Loss: 1, Duplicate: 1, Reorder: 1}},
			{ps: true, dir: topo.ToSwitch, impr: topo.Impairment{Loss: 1, Duplicate: 1, Reorder: 1}},
			{ps: true, dir: topo.FromSwitch, impr: topo.Impairment{Loss: 1, Duplicate: 1, Reorder: 1}},
		}},
	}
	const slotTimeout = 200 * time.Millisecond
	b := newBed(t, testbed.Options{Workers: w, Timeout: 5 * time.Millisecond, Switch: loader.Config{SlotTimeout: slotTimeout}})
	n := 2000 * K
	const rounds = 7
	var rows []string
	var clean time.Duration
	for i, sc := range scenarios {
		t.Run(sc.name, func(t *testing.T) {
			for _, im := range sc.imp {
				hosts := b.Topo.Workers
				if im.ps {
					hosts = []*topo.Host{b.Topo.PS}
				}
				for _, h := range hosts {
					if err := b.Topo.Impair(h, im.dir, im.impr); err != nil {
						t.Fatalf("impair %s: %v", h.Name, err)
					}
					t.Cleanup(func() {
						if err := b.Topo.ClearImpair(h, im.dir); err != nil {
							t.Errorf("clear impairment of %s: %v", h.Name, err)
						}
					})
				}
			}
			before, _ := b.Counters()
			var retx0, fast0 uint64
			for _, wk := range b.Workers {
				retx0 += wk.Stats().Retransmits
				fast0 += wk.Stats().FastResends
			}
			in, ref := inputs(w, n, uint64(10+i), uniform)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			// Median of `rounds` allreduces: the time cost against no faults.
			var times []time.Duration
			for r := range rounds {
				if r > 0 {
					in, ref = inputs(w, n, uint64(100*i+r), uniform)
				}
				d, err := b.AllReduce(ctx, in)
				if err != nil {
					t.Fatalf("allreduce under %s: %v", sc.name, err)
				}
				checkFixed(t, in, ref, 24)
				times = append(times, d)
			}
			// Delayed (reordered) first packets of fragments already completed at the PS may
			// reserve slots nobody will fill: the agent's garbage collection frees them once they
			// are idle past the slot timeout. After that nothing may be left half-filled.
			time.Sleep(slotTimeout + 50*time.Millisecond)
			if _, err := b.Switch.Maps.ReclaimIdle(); err != nil {
				t.Fatal(err)
			}
			checkNoHalfSlots(t, b.Switch.Maps)
			after, _ := b.Counters()
			d := after.Sub(before)
			med := median(times)
			if i == 0 {
				clean = med
			}
			var retx, fast uint64
			for _, wk := range b.Workers {
				st := wk.Stats()
				retx += st.Retransmits
				fast += st.FastResends
			}
			retx, fast = retx-retx0, fast-fast0
			rows = append(rows, fmt.Sprintf("%-50s exact  slots leaked 0  median %6.1f ms (%.2fx)  in-switch %d/%d  flushed %d  shadow %d  worker resends %d (%d deemed lost early)",
				sc.name, float64(med.Microseconds())/1e3, float64(med)/float64(max(clean, 1)),
				d[maps.CntCompleted], rounds*n/K, d[maps.CntFlushed], d[maps.CntShadowTx], retx, fast))
		})
	}
	// Printed so the table is in `make test` output with -v, and in the closing note.
	for _, r := range rows {
		t.Log(r)
	}
}

func median(d []time.Duration) time.Duration {
	a := append([]time.Duration(nil), d...)
	for i := range a {
		for j := i + 1; j < len(a); j++ {
			if a[j] < a[i] {
				a[i], a[j] = a[j], a[i]
			}
		}
	}
	return a[len(a)/2]
}
