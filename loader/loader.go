// Package loader loads the xdpagg switch programs with their runtime configuration, attaches them
// to switch ports, and pins maps and links under a per-switch bpffs directory so other processes
// (xdpagg inspect) can read a live switch.
//
// Calls that name interfaces (Attach*) act in the network namespace of the calling OS thread:
// callers that work in another namespace lock their thread and enter it first.
package loader

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/rlimit"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/wire"
)

// Sentinel errors; wrapped with details by the functions that return them.
var (
	ErrConfig      = errors.New("invalid switch configuration")
	ErrAttached    = errors.New("interface already attached")
	ErrNotAttached = errors.New("interface not attached")
	ErrNotBPFFS    = errors.New("not a bpffs directory")
)

// Limits of the compiled program, from bpf/xdpagg.h.
const (
	// MaxPoolSize bounds the slot array: each slot holds wire.MaxValues values (3,360 bytes a
	// slot), so 128 Ki slots take about 420 MiB of kernel memory.
	MaxPoolSize = 1 << 17
	DefaultPort = wire.DefaultPort
	// MaxRegArrays bounds the hot-parameter register arrays (3 KiB each, twice): 48 MiB.
	MaxRegArrays = 8192
)

// Config is the switch's runtime configuration, written into the program's `volatile const`
// globals before load.
type Config struct {
	// Port is the UDP port of xdpagg traffic (default 9510).
	Port uint16
	// PoolSize is the number of aggregator slots (default 4096). Workers must use the same value.
	PoolSize uint32
	// SlotTimeout is how long a completed slot is kept for retransmits before any job may take it
	// (default 5s). A job's own later fragments reuse its slots without waiting.
	SlotTimeout time.Duration
	// Generic attaches in generic (skb) XDP mode instead of native mode.
	Generic bool
	// CacheResults makes the switch copy every completed sum to the `results` ring buffer, for
	// the agent's retransmit cache. Whoever sets it must consume the ring (agent.Run does);
	// when it is full, copies are dropped and counted (cache_full).
	CacheResults bool
	// PortRate is each port's capacity in bytes per second for ECN marking: the switch keeps a
	// phantom queue per port of the frames it passes to the kernel and of xdpagg DATA (not
	// RESULTs, control messages or frames it drops), drained at this rate, and marks xdpagg
	// DATA with F_ECN while its backlog exceeds ECNThreshold (default 64 KiB). 0: no marking.
	PortRate     uint64
	ECNThreshold uint64
	// NoSourceCheck turns off strict source validation (uRPF against the switch namespace's
	// routes, docs/security.md). Only for BPF_PROG_TEST_RUN tests and benchmarks that feed
	// frames no route explains: a switch on a fabric must keep it on.
	NoSourceCheck bool
	// ControlRate is how many control messages per second each port may send to the agent
	// (default 20,000), with bursts of ControlBurst (default 2,000); the rest are dropped in XDP
	// (ctl_limited), so one port's flood cannot crowd out the others at the agent's socket.
	ControlRate  uint32
	ControlBurst uint32
	// RegArrays is the number of hot-parameter register arrays the switch holds for sparse
	// jobs (default 512), each of RegSlots slots (default and most bpf.RegSlots, 256); a sparse
	// job owns up to bpf.JobMaxArrays (256) of them (job add --reg-arrays). Memory: 2
	// (iteration parities) x RegArrays x 3 KiB (an 8-byte cell and a 4-byte hit counter per
	// compiled slot), whatever RegSlots is: 3 MiB by default.
	RegArrays uint32
	RegSlots  uint32
	// Object, when set, is the path of a compiled switch object (bpf/xdpagg_bpfel.o of another
	// revision, with the same maps and variables) loaded instead of the embedded one, so that a
	// benchmark can compare program revisions in one run (xdpagg bench --switch-object).
	Object string
}

