// Package agent is the switch-CPU daemon: it loads and attaches the XDP switch (or takes over the
// datapath a killed agent left pinned), pins its maps for other processes, answers authenticated
// control messages (iSwitch's Join, Leave, Reset, SetH, FBcast, Help, Halt, Ack) and the
// controller's heartbeats, keeps the retransmit cache, serves the controller's management channel
// (Manager: admit, reset, remove, snapshot, restore, drain), exports metrics, and tears everything
// down on a clean exit.
package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/mgmt"
)

// DefaultPinRoot is where switches pin their maps, one directory per switch name.
const DefaultPinRoot = "/sys/fs/bpf/xdpagg"

// ErrConfig reports an unusable agent configuration.
var ErrConfig = errors.New("invalid agent configuration")

// Config configures one switch daemon.
type Config struct {
	Name        string   // switch name: pins go to PinRoot/Name
	Interfaces  []string // ports to attach, in the agent's network namespace
	PinRoot     string   // bpffs directory (default DefaultPinRoot; mounted if needed)
	Switch      loader.Config
	MetricsAddr string // host:port for /metrics; empty = no metrics server
	ReadyFile   string // written (JSON) once the switch is attached and serving; removed on exit
	Log         *slog.Logger
	// NoRetransmitCache turns off the switch-CPU retransmit cache (Switch.CacheResults and the
	// agent's reader of the results ring buffer).
	NoRetransmitCache bool
	// CacheAge is how long a result stays cached if not every worker acknowledges it
	// (default 10s); CacheEntries caps the cache (default 65536 results).
	CacheAge     time.Duration
	CacheEntries int
	// Control is the control plane's policy (member TTL, members per port).
	Control ControlConfig
	// ControllerKey authenticates the controller's heartbeats (ctlauth.KeySize bytes); nil: the
	// agent refuses them.
	ControllerKey []byte
	// MgmtListen is the TCP address (host:port) of the management channel (package mgmt), on
	// which the controller admits, moves and drains; empty: off. Needs ControllerKey. Heartbeats
	// arriving on the interface of its address (any interface when the host is unspecified) are
	// answered too.
	MgmtListen string
}

// Ready is what the ready file contains.
type Ready struct {
	Name        string   `json:"name"`
	PinDir      string   `json:"pin_dir"`
	Interfaces  []string `json:"interfaces"`
	Port        uint16   `json:"port"`
	PoolSize    uint32   `json:"pool_size"`
	MetricsAddr string   `json:"metrics_addr,omitempty"`
	MgmtAddr    string   `json:"mgmt_addr,omitempty"`
	PID         int      `json:"pid"`
}

// PinDir is the directory a switch named name pins under root.
func PinDir(root, name string) string {
	if root == "" {
		root = DefaultPinRoot
	}
	return filepath.Join(root, name)
}

// Validate says what to change in an unusable configuration.
func (c Config) Validate() error {
	if c.Name == "" || filepath.Base(c.Name) != c.Name || c.Name == "." || c.Name == ".." {
		return fmt.Errorf("%w: switch name %q: use a plain name like \"default\"", ErrConfig, c.Name)
	}
	if len(c.Interfaces) == 0 {
		return fmt.Errorf("%w: no interfaces: name the switch ports, e.g. --iface eth1,eth2", ErrConfig)
	}
	seen := map[string]bool{}
	for _, i := range c.Interfaces {
		if i == "" {
			return fmt.Errorf("%w: empty interface name in %q: list names separated by single commas", ErrConfig, strings.Join(c.Interfaces, ","))
		}
		if seen[i] {
			return fmt.Errorf("%w: interface %q named twice", ErrConfig, i)
		}
		seen[i] = true
	}
	if c.MgmtListen != "" {
		if _, _, err := net.SplitHostPort(c.MgmtListen); err != nil {
			return fmt.Errorf("%w: management address %q: use host:port, e.g. 10.0.0.5:%d: %v", ErrConfig, c.MgmtListen, mgmt.DefaultPort, err)
		}
	}
	return c.Switch.WithDefaults().Validate()
}

