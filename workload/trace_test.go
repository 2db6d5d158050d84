package workload

import (
	"errors"
	"maps"
	"math"
	"slices"
	"testing"
)

// small is a hand-made trace: 2 iterations of 3 workers over 10 keys. Key 1 is in 5 batches, key 2
// in 3, keys 3 and 4 in 2, keys 5 to 9 in 1: 18 touches.
func small() *Trace {
	return &Trace{Name: "small", KeySpace: 10, Iters: [][][]uint64{
		{{1, 2, 3}, {1, 2, 4}, {1, 5}},
		{{1, 3, 6}, {1, 2, 4, 7}, {8, 9}},
	}}
}

func TestFrequencyAndTopShare(t *testing.T) {
	tr := small()
	if tr.Workers() != 3 || tr.Batches() != 6 || tr.Touches() != 17 {
		t.Fatalf("Workers, Batches, Touches = %d, %d, %d; want 3, 6, 17", tr.Workers(), tr.Batches(), tr.Touches())
	}
	want := map[uint64]uint64{1: 5, 2: 3, 3: 2, 4: 2, 5: 1, 6: 1, 7: 1, 8: 1, 9: 1}
	if got := tr.Frequency(); !maps.Equal(got, want) {
		t.Errorf("Frequency = %v, want %v", got, want)
	}
	for k, share := range map[int]float64{-1: 0, 0: 0, 1: 5. / 17, 2: 8. / 17, 4: 12. / 17, 9: 1, 100: 1} {
		if got := tr.TopShare(k); math.Abs(got-share) > 1e-12 {
			t.Errorf("TopShare(%d) = %v, want %v", k, got, share)
		}
	}
	if got := tr.TopShares(1, 4); got[0] != tr.TopShare(1) || got[1] != tr.TopShare(4) {
		t.Errorf("TopShares(1, 4) = %v, want TopShare's", got)
	}
	if got, want := tr.TopKeys(4), []uint64{1, 2, 3, 4}; !slices.Equal(got, want) {
		t.Errorf("TopKeys(4) = %v, want %v (ties by smaller key)", got, want)
	}
	if got := (&Trace{}).TopShare(5); got != 0 {
		t.Errorf("TopShare of an empty trace = %v, want 0", got)
	}
	// The map path for key spaces too large to count densely gives the same shares.
	big := small()
	big.KeySpace = denseLimit + 1
	for k := range 10 {
		if big.TopShare(k) != tr.TopShare(k) {
			t.Errorf("TopShare(%d) differs between dense and map counting", k)
		}
	}
}

func TestSlice(t *testing.T) {
	tr := small()
	s, err := tr.Slice(2, 1)
	if err != nil {
		t.Fatal(err)
	}
	want := &Trace{Name: "small", KeySpace: 10, Iters: [][][]uint64{{{1, 2, 3}, {1, 2, 4}}}}
	if !equalTraces(s, want) {
		t.Errorf("Slice(2, 1) = %v, want %v", s.Iters, want.Iters)
	}
	if s, err := tr.Slice(3, 0); err != nil || len(s.Iters) != 0 {
		t.Errorf("Slice(3, 0) = %v, %v; want an empty trace", s, err)
	}
	for _, a := range [][2]int{{0, 1}, {4, 1}, {1, -1}, {1, 3}} {
		if _, err := tr.Slice(a[0], a[1]); !errors.Is(err, ErrInvalid) {
			t.Errorf("Slice(%d, %d): %v, want ErrInvalid", a[0], a[1], err)
		}
	}
}

// multiset returns, per iteration, how many batches touch each key.
func multiset(tr *Trace) []map[uint64]int {
	out := make([]map[uint64]int, len(tr.Iters))
	for i, it := range tr.Iters {
		out[i] = make(map[uint64]int)
		for _, b := range it {
			for _, k := range b {
				out[i][k]++
			}
		}
	}
	return out
}

