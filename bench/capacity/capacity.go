//go:build linux

package capacity

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/rlimit"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/netns_tests/topo"
	"github.com/xdpagg/xdpagg/wire"
)

// Defaults and limits of Options.
const (
	// DefaultValues fill a standard 1500-byte MTU: 1500 - 20 (IPv4) - 8 (UDP) - 32 (header) =
	// 1440 bytes. Larger Values (up to wire.MaxValues) run over veths with a larger MTU.
	DefaultValues   = 360
	DefaultWorkers  = 4
	DefaultDuration = 2 * time.Second
	DefaultBatch    = 64  // the kernel's own default for live frames
	MaxBatch        = 256 // the kernel's limit for live frames
	DefaultWindow   = 128
	MaxWindow       = 4096

	// RunRepeat is how many times each Program.Run (non-live) path measurement runs the program.
	RunRepeat = 100000
	runWarmup = 1000

	// aggregateWorkers contribute to every fragment of the non-completing "aggregate" path: one
	// fewer than its fan-in, so no fragment ever completes.
	aggregateWorkers = wire.MaxWorkers - 1
)

// Keys of Result.RunNsPerPacket.
const (
	PathAggregate = "aggregate" // a data packet summed into a slot that it does not complete
	PathComplete  = "complete"  // the data packet that completes a sum (rewritten into the result, broadcast verdict)
	PathDuplicate = "duplicate" // a data packet whose contributor is already in the slot
	PathNonAgg    = "non_agg"   // a packet that is not xdpagg traffic (XDP_PASS)
	PathGenerator = "generator" // xdp_gen + tail call, already subtracted from aggregate and complete
)

// Sentinel errors, wrapped with details.
var (
	ErrOptions = errors.New("invalid capacity options")
	// ErrMix means the switch's counters disagree with the packet mix a measurement was designed
	// to drive, so its figure would not mean what it claims.
	ErrMix = errors.New("packet mix not as designed")
)

// Options configures Measure. Zero fields take their defaults.
type Options struct {
	Values   int           // values per packet, 1..wire.MaxValues (default DefaultValues = 360)
	Workers  int           // fan-in of the synthetic job, 1..wire.MaxWorkers (default 4); also the number of switch ports
	Duration time.Duration // per live-frame measurement (default 2s)
	Batch    int           // live-frames batch size, 1..256 (default 64)
	// Window is how many consecutive fragments each worker sends before the next worker's
	// turn (default 128); the job cycles through 2*Window slots, as SwitchML's pool does.
	Window int
	// Gradient makes the frames carry a nonzero gradient. The generator must then restore the
	// values of every frame that came back as a result (a 4*Values-byte copy into a cold page
	// per completion, charged to the switch). By default the values are zero, whose sum is
	// zero, so no restore is needed; the adder is branch-free, so its work does not depend on
	// the values.
	Gradient bool
	// SwitchObject, when set, is a compiled switch object to measure instead of the built-in
	// one (loader.Config.Object): A/B runs of switch program changes.
	SwitchObject string
}

func (o Options) withDefaults() (Options, error) {
	if o.Values == 0 {
		o.Values = DefaultValues
	}
	if o.Workers == 0 {
		o.Workers = DefaultWorkers
	}
	if o.Duration == 0 {
		o.Duration = DefaultDuration
	}
	if o.Batch == 0 {
		o.Batch = DefaultBatch
	}
	if o.Window == 0 {
		o.Window = DefaultWindow
	}
	switch {
	case o.Values < 1 || o.Values > wire.MaxValues:
		return o, fmt.Errorf("%w: %d values per packet: use 1..%d", ErrOptions, o.Values, wire.MaxValues)
	case o.Workers < 1 || o.Workers > wire.MaxWorkers:
		return o, fmt.Errorf("%w: %d workers: use 1..%d", ErrOptions, o.Workers, wire.MaxWorkers)
	case o.Duration < time.Millisecond:
		return o, fmt.Errorf("%w: duration %v: use at least 1ms", ErrOptions, o.Duration)
	case o.Batch < 1 || o.Batch > MaxBatch:
		return o, fmt.Errorf("%w: batch %d: use 1..%d", ErrOptions, o.Batch, MaxBatch)
	case o.Window < 1 || o.Window > MaxWindow:
		return o, fmt.Errorf("%w: window %d: use 1..%d", ErrOptions, o.Window, MaxWindow)
	}
	return o, nil
}

