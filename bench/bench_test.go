package bench

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
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
	// The CPU split is there for every mode that has one (its size is not checked: a figure).
	for _, c := range rep.Cells {
		switch {
		case c.WorkerCPUPerGB == nil:
			t.Errorf("%s W=%d %dB: no worker-side CPU", c.Mode, c.Workers, c.Bytes)
		case c.Mode == ModeXdpagg && c.SwitchCPUPerGB == nil:
			t.Errorf("xdpagg W=%d %dB: no switch-side CPU (notes: %v)", c.Workers, c.Bytes, rep.Notes)
		}
	}
	for _, m := range AllModes {
		if rep.Environments[m] == "" {
			t.Errorf("no environment reported for %s", m)
		}
	}
	png := filepath.Join(t.TempDir(), "bench.png")
	if err := rep.Plot(png); err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(png); err != nil || st.Size() == 0 {
		t.Errorf("plot not written: %v", err)
	}
}

// The loss cost runs its pairs on a testbed with loss injected and verifies every result; only
// the shape of the report is checked, never the ratio.
func TestLossCostReports(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	res, err := LossCost(ctx, LossCostOptions{Workers: 2, Bytes: 400 << 10, Pairs: 3, Loss: 1})
	if errors.Is(err, ebpf.ErrNotSupported) {
		t.Skipf("kernel lacks a feature (ebpf.ErrNotSupported): %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Ratios) != 3 || res.Median <= 0 || res.P10 > res.Median || res.Median > res.P90 ||
		res.CleanMedian <= 0 || res.LossyMedian <= 0 {
		t.Errorf("loss cost %+v", res)
	}
	var b strings.Builder
	res.Table(&b)
	if !strings.Contains(b.String(), "lossy/clean") {
		t.Errorf("table %q", b.String())
	}
	if _, err := LossCost(ctx, LossCostOptions{Pairs: -1}); !errors.Is(err, ErrConfig) {
		t.Errorf("pairs -1: %v, want ErrConfig", err)
	}
}

func TestOptionsValidate(t *testing.T) {
	for name, o := range map[string]Options{
		"mode":    {Modes: []string{"nccl"}},
		"size":    {Bytes: []int{6}},
		"workers": {Workers: []int{1}},
		"mtu":     {MTU: 9000},
		"rate":    {LinkRates: []uint64{1000}},
	} {
		if err := o.withDefaults().Validate(); !errors.Is(err, ErrConfig) {
			t.Errorf("%s: %v, want ErrConfig", name, err)
		}
	}
}

// Profile refuses what it cannot run before building anything.
func TestProfileOptionErrors(t *testing.T) {
	for name, o := range map[string]ProfileOptions{
		"size":    {Bytes: 6},
		"workers": {Workers: 33},
		"mtu":     {MTU: 9000},
		"count":   {Allreduces: -1},
	} {
		if _, err := Profile(context.Background(), o); !errors.Is(err, ErrConfig) {
			t.Errorf("%s: Profile(%+v) = %v, want ErrConfig", name, o, err)
		}
	}
}

// A small profile runs end to end: every allreduce verified, the programs' run counts those of
// the packets sent (every DATA packet through the switch; one egress run per port per result),
// the Go profile hooks called around the timed part only. No timing is asserted.
func TestProfileSmall(t *testing.T) {
	var ready, done int
	res, err := Profile(context.Background(), ProfileOptions{Workers: 2, Bytes: 40 << 10, Allreduces: 3,
		Ready: func() { ready++ }, Done: func() { done++ }})
	if errors.Is(err, ebpf.ErrNotSupported) {
		t.Skipf("kernel lacks a feature (ebpf.ErrNotSupported): %v", err)
	}
	if err != nil {
		t.Fatalf("Profile: %v", err)
	}
	t.Logf("%+v", res)
	if ready != 1 || done != 1 {
		t.Errorf("Ready called %d times, Done %d; want 1 each", ready, done)
	}
	if want := (10240 + 831) / 832; res.PacketsPerWorker != want {
		t.Errorf("PacketsPerWorker %d, want %d", res.PacketsPerWorker, want)
	}
	runs := map[string]float64{}
	for _, p := range res.BPF {
		runs[p.Name] = p.RunsPerAllreduce
	}
	// Every DATA packet runs the switch; each result goes to the 2 workers' and the PS's ports.
	if data := float64(2 * res.PacketsPerWorker); runs["xdpagg_switch"] < data || runs["xdpagg_egress"] < 3*data/2 {
		t.Errorf("BPF runs per allreduce %v: want at least %v switch runs and %v egress runs", runs, data, 3*data/2)
	}
}