// checkRegroup checks Regroup(workers) of tr against the promise of its documentation: each key
// of each iteration keeps min(m, workers) of its m touches.
func checkRegroup(t *testing.T, tr *Trace, workers int) *Trace {
	t.Helper()
	r, err := tr.Regroup(workers)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Validate(); err != nil {
		t.Fatalf("Regroup(%d): %v", workers, err)
	}
	if r.Workers() != workers || len(r.Iters) != len(tr.Iters) || r.KeySpace != tr.KeySpace {
		t.Fatalf("Regroup(%d) has %d workers, %d iterations", workers, r.Workers(), len(r.Iters))
	}
	before, after := multiset(tr), multiset(r)
	for i := range before {
		for k, m := range before[i] {
			if got := after[i][k]; got != min(m, workers) {
				t.Fatalf("Regroup(%d): iteration %d key %d touched %d times, want min(%d, %d)", workers, i, k, got, m, workers)
			}
		}
		if len(after[i]) != len(before[i]) {
			t.Fatalf("Regroup(%d): iteration %d gained keys", workers, i)
		}
	}
	return r
}

func TestRegroup(t *testing.T) {
	tr := small()
	// Into 2: batches 0 and 2 go to worker 0, batch 1 to worker 1. In iteration 0, key 1 of batch
	// 2 finds worker 0 holding it and moves to worker 1, which holds it too (batch 1): dropped,
	// since 3 touches can't fit in 2 workers.
	r := checkRegroup(t, tr, 2)
	want := [][][]uint64{
		{{1, 2, 3, 5}, {1, 2, 4}},
		{{1, 3, 6, 8, 9}, {1, 2, 4, 7}},
	}
	if !equalTraces(r, &Trace{Name: "small", KeySpace: 10, Iters: want}) {
		t.Errorf("Regroup(2) = %v, want %v", r.Iters, want)
	}
	checkRegroup(t, tr, 1)
	if r := checkRegroup(t, tr, 3); !equalTraces(r, tr) {
		t.Errorf("Regroup to the same worker count changed the trace: %v", r.Iters)
	}
	// Into 7: batch 0 splits over workers 0, 3 and 6, batches 1 and 2 over two workers each.
	r = checkRegroup(t, tr, 7)
	want0 := [][]uint64{{1}, {1, 4}, {1}, {2}, {2}, {5}, {3}}
	if !slices.EqualFunc(r.Iters[0], want0, func(a, b []uint64) bool { return slices.Equal(a, b) }) {
		t.Errorf("Regroup(7) iteration 0 = %v, want %v", r.Iters[0], want0)
	}
	// Regrouping never shares memory with the original.
	r.Iters[0][0][0] = 9
	if tr.Iters[0][0][0] != 1 {
		t.Error("Regroup's result shares a batch with the original")
	}
	for _, w := range []int{0, -1, MaxWorkers + 1} {
		if _, err := tr.Regroup(w); !errors.Is(err, ErrInvalid) {
			t.Errorf("Regroup(%d): %v, want ErrInvalid", w, err)
		}
	}
	if r, err := (&Trace{KeySpace: 5}).Regroup(4); err != nil || len(r.Iters) != 0 {
		t.Errorf("Regroup of an empty trace: %v, %v", r, err)
	}
}

func TestRegroupGenerated(t *testing.T) {
	tr, err := Generate(GenConfig{Workers: 8, Iterations: 6, KeysPerBatch: 300, KeySpace: 5000, Skew: 1.3, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range []int{1, 2, 3, 4, 8, 12, 16, 33} {
		checkRegroup(t, tr, w)
	}
}

func TestValidate(t *testing.T) {
	if err := small().Validate(); err != nil {
		t.Errorf("Validate(small) = %v", err)
	}
	if err := (&Trace{}).Validate(); err != nil {
		t.Errorf("Validate of the empty trace = %v", err)
	}
}