// Result is what Measure measured. Rates are per second of wall-clock time on one CPU.
type Result struct {
	// AggPPS is the packet rate of xdpagg_switch under live frames on the aggregation mix, and
	// AggElementsPerSec the aggregated values per second (AggPPS * Values).
	AggPPS, AggElementsPerSec float64
	// TxPPS is the packet rate of a bare XDP_TX program, same frame, same method.
	TxPPS float64
	// CeilingPPS is the honest ceiling: the packet rate of xdp_copy behind the same generator,
	// which loads and stores back every value and broadcasts the same copies through the
	// switch's devmap and egress program, without aggregating. CeilingElementsPerSec is
	// CeilingPPS * Values, and OfCeiling = AggPPS / CeilingPPS, the aggregation mix as a
	// fraction of it (the target is 0.7 or more; reported, not asserted).
	CeilingPPS, CeilingElementsPerSec, OfCeiling float64
	// Ratio is AggPPS / TxPPS.
	Ratio float64
	// RunNsPerPacket is the non-live Program.Run time per packet of each switch path (keys
	// Path*; the median of 5 runs of RunRepeat), the generator's own cost subtracted where it
	// drives the path.
	RunNsPerPacket map[string]float64
	// VerifiedInsns is the verifier's processed-instruction count of each switch program.
	VerifiedInsns map[string]uint32
	// Insns is the instruction count of each switch program's ProgramSpec.
	Insns map[string]int

	// GenTxPPS is the live-frame rate of the traffic generator in front of the bare XDP_TX
	// program: the same driver as the aggregation run, with nothing to aggregate.
	GenTxPPS float64
	// HostRxPPS is the rate at which result copies reached the hosts during the aggregation run
	// (Workers copies per completed fragment, so about AggPPS when all goes well).
	HostRxPPS float64
	// AggCounters are the switch's counter deltas over the aggregation run (warm-up included).
	AggCounters map[string]uint64
	// Options are the options used, defaults applied.
	Options Options
	// CPU is the CPU every measurement ran on.
	CPU int
}

// xdpMd is struct xdp_md, the BPF_PROG_RUN context of an XDP program.
type xdpMd struct {
	Data, DataEnd, DataMeta, IngressIfindex, RxQueueIndex, EgressIfindex uint32
}

// Fixed identities of the synthetic job.
const (
	jobID     = 7
	seqBase   = 1000
	memberUDP = 50000
)

var psIP = netip.AddrFrom4([4]byte{10, 200, 250, 2}) // results' source address; no such host exists

// Measure runs the capacity measurement described in the package documentation. It needs root
// (network namespaces, BPF) and takes about 3*opt.Duration plus a few seconds of setup.
func Measure(ctx context.Context, opt Options) (res Result, err error) {
	opt, err = opt.withDefaults()
	if err != nil {
		return Result{}, err
	}
	res.Options = opt
	if err := rlimit.RemoveMemlock(); err != nil {
		return Result{}, fmt.Errorf("remove memlock rlimit: %w", err)
	}

	// Pool: 2*Window slots for the mix, and room for the non-completing aggregate path, whose
	// fragments are never freed (31 contributions each, with slack for re-runs after EINTR).
	pool := max(4096, 2*opt.Window, (runWarmup+RunRepeat)/aggregateWorkers*5/4+2*opt.Window)
	sw, err := loader.Load(loader.Config{PoolSize: uint32(pool), Object: opt.SwitchObject})
	if err != nil {
		return Result{}, fmt.Errorf("load switch: %w", err)
	}
	defer func() {
		if cerr := sw.Close(); cerr != nil {
			err = errors.Join(err, fmt.Errorf("close switch: %w", cerr))
		}
	}()

	// The benchmark's programs, with xdp_copy broadcasting through the switch's own devmap.
	objs, err := loadObjects(sw.Objects.Ports)
	if err != nil {
		return Result{}, err
	}
	defer func() {
		if cerr := objs.Close(); cerr != nil {
			err = errors.Join(err, fmt.Errorf("close benchmark programs: %w", cerr))
		}
	}()

	res.Insns, res.VerifiedInsns, err = programSizes(sw)
	if err != nil {
		return Result{}, err
	}

	// Veths take frames up to their MTU: make room for opt.Values.
	mtu := max(topo.DefaultMTU, 20+8+wire.HdrSize+4*opt.Values)
	t, err := topo.New(topo.Config{Workers: opt.Workers, MTU: mtu, HostXDP: objs.XdpSink})
	if err != nil {
		return Result{}, fmt.Errorf("build switch topology: %w", err)
	}
	defer func() {
		// Ports first, while their interfaces still exist.
		for _, ifindex := range sw.Ports() {
			if derr := sw.DetachPort(ifindex); derr != nil {
				err = errors.Join(err, fmt.Errorf("detach switch port: %w", derr))
			}
		}
		if cerr := t.Close(); cerr != nil {
			err = errors.Join(err, cerr)
		}
	}()

	b := &bench{opt: opt, objs: objs, sw: sw, topo: t, pool: pool, res: &res}
	if err := t.InSwitch(func() error { return b.run(ctx) }); err != nil {
		return Result{}, err
	}
	return res, nil
}

