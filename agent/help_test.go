package agent

import (
	"bytes"
	"encoding/binary"
	"reflect"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/wire"
)

// helpAnswer is worker's sealed MSG_HELP answer: part [off, off+n) of a result of total values
// (vals, wire bytes) for seq of job, with the result's header fields from res.
func helpAnswer(t *testing.T, key []byte, res wire.Header, worker uint8, total, off, n int, vals []byte) []byte {
	t.Helper()
	h := res
	h.Type, h.Count, h.WorkerId = wire.MsgHelp, uint16(n), worker
	b := wire.AppendHeader(nil, &h)
	b = binary.LittleEndian.AppendUint16(b, uint16(total))
	b = binary.LittleEndian.AppendUint16(b, uint16(off))
	b = binary.LittleEndian.AppendUint32(b, 0)
	b = append(b, vals[4*off:4*(off+n)]...)
	return seal(t, key, b)
}

// twoMembers joins workers 0 (127.0.0.1, behind testPort) and 1 (127.0.0.3, behind testPort2) of
// testJob.
func (ct *ctlTest) twoMembers(t *testing.T) (w0, w1 *worker) {
	t.Helper()
	w0, w1 = newWorker(t), newWorkerAt(t, "127.0.0.3")
	accept(t, ct.c, join(t, ct.key, 1, 0), testPort, w0.addr)
	w0.readAck(t, ct.key)
	accept(t, ct.c, sealed(t, ct.key, hdr(msgJoin, testJob, 2, 1), joinBody(workerMAC, resultIP)), testPort2, w1.addr)
	w1.readAck(t, ct.key)
	return w0, w1
}

// readRaw reads one datagram from the worker's socket.
func (w *worker) readRaw(t *testing.T) []byte {
	t.Helper()
	b, _ := w.read(t, "datagram")
	return b
}

