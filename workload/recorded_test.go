package workload

import (
	"math"
	"slices"
	"strings"
	"sync"
	"testing"
)

// recordedFile describes a shipped trace (see testdata/README.md) and what it must hold.
type recordedFile struct {
	file             string
	minMean, maxMean float64 // keys per batch
}

var recordedTraces = []recordedFile{
	{"testdata/ctr_w8.trace.gz", 1000, 1050},
	{"testdata/ctr_w8_flat.trace.gz", 500, 580},
}

var loaded sync.Map // file -> *Trace, so that tests share one Load of each file

func load(t *testing.T, file string) *Trace {
	t.Helper()
	if tr, ok := loaded.Load(file); ok {
		return tr.(*Trace)
	}
	tr, err := Load(file)
	if err != nil {
		t.Fatal(err)
	}
	loaded.Store(file, tr)
	return tr
}

func meanKeys(tr *Trace) float64 { return float64(tr.Touches()) / float64(tr.Batches()) }

func TestRecordedTraces(t *testing.T) {
	for _, r := range recordedTraces {
		tr := load(t, r.file)
		if err := tr.Validate(); err != nil {
			t.Errorf("%s: %v", r.file, err)
		}
		if !strings.HasPrefix(tr.Name, "ctr ") || tr.KeySpace != 100_000 || tr.Workers() != 8 || len(tr.Iters) != 200 {
			t.Errorf("%s: %q, key space %d, %d workers, %d iterations; want a ctr trace of 100000 keys, 8 workers, 200 iterations",
				r.file, tr.Name, tr.KeySpace, tr.Workers(), len(tr.Iters))
		}
		if m := meanKeys(tr); m < r.minMean || m > r.maxMean {
			t.Errorf("%s: %.1f keys per batch, want %v..%v", r.file, m, r.minMean, r.maxMean)
		}
		ks := []int{10, 100, 300, 1000, 3000, 10_000}
		t.Logf("%s: %q: %d keys touched, %.1f keys per batch, TopShare(%v) = %.3f",
			r.file, tr.Name, len(tr.Frequency()), meanKeys(tr), ks, tr.TopShares(ks...))
	}
	// The same files, embedded.
	if names := RecordedNames(); !slices.Equal(names, []string{"ctr_w8", "ctr_w8_flat"}) {
		t.Errorf("RecordedNames() = %v", names)
	}
	emb, err := Recorded("ctr_w8")
	if err != nil || !equalTraces(emb, load(t, recordedTraces[0].file)) {
		t.Errorf("Recorded(ctr_w8) differs from the file: %v", err)
	}
}

// TestGeneratorMatchesRecorded fits the generator's exponent (plain Zipf, V = 1) to a recorded
// trace's TopShare(1000) and checks that the fitted law then also gives the recorded TopShare at
// k = 100 and k = 3000, within recordedTolerance. Both sides cover the same window: the first 10
// iterations of the 8 workers, with the recorded mean batch size.
//
// The recorded model's ids follow a Zipf law per field; merged over the fields, the ranks follow
// (v + r)^-s with v about the number of fields, so V = 1 is an approximation at the very head
// only, and the fields' finite vocabularies bend the tail. The measured gaps are 0.001 to 0.010.
func TestGeneratorMatchesRecorded(t *testing.T) {
	const recordedTolerance = 0.03
	const fitK, iters = 1000, 10
	for _, r := range recordedTraces {
		t.Run(r.file, func(t *testing.T) {
			t.Parallel()
			rec, err := load(t, r.file).Slice(8, iters)
			if err != nil {
				t.Fatal(err)
			}
			cfg := GenConfig{
				Workers:      8,
				Iterations:   iters,
				KeysPerBatch: int(math.Round(meanKeys(rec))),
				KeySpace:     rec.KeySpace,
				Seed:         1,
			}
			cfg.Skew, err = Fit(cfg, fitK, rec.TopShare(fitK))
			if err != nil {
				t.Fatal(err)
			}
			gen, err := Generate(cfg)
			if err != nil {
				t.Fatal(err)
			}
			ks := []int{10, 100, 300, fitK, 3000, 10_000}
			want, got := rec.TopShares(ks...), gen.TopShares(ks...)
			t.Logf("fitted s = %.4f for %d keys per batch; TopShare(%v): recorded %.3f, generated %.3f",
				cfg.Skew, cfg.KeysPerBatch, ks, want, got)
			for i, k := range ks {
				if k != 100 && k != 3000 {
					continue
				}
				if d := math.Abs(got[i] - want[i]); d > recordedTolerance {
					t.Errorf("TopShare(%d): generated %.3f, recorded %.3f: off by %.3f > %v", k, got[i], want[i], d, recordedTolerance)
				}
			}
		})
	}
}

// TestRegroupRecorded regroups a recorded 8-worker trace into the worker counts experiments use.
func TestRegroupRecorded(t *testing.T) {
	tr, err := load(t, recordedTraces[0].file).Slice(8, 10)
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range []int{2, 4, 16} {
		r := checkRegroup(t, tr, w)
		t.Logf("8 -> %d workers: %.1f keys per batch, %d of %d touches kept, TopShare(1000) %.3f -> %.3f",
			w, meanKeys(r), r.Touches(), tr.Touches(), tr.TopShare(1000), r.TopShare(1000))
	}
}
