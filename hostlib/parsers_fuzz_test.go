package hostlib

// Fuzz targets for every hostlib path that takes bytes off the network (wire.ParsePacket itself has
// FuzzParsePacket in wire/wire_test.go):
//
//	FuzzRingHandle    Ring.handle: a ring rank's DATA and selective ACKs (and the stash of the
//	                  next call's packets, replayed when it starts)
//	FuzzPSHandle      PS.handle: one datagram of a receive batch from a chosen source, against a
//	                  model of the PS's admission (jobs, members, shares) and sums
//	FuzzWorkerResult  Worker.handleResult: one datagram of a receive batch from a chosen source
//	                  (results, and the switch agent's authenticated ACKs)
//
// Each input is a sequence of datagrams (fzSplit). The engines are built over loopback sockets
// but without their receive goroutines, so the test calls the entry point itself, in order, and
// checks after every datagram: no panic, no write outside the tensor, garbage counted as
// malformed and never summed, every counter where the documentation says it goes.

import (
	"encoding/binary"
	"errors"
	"math"
	"math/big"
	"math/bits"
	"net"
	"net/netip"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/wire"
)

// fzMaxDatagrams bounds a sequence: inputs stay cheap to run and to minimize.
const fzMaxDatagrams = 16

// fzSplit cuts a fuzz input into datagrams: each is a little-endian uint16 length and that many
// bytes (fewer at the end of the input).
func fzSplit(b []byte) [][]byte {
	var out [][]byte
	for len(b) >= 2 && len(out) < fzMaxDatagrams {
		n := min(int(binary.LittleEndian.Uint16(b)), len(b)-2)
		out = append(out, b[2:2+n])
		b = b[2+n:]
	}
	return out
}

// fzJoin is fzSplit's inverse, for seeds.
func fzJoin(pkts ...[]byte) []byte {
	var b []byte
	for _, p := range pkts {
		b = binary.LittleEndian.AppendUint16(b, uint16(len(p)))
		b = append(b, p...)
	}
	return b
}

func fzI32s(vs ...int32) []uint32 {
	out := make([]uint32, len(vs))
	for i, v := range vs {
		out[i] = uint32(v)
	}
	return out
}

// fzPacket encodes header h and then the raw 32-bit values.
func fzPacket(h wire.Header, vals ...uint32) []byte {
	b := make([]byte, wire.HdrSize+4*len(vals))
	wire.EncodeHeader(b, &h)
	for i, v := range vals {
		binary.LittleEndian.PutUint32(b[wire.HdrSize+4*i:], v)
	}
	return b
}

// fzSinks are loopback sockets that receive and never answer (peers, PS, switch), one set per
// process: they are only ever sent to.
var fzSinks struct {
	once  sync.Once
	conns [3]*net.UDPConn // referenced, or the GC would close them
	addrs [3]netip.AddrPort
	err   error
}

func fzSink(t *testing.T, i int) netip.AddrPort {
	t.Helper()
	fzSinks.once.Do(func() {
		for j := range fzSinks.addrs {
			c, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
			if err != nil {
				fzSinks.err = err
				return
			}
			fzSinks.conns[j] = c // open for the process's life
			fzSinks.addrs[j] = c.LocalAddr().(*net.UDPAddr).AddrPort()
		}
	})
	if fzSinks.err != nil {
		t.Fatalf("sink socket: %v", fzSinks.err)
	}
	return fzSinks.addrs[i]
}

// fzOnFreePort calls open with a loopback port that was free a moment ago, again while another
// process (a parallel fuzz worker) takes the port first.
func fzOnFreePort(t *testing.T, open func(netip.AddrPort) error) {
	t.Helper()
	for try := 0; ; try++ {
		err := open(netip.AddrPortFrom(loopback, freePort(t)))
		if err == nil {
			return
		}
		if try == 20 || !errors.Is(err, syscall.EADDRINUSE) {
			t.Fatal(err)
		}
	}
}

// fzInject puts datagram b from `from` into slot i of c's receive batch, as recvmmsg would: a
// datagram larger than the slot is cut and flagged MSG_TRUNC.
func fzInject(c *batchConn, i int, b []byte, from netip.AddrPort) {
	n := copy(c.rbuf[i*rslot:(i+1)*rslot], b)
	m := &c.rmsgs[i]
	m.Len = uint32(n)
	m.Hdr.Flags = 0
	if n < len(b) {
		m.Hdr.Flags = unix.MSG_TRUNC
	}
	c.rnames[i] = sockaddr4(from)
}

// fzGuarded returns n float32 values inside a larger array whose ends hold a pattern: guardOK
// reports whether anything wrote past the tensor.
func fzGuarded(n int) (data, backing []float32) {
	const guard = 64
	backing = make([]float32, guard+n+guard)
	for i := range backing {
		backing[i] = math.Float32frombits(0x7fc0dead ^ uint32(i))
	}
	data = backing[guard : guard+n : guard+n]
	for i := range data {
		data[i] = float32(i+1) / 8
	}
	return data, backing
}

func fzGuardOK(t *testing.T, data, backing []float32) {
	t.Helper()
	const guard = 64
	for i, v := range backing {
		if i >= guard && i < guard+len(data) {
			continue
		}
		if math.Float32bits(v) != 0x7fc0dead^uint32(i) {
			t.Fatalf("element %d of the tensor's surroundings (tensor at %d..%d) was written", i, guard, guard+len(data)-1)
		}
	}
}

// sameBits reports whether a and b hold the same float32 bit patterns.
func sameBits(a, b []float32) bool {
	return slices.EqualFunc(a, b, func(x, y float32) bool { return math.Float32bits(x) == math.Float32bits(y) })
}

// ---- Ring ----

// The fuzzed ring: rank 1 of 3, 4 values per packet, window 4, a 22-value tensor (chunks of 8, 7
// and 7 values: 2 packets each; 4 steps, 8 seq numbers per call).
const (
	fzRingW      = 3
	fzRingRank   = 1
	fzRingK      = 4
	fzRingWindow = 4
	fzRingN      = 22
	fzRingID     = 0x51ee
	fzRingPred   = (fzRingRank + fzRingW - 1) % fzRingW
	fzRingSucc   = (fzRingRank + 1) % fzRingW
)

// fzRingChunk is chunk c of the tensor (the ring's split, computed independently).
func fzRingChunk(c int) (lo, n int) {
	q, rem := fzRingN/fzRingW, fzRingN%fzRingW
	lo = c*q + min(c, rem)
	n = q
	if c < rem {
		n++
	}
	return lo, n
}

