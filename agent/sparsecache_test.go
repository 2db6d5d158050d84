package agent

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/wire"
)

// sparseUpdate is packet index of npkts of job's update for iter: n hot sums (or cold pairs), each
// value v, as the PS sends it; pad makes it a ring-buffer record (undefined tail).
func sparseUpdate(job, iter, index uint32, npkts uint16, enc uint8, n int, v byte, pad int) []byte {
	psize := 4
	if enc == wire.EncSparseCold {
		psize = wire.ColdPairSize
	}
	b := make([]byte, wire.HdrSize+wire.SparseHdrSize+psize*n, wire.HdrSize+wire.SparseHdrSize+psize*n+pad)
	wire.EncodeHeader(b, &wire.Header{Version: wire.Version, Type: wire.MsgResult, Encoding: enc, Count: uint16(n), JobId: job,
		Seq: iter, AggIndex: index, Bitmap0: 3, FanIn0: 2})
	wire.EncodeSparseHeader(b[wire.HdrSize:], &wire.SparseHeader{HotVersion: 1, Npkts: npkts})
	for i := wire.HdrSize + wire.SparseHdrSize; i < len(b); i++ {
		b[i] = v
	}
	return append(b, bytes.Repeat([]byte{0xee}, pad)...)
}

func TestSparseCacheStoreGet(t *testing.T) {
	c := NewSparseCache(2, 0, time.Minute)
	now := time.Now()
	for i := range uint32(3) {
		enc := wire.EncSparseHot
		if i == 2 {
			enc = wire.EncSparseCold
		}
		if err := c.Store(sparseUpdate(7, 10, i, 3, enc, 5, byte(i+1), 100), now); err != nil {
			t.Fatal(err)
		}
	}
	// Packets 0 and 2 asked (bits 0 and 2 from 0): exactly those, without the record's tail.
	got := c.Get(7, 10, 0, 0b101)
	if len(got) != 2 || !bytes.Equal(got[0], sparseUpdate(7, 10, 0, 3, wire.EncSparseHot, 5, 1, 0)) ||
		!bytes.Equal(got[1], sparseUpdate(7, 10, 2, 3, wire.EncSparseCold, 5, 3, 0)) {
		t.Fatalf("got %d packets: %x", len(got), got)
	}
	// From packet 1 on: bit 0 is packet 1.
	if got := c.Get(7, 10, 1, 1); len(got) != 1 || got[0][wire.OffAggIndex] != 1 {
		t.Fatalf("from 1: %x", got)
	}
	for _, miss := range []struct{ job, iter, first, mask uint32 }{{7, 11, 0, ^uint32(0)}, {8, 10, 0, ^uint32(0)}, {7, 10, 3, ^uint32(0)}, {7, 10, 0, 0}} {
		if got := c.Get(miss.job, miss.iter, miss.first, miss.mask); got != nil {
			t.Errorf("%+v: %d packets, want a miss", miss, len(got))
		}
	}
	// Keep 2: iterations 11 and 12 evict 10; then 9 (older than every one kept) is not stored.
	for _, it := range []uint32{11, 12} {
		if err := c.Store(sparseUpdate(7, it, 0, 1, wire.EncSparseHot, 5, 9, 0), now); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.Store(sparseUpdate(7, 9, 0, 1, wire.EncSparseHot, 5, 9, 0), now); err != nil {
		t.Fatal(err)
	}
	if c.Get(7, 10, 0, 1) != nil || c.Get(7, 9, 0, 1) != nil || c.Get(7, 11, 0, 1) == nil {
		t.Error("keep 2: iteration 10 kept, 9 stored, or 11 lost")
	}
	st := c.Stats()
	if st.Stored != 5 || st.Evicted != 3 || st.Late != 1 || st.Packets != 2 || st.Hits != 3 || st.Misses != 6 || st.Sent != 4 || st.Requests != 9 {
		t.Errorf("stats %+v", st)
	}
	// Malformed records are refused: a dense result, a lying count, a packet index past npkts.
	bad := [][]byte{sparseUpdate(7, 13, 0, 1, wire.EncSparseHot, 5, 0, 0)[:wire.HdrSize+wire.SparseHdrSize+8],
		sparseUpdate(7, 13, 1, 1, wire.EncSparseHot, 5, 0, 0), make([]byte, 8)}
	for i, b := range bad {
		if err := c.Store(b, now); !errors.Is(err, errBadRecord) {
			t.Errorf("bad record %d: %v", i, err)
		}
	}
	// Age: everything goes.
	c.Sweep(now.Add(2 * time.Minute))
	if st := c.Stats(); st.Packets != 0 || st.Bytes != 0 {
		t.Errorf("after the age sweep: %+v", st)
	}
}

// TestSparseCachePerJob: a job whose updates exceed its byte share evicts its own iterations (and
// keeps only part of an update larger than the share), never another job's.
func TestSparseCachePerJob(t *testing.T) {
	one := len(sparseUpdate(1, 1, 0, 1, wire.EncSparseHot, 100, 0, 0))
	c := NewSparseCache(4, 5*one, 0)
	now := time.Now()
	if err := c.Store(sparseUpdate(2, 1, 0, 1, wire.EncSparseHot, 100, 0, 0), now); err != nil {
		t.Fatal(err)
	}
	for it := range uint32(8) {
		for i := range uint32(2) {
			if err := c.Store(sparseUpdate(1, it, i, 2, wire.EncSparseHot, 100, 0, 0), now); err != nil {
				t.Fatal(err)
			}
		}
	}
	if c.Get(2, 1, 0, 1) == nil {
		t.Fatal("job 1's updates evicted job 2's")
	}
	if c.Get(1, 7, 0, 3) == nil || c.Get(1, 6, 0, 3) == nil || c.Get(1, 5, 0, 3) != nil {
		t.Error("job 1 does not keep its newest iterations within its share")
	}
	// One update of 6 packets in a share of 5: its first 5 are kept.
	for i := range uint32(6) {
		if err := c.Store(sparseUpdate(3, 1, i, 6, wire.EncSparseHot, 100, 0, 0), now); err != nil {
			t.Fatal(err)
		}
	}
	if got := c.Get(3, 1, 0, 0b111111); len(got) != 5 {
		t.Errorf("a 6-packet update in a 5-packet share: %d kept", len(got))
	}
	if st := c.Stats(); st.Bytes != uint64(one*(1+4+5)) {
		t.Errorf("bytes %d, want %d", st.Bytes, one*10)
	}
}

// TestSparseCacheMigrates: the sparse copy travels in a snapshot's Cache next to dense results,
// and storeResult files each record with its cache.
func TestSparseCacheMigrates(t *testing.T) {
	src, dst := &ControlServer{cache: NewResultCache(time.Minute, 16), sparse: NewSparseCache(0, 0, 0)},
		&ControlServer{cache: NewResultCache(time.Minute, 16), sparse: NewSparseCache(0, 0, 0)}
	now := time.Now()
	dense := make([]byte, wire.HdrSize+8)
	wire.EncodeHeader(dense, &wire.Header{Version: wire.Version, Type: wire.MsgResult, Count: 2, JobId: 5, Seq: 3, FanIn0: 2, Bitmap0: 3})
	for _, rec := range [][]byte{dense, sparseUpdate(5, 9, 0, 2, wire.EncSparseHot, 4, 1, 0), sparseUpdate(5, 9, 1, 2, wire.EncSparseCold, 4, 2, 0)} {
		if err := src.storeResult(rec, now); err != nil {
			t.Fatal(err)
		}
	}
	recs := append(src.cache.Export(), src.sparse.Export()...)
	for _, rec := range recs {
		if err := dst.storeResult(rec, now); err != nil {
			t.Fatal(err)
		}
	}
	if _, ok := dst.cache.Get(5, 3); !ok || len(dst.sparse.Get(5, 9, 0, 3)) != 2 || dst.sparse.Stats().Stored != 2 {
		t.Errorf("restored: dense %v, sparse %+v", dst.cache.Stats(), dst.sparse.Stats())
	}
}

// sparseRtx is a sealed sparse MSG_RETRANSMIT of testJob from worker w: packets first+i of
// iteration iter's update for every bit i of mask.
func sparseRtx(t testing.TB, key []byte, iter uint32, w uint8, first, mask uint32) []byte {
	h := hdr(msgRtx, testJob, iter, w)
	h.Encoding, h.AggIndex, h.Bitmap0 = wire.EncSparseHot, first, mask
	return sealed(t, key, h, nil)
}

// A sparse RETRANSMIT from the worker id's binding is answered with the cached update packets it
// asks for (F_CACHED, to the binding alone); one the cache has none of with an authenticated ACK,
// and no member is asked (members keep no sparse updates). Anyone else is refused.
func TestHandleSparseRetransmit(t *testing.T) {
	ct := newCtlTest(t)
	c := ct.c
	sc := NewSparseCache(0, 0, 0)
	c.SetSparseCache(sc)
	w, other := newWorker(t), newWorkerAt(t, "127.0.0.2")
	accept(t, c, join(t, ct.key, 1, 1), testPort, w.addr)
	w.readAck(t, ct.key)
	accept(t, c, join(t, ct.key, 1, 0), testPort2, other.addr)
	other.readAck(t, ct.key)
	now := time.Now()
	for i := range uint32(3) {
		if err := sc.Store(sparseUpdate(testJob, 9, i, 3, wire.EncSparseHot, 6, byte(i+1), 0), now); err != nil {
			t.Fatal(err)
		}
	}
	accept(t, c, sparseRtx(t, ct.key, 9, 1, 1, 0b11), testPort, w.addr)
	for want := uint32(1); want < 3; want++ {
		b, _ := w.read(t, "cached update packet")
		h, rest, err := wire.ParsePacket(b)
		if err != nil || h.Type != wire.MsgResult || h.Encoding != wire.EncSparseHot || h.Seq != 9 || h.AggIndex != want ||
			h.Flags&wire.FlagCached == 0 || rest[wire.SparseHdrSize] != byte(want+1) {
			t.Fatalf("cached packet %d: %+v %v", want, h, err)
		}
	}
	w.noDatagram(t)
	// The cache keeps its copies unflagged.
	if p := sc.Get(testJob, 9, 0, 1); len(p) != 1 || wire.PacketFlags(p[0])&wire.FlagCached != 0 {
		t.Errorf("cached copy after a hit: %x", p)
	}
	// Miss: ACK with the iteration; nobody else hears of it.
	accept(t, c, sparseRtx(t, ct.key, 10, 1, 0, ^uint32(0)), testPort, w.addr)
	if a, _ := w.readAck(t, ct.key); a.Type != msgAck || a.Seq != 10 || a.WorkerId != 1 {
		t.Errorf("miss answered with %+v", a)
	}
	// Not the binding: refused, nothing sent.
	wantRefused(t, c.handle(sparseRtx(t, ct.key, 9, 0, 0, 1), testPort, w.addr), RejectNotMember, "RETRANSMIT")
	wantRefused(t, c.handle(sparseRtx(t, ct.key, 9, 1, 0, 1), testPort2, other.addr), RejectNotMember, "RETRANSMIT")
	// Another job's key: refused before anything is looked up.
	wantRefused(t, c.handle(sparseRtx(t, ct.otherKey, 9, 1, 0, 1), testPort, w.addr), RejectUnauth, "RETRANSMIT")
	w.noDatagram(t)
	other.noDatagram(t)
	if st := c.SparseCacheStats(); st.Requests != 3 || st.Hits != 2 || st.Misses != 1 || st.Sent != 3 { // the test's own Get is one

		t.Errorf("sparse cache stats %+v", st)
	}
	if hs := c.HelpStats(); hs.Requests != 0 || hs.Asked != 0 {
		t.Errorf("a sparse request went to member-assisted Help: %+v", hs)
	}
}
