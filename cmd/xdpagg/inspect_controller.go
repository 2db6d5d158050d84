package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/xdpagg/xdpagg/controller"
)

// inspectController prints the controller's view (`xdpagg inspect --controller-status`) from its
// status file, or from <dir>/status.json when given its state directory.
func inspectController(path string, asJSON bool, stdout io.Writer) error {
	if fi, err := os.Stat(path); err == nil && fi.IsDir() {
		path = filepath.Join(path, controller.StatusFile)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("controller status: %w", err)
	}
	var v controller.View
	if err := json.Unmarshal(b, &v); err != nil {
		return fmt.Errorf("controller status %s: %w", path, err)
	}
	if asJSON {
		out, _ := json.MarshalIndent(v, "", "  ")
		_, err := fmt.Fprintln(stdout, string(out))
		return err
	}
	fmt.Fprintf(stdout, "controller view of %s (%s old)\n", v.Time.Format(time.RFC3339), time.Since(v.Time).Round(time.Second))
	fmt.Fprintf(stdout, "policy: heartbeat every %v, suspect after %d missed, failed after %d; degraded past %.2f resends per aggregated DATA over %d heartbeats (at least %d packets)",
		time.Duration(v.Heartbeat.Interval), v.Heartbeat.SuspectAfter, v.Heartbeat.FailAfter, v.Degrade.MaxResendShare, v.Degrade.Heartbeats, v.Degrade.MinPackets)
	if v.Degrade.MaxRTT > 0 {
		fmt.Fprintf(stdout, ", or every answer of the window slower than %v", time.Duration(v.Degrade.MaxRTT))
	}
	if v.Degrade.Off {
		fmt.Fprint(stdout, " (off)")
	}
	fmt.Fprintln(stdout)
	for _, g := range v.Groups {
		armed := "automatic failover armed"
		if !g.Armed {
			armed = "automatic failover disarmed (after a failover: move back with `xdpagg failover`)"
		}
		fmt.Fprintf(stdout, "\ngroup %s: primary %s, standby %s, active %s; %s\n", g.Name, g.Primary, g.Standby, g.Active, armed)
		if g.Pending != "" {
			fmt.Fprintf(stdout, "  a %s failover drained %s and is being retried until its restore completes\n", g.Pending, g.Active)
		}
		if g.Degraded != "" {
			fmt.Fprintf(stdout, "  active switch degraded: %s\n", g.Degraded)
		}
		tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "  SWITCH\tSTATE\tREASON\tLAST ANSWER\tRTT\tANSWERED/SENT\tJOBS\tMEMBERS\tSLOTS HELD")
		for _, s := range g.Switches {
			last := "never"
			if !s.LastAnswer.IsZero() {
				last = time.Since(s.LastAnswer).Round(time.Millisecond).String() + " ago"
			}
			fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%v\t%d/%d\t%d\t%d\t%d\n", s.Name, s.State, s.Reason, last, s.RTT.Round(time.Microsecond),
				s.Answered, s.Sent, s.Stats.Jobs, s.Stats.Members, s.Stats.SlotsHeld)
		}
		tw.Flush()
		if !g.ReplicaTaken.IsZero() || len(g.Members) > 0 {
			fmt.Fprintf(stdout, "  replica of %s: %d members\n", g.ReplicaTaken.Format(time.RFC3339Nano), len(g.Members))
			tw = tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "    JOB\tWORKER\tPORT\tADDRESS\tMAC")
			for _, m := range g.Members {
				fmt.Fprintf(tw, "    %d\t%d\t%s\t%v\t%v\n", m.Job, m.Worker, m.Port, m.Addr, m.MAC)
			}
			tw.Flush()
		}
		if g.Hot {
			fmt.Fprintf(stdout, "  standby hot: mirrored the replica of %s\n", g.Mirrored.Format(time.RFC3339Nano))
		} else {
			fmt.Fprintln(stdout, "  standby not hot (not mirrored since the controller started, the last failover, or a mirror that failed)")
		}
		if f := g.LastFailover; f != nil {
			fmt.Fprintf(stdout, "  last failover %s: %s -> %s (%s: %s), state from %s (onto a hot standby: %v); drain %v, snapshot %v, restore %v, total %v; migrated %+v\n",
				f.Started.Format(time.RFC3339), f.From, f.To, f.Reason, f.Detail, f.Source, f.Hot, f.Drain, f.Snapshot, f.Restore, f.Total, f.Migrated)
			if f.Error != "" {
				fmt.Fprintf(stdout, "  it did not complete: %s\n", f.Error)
			}
			for _, n := range f.Notes {
				fmt.Fprintf(stdout, "  note: %s\n", n)
			}
		}
		if len(g.Failovers) > 0 {
			fmt.Fprintf(stdout, "  failovers: %v\n", g.Failovers)
		}
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "\nJOB\tGROUP\tWORKERS\tH\tPS\tPS PORT\tQUOTA\tKEY FILE\tADMITTED ON")
	for _, j := range v.Jobs {
		var on []string
		for sw, ok := range j.Admitted {
			if ok {
				on = append(on, sw)
			}
		}
		sort.Strings(on)
		// H as configured, and as the active switch has it when MSG_SETH moved it.
		h := hDesc(j.Threshold, j.Workers)
		if j.RegArrays > 0 {
			h = "-"
		} else if j.ThresholdNow != nil && hDesc(*j.ThresholdNow, j.Workers) != h {
			h += " (now " + hDesc(*j.ThresholdNow, j.Workers) + ")"
		}
		fmt.Fprintf(tw, "%d\t%s\t%d\t%s\t%v\t%s\t%d\t%s\t%s\n", j.ID, j.Group, j.Workers, h, j.PS, j.PSPort, j.Quota, j.KeyFile, strings.Join(on, ","))
	}
	return tw.Flush()
}