// fzRingPer is the seq numbers of one step: packets of the largest chunk.
const fzRingPer = (fzRingN/fzRingW + 1 + fzRingK - 1) / fzRingK

// fzRingData is the DATA packet for seq offset off of the call starting at base, as the
// predecessor sends it.
func fzRingData(base uint32, off int, fill uint32) []byte {
	s, p := off/fzRingPer, off%fzRingPer
	_, n := fzRingChunk(((fzRingRank-1-s)%fzRingW + fzRingW) % fzRingW)
	cnt := max(min(fzRingK, n-p*fzRingK), 1)
	vals := make([]uint32, cnt)
	for i := range vals {
		vals[i] = math.Float32bits(float32(fill) + float32(i)/4)
	}
	return fzPacket(wire.Header{Version: wire.Version, Type: wire.MsgData, Encoding: wire.EncFloat32, Count: uint16(cnt),
		JobId: fzRingID, Seq: base + uint32(off), AggIndex: uint32(s), Bitmap0: 1 << fzRingPred, Bitmap1: fzRingN,
		FanIn0: fzRingW, WorkerId: fzRingPred}, vals...)
}

// fzRingAck acknowledges the 64 seqs from seq on, as the successor does.
func fzRingAck(seq uint32, mask uint64) []byte {
	return fzPacket(wire.Header{Version: wire.Version, Type: wire.MsgAck, Encoding: wire.EncFloat32, JobId: fzRingID, Seq: seq,
		Bitmap0: uint32(mask), Bitmap1: uint32(mask >> 32), FanIn0: fzRingW, WorkerId: fzRingSucc})
}

// newFuzzRing is rank fzRingRank of a ring with no protocol goroutine: newRing builds it (and
// starts its loop, which Close stops at once), then it gets a fresh socket that only the test
// drives. Acks go to a sink, and so does data.
func newFuzzRing(t *testing.T) *Ring {
	t.Helper()
	var r *Ring
	fzOnFreePort(t, func(self netip.AddrPort) (err error) {
		cfg := RingConfig{Rank: fzRingRank, Peers: []netip.AddrPort{fzSink(t, 0), self, fzSink(t, 1)}, ID: fzRingID,
			Window: fzRingWindow, ValuesPerPacket: fzRingK, Timeout: time.Hour, SocketBuffer: 1 << 16}
		r, err = newRing(cfg, nil)
		return err
	})
	r.Close()
	bc, err := listenBatch(netip.AddrPortFrom(loopback, 0), 1<<16, recvBatch, fzRingWindow+recvBatch)
	if err != nil {
		t.Fatal(err)
	}
	r.bc = bc
	t.Cleanup(func() { bc.close() })
	return r
}

// fzRingCheck checks the ring's bookkeeping: every slot is either busy with exactly one packet in
// flight or on the free list (once), and the call's counts never go negative.
func fzRingCheck(t *testing.T, r *Ring) {
	t.Helper()
	busy := 0
	for _, sl := range r.slots {
		if sl.busy {
			busy++
		}
	}
	free := map[int32]bool{}
	for _, k := range r.freeSlots {
		if k < 0 || int(k) >= len(r.slots) || free[k] || r.slots[k].busy {
			t.Fatalf("free list %v with slots %+v", r.freeSlots, r.slots)
		}
		free[k] = true
	}
	if busy+len(free) != len(r.slots) {
		t.Fatalf("%d busy + %d free slots of %d", busy, len(free), len(r.slots))
	}
	if op := &r.op; op.active {
		inFlight := 0
		for _, k := range op.slotOf {
			if k >= 0 {
				inFlight++
			}
		}
		if inFlight != busy || op.sendLeft < 0 || op.recvLeft < 0 {
			t.Fatalf("%d packets in flight, %d busy slots, sendLeft %d recvLeft %d", inFlight, busy, op.sendLeft, op.recvLeft)
		}
	}
}