// loadObjects loads the benchmark's programs, their `ports` devmap replaced by ports (the
// switch's; nil: a devmap of their own, for tests of the programs alone).
func loadObjects(ports *ebpf.Map) (*XdptxObjects, error) {
	spec, err := LoadXdptx()
	if err != nil {
		return nil, fmt.Errorf("load benchmark programs: %w", err)
	}
	var opts ebpf.CollectionOptions
	if ports != nil {
		info, err := ports.Info()
		if err != nil {
			return nil, fmt.Errorf("switch ports map info: %w", err)
		}
		// The switch's size may be configured; the rest of the definition is the same.
		spec.Maps[XdptxMapPorts].MaxEntries = info.MaxEntries
		opts.MapReplacements = map[string]*ebpf.Map{XdptxMapPorts: ports}
	}
	objs := &XdptxObjects{}
	if err := spec.LoadAndAssign(objs, &opts); err != nil {
		return nil, fmt.Errorf("load benchmark programs: %w", err)
	}
	return objs, nil
}

// bench is one measurement in progress.
type bench struct {
	opt     Options
	objs    *XdptxObjects
	sw      *loader.Switch
	topo    *topo.Topology
	pool    int
	res     *Result
	frame   []byte // worker 0's DATA frame of the job, as it arrives at its switch port
	vals    []int32
	ingress int // ifindex of worker 0's switch port
}

// run measures everything. It runs on a locked OS thread inside the switch namespace.
func (b *bench) run(ctx context.Context) (err error) {
	cpu, err := pinThread()
	if err != nil {
		return err
	}
	defer func() {
		if rerr := cpu.restore(); rerr != nil {
			// Leave the thread locked so that the runtime discards it rather than reuse a thread
			// pinned to one CPU.
			runtime.LockOSThread()
			err = errors.Join(err, rerr)
		}
	}()
	b.res.CPU = cpu.cpu

	release, err := b.attachDrivers()
	defer func() {
		if rerr := release(); rerr != nil {
			err = errors.Join(err, rerr)
		}
	}()
	if err != nil {
		return err
	}
	if err := b.setup(); err != nil {
		return err
	}
	if err := b.measureLive(ctx); err != nil {
		return err
	}
	return b.measurePaths(ctx)
}

// Names of the spare veth pair that holds the benchmark's own programs.
const (
	spareGen = "xcap-gen"
	spareTx  = "xcap-tx"
)

// attachDrivers attaches xdp_gen and xdp_tx to a spare veth pair (left down: it carries no
// traffic). BPF_PROG_RUN of an XDP program with Repeat > 1 installs the program in the kernel's
// XDP dispatcher for the duration of the call, and rewriting the dispatcher waits for an RCU
// grace period on the way in and out (milliseconds per call) unless the program is already
// attached somewhere; xdpagg_switch is attached to the ports, so the programs it is compared
// with and driven by must be attached too. release detaches them and deletes the pair; it is
// safe after a failed attachDrivers.
func (b *bench) attachDrivers() (release func() error, err error) {
	var links []link.Link
	made := false
	release = func() error {
		var errs []error
		for _, l := range links {
			if err := l.Close(); err != nil {
				errs = append(errs, fmt.Errorf("detach benchmark program: %w", err))
			}
		}
		if made {
			if l, err := netlink.LinkByName(spareGen); err == nil {
				if err := netlink.LinkDel(l); err != nil {
					errs = append(errs, fmt.Errorf("delete veth %s: %w", spareGen, err))
				}
			}
		}
		return errors.Join(errs...)
	}
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: spareGen}, PeerName: spareTx}
	if err := netlink.LinkAdd(veth); err != nil {
		return release, fmt.Errorf("create veth %s/%s: %w", spareGen, spareTx, err)
	}
	made = true
	for _, x := range []struct {
		ifname string
		prog   *ebpf.Program
	}{{spareGen, b.objs.XdpGen}, {spareTx, b.objs.XdpTx}} {
		ifc, err := netlink.LinkByName(x.ifname)
		if err != nil {
			return release, fmt.Errorf("find %s: %w", x.ifname, err)
		}
		l, err := link.AttachXDP(link.XDPOptions{Program: x.prog, Interface: ifc.Attrs().Index, Flags: link.XDPDriverMode})
		if err != nil {
			return release, fmt.Errorf("attach %s to %s: %w", progName(x.prog), x.ifname, err)
		}
		links = append(links, l)
	}
	return release, nil
}

