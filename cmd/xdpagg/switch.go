package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"
	"unsafe"

	"github.com/xdpagg/xdpagg/agent"
	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/mgmt"
)

// regDefaults is the loader's default register configuration (--reg-arrays, --reg-slots).
var regDefaults = loader.Config{}.WithDefaults()

// regArrayBytes is the kernel memory of one register array: an 8-byte cell and a 4-byte hit
// counter for each of the compiled bpf.RegSlots slots (3 KiB), whatever --reg-slots is.
const regArrayBytes = uint64(unsafe.Sizeof(bpf.XdpaggRegArray{}))

func runSwitch(args []string, _ io.Writer) error {
	cfg, err := parseSwitch(args)
	if err != nil {
		return err
	}
	if os.Geteuid() != 0 {
		return fmt.Errorf("%w: the switch needs root (CAP_BPF, CAP_NET_ADMIN)", errUsage)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return agent.Run(ctx, cfg)
}

// parseSwitch turns `xdpagg switch` flags into the agent's configuration, checked.
func parseSwitch(args []string) (agent.Config, error) {
	fs := flag.NewFlagSet("switch", flag.ContinueOnError)
	var (
		ifaces   = fs.String("iface", "", "comma-separated switch ports to attach (required), e.g. eth1,eth2")
		name     = fs.String("name", "default", "switch name; maps are pinned under <pin-root>/<name>")
		pinRoot  = fs.String("pin-root", agent.DefaultPinRoot, "bpffs directory for pins (mounted if needed)")
		port     = fs.Uint("port", uint(loader.DefaultPort), "UDP port of xdpagg traffic")
		pool     = fs.Uint("pool", 4096, "aggregator slots; workers must use the same value")
		timeout  = fs.Duration("slot-timeout", 5*time.Second, "idle time after which a slot (half-filled or completed) may be taken by another job; the agent frees idle slots every half of it")
		generic  = fs.Bool("generic", false, "attach in generic (skb) XDP mode instead of native")
		metrics  = fs.String("metrics-addr", "", "serve Prometheus metrics at host:port (empty: off)")
		ready    = fs.String("ready-file", "", "write this JSON file once serving (for scripts and tests); removed on exit")
		portMbps = fs.Uint64("port-rate-mbps", 0, "ports' capacity in Mbit/s for ECN marking (a phantom queue per port marks xdpagg data at this arrival rate); 0: off")
		ecnBytes = fs.Uint64("ecn-threshold", 64<<10, "phantom-queue backlog in bytes above which data is marked F_ECN")
		noCache  = fs.Bool("no-retransmit-cache", false, "do not keep completed sums on the switch CPU for workers' retransmit requests")
		cacheAge = fs.Duration("cache-age", 10*time.Second, "longest a result stays in the retransmit cache when not every worker acknowledged it")
		cacheMax = fs.Int("cache-entries", 65536, "most results the retransmit cache holds, shared fairly among jobs (a job over the limit evicts its own oldest before another job's)")
		memTTL   = fs.Duration("member-ttl", agent.DefaultMemberTTL, "silence after which a bound worker id may be taken over by another host's authenticated JOIN")
		perPort  = fs.Int("max-members-per-port", agent.DefaultMaxMembersPerPort, "most job members behind one switch port")
		ctlRate  = fs.Uint("control-rate", 20000, "control messages per second each port may send to the agent (excess dropped in XDP)")
		ctlBurst = fs.Uint("control-burst", 2000, "burst of control messages a port may send at once")
		regArr   = fs.Uint("reg-arrays", uint(regDefaults.RegArrays), fmt.Sprintf("hot-parameter register arrays per iteration parity, shared by the sparse jobs (job add --reg-arrays m), 1..%d; kernel memory 2 x arrays x %d KiB (%d MiB at %d)",
			loader.MaxRegArrays, regArrayBytes>>10, 2*uint64(regDefaults.RegArrays)*regArrayBytes>>20, regDefaults.RegArrays))
		ctlKey   = fs.String("controller-key-file", "", "file with the controller's key (hex) that authenticates its heartbeats; made (mode 0600) with a new key if missing; empty: heartbeats are refused")
		mgmtAddr = fs.String("mgmt-listen", "", fmt.Sprintf("serve the controller's management channel (TCP, encrypted under the controller key) at ip:port, e.g. 10.0.0.5:%d; needs --controller-key-file; empty: off", mgmt.DefaultPort))
		regSlots = fs.Uint("reg-slots", uint(regDefaults.RegSlots), fmt.Sprintf("slots per register array (r), 1..%d: a sparse job of m arrays holds m x r hot parameters; memory stays %d KiB an array whatever r is", bpf.RegSlots, regArrayBytes>>10))
	)
	if err := parseFlags(fs, args); err != nil {
		return agent.Config{}, err
	}
	if *ifaces == "" {
		return agent.Config{}, fmt.Errorf("%w: --iface is required (the interfaces to run the switch on)", errUsage)
	}
	if *port == 0 || *port > 65535 {
		return agent.Config{}, fmt.Errorf("%w: --port %d: use 1..65535", errUsage, *port)
	}
	if *pool == 0 || *pool > loader.MaxPoolSize {
		return agent.Config{}, fmt.Errorf("%w: --pool %d: use 1..%d", errUsage, *pool, loader.MaxPoolSize)
	}
	if *ctlRate == 0 || *ctlBurst == 0 || *perPort <= 0 || *memTTL <= 0 {
		return agent.Config{}, fmt.Errorf("%w: --control-rate, --control-burst, --max-members-per-port and --member-ttl must be positive", errUsage)
	}
	if *regArr == 0 || *regArr > loader.MaxRegArrays {
		return agent.Config{}, fmt.Errorf("%w: --reg-arrays %d: use 1..%d (kernel memory 2 x arrays x %d KiB)", errUsage, *regArr, loader.MaxRegArrays, regArrayBytes>>10)
	}
	if *regSlots == 0 || *regSlots > uint(bpf.RegSlots) {
		return agent.Config{}, fmt.Errorf("%w: --reg-slots %d: use 1..%d", errUsage, *regSlots, bpf.RegSlots)
	}
	if *cacheAge <= 0 {
		return agent.Config{}, fmt.Errorf("%w: --cache-age %v: use a positive duration, e.g. 10s", errUsage, *cacheAge)
	}
	if *cacheMax <= 0 {
		return agent.Config{}, fmt.Errorf("%w: --cache-entries %d: use a positive count, e.g. 65536", errUsage, *cacheMax)
	}
	cfg := agent.Config{
		NoRetransmitCache: *noCache,
		CacheAge:          *cacheAge,
		CacheEntries:      *cacheMax,
		Name:              *name,
		Interfaces:        strings.Split(*ifaces, ","),
		PinRoot:           *pinRoot,
		Switch: loader.Config{Port: uint16(*port), PoolSize: uint32(*pool), SlotTimeout: *timeout,
			Generic: *generic, PortRate: *portMbps * 1_000_000 / 8, ECNThreshold: *ecnBytes,
			ControlRate: uint32(min(*ctlRate, 1e9)), ControlBurst: uint32(min(*ctlBurst, 1e9)),
			RegArrays: uint32(*regArr), RegSlots: uint32(*regSlots)},
		Control:     agent.ControlConfig{MemberTTL: *memTTL, MaxMembersPerPort: *perPort},
		MetricsAddr: *metrics,
		ReadyFile:   *ready,
		MgmtListen:  *mgmtAddr,
	}
	if err := cfg.Validate(); err != nil {
		return agent.Config{}, fmt.Errorf("%w: %v", errUsage, err)
	}
	if *mgmtAddr != "" && *ctlKey == "" {
		return agent.Config{}, fmt.Errorf("%w: --mgmt-listen needs --controller-key-file (the channel is sealed under the controller key)", errUsage)
	}
	if *ctlKey != "" {
		key, err := loadOrMakeKey(*ctlKey)
		if err != nil {
			return agent.Config{}, err
		}
		cfg.ControllerKey = key
	}
	return cfg, nil
}

// loadOrMakeKey reads a hex key from path, or writes a new one there (mode 0600) if the file does
// not exist: the switch and its controller are given the same file.
func loadOrMakeKey(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		key, err := ctlauth.NewKey()
		if err != nil {
			return nil, err
		}
		if err := os.WriteFile(path, []byte(ctlauth.FormatKey(key)+"\n"), 0o600); err != nil {
			return nil, fmt.Errorf("write controller key %s: %w", path, err)
		}
		return key, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read controller key %s: %w", path, err)
	}
	key, err := ctlauth.ParseKey(strings.TrimSpace(string(b)))
	if err != nil {
		return nil, fmt.Errorf("%w: controller key %s: %v", errUsage, path, err)
	}
	return key, nil
}
