package controller

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Collector exports a monitor's view to Prometheus, read at scrape time.
type Collector struct {
	m        *Monitor
	state    *prometheus.Desc
	sent     *prometheus.Desc
	answered *prometheus.Desc
	failures *prometheus.Desc
	rtt      *prometheus.Desc
}

// NewCollector returns a collector over m.
func NewCollector(m *Monitor) *Collector {
	return &Collector{m: m,
		state:    prometheus.NewDesc("xdpagg_controller_switch_state", "1 for the state each switch is in (healthy, suspect, failed, unknown).", []string{"switch", "state"}, nil),
		sent:     prometheus.NewDesc("xdpagg_controller_heartbeats_sent_total", "Heartbeats sent to the switch's agent.", []string{"switch"}, nil),
		answered: prometheus.NewDesc("xdpagg_controller_heartbeats_answered_total", "Heartbeats the agent answered, authenticated and in time.", []string{"switch"}, nil),
		failures: prometheus.NewDesc("xdpagg_controller_switch_failures_total", "Times the switch was declared failed.", []string{"switch"}, nil),
		rtt:      prometheus.NewDesc("xdpagg_controller_heartbeat_rtt_seconds", "Round trip of the last answered heartbeat.", []string{"switch"}, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.state, c.sent, c.answered, c.failures, c.rtt} {
		ch <- d
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
}
