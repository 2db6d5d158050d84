package agent

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/xdpagg/xdpagg/maps"
)

// Collector exports a switch's counters and slot usage to Prometheus, and the agent's refused
// control messages by reason. It reads the maps (and the control server's counters) at scrape
// time, so there is no second copy of the state to drift from the kernel's.
type Collector struct {
	maps     *maps.Maps
	ctrl     *ControlServer // nil: no control-plane metrics
	packets  *prometheus.Desc
	slots    *prometheus.Desc
	pool     *prometheus.Desc
	members  *prometheus.Desc
	jobs     *prometheus.Desc
	rejected *prometheus.Desc
	scrapeOK *prometheus.Desc
}

// NewCollector returns a collector over m.
func NewCollector(m *maps.Maps) *Collector {
	return &Collector{
		maps:     m,
		packets:  prometheus.NewDesc("xdpagg_switch_packets_total", "Packets by switch verdict or event (see docs/protocol.md, Counters).", []string{"counter"}, nil),
		slots:    prometheus.NewDesc("xdpagg_switch_slots", "Aggregator slots by state.", []string{"state"}, nil),
		pool:     prometheus.NewDesc("xdpagg_switch_pool_size", "Aggregator slots in the pool.", nil, nil),
		members:  prometheus.NewDesc("xdpagg_switch_members", "Job members the switch sends results to.", nil, nil),
		jobs:     prometheus.NewDesc("xdpagg_switch_jobs", "Jobs admitted by the operator (xdpagg job add).", nil, nil),
		rejected: prometheus.NewDesc("xdpagg_agent_control_rejected_total", "Control messages the agent refused, by reason (docs/security.md).", []string{"reason"}, nil),
		scrapeOK: prometheus.NewDesc("xdpagg_switch_scrape_ok", "1 if the maps could be read.", nil, nil),
	}
}

// WithControl adds the refusals of ctrl (ControlServer.Rejected) to what c exports, and returns c.
func (c *Collector) WithControl(ctrl *ControlServer) *Collector {
	c.ctrl = ctrl
	return c
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.packets, c.slots, c.pool, c.members, c.jobs, c.rejected, c.scrapeOK} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	ok := 1.0
	if cnt, err := c.maps.ReadCounters(); err == nil {
		for i, v := range cnt {
			ch <- prometheus.MustNewConstMetric(c.packets, prometheus.CounterValue, float64(v), maps.CounterName(maps.Counter(i)))
		}
	} else {
		ok = 0
	}
	if used, err := c.maps.SlotsInUse(); err == nil {
		byState := map[string]int{"aggregating": 0, "complete": 0}
		for _, s := range used {
			byState[s.State]++
		}
		for st, n := range byState {
			ch <- prometheus.MustNewConstMetric(c.slots, prometheus.GaugeValue, float64(n), st)
		}
	} else {
		ok = 0
	}
	ch <- prometheus.MustNewConstMetric(c.pool, prometheus.GaugeValue, float64(c.maps.PoolSize()))
	if ms, err := c.maps.ListMembers(); err == nil {
		ch <- prometheus.MustNewConstMetric(c.members, prometheus.GaugeValue, float64(len(ms)))
	} else {
		ok = 0
	}
	if js, err := c.maps.ListJobs(); err == nil {
		ch <- prometheus.MustNewConstMetric(c.jobs, prometheus.GaugeValue, float64(len(js)))
	} else {
		ok = 0
	}
	if c.ctrl != nil {
		// Every reason, refused or not yet: a rate over a series that appears late misses its start.
		got := c.ctrl.Rejected()
		for _, r := range rejectReasons() {
			ch <- prometheus.MustNewConstMetric(c.rejected, prometheus.CounterValue, float64(got[r]), r)
		}
	}
	ch <- prometheus.MustNewConstMetric(c.scrapeOK, prometheus.GaugeValue, ok)
}