// setup attaches the switch to every port, makes each host a member of the job and builds the
// job's frame.
func (b *bench) setup() error {
	// The job, admitted as `xdpagg job add` does. Its PS does not exist (no results come from
	// it); the quota is the whole pool, so the measurement never diverts to the PS.
	key, err := ctlauth.NewKey()
	if err != nil {
		return err
	}
	last := b.topo.Workers[len(b.topo.Workers)-1]
	if err := b.sw.Maps.AddJob(maps.Job{JobID: jobID, PS: netip.AddrPortFrom(psIP, loader.DefaultPort), PSIfindex: uint32(last.PortIndex),
		Workers: uint8(wire.MaxWorkers), MaxSlots: b.sw.Maps.PoolSize()}, key); err != nil {
		return fmt.Errorf("admit the job: %w", err)
	}
	for w, h := range b.topo.Workers {
		if err := b.sw.AttachPort(h.PortIndex); err != nil {
			return fmt.Errorf("attach switch to %s: %w", h.Port, err)
		}
		mb := maps.Member{
			JobID: jobID, WorkerID: uint8(w), Ifindex: uint32(h.PortIndex),
			Addr: netip.AddrPortFrom(h.IP, memberUDP+uint16(w)),
			MAC:  h.MAC, PortMAC: h.PortMAC, SrcIP: psIP,
		}
		if err := b.sw.Maps.PutMember(mb); err != nil {
			return fmt.Errorf("register worker %d: %w", w, err)
		}
	}
	b.ingress = b.topo.Workers[0].PortIndex
	// The generator sends every worker's contribution from worker 0's frame (its address, UDP
	// port and switch port), so that is where the ingress membership check must expect them.
	h0 := b.topo.Workers[0]
	for w := range wire.MaxWorkers { // the "aggregate" path runs 31 of a fan-in of 32
		if err := b.sw.Maps.PutWorker(jobID, uint8(w), netip.AddrPortFrom(h0.IP, memberUDP), uint32(b.ingress)); err != nil {
			return fmt.Errorf("enroll worker %d: %w", w, err)
		}
	}
	b.vals = make([]int32, b.opt.Values)
	if b.opt.Gradient {
		b.vals = gradient(b.opt.Values)
	}
	b.frame, err = b.dataFrame(b.opt.Workers)
	return err
}

// dataFrame is worker 0's DATA frame of the job (fragment seqBase, slot 0) in a job of fan-in
// fanIn, as it arrives at its switch port.
func (b *bench) dataFrame(fanIn int) ([]byte, error) {
	h0 := b.topo.Workers[0]
	payload, err := xdpaggPayload(wire.Header{
		Version: wire.Version, Type: wire.MsgData,
		Encoding: wire.EncFixed32, ScaleLog2: 16,
		Count: uint16(b.opt.Values), JobId: jobID, Seq: seqBase, AggIndex: 0,
		Bitmap0: 1, FanIn0: uint8(fanIn), WorkerId: 0,
	}, b.vals)
	if err != nil {
		return nil, err
	}
	return udpFrame(endpoints{
		dstMAC: h0.PortMAC, srcMAC: h0.MAC, srcIP: h0.IP, dstIP: psIP,
		srcPort: memberUDP, dstPort: wire.DefaultPort,
	}, payload)
}

// liveSlices is how many alternating slices the aggregation, ceiling and bare XDP_TX runs are
// cut into, so that all three see the same machine (frequency, neighbours) over the measurement.
const liveSlices = 4

// measureLive measures the live-frame rates: the aggregation mix, its payload-copy ceiling
// (xdp_copy behind the same generator) and bare XDP_TX in alternating slices, then the generator
// in front of XDP_TX.
func (b *bench) measureLive(ctx context.Context) error {
	if err := b.prepare(b.sw.Objects.XdpaggSwitch, b.opt.Workers, b.opt.Workers, 2*b.opt.Window); err != nil {
		return err
	}
	// The aggregation and the ceiling share the generator, whose position is per-CPU map state:
	// each keeps its own, swapped in for its slices, so that the switch's slots only ever see
	// the aggregation's own sequence of fragments.
	aggGen, err := b.genState()
	if err != nil {
		return err
	}
	ceilGen := slices.Clone(aggGen)
	var aggD, ceilD maps.Counters
	var aggSent, ceilSent uint64
	var agg, ceil *driver
	// slice runs one program behind the generator: its generator state and tail call in, the
	// run (or, the first time, the warm-up that makes the driver), the state and counters out.
	slice := func(next *ebpf.Program, gen []XdptxGenState, d **driver, dc *maps.Counters, sent *uint64, dur time.Duration) error {
		if err := b.objs.GenState.Put(uint32(0), gen); err != nil {
			return fmt.Errorf("restore generator: %w", err)
		}
		if err := b.setNext(next); err != nil {
			return err
		}
		c0, err := b.sw.Maps.ReadCounters()
		if err != nil {
			return err
		}
		if *d == nil {
			if *d, err = b.newDriver(b.objs.XdpGen); err != nil {
				return err
			}
		} else if err := (*d).runFor(ctx, dur); err != nil {
			return err
		}
		c1, err := b.sw.Maps.ReadCounters()
		if err != nil {
			return err
		}
		addCounters(dc, c1.Sub(c0))
		*sent = (*d).sent
		st, err := b.genState()
		if err != nil {
			return err
		}
		copy(gen, st)
		return nil
	}
	// Warm-ups first: they make the drivers.
	if err := slice(b.sw.Objects.XdpaggSwitch, aggGen, &agg, &aggD, &aggSent, 0); err != nil {
		return fmt.Errorf("aggregation mix: %w", err)
	}
	c0, err := b.copyStats()
	if err != nil {
		return err
	}
	if err := slice(b.objs.XdpCopy, ceilGen, &ceil, &ceilD, &ceilSent, 0); err != nil {
		return fmt.Errorf("payload-copy ceiling: %w", err)
	}
	tx, err := b.newDriver(b.objs.XdpTx)
	if err != nil {
		return fmt.Errorf("bare XDP_TX: %w", err)
	}
	per := b.opt.Duration / liveSlices
	var delivered uint64
	for range liveSlices {
		s0, err := b.sinkCount()
		if err != nil {
			return err
		}
		if err := slice(b.sw.Objects.XdpaggSwitch, aggGen, &agg, &aggD, &aggSent, per); err != nil {
			return fmt.Errorf("aggregation mix: %w", err)
		}
		s1, err := b.sinkCount()
		if err != nil {
			return err
		}
		delivered += s1 - s0
		if err := slice(b.objs.XdpCopy, ceilGen, &ceil, &ceilD, &ceilSent, per); err != nil {
			return fmt.Errorf("payload-copy ceiling: %w", err)
		}
		if err := tx.runFor(ctx, per); err != nil {
			return fmt.Errorf("bare XDP_TX: %w", err)
		}
	}
	b.res.AggCounters = aggD.Map()
	if err := b.checkMix(aggD, aggSent); err != nil {
		return err
	}
	c1, err := b.copyStats()
	if err != nil {
		return err
	}
	if err := b.checkCeiling(ceilD, c1, c0, ceilSent); err != nil {
		return err
	}
	b.res.AggPPS = agg.pps()
	b.res.AggElementsPerSec = b.res.AggPPS * float64(b.opt.Values)
	b.res.HostRxPPS = float64(delivered) / agg.elapsed.Seconds()
	b.res.CeilingPPS = ceil.pps()
	b.res.CeilingElementsPerSec = b.res.CeilingPPS * float64(b.opt.Values)
	b.res.OfCeiling = b.res.AggPPS / b.res.CeilingPPS
	b.res.TxPPS = tx.pps()
	b.res.Ratio = b.res.AggPPS / b.res.TxPPS

	// The generator in front of XDP_TX: the aggregation run's driver with nothing to aggregate.
	if err := b.prepare(b.objs.XdpTx, b.opt.Workers, b.opt.Workers, 2*b.opt.Window); err != nil {
		return err
	}
	gtx, err := b.newDriver(b.objs.XdpGen)
	if err == nil {
		err = gtx.runFor(ctx, b.opt.Duration)
	}
	if err != nil {
		return fmt.Errorf("generator + XDP_TX: %w", err)
	}
	b.res.GenTxPPS = gtx.pps()
	return nil
}

