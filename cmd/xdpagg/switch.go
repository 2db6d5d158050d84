package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/xdpagg/xdpagg/agent"
	"github.com/xdpagg/xdpagg/loader"
)

func runSwitch(args []string, _ io.Writer) error {
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
		memTTL   = fs.Duration("member-ttl", agent.DefaultMemberTTL, "silence after which a bound worker id may be taken over by another host's authenticated JOIN")
		perPort  = fs.Int("max-members-per-port", agent.DefaultMaxMembersPerPort, "most job members behind one switch port")
		ctlRate  = fs.Uint("control-rate", 20000, "control messages per second each port may send to the agent (excess dropped in XDP)")
		ctlBurst = fs.Uint("control-burst", 2000, "burst of control messages a port may send at once")
	)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *ifaces == "" {
		return fmt.Errorf("%w: --iface is required (the interfaces to run the switch on)", errUsage)
	}
	if *port == 0 || *port > 65535 {
		return fmt.Errorf("%w: --port %d: use 1..65535", errUsage, *port)
	}
	if *pool == 0 || *pool > loader.MaxPoolSize {
		return fmt.Errorf("%w: --pool %d: use 1..%d", errUsage, *pool, loader.MaxPoolSize)
	}
	if *ctlRate == 0 || *ctlBurst == 0 || *perPort <= 0 || *memTTL <= 0 {
		return fmt.Errorf("%w: --control-rate, --control-burst, --max-members-per-port and --member-ttl must be positive", errUsage)
	}
	if *cacheAge <= 0 {
		return fmt.Errorf("%w: --cache-age %v: use a positive duration, e.g. 10s", errUsage, *cacheAge)
	}
	cfg := agent.Config{
		NoRetransmitCache: *noCache,
		CacheAge:          *cacheAge,
		Name:              *name,
		Interfaces:        strings.Split(*ifaces, ","),
		PinRoot:           *pinRoot,
		Switch: loader.Config{Port: uint16(*port), PoolSize: uint32(*pool), SlotTimeout: *timeout,
			Generic: *generic, PortRate: *portMbps * 1_000_000 / 8, ECNThreshold: *ecnBytes,
			ControlRate: uint32(min(*ctlRate, 1e9)), ControlBurst: uint32(min(*ctlBurst, 1e9))},
		Control:     agent.ControlConfig{MemberTTL: *memTTL, MaxMembersPerPort: *perPort},
		MetricsAddr: *metrics,
		ReadyFile:   *ready,
	}
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("%w: %v", errUsage, err)
	}
	if os.Geteuid() != 0 {
		return fmt.Errorf("%w: the switch needs root (CAP_BPF, CAP_NET_ADMIN)", errUsage)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return agent.Run(ctx, cfg)
}
