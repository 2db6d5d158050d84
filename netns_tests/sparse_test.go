package netns_tests

// End-to-end tests of sparse (hot-parameter) aggregation: workers in their own namespaces push
// <key, value> gradients, hot keys are summed in the XDP switch's registers, cold keys at the
// PS, and every worker's update is checked key by key against the exact sums.

import (
	"cmp"
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/hostlib"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/netns_tests/testbed"
	"github.com/xdpagg/xdpagg/netns_tests/topo"
	"github.com/xdpagg/xdpagg/sparse"
)

// sparseKeys is one iteration's gradients of w workers: each touches n keys of a Zipf-skewed key
// space, so the low keys are hot (touched by most workers in most iterations). Values are
// multiples of 2^-10 in [-4, 4): the fixed point (scale >= 10) carries them exactly, so every
// sum must equal float32 of the exact real sum.
func sparseKeys(rng *rand.Rand, w, n int, space uint64) ([][]uint64, [][]float32) {
	z := rand.NewZipf(rng, 1.2, 1, space-1)
	keys := make([][]uint64, w)
	vals := make([][]float32, w)
	for i := range w {
		seen := map[uint64]bool{}
		for len(keys[i]) < n {
			k := z.Uint64()
			if !seen[k] {
				seen[k] = true
				keys[i] = append(keys[i], k)
				vals[i] = append(vals[i], float32(rng.IntN(8192)-4096)/1024)
			}
		}
	}
	return keys, vals
}

// expectUpdates checks every worker's update: exactly the keys any worker touched, each with the
// float32 of its exact sum.
func expectUpdates(t *testing.T, iter uint32, keys [][]uint64, vals [][]float32, ups []hostlib.Update) {
	t.Helper()
	sum := map[uint64]float64{}
	for i := range keys {
		for j, k := range keys[i] {
			sum[k] += float64(vals[i][j]) // exact: few multiples of 2^-10
		}
	}
	want := make([]uint64, 0, len(sum))
	for k := range sum {
		want = append(want, k)
	}
	slices.Sort(want)
	for w, up := range ups {
		// An update comes in no particular order: sort it by key.
		idx := make([]int, len(up.Keys))
		for i := range idx {
			idx[i] = i
		}
		slices.SortFunc(idx, func(a, b int) int { return cmp.Compare(up.Keys[a], up.Keys[b]) })
		keys, vals := make([]uint64, len(idx)), make([]float32, len(idx))
		for i, x := range idx {
			keys[i], vals[i] = up.Keys[x], up.Vals[x]
		}
		up.Keys, up.Vals = keys, vals
		if up.Iteration != iter || !slices.Equal(up.Keys, want) {
			t.Fatalf("worker %d iteration %d: update of %d keys, want %d (iteration %d)", w, iter, len(up.Keys), len(want), up.Iteration)
		}
		for i, k := range up.Keys {
			if up.Vals[i] != float32(sum[k]) {
				t.Fatalf("worker %d iteration %d key %d: %v, want %v", w, iter, k, up.Vals[i], float32(sum[k]))
			}
		}
	}
}

