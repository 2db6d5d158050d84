package bpf_test

// What the adder costs per value, and an A/B of it against another build of the switch in one
// interleaved run:
//
//	git show REV:bpf/xdpagg_bpfel.o > /tmp/old.o
//	go test ./bpf/ -run '^$' -bench BenchmarkAdder -benchtime 1x -args -adder-ab /tmp/old.o
//
// Each round runs, for each build (the built-in one, then the -adder-ab object, if given) and
// each packet size (adderSmall, then bpf.MaxValues values), a batch of adderBatch aggregate-path
// packets (31 contributors of a fan-in of 32 over 64 fragments: 30 of 31 packets add into a
// slot, the first of each fragment copies) and keeps the batch's median kernel time per packet
// (BPF_PROG_TEST_RUN's own duration, one packet per call, as BenchmarkSwitchPaths). The cost per
// value is the difference between the sizes over the difference of their values: fixed costs
// (parse, lookups, lock, clock) cancel. The figures are medians over rounds with p10-p90; "ab" is
// the median of the per-round ratios built-in/other, each from the same round, so that a shared
// machine's drift falls on both alike. After each batch its contributions run again, as
// duplicates (a path that touches no value): their median shows whether the builds' fixed costs
// differ. Nothing is asserted about time: the counters must say every packet took the path.

import (
	"flag"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
)

var adderAB = flag.String("adder-ab", "", "BenchmarkAdder: a switch object of another revision to compare the built-in one with, interleaved")

const (
	adderSmall  = 32 // one chunk
	adderFrags  = 64
	adderBatch  = adderFrags * (bpf.MaxWorkers - 1)
	adderRounds = 25
)

func BenchmarkAdder(b *testing.B) {
	p := newPortNS(b)
	ingress := p.a.Attrs().Index
	builds := []string{""}
	if *adderAB != "" {
		builds = append(builds, *adderAB)
	}
	sizes := []int{adderSmall, bpf.MaxValues}
	type variant struct {
		s      *sw
		frames [][]byte // per worker
	}
	vs := map[[2]int]*variant{}
	for bi, obj := range builds {
		for si, n := range sizes {
			sl, err := loader.Load(loader.Config{PoolSize: adderFrags, SlotTimeout: time.Hour, NoSourceCheck: true, Object: obj})
			if err != nil {
				b.Fatalf("load switch %q: %+v", obj, err)
			}
			b.Cleanup(func() { sl.Close() })
			if err := sl.Maps.AddJob(maps.Job{JobID: benchJob, PS: netip.AddrPortFrom(netip.AddrFrom4(nsPS), aggPort),
				PSIfindex: uint32(p.b.Attrs().Index), Workers: uint8(bpf.MaxWorkers), MaxSlots: adderFrags}, testKey(benchJob)); err != nil {
				b.Fatal(err)
			}
			v := &variant{s: &sw{Switch: sl}}
			for w := range uint8(bpf.MaxWorkers - 1) {
				if err := sl.Maps.PutWorker(benchJob, w, netip.AddrPortFrom(netip.AddrFrom4(nsWorkerIP(w)), workerPort(w)), uint32(ingress)); err != nil {
					b.Fatal(err)
				}
				vals := mkVals(n, func(i int) int32 { return int32(i%97) - 48 + int32(w) })
				f := dataFrame(benchJob, 0, 0, w, uint8(bpf.MaxWorkers), vals...).with(func(f *frame) { f.SrcIP = nsWorkerIP(w); f.DstIP = nsPS })
				v.frames = append(v.frames, f.bytes())
			}
			vs[[2]int{bi, si}] = v
		}
	}
	// batch runs one batch on v and returns its median time per packet.
	seq := uint32(0)
	// pass runs v's frames once on each fragment of the batch and returns every run's time.
	pass := func(v *variant) []time.Duration {
		ts := make([]time.Duration, 0, adderBatch)
		for f := range adderFrags {
			for _, fr := range v.frames {
				setFragment(fr, seq+uint32(f), uint32(f))
				_, d, err := timedRun(v.s.Objects.XdpaggSwitch, fr, ingress, 1)
				if err != nil {
					b.Fatal(err)
				}
				ts = append(ts, d)
			}
		}
		return ts
	}
	batch := func(v *variant) (add, dup float64) {
		if err := v.s.Maps.ResetSlots(); err != nil {
			b.Fatal(err)
		}
		c0 := v.s.counters(b)
		per := pass(v)
		if d := v.s.counters(b).Sub(c0); d[maps.CntAggregated] != uint64(adderBatch) || d[maps.CntRx] != uint64(adderBatch) || d[maps.CntCompleted] != 0 {
			b.Fatalf("%d packets, switch counted {%v}", adderBatch, deltaOf(d))
		}
		// Then the same contributions again: duplicates, the path that touches no value, as a
		// check that the build's fixed costs are the same.
		c0 = v.s.counters(b)
		dups := pass(v)
		if d := v.s.counters(b).Sub(c0); d[maps.CntDuplicate] != uint64(adderBatch) || d[maps.CntRx] != uint64(adderBatch) {
			b.Fatalf("%d duplicates, switch counted {%v}", adderBatch, deltaOf(d))
		}
		seq += adderFrags
		slices.Sort(per)
		slices.Sort(dups)
		return float64(per[len(per)/2]), float64(dups[len(dups)/2])
	}
	perValue := make([][]float64, len(builds)) // ns per value, per build, per round
	small := make([][]float64, len(builds))    // ns per packet at adderSmall values
	dup := make([][]float64, len(builds))      // ns per duplicate at bpf.MaxValues values
	b.ResetTimer()
	for range b.N {
		for range adderRounds {
			for bi := range builds {
				t := make([]float64, len(sizes))
				var d float64
				for si := range sizes {
					t[si], d = batch(vs[[2]int{bi, si}])
				}
				perValue[bi] = append(perValue[bi], (t[1]-t[0])/float64(sizes[1]-sizes[0]))
				small[bi] = append(small[bi], t[0])
				dup[bi] = append(dup[bi], d)
			}
		}
	}
	b.StopTimer()
	for bi, obj := range builds {
		name := "built-in"
		if obj != "" {
			name = obj
		}
		b.Logf("%s: %.3f ns/value [p10-p90 %.3f-%.3f], %.0f ns/pkt at %d values [%.0f-%.0f], duplicate %.0f ns/pkt [%.0f-%.0f]", name,
			quantile(perValue[bi], .5), quantile(perValue[bi], .1), quantile(perValue[bi], .9),
			quantile(small[bi], .5), adderSmall, quantile(small[bi], .1), quantile(small[bi], .9),
			quantile(dup[bi], .5), quantile(dup[bi], .1), quantile(dup[bi], .9))
	}
	b.ReportMetric(quantile(perValue[0], .5), "ns/value")
	if len(builds) == 2 {
		ratio := make([]float64, len(perValue[0]))
		for i := range ratio {
			ratio[i] = perValue[0][i] / perValue[1][i]
		}
		b.Logf("built-in/other per value, paired by round: %.3f [p10-p90 %.3f-%.3f]", quantile(ratio, .5), quantile(ratio, .1), quantile(ratio, .9))
		b.ReportMetric(quantile(perValue[1], .5), "ns/value-other")
		b.ReportMetric(quantile(ratio, .5), "ab")
	}
}

// quantile is the q-quantile of xs (nearest rank on a sorted copy).
func quantile(xs []float64, q float64) float64 {
	s := slices.Sorted(slices.Values(xs))
	if len(s) == 0 {
		return 0
	}
	return s[min(len(s)-1, int(q*float64(len(s)-1)+0.5))]
}