// TestHandleHelp: a Help request (RETRANSMIT) the cache cannot answer is passed on to the job's
// other members as an authenticated MSG_HELP; a member's answer is taken only from the binding of
// a worker id that was asked, authentic, fresh and exactly one part of a result, and the whole
// result reaches the requester as a MSG_RESULT with F_CACHED and stays in the cache. Outsiders,
// members of another job, the requester itself, answers nobody asked for, replays and malformed
// parts are refused and change nothing.
func TestHandleHelp(t *testing.T) {
	ct := newCtlTest(t)
	c := ct.c
	cache := NewResultCache(time.Minute, 100)
	c.SetCache(cache)
	w0, w1 := ct.twoMembers(t)
	w2, outsider := newWorkerAt(t, "127.0.0.4"), newWorkerAt(t, "127.0.0.2")
	// Worker 2 is a member of the other job only (behind testPort2 as well).
	accept(t, c, sealed(t, ct.otherKey, hdr(msgJoin, otherJob, 3, 2), joinBody(workerMAC, otherPS.Addr())), testPort2, w2.addr)
	w2.readAck(t, ct.otherKey)

	// Worker 0 asks for seq 50: a miss, acknowledged, and worker 1 (only) is asked.
	accept(t, c, rtx(t, ct.key, 50, 0), testPort, w0.addr)
	if a, _ := w0.readAck(t, ct.key); a.Type != msgAck || a.Seq != 50 {
		t.Fatalf("miss answered with %+v", a)
	}
	q, _ := w1.readAck(t, ct.key)
	if want := (wire.Header{Version: wire.Version, Type: wire.MsgHelp, JobId: testJob, Seq: 50, WorkerId: 1}); q != want {
		t.Fatalf("worker 1 asked with %+v, want %+v", q, want)
	}
	w0.noDatagram(t)
	w2.noDatagram(t)

	// The result worker 1 holds: 300 values, so two parts.
	const total = 300
	res := wire.Header{Version: wire.Version, Type: wire.MsgResult, Encoding: wire.EncFixed32, ScaleLog2: 24,
		Flags: wire.FlagFromSwitch | wire.FlagShadow, Count: total, JobId: testJob, Seq: 50, AggIndex: 9, Bitmap0: 0b11, Bitmap1: 64, FanIn0: 2}
	vals := make([]byte, 4*total)
	for i := range total {
		binary.LittleEndian.PutUint32(vals[4*i:], uint32(1000*i-7))
	}
	part0 := helpAnswer(t, ct.key, res, 1, total, 0, wire.HelpPartValues, vals)
	part1 := func() []byte {
		return helpAnswer(t, ct.key, res, 1, total, wire.HelpPartValues, total-wire.HelpPartValues, vals)
	}
	body := func(mut func(b []byte)) func(t *testing.T) []byte {
		return func(t *testing.T) []byte {
			b := append([]byte(nil), part0[:len(part0)-ctlauth.TrailerSize]...)
			mut(b)
			return seal(t, ct.key, b)
		}
	}
	refusals := []struct {
		name    string
		b       func(t *testing.T) []byte
		ifindex int
		from    *worker
		reason  string
		want    string
	}{
		{"an outsider claiming worker 1", func(t *testing.T) []byte { return part0 }, testPort2, outsider, RejectNotMember, "HELP answer of job 42 worker 1"},
		{"worker 1 from another port", func(t *testing.T) []byte { return helpAnswer(t, ct.key, res, 1, total, 0, 256, vals) }, testPort, w1, RejectNotMember, "worker 1"},
		{"under another job's key", func(t *testing.T) []byte {
			return helpAnswer(t, ct.otherKey, res, 1, total, 0, 256, vals)
		}, testPort2, w1, RejectUnauth, "HELP answer"},
		{"a member of another job", func(t *testing.T) []byte {
			r := res
			r.JobId = otherJob
			return helpAnswer(t, ct.otherKey, r, 2, total, 0, 256, vals)
		}, testPort2, w2, RejectUnsolicited, "not asked"},
		{"the requester itself", func(t *testing.T) []byte { return helpAnswer(t, ct.key, res, 0, total, 0, 256, vals) }, testPort, w0, RejectUnsolicited, "not asked"},
		{"a result nobody asked for", func(t *testing.T) []byte {
			r := res
			r.Seq = 51
			return helpAnswer(t, ct.key, r, 1, total, 0, 256, vals)
		}, testPort2, w1, RejectUnsolicited, "seq 51"},
		{"a part cut short", func(t *testing.T) []byte {
			b := part0[:len(part0)-ctlauth.TrailerSize]
			return seal(t, ct.key, b[:len(b)-4])
		}, testPort2, w1, RejectMalformed, "HELP answer"},
		{"no values", func(t *testing.T) []byte {
			h := res
			h.Type, h.Count, h.WorkerId = wire.MsgHelp, 0, 1
			return sealed(t, ct.key, h, nil)
		}, testPort2, w1, RejectMalformed, "a part holds"},
		{"an offset not at a part", body(func(b []byte) { binary.LittleEndian.PutUint16(b[wire.HdrSize+2:], 100) }), testPort2, w1, RejectMalformed, "not one part"},
		{"a total the part disagrees with", body(func(b []byte) { binary.LittleEndian.PutUint16(b[wire.HdrSize:], 200) }), testPort2, w1, RejectMalformed, "not one part"},
		{"reserved body bits", body(func(b []byte) { b[wire.HdrSize+4] = 1 }), testPort2, w1, RejectMalformed, "reserved"},
		{"an overflowed sum", body(func(b []byte) { wire.SetPacketFlags(b, wire.FlagOverflow) }), testPort2, w1, RejectMalformed, "F_OVERFLOW"},
		{"a sparse encoding", body(func(b []byte) { b[wire.OffEncoding] = wire.EncSparseKV }), testPort2, w1, RejectMalformed, "encoding"},
	}
	for _, r := range refusals {
		t.Run(r.name, func(t *testing.T) {
			before := fzSnapshot(t, ct.sw.Maps)
			wantRefused(t, c.handle(r.b(t), r.ifindex, r.from.addr), r.reason, r.want)
			if after := fzSnapshot(t, ct.sw.Maps); !reflect.DeepEqual(before, after) {
				t.Errorf("refused answer changed the maps")
			}
			for _, w := range []*worker{w0, w1, w2, outsider} {
				w.noDatagram(t)
			}
		})
	}
	if _, ok := cache.Get(testJob, 50); ok {
		t.Fatal("a refused answer reached the cache")
	}

	// Worker 1's two parts: nothing goes out before the last one.
	accept(t, c, part0, testPort2, w1.addr)
	w0.noDatagram(t)
	wantRefused(t, c.handle(part0, testPort2, w1.addr), RejectReplay, "HELP answer") // a replay of an accepted part
	accept(t, c, part1(), testPort2, w1.addr)
	got := w0.readRaw(t)
	var h wire.Header
	wire.DecodeHeader(got, &h)
	want := res
	want.Flags = wire.FlagFromSwitch | wire.FlagCached
	if h != want || len(got) != wire.HdrSize+4*total || !bytes.Equal(got[wire.HdrSize:], vals) {
		t.Errorf("recovered result %+v (%d bytes), want %+v and the member's values", h, len(got), want)
	}
	w1.noDatagram(t) // answers are not acknowledged
	// It stays in the cache: the next request for it is a hit.
	if pkt, ok := cache.Get(testJob, 50); !ok || !bytes.Equal(pkt[wire.HdrSize:], vals) {
		t.Errorf("recovered result not cached: %v", ok)
	}
	// A late answer (another member's, or a resend) changes nothing and is not refused; played
	// again, it is a replay.
	late := part1()
	accept(t, c, late, testPort2, w1.addr)
	w0.noDatagram(t)
	wantRefused(t, c.handle(late, testPort2, w1.addr), RejectReplay, "HELP answer")

	st := c.HelpStats()
	if st.Requests != 1 || st.Asked != 1 || st.Parts != 2 || st.Recovered != 1 || st.Late != 1 || st.CacheHits != 0 {
		t.Errorf("HelpStats = %+v", st)
	}
	if got := c.Rejected()[RejectUnsolicited]; got != 0 {
		t.Errorf("handle counted refusals itself: %d", got) // Serve counts them (reject)
	}
	col := NewCollector(ct.sw.Maps).WithControl(c)
	series := map[string]float64{}
	for _, s := range gather(t, col)["xdpagg_agent_help_total"] {
		series[s.labels["outcome"]] = s.value
	}
	if series["recovered"] != 1 || series["asked"] != 1 || series["requests"] != 1 || len(series) != 11 {
		t.Errorf("xdpagg_agent_help_total = %v", series)
	}
}