// hotSetOf ranks the keys [0, k) by their Zipf order (key 0 hottest), with version v; rotate
// moves the ranking by r places, for a swap that changes every rank.
func hotSetOf(t *testing.T, v uint32, k int, rotate int) *sparse.HotSet {
	t.Helper()
	r := make(sparse.Ranking, k)
	for i := range r {
		r[i] = uint64((i + rotate) % k)
	}
	h, err := sparse.NewHotSet(v, r)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

func newSparseBed(t *testing.T, workers int, specs ...testbed.SparseJobSpec) *testbed.Bed {
	t.Helper()
	b, err := testbed.New(testbed.Options{Prefix: topo.NewPrefix(), Workers: workers,
		Switch: loader.Config{PoolSize: 512, RegArrays: 32, RegSlots: 256}})
	if err != nil {
		t.Fatalf("testbed: %v", err)
	}
	t.Cleanup(func() {
		if err := b.Close(); err != nil {
			t.Errorf("close testbed: %v", err)
		}
	})
	if err := b.StartSparse(specs...); err != nil {
		t.Fatalf("start sparse jobs: %v", err)
	}
	return b
}

// runSparse steps a job through iterations [first, first+n) with fresh gradients and checks
// every update.
func runSparse(ctx context.Context, t *testing.T, j *testbed.SparseJob, first uint32, n int, seed uint64) {
	t.Helper()
	rng := rand.New(rand.NewPCG(seed, uint64(j.Spec.ID)))
	for it := first; it < first+uint32(n); it++ {
		keys, vals := sparseKeys(rng, len(j.Workers), 300, 20000)
		ups, err := j.Step(ctx, it, keys, vals)
		if err != nil {
			t.Fatal(err)
		}
		expectUpdates(t, it, keys, vals, ups)
	}
}

func TestSparseExact(t *testing.T) {
	hot := hotSetOf(t, 1, 2048, 0)
	b := newSparseBed(t, 4, testbed.SparseJobSpec{ID: 31, Hosts: []int{0, 1, 2, 3}, Arrays: 16, Hot: hot})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	j := b.SparseJob(31)
	runSparse(ctx, t, j, 1, 40, 1)

	// A hot-set swap at an iteration boundary: the PS learns the new version first, then every
	// worker switches for the same iteration. Every rank now means another key.
	next := hotSetOf(t, 2, 2048, 1000)
	if err := b.SparsePS.AddHot(31, next); err != nil {
		t.Fatal(err)
	}
	for _, w := range j.Workers {
		w.SetHot(next)
	}
	runSparse(ctx, t, j, 41, 20, 2)

	c, err := b.Counters()
	if err != nil {
		t.Fatal(err)
	}
	st := b.SparsePS.Stats()
	hist, err := b.Switch.Maps.RecircHistogram()
	if err != nil {
		t.Fatal(err)
	}
	var ws hostlib.SparseStats
	for _, w := range j.Workers {
		s := w.Stats()
		ws.HotPairs += s.HotPairs
		ws.ColdPairs += s.ColdPairs
		ws.HotPackets += s.HotPackets
	}
	t.Logf("worker pairs hot/cold %d/%d in %d hot packets; switch summed %d pairs, %d iterations done, %d recirculations, %d spilled; histogram %v; PS %+v",
		ws.HotPairs, ws.ColdPairs, ws.HotPackets, c[mapsCnt("sparse_pairs")], c[mapsCnt("sparse_done")], c[mapsCnt("recirculated")],
		c[mapsCnt("sparse_spilled")], hist, st)
	if c[mapsCnt("sparse_pairs")] == 0 || c[mapsCnt("sparse_done")] != 60 {
		t.Errorf("the switch summed %d hot pairs and completed %d of 60 iterations", c[mapsCnt("sparse_pairs")], c[mapsCnt("sparse_done")])
	}
}

// TestSparseLossAndDuplication: 1% loss and 1% duplication on every worker link, both ways.
func TestSparseLossAndDuplication(t *testing.T) {
	hot := hotSetOf(t, 1, 1024, 0)
	b := newSparseBed(t, 3, testbed.SparseJobSpec{ID: 32, Hosts: []int{0, 1, 2}, Arrays: 8, Hot: hot, Timeout: 10 * time.Millisecond})
	for _, h := range b.Topo.Workers {
		for _, d := range []topo.Direction{topo.ToSwitch, topo.FromSwitch} {
			if err := b.Topo.Impair(h, d, topo.Impairment{Loss: 1, Duplicate: 1}); err != nil {
				t.Fatal(err)
			}
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	j := b.SparseJob(32)
	runSparse(ctx, t, j, 100, 60, 3)
	var resends uint64
	for _, w := range j.Workers {
		resends += w.Stats().Resends
	}
	c, _ := b.Counters()
	t.Logf("resends %d; switch duplicates %d; PS %+v", resends, c[mapsCnt("duplicate")], b.SparsePS.Stats())
}

// TestSparseSharing: two sparse jobs (each with its own register arrays and hot set) and the dense job share
// the switch, at the same time.
func TestSparseSharing(t *testing.T) {
	b := newSparseBed(t, 4,
		testbed.SparseJobSpec{ID: 33, Hosts: []int{0, 1, 2}, Arrays: 8, Hot: hotSetOf(t, 1, 1024, 0)},
		testbed.SparseJobSpec{ID: 34, Hosts: []int{1, 2, 3}, Arrays: 8, Hot: hotSetOf(t, 7, 1024, 5)},
	)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	errs := make(chan error, 3)
	for _, id := range []uint32{33, 34} {
		go func() {
			ok := t.Run(fmt.Sprintf("job %d", id), func(t *testing.T) { runSparse(ctx, t, b.SparseJob(id), 1, 30, uint64(id)) })
			if !ok {
				errs <- fmt.Errorf("sparse job %d failed", id)
				return
			}
			errs <- nil
		}()
	}
	go func() {
		rng := rand.New(rand.NewPCG(5, 6))
		for range 20 {
			in := make([][]float32, len(b.Workers))
			want := make([]float32, 5000)
			for i := range in {
				in[i] = make([]float32, len(want))
				for k := range in[i] {
					in[i][k] = float32(rng.IntN(2048)-1024) / 256
					want[k] += in[i][k]
				}
			}
			if _, err := b.AllReduce(ctx, in); err != nil {
				errs <- fmt.Errorf("dense job: %w", err)
				return
			}
			for i := range in {
				for k := range want {
					if math.Abs(float64(in[i][k]-want[k])) > 1e-3 {
						errs <- fmt.Errorf("dense job worker %d value %d: %v, want %v", i, k, in[i][k], want[k])
						return
					}
				}
			}
		}
		errs <- nil
	}()
	for range 3 {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
}

// mapsCnt is a switch counter by its name.
func mapsCnt(name string) maps.Counter {
	for i := range maps.NumCounters {
		if maps.CounterName(maps.Counter(i)) == name {
			return maps.Counter(i)
		}
	}
	panic("no counter " + name)
}

// TestSparseOnlineSwap: the job starts with a hot set of keys nobody touches; the PS's online
// identification (every 10 iterations, from its cold counts and the switch's register counters)
// proposes the real hot keys, and the scheduler (this test) swaps at an iteration boundary.
// Every update stays exact across the swap, and afterwards most pairs go to the switch.
func TestSparseOnlineSwap(t *testing.T) {
	wrong := make(sparse.Ranking, 1024)
	for i := range wrong {
		wrong[i] = uint64(1_000_000 + i)
	}
	hot, err := sparse.NewHotSet(1, wrong)
	if err != nil {
		t.Fatal(err)
	}
	online := &sparse.Online{Period: 10, Threshold: 0.2}
	b := newSparseBed(t, 3, testbed.SparseJobSpec{ID: 35, Hosts: []int{0, 1, 2}, Arrays: 8, Hot: hot, Online: online})
	j := b.SparseJob(35)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rng := rand.New(rand.NewPCG(35, 36))
	swappedAt := uint32(0)
	hotBefore := uint64(0)
	for it := uint32(1); it <= 40; it++ {
		if pr, ok := b.SparsePS.Proposal(35); ok && swappedAt == 0 {
			if err := b.SparsePS.AddHot(35, pr.Hot); err != nil {
				t.Fatal(err)
			}
			for _, w := range j.Workers {
				w.SetHot(pr.Hot)
				hotBefore += w.Stats().HotPairs
			}
			swappedAt = it
			t.Logf("swap to version %d at iteration %d (Kendall tau distance %.2f, proposed after iteration %d)", pr.Hot.Version, it, pr.Distance, pr.Iteration)
		}
		keys, vals := sparseKeys(rng, len(j.Workers), 300, 20000)
		ups, err := j.Step(ctx, it, keys, vals)
		if err != nil {
			t.Fatal(err)
		}
		expectUpdates(t, it, keys, vals, ups)
	}
	if swappedAt == 0 {
		t.Fatal("the PS never proposed a swap")
	}
	var hotAfter, cold uint64
	for _, w := range j.Workers {
		hotAfter += w.Stats().HotPairs
		cold += w.Stats().ColdPairs
	}
	hotAfter -= hotBefore
	if hotBefore != 0 || hotAfter == 0 {
		t.Errorf("hot pairs before the swap %d, after %d", hotBefore, hotAfter)
	}
	t.Logf("hot pairs after the swap: %d of %d", hotAfter, hotAfter+cold)
}
