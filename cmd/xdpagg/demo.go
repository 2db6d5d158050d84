package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/netns_tests/testbed"
	"github.com/xdpagg/xdpagg/wire"
)

// resnet18Params is the parameter count of ResNet-18: the demo's default tensor, a realistic
// gradient for data-parallel training.
const resnet18Params = 11_689_512

// demoReport is what `xdpagg demo --json` prints.
type demoReport struct {
	Workers          int               `json:"workers"`
	Values           int               `json:"values"`
	ValuesPerPacket  int               `json:"values_per_packet"`
	Fragments        int               `json:"fragments"`
	Rounds           int               `json:"rounds"`
	Seconds          []float64         `json:"seconds"`
	ElementsPerSec   float64           `json:"aggregated_elements_per_second"`
	Verified         int               `json:"elements_verified"`
	Wrong            int               `json:"elements_wrong"`
	MaxAbsError      float64           `json:"max_abs_error"`
	ErrorBound       float64           `json:"error_bound"`
	InSwitchFraction float64           `json:"in_switch_fraction"`
	Counters         map[string]uint64 `json:"switch_counters"`
	Retransmits      uint64            `json:"worker_retransmits"`
	Transport        string            `json:"worker_transport"`
}

func runDemo(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	var (
		workers = fs.Int("workers", 4, "workers in the job (1..32)")
		values  = fs.Int("values", resnet18Params, "float32 values per worker (default: ResNet-18's parameter count)")
		rounds  = fs.Int("rounds", 3, "allreduces to run back to back")
		pool    = fs.Uint("pool", 4096, "switch aggregator slots")
		asJSON  = fs.Bool("json", false, "print a JSON report instead of text")
		mtu     = fs.Int("mtu", 1500, "MTU of the topology's links; packets carry (MTU-60)/4 values, at most 832 (MTU 3388)")

		sparseMode = fs.Bool("sparse", false, "run the sparse demo instead: a recorded sparse-model trace, hot keys in the switch's registers, cold keys at the PS (docs/sparse.md)")
		trace      = fs.String("trace", "ctr_w8", "--sparse: the recorded trace to train through (workload.RecordedNames)")
		iterations = fs.Int("iterations", 0, "--sparse: iterations of the trace to run (0: all)")
		regArrays  = fs.Int("reg-arrays", 256, "--sparse: register arrays (m) of the sparse job, 1..256; it holds m x 256 hot keys")
		sample     = fs.Float64("sample", 0.08, "--sparse: share of the trace's batches the hot keys are chosen from (Zebra's sampling method)")
		hotP       = fs.Float64("hot-p", 0.9, "--sparse: Principle 1's p: the smallest hot set that takes this share of the sample's updates (capped by the registers)")
	)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *workers < 1 || *workers > wire.MaxWorkers {
		return fmt.Errorf("%w: --workers %d: use 1..%d", errUsage, *workers, wire.MaxWorkers)
	}
	if *values < 1 {
		return fmt.Errorf("%w: --values %d: use at least 1", errUsage, *values)
	}
	if *pool == 0 || *pool > loader.MaxPoolSize {
		return fmt.Errorf("%w: --pool %d: use 1..%d", errUsage, *pool, loader.MaxPoolSize)
	}
	if *mtu < 576 || *mtu > 3388 {
		return fmt.Errorf("%w: --mtu %d: use 576..3388 (the largest frame a veth hands XDP as one buffer)", errUsage, *mtu)
	}
	if *rounds < 1 {
		return fmt.Errorf("%w: --rounds %d: use at least 1", errUsage, *rounds)
	}
	if *sparseMode && (*regArrays < 1 || *regArrays > int(bpf.JobMaxArrays) || *sample <= 0 || *sample > 1 || *hotP <= 0 || *hotP > 1 || *iterations < 0) {
		return fmt.Errorf("%w: --sparse: --reg-arrays 1..%d, --sample and --hot-p in (0,1], --iterations >= 0", errUsage, bpf.JobMaxArrays)
	}
	if os.Geteuid() != 0 {
		return fmt.Errorf("%w: the demo needs root (network namespaces, XDP)", errUsage)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if *sparseMode {
		return runSparseDemo(ctx, sparseDemoOptions{workers: *workers, iterations: *iterations, arrays: *regArrays,
			trace: *trace, sample: *sample, p: *hotP, mtu: *mtu, asJSON: *asJSON}, stdout)
	}
	progress := func(format string, a ...any) {
		if !*asJSON {
			fmt.Fprintf(stdout, format+"\n", a...)
		}
	}

	progress("building topology: switch namespace + %d workers + parameter server (veth, native XDP)", *workers)
	bed, err := testbed.New(testbed.Options{Workers: *workers, MTU: *mtu, Switch: loader.Config{PoolSize: uint32(*pool)}})
	if err != nil {
		return err
	}
	defer bed.Close()

	const scaleLog2 = 24
	k := bed.ValuesPerPacket()
	rep := demoReport{Workers: *workers, Values: *values, ValuesPerPacket: k, Rounds: *rounds}
	rep.Fragments = (*values + k - 1) / k
	rep.ErrorBound = float64(*workers) * math.Ldexp(1, -scaleLog2-1)
	before, err := bed.Counters()
	if err != nil {
		return err
	}
	r := rand.New(rand.NewPCG(1, 2))
	ref := make([]float64, *values)
	in := make([][]float32, *workers)
	for i := range in {
		in[i] = make([]float32, *values)
	}
	for round := range *rounds {
		// Gradients: normal(0, 0.01) like a trained network's, different every round and worker.
		for j := range ref {
			ref[j] = 0
		}
		for i := range in {
			for j := range in[i] {
				v := float32(r.NormFloat64() * 0.01)
				in[i][j] = v
				ref[j] += float64(v)
			}
		}
		progress("round %d: allreduce of %d values (%.1f MiB) per worker ...", round+1, *values, float64(*values)*4/(1<<20))
		took, err := bed.AllReduce(ctx, in)
		if err != nil {
			return fmt.Errorf("round %d: %w", round+1, err)
		}
		rep.Seconds = append(rep.Seconds, took.Seconds())
		for _, got := range in {
			for j, v := range got {
				d := math.Abs(float64(v) - ref[j])
				rep.MaxAbsError = max(rep.MaxAbsError, d)
				if d > rep.ErrorBound+math.Abs(ref[j])*0x1p-23 || math.IsNaN(float64(v)) {
					rep.Wrong++
				}
				rep.Verified++
			}
		}
		progress("round %d: %v, %.3g aggregated elements/s, every element checked", round+1,
			took.Round(time.Millisecond), float64(*values)/took.Seconds())
	}
	after, err := bed.Counters()
	if err != nil {
		return err
	}
	d := after.Sub(before)
	rep.Counters = d.Map()
	rep.InSwitchFraction = float64(d[maps.CntCompleted]) / float64(rep.Fragments**rounds)
	best := rep.Seconds[0]
	for _, s := range rep.Seconds {
		best = min(best, s)
	}
	rep.ElementsPerSec = float64(*values) / best
	for _, w := range bed.Workers {
		rep.Retransmits += w.Stats().Retransmits
	}

	if on, why := bed.Workers[0].GSO(); on {
		rep.Transport = "UDP GSO"
	} else {
		rep.Transport = fmt.Sprintf("one datagram per send (UDP GSO off: %v)", why)
	}
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(rep); err != nil {
			return err
		}
	} else {
		fmt.Fprintf(stdout, "\nverified %d elements: %d wrong (max |error| %.3g, bound %.3g + float32 rounding)\n",
			rep.Verified, rep.Wrong, rep.MaxAbsError, rep.ErrorBound)
		fmt.Fprintf(stdout, "switch: %d of %d fragments summed in-switch (%.2f%%); aggregated %d packets, duplicates %d, to PS %d, malformed %d; %d worker retransmits\n",
			d[maps.CntCompleted], rep.Fragments**rounds, 100*rep.InSwitchFraction, d[maps.CntAggregated],
			d[maps.CntDuplicate], d[maps.CntToPS], d[maps.CntMalformed], rep.Retransmits)
		fmt.Fprintf(stdout, "best allreduce %.3fs: %.3g aggregated elements/s, %d values per packet, workers send with %s\n",
			best, rep.ElementsPerSec, k, rep.Transport)
	}
	if rep.Wrong > 0 {
		return errors.New("demo: some elements were wrong")
	}
	return nil
}