// Without a retransmit cache, a result recovered from a member answers the same request again
// at once; nothing is asked of members while a request for that result is pending, but a
// requester asking again (its earlier request unanswered) asks them again.
func TestHandleHelpWithoutCache(t *testing.T) {
	ct := newCtlTest(t)
	c := ct.c
	w0, w1 := ct.twoMembers(t)

	for range 2 {
		accept(t, c, rtx(t, ct.key, 7, 0), testPort, w0.addr)
		w0.readAck(t, ct.key)
		if q, _ := w1.readAck(t, ct.key); q.Type != wire.MsgHelp || q.Seq != 7 {
			t.Fatalf("worker 1 asked with %+v", q)
		}
	}
	res := wire.Header{Version: wire.Version, Type: wire.MsgResult, Encoding: wire.EncFloat32, Count: 3, JobId: testJob, Seq: 7, AggIndex: 1, Bitmap0: 0b11, FanIn0: 2}
	vals := []byte{1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0}
	accept(t, c, helpAnswer(t, ct.key, res, 1, 3, 0, 3, vals), testPort2, w1.addr)
	if got := w0.readRaw(t); !bytes.Equal(got[wire.HdrSize:], vals) || wire.PacketFlags(got)&wire.FlagCached == 0 {
		t.Errorf("recovered result %x", got)
	}
	// Asked again (the forwarded result lost): answered from the recovered copy, members untouched.
	accept(t, c, rtx(t, ct.key, 7, 0), testPort, w0.addr)
	if got := w0.readRaw(t); len(got) != wire.HdrSize+len(vals) || !bytes.Equal(got[wire.HdrSize:], vals) {
		t.Errorf("second answer %x", got)
	}
	w0.readAck(t, ct.key)
	w1.noDatagram(t)
	if st := c.HelpStats(); st.Asked != 2 || st.Recovered != 1 || st.Resent != 1 {
		t.Errorf("HelpStats = %+v", st)
	}
	// A removed job's requests are forgotten.
	c.forgetRemoved(map[uint32]bool{})
	c.mu.Lock()
	n := len(c.help.reqs)
	c.mu.Unlock()
	if n != 0 {
		t.Errorf("%d help requests remembered after the job's removal", n)
	}
}

// A Help request for a fragment its slot still aggregates is not passed on to members: the sum is
// not complete, so nobody has it (a worker waiting on a slow partner asks for a window of those).
// Once the slot holds another fragment (or none), members are asked.
func TestHandleHelpIncomplete(t *testing.T) {
	ct := newCtlTest(t)
	c, m := ct.c, ct.sw.Maps
	w0, w1 := ct.twoMembers(t)
	const idx = 5
	var s bpf.XdpaggSlot
	s.JobId, s.Seq, s.State, s.FanIn, s.Nvals, s.Bitmap = testJob, 60, uint8(bpf.XdpaggSlotStateSLOT_AGGREGATING), 2, 1, 1
	if err := m.Slots.Update(uint32(idx), &s, ebpf.UpdateExist); err != nil {
		t.Fatal(err)
	}
	req := func(seq uint32) []byte {
		h := hdr(msgRtx, testJob, seq, 0)
		h.AggIndex = idx
		return sealed(t, ct.key, h, nil)
	}
	accept(t, c, req(60), testPort, w0.addr)
	if a, _ := w0.readAck(t, ct.key); a.Type != msgAck || a.Seq != 60 {
		t.Errorf("miss answered with %+v", a)
	}
	w1.noDatagram(t)
	// The slot holds another fragment: seq 61 may be complete elsewhere, so members are asked.
	accept(t, c, req(61), testPort, w0.addr)
	w0.readAck(t, ct.key)
	if q, _ := w1.readAck(t, ct.key); q.Type != wire.MsgHelp || q.Seq != 61 {
		t.Errorf("worker 1 asked with %+v", q)
	}
	if st := c.HelpStats(); st.Incomplete != 1 || st.Asked != 1 || st.Requests != 2 {
		t.Errorf("HelpStats = %+v", st)
	}
}

