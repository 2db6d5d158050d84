package bench

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cilium/ebpf"
)

// Every mode must return correct sums (the benchmark verifies its first round of each cell);
// this runs the whole pipeline small and checks the report, never the timings.
func TestEveryModeSumsCorrectly(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	rep, err := Run(ctx, Options{Workers: []int{2}, Bytes: []int{4, 1444, 40 << 10}, Rounds: 2})
	if errors.Is(err, ebpf.ErrNotSupported) {
		t.Skipf("kernel lacks a feature (ebpf.ErrNotSupported): %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Cells) != len(AllModes)*3 {
		t.Fatalf("%d cells, want %d", len(rep.Cells), len(AllModes)*3)
	}
	for _, c := range rep.Cells {
		if c.Error != "" || !c.Verified || len(c.Seconds) != 2 || c.Median <= 0 {
			t.Errorf("%s W=%d %dB: error %q verified %v rounds %d", c.Mode, c.Workers, c.Bytes, c.Error, c.Verified, len(c.Seconds))
		}
	}
	if len(rep.Ratios) == 0 {
		t.Error("no ratios")
	}
	png := filepath.Join(t.TempDir(), "bench.png")
	if err := rep.Plot(png); err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(png); err != nil || st.Size() == 0 {
		t.Errorf("plot not written: %v", err)
	}
}

func TestOptionsValidate(t *testing.T) {
	for name, o := range map[string]Options{
		"mode":    {Modes: []string{"nccl"}},
		"size":    {Bytes: []int{6}},
		"workers": {Workers: []int{1}},
		"mtu":     {MTU: 9000},
	} {
		if err := o.withDefaults().Validate(); !errors.Is(err, ErrConfig) {
			t.Errorf("%s: %v, want ErrConfig", name, err)
		}
	}
}
