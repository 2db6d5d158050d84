package agent

import (
	"encoding/binary"
	"errors"
	"math/bits"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/wire"
)

// resultRecord is a results ring-buffer record: a RESULT header for <job, seq> with the
// contributor bitmap (every worker of the fan-in), and vals.
func resultRecord(t *testing.T, job, seq, bitmap uint32, vals ...int32) []byte {
	return resultRecordFan(t, job, seq, bitmap, uint8(bits.Len32(bitmap)), vals...)
}

func resultRecordFan(t *testing.T, job, seq, bitmap uint32, fan uint8, vals ...int32) []byte {
	t.Helper()
	h := wire.Header{Version: wire.Version, Type: wire.MsgResult, Count: uint16(len(vals)),
		JobId: job, Seq: seq, Bitmap0: bitmap, FanIn0: fan, Flags: wire.FlagFromSwitch, ScaleLog2: 24}
	b, err := binary.Append(wire.AppendHeader(nil, &h), binary.LittleEndian, vals)
	if err != nil {
		t.Fatal(err)
	}
	return append(b, make([]byte, 64)...) // the fixed-size record's undefined tail
}

func TestResultCacheEviction(t *testing.T) {
	c := NewResultCache(time.Second, 3)
	now := time.Unix(1000, 0)
	for seq := uint32(10); seq < 13; seq++ {
		if err := c.Store(resultRecord(t, 1, seq, 0b11, int32(seq)), now); err != nil {
			t.Fatal(err)
		}
	}
	if pkt, ok := c.Get(1, 11); !ok || len(pkt) != wire.HdrSize+4 || int32(binary.LittleEndian.Uint32(pkt[wire.HdrSize:])) != 11 {
		t.Fatalf("Get(1, 11) = %x, %v", pkt, ok)
	}
	if _, ok := c.Get(1, 99); ok {
		t.Fatal("Get of an uncached result hit")
	}
	// Worker 0 has everything before 12; worker 1 only before 11: 10 is acked by both.
	c.Ack(1, 0, 12)
	c.Ack(1, 1, 11)
	if _, ok := c.Get(1, 10); ok {
		t.Error("a result every worker acknowledged is still cached")
	}
	if _, ok := c.Get(1, 11); !ok {
		t.Error("a result worker 1 still lacks was evicted")
	}
	c.Ack(1, 1, 5) // stale watermark: no effect
	// Size limit: a fourth result evicts the oldest.
	if err := c.Store(resultRecord(t, 1, 13, 0b11, 13), now.Add(time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	if err := c.Store(resultRecord(t, 1, 14, 0b11, 14), now.Add(2*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	// Age.
	c.Sweep(now.Add(time.Second + time.Millisecond))
	st := c.Stats()
	if st.Entries != 2 || st.EvictedAcked != 1 || st.EvictedAge != 2 || st.Hits != 2 || st.Misses != 2 || st.Stored != 5 || st.Acks != 3 {
		t.Errorf("stats %+v", st)
	}
	c.Sweep(now.Add(time.Hour))
	if st := c.Stats(); st.Entries != 0 || st.Bytes != 0 {
		t.Errorf("after sweeping everything: %+v", st)
	}
	// A result already acknowledged by every worker is not kept.
	if err := c.Store(resultRecord(t, 1, 10, 0b11, 10), now); err != nil {
		t.Fatal(err)
	}
	if _, ok := c.Get(1, 10); ok {
		t.Error("stored a result both workers already acknowledged")
	}
}

func TestResultCacheRejectsBadRecords(t *testing.T) {
	c := NewResultCache(time.Second, 10)
	good := resultRecord(t, 1, 1, 1, 5)
	bad := func(f func(b []byte) []byte) []byte { return f(append([]byte(nil), good...)) }
	for name, rec := range map[string][]byte{
		"short":      good[:wire.HdrSize-1],
		"not result": bad(func(b []byte) []byte { b[1] = wire.MsgData; return b }),
		"count 0":    bad(func(b []byte) []byte { binary.LittleEndian.PutUint16(b[6:], 0); return b }),
		"count past": bad(func(b []byte) []byte { binary.LittleEndian.PutUint16(b[6:], 1000); return b }),
	} {
		if err := c.Store(rec, time.Now()); !errors.Is(err, errBadRecord) {
			t.Errorf("%s: Store = %v, want errBadRecord", name, err)
		}
	}
	if st := c.Stats(); st.Entries != 0 {
		t.Errorf("bad records were stored: %+v", st)
	}
}

// RETRANSMIT from a member: the cached result comes back with F_CACHED; a miss is answered with
// an authenticated ACK; an ACK feeds the cache and is not answered. Nobody but the worker id's
// binding gets a result out of the cache or moves its acknowledgements.
func TestHandleRetransmit(t *testing.T) {
	ct := newCtlTest(t)
	c := ct.c
	cache := NewResultCache(time.Minute, 100)
	c.SetCache(cache)
	w := newWorker(t)
	other := newWorkerAt(t, "127.0.0.2")
	accept(t, c, join(t, ct.key, 1, 1), testPort, w.addr)
	w.readAck(t, ct.key)
	accept(t, c, join(t, ct.key, 1, 0), testPort2, other.addr)
	other.readAck(t, ct.key)
	if err := cache.Store(resultRecord(t, testJob, 42, 0b11, 7, -8), time.Now()); err != nil {
		t.Fatal(err)
	}
	accept(t, c, rtx(t, ct.key, 42, 1), testPort, w.addr)
	buf := make([]byte, 256)
	_ = w.conn.SetReadDeadline(time.Now().Add(failsafeFor))
	n, _, err := w.conn.ReadFromUDPAddrPort(buf)
	if err != nil || n != wire.HdrSize+8 {
		t.Fatalf("cached result: %d bytes, %v", n, err)
	}
	var h wire.Header
	wire.DecodeHeader(buf, &h)
	if h.Type != wire.MsgResult || h.Seq != 42 || h.Flags&wire.FlagCached == 0 ||
		int32(binary.LittleEndian.Uint32(buf[wire.HdrSize+4:])) != -8 {
		t.Errorf("cached result %+v %x", h, buf[wire.HdrSize:n])
	}
	// The cache keeps its copy unflagged.
	if pkt, ok := cache.Get(testJob, 42); !ok || wire.PacketFlags(pkt)&wire.FlagCached != 0 {
		t.Errorf("cached copy after a hit: %x, %v", pkt, ok)
	}
	// Miss: ACK with the same seq.
	accept(t, c, rtx(t, ct.key, 43, 1), testPort, w.addr)
	if a, _ := w.readAck(t, ct.key); a.Type != msgAck || a.Seq != 43 || a.JobId != testJob || a.WorkerId != 1 {
		t.Errorf("miss answered with %+v", a)
	}
	// ... and passed on to the job's other member (member-assisted Help).
	if q, _ := other.readAck(t, ct.key); q.Type != wire.MsgHelp || q.Seq != 43 || q.JobId != testJob || q.WorkerId != 0 || q.Count != 0 {
		t.Errorf("the other member was asked with %+v, want a HELP request for seq 43", q)
	}
	// A RETRANSMIT claiming another worker id (bound elsewhere) is refused, and so is one from
	// another host for this one.
	wantRefused(t, c.handle(rtx(t, ct.key, 42, 0), testPort, w.addr), RejectNotMember, "RETRANSMIT")
	wantRefused(t, c.handle(rtx(t, ct.key, 42, 1), testPort2, other.addr), RejectNotMember, "RETRANSMIT")
	// ACKs from outside the binding do not move the cache's watermarks.
	wantRefused(t, c.handle(ack(t, ct.key, 100, 1), testPort2, other.addr), RejectNotMember, "ACK")
	// ACK: no answer, fed to the cache.
	accept(t, c, ack(t, ct.key, 100, 1), testPort, w.addr)
	accept(t, c, ack(t, ct.key, 100, 0), testPort2, other.addr)
	w.noDatagram(t)
	other.noDatagram(t)
	if _, ok := cache.Get(testJob, 42); ok {
		t.Error("a result both workers acknowledged is still cached")
	}
	if st := cache.Stats(); st.Hits != 2 || st.Misses != 2 || st.Acks != 2 {
		t.Errorf("cache stats %+v", st)
	}
}

func TestResultCacheForgetJob(t *testing.T) {
	c := NewResultCache(time.Minute, 100)
	now := time.Unix(1000, 0)
	for _, job := range []uint32{1, 2} {
		for seq := uint32(10); seq < 13; seq++ {
			if err := c.Store(resultRecord(t, job, seq, 0b1, int32(seq)), now); err != nil {
				t.Fatal(err)
			}
		}
	}
	c.Ack(1, 0, 11) // job 1: seq 10 evicted, worker 0 has everything before 11
	c.Sweep(now)
	c.ForgetJob(1)
	for seq := uint32(10); seq < 13; seq++ {
		if _, ok := c.Get(1, seq); ok {
			t.Errorf("forgotten job 1's seq %d still cached", seq)
		}
		if _, ok := c.Get(2, seq); !ok {
			t.Errorf("job 2's seq %d was dropped", seq)
		}
	}
	st := c.Stats()
	if st.Entries != 3 || st.Bytes != 3*uint64(wire.HdrSize+4) || st.EvictedAcked != 1 || st.EvictedAge != 2 {
		t.Errorf("stats after ForgetJob(1): %+v", st)
	}
	// Job 1's acknowledgements went too: its seq 10 is cached again.
	if err := c.Store(resultRecord(t, 1, 10, 0b1, 10), now); err != nil {
		t.Fatal(err)
	}
	if _, ok := c.Get(1, 10); !ok {
		t.Error("a result of the forgotten job below its old acknowledgements was not cached")
	}
	c.ForgetJobs(func(uint32) bool { return true })
	if st := c.Stats(); st.Entries != 0 || st.Bytes != 0 {
		t.Errorf("after forgetting every job: %+v", st)
	}
	c.Sweep(now.Add(time.Hour)) // the queues' stale keys are skipped
	c.ForgetJob(3)              // unknown: nothing
}

// A result completed at a threshold H below the fan-in stays cached until every worker of the
// fan-in acknowledged it, not only its contributors: the slow worker outside the sum may still
// have to ask for it.
func TestResultCacheKeepsForTheSlowWorker(t *testing.T) {
	c := NewResultCache(time.Minute, 100)
	if err := c.Store(resultRecordFan(t, 1, 10, 0b011, 3, 7), time.Unix(1000, 0)); err != nil {
		t.Fatal(err)
	}
	c.Ack(1, 0, 11)
	c.Ack(1, 1, 11)
	if _, ok := c.Get(1, 10); !ok {
		t.Fatal("evicted once its contributors acknowledged it; worker 2 has not")
	}
	c.Ack(1, 2, 11)
	if _, ok := c.Get(1, 10); ok {
		t.Fatal("still cached after every worker acknowledged it")
	}
}

// TestResultCacheShare: a job whose results go unacknowledged (a tenant flooding sums of its own)
// fills the cache and pushes out only its own results; another job's results stay, and that job's
// own pushes out the flooder's until both hold an equal share, then its own oldest.
func TestResultCacheShare(t *testing.T) {
	const size = 100
	c := NewResultCache(time.Minute, size)
	now := time.Unix(1000, 0)
	store := func(job, seq uint32) {
		t.Helper()
		if err := c.Store(resultRecord(t, job, seq, 0b11, int32(seq)), now); err != nil {
			t.Fatal(err)
		}
	}
	const victim, flooder = 1, 2
	for seq := range uint32(10) {
		store(victim, seq)
	}
	for seq := range uint32(3000) {
		store(flooder, seq)
	}
	has := func(job, seq uint32) bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		_, ok := c.entries[cacheKey{job, seq}]
		return ok
	}
	for seq := range uint32(10) {
		if !has(victim, seq) {
			t.Errorf("the flood evicted the victim's result %d", seq)
		}
	}
	if !has(flooder, 2999) || has(flooder, 2909) {
		t.Error("the flooder's results beyond its share are not its oldest ones evicted")
	}
	// The victim's oldest result, at the front of the age queue, does not let the flooder's
	// evicted keys pile up behind it.
	if n := len(c.order.keys) - c.order.head; n > 2*size+1024+1 {
		t.Errorf("age queue holds %d keys for %d results", n, size)
	}
	// The victim stores 60 more: it takes the flooder's entries up to an equal share, then
	// evicts its own oldest.
	for seq := range uint32(60) {
		store(victim, 10+seq)
	}
	held := func(job uint32) int {
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.jobs[job].n
	}
	if held(victim) != size/2 || held(flooder) != size/2 {
		t.Errorf("victim holds %d, flooder %d; want %d each", held(victim), held(flooder), size/2)
	}
	if has(victim, 19) || !has(victim, 20) || !has(victim, 69) {
		t.Error("the victim's results beyond an equal share are not its oldest ones evicted")
	}
	if st := c.Stats(); st.Entries != size || st.EvictedAge != 3070-size || st.Stored != 3070 {
		t.Errorf("stats %+v", st)
	}
	// Acknowledged results leave the job's share.
	c.Ack(victim, 0, 70)
	c.Ack(victim, 1, 70)
	if held(victim) != 0 || c.Stats().Entries != size/2 {
		t.Errorf("after the victim's acknowledgements it holds %d, %+v", held(victim), c.Stats())
	}
}

// TestResultCacheQueuesBounded: a job that never acknowledges, whose results only age out, keeps
// its queue of keys bounded (it once grew by a key per result for ever), and so does the age
// queue; results stored twice do not make either grow.
func TestResultCacheQueuesBounded(t *testing.T) {
	c := NewResultCache(time.Millisecond, 1<<20)
	now := time.Unix(1000, 0)
	for seq := range uint32(50_000) {
		if err := c.Store(resultRecord(t, 7, seq, 0b11, 1), now); err != nil {
			t.Fatal(err)
		}
		if seq%3 == 0 { // a late copy of the same result
			if err := c.Store(resultRecord(t, 7, seq, 0b11, 1), now); err != nil {
				t.Fatal(err)
			}
		}
		now = now.Add(time.Millisecond)
		c.Sweep(now)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	ja := c.jobs[7]
	if n := len(ja.order.keys) - ja.order.head; n > 2*ja.n+1024+1 {
		t.Errorf("the job's queue holds %d keys for %d results", n, ja.n)
	}
	if n := len(c.order.keys) - c.order.head; n > 2*len(c.entries)+1024+1 {
		t.Errorf("the age queue holds %d keys for %d results", n, len(c.entries))
	}
}