func addCounters(dst *maps.Counters, d maps.Counters) {
	for i := range d {
		dst[i] += d[i]
	}
}

// genState reads the generator's per-CPU position.
func (b *bench) genState() ([]XdptxGenState, error) {
	var st []XdptxGenState
	if err := b.objs.GenState.Lookup(uint32(0), &st); err != nil {
		return nil, fmt.Errorf("read generator state: %w", err)
	}
	return st, nil
}

// copyStats sums xdp_copy's per-CPU statistics (fold aside).
func (b *bench) copyStats() (XdptxCopyStats, error) {
	var per []XdptxCopyStats
	var sum XdptxCopyStats
	if err := b.objs.CopyStats.Lookup(uint32(0), &per); err != nil {
		return sum, fmt.Errorf("read ceiling statistics: %w", err)
	}
	for _, p := range per {
		sum.Packets += p.Packets
		sum.Broadcasts += p.Broadcasts
		sum.Errors += p.Errors
	}
	return sum, nil
}

// checkCeiling verifies that the ceiling runs did what the aggregation mix does with bytes and
// copies: every packet's values touched, one in Workers broadcast, Workers egress copies each
// (xdpagg_egress counts them in the switch's counters), and the switch program itself never ran.
func (b *bench) checkCeiling(d maps.Counters, now, before XdptxCopyStats, sent uint64) error {
	w := uint64(b.opt.Workers)
	pk, bc := now.Packets-before.Packets, now.Broadcasts-before.Broadcasts
	slack := w * uint64(b.opt.Window)
	switch {
	// sent is a lower bound: a live-frame run interrupted by a signal (EINTR, e.g. the Go
	// runtime's preemption) is retried whole by cilium/ebpf, so the program may see more frames
	// than the driver counted, never fewer.
	case now.Errors != before.Errors || pk < sent || d[maps.CntRx] != 0:
		return fmt.Errorf("%w: ceiling run sent %d packets, xdp_copy touched %d (%d errors), switch counted %v",
			ErrMix, sent, pk, now.Errors-before.Errors, nonZero(d))
	case bc*w > pk || pk-bc*w > slack:
		return fmt.Errorf("%w: ceiling broadcast %d of %d packets, want 1 in %d", ErrMix, bc, pk, w)
	case d[maps.CntEgressTx]*100 < bc*w*99 || d[maps.CntEgressSkip] != 0:
		return fmt.Errorf("%w: %d ceiling broadcasts made %d egress copies to %d ports: %v", ErrMix, bc, d[maps.CntEgressTx], w, nonZero(d))
	}
	return nil
}

