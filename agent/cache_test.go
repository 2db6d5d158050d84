package agent

import (
	"encoding/binary"
	"errors"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/bpf"
)

// resultRecord is a results ring-buffer record: a RESULT header for <job, seq> with the
// contributor bitmap, and vals.
func resultRecord(t *testing.T, job, seq, bitmap uint32, vals ...int32) []byte {
	t.Helper()
	h := bpf.XdpaggHdr{Version: bpf.Version, Type: uint8(bpf.XdpaggMsgTypeMSG_RESULT), Count: uint16(len(vals)),
		JobId: job, Seq: seq, Bitmap0: bitmap, FanIn0: 2, Flags: uint16(bpf.XdpaggFlagF_FROM_SWITCH), ScaleLog2: 24}
	b, err := binary.Append(nil, binary.LittleEndian, &h)
	if err != nil {
		t.Fatal(err)
	}
	b, err = binary.Append(b, binary.LittleEndian, vals)
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
	if pkt, ok := c.Get(1, 11); !ok || len(pkt) != bpf.HdrSize+4 || int32(binary.LittleEndian.Uint32(pkt[bpf.HdrSize:])) != 11 {
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
		"short":      good[:bpf.HdrSize-1],
		"not result": bad(func(b []byte) []byte { b[1] = uint8(bpf.XdpaggMsgTypeMSG_DATA); return b }),
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
// an ACK; an ACK feeds the cache and is not answered.
func TestHandleRetransmit(t *testing.T) {
	sw := loadSwitch(t, 4)
	c := newControl(t, sw.Maps)
	cache := NewResultCache(time.Minute, 100)
	c.SetCache(cache)
	w := newWorker(t)
	if err := c.handle(msg(t, hdr(msgJoin, 5, 1, 1), joinBody(workerMAC, resultIP)), testPort, w.addr); err != nil {
		t.Fatal(err)
	}
	w.readAck(t)
	if err := cache.Store(resultRecord(t, 5, 42, 0b11, 7, -8), time.Now()); err != nil {
		t.Fatal(err)
	}
	rt := hdr(uint8(bpf.XdpaggMsgTypeMSG_RETRANSMIT), 5, 42, 1)
	if err := c.handle(msg(t, rt, nil), testPort, w.addr); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 256)
	_ = w.conn.SetReadDeadline(time.Now().Add(failsafeFor))
	n, _, err := w.conn.ReadFromUDPAddrPort(buf)
	if err != nil || n != bpf.HdrSize+8 {
		t.Fatalf("cached result: %d bytes, %v", n, err)
	}
	var h bpf.XdpaggHdr
	_, _ = binary.Decode(buf[:bpf.HdrSize], binary.LittleEndian, &h)
	if h.Type != uint8(bpf.XdpaggMsgTypeMSG_RESULT) || h.Seq != 42 || h.Flags&uint16(bpf.XdpaggFlagF_CACHED) == 0 ||
		int32(binary.LittleEndian.Uint32(buf[bpf.HdrSize+4:])) != -8 {
		t.Errorf("cached result %+v %x", h, buf[bpf.HdrSize:n])
	}
	// Miss: ACK with the same seq.
	rt.Seq = 43
	if err := c.handle(msg(t, rt, nil), testPort, w.addr); err != nil {
		t.Fatal(err)
	}
	if a, _ := w.readAck(t); a.Type != msgAck || a.Seq != 43 || a.JobId != 5 {
		t.Errorf("miss answered with %+v", a)
	}
	// A RETRANSMIT claiming another worker id is refused.
	spoof := hdr(uint8(bpf.XdpaggMsgTypeMSG_RETRANSMIT), 5, 42, 0)
	if err := c.handle(msg(t, spoof, nil), testPort, w.addr); !errors.Is(err, errBadControl) {
		t.Errorf("spoofed RETRANSMIT: %v", err)
	}
	// ACK: no answer, fed to the cache.
	if err := c.handle(msg(t, hdr(msgAck, 5, 100, 1), nil), testPort, w.addr); err != nil {
		t.Fatal(err)
	}
	w.noDatagram(t)
	if st := cache.Stats(); st.Hits != 1 || st.Misses != 1 || st.Acks != 1 {
		t.Errorf("cache stats %+v", st)
	}
}
