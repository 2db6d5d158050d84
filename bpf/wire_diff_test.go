package bpf_test

// Differential test of wire.ParsePacket (the hosts' rules for a well-formed xdpagg packet) against
// xdpagg_switch run with BPF_PROG_TEST_RUN: for any UDP payload to the xdpagg port, inside a frame
// whose Ethernet, IPv4 and UDP headers are right, the switch counts `malformed` exactly when
// ParsePacket refuses it, bar the one rule only the switch can apply (agg_index < pool size for
// DATA and RESULT). Membership, slots and the control budget decide other verdicts: only the
// parse verdict (malformed or not) is compared.

import (
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/wire"
)

// wireDiff is a loaded switch and the next fragment sequence number it sees.
type wireDiff struct {
	s   *sw
	seq uint32
}

// newWireDiff loads the switch of the BPF_PROG_TEST_RUN tests (no source check, pool poolSize)
// with the test jobs enrolled.
func newWireDiff(tb testing.TB) *wireDiff {
	tb.Helper()
	s, err := loader.Load(testConfig(time.Hour))
	if errors.Is(err, ebpf.ErrNotSupported) {
		tb.Skipf("load switch: kernel lacks a feature: %v", err)
	}
	if err != nil {
		tb.Fatalf("load switch: %v", err)
	}
	tb.Cleanup(func() {
		if err := s.Close(); err != nil {
			tb.Errorf("close switch: %v", err)
		}
	})
	enroll(tb, s.Maps, loIfindex, testJobs...)
	e := &sw{Switch: s}
	e.base = e.counters(tb)
	return &wireDiff{s: e, seq: 1}
}

// maxDiffPayload bounds the payloads sent: a value more than the largest packet, so the length
// rules are exercised at the top without frames BPF_PROG_TEST_RUN cannot take.
const maxDiffPayload = wire.MaxPacket + 4

// check sends payload to the switch as the UDP payload of worker 0's well-formed frame and
// compares the switch's verdict with ParsePacket's. A header's seq is replaced by a fresh one
// first: the switch also refuses a contribution whose count or fan-in disagrees with the slot
// already aggregating the same <job, seq>, which depends on earlier packets, not on the parse.
func (d *wireDiff) check(t *testing.T, payload []byte) {
	t.Helper()
	payload = append([]byte{}, payload...) // non-nil: frame.bytes sends it as is
	if len(payload) >= wire.HdrSize {
		binary.LittleEndian.PutUint32(payload[wire.OffSeq:], d.seq)
		d.seq++
	}
	h, _, perr := wire.ParsePacket(payload)
	dense := !wire.Sparse(h.Encoding) && h.Type != wire.MsgPull
	want := perr != nil || ((h.Type == wire.MsgData || h.Type == wire.MsgResult) && dense && h.AggIndex >= poolSize)
	// Job rule: the test jobs are dense, and a member's hot pairs for a dense job are malformed
	// (only the switch knows which jobs have registers). The frames come from worker 0's
	// address, so they pass the membership check when they name worker 0 with its bit.
	member := h.WorkerId == 0 && h.Bitmap0 == 1 && slices.Contains(testJobs, h.JobId)
	want = want || (perr == nil && member && h.Type == wire.MsgData && h.Encoding == wire.EncSparseKV)

	f := dataFrame(1, 0, 0, 0, 1)
	f.Payload = payload
	runProg(t, d.s.Objects.XdpaggSwitch, f.bytes())
	now := d.s.counters(t)
	delta := now.Sub(d.s.base)
	d.s.base = now
	if delta[maps.CntRx] != 1 || delta[maps.CntIPInvalid] != 0 || delta[maps.CntNonAgg] != 0 {
		t.Fatalf("payload %x: not taken as an xdpagg packet: %v", payload, deltaOf(delta))
	}
	if got := delta[maps.CntMalformed] == 1; got != want {
		t.Fatalf("payload %x (header %+v): switch malformed=%v, wire.ParsePacket err=%v (agg_index %d, pool %d); counters %v",
			payload, h, got, perr, h.AggIndex, poolSize, deltaOf(delta))
	}
}

