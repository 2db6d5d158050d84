package bpf_test

import (
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/maps"
)

// TestAdderLanes drives the SWAR adder (bpf/adder.h: two int32 lanes per 64-bit add, the low
// lane's carry cut) with one special value at every lane position, in the full chunks added in
// place in the packet and in the partial last chunk added through the scratch, low and high lane
// alike. Every other lane sums -1 and 1, whose unsigned carry out of a low lane must not reach
// the high lane. The special lane overflows upwards or downwards (F_OVERFLOW, wrapped sum) or
// reaches a limit exactly (no flag): docs/protocol.md's rule, any lane that overflows sets
// F_OVERFLOW, and only then.
func TestAdderLanes(t *testing.T) {
	s := load(t, time.Hour)
	kinds := []struct {
		name   string
		a, b   int32
		wantOv bool
	}{
		{"overflows up", math.MaxInt32, 1, true},
		{"overflows down", math.MinInt32, -1, true},
		{"reaches max", math.MaxInt32 - 1, 1, false},
		{"reaches min", math.MinInt32 + 1, -1, false},
	}
	var steps []step
	seq := uint32(0)
	// 70: two full chunks and a 6-value tail; MaxValues-2: 25 full chunks and a 30-value tail.
	for _, n := range []int{70, bpf.MaxValues - 2} {
		for pos := range n {
			for _, k := range kinds {
				seq++
				idx := seq % poolSize // the job retakes its own completed slots
				v0 := mkVals(n, func(i int) int32 { return map[bool]int32{true: k.a, false: -1}[i == pos] })
				v1 := mkVals(n, func(i int) int32 { return map[bool]int32{true: k.b, false: 1}[i == pos] })
				want := sum(v0, v1)
				if (want[pos] == math.MinInt32) != (k.name == "overflows up" || k.name == "reaches min") {
					t.Fatalf("bad case %s: sum %d", k.name, want[pos])
				}
				w0 := dataFrame(9, seq, idx, 0, 2, v0...)
				w1 := dataFrame(9, seq, idx, 1, 2, v1...)
				fl, ovf := fFromSwitch, uint64(0)
				if k.wantOv {
					fl, ovf = fl|fOverflow, 1
				}
				name := fmt.Sprintf("n=%d/lane %d/%s", n, pos, k.name)
				steps = append(steps,
					step{name: name + "/worker 0", in: w0, verdict: xdpDrop, delta: cnt{maps.CntRx: 1, maps.CntAggregated: 1}},
					step{name: name + "/worker 1", in: w1, verdict: xdpRedirect, want: ptr(asResult(w1, 3, fl, want)),
						delta: cnt{maps.CntRx: 1, maps.CntAggregated: 1, maps.CntCompleted: 1, maps.CntOverflow: ovf}})
			}
		}
	}
	runSteps(t, s, steps)
}
