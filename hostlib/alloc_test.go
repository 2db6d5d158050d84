package hostlib

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"
)

// wakeAllocators are where allocations come from that a goroutine makes because it blocked and
// was woken, not because of the work it does. How many happen during a call depends on how long
// the call takes and on the scheduler, i.e. on the machine's load, so allocation budgets leave
// them out (see allocsPerRun). Keyed by the function that asked the allocator for memory:
var wakeAllocators = map[string]string{
	// A receive loop blocked in a socket read is woken by its read deadline, a timer (the PS's
	// eviction tick, the ring's retransmit and stall timers, a poke): net wraps the poller's
	// deadline error in a new *net.OpError every time.
	"net.(*rawConn).Read":  "read deadline expiries (net.OpError)",
	"net.(*rawConn).Write": "write deadline expiries (net.OpError)",
	// A goroutine that blocks in a select or on a channel takes one sudog per case from a per-P
	// cache, refilled from a central one that every GC empties: which P it blocks on, and
	// whether a GC just ran, decides whether that allocates.
	"runtime.acquireSudog": "goroutines blocking in select/channel operations (sudogs)",
	// A timer that a blocked goroutine waits on goes into a per-P heap, which grows on the P the
	// goroutine happens to run on.
	"runtime.(*timers).addHeap": "timer heaps growing",
	// First use of a type assertion or type switch at a call site builds its cache (errors.Is on
	// the deadline error, only reached after a wake-up).
	"runtime.buildTypeAssertCache":      "type assertion caches, on first use",
	"runtime.buildInterfaceSwitchCache": "type switch caches, on first use",
}

// wakeStacks are functions that, anywhere on an allocation's stack, make it a wake-up allocation
// like those of wakeAllocators.
var wakeStacks = map[string]string{
	// The scheduler starts an OS thread (its m, g0 stack, profiling buffers) when every thread
	// is busy or blocked in a system call: a matter of load.
	"runtime.newm": "the scheduler starting an OS thread",
}

// wakeReason returns why an allocation with stack stk is a wake-up allocation, or "".
func wakeReason(stk []uintptr) string {
	if why, ok := wakeAllocators[allocRequester(stk)]; ok {
		return why
	}
	frames := runtime.CallersFrames(stk)
	for {
		fr, more := frames.Next()
		if why, ok := wakeStacks[fr.Function]; ok {
			return why
		}
		if !more {
			return ""
		}
	}
}

// allocEntry are the runtime's allocation entry points, skipped to find who asked for memory.
func allocEntry(fn string) bool {
	switch fn {
	case "runtime.mallocgc", "runtime.newobject", "runtime.growslice", "runtime.makeslice",
		"runtime.makeslicecopy", "runtime.newarray":
		return true
	}
	return strings.HasPrefix(fn, "runtime.mallocgc") // size-class variants
}

// allocRequester returns the function that asked the runtime's allocator for the memory of an
// allocation with stack stk.
func allocRequester(stk []uintptr) string {
	frames := runtime.CallersFrames(stk)
	for {
		fr, more := frames.Next()
		if !allocEntry(fr.Function) || !more {
			return fr.Function
		}
	}
}

// stackHas reports whether fn is a frame of stk.
func stackHas(stk []uintptr, fn string) bool {
	frames := runtime.CallersFrames(stk)
	for {
		fr, more := frames.Next()
		if fr.Function == fn {
			return true
		}
		if !more {
			return false
		}
	}
}

// allocKey groups allocations in a heap profile: by requester (see allocRequester), and whether
// they are wake-up allocations (why, empty if not).
type allocKey struct{ requester, why string }

// heapProfile returns the cumulative count of allocated objects per allocKey, as of a GC it runs
// first (a GC publishes every allocation made before it). Its own allocations are left out.
func heapProfile() map[allocKey]int64 {
	runtime.GC()
	n, _ := runtime.MemProfile(nil, true)
	var recs []runtime.MemProfileRecord
	for {
		recs = make([]runtime.MemProfileRecord, n+64)
		var ok bool
		if n, ok = runtime.MemProfile(recs, true); ok {
			recs = recs[:n]
			break
		}
	}
	m := map[allocKey]int64{}
	for _, r := range recs {
		if stackHas(r.Stack(), "github.com/xdpagg/xdpagg/hostlib.heapProfile") {
			continue
		}
		m[allocKey{allocRequester(r.Stack()), wakeReason(r.Stack())}] += r.AllocObjects
	}
	return m
}