// collectGarbage frees slots idle past the slot timeout every interval (ATP's aggregator garbage
// collection: an idle pool drains to empty) and forgets removed jobs' control state, until ctx
// is done.
func collectGarbage(ctx context.Context, m *maps.Maps, ctrl *ControlServer, every time.Duration, log *slog.Logger) {
	t := time.NewTicker(every)
	defer t.Stop()
	failing := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		n, err := m.ReclaimIdle()
		if err != nil {
			if !failing { // one line per failure streak, not one per tick
				log.Error("slot garbage collection", "err", err)
			}
			failing = true
			continue
		}
		failing = false
		if n > 0 {
			log.Debug("idle slots freed", "slots", n)
		}
		jobs, err := m.ListJobs()
		if err != nil {
			continue
		}
		admitted := make(map[uint32]bool, len(jobs))
		for _, j := range jobs {
			admitted[j.JobID] = true
		}
		ctrl.forgetRemoved(admitted)
	}
}

// enableForwarding turns IPv4 forwarding on at every port that has it off, and returns what
// puts the old settings back. The switch routes what it does not absorb, and its source
// validation asks the kernel's forwarding table (bpf_fib_lookup), which answers "forwarding
// disabled" for every source at a port without it: the switch would drop all traffic there as
// spoofed. Only the switch's own ports are changed, and only while it runs.
func enableForwarding(links []netlink.Link, log *slog.Logger) (restore func(), err error) {
	var changed []string
	restore = func() {
		for _, p := range changed {
			if err := os.WriteFile(p, []byte("0"), 0o644); err != nil {
				log.Error("restore forwarding setting", "file", p, "err", err)
			}
		}
	}
	for _, l := range links {
		name := l.Attrs().Name
		p := filepath.Join("/proc/sys/net/ipv4/conf", name, "forwarding")
		b, err := os.ReadFile(p)
		if err != nil {
			restore()
			return nil, fmt.Errorf("%w: read forwarding setting of %s: %w", ErrConfig, name, err)
		}
		if strings.TrimSpace(string(b)) == "1" {
			continue
		}
		if err := os.WriteFile(p, []byte("1"), 0o644); err != nil {
			restore()
			return nil, fmt.Errorf("turn on IPv4 forwarding at %s (the switch routes, and its source validation needs it): %w", name, err)
		}
		changed = append(changed, p)
		log.Info("IPv4 forwarding turned on for the switch's run", "iface", name)
	}
	return restore, nil
}

