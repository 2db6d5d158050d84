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
	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/sparse"
)

// SparseWorkerPort is the UDP port the first sparse job's workers bind; the next jobs take the
// ports after it (dense jobs use WorkerPort and up).
const SparseWorkerPort = 7200

// SparseJobSpec is one sparse job on a Bed.
type SparseJobSpec struct {
	ID    uint32
	Hosts []int // worker hosts, by worker id
	// Arrays is the register arrays (m) the job is admitted with; Hot its hot set (nil: every
	// key goes to the PS, and the job is admitted without registers).
	Arrays    int
	Hot       *sparse.HotSet
	ScaleLog2 uint8 // default hostlib's
	InOrder   bool  // pack hot pairs in order instead of Algorithm 1
	Timeout   time.Duration
	Online    *sparse.Online
}

// SparseJob is a running sparse job.
type SparseJob struct {
	Spec    SparseJobSpec
	Key     []byte
	Workers []*hostlib.SparseWorker
}

// SparsePSAddr is the address the Bed's sparse PS takes on the PS host: the switch intercepts
// one xdpagg port per address, and the dense PS has the host's first address.
func (b *Bed) SparsePSAddr() netip.AddrPort {
	ip := b.Topo.PS.IP.As4()
	ip[3]++
	return netip.AddrPortFrom(netip.AddrFrom4(ip), b.Opts.Switch.Port)
}

// StartSparse admits sparse jobs at the switch, starts one SparsePS for all of them (at
// SparsePSAddr) and their workers. Call it once per Bed.
func (b *Bed) StartSparse(specs ...SparseJobSpec) error {
	if b.SparsePS != nil {
		return errors.New("testbed: StartSparse called twice")
	}
	ps := b.Topo.PS
	addr := b.SparsePSAddr()
	if err := b.Topo.AddHostAddr(ps, addr.Addr()); err != nil {
		return err
	}
	psCfg := hostlib.SparsePSConfig{Listen: addr, Switch: netip.AddrPortFrom(ps.Gateway, b.Opts.Switch.Port), MTU: b.Opts.MTU}
	for j, s := range specs {
		job := &SparseJob{Spec: s}
		port := uint16(SparseWorkerPort + j)
		key, err := ctlauth.NewKey()
		if err != nil {
			return err
		}
		job.Key = key
		adm := maps.Job{JobID: s.ID, PS: addr, PSIfindex: uint32(ps.PortIndex), Workers: uint8(len(s.Hosts)),
			MaxSlots: 1, RegArrays: uint16(s.Arrays)}
		if s.Hot == nil {
			adm.RegArrays = 0
		}
		if err := b.Switch.Maps.AddJob(adm, key); err != nil {
			return fmt.Errorf("admit sparse job %d: %w", s.ID, err)
		}
		scale := s.ScaleLog2
		if scale == 0 {
			scale = hostlib.DefaultScaleLog2
		}
		pj := hostlib.SparsePSJob{ID: s.ID, Hot: s.Hot, Arrays: s.Arrays, ScaleLog2: scale, Online: s.Online}
		for i, hi := range s.Hosts {
			h := b.Topo.Workers[hi]
			waddr := netip.AddrPortFrom(h.IP, port)
			pj.Workers = append(pj.Workers, waddr)
			// What a JOIN sets up, statically: where updates go out, and who may send.
			m := maps.Member{JobID: s.ID, WorkerID: uint8(i), Ifindex: uint32(h.PortIndex), Addr: waddr, MAC: h.MAC,
				PortMAC: h.PortMAC, SrcIP: addr.Addr()}
			if err := b.Switch.Maps.PutMember(m); err != nil {
				return err
			}
			cfg := hostlib.SparseWorkerConfig{JobID: s.ID, WorkerID: uint8(i), NumWorkers: uint8(len(s.Hosts)), Local: waddr,
				PS: addr, Hot: s.Hot, Arrays: s.Arrays, InOrder: s.InOrder, ScaleLog2: scale, MTU: b.Opts.MTU,
				Timeout: s.Timeout, JobKey: key}
			err := b.Topo.InHost(h, func() error {
				w, err := hostlib.NewSparseWorker(cfg)
				if err != nil {
					return err
				}
				job.Workers = append(job.Workers, w)
				return nil
			})
			if err != nil {
				return fmt.Errorf("start sparse worker %d of job %d: %w", i, s.ID, err)
			}
		}
		psCfg.Jobs = append(psCfg.Jobs, pj)
		b.Sparse = append(b.Sparse, job)
	}
	err := b.Topo.InHost(ps, func() error {
		var err error
		b.SparsePS, err = hostlib.NewSparsePS(psCfg)
		return err
	})
	if err != nil {
		return fmt.Errorf("start sparse PS: %w", err)
	}
	var ctx context.Context
	ctx, b.sparseCancel = context.WithCancel(context.Background())
	b.sparseDone = make(chan error, 1)
	go func() { b.sparseDone <- b.SparsePS.Serve(ctx) }()
	return nil
}

// SparseJob returns the running sparse job id, or nil.
func (b *Bed) SparseJob(id uint32) *SparseJob {
	for _, j := range b.Sparse {
		if j.Spec.ID == id {
			return j
		}
	}
	return nil
}

// Step runs one iteration on every worker of the job at once: keys[i] and vals[i] are worker i's
// gradients. It returns each worker's update.
func (j *SparseJob) Step(ctx context.Context, iter uint32, keys [][]uint64, vals [][]float32) ([]hostlib.Update, error) {
	ups, err := StepAll(ctx, j.Workers, iter, keys, vals)
	if err != nil {
		return ups, fmt.Errorf("job %d: %w", j.Spec.ID, err)
	}
	return ups, nil
}

// StepAll runs iteration iter on every worker at once (worker i pushes keys[i], vals[i]) and
// returns each one's update.
func StepAll(ctx context.Context, workers []*hostlib.SparseWorker, iter uint32, keys [][]uint64, vals [][]float32) ([]hostlib.Update, error) {
	out := make([]hostlib.Update, len(workers))
	errs := make([]error, len(workers))
	var wg sync.WaitGroup
	for i, w := range workers {
		wg.Go(func() {
			out[i], errs[i] = w.Step(ctx, iter, keys[i], vals[i])
			if errs[i] != nil {
				errs[i] = fmt.Errorf("worker %d iteration %d: %w", i, iter, errs[i])
			}
		})
	}
	wg.Wait()
	return out, errors.Join(errs...)
}

// closeSparse stops the sparse PS and workers.
func (b *Bed) closeSparse() []error {
	var errs []error
	for _, j := range b.Sparse {
		for _, w := range j.Workers {
			errs = append(errs, w.Close())
		}
	}
	if b.sparseCancel != nil {
		b.sparseCancel()
		errs = append(errs, b.SparsePS.Close())
		if err := <-b.sparseDone; err != nil && !errors.Is(err, context.Canceled) {
			errs = append(errs, err)
		}
	}
	return errs
}
