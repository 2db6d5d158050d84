package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
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

// runController is `xdpagg controller`: with --config, the controller of groups and jobs
// (runGroups); else it heartbeats every --switch, logs state changes, serves metrics, and writes
// its view to --status-file (JSON) after every heartbeat round.
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
		config   = fs.String("config", "", "groups and jobs (JSON, docs/operations.md): own them — admit the jobs on both switches of each group, keep replicas, fail groups over; instead of --switch")
		stateDir = fs.String("state-dir", "", "with --config: the controller's state (jobs' keys, active switches, replicas, failovers), its status.json and operator socket; reloaded on restart")
	)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	local, err := netip.ParseAddrPort(*listen)
	if err != nil {
		return fmt.Errorf("%w: --listen %q: %v", errUsage, *listen, err)
	}
	log := slog.Default()
	if *config != "" {
		if len(targets) > 0 || *stateDir == "" || *status != "" {
			return fmt.Errorf("%w: --config takes --state-dir (its status is <state-dir>/%s), not --switch or --status-file", errUsage, controller.StatusFile)
		}
		return runGroups(*config, *stateDir, local, *metrics, *ready, log)
	}
	if len(targets) == 0 {
		return fmt.Errorf("%w: give --config and --state-dir, or at least one --switch NAME=IP[:PORT]@KEYFILE", errUsage)
	}
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
		if err := writeReady(*ready); err != nil {
			return err
		}
		defer os.Remove(*ready)
	}
	log.Info("controller heartbeating", "switches", len(targets), "interval", *interval)
	return m.Run(ctx)
}

func writeReady(path string) error {
	if err := os.WriteFile(path, []byte(fmt.Sprintf("{\"pid\": %d}\n", os.Getpid())), 0o644); err != nil {
		return fmt.Errorf("write ready file: %w", err)
	}
	return nil
}

// runGroups is `xdpagg controller --config F --state-dir D`: the controller that owns groups and
// jobs (package controller's Controller), logging what it does.
func runGroups(config, dir string, local netip.AddrPort, metrics, ready string, log *slog.Logger) error {
	cfg, err := controller.LoadConfig(config)
	if err != nil {
		return fmt.Errorf("%w: %v", errUsage, err)
	}
	c, err := controller.New(cfg, dir, controller.Options{Local: local,
		OnChange: func(s controller.Status) {
			log.Info("switch state", "switch", s.Name, "state", s.State, "reason", s.Reason)
		},
		OnFailover: func(f controller.Failover) {
			args := []any{"group", f.Group, "from", f.From, "to", f.To, "reason", f.Reason, "detail", f.Detail, "source", f.Source, "hot", f.Hot,
				"drain", f.Drain, "snapshot", f.Snapshot, "restore", f.Restore, "total", f.Total, "migrated", f.Migrated, "notes", f.Notes}
			if f.Error != "" {
				log.Error("failover did not complete", append(args, "err", f.Error)...)
				return
			}
			log.Warn("failover", args...)
		},
		OnError: func(err error) { log.Warn("controller", "err", err) },
	})
	if err != nil {
		return err
	}
	defer c.Close()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if metrics != "" {
		_, stopMetrics, err := agent.ServeMetrics(metrics, log, controller.NewControllerCollector(c))
		if err != nil {
			return fmt.Errorf("%w: %v", errUsage, err)
		}
		defer stopMetrics()
	}
	if ready != "" {
		if err := writeReady(ready); err != nil {
			return err
		}
		defer os.Remove(ready)
	}
	log.Info("controller running", "groups", len(cfg.Groups), "jobs", len(cfg.Jobs), "state_dir", dir)
	return c.Run(ctx)
}

// runReset is `xdpagg reset --state-dir D --job N`: ask the running controller to clear the job's
// slots, registers and counters on both switches of its group (iSwitch's Reset, from the
// controller; members, key and admission stay).
func runReset(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("reset", flag.ContinueOnError)
	var (
		dir     = fs.String("state-dir", "", "the controller's --state-dir")
		job     = fs.Uint("job", 0, "the job to reset")
		timeout = fs.Duration("timeout", time.Minute, "give up waiting for the controller after this long")
	)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *dir == "" || *job == 0 || *job > math.MaxUint32 {
		return fmt.Errorf("%w: give --state-dir and --job (1..%d)", errUsage, uint32(math.MaxUint32))
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	if _, err := controller.Ask(ctx, *dir, controller.Request{Op: "reset", Job: uint32(*job)}); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "job %d reset on both switches of its group\n", *job)
	return nil
}

// runFailover is `xdpagg failover --state-dir D --group G`: ask the running controller to drain
// the group's active switch and move the group to the other one.
func runFailover(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("failover", flag.ContinueOnError)
	var (
		dir     = fs.String("state-dir", "", "the controller's --state-dir")
		group   = fs.String("group", "", "the group to move to its other switch")
		timeout = fs.Duration("timeout", time.Minute, "give up waiting for the controller after this long")
	)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *dir == "" || *group == "" {
		return fmt.Errorf("%w: give --state-dir and --group", errUsage)
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	r, err := controller.Ask(ctx, *dir, controller.Request{Op: "failover", Group: *group})
	if r.Failover != nil {
		b, _ := json.MarshalIndent(r.Failover, "", "  ")
		fmt.Fprintln(stdout, string(b))
	}
	return err
}
