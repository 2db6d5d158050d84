package bpf_test

// Program.Run tests of the sparse (hot-parameter) path: xdpagg_switch claims a hot packet and
// tail-calls xdpagg_sparse, which runs one pass per call over the register arrays and
// recirculates (tail-calls itself) up to the pass bound. A Go model (sparseModel) mirrors
// sparse_claim, sparse_settle and the pass loop of bpf/sparse.h step for step, and is the oracle
// for the table-driven cases and for the random differential test.

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/wire"
)

const (
	sparseJobA   = 21 // m = sparseArrays, a sparse job of the tests
	sparseJobB   = 22 // another sparse job, owning the next arrays
	sparseDense  = 23 // a dense job: hot pairs are malformed for it
	sparseArrays = 4  // m of the test jobs
	sparseSlots  = 16 // r of the test switch: M = 64 ranks per job
	sparseTotal  = 8  // register arrays of the test switch (per parity)
	sparseFan    = 2  // workers per test iteration
	sparseScale  = 8
)

// kv is one hot pair.
type kv struct {
	rank uint32
	val  int32
}

// sparseFrame is worker w's hot packet `index` of `npkts` for iteration iter.
func sparseFrame(job, iter uint32, w, fan uint8, index, npkts uint16, version uint32, pairs ...kv) frame {
	f := dataFrame(job, iter, uint32(index), w, fan)
	h := wire.Header{Version: wire.Version, Type: wire.MsgData, Encoding: wire.EncSparseKV, ScaleLog2: sparseScale,
		Count: uint16(len(pairs)), JobId: job, Seq: iter, AggIndex: uint32(index), Bitmap0: 1 << w, FanIn0: fan, WorkerId: w}
	b := make([]byte, wire.HdrSize+wire.SparseHdrSize+wire.KVPairSize*len(pairs))
	wire.EncodeHeader(b, &h)
	wire.EncodeSparseHeader(b[wire.HdrSize:], &wire.SparseHeader{HotVersion: version, Npkts: npkts})
	for i, p := range pairs {
		wire.PutKV(b[wire.HdrSize+wire.SparseHdrSize:], i, p.rank, p.val)
	}
	f.Payload = b
	return f
}

// pullFrame is the PS's read-out request for ranks [first, first+n) of iteration iter.
func pullFrame(job, iter, first uint32, n int) frame {
	f := resultFrame(job, iter, first, 1)
	h := wire.Header{Version: wire.Version, Type: wire.MsgPull, Encoding: wire.EncSparseKV, Count: uint16(n), JobId: job,
		Seq: iter, AggIndex: first}
	b := make([]byte, wire.HdrSize+wire.SparseHdrSize+wire.KVPairSize*n)
	wire.EncodeHeader(b, &h)
	f.Payload = b
	return f
}

// coldFrame is worker w's cold packet (keys and float bits) for the PS.
func coldFrame(job, iter uint32, w, fan uint8, keys ...uint64) frame {
	f := dataFrame(job, iter, 0, w, fan)
	h := wire.Header{Version: wire.Version, Type: wire.MsgData, Encoding: wire.EncSparseCold, Count: uint16(len(keys)),
		JobId: job, Seq: iter, Bitmap0: 1 << w, FanIn0: fan, WorkerId: w}
	b := make([]byte, wire.HdrSize+wire.SparseHdrSize+wire.ColdPairSize*len(keys))
	wire.EncodeHeader(b, &h)
	wire.EncodeSparseHeader(b[wire.HdrSize:], &wire.SparseHeader{Npkts: 1})
	for i, k := range keys {
		wire.PutCold(b[wire.HdrSize+wire.SparseHdrSize:], i, k, 0x3f800000)
	}
	f.Payload = b
	return f
}

