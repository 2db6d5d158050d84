package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/xdpagg/xdpagg/agent"
	"github.com/xdpagg/xdpagg/controller"
	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/wire"
)

// switchList is the repeatable --switch flag: NAME=IP[:PORT]@KEYFILE.
type switchList []controller.Target

func (l *switchList) String() string { return fmt.Sprint(len(*l), " switches") }

func (l *switchList) Set(v string) error {
	name, rest, ok1 := strings.Cut(v, "=")
	addr, keyFile, ok2 := strings.Cut(rest, "@")
	if !ok1 || !ok2 || name == "" {
		return fmt.Errorf("%q: use NAME=IP[:PORT]@KEYFILE", v)
	}
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		ip, err2 := netip.ParseAddr(addr)
		if err2 != nil {
			return fmt.Errorf("%q: address %q: %v", v, addr, err)
		}
		ap = netip.AddrPortFrom(ip, wire.DefaultPort)
	}
	b, err := os.ReadFile(keyFile)
	if err != nil {
		return fmt.Errorf("controller key of %s: %w", name, err)
	}
	key, err := ctlauth.ParseKey(strings.TrimSpace(string(b)))
	if err != nil {
		return fmt.Errorf("controller key of %s (%s): %w", name, keyFile, err)
	}
	*l = append(*l, controller.Target{Name: name, Addr: ap, Key: key})
	return nil
}

// runController is `xdpagg controller`: it heartbeats every --switch, logs state changes, serves
// metrics, and writes its view to --status-file (JSON) after every heartbeat round.
func runController(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("controller", flag.ContinueOnError)
	var targets switchList
	fs.Var(&targets, "switch", "a switch to watch, NAME=IP[:PORT]@KEYFILE (the agent's address, the key file given to its --controller-key-file); repeat for more")
	var (
		listen   = fs.String("listen", "0.0.0.0:0", "local address for heartbeats")
		interval = fs.Duration("interval", 200*time.Millisecond, "time between heartbeats; one unanswered within it is missed")
		suspect  = fs.Int("suspect-after", 1, "missed heartbeats in a row after which a switch is suspect")
		fail     = fs.Int("fail-after", 3, "missed heartbeats in a row after which a switch is failed")
		metrics  = fs.String("metrics-addr", "", "serve Prometheus metrics at host:port (empty: off)")
		status   = fs.String("status-file", "", "write every switch's status (JSON) here after each round")
		ready    = fs.String("ready-file", "", "write this file once heartbeating; removed on exit")
	)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if len(targets) == 0 {
		return fmt.Errorf("%w: give at least one --switch NAME=IP[:PORT]@KEYFILE", errUsage)
	}
	local, err := netip.ParseAddrPort(*listen)
	if err != nil {
		return fmt.Errorf("%w: --listen %q: %v", errUsage, *listen, err)
	}
	log := slog.Default()
	m, err := controller.NewMonitor(local, targets, controller.Policy{Interval: *interval, SuspectAfter: *suspect, FailAfter: *fail,
		OnChange: func(s controller.Status) {
			log.Info("switch state", "switch", s.Name, "state", s.State, "reason", s.Reason)
		}})
	if err != nil {
		return fmt.Errorf("%w: %v", errUsage, err)
	}
	defer m.Close()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if *metrics != "" {
		_, stopMetrics, err := agent.ServeMetrics(*metrics, log, controller.NewCollector(m))
		if err != nil {
			return fmt.Errorf("%w: %v", errUsage, err)
		}
		defer stopMetrics()
	}
	if *status != "" {
		go func() {
			t := time.NewTicker(*interval)
			defer t.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case <-t.C:
				}
				b, _ := json.MarshalIndent(m.Status(), "", "  ")
				tmp := *status + ".tmp"
				if os.WriteFile(tmp, append(b, '\n'), 0o644) == nil {
					_ = os.Rename(tmp, *status)
				}
			}
		}()
	}
	if *ready != "" {
		if err := os.WriteFile(*ready, []byte(fmt.Sprintf("{\"pid\": %d}\n", os.Getpid())), 0o644); err != nil {
			return fmt.Errorf("write ready file: %w", err)
		}
		defer os.Remove(*ready)
	}
	log.Info("controller heartbeating", "switches", len(targets), "interval", *interval)
	return m.Run(ctx)
}
