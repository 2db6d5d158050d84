package netns_tests

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/internal/bpftest"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/netns_tests/testbed"
	"github.com/xdpagg/xdpagg/netns_tests/topo"
	"github.com/xdpagg/xdpagg/wire"
)

const K = wire.StdValues // values per packet at the topology's 1500-byte MTU

// newBed builds a testbed torn down (and checked for leftovers) when the test ends. Before the
// teardown, every host is checked for UDP datagrams with a bad checksum (checkUDPChecksums).
func newBed(t *testing.T, opts testbed.Options) *testbed.Bed {
	t.Helper()
	opts.Prefix = topo.NewPrefix()
	b, err := testbed.New(opts)
	bpftest.Check(t, "testbed", err)
	t.Cleanup(func() {
		if err := b.Close(); err != nil {
			t.Errorf("teardown: %v", err)
		}
		left, err := topo.Leftovers(opts.Prefix)
		if err != nil {
			t.Errorf("list namespaces: %v", err)
		}
		if len(left) > 0 {
			t.Errorf("namespaces left behind: %v", left)
		}
	})
	t.Cleanup(func() { checkUDPChecksums(t, b.Topo) }) // runs first: cleanups run last-in first-out
	return b
}

// checkUDPChecksums fails if a host (worker or PS) or the switch namespace dropped a UDP
// datagram for a bad checksum (Udp InCsumErrors in its /proc/net/snmp). Every result a worker gets
// must carry a valid UDP checksum or 0 (docs/protocol.md: the switch zeroes it whenever it
// rewrites a packet): one with a stale or partial checksum (the sender's, left in a rewritten
// result) is dropped by the host's kernel, and the workers' resends would quietly repair the
// loss, so exact sums alone would not show it.
func checkUDPChecksums(t *testing.T, tp *topo.Topology) {
	t.Helper()
	check := func(where string) func() error {
		return func() error {
			n, err := udpCsumErrors()
			if err != nil {
				return err
			}
			if n != 0 {
				t.Errorf("%s: %d UDP datagrams dropped for a bad checksum (Udp InCsumErrors)", where, n)
			}
			return nil
		}
	}
	for _, h := range tp.Hosts() {
		if err := tp.InHost(h, check("host "+h.Name)); err != nil {
			t.Errorf("host %s: read UDP counters: %v", h.Name, err)
		}
	}
	if err := tp.InSwitch(check("switch namespace")); err != nil {
		t.Errorf("switch namespace: read UDP counters: %v", err)
	}
}

// udpCsumErrors reads Udp InCsumErrors of the calling thread's network namespace (thread-self:
// /proc/net is the process's, i.e. its main thread's, namespace).
func udpCsumErrors() (uint64, error) {
	b, err := os.ReadFile("/proc/thread-self/net/snmp")
	if err != nil {
		return 0, err
	}
	var names []string
	for line := range strings.Lines(string(b)) {
		f := strings.Fields(line)
		if len(f) == 0 || f[0] != "Udp:" {
			continue
		}
		if names == nil {
			names = f
			continue
		}
		for i, name := range names {
			if name == "InCsumErrors" && i < len(f) {
				return strconv.ParseUint(f[i], 10, 64)
			}
		}
	}
	return 0, fmt.Errorf("no Udp InCsumErrors in /proc/thread-self/net/snmp")
}

// inputs returns W tensors of n values drawn by gen, and their float64 sum.
func inputs(w, n int, seed uint64, gen func(r *rand.Rand) float32) ([][]float32, []float64) {
	r := rand.New(rand.NewPCG(seed, 42))
	in := make([][]float32, w)
	ref := make([]float64, n)
	for i := range in {
		in[i] = make([]float32, n)
		for j := range in[i] {
			v := gen(r)
			in[i][j] = v
			ref[j] += float64(v)
		}
	}
	return in, ref
}

func uniform(r *rand.Rand) float32 { return float32(r.Float64()*2 - 1) }

// checkFixed checks every worker's result against the reference within the fixed-point bound of
// docs/protocol.md: W * 2^-(e+1) for quantisation plus float32 rounding of the result.
func checkFixed(t *testing.T, got [][]float32, ref []float64, scaleLog2 uint8) {
	t.Helper()
	w := float64(len(got))
	bound := w * math.Ldexp(1, -int(scaleLog2)-1)
	bad := 0
	for i, g := range got {
		for j, v := range g {
			tol := bound + math.Abs(ref[j])*0x1p-23
			if d := math.Abs(float64(v) - ref[j]); d > tol || math.IsNaN(float64(v)) {
				if bad < 5 {
					t.Errorf("worker %d element %d: got %v, want %v ± %g", i, j, v, ref[j], tol)
				}
				bad++
			}
		}
	}
	if bad > 0 {
		t.Fatalf("%d wrong elements", bad)
	}
}

