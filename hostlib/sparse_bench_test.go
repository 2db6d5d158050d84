package hostlib

import (
	"errors"
	"testing"

	"github.com/xdpagg/xdpagg/sparse"
	"github.com/xdpagg/xdpagg/workload"
)

// BenchmarkSparseBuild measures a worker's packing of one iteration of the recorded trace (W=4):
// hot-set lookups, Algorithm 1 and packet encoding.
func BenchmarkSparseBuild(b *testing.B) {
	full, err := workload.Recorded("ctr_w8")
	if err != nil {
		b.Fatal(err)
	}
	tr, err := full.Regroup(4)
	if err != nil {
		b.Fatal(err)
	}
	r := sparse.SampledRanking(full.Iters, 0.08, 1)
	hot, err := sparse.NewHotSet(1, r[:6529])
	if err != nil {
		b.Fatal(err)
	}
	for _, c := range []struct {
		name string
		hot  *sparse.HotSet
	}{{"hot", hot}, {"ps-only", nil}} {
		b.Run(c.name, func(b *testing.B) {
			w := &SparseWorker{cfg: SparseWorkerConfig{JobID: 1, NumWorkers: 4, Hot: c.hot, Arrays: 256, ScaleLog2: 24, MTU: 1500}.WithDefaults(), bound: 1 << 28}
			keys := tr.Iters[0][0]
			vals := workload.Values(0, 0, keys, 1)
			b.ReportAllocs()
			for b.Loop() {
				if _, err := w.build(1, keys, vals); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func TestSparseBuildRefusesDuplicateKeys(t *testing.T) {
	w := &SparseWorker{cfg: SparseWorkerConfig{JobID: 1, NumWorkers: 2, ScaleLog2: 24, MTU: 1500}.WithDefaults(), bound: 1 << 28}
	for _, keys := range [][]uint64{{1, 2, 2, 3}, {5, 1, 5}} {
		if _, err := w.build(1, keys, make([]float32, len(keys))); !errors.Is(err, ErrConfig) {
			t.Errorf("keys %v: %v, want ErrConfig", keys, err)
		}
	}
	for _, keys := range [][]uint64{{1, 2, 3}, {3, 1, 2}, nil} {
		if _, err := w.build(1, keys, make([]float32, len(keys))); err != nil {
			t.Errorf("keys %v: %v", keys, err)
		}
	}
}
