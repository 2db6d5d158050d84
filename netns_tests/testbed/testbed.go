// Package testbed assembles a complete xdpagg deployment inside network namespaces on one
// machine: the XDP switch on a switch namespace's ports, a parameter server, and W workers of one
// job. End-to-end tests, `xdpagg demo` and benchmarks all build on it.
package testbed

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"time"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/hostlib"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/netns_tests/topo"
)

// WorkerPort is the UDP port every worker binds (each in its own namespace).
const WorkerPort = 9600

// Options configures a testbed. Zero values take defaults.
type Options struct {
	Prefix      string // namespace prefix (default topo.NewPrefix())
	Workers     int    // default 4
	JobID       uint32 // default 1
	Switch      loader.Config
	Window      int           // worker window (default hostlib's)
	ScaleLog2   uint8         // fixed-point exponent (default hostlib's)
	Timeout     time.Duration // worker retransmit timeout (default hostlib's)
	PinDir      string        // if set (a bpffs dir), pin the switch's maps there
	MTU         int
	ExtraWorker func(i int, cfg *hostlib.WorkerConfig) // adjust a worker's config before creation
}

// Bed is a running testbed.
type Bed struct {
	Opts    Options
	Topo    *topo.Topology
	Switch  *loader.Switch
	PS      *hostlib.PS
	Workers []*hostlib.Worker

	psCancel context.CancelFunc
	psDone   chan error
	closed   bool
}

// New builds the topology, loads and attaches the switch, registers the job's members, and starts
// the PS and the workers. On error everything already made is torn down.
func New(opts Options) (b *Bed, err error) {
	if opts.Workers == 0 {
		opts.Workers = 4
	}
	if opts.JobID == 0 {
		opts.JobID = 1
	}
	if opts.Prefix == "" {
		opts.Prefix = topo.NewPrefix()
	}
	opts.Switch = opts.Switch.WithDefaults()
	b = &Bed{Opts: opts}
	defer func() {
		if err != nil {
			b.Close()
			b = nil
		}
	}()

	if b.Switch, err = loader.Load(opts.Switch); err != nil {
		return b, fmt.Errorf("load switch: %w", err)
	}
	if opts.PinDir != "" {
		if err = b.Switch.Pin(opts.PinDir); err != nil {
			return b, err
		}
	}
	b.Topo, err = topo.New(topo.Config{Prefix: opts.Prefix, Workers: opts.Workers, PS: true, MTU: opts.MTU,
		HostXDP: b.Switch.Objects.XdpaggPass})
	if err != nil {
		return b, fmt.Errorf("build topology: %w", err)
	}
	err = b.Topo.InSwitch(func() error {
		for _, h := range b.Topo.Hosts() {
			if err := b.Switch.AttachPort(h.PortIndex); err != nil {
				return fmt.Errorf("attach switch port %s: %w", h.Port, err)
			}
		}
		return nil
	})
	if err != nil {
		return b, err
	}

	ps := b.Topo.PS
	psAddr := netip.AddrPortFrom(ps.IP, opts.Switch.Port)
	for i, w := range b.Topo.Workers {
		m := maps.Member{JobID: opts.JobID, WorkerID: uint8(i), Ifindex: uint32(w.PortIndex),
			Addr: netip.AddrPortFrom(w.IP, WorkerPort), MAC: w.MAC, PortMAC: w.PortMAC, SrcIP: ps.IP}
		if err = b.Switch.Maps.PutMember(m); err != nil {
			return b, err
		}
	}

	err = b.Topo.InHost(ps, func() error {
		var err error
		b.PS, err = hostlib.NewPS(hostlib.PSConfig{Listen: psAddr,
			Switch: netip.AddrPortFrom(ps.Gateway, opts.Switch.Port)})
		return err
	})
	if err != nil {
		return b, fmt.Errorf("start PS: %w", err)
	}
	var ctx context.Context
	ctx, b.psCancel = context.WithCancel(context.Background())
	b.psDone = make(chan error, 1)
	go func() { b.psDone <- b.PS.Serve(ctx) }()

	for i, w := range b.Topo.Workers {
		cfg := hostlib.WorkerConfig{
			JobID: opts.JobID, WorkerID: uint8(i), NumWorkers: uint8(opts.Workers),
			Local: netip.AddrPortFrom(w.IP, WorkerPort), PS: psAddr,
			PoolSize: opts.Switch.PoolSize, Window: opts.Window, ScaleLog2: opts.ScaleLog2, Timeout: opts.Timeout,
			ValuesPerPacket: b.ValuesPerPacket(),
		}
		if opts.ExtraWorker != nil {
			opts.ExtraWorker(i, &cfg)
		}
		err = b.Topo.InHost(w, func() error {
			wk, err := hostlib.NewWorker(cfg)
			if err != nil {
				return err
			}
			b.Workers = append(b.Workers, wk)
			return nil
		})
		if err != nil {
			return b, fmt.Errorf("start worker %d: %w", i, err)
		}
	}
	return b, nil
}

// ValuesPerPacket is what the topology's MTU lets a fragment carry (K).
func (b *Bed) ValuesPerPacket() int {
	if b.Opts.MTU == 0 {
		return bpf.StdValues
	}
	return bpf.ValuesForMTU(b.Opts.MTU)
}

// AllReduce runs one allreduce on every worker at once; inputs[i] is worker i's tensor, summed in
// place. It returns the wall time of the slowest worker.
func (b *Bed) AllReduce(ctx context.Context, inputs [][]float32) (time.Duration, error) {
	if len(inputs) != len(b.Workers) {
		return 0, fmt.Errorf("%d inputs for %d workers", len(inputs), len(b.Workers))
	}
	var wg sync.WaitGroup
	errs := make([]error, len(inputs))
	start := time.Now()
	for i, w := range b.Workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := w.AllReduce(ctx, inputs[i]); err != nil {
				errs[i] = fmt.Errorf("worker %d: %w", i, err)
			}
		}()
	}
	wg.Wait()
	return time.Since(start), errors.Join(errs...)
}

// Counters reads the switch's counters.
func (b *Bed) Counters() (maps.Counters, error) { return b.Switch.Maps.ReadCounters() }

// Close tears everything down: workers, PS, namespaces (with their veths), switch programs and pins.
func (b *Bed) Close() error {
	if b.closed {
		return nil
	}
	b.closed = true
	var errs []error
	for _, w := range b.Workers {
		errs = append(errs, w.Close())
	}
	if b.psCancel != nil {
		b.psCancel()
		errs = append(errs, b.PS.Close())
		if err := <-b.psDone; err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, hostlib.ErrClosed) {
			errs = append(errs, err)
		}
	}
	if b.Topo != nil {
		errs = append(errs, b.Topo.Close())
	}
	if b.Switch != nil {
		errs = append(errs, b.Switch.Close())
	}
	return errors.Join(errs...)
}