// checkNoHalfSlots fails if any slot is left aggregating after an allreduce: a leaked partial sum.
func checkNoHalfSlots(t *testing.T, m *maps.Maps) {
	t.Helper()
	used, err := m.SlotsInUse()
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range used {
		if s.State != "complete" {
			t.Errorf("slot %d left %s (job %d seq %d, %d/%d)", s.Index, s.State, s.JobID, s.Seq, s.Counter, s.FanIn)
		}
	}
}

func TestAllReduceDense(t *testing.T) {
	sizes := []int{1, K - 1, K, K + 1, 1 << 18 /* 1 MiB */, 1 << 24 /* 64 MiB */}
	for _, w := range []int{2, 4, 8} {
		t.Run(fmt.Sprintf("W=%d", w), func(t *testing.T) {
			b := newBed(t, testbed.Options{Workers: w})
			scale := uint8(24)
			var frags uint64
			before, err := b.Counters()
			if err != nil {
				t.Fatal(err)
			}
			// Back-to-back allreduces on one bed: the pool is reused across them.
			for _, n := range sizes {
				in, ref := inputs(w, n, uint64(w*1000+n), uniform)
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
				took, err := b.AllReduce(ctx, in)
				cancel()
				if err != nil {
					t.Fatalf("n=%d: %v", n, err)
				}
				checkFixed(t, in, ref, scale)
				checkNoHalfSlots(t, b.Switch.Maps)
				frags += uint64((n + K - 1) / K)
				t.Logf("n=%d values: %v", n, took)
			}
			after, err := b.Counters()
			if err != nil {
				t.Fatal(err)
			}
			d := after.Sub(before)
			// How many fragments the switch completes is reported, not asserted: a worker
			// that waits out its retransmit timeout (20 ms; a loaded machine can stall it that
			// long) resends, and a resend flushes a half-filled slot to the PS (ATP), which
			// then completes the fragment: still exact, but not in-switch.
			frac := float64(d[maps.CntCompleted]) / float64(frags)
			t.Logf("fragments %d, completed in-switch %d (%.2f%%), counters %v", frags, d[maps.CntCompleted], 100*frac, d.Map())
			checkEveryResultOnce(t, b, frags, d)
			if d[maps.CntMalformed] != 0 {
				t.Errorf("%d malformed packets on a clean run", d[maps.CntMalformed])
			}
		})
	}
}

// checkEveryResultOnce checks what holds whatever the timing since the bed was made (frags
// fragments, no overflow, switch counters d over the same span): every worker got each fragment's
// result exactly once (repeats count as duplicates), and no fragment completed in-switch twice.
func checkEveryResultOnce(t *testing.T, b *testbed.Bed, frags uint64, d maps.Counters) {
	t.Helper()
	for i, wk := range b.Workers {
		if s := wk.Stats(); s.ResultsReceived != frags || s.Malformed != 0 {
			t.Errorf("worker %d: %d results, %d malformed packets; want %d results: %+v", i, s.ResultsReceived, s.Malformed, frags, s)
		}
	}
	if d[maps.CntCompleted] > frags {
		t.Errorf("completed %d in-switch, more than the %d fragments", d[maps.CntCompleted], frags)
	}
}