// WithDefaults returns c with zero fields set to their defaults.
func (c Config) WithDefaults() Config {
	if c.Port == 0 {
		c.Port = DefaultPort
	}
	if c.PoolSize == 0 {
		c.PoolSize = 4096
	}
	if c.SlotTimeout == 0 {
		c.SlotTimeout = 5 * time.Second
	}
	if c.ControlRate == 0 {
		c.ControlRate = 20000
	}
	if c.ControlBurst == 0 {
		c.ControlBurst = 2000
	}
	if c.RegArrays == 0 {
		c.RegArrays = 512
	}
	if c.RegSlots == 0 {
		c.RegSlots = bpf.RegSlots
	}
	return c
}

// Validate reports what to change in a configuration that cannot work.
func (c Config) Validate() error {
	if c.PoolSize == 0 || c.PoolSize > MaxPoolSize {
		return fmt.Errorf("%w: pool size %d: use 1..%d slots", ErrConfig, c.PoolSize, MaxPoolSize)
	}
	if c.SlotTimeout < time.Millisecond {
		return fmt.Errorf("%w: slot timeout %v: use at least 1ms", ErrConfig, c.SlotTimeout)
	}
	if c.RegArrays > MaxRegArrays {
		return fmt.Errorf("%w: %d register arrays: use at most %d", ErrConfig, c.RegArrays, MaxRegArrays)
	}
	if c.RegSlots > bpf.RegSlots {
		return fmt.Errorf("%w: %d slots per register array: use 1..%d", ErrConfig, c.RegSlots, bpf.RegSlots)
	}
	if c.ControlRate > 1e9 {
		return fmt.Errorf("%w: control rate %d/s: use at most 1e9", ErrConfig, c.ControlRate)
	}
	return nil
}

// Switch is a loaded xdpagg switch: its programs, maps and port attachments.
type Switch struct {
	Config  Config
	Objects bpf.XdpaggObjects
	Maps    *maps.Maps
	links   map[int]link.Link // by ifindex
	pinDir  string
	// adopting: made by Adopt; ports take over their pinned links.
	adopting bool
}

// Spec returns the compiled collection spec with cfg applied (constants set, pool sized).
func Spec(cfg Config) (*ebpf.CollectionSpec, error) {
	var spec *ebpf.CollectionSpec
	var err error
	if cfg.Object != "" {
		spec, err = ebpf.LoadCollectionSpec(cfg.Object)
	} else {
		spec, err = bpf.LoadXdpagg()
	}
	if err != nil {
		return nil, fmt.Errorf("load BPF object: %w", err)
	}
	sets := map[string]any{
		bpf.XdpaggVarAggPort:       cfg.Port,
		bpf.XdpaggVarPoolSize:      cfg.PoolSize,
		bpf.XdpaggVarSlotTimeoutNs: uint64(cfg.SlotTimeout.Nanoseconds()),
		bpf.XdpaggVarCacheResults:  uint32(0),
		bpf.XdpaggVarPortRateBps:   cfg.PortRate,
		bpf.XdpaggVarSourceCheck:   uint32(1),
		bpf.XdpaggVarRegArrays:     cfg.RegArrays,
		bpf.XdpaggVarRegSlots:      cfg.RegSlots,
	}
	if cfg.NoSourceCheck {
		sets[bpf.XdpaggVarSourceCheck] = uint32(0)
	}
	if cfg.ControlRate > 0 {
		interval := uint64(1e9) / uint64(cfg.ControlRate)
		sets[bpf.XdpaggVarCtlIntervalNs] = interval
		sets[bpf.XdpaggVarCtlBurstNs] = interval * uint64(max(cfg.ControlBurst, 1))
	}
	if cfg.ECNThreshold > 0 {
		sets[bpf.XdpaggVarEcnThresholdBytes] = cfg.ECNThreshold
	}
	if cfg.CacheResults {
		sets[bpf.XdpaggVarCacheResults] = uint32(1)
	}
	for name, v := range sets {
		vs, ok := spec.Variables[name]
		if !ok {
			return nil, fmt.Errorf("BPF object has no variable %q", name)
		}
		if err := vs.Set(v); err != nil {
			return nil, fmt.Errorf("set %s: %w", name, err)
		}
	}
	spec.Maps[bpf.XdpaggMapSlots].MaxEntries = cfg.PoolSize
	spec.Maps[bpf.XdpaggMapRegisters].MaxEntries = 2 * max(cfg.RegArrays, 1)
	return spec, nil
}

