package agent

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"sync/atomic"
	"time"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/wire"
)

// Member-assisted Help (iSwitch's Help, completed; docs/protocol.md "HELP"). A worker that lost a
// result asks the agent (MSG_RETRANSMIT, the Help request). The retransmit cache answers what the
// switch completed lately; what it does not hold (the cache off or full, the sum completed at the
// PS, or lost by a failover) some other member of the job may still have, since every member got
// the same broadcast. So on a miss the agent asks the job's other members (MSG_HELP, header only,
// from the switch's address on each member's port), a member that keeps the result answers with
// it (MSG_HELP with values, in parts, under the job key), and the agent sends it on to the
// requester as a MSG_RESULT with F_CACHED, and keeps it in its cache.

// Limits of member-assisted Help.
const (
	// HelpWindow is how long the agent waits for members' answers to one result it asked them
	// for, and keeps a recovered result to answer the same request again (without a cache):
	// longer than a worker retries a fragment with the default timeout (50 resends, 8 x 20 ms).
	HelpWindow = 10 * time.Second
	// MaxHelpPending bounds the results being asked for or recently recovered, over all jobs.
	// It is shared fairly: while it is full, a job holding fewer entries than the job holding
	// the most takes one of that job's entries (HelpStats.Evicted), so a job flooding Help
	// requests for its own results pushes out only its own, and every job asking keeps at least
	// an equal share. A miss of a job holding the most already is not passed on to members
	// (HelpStats.Full): the requester's data timer goes on as without Help.
	MaxHelpPending = 4096
	// helpSweepEvery is how often a full table is swept for expired entries at most: a sweep
	// walks the whole table, which a flood of requests must not make the agent do per request.
	helpSweepEvery = time.Second
)

// HelpStats counts what member-assisted Help did (ControlServer.HelpStats; Prometheus
// xdpagg_agent_help_total{outcome}).
type HelpStats struct {
	Requests   uint64 // Help requests (MSG_RETRANSMIT) accepted from members
	CacheHits  uint64 // of Requests: answered from the retransmit cache
	Asked      uint64 // MSG_HELP requests sent to members
	Parts      uint64 // members' answers (parts of results) accepted
	Recovered  uint64 // results completed from members' answers and sent to their requesters
	Resent     uint64 // requests answered again from a result recovered earlier
	Late       uint64 // answers for a result already recovered: dropped
	Unanswered uint64 // results asked for that no member answered within HelpWindow
	Full       uint64 // misses not passed on to members: MaxHelpPending outstanding, the requester's job holding the most
	Evicted    uint64 // pending requests dropped for another job's: their job held the most of a full table
	Incomplete uint64 // misses not passed on to members: the switch still aggregates the sum, so nobody has it
}

// helpCounters are HelpStats as the control server counts them.
type helpCounters struct {
	requests, cacheHits, asked, parts, recovered, resent, late, unanswered, full, evicted, incomplete atomic.Uint64
}

// HelpStats returns what member-assisted Help did so far.
func (c *ControlServer) HelpStats() HelpStats {
	s := &c.helpSt
	return HelpStats{Requests: s.requests.Load(), CacheHits: s.cacheHits.Load(), Asked: s.asked.Load(), Parts: s.parts.Load(),
		Recovered: s.recovered.Load(), Resent: s.resent.Load(), Late: s.late.Load(), Unanswered: s.unanswered.Load(), Full: s.full.Load(),
		Evicted: s.evicted.Load(), Incomplete: s.incomplete.Load()}
}

// helpOutcomes lists HelpStats by their metric label, in a stable order.
func (s HelpStats) outcomes() []struct {
	label string
	n     uint64
} {
	return []struct {
		label string
		n     uint64
	}{{"requests", s.Requests}, {"cache_hits", s.CacheHits}, {"asked", s.Asked}, {"parts", s.Parts}, {"recovered", s.Recovered},
		{"resent", s.Resent}, {"late", s.Late}, {"unanswered", s.Unanswered}, {"full", s.Full}, {"evicted", s.Evicted}, {"incomplete", s.Incomplete}}
}