func FuzzRingHandle(f *testing.F) {
	// Call 1 starts at seq 0 (8 seq numbers), call 2 at 8.
	var all [][]byte
	for off := 0; off < 2*fzRingPer*(fzRingW-1); off++ {
		all = append(all, fzRingData(0, off, uint32(off+1)))
	}
	f.Add(fzJoin(all...))
	f.Add(fzJoin(fzRingData(0, 0, 1), fzRingData(0, 0, 1), fzRingAck(0, 0b11), fzRingAck(0, ^uint64(0)), fzRingData(0, 7, 3)))
	f.Add(fzJoin(fzRingData(8, 0, 1), fzRingData(8, 1, 2), fzRingData(8, 1, 2), fzRingData(8, 6, 5), fzRingData(16, 0, 1)))
	f.Add(fzJoin(fzRingData(0xfffffff0, 0, 1), fzRingAck(0xffffffc0, 1<<63|1), fzRingAck(8, 1), []byte("junk"), nil))
	bad := fzRingData(0, 2, 9)
	bad[wire.OffCount] = 3 // disagrees with the chunk
	wrongStep := fzRingData(0, 3, 9)
	wrongStep[wire.OffAggIndex] = 0
	f.Add(fzJoin(bad, wrongStep, fzRingData(0, 3, 9)[:40], append(fzRingData(0, 3, 9), 0, 0, 0, 0)))

	f.Fuzz(func(t *testing.T, in []byte) {
		r := newFuzzRing(t)
		data, backing := fzGuarded(fzRingN)
		r.reqData = data
		r.reqPending.Store(true)
		r.start()
		base := uint32(r.op.base)
		if err := r.pump(r.now()); err != nil {
			t.Fatal(err)
		}
		if err := r.flush(); err != nil {
			t.Fatal(err)
		}
		fzRingCheck(t, r)
		got := map[int]bool{} // seq offsets applied
		for i, b := range fzSplit(in) {
			before, was := slices.Clone(data), r.Stats()
			r.handle(b, r.now(), true)
			r.queueAcks()
			if err := r.flush(); err != nil {
				t.Fatal(err)
			}
			st := r.Stats()
			fzGuardOK(t, data, backing)
			fzRingCheck(t, r)

			h, vals, err := wire.ParsePacket(b)
			if err != nil || h.JobId != fzRingID || h.Encoding != wire.EncFloat32 {
				if st.Malformed != was.Malformed+1 || st.DataReceived != was.DataReceived || st.AcksReceived != was.AcksReceived ||
					st.Duplicates != was.Duplicates || st.Early != was.Early || st.EarlyDropped != was.EarlyDropped {
					t.Fatalf("datagram %d (%v): stats %+v -> %+v, want Malformed+1 only", i, err, was, st)
				}
			}
			// Which packet of the call this is, if any, decided here from the wire contract alone.
			off := int(int32(h.Seq - base))
			s, p := off/fzRingPer, off%fzRingPer
			lo, cn := fzRingChunk(((fzRingRank-1-s)%fzRingW + fzRingW) % fzRingW)
			fits := err == nil && h.Type == wire.MsgData && h.JobId == fzRingID && h.Encoding == wire.EncFloat32 &&
				h.WorkerId == fzRingPred && h.FanIn0 == fzRingW && h.Bitmap0 == 1<<fzRingPred &&
				off >= 0 && off < fzRingPer*2*(fzRingW-1) && p*fzRingK < cn && h.AggIndex == uint32(s) &&
				h.Bitmap1 == fzRingN && int(h.Count) == min(fzRingK, cn-p*fzRingK)
			applied := st.DataReceived - was.DataReceived
			switch {
			case applied > 1:
				t.Fatalf("datagram %d applied %d times", i, applied)
			case applied == 1 && (!fits || got[off]):
				t.Fatalf("datagram %d (%+v) was applied: not a packet of the call, or offset %d already applied", i, h, off)
			case applied == 0 && fits && !got[off]:
				t.Fatalf("datagram %d (%+v), packet %d of step %d, was not applied (stats %+v -> %+v)", i, h, p, s, was, st)
			case applied == 0:
				if !sameBits(data, before) {
					t.Fatalf("datagram %d (%+v) changed the tensor without being applied", i, h)
				}
				continue
			}
			got[off] = true
			want := slices.Clone(before)
			at := lo + p*fzRingK
			for j := range int(h.Count) {
				v := math.Float32frombits(binary.LittleEndian.Uint32(vals[4*j:]))
				if s < fzRingW-1 {
					want[at+j] = v + before[at+j] // reduce-scatter: add to the partial sum
				} else {
					want[at+j] = v // all-gather: the final sum
				}
			}
			if !sameBits(data, want) {
				t.Fatalf("datagram %d (packet %d of step %d): tensor\n%v\nwant\n%v", i, p, s, data, want)
			}
		}

		// The next call replays what was stashed for it (not fresh: nothing is stashed again).
		r.finish(errCanceled)
		<-r.done
		data2, backing2 := fzGuarded(fzRingN)
		before2, was := slices.Clone(data2), r.Stats()
		r.reqData = data2
		r.reqPending.Store(true)
		r.start()
		if err := r.flush(); err != nil {
			t.Fatal(err)
		}
		fzGuardOK(t, data2, backing2)
		fzRingCheck(t, r)
		st := r.Stats()
		if st.DataReceived == was.DataReceived && !sameBits(data2, before2) {
			t.Fatalf("stashed packets changed the next call's tensor without being applied")
		}
		if st.DataReceived-was.DataReceived > was.Early {
			t.Fatalf("the next call applied %d stashed packets, only %d were kept", st.DataReceived-was.DataReceived, was.Early)
		}
		r.finish(errCanceled)
		<-r.done
	})
}

// ---- Worker ----

// The fuzzed worker: worker 0 of job 3 (fan-in 2), 4 values per fragment, window 4 over a pool of
// 16, a 30-value tensor (8 fragments, the last of 2 values). With `joined` it has joined a switch
// whose agent is at fzAgent, a Join is pending (nonce fzNonce) and fragment fzAskedFrag's result
// was asked of the agent's cache.
const (
	fzWorkerJob    = 3
	fzWorkerK      = 4
	fzWorkerWindow = 4
	fzWorkerPool   = 16
	fzWorkerN      = 30
	fzWorkerScale  = 20
	fzNonce        = 0x5eed0001
	fzAskedFrag    = 1
)

// fzKey is the fuzzed job's control key.
var fzKey = func() []byte {
	k := make([]byte, ctlauth.KeySize)
	for i := range k {
		k[i] = byte(i*7 + 1)
	}
	return k
}()

// Where a fuzzed worker's datagram comes from: two bits per datagram of the input's srcs.
const (
	fzFromPS        = iota // the worker's PS address and port
	fzFromAgent            // the switch agent's address (control messages and cached results)
	fzFromOtherPort        // the PS's host, another port
	fzFromOtherIP          // another host, the PS's port
)

func fzSource(srcs uint32, i int) int { return int(srcs>>(2*(i%16))) & 3 }

// fzWorkerAddrs are the addresses a fuzzed worker's datagrams come from, by fzFrom*.
func fzWorkerAddrs(t *testing.T) [4]netip.AddrPort {
	ps := fzSink(t, 2)
	return [4]netip.AddrPort{ps, fzSink(t, 1), fzSink(t, 0), netip.AddrPortFrom(netip.AddrFrom4([4]byte{127, 0, 0, 2}), ps.Port())}
}

// fzResult is the result of fragment frag of the worker's first AllReduce (seq = frag).
func fzResult(frag int, flags uint16, enc uint8, fill int32) []byte {
	n := max(min(fzWorkerK, fzWorkerN-frag*fzWorkerK), 1)
	vals := make([]uint32, n)
	for i := range vals {
		if enc == wire.EncFloat32 {
			vals[i] = math.Float32bits(float32(fill) + float32(i)/2)
		} else {
			vals[i] = uint32(fill<<fzWorkerScale + int32(i))
		}
	}
	return fzPacket(wire.Header{Version: wire.Version, Type: wire.MsgResult, Encoding: enc, ScaleLog2: fzWorkerScale,
		Flags: flags | wire.FlagFromSwitch, Count: uint16(n), JobId: fzWorkerJob, Seq: uint32(frag),
		AggIndex: AggIndex(fzWorkerJob, uint64(frag), fzWorkerWindow, fzWorkerPool), Bitmap0: 0b11, FanIn0: 2}, vals...)
}

// fzAck is the agent's MSG_ACK of seq to worker `worker` of the fuzzed job, sealed under key with
// stamp (nil key: no trailer).
func fzAck(key []byte, seq uint32, worker uint8, stamp uint64) []byte {
	b := fzPacket(wire.Header{Version: wire.Version, Type: wire.MsgAck, JobId: fzWorkerJob, Seq: seq, WorkerId: worker})
	if key == nil {
		return b
	}
	b, err := ctlauth.Seal(key, b, stamp)
	if err != nil {
		panic(err)
	}
	return b
}