// checkMix verifies that the aggregation run drove the mix it was designed for: every packet
// summed, one in Workers completing and broadcast to every port, nothing else.
func (b *bench) checkMix(d maps.Counters, sent uint64) error {
	w := uint64(b.opt.Workers)
	rx, agg, done := d[maps.CntRx], d[maps.CntAggregated], d[maps.CntCompleted]
	bad := d[maps.CntDuplicate] + d[maps.CntCollision] + d[maps.CntToPS] + d[maps.CntMalformed] +
		d[maps.CntRedirectErr] + d[maps.CntEgressSkip] + d[maps.CntShadowTx]
	slack := w * uint64(b.opt.Window) // a round cut short by the end of the run
	switch {
	case rx < sent || agg != rx || bad != 0:
		return fmt.Errorf("%w: aggregation run sent %d packets, switch counted %v", ErrMix, sent, nonZero(d))
	case done*w > rx || rx-done*w > slack:
		return fmt.Errorf("%w: %d of %d packets completed a sum, want 1 in %d: %v", ErrMix, done, rx, w, nonZero(d))
	case d[maps.CntEgressTx]*100 < done*w*99:
		return fmt.Errorf("%w: %d completions broadcast only %d copies to %d ports: %v", ErrMix, done, d[maps.CntEgressTx], w, nonZero(d))
	}
	return nil
}

func nonZero(c maps.Counters) map[string]uint64 {
	out := map[string]uint64{}
	for name, v := range c.Map() {
		if v != 0 {
			out[name] = v
		}
	}
	return out
}

// driver runs one program on b.frame in live-frame mode, in chunks of about 10ms of
// wall-clock time each, and accumulates what it timed.
type driver struct {
	prog    *ebpf.Program
	opts    ebpf.RunOptions
	chunk   uint32
	sent    uint64        // packets, warm-up included; a lower bound (a run retried after EINTR runs again)
	timed   uint64        // packets of the timed chunks
	elapsed time.Duration // of the timed chunks
}

// newDriver makes a driver and runs its warm-up chunk, which also sizes the chunks.
func (b *bench) newDriver(prog *ebpf.Program) (*driver, error) {
	d := &driver{prog: prog, opts: ebpf.RunOptions{
		Data:      b.frame,
		Flags:     unix.BPF_F_TEST_XDP_LIVE_FRAMES,
		BatchSize: uint32(b.opt.Batch),
		Context:   xdpMd{DataEnd: uint32(len(b.frame)), IngressIfindex: uint32(b.ingress)},
	}}
	const warm = 8192
	d.chunk = warm
	start := time.Now()
	if err := d.run(); err != nil {
		return nil, err
	}
	per := time.Since(start) / warm
	d.chunk = 1 << 22
	if per > 0 {
		d.chunk = uint32(min(1<<22, max(1024, int64(10*time.Millisecond/per))))
	}
	return d, nil
}

func (d *driver) run() error {
	d.opts.Repeat = d.chunk
	if _, err := d.prog.Run(&d.opts); err != nil {
		return fmt.Errorf("live-frame run of %s: %w", progName(d.prog), err)
	}
	d.sent += uint64(d.chunk)
	return nil
}

// runFor runs timed chunks until dur has passed (at least one chunk).
func (d *driver) runFor(ctx context.Context, dur time.Duration) error {
	start := time.Now()
	for {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("capacity measurement: %w", err)
		}
		if err := d.run(); err != nil {
			return err
		}
		d.timed += uint64(d.chunk)
		if el := time.Since(start); el >= dur {
			d.elapsed += el
			return nil
		}
	}
}

func (d *driver) pps() float64 { return float64(d.timed) / d.elapsed.Seconds() }

func progName(p *ebpf.Program) string {
	if info, err := p.Info(); err == nil && info.Name != "" {
		return info.Name
	}
	return p.String()
}

// prepare frees every slot, configures the generator (workers contributors of fan-in fanIn, each
// sending Window fragments in a row, over slots slots), rewinds it and puts next behind it.
func (b *bench) prepare(next *ebpf.Program, workers, fanIn, slots int) error {
	if err := b.sw.Maps.ResetSlots(); err != nil {
		return err
	}
	cfg := XdptxGenCfg{
		Workers: uint32(workers), FanIn: uint32(fanIn), Window: uint32(b.opt.Window),
		Slots: uint32(slots), SeqBase: seqBase, Nvals: uint32(b.opt.Values),
	}
	if b.opt.Gradient {
		cfg.Restore = 1
	}
	if len(cfg.Vals) < b.opt.Values {
		return fmt.Errorf("%w: %d values per packet: the generator holds at most %d", ErrOptions, b.opt.Values, len(cfg.Vals))
	}
	copy(cfg.Tmpl[:], b.frame[:offVals])
	copy(cfg.Vals[:], b.vals)
	if err := b.objs.GenCfg.Put(uint32(0), &cfg); err != nil {
		return fmt.Errorf("configure generator: %w", err)
	}
	ncpu, err := ebpf.PossibleCPU()
	if err != nil {
		return fmt.Errorf("count CPUs: %w", err)
	}
	if err := b.objs.GenState.Put(uint32(0), make([]XdptxGenState, ncpu)); err != nil {
		return fmt.Errorf("rewind generator: %w", err)
	}
	return b.setNext(next)
}