type helpKey struct{ job, seq uint32 }

// helpTable holds the results asked of members lately, and how many each job holds (its share
// of MaxHelpPending). Guarded by ControlServer.mu.
type helpTable struct {
	reqs      map[helpKey]*helpReq
	perJob    map[uint32]int
	nextSweep time.Time // a full table is swept again no sooner
}

func newHelpTable() helpTable {
	return helpTable{reqs: map[helpKey]*helpReq{}, perJob: map[uint32]int{}}
}

func (t *helpTable) put(k helpKey, r *helpReq) {
	if _, ok := t.reqs[k]; !ok {
		t.perJob[k.job]++
	}
	t.reqs[k] = r
}

func (t *helpTable) del(k helpKey) {
	if _, ok := t.reqs[k]; !ok {
		return
	}
	delete(t.reqs, k)
	if t.perJob[k.job]--; t.perJob[k.job] <= 0 {
		delete(t.perJob, k.job)
	}
}

// helpWaiter is a member waiting for a result: where its Help request came from and the switch
// address it was sent to (answers leave from there: the worker accepts results only from it).
type helpWaiter struct {
	worker uint8
	to     netip.AddrPort
	src    net.IP
}

// helpReq is one result asked of a job's members. Guarded by ControlServer.mu.
type helpReq struct {
	until   time.Time
	asked   uint32 // worker ids asked: only they may answer
	waiters []helpWaiter
	done    bool        // recovered: pkt holds the result, later answers are late
	hdr     wire.Header // the first accepted part's header: every part must agree with it
	total   int
	parts   uint32 // parts received, bit i for values [i*HelpPartValues, ...)
	pkt     []byte // the result being assembled: header + total values
}

// helpParts is how many parts a result of total values travels in.
func helpParts(total int) int { return (total + wire.HelpPartValues - 1) / wire.HelpPartValues }

// helpFromMembers passes a Help request the cache could not serve on to the job's other members:
// an authenticated MSG_HELP to each (but the requester), from the switch's address on its port.
// A result recovered lately is sent again at once. It reports whether the request was sent on.
//
// A request whose slot (the request's agg_index, a hint from the worker) still aggregates that
// very fragment is not passed on: the sum is not complete, so no member has it. That is what a
// worker waiting on a slow partner asks for, a window of fragments at a time; fanning each out to
// every member would cost the agent (members-1) messages per fragment for nothing.
func (c *ControlServer) helpFromMembers(h wire.Header, key []byte, from netip.AddrPort, now time.Time) (bool, error) {
	k := helpKey{h.JobId, h.Seq}
	w := helpWaiter{worker: h.WorkerId, to: from, src: c.replySrc}
	if s, err := c.maps.Slot(h.AggIndex); err == nil && s.JobId == h.JobId && s.Seq == h.Seq &&
		s.State == uint8(bpf.XdpaggSlotStateSLOT_AGGREGATING) {
		c.helpSt.incomplete.Add(1)
		return false, nil
	}
	c.mu.Lock()
	r := c.help.reqs[k]
	if r != nil && now.After(r.until) {
		c.dropHelp(k, r)
		r = nil
	}
	if r != nil && r.done {
		pkt := r.pkt
		c.mu.Unlock()
		c.helpSt.resent.Add(1)
		return true, c.sendRecovered(pkt, []helpWaiter{w})
	}
	if r == nil {
		if !c.helpRoomLocked(h.JobId, now) {
			c.mu.Unlock()
			c.helpSt.full.Add(1)
			return false, nil
		}
		r = &helpReq{until: now.Add(HelpWindow), waiters: []helpWaiter{w}}
		c.help.put(k, r)
	} else if i := slices.IndexFunc(r.waiters, func(x helpWaiter) bool { return x.worker == w.worker }); i >= 0 {
		// Asked again by a member already waiting: the earlier requests (or their answers)
		// were lost, or no member had the result yet. Ask the members again.
		r.waiters[i] = w // where it asks from now
	} else {
		// A new waiter rides on the pending request.
		r.waiters = append(r.waiters, w)
		c.mu.Unlock()
		return true, nil
	}
	waiting := uint32(0)
	for _, x := range r.waiters {
		waiting |= 1 << x.worker
	}
	c.mu.Unlock()

	var asked uint32
	_, err := c.toMembers(h.JobId, "help request", func(m maps.Member, src net.IP) error {
		if waiting&(1<<m.WorkerID) != 0 {
			return nil
		}
		if err := c.sendHeaderFrom(wire.MsgHelp, h.JobId, h.Seq, m.WorkerID, key, m.Addr, src); err != nil {
			return err
		}
		asked |= 1 << m.WorkerID
		c.helpSt.asked.Add(1)
		return nil
	})
	if err != nil {
		return false, err
	}
	c.mu.Lock()
	if r := c.help.reqs[k]; r != nil {
		r.asked |= asked
	}
	c.mu.Unlock()
	return true, nil
}