// allocsPerRun is testing.AllocsPerRun (a warm-up call, then the mean over runs calls) split by
// where the allocations come from, from the heap profile at rate 1: wake are those of
// wakeAllocators and wakeStacks, made because a goroutine blocked and was woken, in numbers that
// grow with the time a call takes (a loaded machine); hot is everything else, the allocations the
// code under test makes per call or per packet wherever it runs (worker, PS, the test's fake
// switch). testing.AllocsPerRun counts both: a budget on its figure fails on a slow machine.
func allocsPerRun(t *testing.T, runs int, f func()) (hot, wake float64) {
	t.Helper()
	old := runtime.MemProfileRate
	runtime.MemProfileRate = 1
	defer func() { runtime.MemProfileRate = old }()
	f()
	before := heapProfile()
	for range runs {
		f()
	}
	after := heapProfile()
	var nHot, nWake int64
	for k, n := range after {
		d := n - before[k]
		if d <= 0 {
			continue
		}
		if k.why != "" {
			nWake += d
			t.Logf("not counted: %.2f allocations per run by %s: %s", float64(d)/float64(runs), k.requester, k.why)
		} else {
			nHot += d
			t.Logf("counted: %.2f allocations per run by %s", float64(d)/float64(runs), k.requester)
		}
	}
	return float64(nHot) / float64(runs), float64(nWake) / float64(runs)
}

// The hot paths allocate nothing: a warmed-up AllReduce (worker send and receive, PS, and the
// test's fake switch, since allocations are counted process-wide) makes no garbage per fragment.
//
// The PS recycles a result's entry once MaxEntries are held (the oldest result makes room), and
// the warm-up sends far more fragments than that, so every entry comes from the free list in the
// measured calls. (Recycling by age instead, with a short ResultTTL, made the pool's size, and
// so its growth during the measurement, depend on how many calls fit in a TTL: on the machine's
// speed at the moment.) Allocations made by waking up (read deadlines, sudogs of blocking
// goroutines) are reported but not budgeted: how many happen depends on the load too.
func TestAllReduceAllocs(t *testing.T) {
	c := newCluster(t, clusterOpts{w: 1, psConfig: func(c *PSConfig) { c.MaxEntries, c.ResultTTL = 64, time.Hour }})
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
	hot, wake := allocsPerRun(t, 50, func() {
		if err := c.workers[0].AllReduce(ctx, data); err != nil {
			t.Fatal(err)
		}
	})
	frags := float64(len(data) / K)
	t.Logf("%.2f allocations per AllReduce of %g fragments, and %.2f by wake-ups (not counted)", hot, frags, wake)
	// A stray allocation (a map resize) is fine; one per fragment is the bug this catches.
	if hot >= frags/4 {
		t.Errorf("%.2f allocations per AllReduce of %g fragments, want about none", hot, frags)
	}
}

// BenchmarkAllReduce measures loopback throughput through the PS (no switch): W workers, 1 Mi
// values each. With /keep, the workers keep their results for member-assisted Help, as joined
// workers do: the hot-path cost of the ring (docs/protocol.md, HELP).
func BenchmarkAllReduce(b *testing.B) {
	for _, keep := range []bool{false, true} {
		for _, w := range []int{1, 4} {
			name := fmt.Sprintf("W=%d", w)
			if keep {
				name += "/keep"
			}
			b.Run(name, func(b *testing.B) {
				c := newCluster(b, clusterOpts{w: w})
				if keep {
					for _, wk := range c.workers {
						wk.mu.Lock()
						wk.startKeeping()
						wk.mu.Unlock()
					}
				}
				benchAllReduce(b, w, c.allReduce)
			})
		}
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
