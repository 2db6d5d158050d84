package hostlib

import (
	"context"
	"errors"
	"math/bits"
	"slices"
	"sync"
	"testing"
	"time"
)

// asyncRecord is what one worker saw of one round.
type asyncRecord struct {
	sum, contributed []float32
	bitmaps          []uint32
}

// runAsync trains on every worker of c at once: each computes gradients with grad (from its
// weights' version) in one goroutine, sleeping slow[i] per gradient, while Async.Run goes through
// rounds in another; it returns every worker's records and Async.
func runAsync(t *testing.T, c *cluster, params, rounds, staleness int, slow []time.Duration,
	grad func(worker int, version uint64, g []float32)) ([][]asyncRecord, []*Async) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute) // a hang guard only
	defer cancel()
	recs := make([][]asyncRecord, len(c.workers))
	asyncs := make([]*Async, len(c.workers))
	errs := make([]error, len(c.workers))
	var wg sync.WaitGroup
	for i, w := range c.workers {
		a, err := NewAsync(w, AsyncConfig{Params: params, Staleness: staleness})
		if err != nil {
			t.Fatal(err)
		}
		asyncs[i] = a
		runCtx, stop := context.WithCancel(ctx)
		wg.Add(2)
		go func() { // computes
			defer wg.Done()
			g := make([]float32, params)
			for runCtx.Err() == nil {
				v := a.Version()
				grad(i, v, g)
				time.Sleep(slow[i])
				if err := a.Push(runCtx, g, v); err != nil {
					return
				}
			}
		}()
		go func() { // aggregates and applies
			defer wg.Done()
			defer stop()
			errs[i] = a.Run(ctx, rounds, func(u *AsyncUpdate) {
				r := asyncRecord{sum: slices.Clone(u.Sum), bitmaps: slices.Clone(u.Bitmaps)}
				if u.Contributed != nil {
					r.contributed = slices.Clone(u.Contributed)
				}
				recs[i] = append(recs[i], r)
			})
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("worker %d: %v", i, err)
		}
	}
	return recs, asyncs
}

// checkAsyncRounds checks that every worker applied the same rounds, each fragment's sum exactly
// the sum of the gradients its bitmap names (the values are exact in fixed point), with at least
// h of them.
func checkAsyncRounds(t *testing.T, recs [][]asyncRecord, rounds, k, h int) {
	t.Helper()
	for r := 0; r < rounds; r++ {
		ref := recs[0][r]
		for i := range recs {
			got := recs[i][r]
			if !slices.Equal(got.sum, ref.sum) || !slices.Equal(got.bitmaps, ref.bitmaps) {
				t.Fatalf("round %d: worker %d applied another update than worker 0 (bitmaps %v vs %v)", r, i, got.bitmaps, ref.bitmaps)
			}
		}
		for f, bm := range ref.bitmaps {
			if bits.OnesCount32(bm) < h {
				t.Fatalf("round %d fragment %d: contributors %#b, fewer than H = %d", r, f, bm, h)
			}
			for j := f * k; j < min((f+1)*k, len(ref.sum)); j++ {
				var want float32
				for i := range recs {
					if bm&(1<<i) == 0 {
						continue
					}
					c := recs[i][r].contributed
					if c == nil {
						t.Fatalf("round %d fragment %d names worker %d, which listened", r, f, i)
					}
					want += c[j]
				}
				if ref.sum[j] != want {
					t.Fatalf("round %d value %d: sum %v, the gradients of %#b add up to %v", r, j, ref.sum[j], bm, want)
				}
			}
		}
	}
}

// TestAsyncRounds: three workers, H = 2 at the PS, one of them slow. Every round's update is the
// exact sum of the gradients its bitmaps name (at least H), every worker applies the same updates
// in the same order, and the slow worker contributes to fewer rounds without holding anyone up.
func TestAsyncRounds(t *testing.T) {
	const (
		w      = 3
		h      = 2
		params = 2*K + 17 // three fragments, the last one partial
		rounds = 40
	)
	c := newCluster(t, clusterOpts{w: w, psConfig: func(p *PSConfig) { p.Jobs[0].Threshold = h }})
	grad := func(worker int, version uint64, g []float32) {
		for j := range g {
			// Multiples of 2^-10: every sum is exact in fixed point (scale 2^24) and in float32.
			g[j] = float32((worker+1)*1000+j%97) / 1024
		}
	}
	slow := []time.Duration{time.Millisecond, time.Millisecond, 3 * time.Millisecond}
	recs, asyncs := runAsync(t, c, params, rounds, 4, slow, grad)
	checkAsyncRounds(t, recs, rounds, K, h)
	for i, a := range asyncs {
		st := a.Stats()
		t.Logf("worker %d: %+v", i, st)
		if a.Version() != rounds || st.Rounds != rounds || st.Contributed+st.Listened != rounds {
			t.Errorf("worker %d: version %d, stats %+v", i, a.Version(), st)
		}
	}
	if s := asyncs[2].Stats(); s.Included >= asyncs[0].Stats().Included {
		t.Logf("the slow worker was included as often as a fast one (%d vs %d): possible, if unlikely", s.Included, asyncs[0].Stats().Included)
	}
}

// TestAsyncStaleness: with S = 0 a gradient is used only in the round right after the weights it
// was computed from; a slow worker's older gradients are dropped unsent and counted.
func TestAsyncStaleness(t *testing.T) {
	const w, params, rounds = 3, 10, 30
	c := newCluster(t, clusterOpts{w: w, psConfig: func(p *PSConfig) { p.Jobs[0].Threshold = 2 }})
	grad := func(worker int, version uint64, g []float32) {
		for j := range g {
			g[j] = float32(worker + 1)
		}
	}
	recs, asyncs := runAsync(t, c, params, rounds, 0, []time.Duration{time.Millisecond, time.Millisecond, 5 * time.Millisecond}, grad)
	checkAsyncRounds(t, recs, rounds, K, 2)
	st := asyncs[2].Stats()
	t.Logf("slow worker: %+v", st)
	if st.Stale == 0 {
		t.Errorf("the slow worker dropped no stale gradient: %+v", st)
	}
}

func TestAsyncMisuse(t *testing.T) {
	c := newCluster(t, clusterOpts{w: 1})
	if _, err := NewAsync(c.workers[0], AsyncConfig{Params: 0}); !errors.Is(err, ErrAsync) {
		t.Errorf("Params 0: %v", err)
	}
	if _, err := NewAsync(c.workers[0], AsyncConfig{Params: 3, Staleness: -1}); !errors.Is(err, ErrAsync) {
		t.Errorf("Staleness -1: %v", err)
	}
	a, err := NewAsync(c.workers[0], AsyncConfig{Params: 3})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Push(context.Background(), make([]float32, 4), 0); !errors.Is(err, ErrAsync) {
		t.Errorf("gradient of the wrong size: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := a.Push(ctx, make([]float32, 3), 0); err != nil {
		t.Fatal(err)
	}
	if err := a.Push(ctx, make([]float32, 3), 0); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("second Push with the first still pending: %v, want it to wait until ctx ends", err)
	}
}