// Load loads the switch programs and maps into the kernel. Nothing is attached yet.
func Load(cfg Config) (*Switch, error) {
	cfg, spec, err := prepare(cfg)
	if err != nil {
		return nil, err
	}
	s := &Switch{Config: cfg, links: map[int]link.Link{}}
	if err := spec.LoadAndAssign(&s.Objects, nil); err != nil {
		return nil, fmt.Errorf("load switch programs: %w", err)
	}
	s.Maps = maps.New(&s.Objects)
	return s, nil
}

// prepare is what Load and Adopt do first: defaults, validation, the memlock limit, and the spec
// with the configuration applied.
func prepare(cfg Config) (Config, *ebpf.CollectionSpec, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return cfg, nil, err
	}
	if err := rlimit.RemoveMemlock(); err != nil {
		return cfg, nil, fmt.Errorf("remove memlock rlimit: %w", err)
	}
	spec, err := Spec(cfg)
	return cfg, spec, err
}

// ErrIncompatible: the pinned switch a restart would adopt does not fit the configuration (a
// different pool size, register count or map layout).
var ErrIncompatible = errors.New("pinned switch state does not fit this configuration")

// Adopt loads the switch programs over the state a switch pinned under dir (Pin) and left behind
// (an agent that was killed, or is being upgraded): every pinned map is reused as it is, with
// the slots, registers, jobs, keys, members and counters in it, and AttachPort moves each port
// whose link is still pinned there to the new program in one step (the XDP link's program is
// replaced, so no packet finds the port without a program). Maps that were not pinned (scratch,
// the retransmit-cache ring, the phantom queues) start empty. The configuration must match what
// the pinned maps were made with (pool size, register arrays): ErrIncompatible otherwise.
func Adopt(cfg Config, dir string) (*Switch, error) {
	if err := CheckBPFFS(filepath.Dir(filepath.Clean(dir))); err != nil {
		return nil, err
	}
	cfg, spec, err := prepare(cfg)
	if err != nil {
		return nil, err
	}
	for _, name := range maps.PinnedMaps {
		spec.Maps[name].Pinning = ebpf.PinByName
	}
	s := &Switch{Config: cfg, links: map[int]link.Link{}}
	opts := &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: filepath.Join(dir, "maps")}}
	if err := spec.LoadAndAssign(&s.Objects, opts); err != nil {
		if errors.Is(err, ebpf.ErrMapIncompatible) {
			return nil, fmt.Errorf("%w: %w", ErrIncompatible, err)
		}
		return nil, fmt.Errorf("load switch programs over %s: %w", dir, err)
	}
	s.Maps = maps.New(&s.Objects)
	s.pinDir = dir
	s.adopting = true
	// The garbage collector: the new program replaces the old one's pin.
	gcPin := filepath.Join(dir, maps.PinnedGC)
	if err := os.MkdirAll(filepath.Dir(gcPin), 0o700); err != nil {
		s.Close()
		return nil, fmt.Errorf("create pin directory: %w", err)
	}
	if err := os.Remove(gcPin); err != nil && !errors.Is(err, os.ErrNotExist) {
		s.Close()
		return nil, fmt.Errorf("replace the garbage collector's pin: %w", err)
	}
	if err := s.Objects.XdpaggGc.Pin(gcPin); err != nil {
		s.Close()
		return nil, fmt.Errorf("pin garbage collector: %w", err)
	}
	if err := os.MkdirAll(filepath.Join(dir, "links"), 0o700); err != nil {
		s.Close()
		return nil, fmt.Errorf("create pin directory: %w", err)
	}
	return s, nil
}

