package workload

import (
	"flag"
	"math"
	"testing"
)

var refit = flag.Bool("workload.refit", false, "refit every ZebraPoints Skew (slow) and print them")

// TestZebraPoints checks every preset against its data point on a trace of another seed than the
// one its Skew was fitted with: the share must hold for the law, not for one draw of it.
func TestZebraPoints(t *testing.T) {
	for _, p := range ZebraPoints {
		t.Run(p.Name, func(t *testing.T) {
			t.Parallel()
			tr, err := Generate(p.Config(PointFitSeed + 1))
			if err != nil {
				t.Fatal(err)
			}
			got := tr.TopShare(p.K)
			t.Logf("%s: %d keys, s=%v v=%v, %d keys per batch: TopShare(%d) = %.3f (paper %.2f at k=%d of %d)",
				p.Name, p.KeySpace, p.Skew, p.V, p.KeysPerBatch, p.K, got, p.Share, p.PaperK, p.PaperKeySpace)
			if math.Abs(got-p.Share) > 0.05 {
				t.Errorf("TopShare(%d) = %.3f, want %.2f ± 0.05", p.K, got, p.Share)
			}
			if p.KeySpace*uint64(p.PaperK) != p.PaperKeySpace*uint64(p.K) {
				t.Errorf("key space and k are not scaled alike")
			}
		})
	}
}

// TestZebraPointsRefit checks that Fit gives back the Skew of a preset. It refits the cheapest
// preset, or all of them with -workload.refit, printing the values to paste into ZebraPoints.
func TestZebraPointsRefit(t *testing.T) {
	for _, p := range ZebraPoints {
		if !*refit && p.Name != "NCF-100" {
			continue
		}
		s, err := Fit(p.Config(PointFitSeed), p.K, p.Share)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: Skew: %.4f", p.Name, s)
		if math.Abs(s-p.Skew) > 0.0005 {
			t.Errorf("%s: Fit gives s=%.4f, ZebraPoints has %v", p.Name, s, p.Skew)
		}
	}
}