// newFuzzWorker is a worker without its receive goroutine: NewWorker builds it, Close stops the
// goroutine, and it gets a fresh socket that only the test drives. Its data goes to a sink.
func newFuzzWorker(t *testing.T) *Worker {
	t.Helper()
	w, err := NewWorker(WorkerConfig{JobID: fzWorkerJob, WorkerID: 0, NumWorkers: 2, Local: netip.AddrPortFrom(loopback, 0),
		PS: fzSink(t, 2), PoolSize: fzWorkerPool, Window: fzWorkerWindow, ScaleLog2: fzWorkerScale, Timeout: time.Hour,
		ValuesPerPacket: fzWorkerK, SocketBuffer: 1 << 16, NoGSO: true, JobKey: fzKey})
	if err != nil {
		t.Fatal(err)
	}
	w.Close()
	bc, err := listenBatch(netip.AddrPortFrom(loopback, 0), 1<<16, recvBatch, fzWorkerWindow+1)
	if err != nil {
		t.Fatal(err)
	}
	w.bc = bc
	t.Cleanup(func() { bc.close() })
	return w
}

// fzSrcs builds a srcs word from per-datagram sources.
func fzSrcs(from ...int) uint32 {
	var s uint32
	for i, f := range from {
		s |= uint32(f&3) << (2 * i)
	}
	return s
}