// PinnedPorts lists the ifindexes whose XDP links are pinned under dir (a switch's pin directory).
func PinnedPorts(dir string) ([]int, error) {
	ents, err := os.ReadDir(filepath.Join(dir, "links"))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read pinned links: %w", err)
	}
	var out []int
	for _, e := range ents {
		var i int
		if _, err := fmt.Sscan(e.Name(), &i); err == nil && i > 0 {
			out = append(out, i)
		}
	}
	return out, nil
}

// DropPinnedPort detaches a port a previous run of the switch left attached (its link pinned
// under the pin directory) that this run does not take: its pin goes, and with it the program.
func (s *Switch) DropPinnedPort(ifindex int) error {
	if s.pinDir == "" {
		return nil
	}
	l, err := link.LoadPinnedLink(s.linkPin(ifindex), nil)
	if err != nil {
		_ = os.Remove(s.linkPin(ifindex)) // a link whose interface went away
		return nil
	}
	_ = s.Objects.Ports.Delete(uint32(ifindex))
	return errors.Join(l.Unpin(), l.Close())
}

// AttachPort attaches the switch program to a port (an ifindex in the calling thread's network
// namespace) and adds it to the broadcast set that results go out of. On a switch made by Adopt,
// a port whose link is still pinned keeps its link, which now runs the new program.
func (s *Switch) AttachPort(ifindex int) error {
	if _, ok := s.links[ifindex]; ok {
		return fmt.Errorf("%w: ifindex %d", ErrAttached, ifindex)
	}
	flags := link.XDPDriverMode
	if s.Config.Generic {
		flags = link.XDPGenericMode
	}
	var l link.Link
	adopted := false
	if s.adopting && s.pinDir != "" {
		if old, err := link.LoadPinnedLink(s.linkPin(ifindex), nil); err == nil {
			if err := old.Update(s.Objects.XdpaggSwitch); err != nil {
				old.Close()
				return fmt.Errorf("move ifindex %d to the new program: %w", ifindex, err)
			}
			l, adopted = old, true
		}
	}
	if l == nil {
		var err error
		l, err = link.AttachXDP(link.XDPOptions{Program: s.Objects.XdpaggSwitch, Interface: ifindex, Flags: flags})
		if err != nil {
			return fmt.Errorf("attach XDP to ifindex %d: %w", ifindex, err)
		}
	}
	val := bpf.XdpaggBpfDevmapVal{Ifindex: uint32(ifindex)}
	val.BpfProg.Fd = int32(s.Objects.XdpaggEgress.FD())
	if err := s.Objects.Ports.Put(uint32(ifindex), &val); err != nil {
		l.Close()
		return fmt.Errorf("add ifindex %d to the broadcast ports: %w", ifindex, err)
	}
	s.links[ifindex] = l
	if s.pinDir != "" && !adopted {
		if err := l.Pin(s.linkPin(ifindex)); err != nil {
			return fmt.Errorf("pin link of ifindex %d: %w", ifindex, err)
		}
	}
	return nil
}

// DetachPort removes a port from the switch.
func (s *Switch) DetachPort(ifindex int) error {
	l, ok := s.links[ifindex]
	if !ok {
		return fmt.Errorf("%w: ifindex %d", ErrNotAttached, ifindex)
	}
	delete(s.links, ifindex)
	err := s.Objects.Ports.Delete(uint32(ifindex))
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		err = nil // the kernel drops devmap entries of interfaces that went away
	}
	if s.pinDir != "" {
		_ = l.Unpin()
	}
	return errors.Join(err, l.Close())
}

