// Package testbed assembles a complete xdpagg deployment inside network namespaces on one
// machine: the XDP switch on a switch namespace's ports, a parameter server, and W workers of one
// job, or several jobs with their own (possibly overlapping) sets of worker hosts sharing the
// switch and the PS (Options.Jobs). End-to-end tests, `xdpagg demo` and benchmarks all build on it.
package testbed

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"time"

	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/hostlib"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/netns_tests/topo"
	"github.com/xdpagg/xdpagg/wire"
)

// WorkerPort is the UDP port every worker of the first (or only) job binds, each in its own
// namespace. The workers of Options.Jobs[j] bind WorkerPort+j, so a host that is in several jobs
// runs one worker per job, each on its own port.
const WorkerPort = 9600

// Options configures a testbed. Zero values take defaults.
type Options struct {
	Prefix string // namespace prefix (default topo.NewPrefix())
	// Workers is the number of worker hosts (default 4; with Jobs, default the highest host
	// index in Jobs + 1).
	Workers   int
	JobID     uint32 // the single job's id when Jobs is empty (default 1)
	Switch    loader.Config
	Window    int           // worker window (default hostlib's)
	ScaleLog2 uint8         // fixed-point exponent (default hostlib's)
	Timeout   time.Duration // worker retransmit timeout (default hostlib's)
	PinDir    string        // if set (a bpffs dir), pin the switch's maps there
	MTU       int
	// ExtraWorker adjusts a worker's config before creation; i is its worker id in its job
	// (cfg.JobID says which job). It applies to every worker of every job.
	ExtraWorker func(i int, cfg *hostlib.WorkerConfig)
	// ExtraPS adjusts the PS's config before creation (e.g. PoolSize, to turn on ATP's rehash).
	ExtraPS func(cfg *hostlib.PSConfig)
	// Jobs, if set, runs several jobs at once on the one switch and PS, instead of the single
	// job JobID on every worker host. Each job gets its own hostlib.Worker on each of its hosts
	// (bound to WorkerPort+j for Jobs[j]) and its own switch members. Bed.Workers and
	// Bed.AllReduce are then Jobs[0]'s.
	Jobs []JobSpec
	// AFXDP makes every worker receive its results through AF_XDP (hostlib.WorkerConfig.AFXDP):
	// the worker hosts' xdpagg_pass is detached and each worker attaches its own xdpagg_host,
	// which also passes everything else. The PS host keeps xdpagg_pass.
	AFXDP bool
}

// JobSpec describes one job of a multi-job testbed (Options.Jobs).
type JobSpec struct {
	ID uint32 // job id: nonzero, unique among Jobs
	// Hosts are the indexes (into Topo.Workers) of the hosts running the job's workers, in
	// worker-id order: worker i of the job runs on host Hosts[i]. 1..32 distinct hosts.
	Hosts   []int
	Window  int           // worker window (0: Options.Window)
	Timeout time.Duration // worker retransmit timeout (0: Options.Timeout)
	// Extra adjusts a worker's config before creation, after Options.ExtraWorker; i is the
	// worker id in the job.
	Extra func(i int, cfg *hostlib.WorkerConfig)
	// MaxSlots is the job's slot quota at the switch (0: maps.DefaultMaxSlots of the pool).
	MaxSlots uint32
}

// Job is a running job of a testbed.
type Job struct {
	Spec    JobSpec
	Key     []byte            // the job's control key, as `xdpagg job add` makes it
	Port    uint16            // UDP port the job's workers bind, each on its own host
	Hosts   []*topo.Host      // Hosts[i] runs Workers[i]
	Workers []*hostlib.Worker // in worker-id order
}

// Bed is a running testbed.
type Bed struct {
	Opts    Options
	Topo    *topo.Topology
	Switch  *loader.Switch
	PS      *hostlib.PS
	Workers []*hostlib.Worker // the first (or only) job's workers: Jobs[0].Workers
	Jobs    []*Job            // every job, in Options.Jobs order (one job without Options.Jobs)

	psCancel context.CancelFunc
	psDone   chan error
	closed   bool

	// Sparse jobs (StartSparse) and their PS.
	Sparse       []*SparseJob
	SparsePS     *hostlib.SparsePS
	sparseCancel context.CancelFunc
	sparseDone   chan error
}