// Run loads and attaches the switch and serves until ctx is done, then detaches and unpins.
func Run(ctx context.Context, cfg Config) (err error) {
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if err := cfg.Validate(); err != nil {
		return err
	}
	cfg.Switch.CacheResults = !cfg.NoRetransmitCache
	if cfg.CacheAge == 0 {
		cfg.CacheAge = 10 * time.Second
	}
	if cfg.CacheEntries == 0 {
		cfg.CacheEntries = 65536
	}
	log := cfg.Log
	root := cfg.PinRoot
	if root == "" {
		root = DefaultPinRoot
	}
	if err := loader.MountBPFFS(root); err != nil {
		return err
	}
	dir := PinDir(root, cfg.Name)
	// A pin directory left behind is a switch whose agent died (or is being upgraded): its XDP
	// programs still run on their pinned links, and its maps hold the jobs in flight. Take it
	// over instead of starting empty. Two live agents of one name are kept apart by the lock.
	adopt := false
	if _, err := os.Stat(dir); err == nil {
		adopt = true
	}
	unlock, err := lockSwitch(root, cfg.Name)
	if err != nil {
		return err
	}
	defer unlock()

	links := make([]netlink.Link, 0, len(cfg.Interfaces))
	for _, name := range cfg.Interfaces {
		l, err := netlink.LinkByName(name)
		if err != nil {
			return fmt.Errorf("%w: interface %q: %w", ErrConfig, name, err)
		}
		links = append(links, l)
	}

	restoreForwarding, err := enableForwarding(links, log)
	if err != nil {
		return err
	}
	defer restoreForwarding()

	var sw *loader.Switch
	if adopt {
		sw, err = loader.Adopt(cfg.Switch, dir)
		if err != nil {
			return fmt.Errorf("take over the switch pinned at %s (to start afresh instead, remove that directory): %w", dir, err)
		}
		log.Info("took over the running switch left pinned", "pin_dir", dir)
	} else if sw, err = loader.Load(cfg.Switch); err != nil {
		return fmt.Errorf("load switch: %w", err) // callers print with %+v for the verifier log
	}
	defer func() {
		if cerr := sw.Close(); cerr != nil {
			log.Error("teardown", "err", cerr)
		}
		log.Info("switch detached and unpinned", "name", cfg.Name)
	}()
	if !adopt {
		if err := sw.Pin(dir); err != nil {
			return err
		}
	} else {
		// Ports the previous run had and this one does not take are detached.
		pinned, err := loader.PinnedPorts(dir)
		if err != nil {
			return err
		}
		for _, ifindex := range pinned {
			keep := false
			for _, l := range links {
				keep = keep || l.Attrs().Index == ifindex
			}
			if !keep {
				if err := sw.DropPinnedPort(ifindex); err != nil {
					log.Error("detach a port of the previous run", "ifindex", ifindex, "err", err)
				}
			}
		}
	}
	ports := map[int]net.HardwareAddr{}
	for _, l := range links {
		if err := sw.AttachPort(l.Attrs().Index); err != nil {
			return fmt.Errorf("attach %s: %w", l.Attrs().Name, err)
		}
		ports[l.Attrs().Index] = l.Attrs().HardwareAddr
		log.Info("port attached", "iface", l.Attrs().Name, "ifindex", l.Attrs().Index)
	}

	ctrl, err := ListenControl(sw.Config.Port, sw.Maps, ports, log)
	if err != nil {
		return err
	}
	defer ctrl.Close()
	if sw.Config.CacheResults {
		cache := NewResultCache(cfg.CacheAge, cfg.CacheEntries)
		ctrl.SetCache(cache)
		ctrl.SetSparseCache(NewSparseCache(DefaultSparseKeep, DefaultSparseJobBytes, cfg.CacheAge))
		stop, err := publishCacheStats(ctx, dir, cache, 100*time.Millisecond)
		if err != nil {
			return err
		}
		defer stop() // before sw.Close (deferred earlier) removes the pin directory
		feedCtx, feedCancel := context.WithCancel(ctx)
		feedDone := make(chan error, 1)
		go func() { feedDone <- feedCache(feedCtx, sw.Maps.Results, ctrl.storeResult, log) }()
		defer func() {
			feedCancel()
			if err := <-feedDone; err != nil {
				log.Error("retransmit cache", "err", err)
			}
		}()
		log.Info("retransmit cache on", "max_age", cfg.CacheAge, "max_entries", cfg.CacheEntries)
	}
	ctrl.SetConfig(cfg.Control)
	if cfg.ControllerKey != nil {
		if err := ctrl.SetControllerKey(cfg.ControllerKey); err != nil {
			return fmt.Errorf("%w: controller key: %w", ErrConfig, err)
		}
	}
	var mgmtSrv *mgmt.Server
	mgmtAddr := ""
	if cfg.MgmtListen != "" {
		if cfg.ControllerKey == nil {
			return fmt.Errorf("%w: the management channel (--mgmt-listen) needs the controller key (--controller-key-file)", ErrConfig)
		}
		ports := make([]MgmtPort, 0, len(links))
		for _, l := range links {
			ports = append(ports, MgmtPort{Name: l.Attrs().Name, Ifindex: l.Attrs().Index, MAC: l.Attrs().HardwareAddr})
		}
		srv, ln, err := listenMgmt(cfg.MgmtListen, cfg.ControllerKey, NewManager(cfg.Name, sw.Maps, ctrl, ports, log), ctrl, log)
		if err != nil {
			return err
		}
		mgmtSrv, mgmtAddr = srv, ln.Addr().String()
		mgmtCtx, mgmtCancel := context.WithCancel(ctx)
		mgmtDone := make(chan error, 1)
		go func() {
			err := srv.Serve(mgmtCtx, ln)
			if err != nil { // the switch keeps running without it (heartbeats still work)
				log.Error("management channel stopped", "err", err)
			}
			mgmtDone <- err
		}()
		defer func() { mgmtCancel(); <-mgmtDone }()
		log.Info("management channel", "addr", mgmtAddr)
	}
	ctrlDone := make(chan error, 1)
	go func() { ctrlDone <- ctrl.Serve(ctx) }()
	gcCtx, gcCancel := context.WithCancel(ctx)
	gcDone := make(chan struct{})
	go func() {
		defer close(gcDone)
		collectGarbage(gcCtx, sw.Maps, ctrl, sw.Config.SlotTimeout/2, log)
	}()
	defer func() { gcCancel(); <-gcDone }()

	metricsAddr := ""
	if cfg.MetricsAddr != "" {
		addr, stop, err := ServeMetrics(cfg.MetricsAddr, log, NewCollector(sw.Maps).WithControl(ctrl).WithMgmt(mgmtSrv))
		if err != nil {
			return err
		}
		defer stop()
		metricsAddr = addr
		log.Info("metrics", "addr", metricsAddr)
	}

	if cfg.ReadyFile != "" {
		r := Ready{Name: cfg.Name, PinDir: dir, Interfaces: cfg.Interfaces, Port: sw.Config.Port,
			PoolSize: sw.Config.PoolSize, MetricsAddr: metricsAddr, MgmtAddr: mgmtAddr, PID: os.Getpid()}
		b, _ := json.MarshalIndent(r, "", "  ")
		tmp := cfg.ReadyFile + ".tmp"
		if err := os.WriteFile(tmp, append(b, '\n'), 0o644); err != nil {
			return fmt.Errorf("write ready file: %w", err)
		}
		if err := os.Rename(tmp, cfg.ReadyFile); err != nil {
			return fmt.Errorf("write ready file: %w", err)
		}
		defer os.Remove(cfg.ReadyFile)
	}
	log.Info("switch serving", "name", cfg.Name, "pin_dir", dir, "port", sw.Config.Port, "pool", sw.Config.PoolSize)

	select {
	case <-ctx.Done():
	case err := <-ctrlDone:
		if err != nil {
			return err
		}
	}
	return nil
}