// hotSumsFrame is an update packet of hot sums (ENC_SPARSE_HOT) from the PS, as type ty.
func hotSumsFrame(job, iter uint32, ty uint8) frame {
	f := resultFrame(job, iter, 0, 2)
	h := wire.Header{Version: wire.Version, Type: ty, Encoding: wire.EncSparseHot, Count: 3, JobId: job, Seq: iter,
		Bitmap0: 3, FanIn0: 2, Bitmap1: 10}
	b := make([]byte, wire.HdrSize+wire.SparseHdrSize+4*3)
	wire.EncodeHeader(b, &h)
	wire.EncodeSparseHeader(b[wire.HdrSize:], &wire.SparseHeader{HotVersion: 1, Npkts: 2})
	f.Payload = b
	return f
}

// sparseOut is a sparse packet the switch sent, taken apart.
type sparseOut struct {
	h     wire.Header
	sh    wire.SparseHeader
	pairs []kv // hot pairs, or reg_read (sum, hits) as (rank = uint32(sum), val = int32(hits))
	src   [4]byte
	dst   [4]byte
}

func decodeSparse(t *testing.T, b []byte) sparseOut {
	t.Helper()
	ipLen := int(binary.BigEndian.Uint16(b[offIP+2:]))
	b = b[:offIP+ipLen]
	h, rest, err := wire.ParsePacket(b[offHdr:])
	if err != nil {
		// Packets the switch hands the PS carry its own fields (spilled); parse the layout only.
		wire.DecodeHeader(b[offHdr:], &h)
		rest = b[offHdr+wire.HdrSize:]
	}
	o := sparseOut{h: h}
	copy(o.src[:], b[offIP+12:])
	copy(o.dst[:], b[offIP+16:])
	wire.DecodeSparseHeader(rest, &o.sh)
	pairs := rest[wire.SparseHdrSize:]
	for i := range int(h.Count) {
		r, v := wire.KV(pairs, i)
		o.pairs = append(o.pairs, kv{r, v})
	}
	return o
}

// ---- the model ----

type mcell struct {
	tag  uint32 // iteration mod 2^31
	sum  int32
	ovf  bool
	hits uint32
}

type miter struct {
	used      bool
	iter      uint32
	version   uint32
	fan       uint8
	complete  bool
	npkts     [32]uint16
	done      [32]uint16
	seen      [32][wire.SparseMaxPkts]bool
	spilled   uint16
	everTaken bool
}

type mSparseJob struct {
	m    uint32
	recs [2]miter
	regs [2]map[uint32]*mcell // by parity, rank
}

type sparseModel struct {
	jobs map[uint32]*mSparseJob
	r    uint32
}

func newSparseModel() *sparseModel {
	sm := &sparseModel{jobs: map[uint32]*mSparseJob{}, r: sparseSlots}
	for _, j := range []uint32{sparseJobA, sparseJobB} {
		sm.jobs[j] = &mSparseJob{m: sparseArrays, regs: [2]map[uint32]*mcell{{}, {}}}
	}
	return sm
}

// sparseResult is what the model expects of one hot packet.
type sparseResult struct {
	verdict  uint32
	counter  maps.Counter // the verdict counter
	passes   int          // passes taken (0: none ran)
	left     []kv         // pairs handed to the PS (F_COLLISION), in packet order with placed marks
	complete bool
	spilled  uint16
	placed   int
	ovf      int
}