// normalize fills in the defaults of opts and returns the jobs to run: Options.Jobs, or without
// them the single job JobID on every worker host. opts.Jobs itself is left as given.
func normalize(opts Options) (Options, []JobSpec, error) {
	if opts.Prefix == "" {
		opts.Prefix = topo.NewPrefix()
	}
	if len(opts.Jobs) == 0 {
		if opts.Workers == 0 {
			opts.Workers = 4
		}
		if opts.JobID == 0 {
			opts.JobID = 1
		}
		hosts := make([]int, opts.Workers)
		for i := range hosts {
			hosts[i] = i
		}
		return opts, []JobSpec{{ID: opts.JobID, Hosts: hosts}}, nil
	}
	ids := map[uint32]bool{}
	need := 0
	jobs := make([]JobSpec, len(opts.Jobs))
	for j, js := range opts.Jobs {
		switch {
		case js.ID == 0:
			return opts, nil, fmt.Errorf("testbed: job %d: id 0 is reserved", j)
		case ids[js.ID]:
			return opts, nil, fmt.Errorf("testbed: job id %d given twice", js.ID)
		case len(js.Hosts) == 0 || len(js.Hosts) > wire.MaxWorkers:
			return opts, nil, fmt.Errorf("testbed: job %d has %d hosts: use 1..%d", js.ID, len(js.Hosts), wire.MaxWorkers)
		case j > 0xffff-WorkerPort:
			return opts, nil, fmt.Errorf("testbed: %d jobs: no UDP port left for job %d", len(opts.Jobs), js.ID)
		}
		ids[js.ID] = true
		seen := map[int]bool{}
		for _, h := range js.Hosts {
			if h < 0 || seen[h] {
				return opts, nil, fmt.Errorf("testbed: job %d: host %d is negative or given twice", js.ID, h)
			}
			seen[h] = true
			need = max(need, h+1)
		}
		js.Hosts = append([]int(nil), js.Hosts...)
		jobs[j] = js
	}
	if opts.Workers == 0 {
		opts.Workers = need
	}
	if opts.Workers < need {
		return opts, nil, fmt.Errorf("testbed: jobs use host %d but Workers is %d", need-1, opts.Workers)
	}
	if opts.JobID == 0 {
		opts.JobID = jobs[0].ID
	}
	if opts.JobID != jobs[0].ID {
		return opts, nil, fmt.Errorf("testbed: JobID %d is not Jobs[0]'s id %d: leave JobID 0 with Jobs", opts.JobID, jobs[0].ID)
	}
	return opts, jobs, nil
}

