//go:build linux

package capacity

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/xdpagg/xdpagg/wire"
)

func TestMeasure(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	r, err := Measure(ctx, Options{Duration: 200 * time.Millisecond})
	if errors.Is(err, ebpf.ErrNotSupported) {
		t.Skipf("kernel lacks a feature (ebpf.ErrNotSupported): %v", err)
	}
	if err != nil {
		t.Fatalf("Measure: %v", err)
	}
	var b strings.Builder
	r.Table(&b)
	t.Logf("\n%s", b.String())

	for name, v := range map[string]float64{
		"AggPPS": r.AggPPS, "AggElementsPerSec": r.AggElementsPerSec, "TxPPS": r.TxPPS,
		"GenTxPPS": r.GenTxPPS, "HostRxPPS": r.HostRxPPS, "CeilingPPS": r.CeilingPPS,
	} {
		if !(v > 0) {
			t.Errorf("%s = %v, want > 0", name, v)
		}
	}
	if !(r.Ratio > 0 && r.Ratio < 10) {
		t.Errorf("Ratio = %v, want in (0, 10)", r.Ratio)
	}
	// The fraction of the ceiling is a report (timing never decides a test): only its definition.
	if got, want := r.OfCeiling, r.AggPPS/r.CeilingPPS; got != want {
		t.Errorf("OfCeiling = %v, want AggPPS / CeilingPPS = %v", got, want)
	}
	if got, want := r.CeilingElementsPerSec, r.CeilingPPS*float64(r.Options.Values); got != want {
		t.Errorf("CeilingElementsPerSec = %v, want CeilingPPS * Values = %v", got, want)
	}
	if got, want := r.AggElementsPerSec, r.AggPPS*float64(r.Options.Values); got != want {
		t.Errorf("AggElementsPerSec = %v, want AggPPS * Values = %v", got, want)
	}
	for _, k := range []string{PathAggregate, PathComplete, PathDuplicate, PathNonAgg, PathGenerator} {
		if v, ok := r.RunNsPerPacket[k]; !ok || !(v > 0) {
			t.Errorf("RunNsPerPacket[%q] = %v (present %v), want > 0", k, v, ok)
		}
	}
	for _, k := range []string{"xdpagg_switch", "xdpagg_egress", "xdpagg_pass"} {
		if v := r.VerifiedInsns[k]; v == 0 {
			t.Errorf("VerifiedInsns[%q] = 0, want > 0", k)
		}
		if v := r.Insns[k]; v <= 0 {
			t.Errorf("Insns[%q] = %d, want > 0", k, v)
		}
	}
	if r.VerifiedInsns["xdpagg_switch"] <= r.VerifiedInsns["xdpagg_pass"] {
		t.Errorf("verified instructions: switch %d <= pass %d", r.VerifiedInsns["xdpagg_switch"], r.VerifiedInsns["xdpagg_pass"])
	}
}

func TestOptions(t *testing.T) {
	o, err := Options{}.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	if o.Values != DefaultValues || o.Workers != DefaultWorkers || o.Duration != DefaultDuration || o.Batch != DefaultBatch || o.Window != DefaultWindow {
		t.Errorf("defaults: %+v", o)
	}
	for _, bad := range []Options{{Values: wire.MaxValues + 1}, {Workers: 33}, {Batch: 257}, {Window: -1}, {Duration: time.Microsecond}} {
		if _, err := bad.withDefaults(); !errors.Is(err, ErrOptions) {
			t.Errorf("%+v: err %v, want ErrOptions", bad, err)
		}
	}
	if _, err := Measure(context.Background(), Options{Workers: 40}); !errors.Is(err, ErrOptions) {
		t.Errorf("Measure with 40 workers: err %v, want ErrOptions", err)
	}
}

func TestProcessedInsns(t *testing.T) {
	log := "func#0 @0\nprocessed 1234 insns (limit 1000000) max_states_per_insn 4\nprocessed 10 insns (limit 1000000)\n"
	if got := processedInsns(log); got != 1244 {
		t.Errorf("processedInsns = %d, want 1244", got)
	}
}

func TestMeasureCancelled(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := Measure(ctx, Options{Duration: 100 * time.Millisecond})
	if errors.Is(err, ebpf.ErrNotSupported) {
		t.Skipf("kernel lacks a feature (ebpf.ErrNotSupported): %v", err)
	}
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Measure with a cancelled context: err %v, want context.Canceled", err)
	}
}