// diffSeeds are well-formed packets of every kind the switch takes: DATA (both levels, both
// encodings, one to MaxValues values), RESULT and each control message.
func diffSeeds() [][]byte {
	var out [][]byte
	mk := func(h wire.Header, n int) []byte {
		b := wire.AppendHeader(nil, &h)
		for i := range n {
			b = binary.LittleEndian.AppendUint32(b, uint32(i*7919))
		}
		return b
	}
	data := wire.Header{Version: wire.Version, Type: wire.MsgData, Encoding: wire.EncFixed32, ScaleLog2: 24,
		JobId: 1, AggIndex: 3, Bitmap0: 1, FanIn0: 4}
	for _, n := range []int{1, 2, 31, 33, wire.StdValues, wire.MaxValues} {
		h := data
		h.Count = uint16(n)
		out = append(out, mk(h, n))
	}
	f32 := data
	f32.Encoding, f32.Count = wire.EncFloat32, 3
	out = append(out, mk(f32, 3))
	lvl1 := data
	lvl1.Flags, lvl1.Bitmap0, lvl1.FanIn0, lvl1.Bitmap1, lvl1.FanIn1, lvl1.Count = wire.FlagLevel1, 0, 0, 1<<31, 32, 2
	out = append(out, mk(lvl1, 2))
	res := data
	res.Type, res.Bitmap0, res.Count = wire.MsgResult, 0xf, 4
	out = append(out, mk(res, 4))
	for _, ty := range []uint8{wire.MsgJoin, wire.MsgLeave, wire.MsgAck, wire.MsgRetransmit} {
		h := wire.Header{Version: wire.Version, Type: ty, JobId: 1}
		out = append(out, mk(h, 9))
	}
	// Sparse: hot DATA, cold DATA, a cold RESULT (update) and a read-out, each with its sparse
	// header (npkts 2 for DATA and RESULT, 0 for PULL) and pairs.
	sp := func(ty, enc uint8, n, psize int, npkts uint16) []byte {
		h := data
		h.Type, h.Encoding, h.Count, h.AggIndex = ty, enc, uint16(n), 1
		if ty == wire.MsgPull {
			h.AggIndex = 64
		}
		b := wire.AppendHeader(nil, &h)
		b = binary.LittleEndian.AppendUint32(b, 7)
		b = binary.LittleEndian.AppendUint16(b, npkts)
		b = binary.LittleEndian.AppendUint16(b, 0)
		return append(b, make([]byte, n*psize)...)
	}
	out = append(out, sp(wire.MsgData, wire.EncSparseKV, 5, wire.KVPairSize, 2), sp(wire.MsgData, wire.EncSparseKV, 0, wire.KVPairSize, 2),
		sp(wire.MsgData, wire.EncSparseCold, 3, wire.ColdPairSize, 2), sp(wire.MsgResult, wire.EncSparseCold, 4, wire.ColdPairSize, 2),
		sp(wire.MsgPull, wire.EncSparseKV, 8, wire.KVPairSize, 0))
	return out
}