// hot mirrors handle_sparse + the passes + sparse_finish for a hot packet that parsed.
func (sm *sparseModel) hot(job, iter uint32, w, fan uint8, index, npkts uint16, version uint32, pairs []kv) sparseResult {
	j := sm.jobs[job]
	if j == nil {
		return sparseResult{verdict: xdpDrop, counter: maps.CntMalformed}
	}
	for _, p := range pairs {
		if p.rank >= j.m*sm.r {
			return sparseResult{verdict: xdpDrop, counter: maps.CntMalformed}
		}
	}
	rec := &j.recs[iter&1]
	// sparse_claim
	if !rec.used || rec.iter != iter {
		if rec.used && iter-rec.iter != 2 {
			return sparseResult{verdict: xdpDrop, counter: maps.CntSparseStale}
		}
		*rec = miter{used: true, iter: iter, version: version, fan: fan}
	}
	if rec.version != version {
		return sparseResult{verdict: xdpDrop, counter: maps.CntSparseStale}
	}
	if rec.fan != fan {
		return sparseResult{verdict: xdpDrop, counter: maps.CntMalformed}
	}
	if rec.npkts[w] == 0 {
		rec.npkts[w] = npkts
	} else if rec.npkts[w] != npkts {
		return sparseResult{verdict: xdpDrop, counter: maps.CntMalformed}
	}
	if rec.seen[w][index] {
		return sparseResult{verdict: xdpDrop, counter: maps.CntDuplicate}
	}
	rec.seen[w][index] = true
	// passes
	res := sparseResult{}
	work := append([]kv(nil), pairs...)
	left := len(work)
	tag := iter & 0x7fffffff
	for left > 0 && res.passes < wire.SparseMaxPasses {
		touched := map[uint32]bool{}
		for i := range work {
			if work[i].rank == wire.RankPlaced {
				continue
			}
			a := work[i].rank % j.m
			if touched[a] {
				continue
			}
			touched[a] = true
			c := j.regs[iter&1][work[i].rank]
			if c == nil {
				c = &mcell{}
				j.regs[iter&1][work[i].rank] = c
			}
			if c.tag != tag {
				*c = mcell{tag: tag, sum: work[i].val, hits: c.hits}
			} else {
				s := int64(c.sum) + int64(work[i].val)
				if s != int64(int32(s)) {
					res.ovf++
					c.ovf = true
				}
				c.sum = int32(s)
			}
			c.hits++
			work[i].rank = wire.RankPlaced
			left--
			res.placed++
		}
		res.passes++
	}
	// sparse_settle
	rec.done[w]++
	if left > 0 {
		rec.spilled++
	}
	if !rec.complete {
		all := true
		for x := range int(rec.fan) {
			if rec.npkts[x] == 0 || rec.done[x] < rec.npkts[x] {
				all = false
			}
		}
		if all {
			rec.complete = true
			res.complete = true
			res.spilled = rec.spilled
		}
	}
	if left == 0 && !res.complete {
		res.verdict, res.counter = xdpDrop, maps.CntAggregated
		return res
	}
	res.verdict, res.counter = xdpPass, maps.CntToPS
	if left > 0 {
		res.left = work
	}
	return res
}

// pull mirrors handle_pull: the sums and hits words of ranks [first, first+n) if iteration iter is
// complete.
func (sm *sparseModel) pull(job, iter, first uint32, n int) (ready bool, sums []int32, hits []uint32, ovf bool, spilled uint16) {
	j := sm.jobs[job]
	rec := &j.recs[iter&1]
	ready = rec.used && rec.complete && rec.iter == iter
	spilled = rec.spilled
	if !ready {
		return
	}
	for r := first; r < first+uint32(n); r++ {
		c := j.regs[iter&1][r]
		var s int32
		var h uint32
		if c != nil { // a cell the model has was added to: hits > 0
			h = c.hits & wire.RegHitsMask
			if c.tag == iter&0x7fffffff {
				s = c.sum
				ovf = ovf || c.ovf
				h |= wire.RegThisIter
			}
		}
		sums = append(sums, s)
		hits = append(hits, h)
	}
	return
}

// ---- harness ----

func loadSparse(t *testing.T) *sw {
	t.Helper()
	cfg := testConfig(time.Hour)
	cfg.RegArrays, cfg.RegSlots = sparseTotal, sparseSlots
	s := loadCfg(t, cfg)
	for _, id := range []uint32{sparseJobA, sparseJobB, sparseDense} {
		j := testJob(s.Maps, id)
		if id != sparseDense {
			j.RegArrays = sparseArrays
		}
		admit(t, s.Maps, j)
		enrollWorkers(t, s.Maps, loIfindex, id)
	}
	s.base = s.counters(t)
	return s
}