func FuzzWorkerResult(f *testing.F) {
	var all [][]byte
	for frag := range (fzWorkerN + fzWorkerK - 1) / fzWorkerK {
		all = append(all, fzResult(frag, 0, wire.EncFixed32, int32(frag)))
	}
	f.Add(false, uint32(0), fzJoin(all...))
	// The same from elsewhere: foreign, all of them; and from the agent, once joined (its cache).
	f.Add(false, fzSrcs(fzFromOtherPort, fzFromOtherIP, fzFromAgent, fzFromPS, fzFromOtherIP), fzJoin(all[:5]...))
	f.Add(true, fzSrcs(fzFromAgent, fzFromOtherPort, fzFromAgent, fzFromPS), fzJoin(fzResult(0, wire.FlagCached, wire.EncFixed32, 1),
		fzResult(1, wire.FlagCached, wire.EncFixed32, 2), fzResult(2, wire.FlagCached, wire.EncFixed32, 3), fzResult(3, 0, wire.EncFixed32, 4)))
	// Overflow: the repair, then its float result; shadow and PS results; a duplicate.
	f.Add(false, uint32(0), fzJoin(fzResult(1, wire.FlagOverflow, wire.EncFixed32, 1), fzResult(1, wire.FlagOverflow, wire.EncFixed32, 1), fzResult(1, 0, wire.EncFloat32, 7),
		fzResult(0, wire.FlagShadow, wire.EncFixed32, 2), fzResult(0, 0, wire.EncFixed32, 2), fzResult(2, wire.FlagCollision, wire.EncFixed32, -3)))
	short := fzResult(7, 0, wire.EncFixed32, 1)
	short[wire.OffCount] = 4 // the last fragment has 2 values
	wrongSlot := fzResult(3, 0, wire.EncFixed32, 1)
	wrongSlot[wire.OffAggIndex]++
	f.Add(false, uint32(0), fzJoin(fzAck(nil, 2, 0, 0), short, wrongSlot, fzResult(9, 0, wire.EncFixed32, 1), fzResult(3, 0, wire.EncSparseKV, 1), []byte{1, 2, 3},
		make([]byte, 3000), make([]byte, rslot+10)))
	// Acknowledgements: the Join's, a cache miss, replays of both, a stale stamp, a wrong worker
	// id, another key, a tampered one, no trailer, and a good one from the PS's address. Stamps
	// are taken now: authentic ones must be within ctlauth.MaxSkew of the clock when they run.
	now := uint64(time.Now().UnixNano())
	otherKey := append([]byte(nil), fzKey...)
	otherKey[0] ^= 1
	good, miss := fzAck(fzKey, fzNonce, 0, now), fzAck(fzKey, fzAskedFrag, 0, now+1)
	tampered := fzAck(fzKey, fzNonce, 0, now+5)
	tampered[wire.OffSeq] ^= 1
	f.Add(true, fzSrcs(fzFromAgent, fzFromAgent, fzFromAgent, fzFromAgent, fzFromAgent, fzFromAgent, fzFromAgent, fzFromAgent,
		fzFromAgent, fzFromPS, fzFromOtherIP, fzFromAgent),
		fzJoin(good, miss, good, miss, fzAck(fzKey, fzNonce, 0, now-uint64(time.Minute)), fzAck(fzKey, fzNonce, 1, now+2),
			fzAck(otherKey, fzNonce, 0, now+3), tampered, fzAck(nil, fzNonce, 0, 0), fzAck(fzKey, fzNonce, 0, now+6),
			fzAck(fzKey, fzNonce, 0, now+7), append(fzAck(fzKey, fzNonce, 0, now+8), 0)))
	f.Add(false, fzSrcs(fzFromAgent, fzFromPS), fzJoin(fzAck(fzKey, fzNonce, 0, now+9), fzAck(fzKey, fzNonce, 0, now+10)))

	f.Fuzz(func(t *testing.T, joined bool, srcs uint32, in []byte) {
		w := newFuzzWorker(t)
		addrs := fzWorkerAddrs(t)
		data, backing := fzGuarded(fzWorkerN)
		nfrags := (fzWorkerN + fzWorkerK - 1) / fzWorkerK
		// What AllReduce does before its first step.
		base := w.nextSeq
		w.nextSeq += uint64(nfrags)
		w.mu.Lock()
		w.op.active, w.op.data, w.op.seqBase = true, data, base
		w.op.nfrags, w.op.low, w.op.next = nfrags, 0, 0
		if joined {
			// What a Join leaves behind, and a second Join under way.
			w.ctrl, w.ctrlRaw, w.ctrlSet = addrs[fzFromAgent], sockaddr4(addrs[fzFromAgent]), true
			w.ackWant, w.ackFrom, w.ackPending = fzNonce, sockaddr4(addrs[fzFromAgent]), true
		}
		w.mu.Unlock()
		if _, err := w.step(); err != nil {
			t.Fatal(err)
		}
		if joined {
			w.mu.Lock()
			w.op.ring[fzAskedFrag].askedCache = true // as if its result had been asked of the cache
			w.mu.Unlock()
		}
		var lastStamp uint64   // the agent's last accepted stamp
		done := map[int]bool{} // fragments whose result was written
		for i, b := range fzSplit(in) {
			slot := i % recvBatch // as the receive goroutine would see a batch
			src := fzSource(srcs, i)
			fzInject(w.bc, slot, b, addrs[src])
			before, was := slices.Clone(data), w.Stats()
			// Whether an ACK of fragment fzAskedFrag is a cache miss: its result was asked of the
			// agent and is still missing, in fixed point.
			af := &w.op.ring[fzAskedFrag%fzWorkerWindow]
			missable := w.op.active && w.op.low <= fzAskedFrag && fzAskedFrag < w.op.next && af.idx == fzAskedFrag &&
				af.askedCache && af.state == fragFixed
			w.mu.Lock()
			w.handleResult(w.bc.datagram(slot))
			gotAck := w.ackGot
			w.mu.Unlock()
			st := w.Stats()
			fzGuardOK(t, data, backing)

			// The model's verdict for the datagram's source and, for an ACK, its authentication.
			const (
				vOther = iota // a result or malformed: checked below
				vForeign
				vUnauth
				vReplayed
				vAck
				vAckMalformed
			)
			h, vals, err := wire.ParsePacket(b)
			fromAgent := joined && src == fzFromAgent
			verdict := vOther
			var stamp uint64
			switch {
			case src != fzFromPS && !fromAgent:
				verdict = vForeign
			case len(b) > wire.MaxPacket:
			case err == nil && h.Type == wire.MsgAck:
				msg, s, oerr := ctlauth.Open(fzKey, b)
				skew := time.Until(time.Unix(0, int64(s)))
				switch {
				case !fromAgent:
					verdict = vForeign
				case oerr != nil:
					verdict = vUnauth
				case len(msg) != wire.HdrSize || h.Count != 0 || h.JobId != fzWorkerJob || h.WorkerId != 0:
					verdict = vAckMalformed
				case (lastStamp != 0 && s <= lastStamp) || skew > ctlauth.MaxSkew || skew < -ctlauth.MaxSkew:
					verdict = vReplayed
				default:
					verdict, stamp = vAck, s
				}
			}
			moved := []uint64{st.ResultsReceived - was.ResultsReceived, st.DuplicateResults - was.DuplicateResults,
				st.OverflowRepairs - was.OverflowRepairs, st.Malformed - was.Malformed, st.Foreign - was.Foreign,
				st.Unauthenticated - was.Unauthenticated, st.Replayed - was.Replayed, st.ControlAcks - was.ControlAcks}
			var total uint64
			for _, m := range moved {
				total += m
			}
			if total != 1 || slices.Max(moved) != 1 {
				t.Fatalf("datagram %d (%+v, %v) from %d: results/duplicates/repairs/malformed/foreign/unauthenticated/replayed/acks moved by %v, want exactly one by 1",
					i, h, err, src, moved)
			}
			want := map[int]int{vForeign: 4, vUnauth: 5, vReplayed: 6, vAck: 7, vAckMalformed: 3}
			if k, ok := want[verdict]; ok && moved[k] != 1 {
				t.Fatalf("datagram %d (%+v, %v) from %d: verdict %d, but counters moved by %v", i, h, err, src, verdict, moved)
			}
			if verdict == vOther && slices.Max(moved[4:]) != 0 {
				t.Fatalf("datagram %d (%+v, %v) from %d: counted as an acknowledgement or foreign (%v)", i, h, err, src, moved)
			}
			if verdict == vOther && (err != nil || h.Type != wire.MsgResult || h.JobId != fzWorkerJob) && moved[3] != 1 {
				t.Fatalf("datagram %d (%+v, %v) is not a result of the job but was not counted malformed", i, h, err)
			}
			misses := st.CacheMisses - was.CacheMisses
			switch {
			case verdict == vAck:
				lastStamp = stamp
				if h.Seq == fzNonce && !gotAck {
					t.Fatalf("datagram %d: the pending Join's authenticated ACK did not complete it", i)
				}
				isMiss := h.Seq != fzNonce && h.Seq == uint32(base)+fzAskedFrag && missable
				if misses != b2u(isMiss) {
					t.Fatalf("datagram %d: ACK of seq %d moved CacheMisses by %d, want %v", i, h.Seq, misses, isMiss)
				}
			case misses != 0:
				t.Fatalf("datagram %d (verdict %d) moved CacheMisses", i, verdict)
			case gotAck && lastStamp == 0:
				t.Fatalf("datagram %d (verdict %d) completed the Join without an authenticated ACK", i, verdict)
			}
			if moved[0] == 0 {
				if !sameBits(data, before) {
					t.Fatalf("datagram %d (%+v, %v) changed the tensor without being counted a result", i, h, err)
				}
			} else {
				frag := int(int32(h.Seq - uint32(base)))
				lo := frag * fzWorkerK
				if frag < 0 || frag >= nfrags || done[frag] || h.Type != wire.MsgResult || h.JobId != fzWorkerJob ||
					int(h.Count) != min(fzWorkerK, fzWorkerN-lo) ||
					h.AggIndex != AggIndex(fzWorkerJob, base+uint64(frag), fzWorkerWindow, fzWorkerPool) ||
					(h.Encoding == wire.EncFixed32 && h.Flags&wire.FlagOverflow != 0) {
					t.Fatalf("datagram %d (%+v) was taken as the result of fragment %d (already done: %v)", i, h, frag, done[frag])
				}
				done[frag] = true
				want := slices.Clone(before)
				for j := range int(h.Count) {
					v := binary.LittleEndian.Uint32(vals[4*j:])
					switch h.Encoding {
					case wire.EncFixed32:
						want[lo+j] = Dequantize(int32(v), h.ScaleLog2)
					case wire.EncFloat32:
						want[lo+j] = math.Float32frombits(v)
					default:
						t.Fatalf("datagram %d: a result of encoding %d was taken", i, h.Encoding)
					}
				}
				if !sameBits(data, want) {
					t.Fatalf("datagram %d (result of fragment %d): tensor\n%v\nwant\n%v", i, frag, data, want)
				}
			}
			// What AllReduce does when the receive goroutine kicks it: move on, send what is due.
			wait, err := w.step()
			if err != nil {
				t.Fatal(err)
			}
			if wait < 0 && w.op.active {
				w.mu.Lock()
				w.op.active, w.op.data = false, nil // AllReduce returns: results are stale from now on
				w.mu.Unlock()
			}
		}
	})
}

