package agent

import (
	"errors"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/mgmt"
)

// Collector exports a switch's counters and slot usage to Prometheus, the sparse datapath's
// recirculation histogram and each sparse job's iteration records, and the agent's refused
// control messages by reason. It reads the maps (and the control server's counters) at scrape
// time, so there is no second copy of the state to drift from the kernel's.
type Collector struct {
	maps     *maps.Maps
	ctrl     *ControlServer // nil: no control-plane metrics
	mgmt     *mgmt.Server   // nil: no management-channel metrics
	mgmtBad  *prometheus.Desc
	packets  *prometheus.Desc
	slots    *prometheus.Desc
	pool     *prometheus.Desc
	members  *prometheus.Desc
	jobs     *prometheus.Desc
	rejected *prometheus.Desc
	help     *prometheus.Desc
	spCache  *prometheus.Desc
	scrapeOK *prometheus.Desc
	// The sparse datapath (docs/sparse.md).
	recirc      *prometheus.Desc
	sparseIter  *prometheus.Desc
	sparseVer   *prometheus.Desc
	sparseFill  *prometheus.Desc
	sparseReady *prometheus.Desc
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
		mgmtBad: prometheus.NewDesc("xdpagg_agent_mgmt_dropped_total",
			"Management connections the agent dropped without an answer, by reason (docs/security.md, Management channel).", []string{"reason"}, nil),
		help: prometheus.NewDesc("xdpagg_agent_help_total",
			"iSwitch's Help (a worker asks for a lost result): requests, cache hits, and the job's members asked and answering (docs/protocol.md, HELP).", []string{"outcome"}, nil),
		spCache: prometheus.NewDesc("xdpagg_agent_sparse_cache_total",
			"The switch CPU's copy of sparse updates: packets stored, evicted and not stored (late), sparse RETRANSMIT requests, hits and misses, packets sent (docs/sparse.md).", []string{"outcome"}, nil),
		scrapeOK: prometheus.NewDesc("xdpagg_switch_scrape_ok", "1 if the maps could be read.", nil, nil),
		recirc: prometheus.NewDesc("xdpagg_switch_recirculation_packets",
			"Hot (sparse) packets by the passes through the pipeline they took: 0 for empty markers, k for k-1 recirculations.", []string{"passes"}, nil),
		sparseIter: prometheus.NewDesc("xdpagg_switch_sparse_iteration",
			"Training iteration a sparse job's record of one iteration parity holds.", []string{"job", "parity"}, nil),
		sparseVer: prometheus.NewDesc("xdpagg_switch_sparse_hot_version",
			"Hot-set version of the iteration a sparse job's record of one parity holds.", []string{"job", "parity"}, nil),
		sparseFill: prometheus.NewDesc("xdpagg_switch_sparse_register_filled",
			"Register slots of a sparse job holding a sum of the iteration its record of one parity holds.", []string{"job", "parity"}, nil),
		sparseReady: prometheus.NewDesc("xdpagg_switch_sparse_record_complete",
			"1 if a sparse job's record of one iteration parity is complete (every worker's hot packets are in), else 0.", []string{"job", "parity"}, nil),
	}
}

// WithControl adds the refusals of ctrl (ControlServer.Rejected) and what its Help did
// (ControlServer.HelpStats) to what c exports, and returns c.
func (c *Collector) WithControl(ctrl *ControlServer) *Collector {
	c.ctrl = ctrl
	return c
}

// WithMgmt adds the management channel's dropped connections (mgmt.Server.BadFrames) to what c
// exports (nil: none), and returns c.
func (c *Collector) WithMgmt(s *mgmt.Server) *Collector {
	c.mgmt = s
	return c
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.packets, c.slots, c.pool, c.members, c.jobs, c.rejected, c.mgmtBad, c.help, c.spCache, c.scrapeOK,
		c.recirc, c.sparseIter, c.sparseVer, c.sparseFill, c.sparseReady} {
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
		if !c.collectSparse(ch, js) {
			ok = 0
		}
	} else {
		ok = 0
	}
	if h, err := c.maps.RecircHistogram(); err == nil {
		for k, n := range h {
			ch <- prometheus.MustNewConstMetric(c.recirc, prometheus.CounterValue, float64(n), strconv.Itoa(k))
		}
	} else {
		ok = 0
	}
	if c.mgmt != nil {
		got := c.mgmt.BadFrames()
		for _, r := range mgmt.BadFrameReasons() {
			ch <- prometheus.MustNewConstMetric(c.mgmtBad, prometheus.CounterValue, float64(got[r]), r)
		}
	}
	if c.ctrl != nil {
		// Every reason, refused or not yet: a rate over a series that appears late misses its start.
		got := c.ctrl.Rejected()
		for _, r := range rejectReasons() {
			ch <- prometheus.MustNewConstMetric(c.rejected, prometheus.CounterValue, float64(got[r]), r)
		}
		for _, o := range c.ctrl.HelpStats().outcomes() {
			ch <- prometheus.MustNewConstMetric(c.help, prometheus.CounterValue, float64(o.n), o.label)
		}
		for _, o := range c.ctrl.SparseCacheStats().outcomes() {
			ch <- prometheus.MustNewConstMetric(c.spCache, prometheus.CounterValue, float64(o.n), o.label)
		}
	}
	ch <- prometheus.MustNewConstMetric(c.scrapeOK, prometheus.GaugeValue, ok)
}

// collectSparse exports the iteration records and register fill of the sparse jobs among js. It
// reports false if one could not be read (a job removed since js was listed is skipped).
func (c *Collector) collectSparse(ch chan<- prometheus.Metric, js []maps.Job) bool {
	ok := true
	for _, j := range js {
		if j.RegArrays == 0 {
			continue
		}
		st, err := c.maps.Sparse(j.JobID)
		if errors.Is(err, maps.ErrNoJob) {
			continue
		}
		if err != nil {
			ok = false
			continue
		}
		job := strconv.FormatUint(uint64(j.JobID), 10)
		for p, r := range st.Records {
			parity := strconv.Itoa(p)
			complete := 0.0
			if r.State == "complete" {
				complete = 1
			}
			ch <- prometheus.MustNewConstMetric(c.sparseIter, prometheus.GaugeValue, float64(r.Iteration), job, parity)
			ch <- prometheus.MustNewConstMetric(c.sparseVer, prometheus.GaugeValue, float64(r.Version), job, parity)
			ch <- prometheus.MustNewConstMetric(c.sparseFill, prometheus.GaugeValue, float64(st.Filled[p]), job, parity)
			ch <- prometheus.MustNewConstMetric(c.sparseReady, prometheus.GaugeValue, complete, job, parity)
		}
	}
	return ok
}