// mutate changes one thing of a payload, biased towards the edges of each rule.
func mutate(r *rand.Rand, b []byte) []byte {
	b = append([]byte(nil), b...)
	pick := func(vs ...uint32) uint32 {
		if r.IntN(4) == 0 {
			return r.Uint32()
		}
		return vs[r.IntN(len(vs))]
	}
	put8 := func(off int, v uint32) {
		if off < len(b) {
			b[off] = byte(v)
		}
	}
	put16 := func(off int, v uint32) {
		if off+2 <= len(b) {
			binary.LittleEndian.PutUint16(b[off:], uint16(v))
		}
	}
	put32 := func(off int, v uint32) {
		if off+4 <= len(b) {
			binary.LittleEndian.PutUint32(b[off:], v)
		}
	}
	switch r.IntN(14) {
	case 0:
		put8(wire.OffVersion, pick(0, 1, 2, 255))
	case 1:
		put8(wire.OffType, pick(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 255))
	case 2:
		put8(wire.OffEncoding, pick(0, 1, 2, 3, 255))
	case 3:
		put16(wire.OffFlags, pick(0, uint32(wire.FlagLevel1), uint32(wire.FlagResend), uint32(wire.FlagCollision), 0xffff))
	case 4:
		put16(wire.OffCount, pick(0, 1, 2, 3, 4, 9, wire.MaxValues-1, wire.MaxValues, wire.MaxValues+1, 0xffff))
	case 5:
		put32(wire.OffJob, pick(0, 1, 2, unenrolledJob))
	case 6:
		put32(wire.OffAggIndex, pick(0, poolSize-1, poolSize, 0xffffffff))
	case 7:
		put32(wire.OffBitmap0, pick(0, 1, 2, 1<<3, 1<<4, 1<<31, 0xffffffff))
	case 8:
		put32(wire.OffBitmap1, pick(0, 1, 2, 1<<3, 1<<31, 0xffffffff))
	case 9:
		put8(wire.OffFanIn0, pick(0, 1, 3, 4, 31, 32, 33, 255))
	case 10:
		put8(wire.OffFanIn1, pick(0, 1, 2, 31, 32, 33))
	case 11:
		put8(wire.OffReserved, pick(0, 1, 0x80))
	case 12: // lengths: cut or extend
		switch n := r.IntN(5); {
		case n == 0 && len(b) > 0:
			b = b[:r.IntN(len(b))]
		case n == 1 && len(b) > 0:
			b = b[:len(b)-1]
		case n == 2:
			b = append(b, 0, 0, 0, 0)
		default:
			b = append(b, byte(r.Uint32()))
		}
	case 13: // value count and length agree, at another count
		if len(b) >= wire.HdrSize {
			n := int(pick(1, 2, 5, wire.MaxValues))
			b = append(b[:wire.HdrSize], make([]byte, 4*(n%(wire.MaxValues+1)))...)
			put16(wire.OffCount, uint32(n))
		}
	}
	if len(b) > maxDiffPayload {
		b = b[:maxDiffPayload]
	}
	return b
}

// TestWireParseMatchesSwitch runs seeded random mutations (one to three edits of a well-formed
// packet) through both parsers.
func TestWireParseMatchesSwitch(t *testing.T) {
	d := newWireDiff(t)
	r := rand.New(rand.NewPCG(9510, 1))
	seeds := diffSeeds()
	n := 3000
	if testing.Short() {
		n = 500
	}
	malformed := 0
	for i := range n {
		b := seeds[i%len(seeds)]
		if i >= len(seeds) {
			for range 1 + r.IntN(3) {
				b = mutate(r, b)
			}
		}
		if _, _, err := wire.ParsePacket(b); err != nil {
			malformed++
		}
		d.check(t, b)
	}
	// Both verdicts must have been exercised in earnest.
	if malformed < n/10 || malformed > n-n/10 {
		t.Fatalf("%d of %d packets malformed: the mutations are off balance", malformed, n)
	}
}

// FuzzWireParseVsSwitch: the fuzzer's bytes are the UDP payload.
func FuzzWireParseVsSwitch(f *testing.F) {
	r := rand.New(rand.NewPCG(1, 9510))
	for _, s := range diffSeeds() {
		f.Add(s)
		f.Add(mutate(r, s))
	}
	f.Add([]byte{})
	f.Add(make([]byte, wire.HdrSize))
	d := newWireDiff(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) > maxDiffPayload {
			b = b[:maxDiffPayload]
		}
		d.check(t, b)
	})
}