// TestHelpShare: a job flooding Help requests for its own results fills the pending-Help table,
// and another job that needs Help still gets it: the flooder loses one of its own entries
// (evicted), its requests beyond the table are refused (full), and the other job may take up to an
// equal share of the table, no more.
func TestHelpShare(t *testing.T) {
	ct := newCtlTest(t)
	c := ct.c
	w0, w1 := ct.twoMembers(t)
	flooder := newWorkerAt(t, "127.0.0.2") // otherJob's worker 0, a tenant with the job's key
	accept(t, c, sealed(t, ct.otherKey, hdr(msgJoin, otherJob, 3, 0), joinBody(workerMAC, otherPS.Addr())), testPort2, flooder.addr)
	flooder.readAck(t, ct.otherKey)

	// The flood fills the table. Its entries are made as of an hour from now, so that none
	// expires however slowly the test runs.
	later := time.Now().Add(time.Hour)
	fill := func(h wire.Header, key []byte, from *worker, first uint32, n int) {
		t.Helper()
		for i := range uint32(n) {
			h.Seq = first + i
			if sent, err := c.helpFromMembers(h, key, from.addr, later); err != nil || !sent {
				t.Fatalf("help request %d of job %d: sent %v, %v", h.Seq, h.JobId, sent, err)
			}
		}
	}
	fill(hdr(msgRtx, otherJob, 0, 0), ct.otherKey, flooder, 1000, MaxHelpPending)
	held := func(job uint32) int {
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.help.perJob[job]
	}
	// More of the flooder's requests are refused: it holds the whole table.
	accept(t, c, sealed(t, ct.otherKey, hdr(msgRtx, otherJob, 999, 0), nil), testPort2, flooder.addr)
	flooder.readAck(t, ct.otherKey)
	if st := c.HelpStats(); st.Full != 1 || st.Evicted != 0 || held(otherJob) != MaxHelpPending {
		t.Fatalf("after the flood: %+v, flooder holds %d", st, held(otherJob))
	}

	// The victim's Help request still reaches its other member, and the answer the victim.
	accept(t, c, rtx(t, ct.key, 50, 0), testPort, w0.addr)
	w0.readAck(t, ct.key)
	if q, _ := w1.readAck(t, ct.key); q.Type != wire.MsgHelp || q.Seq != 50 {
		t.Fatalf("worker 1 asked with %+v", q)
	}
	res := wire.Header{Version: wire.Version, Type: wire.MsgResult, Encoding: wire.EncFixed32, ScaleLog2: 24, Count: 3,
		JobId: testJob, Seq: 50, AggIndex: 1, Bitmap0: 0b11, FanIn0: 2}
	vals := []byte{1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0}
	accept(t, c, helpAnswer(t, ct.key, res, 1, 3, 0, 3, vals), testPort2, w1.addr)
	if got := w0.readRaw(t); !bytes.Equal(got[wire.HdrSize:], vals) || wire.PacketFlags(got)&wire.FlagCached == 0 {
		t.Errorf("recovered result %x", got)
	}
	if st := c.HelpStats(); st.Evicted != 1 || st.Recovered != 1 || held(testJob) != 1 || held(otherJob) != MaxHelpPending-1 {
		t.Errorf("after the victim's request: %+v, victim holds %d, flooder %d", st, held(testJob), held(otherJob))
	}

	// The victim may take up to an equal share, and no more: then its own requests are refused.
	// (Its first entry, recovered, has expired as of an hour from now.) Every entry the flooder
	// no longer holds it lost to the victim.
	seq := uint32(100)
	for ; seq < 100+MaxHelpPending; seq++ {
		if sent, err := c.helpFromMembers(hdr(msgRtx, testJob, seq, 0), ct.key, w0.addr, later); err != nil {
			t.Fatal(err)
		} else if !sent {
			break
		}
	}
	if held(testJob) != MaxHelpPending/2 || held(otherJob) != MaxHelpPending/2 {
		t.Errorf("victim holds %d, flooder %d; want %d each", held(testJob), held(otherJob), MaxHelpPending/2)
	}
	if st := c.HelpStats(); st.Full != 2 || st.Evicted != MaxHelpPending/2 {
		t.Errorf("HelpStats = %+v", st)
	}
}