// New builds the topology, loads and attaches the switch, registers every job's members, and starts
// the PS and every job's workers. On error everything already made is torn down.
func New(opts Options) (b *Bed, err error) {
	opts, jobs, err := normalize(opts)
	if err != nil {
		return nil, err
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
	for j, js := range jobs {
		job := &Job{Spec: js, Port: uint16(WorkerPort + j)}
		for _, h := range js.Hosts {
			job.Hosts = append(job.Hosts, b.Topo.Workers[h])
		}
		b.Jobs = append(b.Jobs, job)
		// Admission, as `xdpagg job add` does it: the PS, the fan-in, the quota and a key.
		if job.Key, err = ctlauth.NewKey(); err != nil {
			return b, err
		}
		quota := js.MaxSlots
		if quota == 0 {
			quota = maps.DefaultMaxSlots(opts.Switch.PoolSize)
		}
		adm := maps.Job{JobID: js.ID, PS: psAddr, PSIfindex: uint32(ps.PortIndex), Workers: uint8(len(job.Hosts)), MaxSlots: quota}
		if err = b.Switch.Maps.AddJob(adm, job.Key); err != nil {
			return b, fmt.Errorf("admit job %d: %w", js.ID, err)
		}
		// One member per job per switch port: each of the job's hosts is behind its own port.
		for i, w := range job.Hosts {
			m := maps.Member{JobID: js.ID, WorkerID: uint8(i), Ifindex: uint32(w.PortIndex),
				Addr: netip.AddrPortFrom(w.IP, job.Port), MAC: w.MAC, PortMAC: w.PortMAC, SrcIP: ps.IP}
			if err = b.Switch.Maps.PutMember(m); err != nil {
				return b, err
			}
		}
	}

	// The PS sums only what the switch admitted: each job's workers, at their hosts' addresses
	// and the job's port, by worker id.
	psCfg := hostlib.PSConfig{Listen: psAddr, Switch: netip.AddrPortFrom(ps.Gateway, opts.Switch.Port)}
	for _, job := range b.Jobs {
		pj := hostlib.PSJob{ID: job.Spec.ID}
		for _, h := range job.Hosts {
			pj.Workers = append(pj.Workers, netip.AddrPortFrom(h.IP, job.Port))
		}
		psCfg.Jobs = append(psCfg.Jobs, pj)
	}
	if opts.ExtraPS != nil {
		opts.ExtraPS(&psCfg)
	}
	err = b.Topo.InHost(ps, func() error {
		var err error
		b.PS, err = hostlib.NewPS(psCfg)
		return err
	})
	if err != nil {
		return b, fmt.Errorf("start PS: %w", err)
	}
	var ctx context.Context
	ctx, b.psCancel = context.WithCancel(context.Background())
	b.psDone = make(chan error, 1)
	go func() { b.psDone <- b.PS.Serve(ctx) }()

	if opts.AFXDP {
		// One XDP program per interface: the workers bring their own.
		for _, h := range b.Topo.Workers {
			if h.XDPLink != nil {
				if err = h.XDPLink.Close(); err != nil {
					return b, fmt.Errorf("detach xdpagg_pass from %s: %w", h.Name, err)
				}
			}
		}
	}
	for _, job := range b.Jobs {
		js := job.Spec
		window, timeout := js.Window, js.Timeout
		if window == 0 {
			window = opts.Window
		}
		if timeout == 0 {
			timeout = opts.Timeout
		}
		for i, w := range job.Hosts {
			cfg := hostlib.WorkerConfig{
				JobID: js.ID, WorkerID: uint8(i), NumWorkers: uint8(len(job.Hosts)),
				Local: netip.AddrPortFrom(w.IP, job.Port), PS: psAddr, JobKey: job.Key,
				PoolSize: opts.Switch.PoolSize, Window: window, ScaleLog2: opts.ScaleLog2, Timeout: timeout,
				ValuesPerPacket: b.ValuesPerPacket(), AFXDP: opts.AFXDP,
			}
			if opts.ExtraWorker != nil {
				opts.ExtraWorker(i, &cfg)
			}
			if js.Extra != nil {
				js.Extra(i, &cfg)
			}
			// On a locked thread inside the host's namespace: the socket stays there.
			err = b.Topo.InHost(w, func() error {
				wk, err := hostlib.NewWorker(cfg)
				if err != nil {
					return err
				}
				job.Workers = append(job.Workers, wk)
				return nil
			})
			if err != nil {
				if len(opts.Jobs) > 0 {
					return b, fmt.Errorf("start worker %d of job %d on %s: %w", i, js.ID, w.Name, err)
				}
				return b, fmt.Errorf("start worker %d: %w", i, err)
			}
		}
	}
	b.Workers = b.Jobs[0].Workers
	return b, nil
}

// ValuesPerPacket is what the topology's MTU lets a fragment carry (K).
func (b *Bed) ValuesPerPacket() int {
	if b.Opts.MTU == 0 {
		return wire.StdValues
	}
	return wire.ValuesForMTU(b.Opts.MTU)
}

// AllReduce runs one allreduce on every worker at once; inputs[i] is worker i's tensor, summed in
// place. It returns the wall time of the slowest worker. With Options.Jobs it runs Jobs[0].
func (b *Bed) AllReduce(ctx context.Context, inputs [][]float32) (time.Duration, error) {
	return allReduce(ctx, b.Workers, inputs)
}

// Job returns the job with id, or nil.
func (b *Bed) Job(id uint32) *Job {
	for _, j := range b.Jobs {
		if j.Spec.ID == id {
			return j
		}
	}
	return nil
}

// JobWorkers returns the workers of job id in worker-id order (nil for an unknown job).
func (b *Bed) JobWorkers(id uint32) []*hostlib.Worker {
	if j := b.Job(id); j != nil {
		return j.Workers
	}
	return nil
}

// AllReduceJob runs one allreduce of job id on each of its workers at once; inputs[i] is worker
// i's tensor, summed in place. It returns the wall time of the job's slowest worker. Different
// jobs' allreduces may run concurrently; one job's must not overlap.
func (b *Bed) AllReduceJob(ctx context.Context, id uint32, inputs [][]float32) (time.Duration, error) {
	j := b.Job(id)
	if j == nil {
		return 0, fmt.Errorf("testbed: no job %d", id)
	}
	d, err := allReduce(ctx, j.Workers, inputs)
	if err != nil {
		err = fmt.Errorf("job %d: %w", id, err)
	}
	return d, err
}

func allReduce(ctx context.Context, workers []*hostlib.Worker, inputs [][]float32) (time.Duration, error) {
	if len(inputs) != len(workers) {
		return 0, fmt.Errorf("%d inputs for %d workers", len(inputs), len(workers))
	}
	var wg sync.WaitGroup
	errs := make([]error, len(inputs))
	start := time.Now()
	for i, w := range workers {
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
	errs := b.closeSparse()
	for _, j := range b.Jobs {
		for _, w := range j.Workers {
			// A test may have closed a worker already (a killed job): not a teardown error.
			if err := w.Close(); err != nil && !errors.Is(err, hostlib.ErrClosed) {
				errs = append(errs, err)
			}
		}
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