// hotCase checks one hot packet against the model: verdict, counters, the packet handed on.
func (s *sw) hotCase(t *testing.T, sm *sparseModel, job, iter uint32, w, fan uint8, index, npkts uint16, version uint32, pairs ...kv) sparseResult {
	t.Helper()
	want := sm.hot(job, iter, w, fan, index, npkts, version, pairs)
	verdict, out := s.run(t, sparseFrame(job, iter, w, fan, index, npkts, version, pairs...))
	if verdict != want.verdict {
		t.Fatalf("verdict %s, want %s (model: %+v)", verdictName(verdict), verdictName(want.verdict), want)
	}
	d := cnt{maps.CntRx: 1, want.counter: 1}
	if want.passes > 1 {
		d[maps.CntRecirc] = uint64(want.passes - 1)
	}
	if want.placed > 0 {
		d[maps.CntSparsePairs] = uint64(want.placed)
	}
	if n := len(want.left); n > 0 {
		spilled := 0
		for _, p := range want.left {
			if p.rank != wire.RankPlaced {
				spilled++
			}
		}
		d[maps.CntSparseSpill] = uint64(spilled)
	}
	if want.complete {
		d[maps.CntSparseDone] = 1
	}
	if want.ovf > 0 {
		d[maps.CntRegOverflow] = uint64(want.ovf)
	}
	s.expectDelta(t, d)
	if verdict == xdpPass {
		o := decodeSparse(t, out)
		wantFlags := uint16(0)
		if len(want.left) > 0 {
			wantFlags |= wire.FlagCollision
		}
		if want.complete {
			wantFlags |= wire.FlagSparseDone
		}
		if o.h.Flags != wantFlags || o.sh.Spilled != want.spilled {
			t.Errorf("handed to the PS with flags %#x spilled %d, want %#x and %d", o.h.Flags, o.sh.Spilled, wantFlags, want.spilled)
		}
		if len(want.left) > 0 {
			if fmt.Sprint(o.pairs) != fmt.Sprint(want.left) {
				t.Errorf("pairs left for the PS: got %v, want %v", o.pairs, want.left)
			}
		}
	}
	return want
}

// pullCase checks a read-out against the model and returns its reg_reads (nil if pending).
func (s *sw) pullCase(t *testing.T, sm *sparseModel, job, iter, first uint32, n int) []kv {
	t.Helper()
	ready, sums, hits, ovf, spilled := sm.pull(job, iter, first, n)
	out := s.runExpect(t, pullFrame(job, iter, first, n), xdpTX)
	d := cnt{maps.CntRx: 1, maps.CntPull: 1}
	if !ready {
		d[maps.CntPullPending] = 1
	}
	s.expectDelta(t, d)
	o := decodeSparse(t, out)
	if o.dst != psIP {
		t.Errorf("read-out answered to %v, want the PS %v", o.dst, psIP)
	}
	wantFlags := wire.FlagFromSwitch
	if !ready {
		wantFlags |= wire.FlagPending
	}
	if ovf {
		wantFlags |= wire.FlagOverflow
	}
	if o.h.Flags != wantFlags || o.sh.Spilled != spilled {
		t.Fatalf("read-out flags %#x spilled %d, want %#x and %d", o.h.Flags, o.sh.Spilled, wantFlags, spilled)
	}
	if !ready {
		return nil
	}
	for i := range n {
		if int32(o.pairs[i].rank) != sums[i] || uint32(o.pairs[i].val) != hits[i] {
			t.Fatalf("rank %d: read sum %d hits %#x, want %d and %#x", first+uint32(i), int32(o.pairs[i].rank), uint32(o.pairs[i].val), sums[i], hits[i])
		}
	}
	return o.pairs
}