func b2u(b bool) uint64 {
	if b {
		return 1
	}
	return 0
}

// ---- PS ----

// fzPSEntry is the model of one aggregation: the PS's documented behaviour, rebuilt here.
type fzPSEntry struct {
	count, fan   int
	level1       bool
	scale        uint8
	bitmap       uint32
	flags        uint16 // F_ECN | F_OVERFLOW | F_COLLISION of contributions
	complete     bool
	fix          []int64
	flt          [][]float32 // float32 contributions, per value
	firstWorker  uint8
	firstBitmaps [2]uint32
}

// fzPSData is a DATA packet for the PS.
func fzPSData(job, seq uint32, enc uint8, worker, fan uint8, flags uint16, vals ...uint32) []byte {
	h := wire.Header{Version: wire.Version, Type: wire.MsgData, Encoding: enc, ScaleLog2: 24, Flags: flags,
		Count: uint16(len(vals)), JobId: job, Seq: seq, AggIndex: 5, Bitmap0: 1 << worker, FanIn0: fan, WorkerId: worker}
	if flags&wire.FlagLevel1 != 0 {
		h.Bitmap0, h.FanIn0, h.Bitmap1, h.FanIn1 = 0, 0, 1<<worker, fan
	}
	return fzPacket(h, vals...)
}

// The fuzzed PS's admitted jobs (unless Open): job 5 of workers at A and B, job 6 of workers at B,
// any port of 127.0.0.1, and C (another host). A datagram comes, by two bits of srcs each, from
// the member its worker id names (fzFromMember; somewhere foreign if it names none), A, B, or a
// host that is no member (fzFromStranger).
const (
	fzFromMember = iota
	fzFromA
	fzFromB
	fzFromStranger
)

// fzPSMembers returns the members of the fuzzed jobs, by job and worker id, and the four sources.
func fzPSMembers(t *testing.T) (map[uint32][]netip.AddrPort, [4]netip.AddrPort) {
	a, b := fzSink(t, 0), fzSink(t, 1)
	c := netip.AddrPortFrom(netip.AddrFrom4([4]byte{127, 0, 0, 2}), a.Port())
	jobs := map[uint32][]netip.AddrPort{5: {a, b}, 6: {b, netip.AddrPortFrom(loopback, 0), c}}
	stranger := netip.AddrPortFrom(netip.AddrFrom4([4]byte{127, 0, 0, 3}), a.Port())
	return jobs, [4]netip.AddrPort{{}, a, b, stranger}
}