func (b *bench) setNext(p *ebpf.Program) error {
	if err := b.objs.Next.Put(uint32(0), p); err != nil {
		return fmt.Errorf("put %s behind the generator: %w", progName(p), err)
	}
	return nil
}

func (b *bench) sinkCount() (uint64, error) {
	var per []uint64
	if err := b.objs.SinkCount.Lookup(uint32(0), &per); err != nil {
		return 0, fmt.Errorf("read host sink counter: %w", err)
	}
	var n uint64
	for _, v := range per {
		n += v
	}
	return n, nil
}

// pathReps is how many times each Program.Run path is measured; the median is reported.
const pathReps = 5

// pathRun is one Program.Run path measurement.
type pathRun struct {
	name    string
	prepare func() error
	prog    *ebpf.Program
	frame   []byte
	check   func(d maps.Counters) bool // the counters say every run took the path
}

// measurePaths measures the non-live Program.Run time of each switch path: the median over
// pathReps measurements of RunRepeat runs each, every one from a freshly prepared state.
func (b *bench) measurePaths(ctx context.Context) error {
	const n = runWarmup + RunRepeat
	resetSlots := func() error { return b.sw.Maps.ResetSlots() }
	// Fan-in 32 for the duplicate frame, so that its first run does not complete (and rewrite)
	// it whatever opt.Workers is: without live frames the program reruns the very same buffer.
	dup, err := b.dataFrame(wire.MaxWorkers)
	if err != nil {
		return err
	}
	nonAgg := append([]byte(nil), b.frame...)
	nonAgg[offUDP+2], nonAgg[offUDP+3] = 0x23, 0x29 // UDP port 9001: not xdpagg traffic
	runs := []pathRun{
		// The generator alone, in front of XDP_TX (which costs next to nothing without live frames).
		{PathGenerator, func() error {
			return b.prepare(b.objs.XdpTx, b.opt.Workers, b.opt.Workers, 2*b.opt.Window)
		}, b.objs.XdpGen, b.frame, func(d maps.Counters) bool { return d == maps.Counters{} }},
		// 31 workers of a fan-in of 32: no fragment completes, every packet is summed into its
		// slot (the first of each fragment reserves the slot: the same value loop).
		{PathAggregate, func() error {
			return b.prepare(b.sw.Objects.XdpaggSwitch, aggregateWorkers, wire.MaxWorkers, b.pool)
		}, b.objs.XdpGen, b.frame, func(d maps.Counters) bool {
			return d[maps.CntAggregated] == d[maps.CntRx] && d[maps.CntRx] >= n && d[maps.CntCompleted] == 0 && errorCount(d) == 0
		}},
		// Fan-in 1: every packet is a new fragment that it completes.
		{PathComplete, func() error {
			return b.prepare(b.sw.Objects.XdpaggSwitch, 1, 1, 2*b.opt.Window)
		}, b.objs.XdpGen, b.frame, func(d maps.Counters) bool {
			return d[maps.CntCompleted] == d[maps.CntRx] && d[maps.CntRx] >= n && errorCount(d) == 0
		}},
		// The same frame over and over: all but the first are duplicates.
		{PathDuplicate, resetSlots, b.sw.Objects.XdpaggSwitch, dup, func(d maps.Counters) bool {
			return d[maps.CntDuplicate]+1 == d[maps.CntRx] && d[maps.CntRx] >= n
		}},
		// A UDP datagram of the same size to another port.
		{PathNonAgg, resetSlots, b.sw.Objects.XdpaggSwitch, nonAgg, func(d maps.Counters) bool {
			return d[maps.CntNonAgg] >= n && d[maps.CntRx] == 0
		}},
	}
	out := map[string]float64{}
	for _, r := range runs {
		var ns []float64
		for range pathReps {
			if err := r.prepare(); err != nil {
				return err
			}
			v, d, err := b.runNs(ctx, r.prog, r.frame)
			if err != nil {
				return fmt.Errorf("%s path: %w", r.name, err)
			}
			if !r.check(d) {
				return fmt.Errorf("%w: %s path: %d runs, switch counted %v", ErrMix, r.name, n, nonZero(d))
			}
			ns = append(ns, v)
		}
		out[r.name] = median(ns)
	}
	out[PathAggregate] -= out[PathGenerator]
	out[PathComplete] -= out[PathGenerator]
	b.res.RunNsPerPacket = out
	return nil
}

func median(v []float64) float64 {
	v = slices.Clone(v)
	slices.Sort(v)
	if len(v)%2 == 1 {
		return v[len(v)/2]
	}
	return (v[len(v)/2-1] + v[len(v)/2]) / 2
}

// errorCount sums the counters no designed path should move.
func errorCount(d maps.Counters) uint64 {
	return d[maps.CntDuplicate] + d[maps.CntCollision] + d[maps.CntToPS] + d[maps.CntMalformed] +
		d[maps.CntRedirectErr] + d[maps.CntShadowTx]
}