func (s *sw) histogram(t *testing.T) []uint64 {
	t.Helper()
	h, err := s.Maps.RecircHistogram()
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// ---- tests ----

func TestSparsePasses(t *testing.T) {
	s := loadSparse(t)
	sm := newSparseModel()
	const m = sparseArrays
	A := uint32(sparseJobA)

	t.Run("distinct arrays take one pass", func(t *testing.T) {
		r := s.hotCase(t, sm, A, 1, 0, sparseFan, 0, 1, 7, kv{0, 5}, kv{1, -3}, kv{2, 100}, kv{3, 1})
		if r.passes != 1 {
			t.Fatalf("model took %d passes", r.passes)
		}
		if h := s.histogram(t); h[1] != 1 {
			t.Errorf("histogram %v: want one packet at 1 pass", h)
		}
	})
	t.Run("a shared array recirculates", func(t *testing.T) {
		// Ranks 4, 8 and 12 share array 0 with each other: three passes (two recirculations).
		r := s.hotCase(t, sm, A, 1, 1, sparseFan, 0, 2, 7, kv{4, 1}, kv{5, 1}, kv{8, 2}, kv{12, 3})
		if r.passes != 3 {
			t.Fatalf("model took %d passes, want 3", r.passes)
		}
		if h := s.histogram(t); h[3] != 1 {
			t.Errorf("histogram %v: want one packet at 3 passes", h)
		}
	})
	t.Run("pull before the iteration completes is pending", func(t *testing.T) {
		s.pullCase(t, sm, A, 1, 0, m)
	})
	t.Run("a duplicate never adds twice", func(t *testing.T) {
		s.hotCase(t, sm, A, 1, 1, sparseFan, 0, 2, 7, kv{4, 1}, kv{5, 1}, kv{8, 2}, kv{12, 3})
	})
	t.Run("beyond the pass bound pairs go to the PS; the last packet completes the iteration", func(t *testing.T) {
		// Six pairs in array 1: four passes place four, two are left for the PS.
		pairs := []kv{{1, 10}, {5, 10}, {9, 10}, {13, 10}, {17, 10}, {21, 10}}
		r := s.hotCase(t, sm, A, 1, 1, sparseFan, 1, 2, 7, pairs...)
		if r.passes != wire.SparseMaxPasses || !r.complete || r.spilled != 1 {
			t.Fatalf("model: %+v", r)
		}
		if h := s.histogram(t); h[wire.SparseMaxPasses] != 1 {
			t.Errorf("histogram %v: want one packet at the bound", h)
		}
	})
	t.Run("read-out of the complete iteration", func(t *testing.T) {
		for first := uint32(0); first < m*sparseSlots; first += m {
			s.pullCase(t, sm, A, 1, first, m)
		}
		s.pullCase(t, sm, A, 1, 3, 2) // any range within m
	})
	t.Run("the other parity is independent; an empty marker counts", func(t *testing.T) {
		s.hotCase(t, sm, A, 2, 0, sparseFan, 0, 1, 7)
		s.hotCase(t, sm, A, 2, 1, sparseFan, 0, 1, 7, kv{63, -7})
		s.pullCase(t, sm, A, 2, 60, 4)
		if h := s.histogram(t); h[0] != 1 {
			t.Errorf("histogram %v: want one empty marker", h)
		}
	})
	t.Run("two iterations on, the buffer reads as zero", func(t *testing.T) {
		s.hotCase(t, sm, A, 3, 0, sparseFan, 0, 1, 7, kv{0, 1})
		s.hotCase(t, sm, A, 3, 1, sparseFan, 0, 1, 7)
		s.pullCase(t, sm, A, 3, 0, m) // ranks 1..3 were iteration 1's: zero now
	})
	t.Run("stale iterations and other versions are dropped", func(t *testing.T) {
		s.hotCase(t, sm, A, 1, 0, sparseFan, 0, 1, 7, kv{0, 1}) // iteration 1 is gone
		s.hotCase(t, sm, A, 9, 0, sparseFan, 0, 1, 7, kv{0, 1}) // too far ahead
		s.hotCase(t, sm, A, 5, 0, sparseFan, 0, 1, 7, kv{0, 1}) // 3 + 2: opens iteration 5
		s.hotCase(t, sm, A, 5, 1, sparseFan, 0, 1, 8, kv{0, 1}) // another hot-set version
	})
	t.Run("overflow is flagged in the read-out", func(t *testing.T) {
		s.hotCase(t, sm, A, 4, 0, sparseFan, 0, 1, 7, kv{0, 1 << 30}, kv{1, -5})
		s.hotCase(t, sm, A, 4, 1, sparseFan, 0, 1, 7, kv{0, 1 << 30})
		s.pullCase(t, sm, A, 4, 0, m)
	})
	t.Run("jobs have their own registers", func(t *testing.T) {
		s.hotCase(t, sm, sparseJobB, 4, 0, sparseFan, 0, 1, 1, kv{0, 9})
		s.hotCase(t, sm, sparseJobB, 4, 1, sparseFan, 0, 1, 1, kv{0, 9})
		s.pullCase(t, sm, sparseJobB, 4, 0, m)
		s.pullCase(t, sm, A, 4, 0, m)
	})
}

// TestSparsePullTouched: a read-out's hits word says whether the slot holds a sum of the
// iteration read, which is what the PS builds the update's key list from: set for a rank summed
// in t (even to 0), clear for one nobody sent in t (a never-used cell at iteration 0 included:
// all zero, iteration 0's tag) and for one summed in t-2 in the same buffer; a hit counter past
// 2^31 never reads as the flag.
func TestSparsePullTouched(t *testing.T) {
	s := loadSparse(t)
	sm := newSparseModel()
	const m = sparseArrays
	A := uint32(sparseJobA)
	// check reads ranks [0, m) of iteration iter: want[r] is (sum, touched, counter).
	type want struct {
		sum     int32
		touched bool
		hits    uint32
	}
	check := func(t *testing.T, iter uint32, ws ...want) {
		t.Helper()
		got := s.pullCase(t, sm, A, iter, 0, m)
		if len(got) != m {
			t.Fatalf("iteration %d: read-out pending", iter)
		}
		b := make([]byte, m*wire.KVPairSize)
		for i, p := range got {
			wire.PutKV(b, i, p.rank, p.val)
		}
		for r, w := range ws {
			sum, hits, touched := wire.RegRead(b, r)
			if sum != w.sum || touched != w.touched || hits != w.hits {
				t.Errorf("iteration %d rank %d: sum %d touched %v hits %d, want %d %v %d", iter, r, sum, touched, hits, w.sum, w.touched, w.hits)
			}
		}
	}
	t.Run("iteration 0: summed ranks are flagged, a sum of 0 too; never-used cells are not", func(t *testing.T) {
		s.hotCase(t, sm, A, 0, 0, sparseFan, 0, 1, 7, kv{0, 5}, kv{1, -5})
		s.hotCase(t, sm, A, 0, 1, sparseFan, 0, 1, 7, kv{1, 5})
		check(t, 0, want{5, true, 1}, want{0, true, 2}, want{0, false, 0}, want{0, false, 0})
	})
	t.Run("two iterations on, t-2's ranks in the same buffer are not flagged", func(t *testing.T) {
		for _, it := range []uint32{1, 2} {
			s.hotCase(t, sm, A, it, 0, sparseFan, 0, 1, 7)
		}
		s.hotCase(t, sm, A, 1, 1, sparseFan, 0, 1, 7)
		s.hotCase(t, sm, A, 2, 1, sparseFan, 0, 1, 7, kv{2, -3})
		check(t, 2, want{0, false, 1}, want{0, false, 2}, want{-3, true, 1}, want{0, false, 0})
	})
	t.Run("a hit counter past 2^31 keeps the flag clear", func(t *testing.T) {
		j, err := s.Maps.GetJob(A)
		if err != nil {
			t.Fatal(err)
		}
		ra, err := s.Maps.JobRegisters(j, 0, 3) // rank 3: array 3, slot 0 of parity 0
		if err != nil {
			t.Fatal(err)
		}
		ra.Cells[0], ra.Hits[0] = 0, 0xffffffff // iteration 0's tag, sum 0: not iteration 2's
		if err := s.Maps.PutJobRegisters(j, 0, 3, &ra); err != nil {
			t.Fatal(err)
		}
		sm.jobs[A].regs[0][3] = &mcell{tag: 0, hits: 0xffffffff}
		check(t, 2, want{0, false, 1}, want{0, false, 2}, want{-3, true, 1}, want{0, false, wire.RegHitsMask})
	})
}

func TestSparseRefused(t *testing.T) {
	s := loadSparse(t)
	A := uint32(sparseJobA)
	malformed := cnt{maps.CntRx: 1, maps.CntMalformed: 1}
	cases := []struct {
		name    string
		f       frame
		verdict uint32
		delta   cnt
	}{
		{"rank beyond the job's registers", sparseFrame(A, 1, 0, 2, 0, 1, 1, kv{sparseArrays * sparseSlots, 1}), xdpDrop, malformed},
		{"the placed mark from a worker", sparseFrame(A, 1, 0, 2, 0, 1, 1, kv{wire.RankPlaced, 1}), xdpDrop, malformed},
		{"hot pairs of a dense job", sparseFrame(sparseDense, 1, 0, 2, 0, 1, 1, kv{0, 1}), xdpDrop, malformed},
		{"index beyond npkts", sparseFrame(A, 1, 0, 2, 3, 2, 1, kv{0, 1}), xdpDrop, malformed},
		{"too many packets announced", sparseFrame(A, 1, 0, 2, 0, wire.SparseMaxPkts+1, 1, kv{0, 1}), xdpDrop, malformed},
		{"a hot packet from a non-member", sparseFrame(A, 1, 0, 2, 0, 1, 1, kv{0, 1}).with(func(f *frame) { f.SrcPort++ }), xdpDrop,
			cnt{maps.CntRx: 1, maps.CntNotMember: 1}},
		{"second-level hot pairs", sparseFrame(A, 1, 0, 2, 0, 1, 1, kv{0, 1}).with(func(f *frame) {
			binary.LittleEndian.PutUint16(f.Payload[wire.OffFlags:], wire.FlagLevel1)
		}), xdpDrop, malformed},
		{"pull from a worker", pullFrame(A, 1, 0, 2).with(func(f *frame) { f.SrcIP = workerIP(0) }), xdpDrop,
			cnt{maps.CntRx: 1, maps.CntNotMember: 1}},
		{"pull of more than m ranks", pullFrame(A, 1, 0, sparseArrays+1), xdpDrop, malformed},
		{"pull beyond M", pullFrame(A, 1, sparseArrays*sparseSlots-1, 2), xdpDrop, malformed},
		{"pull of a dense job", pullFrame(sparseDense, 1, 0, 1), xdpDrop, malformed},
		{"cold pairs go on to the PS", coldFrame(A, 1, 0, 2, 1, 2, 3), xdpPass, cnt{maps.CntRx: 1, maps.CntToPS: 1}},
		{"an update's hot sums from the PS are broadcast", hotSumsFrame(A, 1, wire.MsgResult), xdpRedirect, cnt{maps.CntRx: 1, maps.CntPSResult: 1}},
		{"hot sums as DATA", hotSumsFrame(A, 1, wire.MsgData), xdpDrop, malformed},
		{"an update's hot sums not from the PS", hotSumsFrame(A, 1, wire.MsgResult).with(func(f *frame) { f.SrcPort++ }), xdpDrop,
			cnt{maps.CntRx: 1, maps.CntNotMember: 1}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s.runExpect(t, c.f, c.verdict)
			s.expectDelta(t, c.delta)
		})
	}
	// Nothing was claimed: iteration 1 is still open to every worker.
	st, err := s.Maps.Sparse(A)
	if err != nil {
		t.Fatal(err)
	}
	if st.Records[1].State != "empty" {
		t.Errorf("refused packets changed the iteration record: %+v", st.Records[1])
	}
}