func FuzzPSHandle(f *testing.F) {
	f32 := func(xs ...float32) []uint32 {
		out := make([]uint32, len(xs))
		for i, x := range xs {
			out[i] = math.Float32bits(x)
		}
		return out
	}
	for _, open := range []bool{false, true} {
		for _, direct := range []bool{false, true} {
			f.Add(open, direct, uint8(3), uint32(0), fzJoin(
				fzPSData(5, 1, wire.EncFixed32, 0, 2, 0, fzI32s(1, -2, 3)...),
				fzPSData(5, 1, wire.EncFixed32, 0, 2, wire.FlagResend, fzI32s(1, -2, 3)...),
				fzPSData(5, 1, wire.EncFixed32, 1, 2, wire.FlagECN, fzI32s(10, 20, 30)...),
				fzPSData(5, 1, wire.EncFixed32, 1, 2, wire.FlagResend, fzI32s(10, 20, 30)...),
				fzPSData(5, 2, wire.EncFixed32, 0, 1, wire.FlagCollision, fzI32s(math.MaxInt32)...),
				fzPSData(5, 3, wire.EncFixed32, 0, 2, 0, fzI32s(math.MaxInt32, math.MinInt32)...),
				fzPSData(5, 3, wire.EncFixed32, 1, 2, 0, fzI32s(1, -1)...),
			))
			f.Add(open, direct, uint8(2), uint32(0), fzJoin(
				fzPSData(6, 1, wire.EncFloat32, 0, 3, wire.FlagOverflow, f32(1e30, 1, -0.0)...),
				fzPSData(6, 1, wire.EncFloat32, 2, 3, wire.FlagOverflow, f32(-1e30, 0x1p-149, -0.0)...),
				fzPSData(6, 1, wire.EncFloat32, 1, 3, wire.FlagOverflow, f32(3, float32(math.Inf(1)), -0.0)...),
				fzPSData(6, 1, wire.EncFixed32, 1, 3, wire.FlagLevel1, fzI32s(1, 2, 3)...),
				fzPSData(6, 2, wire.EncFixed32, 1, 3, wire.FlagLevel1, fzI32s(1, 2, 3)...),
				fzPSData(6, 3, wire.EncFixed32, 1, 3, 0, fzI32s(1, 2, 3)...),
				fzPSData(6, 4, wire.EncFixed32, 0, 1, 0, fzI32s(4)...),
				fzPSData(6, 5, wire.EncFixed32, 0, 1, 0, fzI32s(5)...),
			))
		}
	}
	res := fzPSData(5, 1, wire.EncFixed32, 0, 2, 0, fzI32s(1)...)
	res[wire.OffType] = wire.MsgResult
	count := fzPSData(5, 1, wire.EncFixed32, 1, 2, 0, fzI32s(1, 2)...)
	scale := fzPSData(5, 1, wire.EncFixed32, 1, 2, 0, fzI32s(1)...)
	scale[wire.OffScale] = 20
	unknownEnc := fzPSData(5, 1, wire.EncFixed32, 1, 2, 0, fzI32s(1)...)
	unknownEnc[wire.OffEncoding] = wire.EncSparseKV + 1
	f.Add(false, false, uint8(1), uint32(0), fzJoin(fzPSData(5, 1, wire.EncFixed32, 0, 2, 0, fzI32s(1)...), res, count, scale,
		fzPSData(5, 1, wire.EncSparseKV, 1, 2, 0, fzI32s(1)...), unknownEnc, []byte("hello"), make([]byte, rslot+1), make([]byte, 3000)))
	// Outsiders: an unknown job, a worker id beyond the job, members' packets from the wrong
	// address or port, another member's id; the any-port member from any port.
	f.Add(false, false, uint8(0), fzSrcs(fzFromMember, fzFromMember, fzFromB, fzFromStranger, fzFromA, fzFromA, fzFromB, fzFromMember),
		fzJoin(fzPSData(7, 1, wire.EncFixed32, 0, 2, 0, fzI32s(1)...), fzPSData(5, 1, wire.EncFixed32, 2, 3, 0, fzI32s(1)...),
			fzPSData(5, 1, wire.EncFixed32, 0, 2, 0, fzI32s(1)...), fzPSData(5, 1, wire.EncFixed32, 1, 2, 0, fzI32s(1)...),
			fzPSData(6, 1, wire.EncFixed32, 1, 3, 0, fzI32s(1)...), fzPSData(6, 1, wire.EncFixed32, 2, 3, 0, fzI32s(1)...),
			fzPSData(5, 1, wire.EncSparseKV, 1, 2, 0, fzI32s(1)...), fzPSData(5, 1, wire.EncFixed32, 1, 2, 0, fzI32s(1)...)))
	// Job 5 floods new seqs (resends, never complete) past its share; job 6 keeps its sums.
	var flood [][]byte
	flood = append(flood, fzPSData(6, 9, wire.EncFixed32, 0, 3, 0, fzI32s(6)...))
	for seq := range uint32(10) {
		flood = append(flood, fzPSData(5, 100+seq, wire.EncFixed32, 0, 2, wire.FlagResend, fzI32s(1)...))
	}
	flood = append(flood, fzPSData(6, 9, wire.EncFixed32, 1, 3, 0, fzI32s(6)...), fzPSData(6, 9, wire.EncFixed32, 2, 3, 0, fzI32s(6)...))
	f.Add(false, false, uint8(1), uint32(0), fzJoin(flood...))

	f.Fuzz(func(t *testing.T, open, direct bool, maxEntries uint8, srcs uint32, in []byte) {
		var (
			cfg PSConfig
			p   *PS
		)
		members, from := fzPSMembers(t)
		fzOnFreePort(t, func(listen netip.AddrPort) (err error) {
			cfg = PSConfig{Listen: listen, Switch: fzSink(t, 1), Direct: direct, Open: open,
				Shards: 1, SocketBuffer: 1 << 16, MaxEntries: 1 + int(maxEntries%4)}
			if !open {
				cfg.MaxEntries *= len(members)
				for _, id := range []uint32{5, 6} {
					cfg.Jobs = append(cfg.Jobs, PSJob{ID: id, Workers: members[id]})
				}
			}
			p, err = NewPS(cfg) // no Serve: the test drives the shard
			return err
		})
		t.Cleanup(func() { p.Close() })
		share := cfg.MaxEntries
		if !open {
			share /= len(members)
		}
		s := p.socks[0]
		model := map[psKey]*fzPSEntry{}
		now := int64(0)
		for i, b := range fzSplit(in) {
			now += int64(time.Millisecond)
			slot := i % recvBatch
			h, vals, err := wire.ParsePacket(b)
			src := from[fzSource(srcs, i)]
			if fzSource(srcs, i) == fzFromMember {
				src = from[fzFromStranger]
				if ms := members[h.JobId]; int(h.WorkerId) < len(ms) {
					src = ms[h.WorkerId]
					if src.Port() == 0 {
						src = netip.AddrPortFrom(src.Addr(), 1) // any port will do
					}
				}
			}
			fzInject(s.bc, slot, b, src)
			was := p.Stats()
			p.handle(s, slot, now)
			if err := s.flush(); err != nil {
				t.Fatal(err)
			}
			st := p.Stats()

			// The model's verdict, in the documented order of the checks.
			const (
				vMalformed = iota
				vDuplicate
				vAggregated
				vDropped
				vUnknownJob
				vNotMember
				vOverQuota
				vUnsupported
			)
			verdict, evict := vMalformed, false
			var e *fzPSEntry
			key := psKey{job: h.JobId, seq: h.Seq, enc: h.Encoding}
			bm, fan := h.LevelBits()
			level1 := h.Flags&wire.FlagLevel1 != 0
			ms, admitted := members[h.JobId]
			memberOK := func() bool {
				if int(h.WorkerId) >= len(ms) {
					return false
				}
				m := ms[h.WorkerId]
				return m.Addr() == src.Addr() && (m.Port() == 0 || m.Port() == src.Port())
			}
			unsupported := err == wire.ErrEncoding ||
				(len(b) >= wire.HdrSize && h.Version == wire.Version && h.Reserved == 0 && h.Type == wire.MsgData && wire.Sparse(h.Encoding))
			switch {
			case len(b) > wire.MaxPacket || (err != nil && !unsupported) || h.Type != wire.MsgData:
			case !open && !admitted:
				verdict = vUnknownJob
			case !open && !memberOK():
				verdict = vNotMember
			case unsupported || (h.Encoding != wire.EncFixed32 && h.Encoding != wire.EncFloat32):
				verdict = vUnsupported
			case !open && !level1 && int(fan) != len(ms):
			default:
				e = model[key]
				switch {
				case e == nil:
					held := 0
					for k := range model {
						if open || k.job == h.JobId {
							held++
						}
					}
					free := held < share
					if !free {
						for k, o := range model {
							if (open || k.job == h.JobId) && o.complete {
								free, evict = true, true
								break
							}
						}
					}
					if !free {
						verdict = vOverQuota
						if open {
							verdict = vDropped
						}
						break
					}
					e = &fzPSEntry{count: int(h.Count), fan: int(fan), level1: level1, scale: h.ScaleLog2,
						firstWorker: h.WorkerId, firstBitmaps: [2]uint32{h.Bitmap0, h.Bitmap1}}
					if h.Encoding == wire.EncFixed32 {
						e.fix = make([]int64, h.Count)
					} else {
						e.flt = make([][]float32, h.Count)
					}
					model[key] = e
					verdict = vAggregated
				case e.count != int(h.Count) || e.fan != int(fan) || e.level1 != level1 ||
					(h.Encoding == wire.EncFixed32 && e.scale != h.ScaleLog2):
				case e.bitmap&bm != 0:
					verdict = vDuplicate
				default:
					verdict = vAggregated
				}
			}
			completes := false
			if verdict == vAggregated {
				for j := range int(h.Count) {
					v := binary.LittleEndian.Uint32(vals[4*j:])
					if e.fix != nil {
						e.fix[j] += int64(int32(v))
					} else {
						e.flt[j] = append(e.flt[j], math.Float32frombits(v))
					}
				}
				e.bitmap |= bm
				e.flags |= h.Flags & (wire.FlagECN | wire.FlagOverflow | wire.FlagCollision)
				completes = bits.OnesCount32(e.bitmap) == e.fan
				e.complete = completes
			}

			want := was
			want.Received++
			want.Unaddressed = st.Unaddressed
			switch verdict {
			case vMalformed:
				want.Malformed++
			case vDuplicate:
				want.Duplicates++
				if e.complete {
					want.ResultsResent++ // the sender missed the result: unicast it again
				}
			case vAggregated:
				want.Aggregated++
				if completes {
					want.Completed++
					ovf := e.flags&wire.FlagOverflow != 0
					for _, v := range e.fix {
						ovf = ovf || v > math.MaxInt32 || v < math.MinInt32
					}
					if e.fix != nil && ovf {
						want.Overflows++ // sent saturated, for the float repair
					}
				}
			case vDropped:
				want.Dropped++
			case vUnknownJob:
				want.UnknownJob++
			case vNotMember:
				want.NotMember++
			case vOverQuota:
				want.OverQuota++
			case vUnsupported:
				want.Unsupported++
			}
			if st != want {
				t.Fatalf("datagram %d (%+v, %v) from %v: stats\n%+v\nwant\n%+v", i, h, err, src, st, want)
			}

			// The PS's tables against the model: a completed result of the same job (Open: any)
			// may have been released to admit this one (exactly then), nothing else may vanish or
			// appear.
			seen := map[psKey]bool{}
			for ti := range p.tables {
				for k, pe := range p.tables[ti].entries {
					seen[k] = true
					me := model[k]
					if me == nil {
						t.Fatalf("datagram %d: the PS holds %+v, which nothing valid created", i, k)
					}
					fzPSCompare(t, i, k, pe, me)
				}
			}
			gone := 0
			for k, me := range model {
				if !seen[k] {
					if !me.complete || !evict || (!open && k.job != h.JobId) {
						t.Fatalf("datagram %d: the PS lost %+v (complete %v, room needed %v for job %d)", i, k, me.complete, evict, h.JobId)
					}
					delete(model, k)
					gone++
				}
			}
			if gone != b2i(evict) {
				t.Fatalf("datagram %d: %d results released to admit a new aggregation, want %d", i, gone, b2i(evict))
			}
			fzPSAccounts(t, i, p, model)
		}
		// Everything ages out, and every account comes back to zero.
		now += int64(time.Hour)
		for ti := range p.tables {
			p.evict(&p.tables[ti], s, now)
		}
		fzPSAccounts(t, -1, p, map[psKey]*fzPSEntry{})
	})
}