// LockDir holds the agents' locks (bpffs, where the pins are, takes no regular files).
const LockDir = "/run/xdpagg"

// lockSwitch takes the lock of the switch pinned at root/name (an flock on a file in LockDir), so
// that two agents of one switch never run at once, whether the first left its pins behind or is
// still alive. The lock goes with the process, even when it is killed.
func lockSwitch(root, name string) (func(), error) {
	if err := os.MkdirAll(LockDir, 0o700); err != nil {
		return nil, fmt.Errorf("create %s: %w", LockDir, err)
	}
	p := filepath.Join(LockDir, strings.ReplaceAll(strings.Trim(filepath.Join(root, name), "/"), "/", "_")+".lock")
	f, err := os.OpenFile(p, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open the switch's lock %s: %w", p, err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("%w: switch %q is already running (lock %s)", ErrConfig, name, p)
		}
		return nil, fmt.Errorf("lock the switch %s: %w", p, err)
	}
	return func() { f.Close() }, nil
}

// ServeMetrics serves the collectors at http://addr/metrics (a registry of their own) until the
// returned stop is called; it returns the address it listens on (addr may have port 0).
func ServeMetrics(addr string, log *slog.Logger, cs ...prometheus.Collector) (string, func(), error) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(cs...)
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return "", nil, fmt.Errorf("%w: metrics address %q: %w", ErrConfig, addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("metrics server", "err", err)
		}
	}()
	return ln.Addr().String(), func() { srv.Close() }, nil
}