// TestSparseModelRandom drives both jobs with random hot packets (random ranks, so random
// recirculation; duplicates; empty markers; stale iterations) and checks every verdict, counter
// and read-out against the model.
func TestSparseModelRandom(t *testing.T) {
	s := loadSparse(t)
	sm := newSparseModel()
	rng := rand.New(rand.NewPCG(9, 10))
	iters := map[uint32]uint32{sparseJobA: 10, sparseJobB: 40}
	for step := range 60 {
		for _, job := range []uint32{sparseJobA, sparseJobB} {
			iter := iters[job]
			type sent struct {
				w            uint8
				index, npkts uint16
				pairs        []kv
			}
			var pkts []sent
			for w := range uint8(sparseFan) {
				np := uint16(1 + rng.IntN(3))
				for i := range np {
					var pairs []kv
					for range rng.IntN(12) {
						pairs = append(pairs, kv{uint32(rng.IntN(sparseArrays * sparseSlots)), int32(rng.IntN(2001) - 1000)})
					}
					pkts = append(pkts, sent{w, i, np, pairs})
				}
			}
			rng.Shuffle(len(pkts), func(a, b int) { pkts[a], pkts[b] = pkts[b], pkts[a] })
			for i, p := range pkts {
				s.hotCase(t, sm, job, iter, p.w, sparseFan, p.index, p.npkts, 1, p.pairs...)
				if rng.IntN(4) == 0 { // a duplicate, now or later
					q := pkts[rng.IntN(i+1)]
					s.hotCase(t, sm, job, iter, q.w, sparseFan, q.index, q.npkts, 1, q.pairs...)
				}
				if rng.IntN(10) == 0 { // a straggler of an old iteration
					s.hotCase(t, sm, job, iter-2, p.w, sparseFan, p.index, p.npkts, 1, p.pairs...)
				}
			}
			for first := uint32(0); first < sparseArrays*sparseSlots; first += sparseArrays {
				s.pullCase(t, sm, job, iter, first, sparseArrays)
			}
			iters[job]++
		}
		if t.Failed() {
			t.Fatalf("step %d failed", step)
		}
	}
	t.Logf("recirculation histogram: %v", s.histogram(t))
}

var _ = netip.Addr{}
var _ = bpf.RegSlots

// TestSparseTailCallFails: without its recirculation program a hot packet is not lost: every
// pair goes on to the PS, counted.
func TestSparseTailCallFails(t *testing.T) {
	s := loadSparse(t)
	if err := s.Objects.SparseProgs.Delete(uint32(0)); err != nil {
		t.Fatalf("empty the program array: %v", err)
	}
	s.base = s.counters(t)
	pairs := []kv{{0, 1}, {1, 2}, {4, 3}}
	out := s.runExpect(t, sparseFrame(sparseJobA, 1, 0, 1, 0, 1, 1, pairs...), xdpPass)
	s.expectDelta(t, cnt{maps.CntRx: 1, maps.CntToPS: 1, maps.CntTailcallErr: 1, maps.CntSparseSpill: 3, maps.CntSparseDone: 1})
	o := decodeSparse(t, out)
	if fmt.Sprint(o.pairs) != fmt.Sprint(pairs) || o.h.Flags != wire.FlagCollision|wire.FlagSparseDone || o.sh.Spilled != 1 {
		t.Errorf("handed to the PS: %+v", o)
	}
}
