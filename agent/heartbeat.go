package agent

import (
	"fmt"
	"net/netip"
	"time"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/wire"
)

// SetControllerKey makes the server answer the controller's MSG_HEARTBEATs, authenticated under
// key (ctlauth.KeySize bytes; `xdpagg switch --controller-key-file`), with answers sealed under a
// key derived from it. Without one, heartbeats are refused. Call before Serve.
func (c *ControlServer) SetControllerKey(key []byte) error {
	a, err := ctlauth.NewHeartbeatAnswers(key)
	if err != nil {
		return err
	}
	c.ctlKey, c.hbAnswers = append([]byte(nil), key...), a
	return nil
}

// SetHeartbeatInterfaces makes the server answer heartbeats arriving on the management
// interfaces ifindexes too (any: on every interface), not only on the switch ports: the
// controller sits on a management network of its own (`xdpagg switch --mgmt-listen`). They are
// still authenticated under the controller key. Call before Serve.
func (c *ControlServer) SetHeartbeatInterfaces(any bool, ifindexes ...int) {
	c.hbAnyIface = any
	c.hbIfaces = map[int]bool{}
	for _, i := range ifindexes {
		c.hbIfaces[i] = true
	}
}

// heartbeat answers the controller: job_id 0, a bare header and the trailer under the controller
// key, a fresh stamp. The answer (ctlauth.HeartbeatAnswers) is the request's seq with a struct
// heartbeat_stats body, encrypted and sealed under a key derived from the controller key, from
// the address the request was sent to.
//
// The replay check keeps one record for the controller, whatever the source address and port:
// the controller key has one holder, whose heartbeats (the Monitor's one Stamper, wall clock)
// are one strictly increasing sequence, so a heartbeat recorded and played back from any address
// is refused. A restarted controller's stamps move on with its clock. A legitimate heartbeat
// refused here is one overtaken on the way by the controller's next one to this switch (an
// Interval, 200 ms, later): the controller counted it missed already, as its seq is no longer
// the outstanding one. A copy raced ahead of the original by someone on the path gets the
// answer, which it cannot read, and the controller one miss, as if the heartbeat were dropped.
func (c *ControlServer) heartbeat(b []byte, h wire.Header, ifindex int, from netip.AddrPort) error {
	if c.hbAnswers == nil {
		return refuse(RejectUnauth, "HEARTBEAT from %v: this switch has no controller key", from)
	}
	if h.JobId != 0 || h.Count != 0 || len(b) != wire.HdrSize+ctlauth.TrailerSize {
		return refuse(RejectMalformed, "HEARTBEAT of %d bytes for job %d", len(b), h.JobId)
	}
	if _, ok := c.ports[ifindex]; !ok && !c.hbAnyIface && !c.hbIfaces[ifindex] {
		return refuse(RejectNotAPort, "HEARTBEAT arrived on ifindex %d, neither a switch port nor the management interface", ifindex)
	}
	_, stamp, err := ctlauth.Open(c.ctlKey, b)
	if err != nil {
		return refuse(RejectUnauth, "HEARTBEAT from %v: %w", from, err)
	}
	if err := c.ctlReplay.Check(struct{}{}, stamp); err != nil {
		return refuse(RejectReplay, "HEARTBEAT from %v: %w", from, err)
	}
	st, err := c.heartbeatStats()
	if err != nil {
		return err
	}
	out, err := c.hbAnswers.Seal(h.Seq, c.stamper.Next(), &st)
	if err != nil {
		return err
	}
	if err := c.send(out, from); err != nil {
		return fmt.Errorf("send heartbeat: %w", err)
	}
	return nil
}

// heartbeatStats gathers what the controller watches, from the maps (cheap reads: no slot scan).
func (c *ControlServer) heartbeatStats() (bpf.XdpaggHeartbeatStats, error) {
	st := bpf.XdpaggHeartbeatStats{UptimeNs: uint64(time.Since(c.start)), PoolSize: c.maps.PoolSize(), RegArrays: c.maps.RegArrays()}
	cnt, err := c.maps.ReadCounters()
	if err != nil {
		return st, err
	}
	st.Rx, st.Aggregated, st.ToPs, st.Duplicate = cnt[maps.CntRx], cnt[maps.CntAggregated], cnt[maps.CntToPS], cnt[maps.CntDuplicate]
	st.Completed, st.ShadowTx, st.Flushed = cnt[maps.CntCompleted], cnt[maps.CntShadowTx], cnt[maps.CntFlushed]
	st.Dropped = cnt[maps.CntMalformed] + cnt[maps.CntNotMember] + cnt[maps.CntSpoofed] + cnt[maps.CntIPInvalid] + cnt[maps.CntCtlLimited]
	jobs, err := c.maps.ListJobs()
	if err != nil {
		return st, err
	}
	st.Jobs = uint32(len(jobs))
	for _, j := range jobs {
		st.SlotsHeld += uint32(max(j.Held, 0))
		st.RegArraysUsed += uint32(j.RegArrays)
	}
	ms, err := c.maps.ListMembers()
	if err != nil {
		return st, err
	}
	st.Members = uint32(len(ms))
	if c.cache != nil {
		cs := c.cache.Stats()
		st.CacheEntries, st.CacheHits, st.CacheMisses = cs.Entries, cs.Hits, cs.Misses
	}
	for _, n := range c.Rejected() {
		st.ControlRefused += n
	}
	return st, nil
}
