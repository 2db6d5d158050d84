package hostlib

import (
	"context"
	"fmt"
	"testing"
	"time"
)

// The hot paths allocate nothing: a warmed-up AllReduce (worker send and receive, PS, and the
// test's fake switch, since AllocsPerRun counts the whole process) makes no garbage per fragment.
// The PS keeps each result for ResultTTL before recycling its entry, so a short TTL and a warm-up
// bring it to its steady state, where entries come from the free list.
func TestAllReduceAllocs(t *testing.T) {
	c := newCluster(t, clusterOpts{w: 1, psConfig: func(c *PSConfig) { c.ResultTTL = time.Millisecond }})
	data := make([]float32, 20*K)
	for i := range data {
		data[i] = float32(i) / 1000
	}
	ctx := context.Background()
	for i := 0; i < 200; i++ {
		if err := c.workers[0].AllReduce(ctx, data); err != nil {
			t.Fatal(err)
		}
	}
	allocs := testing.AllocsPerRun(50, func() {
		if err := c.workers[0].AllReduce(ctx, data); err != nil {
			t.Fatal(err)
		}
	})
	t.Logf("%.2f allocations per AllReduce of %d fragments", allocs, len(data)/K)
	// A stray allocation (a map resize, an eviction tick running late) is fine; one per fragment
	// is the bug this catches.
	if frags := float64(len(data) / K); allocs >= frags/4 {
		t.Errorf("%.2f allocations per AllReduce of %g fragments, want about none", allocs, frags)
	}
}

// BenchmarkAllReduce measures loopback throughput through the PS (no switch): W workers, 1 Mi
// values each.
func BenchmarkAllReduce(b *testing.B) {
	for _, w := range []int{1, 4} {
		b.Run(fmt.Sprintf("W=%d", w), func(b *testing.B) {
			c := newCluster(b, clusterOpts{w: w})
			benchAllReduce(b, w, c.allReduce)
		})
	}
}

// benchAllReduce times allReduce over w tensors of 1 Mi values (4 MiB each), refilling the inputs
// before every call: repeated sums would grow into the overflow-repair path.
func benchAllReduce(b *testing.B, w int, allReduce func(ctx context.Context, in [][]float32) error) {
	b.Helper()
	orig, _ := tensors(w, 1<<20, 1, uniform)
	in := make([][]float32, w)
	for i := range in {
		in[i] = make([]float32, len(orig[i]))
	}
	b.SetBytes(4 << 20)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for j := range in {
			copy(in[j], orig[j])
		}
		if err := allReduce(context.Background(), in); err != nil {
			b.Fatal(err)
		}
	}
}