// runNs runs prog on frame runWarmup times, then RunRepeat times, without live frames, and
// returns the kernel's average time per run of the second batch and the switch's counter deltas
// over both.
func (b *bench) runNs(ctx context.Context, prog *ebpf.Program, frame []byte) (float64, maps.Counters, error) {
	var d maps.Counters
	if err := ctx.Err(); err != nil {
		return 0, d, fmt.Errorf("capacity measurement: %w", err)
	}
	c0, err := b.sw.Maps.ReadCounters()
	if err != nil {
		return 0, d, err
	}
	// The context puts the frame on worker 0's switch port, where the job's workers joined:
	// the switch's membership check looks at the ingress ifindex.
	run := func(repeat int) (time.Duration, error) {
		// Program.Benchmark takes no context, so time the run by the wall clock: one syscall
		// amortised over `repeat` runs.
		opts := &ebpf.RunOptions{Data: frame, Repeat: uint32(repeat), Context: xdpMd{DataEnd: uint32(len(frame)), IngressIfindex: uint32(b.ingress)}}
		start := time.Now()
		if _, err := prog.Run(opts); err != nil {
			return 0, fmt.Errorf("test run of %s: %w", progName(prog), err)
		}
		return time.Since(start) / time.Duration(max(repeat, 1)), nil
	}
	if _, err := run(runWarmup); err != nil {
		return 0, d, err
	}
	per, err := run(RunRepeat)
	if err != nil {
		return 0, d, err
	}
	c1, err := b.sw.Maps.ReadCounters()
	if err != nil {
		return 0, d, err
	}
	return float64(per.Nanoseconds()), c1.Sub(c0), nil
}

// pinned is the calling thread pinned to one CPU.
type pinned struct {
	cpu  int
	orig unix.CPUSet
}

// pinThread pins the calling (locked) thread to the highest-numbered CPU it may run on.
func pinThread() (*pinned, error) {
	p := &pinned{cpu: -1}
	if err := unix.SchedGetaffinity(0, &p.orig); err != nil {
		return nil, fmt.Errorf("read CPU affinity: %w", err)
	}
	for i := len(p.orig)*64 - 1; i >= 0; i-- {
		if p.orig.IsSet(i) {
			p.cpu = i
			break
		}
	}
	if p.cpu < 0 {
		return nil, errors.New("read CPU affinity: empty CPU set")
	}
	var one unix.CPUSet
	one.Set(p.cpu)
	if err := unix.SchedSetaffinity(0, &one); err != nil {
		return nil, fmt.Errorf("pin to CPU %d: %w", p.cpu, err)
	}
	return p, nil
}

func (p *pinned) restore() error {
	if err := unix.SchedSetaffinity(0, &p.orig); err != nil {
		return fmt.Errorf("restore CPU affinity: %w", err)
	}
	return nil
}

// programSizes returns the instruction counts of the switch programs: in their specs, and as
// processed by the verifier.
func programSizes(sw *loader.Switch) (map[string]int, map[string]uint32, error) {
	spec, err := loader.Spec(sw.Config)
	if err != nil {
		return nil, nil, err
	}
	progs := map[string]*ebpf.Program{
		bpf.XdpaggProgXdpaggSwitch: sw.Objects.XdpaggSwitch,
		bpf.XdpaggProgXdpaggEgress: sw.Objects.XdpaggEgress,
		bpf.XdpaggProgXdpaggPass:   sw.Objects.XdpaggPass,
	}
	insns := map[string]int{}
	verified := map[string]uint32{}
	var missing []string
	for name, p := range progs {
		ps, ok := spec.Programs[name]
		if !ok {
			return nil, nil, fmt.Errorf("switch object has no program %s", name)
		}
		insns[name] = len(ps.Instructions)
		info, err := p.Info()
		if err != nil {
			return nil, nil, fmt.Errorf("program info of %s: %w", name, err)
		}
		if n, ok := info.VerifiedInstructions(); ok {
			verified[name] = n
		} else {
			missing = append(missing, name)
		}
	}
	if len(missing) == 0 {
		return insns, verified, nil
	}
	// Kernels before 5.16 do not report the count: load again with verifier statistics.
	coll, err := ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{
		Programs: ebpf.ProgramOptions{LogLevel: ebpf.LogLevelStats},
	})
	if err != nil {
		return nil, nil, fmt.Errorf("load switch programs with verifier statistics: %w", err)
	}
	defer coll.Close()
	for _, name := range missing {
		p := coll.Programs[name]
		if p == nil {
			return nil, nil, fmt.Errorf("switch collection has no program %s", name)
		}
		verified[name] = processedInsns(p.VerifierLog)
	}
	return insns, verified, nil
}

var processedRE = regexp.MustCompile(`processed (\d+) insns`)

// processedInsns sums the "processed N insns" lines of a verifier log.
func processedInsns(log string) uint32 {
	var n uint64
	for _, m := range processedRE.FindAllStringSubmatch(log, -1) {
		v, err := strconv.ParseUint(m[1], 10, 32)
		if err == nil {
			n += v
		}
	}
	return uint32(min(n, uint64(^uint32(0))))
}
