package controller

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Collector exports a monitor's view to Prometheus, read at scrape time; with a Controller, also
// its groups' failovers and migrations.
type Collector struct {
	m        *Monitor
	c        *Controller
	state    *prometheus.Desc
	sent     *prometheus.Desc
	answered *prometheus.Desc
	failures *prometheus.Desc
	rtt      *prometheus.Desc

	failovers, migration, migrated, active, hot *prometheus.Desc
}

// NewControllerCollector returns a collector over c's monitor and groups.
func NewControllerCollector(c *Controller) *Collector {
	col := NewCollector(c.mon)
	col.c = c
	return col
}

// NewCollector returns a collector over m.
func NewCollector(m *Monitor) *Collector {
	return &Collector{m: m,
		state:     prometheus.NewDesc("xdpagg_controller_switch_state", "1 for the state each switch is in (healthy, suspect, failed, unknown).", []string{"switch", "state"}, nil),
		sent:      prometheus.NewDesc("xdpagg_controller_heartbeats_sent_total", "Heartbeats sent to the switch's agent.", []string{"switch"}, nil),
		answered:  prometheus.NewDesc("xdpagg_controller_heartbeats_answered_total", "Heartbeats the agent answered, authenticated and in time.", []string{"switch"}, nil),
		failures:  prometheus.NewDesc("xdpagg_controller_switch_failures_total", "Times the switch was declared failed.", []string{"switch"}, nil),
		rtt:       prometheus.NewDesc("xdpagg_controller_heartbeat_rtt_seconds", "Round trip of the last answered heartbeat.", []string{"switch"}, nil),
		failovers: prometheus.NewDesc("xdpagg_controller_failovers_total", "Completed failovers of the group, by reason (failed, degraded, operator).", []string{"group", "reason"}, nil),
		migration: prometheus.NewDesc("xdpagg_controller_migration_seconds", "The group's last failover, by phase (drain, snapshot, restore, total).", []string{"group", "phase"}, nil),
		migrated:  prometheus.NewDesc("xdpagg_controller_migrated_entries", "Entries the group's last failover restored on its new switch, by kind.", []string{"group", "kind"}, nil),
		active:    prometheus.NewDesc("xdpagg_controller_active_switch", "1 for the switch each group's traffic goes through.", []string{"group", "switch"}, nil),
		hot:       prometheus.NewDesc("xdpagg_controller_standby_hot", "1 while the group's standby is a mirror of its active switch's jobs and members (hot standby).", []string{"group"}, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.state, c.sent, c.answered, c.failures, c.rtt} {
		ch <- d
	}
	if c.c != nil {
		for _, d := range []*prometheus.Desc{c.failovers, c.migration, c.migrated, c.active, c.hot} {
			ch <- d
		}
	}
}

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	for _, s := range c.m.Status() {
		for _, st := range []string{StateUnknown, StateHealthy, StateSuspect, StateFailed} {
			v := 0.0
			if s.State == st {
				v = 1
			}
			ch <- prometheus.MustNewConstMetric(c.state, prometheus.GaugeValue, v, s.Name, st)
		}
		ch <- prometheus.MustNewConstMetric(c.sent, prometheus.CounterValue, float64(s.Sent), s.Name)
		ch <- prometheus.MustNewConstMetric(c.answered, prometheus.CounterValue, float64(s.Answered), s.Name)
		ch <- prometheus.MustNewConstMetric(c.failures, prometheus.CounterValue, float64(s.Failures), s.Name)
		ch <- prometheus.MustNewConstMetric(c.rtt, prometheus.GaugeValue, s.RTT.Seconds(), s.Name)
	}
	if c.c == nil {
		return
	}
	for _, g := range c.c.View().Groups {
		for _, r := range []string{ReasonFailed, ReasonDegraded, ReasonOperator} {
			ch <- prometheus.MustNewConstMetric(c.failovers, prometheus.CounterValue, float64(g.Failovers[r]), g.Name, r)
		}
		for _, sw := range []string{g.Primary, g.Standby} {
			v := 0.0
			if sw == g.Active {
				v = 1
			}
			ch <- prometheus.MustNewConstMetric(c.active, prometheus.GaugeValue, v, g.Name, sw)
		}
		hot := 0.0
		if g.Hot {
			hot = 1
		}
		ch <- prometheus.MustNewConstMetric(c.hot, prometheus.GaugeValue, hot, g.Name)
		f := g.LastFailover
		if f == nil {
			continue
		}
		for phase, d := range map[string]time.Duration{"drain": f.Drain, "snapshot": f.Snapshot, "restore": f.Restore, "total": f.Total} {
			ch <- prometheus.MustNewConstMetric(c.migration, prometheus.GaugeValue, d.Seconds(), g.Name, phase)
		}
		m := f.Migrated
		for kind, n := range map[string]int{"jobs": m.Jobs, "members": m.Members, "slots": m.Slots, "sparse": m.Sparse, "cache": m.Cache, "skipped": m.Skipped} {
			ch <- prometheus.MustNewConstMetric(c.migrated, prometheus.GaugeValue, float64(n), g.Name, kind)
		}
	}
}