// Values that saturate int32 must still come out exact, through the PS's float repair.
func TestAllReduceOverflowRepairedExactly(t *testing.T) {
	const w = 4
	b := newBed(t, testbed.Options{Workers: w})
	cases := []struct {
		name string
		gen  func(r *rand.Rand) float32
	}{
		// Each value fits int32 at 2^24 (< 128) but four of them do not: the switch saturates.
		{"sum saturates", func(r *rand.Rand) float32 { return float32(100 + r.Float64()*20) }},
		// Values that cannot even be quantised: the worker flags its own packet.
		{"value saturates", func(r *rand.Rand) float32 { return float32((r.Float64()*2 - 1) * 1e6) }},
		// Mixed: a few huge values among ordinary ones; the whole fragment is repaired.
		{"some saturate", func(r *rand.Rand) float32 {
			if r.IntN(1000) == 0 {
				return 3e5
			}
			return uniform(r)
		}},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			before, _ := b.Counters()
			n := 5*K + 17
			in, ref := inputs(w, n, uint64(i), c.gen)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			if _, err := b.AllReduce(ctx, in); err != nil {
				t.Fatal(err)
			}
			// A fragment that overflowed anywhere (a value or the sum beyond int32 at scale 2^24,
			// i.e. |x| >= 128) is repaired by the PS and must be exact; others keep the
			// fixed-point bound.
			over := make([]bool, (n+K-1)/K)
			for j := range n {
				if math.Abs(ref[j]) >= 128 {
					over[j/K] = true
				}
			}
			for _, orig := range origs(c.gen, uint64(i), w, n) {
				if math.Abs(float64(orig.v)) >= 128 {
					over[orig.j/K] = true
				}
			}
			bound := w * math.Ldexp(1, -25)
			for wi, g := range in {
				for j, v := range g {
					want := float32(ref[j])
					if over[j/K] {
						if v != want {
							t.Fatalf("worker %d element %d (repaired fragment): got %v, want exactly %v", wi, j, v, want)
						}
					} else if d := math.Abs(float64(v) - ref[j]); d > bound+math.Abs(ref[j])*0x1p-23 {
						t.Fatalf("worker %d element %d: got %v, want %v", wi, j, v, ref[j])
					}
				}
			}
			after, _ := b.Counters()
			d := after.Sub(before)
			if c.name == "sum saturates" && d[maps.CntOverflow] == 0 {
				t.Errorf("no overflow counted in-switch: %v", d.Map())
			}
			var repairs uint64
			for _, wk := range b.Workers {
				repairs += wk.Stats().OverflowRepairs
			}
			if repairs == 0 {
				t.Errorf("no worker repaired an overflow")
			}
			t.Logf("counters %v, repairs %d", d.Map(), repairs)
		})
	}
}

// A switch port whose job has no member gets no result copy; the PS port never gets results.
func TestResultsOnlyToMembers(t *testing.T) {
	b := newBed(t, testbed.Options{Workers: 2})
	in, ref := inputs(2, 3*K, 7, uniform)
	if _, err := b.AllReduce(context.Background(), in); err != nil {
		t.Fatal(err)
	}
	checkFixed(t, in, ref, 24)
	c, _ := b.Counters()
	// Every broadcast of a result goes to all 3 ports (2 workers + PS): a copy out to each
	// worker, none to the PS port. 3 fragments make 3 broadcasts (6 copies out, 3 skipped) when
	// the switch completes them all; a fragment that went through the PS instead (a worker
	// resent after its 20 ms timeout on a loaded machine) can be broadcast once more, with its PS
	// result. Either way: twice as many copies out as skipped, and every fragment broadcast.
	t.Logf("egress tx %d, skip %d; counters %v", c[maps.CntEgressTx], c[maps.CntEgressSkip], c.Map())
	if c[maps.CntEgressSkip] < 3 || c[maps.CntEgressTx] != 2*c[maps.CntEgressSkip] {
		t.Errorf("egress tx %d skip %d, want 2 copies out per copy skipped at the PS port, for at least 3 broadcasts",
			c[maps.CntEgressTx], c[maps.CntEgressSkip])
	}
}

type origVal struct {
	j int
	v float32
}

// origs regenerates the inputs (they were summed in place) and returns every value by element.
func origs(gen func(r *rand.Rand) float32, seed uint64, w, n int) []origVal {
	in, _ := inputs(w, n, seed, gen)
	out := make([]origVal, 0, w*n)
	for _, t := range in {
		for j, v := range t {
			out = append(out, origVal{j, v})
		}
	}
	return out
}

var _ = loader.Config{}

// Larger frames carry more values per packet: at MTU 3388 a fragment holds wire.MaxValues (832),
// still a linear XDP buffer on veth, so the broadcast can clone it.
func TestAllReduceLargeFrames(t *testing.T) {
	const w = 4
	mtu := 20 + 8 + wire.HdrSize + 4*wire.MaxValues
	b := newBed(t, testbed.Options{Workers: w, MTU: mtu})
	k := b.ValuesPerPacket()
	if k != wire.MaxValues {
		t.Fatalf("MTU %d gives %d values per packet, want %d", mtu, k, wire.MaxValues)
	}
	var frags uint64
	for _, n := range []int{1, k - 1, k, k + 1, 1 << 18} {
		in, ref := inputs(w, n, uint64(n), uniform)
		if _, err := b.AllReduce(context.Background(), in); err != nil {
			t.Fatalf("n=%d: %v", n, err)
		}
		checkFixed(t, in, ref, 24)
		frags += uint64((n + k - 1) / k)
	}
	c, _ := b.Counters()
	// All of them in-switch unless a worker timed out and resent (see TestAllReduceDense).
	t.Logf("completed %d of %d fragments in-switch: %v", c[maps.CntCompleted], frags, c.Map())
	checkEveryResultOnce(t, b, frags, c)
}
