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
