package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/xdpagg/xdpagg/bench"
	"github.com/xdpagg/xdpagg/bench/capacity"
	"github.com/xdpagg/xdpagg/wire"
)

// benchOutput is what --json prints and bench.json holds.
type benchOutput struct {
	Report   *bench.Report         `json:"report,omitempty"`
	Sparse   *bench.SparseResult   `json:"sparse,omitempty"`
	LossCost *bench.LossCostResult `json:"loss_cost,omitempty"`
	Capacity *capacity.Result      `json:"switch_capacity,omitempty"`
}

func runBench(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	var (
		modes    = fs.String("modes", strings.Join(bench.AllModes, ","), "modes to compare: xdpagg,ps,ring,gloo; also xdpagg-udp (xdpagg with the workers receiving on their UDP sockets instead of AF_XDP, for A/B runs)")
		sizes    = fs.String("sizes", "40KB,4MiB,64MiB", "tensor sizes (float32 bytes per worker): NNN, NNNKB, NNNMiB")
		workers  = fs.String("workers", "2,4,8", "worker counts")
		rounds   = fs.Int("rounds", 0, "interleaved rounds per cell (0: 9, or 5 for sizes >= 16MiB)")
		window   = fs.Int("window", 0, "fragments in flight per worker for xdpagg/ps (0: hostlib default)")
		python   = fs.String("python", "/usr/bin/python3", "Python with torch for the gloo mode")
		out      = fs.String("out", "bench-out", "directory for bench.json and bench.png")
		asJSON   = fs.Bool("json", false, "print the JSON report instead of the table")
		capOnly  = fs.Bool("switch-capacity", false, "measure the switch program's capacity (live frames, against its payload-copy ceiling and bare XDP_TX) instead of the modes")
		capToo   = fs.Bool("with-capacity", false, "also measure switch capacity after the modes")
		lossOne  = fs.Bool("loss-cost", false, "measure only the time cost of 0.1% loss to xdpagg (paired clean/lossy allreduces) instead of the modes")
		pairs    = fs.Int("loss-pairs", 15, "clean/lossy allreduce pairs of the 0.1%-loss cost (W=4, 4MiB), measured after the modes when they include xdpagg; 0: skip")
		quiet    = fs.Bool("quiet", false, "no progress line")
		mtu      = fs.Int("mtu", bench.DefaultMTU, "MTU of the topology's links (576..3388; at 3388 a packet holds 832 values, at 1500 360)")
		rates    = fs.String("link-rate", "none", "host-link rates to measure at, each direction, on every mode's topology alike: none (unshaped) or tc units, e.g. none,1gbit,10gbit (also --sparse)")
		cpus     = fs.String("cpus", "", "pin the benchmark and every process it starts (every mode's) to these CPUs, e.g. 0 or 0,1 or 0-3, and count cores busy over them only (also --sparse; empty: every CPU, nothing pinned)")
		busyPoll = fs.Duration("busy-poll", 0, "xdpagg's workers: SO_BUSY_POLL for this long (e.g. 50us) and SO_PREFER_BUSY_POLL on their sockets (0: off, the default)")
		sockBuf  = fs.Int("socket-buffer", 0, "xdpagg's workers: SO_RCVBUF/SO_SNDBUF in bytes (0: hostlib's default, 8 MiB)")
		threaded = fs.Bool("threaded-napi", false, "xdpagg's testbed: threaded NAPI on every veth (switch ports and hosts)")
		profN    = fs.Int("profile", 0, "instead of the modes: N allreduces (then N more with BPF statistics on) on one xdpagg testbed, the first --workers and --sizes; prints where the CPU goes. --cpuprofile and --perf-record then cover only the timed N")
		perfOut  = fs.String("perf-record", "", "--profile: run `perf record -a -g` over the timed allreduces into `file`")
		swObj    = fs.String("switch-object", "", "run this compiled switch object (bpf/xdpagg_bpfel.o of another revision) instead of the built-in one, in the xdpagg mode and --switch-capacity: A/B runs of switch program changes")
		cpuProf  = fs.String("cpuprofile", "", "write a Go CPU profile of the run (this process: workers, PS, ring) to `file`")

		sparseMode = fs.Bool("sparse", false, "run the sparse benchmark instead (Zebra Figs. 6, 9, 10 on a recorded trace; --workers applies)")
		sparseIter = fs.Int("sparse-iterations", 60, "--sparse: iterations of the trace per round")
		sparseTr   = fs.String("trace", "ctr_w8", "--sparse: the recorded trace")
	)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if os.Geteuid() != 0 {
		return fmt.Errorf("%w: the benchmark needs root (network namespaces, XDP)", errUsage)
	}
	opts := bench.Options{Rounds: *rounds, Python: *python, Window: *window, MTU: *mtu, SwitchObject: *swObj,
		BusyPoll: *busyPoll, SocketBuffer: *sockBuf, ThreadedNAPI: *threaded}
	if !*quiet {
		opts.Progress = os.Stderr
	}
	opts.Modes = splitList(*modes)
	var err error
	if opts.LinkRates, err = bench.ParseLinkRates(*rates); err != nil {
		return fmt.Errorf("%w: --link-rate: %w", errUsage, err)
	}
	if *cpus != "" {
		if opts.CPUs, err = bench.ParseCPUList(*cpus); err != nil {
			return fmt.Errorf("%w: --cpus: %w", errUsage, err)
		}
	}
	if opts.Bytes, err = parseSizes(*sizes); err != nil {
		return err
	}
	for _, w := range splitList(*workers) {
		n, err := strconv.Atoi(w)
		if err != nil {
			return fmt.Errorf("%w: --workers %q: use numbers like 2,4,8", errUsage, w)
		}
		opts.Workers = append(opts.Workers, n)
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		return fmt.Errorf("create output directory: %w", err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	if *profN > 0 {
		return runProfile(ctx, opts, *profN, *cpuProf, *perfOut, stdout)
	}
	if *cpuProf != "" {
		f, err := os.Create(*cpuProf)
		if err != nil {
			return fmt.Errorf("cpu profile: %w", err)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return fmt.Errorf("cpu profile: %w", err)
		}
		defer pprof.StopCPUProfile()
	}

	var res benchOutput
	if *sparseMode {
		so := bench.SparseOptions{Trace: *sparseTr, Workers: opts.Workers, Iterations: *sparseIter, Rounds: *rounds, MTU: *mtu,
			LinkRates: opts.LinkRates, CPUs: opts.CPUs, Progress: opts.Progress}
		if res.Sparse, err = bench.Sparse(ctx, so); err != nil {
			return err
		}
		b, _ := json.MarshalIndent(res, "", "  ")
		jsonPath := filepath.Join(*out, "bench-sparse.json")
		if err := os.WriteFile(jsonPath, append(b, '\n'), 0o644); err != nil {
			return fmt.Errorf("write %s: %w", jsonPath, err)
		}
		if *asJSON {
			_, err := stdout.Write(append(b, '\n'))
			return err
		}
		res.Sparse.Table(stdout)
		fmt.Fprintf(stdout, "\nwrote %s\n", jsonPath)
		return nil
	}
	if !*capOnly && !*lossOne {
		if res.Report, err = bench.Run(ctx, opts); err != nil {
			return err
		}
	}
	if *lossOne || (!*capOnly && *pairs > 0 && slices.Contains(opts.Modes, bench.ModeXdpagg)) {
		lopts := bench.LossCostOptions{Pairs: *pairs, MTU: *mtu, Window: *window, Progress: opts.Progress}
		if lopts.Pairs <= 0 {
			lopts.Pairs = 15
		}
		if res.LossCost, err = bench.LossCost(ctx, lopts); err != nil {
			return err
		}
	}
	if *capOnly || *capToo {
		if opts.Progress != nil {
			fmt.Fprint(os.Stderr, "\r\033[Kmeasuring switch capacity ...")
		}
		// The packets the topology's MTU carries: the switch's work per packet scales with it.
		copts := capacity.Options{SwitchObject: *swObj}
		if *mtu > 0 {
			copts.Values = wire.ValuesForMTU(*mtu)
		}
		c, err := capacity.Measure(ctx, copts)
		if opts.Progress != nil {
			fmt.Fprint(os.Stderr, "\r\033[K")
		}
		if err != nil {
			return fmt.Errorf("switch capacity: %w", err)
		}
		res.Capacity = &c
	}

	b, _ := json.MarshalIndent(res, "", "  ")
	jsonPath := filepath.Join(*out, "bench.json")
	if err := os.WriteFile(jsonPath, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("write %s: %w", jsonPath, err)
	}
	pngPath := filepath.Join(*out, "bench.png")
	if res.Report != nil {
		if err := res.Report.Plot(pngPath); err != nil {
			return err
		}
	}
	if *asJSON {
		_, err := stdout.Write(append(b, '\n'))
		return err
	}
	if res.Report != nil {
		res.Report.Table(stdout)
	}
	if res.LossCost != nil {
		if res.Report != nil {
			fmt.Fprintln(stdout)
		}
		res.LossCost.Table(stdout)
	}
	if res.Report != nil {
		fmt.Fprintf(stdout, "\nwrote %s and %s\n", jsonPath, pngPath)
	} else {
		fmt.Fprintf(stdout, "\nwrote %s\n", jsonPath)
	}
	if res.Capacity != nil {
		fmt.Fprintln(stdout)
		res.Capacity.Table(stdout)
	}
	return nil
}

func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

// parseSizes reads "40KB,4MiB,64MiB" (KB = KiB = 1024 bytes; MB = MiB).
func parseSizes(s string) ([]int, error) {
	var out []int
	for _, f := range splitList(s) {
		mult := 1
		num := f
		for _, suf := range []struct {
			s string
			m int
		}{{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"KB", 1 << 10}, {"MB", 1 << 20}, {"K", 1 << 10}, {"M", 1 << 20}, {"B", 1}} {
			if strings.HasSuffix(f, suf.s) {
				mult, num = suf.m, strings.TrimSuffix(f, suf.s)
				break
			}
		}
		n, err := strconv.Atoi(num)
		if err != nil || n <= 0 || (n*mult)%4 != 0 {
			return nil, fmt.Errorf("%w: --sizes %q: use sizes like 40KB, 4MiB or 4096 (a multiple of 4 bytes)", errUsage, f)
		}
		out = append(out, n*mult)
	}
	return out, nil
}

// runProfile is `xdpagg bench --profile N`: bench.Profile with the Go CPU profile and perf
// confined to the timed allreduces.
func runProfile(ctx context.Context, opts bench.Options, n int, cpuProf, perfOut string, stdout io.Writer) error {
	po := bench.ProfileOptions{Workers: opts.Workers[0], Bytes: opts.Bytes[0], MTU: opts.MTU, Allreduces: n,
		BusyPoll: opts.BusyPoll, SocketBuffer: opts.SocketBuffer, ThreadedNAPI: opts.ThreadedNAPI}
	var startErr error
	var perf *exec.Cmd
	var prof *os.File
	po.Ready = func() {
		if perfOut != "" {
			perf = exec.Command("perf", "record", "-a", "-g", "-o", perfOut)
			perf.Stdout, perf.Stderr = os.Stderr, os.Stderr
			if err := perf.Start(); err != nil {
				startErr = fmt.Errorf("perf record: %w", err)
				perf = nil
			} else {
				time.Sleep(time.Second) // perf needs a moment before it samples
			}
		}
		if cpuProf != "" {
			f, err := os.Create(cpuProf)
			if err == nil {
				err = pprof.StartCPUProfile(f)
			}
			if err != nil {
				startErr = errors.Join(startErr, fmt.Errorf("cpu profile: %w", err))
				return
			}
			prof = f
		}
	}
	po.Done = func() {
		if prof != nil {
			pprof.StopCPUProfile()
			prof.Close()
		}
		if perf != nil {
			_ = perf.Process.Signal(os.Interrupt)
			_ = perf.Wait()
		}
	}
	res, err := bench.Profile(ctx, po)
	if err != nil {
		return err
	}
	res.Table(stdout)
	return startErr
}