// errLateHelp is a member's answer for a result already recovered: dropped, not refused.
var errLateHelp = fmt.Errorf("late help answer")

// checkHelpAnswer decides whether a member's MSG_HELP answer (msg, without its trailer) may be
// taken, changing nothing: its body must describe one part of a result exactly, the result must
// be one the agent asked this worker id for, and the part must agree with the parts already in.
func (c *ControlServer) checkHelpAnswer(h wire.Header, msg []byte, now time.Time) (bpf.XdpaggHelpBody, error) {
	var body bpf.XdpaggHelpBody
	if _, err := binary.Decode(msg[wire.HdrSize:], binary.LittleEndian, &body); err != nil {
		return body, refuse(RejectMalformed, "help body: %w", err)
	}
	total, off := int(body.Total), int(body.Offset)
	switch {
	case body.Reserved != 0:
		return body, refuse(RejectMalformed, "help body reserved %#x, must be 0", body.Reserved)
	case total < 1 || total > wire.MaxValues || off%wire.HelpPartValues != 0 || off >= total ||
		int(h.Count) != min(wire.HelpPartValues, total-off):
		return body, refuse(RejectMalformed, "help answer part of %d values at %d of %d: not one part of a result", h.Count, off, total)
	case h.Encoding != wire.EncFixed32 && h.Encoding != wire.EncFloat32:
		return body, refuse(RejectMalformed, "help answer with encoding %d", h.Encoding)
	case h.Flags&wire.FlagOverflow != 0:
		return body, refuse(RejectMalformed, "help answer with F_OVERFLOW: not a sum")
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	r := c.help.reqs[helpKey{h.JobId, h.Seq}]
	if r == nil || now.After(r.until) || r.asked&(1<<h.WorkerId) == 0 {
		return body, refuse(RejectUnsolicited, "HELP answer of job %d seq %d from worker %d, which was not asked for it", h.JobId, h.Seq, h.WorkerId)
	}
	if r.done {
		return body, errLateHelp
	}
	if r.parts != 0 && (r.total != total || !sameResult(r.hdr, h)) {
		return body, refuse(RejectMalformed, "HELP answer of job %d seq %d from worker %d disagrees with the parts already in", h.JobId, h.Seq, h.WorkerId)
	}
	return body, nil
}

// sameResult reports whether two answer parts describe the same result.
func sameResult(a, b wire.Header) bool {
	return a.Encoding == b.Encoding && a.ScaleLog2 == b.ScaleLog2 && a.Flags == b.Flags && a.AggIndex == b.AggIndex &&
		a.Bitmap0 == b.Bitmap0 && a.Bitmap1 == b.Bitmap1 && a.FanIn0 == b.FanIn0 && a.FanIn1 == b.FanIn1
}

// takeHelpAnswer adds a checked part to its result; the last part sends the result to every
// waiting member (F_CACHED) and stores it in the retransmit cache.
func (c *ControlServer) takeHelpAnswer(h wire.Header, body bpf.XdpaggHelpBody, msg []byte, now time.Time) error {
	c.helpSt.parts.Add(1)
	k := helpKey{h.JobId, h.Seq}
	c.mu.Lock()
	r := c.help.reqs[k]
	if r == nil || r.done { // cannot happen: checked in this goroutine just before
		c.mu.Unlock()
		return nil
	}
	total, off := int(body.Total), int(body.Offset)
	if r.parts == 0 {
		r.hdr, r.total = h, total
		res := h
		res.Type, res.Count, res.WorkerId = wire.MsgResult, uint16(total), 0
		res.Flags &^= wire.FlagShadow | wire.FlagCached // how the member got it is no business of the requester
		r.pkt = make([]byte, wire.HdrSize+4*total)
		wire.EncodeHeader(r.pkt, &res)
	}
	vals := msg[wire.HdrSize+wire.HelpBodySize:]
	copy(r.pkt[wire.HdrSize+4*off:], vals)
	r.parts |= 1 << (off / wire.HelpPartValues)
	if r.parts != 1<<helpParts(total)-1 {
		c.mu.Unlock()
		return nil
	}
	r.done = true
	pkt, waiters := r.pkt, r.waiters
	r.waiters = nil
	c.mu.Unlock()
	c.helpSt.recovered.Add(1)
	if c.cache != nil {
		if err := c.cache.Store(pkt, now); err != nil {
			return err
		}
	}
	c.log.Debug("result recovered from a member", "job", h.JobId, "seq", h.Seq, "from_worker", h.WorkerId, "requesters", len(waiters))
	return c.sendRecovered(pkt, waiters)
}

// sendRecovered sends a recovered result to its requesters, flagged F_CACHED, each from the
// address its request was sent to.
func (c *ControlServer) sendRecovered(pkt []byte, to []helpWaiter) error {
	out := append([]byte(nil), pkt...)
	wire.SetPacketFlags(out, wire.PacketFlags(out)|wire.FlagCached)
	var first error
	for _, w := range to {
		if err := c.sendFrom(out, w.to, w.src); err != nil && first == nil {
			first = fmt.Errorf("send recovered result: %w", err)
		}
	}
	return first
}

// sweepHelpLocked drops expired requests (counting those no member answered). Called with mu
// held.
func (c *ControlServer) sweepHelpLocked(now time.Time) {
	for k, r := range c.help.reqs {
		if now.After(r.until) {
			c.dropHelp(k, r)
		}
	}
}

// dropHelp forgets one request. Called with mu held.
func (c *ControlServer) dropHelp(k helpKey, r *helpReq) {
	if !r.done {
		c.helpSt.unanswered.Add(1)
	}
	c.help.del(k)
}

// helpRoomLocked makes room in the table for a new request of job, if job may have it: there is
// room, or expired entries make some (swept at most every helpSweepEvery), or another job holds
// more entries than job, and loses one of them. Called with mu held.
func (c *ControlServer) helpRoomLocked(job uint32, now time.Time) bool {
	t := &c.help
	if len(t.reqs) < MaxHelpPending {
		return true
	}
	if !now.Before(t.nextSweep) {
		c.sweepHelpLocked(now)
		t.nextSweep = now.Add(helpSweepEvery)
		if len(t.reqs) < MaxHelpPending {
			return true
		}
	}
	big, most := job, t.perJob[job]
	for j, n := range t.perJob {
		if n > most {
			big, most = j, n
		}
	}
	if big == job {
		return false // job holds the most: its flood costs only its own requests
	}
	for k := range t.reqs { // the job holding the most holds at least 1/jobs of the table
		if k.job == big {
			t.del(k)
			c.helpSt.evicted.Add(1)
			return true
		}
	}
	return false
}