// fzPSAccounts checks that each account holds as many entries as the model has of its job (Open:
// of all jobs), and never more than its share.
func fzPSAccounts(t *testing.T, i int, p *PS, model map[psKey]*fzPSEntry) {
	t.Helper()
	for _, a := range p.accts {
		want, done := 0, 0
		for k, me := range model {
			if a == p.open || p.jobs[k.job].acct == a {
				want++
				done += b2i(me.complete)
			}
		}
		if n := a.n.Load(); n != int64(want) || n > a.share || a.done.Load() != int64(done) {
			t.Fatalf("datagram %d: account %d holds %d entries, %d complete (share %d), the model %d, %d complete",
				i, a.idx, n, a.done.Load(), a.share, want, done)
		}
	}
}

// fzPSCompare checks one PS entry against its model.
func fzPSCompare(t *testing.T, i int, k psKey, pe *psEntry, me *fzPSEntry) {
	t.Helper()
	if pe.bitmap != me.bitmap || pe.complete != me.complete || int(pe.fanIn) != me.fan || pe.level1 != me.level1 ||
		int(pe.tmpl.Count) != me.count {
		t.Fatalf("datagram %d: entry %+v: bitmap %#x complete %v fan %d level1 %v count %d; model %+v",
			i, k, pe.bitmap, pe.complete, pe.fanIn, pe.level1, pe.tmpl.Count, me)
	}
	if !me.complete {
		if me.fix != nil && (pe.fix == nil || !slices.Equal(pe.fix[:me.count], me.fix)) {
			t.Fatalf("datagram %d: entry %+v sums %v, model %v", i, k, pe.fix, me.fix)
		}
		return
	}
	h, vals, err := wire.ParsePacket(pe.pkt[:pe.plen])
	if err != nil || h.Type != wire.MsgResult || h.JobId != k.job || h.Seq != k.seq || h.Encoding != k.enc || int(h.Count) != me.count {
		t.Fatalf("datagram %d: result of %+v is %+v (%v)", i, k, h, err)
	}
	if bm, _ := h.LevelBits(); bm != me.bitmap {
		t.Fatalf("datagram %d: result of %+v carries bitmap %#x, want %#x", i, k, bm, me.bitmap)
	}
	flags := me.flags & (wire.FlagECN | wire.FlagCollision)
	if me.level1 {
		flags |= wire.FlagLevel1
	}
	for j := range me.count {
		got := binary.LittleEndian.Uint32(vals[4*j:])
		if me.fix != nil {
			v := me.fix[j]
			if v > math.MaxInt32 || v < math.MinInt32 {
				flags |= wire.FlagOverflow
				v = max(min(v, math.MaxInt32), math.MinInt32)
			}
			if int32(got) != int32(v) {
				t.Fatalf("datagram %d: result of %+v value %d = %d, want the saturated sum %d", i, k, j, int32(got), v)
			}
			continue
		}
		if want, ok := fzExactF32(me.flt[j]); ok && got != math.Float32bits(want) {
			t.Fatalf("datagram %d: float result of %+v value %d = %v, want the rounded exact sum %v of %v",
				i, k, j, math.Float32frombits(got), want, me.flt[j])
		}
	}
	if me.fix != nil && me.flags&wire.FlagOverflow != 0 {
		flags |= wire.FlagOverflow
	}
	if h.Flags != flags {
		t.Fatalf("datagram %d: result of %+v flags %#x, want %#x", i, k, h.Flags, flags)
	}
}

// fzExactF32 is the correctly rounded float32 of the exact sum of xs, when they are all finite.
func fzExactF32(xs []float32) (float32, bool) {
	sum := new(big.Float).SetPrec(1024)
	for _, x := range xs {
		if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) {
			return 0, false
		}
		sum.Add(sum, new(big.Float).SetFloat64(float64(x)))
	}
	if len(xs) > 0 && sum.Sign() == 0 {
		// big.Float keeps IEEE's sign of an exact zero sum: -0 only when every addend is -0.
		neg := true
		for _, x := range xs {
			neg = neg && math.Signbit(float64(x)) && x == 0
		}
		if neg {
			return float32(math.Copysign(0, -1)), true
		}
		return 0, true
	}
	v, _ := sum.Float32()
	return v, true
}