// Ports returns the attached ifindexes.
func (s *Switch) Ports() []int {
	out := make([]int, 0, len(s.links))
	for i := range s.links {
		out = append(out, i)
	}
	return out
}

// Pin pins the maps (dir/maps/NAME) and, from now on, the port links (dir/links/IFINDEX) under
// dir, whose parent must be on a bpffs (see MountBPFFS). Close removes the pins.
func (s *Switch) Pin(dir string) error {
	if err := CheckBPFFS(filepath.Dir(filepath.Clean(dir))); err != nil {
		return err
	}
	for _, sub := range []string{"maps", "links", "progs"} {
		if err := os.MkdirAll(filepath.Join(dir, sub), 0o700); err != nil {
			return fmt.Errorf("create pin directory: %w", err)
		}
	}
	// Record the directory first, so a failure part-way still has Close remove what was pinned.
	s.pinDir = dir
	for _, m := range s.pinnedMaps() {
		name := m.name
		if err := m.m.Pin(filepath.Join(dir, "maps", name)); err != nil {
			s.unpin()
			return fmt.Errorf("pin map %s: %w", name, err)
		}
	}
	if err := s.Objects.XdpaggGc.Pin(filepath.Join(dir, maps.PinnedGC)); err != nil {
		s.unpin()
		return fmt.Errorf("pin garbage collector: %w", err)
	}
	for ifindex, l := range s.links {
		if err := l.Pin(s.linkPin(ifindex)); err != nil {
			return fmt.Errorf("pin link of ifindex %d: %w", ifindex, err)
		}
	}
	return nil
}

type namedMap struct {
	name string
	m    *ebpf.Map
}

// pinnedMaps are the maps other processes open (maps.OpenPinned): all but the agent's ring buffer.
func (s *Switch) pinnedMaps() []namedMap {
	o := &s.Objects
	byName := map[string]*ebpf.Map{
		bpf.XdpaggMapSlots: o.Slots, bpf.XdpaggMapMembers: o.Members, bpf.XdpaggMapPorts: o.Ports,
		bpf.XdpaggMapCounters: o.Counters, bpf.XdpaggMapWorkers: o.Workers, bpf.XdpaggMapJobs: o.Jobs,
		bpf.XdpaggMapJobKeys: o.JobKeys, bpf.XdpaggMapCtlBudget: o.CtlBudget,
		bpf.XdpaggMapRegisters: o.Registers, bpf.XdpaggMapSparseJobs: o.SparseJobs, bpf.XdpaggMapRecircHist: o.RecircHist,
	}
	out := make([]namedMap, 0, len(maps.PinnedMaps))
	for _, n := range maps.PinnedMaps {
		out = append(out, namedMap{n, byName[n]})
	}
	return out
}

func (s *Switch) linkPin(ifindex int) string {
	return filepath.Join(s.pinDir, "links", fmt.Sprint(ifindex))
}

// Close detaches every port, unpins everything it pinned and releases the programs and maps.
func (s *Switch) Close() error {
	var errs []error
	for ifindex := range s.links {
		errs = append(errs, s.DetachPort(ifindex))
	}
	errs = append(errs, s.unpin())
	errs = append(errs, s.Objects.Close())
	return errors.Join(errs...)
}

// unpin removes the map pins and the pin directories (link pins go with DetachPort).
func (s *Switch) unpin() error {
	if s.pinDir == "" {
		return nil
	}
	var errs []error
	for _, m := range s.pinnedMaps() {
		errs = append(errs, m.m.Unpin()) // a no-op for a map that was never pinned
	}
	errs = append(errs, s.Objects.XdpaggGc.Unpin())
	_ = os.Remove(filepath.Join(s.pinDir, "maps"))
	_ = os.Remove(filepath.Join(s.pinDir, "progs"))
	_ = os.Remove(filepath.Join(s.pinDir, "links"))
	_ = os.Remove(s.pinDir)
	s.pinDir = ""
	return errors.Join(errs...)
}
