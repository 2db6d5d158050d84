package hostlib

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"testing"
	"time"
)

// newDirectCluster is a PS in Direct mode and w workers of one job on loopback, with no switch:
// the PS answers every worker itself.
func newDirectCluster(t testing.TB, w, shards int) *cluster {
	t.Helper()
	c := &cluster{psErr: make(chan error, 1)}
	listen := netip.AddrPortFrom(loopback, freePort(t))
	job := PSJob{ID: 7}
	for i := 0; i < w; i++ {
		wk, err := NewWorker(WorkerConfig{JobID: 7, WorkerID: uint8(i), NumWorkers: uint8(w),
			Local: netip.AddrPortFrom(loopback, 0), PS: listen})
		if err != nil {
			t.Fatal(err)
		}
		c.workers = append(c.workers, wk)
		job.Workers = append(job.Workers, wk.LocalAddr())
	}
	ps, err := NewPS(PSConfig{Listen: listen, Direct: true, Shards: shards, Jobs: []PSJob{job}})
	if err != nil {
		for _, w := range c.workers {
			w.Close()
		}
		t.Fatal(err)
	}
	c.ps = ps
	ctx, cancel := context.WithCancel(context.Background())
	go func() { c.psErr <- ps.Serve(ctx) }()
	t.Cleanup(func() {
		for _, w := range c.workers {
			if err := w.Close(); err != nil {
				t.Errorf("close worker: %v", err)
			}
		}
		cancel()
		if err := <-c.psErr; !errors.Is(err, context.Canceled) {
			t.Errorf("Serve returned %v, want context.Canceled", err)
		}
		if err := ps.Close(); err != nil {
			t.Errorf("close PS: %v", err)
		}
	})
	return c
}

func TestPSDirect(t *testing.T) {
	const w = 4
	for _, shards := range []int{1, 4} {
		t.Run(fmt.Sprintf("shards=%d", shards), func(t *testing.T) {
			c := newDirectCluster(t, w, shards)
			sizes := []int{1, 361, 100000}
			for round := 0; round < 2; round++ {
				for _, n := range sizes {
					in, ref := tensors(w, n, uint64(10*n+round), uniform)
					ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
					err := c.allReduce(ctx, in)
					cancel()
					if err != nil {
						t.Fatalf("n=%d: %v", n, err)
					}
					checkBound(t, in, ref, DefaultScaleLog2)
				}
			}
			k := c.workers[0].Config().ValuesPerPacket
			var frags uint64
			for _, n := range sizes {
				frags += 2 * uint64((n+k-1)/k)
			}
			for i, wk := range c.workers {
				s := wk.Stats()
				if s.ResultsReceived != frags || s.ResultsFromPS != frags || s.Malformed != 0 {
					t.Errorf("worker %d: %+v, want %d results, all from the PS", i, s, frags)
				}
			}
			if s := c.ps.Stats(); s.Completed != frags || s.Malformed != 0 || s.Unaddressed != 0 || s.Dropped != 0 {
				t.Errorf("PS: %+v, want %d completed", s, frags)
			}
		})
	}
}

// Direct mode needs no switch address.
func TestPSDirectConfig(t *testing.T) {
	c := PSConfig{Listen: netip.MustParseAddrPort("10.0.0.2:9511"), Direct: true, Open: true}.WithDefaults()
	if err := c.Validate(); err != nil {
		t.Fatalf("Direct without Switch: %v", err)
	}
	c.Direct = false
	if err := c.Validate(); !errors.Is(err, ErrConfig) {
		t.Fatalf("no Switch and not Direct: %v, want ErrConfig", err)
	}
}

// BenchmarkPSDirect measures loopback throughput of W workers through a Direct PS: 1 Mi values
// each.
func BenchmarkPSDirect(b *testing.B) {
	for _, w := range []int{1, 4} {
		b.Run(fmt.Sprintf("W=%d", w), func(b *testing.B) {
			c := newDirectCluster(b, w, 0)
			benchAllReduce(b, w, c.allReduce)
		})
	}
}
