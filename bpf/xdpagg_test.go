package bpf_test

// Table-driven BPF_PROG_TEST_RUN tests of xdpagg_switch and xdpagg_pass: input frame -> verdict,
// output frame and counter/slot deltas. xdpagg_egress is in egress_test.go, the randomized model
// test in model_test.go.

import (
	"encoding/binary"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
)

// Frame modifiers.
func setHdr(f func(h *bpf.XdpaggHdr)) func(*frame) { return func(fr *frame) { f(&fr.Hdr) } }
func flags(fl uint16) func(*frame) {
	return func(fr *frame) { fr.Hdr.Flags |= fl }
}

// asResult is what the switch makes of a completing DATA frame: a RESULT with the slot's bitmap,
// flags and sum, every other byte as it came in, and the UDP checksum zeroed (docs/protocol.md:
// "whenever the switch rewrites a packet it sets the UDP checksum to 0").
func asResult(in frame, bitmap uint32, fl uint16, vals []int32) frame {
	return in.with(func(f *frame) {
		f.Hdr.Type = msgResult
		f.Hdr.Flags = fl
		if in.Hdr.Flags&fLevel1 != 0 {
			f.Hdr.Bitmap1 = bitmap
		} else {
			f.Hdr.Bitmap0 = bitmap
		}
		f.Vals = append([]int32(nil), vals...)
		f.NoUDPCsum = true
	})
}

// asShadow is the unicast answer to in from a completed slot: a result with endpoints swapped.
func asShadow(in frame, bitmap uint32, fl uint16, vals []int32) frame {
	return asResult(in, bitmap, fl, vals).with(func(f *frame) {
		f.DstMAC, f.SrcMAC = in.SrcMAC, in.DstMAC
		f.DstIP, f.SrcIP = in.SrcIP, in.DstIP
		f.DstPort, f.SrcPort = in.SrcPort, aggPort
	})
}

// asToPS is a frame passed on to the PS: extra flags, UDP checksum zeroed.
func asToPS(in frame, fl uint16) frame {
	return in.with(func(f *frame) { f.Hdr.Flags |= fl; f.NoUDPCsum = true })
}

// expectFrame compares an output frame byte for byte with the frame it should be.
func expectFrame(t *testing.T, out []byte, want frame) {
	t.Helper()
	w := want.bytes()
	if string(out) == string(w) {
		if len(out) >= offUDP && !ipChecksumOK(out[offIP:offUDP]) {
			t.Errorf("output IPv4 header checksum is invalid")
		}
		return
	}
	first := 0
	for first < len(out) && first < len(w) && out[first] == w[first] {
		first++
	}
	t.Errorf("output frame differs from the expected one at byte %d (got %d bytes, want %d)", first, len(out), len(w))
	if len(out) >= offVals && len(w) >= offVals {
		g, e := decode(t, out), decode(t, w)
		t.Errorf("got:  eth %x<-%x ip %v<-%v udp %d<-%d csum %#x hdr %+v vals %v",
			g.dstMAC, g.srcMAC, g.dstIP, g.srcIP, g.dstPort, g.srcPort, g.udpCsum, g.hdr, g.vals)
		t.Errorf("want: eth %x<-%x ip %v<-%v udp %d<-%d csum %#x hdr %+v vals %v",
			e.dstMAC, e.srcMAC, e.dstIP, e.srcIP, e.dstPort, e.srcPort, e.udpCsum, e.hdr, e.vals)
	}
}

// ---- 1. non-aggregation traffic ----

func TestSwitchNonAggregation(t *testing.T) {
	udp := dataFrame(1, 1, 0, 0, 2, 1, 2, 3, 4)
	arp := []byte{
		0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02, 0, 0, 0, 1, 0, 0x08, 0x06, // eth
		0, 1, 0x08, 0x00, 6, 4, 0, 1, // htype, ptype, hlen, plen, op=request
		0x02, 0, 0, 0, 1, 0, 10, 0, 1, 10, // sender
		0, 0, 0, 0, 0, 0, 10, 0, 0, 1, // target
	}
	cases := []struct {
		name string
		in   frame
	}{
		{"ARP", frame{Raw: arp}},
		{"IPv6", udp.with(func(f *frame) { f.EtherType = 0x86dd })},
		{"ICMP", udp.with(func(f *frame) { f.Proto = 1; f.Payload = []byte{8, 0, 0, 0, 0, 1, 0, 1, 'p', 'i', 'n', 'g'} })},
		{"UDP to another port", udp.with(func(f *frame) { f.DstPort = 53 })},
		{"UDP from the agg port to another port", udp.with(func(f *frame) { f.SrcPort = aggPort; f.DstPort = aggPort + 1 })},
		// Fragments and options to the agg port are dropped (TestSwitchIPInvalid); a later
		// fragment shows no port, and to other ports both are the kernel's business.
		{"IPv4 later fragment (offset, MF) to the agg port", udp.with(func(f *frame) { f.FragOff = 0x2000 | 0x00b9 })},
		{"IPv4 last fragment (offset, no MF) to the agg port", udp.with(func(f *frame) { f.FragOff = 0x00b9 })},
		{"IPv4 later fragment with options", udp.with(func(f *frame) { f.FragOff = 0x0001; f.IHL = 7 })},
		{"IPv4 first fragment (MF) to another port", udp.with(func(f *frame) { f.FragOff = 0x2000; f.DstPort = 53 })},
		{"IPv4 with options to another port", udp.with(func(f *frame) { f.IHL = 6; f.DstPort = 53 })},
		{"IPv4 with 40 bytes of options to another port", udp.with(func(f *frame) { f.IHL = 15; f.DstPort = 53 })},
		{"bad IPv4 checksum to another port", udp.with(func(f *frame) { f.BadIPCsum = true; f.DstPort = 53 })},
		{"IPv4 header length below 5 to the agg port", udp.with(func(f *frame) { f.IHL = 4 })},
		{"IPv4 options longer than the frame", udp.with(func(f *frame) { f.IHL = 15; f.Truncate = offIP + 40 })},
		{"IP version 6 in an IPv4 ethertype", udp.with(func(f *frame) { f.IPVersion = 6 })},
		{"frame cut inside the IPv4 header", udp.with(func(f *frame) { f.Truncate = offIP + 10 })},
		{"frame cut inside the UDP header", udp.with(func(f *frame) { f.Truncate = offUDP + 4 })},
		{"bare Ethernet header", frame{Raw: udp.bytes()[:14]}},
	}
	s := load(t, 0)
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			in := c.in.bytes()
			got, out := runProg(t, s.Objects.XdpaggSwitch, in)
			if got != xdpPass {
				t.Errorf("verdict %s, want XDP_PASS", verdictName(got))
			}
			expectUnchangedBut(t, out, in)
			s.expectDelta(t, cnt{maps.CntNonAgg: 1})
			s.allSlotsFree(t)
		})
	}
}

// ---- 2. malformed aggregation traffic ----

func TestSwitchMalformed(t *testing.T) {
	base := dataFrame(1, 1, 0, 0, 2, 1, 2, 3, 4)
	realUDP := 8 + 32 + 16
	realIP := 20 + realUDP
	hdr := func(f func(h *bpf.XdpaggHdr)) frame { return base.with(setHdr(f)) }
	cases := []namedFrame{
		{"truncated header", base.with(func(f *frame) { f.Truncate = offHdr + 16 })},
		{"header present, values truncated", base.with(func(f *frame) { f.Truncate = offVals + 12 })},
		{"UDP length longer than the datagram", base.with(func(f *frame) { f.UDPLen = realUDP + 4 })},
		{"UDP length shorter than the datagram", base.with(func(f *frame) { f.UDPLen = realUDP - 4 })},
		{"UDP length shorter than its header", base.with(func(f *frame) { f.UDPLen = 4 })},
		{"UDP and IP lengths agree but exceed the frame", base.with(func(f *frame) { f.UDPLen = realUDP + 4; f.IPLen = realIP + 4 })},
		{"UDP and IP lengths agree but cut the values", base.with(func(f *frame) { f.UDPLen = realUDP - 4; f.IPLen = realIP - 4 })},
		{"UDP and IP lengths cover only the header", base.with(func(f *frame) { f.UDPLen = 8; f.IPLen = 28 })},
		{"IP total length longer than the frame", base.with(func(f *frame) { f.IPLen = realIP + 4 })},
		{"IP total length shorter than the datagram", base.with(func(f *frame) { f.IPLen = realIP - 4 })},
		{"version 0", hdr(func(h *bpf.XdpaggHdr) { h.Version = 0 })},
		{"version 2", hdr(func(h *bpf.XdpaggHdr) { h.Version = 2 })},
		{"reserved 1", hdr(func(h *bpf.XdpaggHdr) { h.Reserved = 1 })},
		{"reserved 0x80", hdr(func(h *bpf.XdpaggHdr) { h.Reserved = 0x80 })},
		{"count 0", base.with(func(f *frame) { f.Vals = nil; f.Hdr.Count = 0 })},
		{"count MaxValues+1", base.with(func(f *frame) {
			f.Vals = mkVals(bpf.MaxValues+1, func(i int) int32 { return 1 })
			f.Hdr.Count = uint16(bpf.MaxValues + 1)
		})},
		{"count larger than the values", hdr(func(h *bpf.XdpaggHdr) { h.Count = 5 })},
		{"count smaller than the values", hdr(func(h *bpf.XdpaggHdr) { h.Count = 3 })},
		{"agg_index == pool size", hdr(func(h *bpf.XdpaggHdr) { h.AggIndex = poolSize })},
		{"agg_index 0xffffffff", hdr(func(h *bpf.XdpaggHdr) { h.AggIndex = math.MaxUint32 })},
		{"job 0", hdr(func(h *bpf.XdpaggHdr) { h.JobId = 0 })},
		{"fan_in0 0", hdr(func(h *bpf.XdpaggHdr) { h.FanIn0 = 0 })},
		{"fan_in0 33", hdr(func(h *bpf.XdpaggHdr) { h.FanIn0 = 33 })},
		{"fan_in0 255", hdr(func(h *bpf.XdpaggHdr) { h.FanIn0 = 255 })},
		{"bitmap0 0", hdr(func(h *bpf.XdpaggHdr) { h.Bitmap0 = 0 })},
		{"bitmap0 bit == fan_in0", hdr(func(h *bpf.XdpaggHdr) { h.Bitmap0 = 1 << 2 })},
		{"bitmap0 bit 31 with fan_in0 2", hdr(func(h *bpf.XdpaggHdr) { h.Bitmap0 = 1<<31 | 1 })},
		{"level1 with fan_in1 0", hdr(func(h *bpf.XdpaggHdr) { h.Flags = fLevel1; h.Bitmap1 = 1 })},
		{"level1 with bitmap1 0", hdr(func(h *bpf.XdpaggHdr) { h.Flags = fLevel1; h.FanIn1 = 2 })},
		{"float32 with fan_in0 0", hdr(func(h *bpf.XdpaggHdr) { h.Encoding = encFloat32; h.FanIn0 = 0 })},
		{"type 0", hdr(func(h *bpf.XdpaggHdr) { h.Type = 0 })},
		{"type 9", hdr(func(h *bpf.XdpaggHdr) { h.Type = 9 })},
		{"type 99", hdr(func(h *bpf.XdpaggHdr) { h.Type = 99 })},
		{"encoding 3", hdr(func(h *bpf.XdpaggHdr) { h.Encoding = 3 })},
		{"encoding 7", hdr(func(h *bpf.XdpaggHdr) { h.Encoding = 7 })},
		{"result with count 0", resultFrame(1, 1, 0, 2).with(func(f *frame) { f.Hdr.Count = 0 })},
		{"result with job 0", resultFrame(0, 1, 0, 2, 5, 6)},
		{"result with agg_index == pool size", resultFrame(1, 1, poolSize, 2, 5, 6)},
		{"result with encoding 7", resultFrame(1, 1, 0, 2, 5, 6).with(setHdr(func(h *bpf.XdpaggHdr) { h.Encoding = 7 }))},
		// Reserved encodings and message types: nothing handles them yet.
		{"ENC_SPARSE_KV data", hdr(func(h *bpf.XdpaggHdr) { h.Encoding = encSparseKV })},
		{"ENC_SPARSE_KV data with F_RESEND", hdr(func(h *bpf.XdpaggHdr) { h.Encoding = encSparseKV; h.Flags = fResend })},
		{"ENC_SPARSE_KV result", resultFrame(1, 1, 0, 2, 5, 6).with(setHdr(func(h *bpf.XdpaggHdr) { h.Encoding = encSparseKV }))},
		{"type 200 (unknown)", hdr(func(h *bpf.XdpaggHdr) { h.Type = 200 })},
		{"type 200 (unknown)", hdr(func(h *bpf.XdpaggHdr) { h.Type = 200 })},
		{"type 200 without values", base.with(func(f *frame) { f.Hdr.Type = 200; f.Hdr.Count = 0; f.Vals = nil })},
		{"type 200 without values", base.with(func(f *frame) { f.Hdr.Type = 200; f.Hdr.Count = 0; f.Vals = nil })},
		// Bytes after the IPv4 total length: an xdpagg frame is longer than Ethernet's minimum,
		// so it never carries link padding.
		{"1 trailing byte", base.with(func(f *frame) { f.Pad = 1 })},
		{"6 trailing bytes", base.with(func(f *frame) { f.Pad = 6 })},
		{"a whole value of trailing bytes", base.with(func(f *frame) { f.Pad = 4 })},
		{"trailing bytes after a result", resultFrame(1, 1, 0, 2, 5, 6).with(func(f *frame) { f.Pad = 2 })},
		{"trailing bytes after a control message", base.with(func(f *frame) {
			f.Hdr.Type = uint8(bpf.XdpaggMsgTypeMSG_JOIN)
			f.Hdr.Count = 0
			f.Vals = nil
			f.Pad = 3
		})},
		{"lengths agree, one byte short of the frame", base.with(func(f *frame) { f.UDPLen = realUDP - 1; f.IPLen = realIP - 1 })},
	}
	expectDropped(t, load(t, 0), cases, maps.CntMalformed)
}

// namedFrame is one case of a table of frames.
type namedFrame struct {
	name string
	in   frame
}

// expectDropped runs every case through s and checks that each is dropped, counted in rx and in
// verdict, and touches no slot.
func expectDropped(t *testing.T, s *sw, cases []namedFrame, verdict maps.Counter) {
	t.Helper()
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, _ := s.run(t, c.in)
			if got != xdpDrop {
				t.Errorf("verdict %s, want XDP_DROP", verdictName(got))
			}
			s.expectDelta(t, cnt{maps.CntRx: 1, verdict: 1})
			s.allSlotsFree(t)
		})
	}
}

// ---- 13. control messages ----

// Control messages (JOIN, LEAVE, ACK, RETRANSMIT) within their port's budget go up to the agent
// untouched (every type from JOIN to HALT but the sparse read-out).
func TestSwitchControl(t *testing.T) {
	s := load(t, 0)
	for typ := uint8(bpf.XdpaggMsgTypeMSG_JOIN); typ <= uint8(bpf.XdpaggMsgTypeMSG_FBCAST); typ++ {
		if typ == uint8(bpf.XdpaggMsgTypeMSG_PULL) {
			continue // a sparse read-out, not a control message
		}
		for _, body := range [][]int32{nil, {7, 8}} {
			in := controlFrame(typ, body...)
			t.Run(fmt.Sprintf("type %d with %d values", typ, len(body)), func(t *testing.T) {
				b := in.bytes()
				got, out := runProg(t, s.Objects.XdpaggSwitch, b)
				if got != xdpPass {
					t.Errorf("type %d: verdict %s, want XDP_PASS", typ, verdictName(got))
				}
				expectUnchangedBut(t, out, b)
				s.expectDelta(t, cnt{maps.CntRx: 1, maps.CntControl: 1})
				s.allSlotsFree(t)
			})
		}
	}
}

// controlFrame is a control message of type typ from worker 0 to the switch's own address.
func controlFrame(typ uint8, body ...int32) frame {
	return dataFrame(1, 0, 0, 0, 1).with(func(f *frame) {
		f.DstIP = [4]byte{10, 0, 1, 1} // the switch's own address
		f.Hdr.Type = typ
		f.Hdr.Count = 0
		f.Hdr.AggIndex = 1 << 20 // not checked for control messages
		f.Vals = body
	})
}

// ---- 16. xdpagg_pass ----

func TestPass(t *testing.T) {
	s := load(t, 0)
	for _, in := range []frame{
		dataFrame(1, 1, 0, 0, 1, 1, 2, 3),
		resultFrame(1, 1, 0, 2, 1),
		dataFrame(1, 1, 0, 0, 1, 1).with(func(f *frame) { f.Proto = 1 }),
		{Raw: make([]byte, 14)},
	} {
		b := in.bytes()
		got, out := runProg(t, s.Objects.XdpaggPass, b)
		if got != xdpPass {
			t.Errorf("xdpagg_pass verdict %s, want XDP_PASS", verdictName(got))
		}
		expectUnchangedBut(t, out, b)
	}
	s.expectDelta(t, cnt{})
	s.allSlotsFree(t)
}

// ---- 3..12, 14: scenarios, a fresh switch each, steps in order ----

// step sends one frame (after `before`) and checks the verdict, the output frame (when want is
// set), the counter deltas and (when slot is set) one slot.
type step struct {
	name    string
	before  func()
	setup   func(t *testing.T) // like before, for what may fail
	in      frame
	verdict uint32
	want    *frame // expected output frame, byte for byte
	delta   cnt
	idx     uint32    // slot to check
	slot    *slotView // expected slot fields; nil: not checked
	vals    []int32   // expected slot values (rest zero)
	check   func(t *testing.T, s *sw, out []byte)
}

func ptr[T any](v T) *T { return &v }

type scenario struct {
	name    string
	timeout time.Duration
	steps   []step
}

func runScenarios(t *testing.T, scenarios []scenario) {
	for _, sc := range scenarios {
		t.Run(sc.name, func(t *testing.T) { runSteps(t, load(t, sc.timeout), sc.steps) })
	}
}

// runSteps runs steps on s in order, each a subtest; a failed step ends the run.
func runSteps(t *testing.T, s *sw, steps []step) {
	t.Helper()
	for i, st := range steps {
		ok := t.Run(st.name, func(t *testing.T) {
			if st.before != nil {
				st.before()
			}
			if st.setup != nil {
				st.setup(t)
			}
			out := s.runExpect(t, st.in, st.verdict)
			if st.want != nil {
				expectFrame(t, out, *st.want)
			}
			s.expectDelta(t, st.delta)
			if st.slot != nil {
				expectSlot(t, s.slot(t, st.idx), *st.slot, st.vals)
			}
			if st.check != nil {
				st.check(t, s, out)
			}
		})
		if !ok {
			t.Fatalf("step %d (%s) failed; later steps depend on it", i, st.name)
		}
	}
}

func TestSwitchScenarios(t *testing.T) {
	const (
		rx   = maps.CntRx
		agg  = maps.CntAggregated
		done = maps.CntCompleted
		dup  = maps.CntDuplicate
		coll = maps.CntCollision
		ovf  = maps.CntOverflow
		tops = maps.CntToPS
		bad  = maps.CntMalformed
		psr  = maps.CntPSResult
		shad = maps.CntShadowTx
		recl = maps.CntReclaimed
		nmem = maps.CntNotMember
		flsh = maps.CntFlushed
	)
	aggregating := func(job, seq, bitmap uint32, counter, fan uint8, nvals int, fl uint16) *slotView {
		return &slotView{State: slotAggregating, Counter: counter, FanIn: fan, Scale: 24, Job: job, Seq: seq,
			Bitmap: bitmap, Nvals: uint16(nvals), Flags: fl}
	}
	complete := func(job, seq, bitmap uint32, counter, fan uint8, nvals int, fl uint16) *slotView {
		v := aggregating(job, seq, bitmap, counter, fan, nvals, fl)
		v.State = slotComplete
		return v
	}
	sleep := func() { time.Sleep(5 * time.Millisecond) }

	// 3, 4: fan-in 2, duplicate, completion, shadow copy.
	w0 := dataFrame(7, 100, 3, 0, 2, 1, 2, 3, -4)
	w1 := dataFrame(7, 100, 3, 1, 2, 10, 20, 30, 40)
	s01 := sum(w0.Vals, w1.Vals)
	w1resend := w1.with(flags(fResend), func(f *frame) { f.Vals = []int32{99, 99, 99, 99} })
	w0late := w0.with(func(f *frame) { f.Vals = []int32{-1, -1, -1, -1} })

	// 6: collision.
	c1 := dataFrame(1, 5, 2, 0, 2, 11, 12)
	c2 := dataFrame(2, 5, 2, 0, 2, 21, 22)
	c1next := dataFrame(1, 6, 2, 1, 2, 31, 32)
	c1prev := dataFrame(1, 4, 2, 1, 2, 41, 42)

	// 7, 11: same job retakes its completed slot; partial last fragment.
	full := dataFrame(1, 1, 0, 0, 1, mkVals(bpf.MaxValues, func(i int) int32 { return int32(i + 1) })...)
	part0 := dataFrame(1, 2, 0, 0, 2, mkVals(7, func(i int) int32 { return int32(-100 * i) })...)
	part1 := dataFrame(1, 2, 0, 1, 2, mkVals(7, func(i int) int32 { return int32(1000 + i) })...)

	// 10: overflow.
	o0 := dataFrame(9, 1, 1, 0, 2, math.MaxInt32-10, math.MinInt32+10, 5, math.MaxInt32, math.MinInt32, -7)
	o1 := dataFrame(9, 1, 1, 1, 2, 100, -100, -5, 1, math.MinInt32, 3)
	oSum := sum(o0.Vals, o1.Vals) // wrapped where it overflowed: the flag marks the sum invalid

	// 12: results from the PS.
	p0 := dataFrame(3, 9, 5, 0, 2, 4, 5)
	p1 := dataFrame(3, 9, 5, 1, 2, 6, 7)

	scenarios := []scenario{
		{name: "fan-in 2: aggregate, duplicate, complete, shadow", steps: []step{
			{name: "worker 0 reserves", in: w0, verdict: xdpDrop, delta: cnt{rx: 1, agg: 1},
				idx: 3, slot: aggregating(7, 100, 1, 1, 2, 4, 0), vals: w0.Vals},
			{name: "worker 0 duplicate", in: w0, verdict: xdpDrop, delta: cnt{rx: 1, dup: 1},
				idx: 3, slot: aggregating(7, 100, 1, 1, 2, 4, 0), vals: w0.Vals},
			{name: "worker 1 with another count", in: w1.with(func(f *frame) { f.Vals = f.Vals[:3]; f.Hdr.Count = 3 }),
				verdict: xdpDrop, delta: cnt{rx: 1, bad: 1}, idx: 3, slot: aggregating(7, 100, 1, 1, 2, 4, 0), vals: w0.Vals},
			{name: "worker 1 with another fan-in", in: w1.with(setHdr(func(h *bpf.XdpaggHdr) { h.FanIn0 = 3 })),
				verdict: xdpDrop, delta: cnt{rx: 1, bad: 1}, idx: 3, slot: aggregating(7, 100, 1, 1, 2, 4, 0), vals: w0.Vals},
			{name: "worker 1 completes", in: w1, verdict: xdpRedirect, want: ptr(asResult(w1, 3, fFromSwitch, s01)),
				delta: cnt{rx: 1, agg: 1, done: 1}, idx: 3, slot: complete(7, 100, 3, 2, 2, 4, 0), vals: s01},
			{name: "worker 1 resend gets the shadow copy", in: w1resend, verdict: xdpTX,
				want:  ptr(asShadow(w1resend, 3, fFromSwitch|fShadow, s01)),
				delta: cnt{rx: 1, shad: 1}, idx: 3, slot: complete(7, 100, 3, 2, 2, 4, 0), vals: s01,
				check: func(t *testing.T, s *sw, out []byte) {
					d := decode(t, out)
					if d.dstPort != workerPort(1) || d.srcPort != aggPort || d.udpCsum != 0 {
						t.Errorf("shadow UDP %d -> %d csum %#x", d.srcPort, d.dstPort, d.udpCsum)
					}
					if d.dstIP != workerIP(1) || d.srcIP != psIP || d.dstMAC != workerMAC(1) || d.srcMAC != switchMAC {
						t.Errorf("shadow addresses %v/%x -> %v/%x", d.srcIP, d.srcMAC, d.dstIP, d.dstMAC)
					}
				}},
			{name: "worker 0 late non-resend also gets the shadow copy", in: w0late, verdict: xdpTX,
				want:  ptr(asShadow(w0late, 3, fFromSwitch|fShadow, s01)),
				delta: cnt{rx: 1, shad: 1}, idx: 3, slot: complete(7, 100, 3, 2, 2, 4, 0), vals: s01},
			{name: "resend with another count on the completed slot", in: w1resend.with(func(f *frame) { f.Vals = f.Vals[:2]; f.Hdr.Count = 2 }),
				verdict: xdpDrop, delta: cnt{rx: 1, bad: 1}, idx: 3, slot: complete(7, 100, 3, 2, 2, 4, 0), vals: s01},
		}},
		{name: "ECN is OR-ed into the slot, also by duplicates", steps: []step{
			{name: "worker 0", in: w0, verdict: xdpDrop, delta: cnt{rx: 1, agg: 1}, idx: 3, slot: aggregating(7, 100, 1, 1, 2, 4, 0), vals: w0.Vals},
			{name: "worker 0 duplicate with ECN", in: w0.with(flags(fECN)), verdict: xdpDrop, delta: cnt{rx: 1, dup: 1},
				idx: 3, slot: aggregating(7, 100, 1, 1, 2, 4, fECN), vals: w0.Vals},
			{name: "worker 1 completes with ECN", in: w1, verdict: xdpRedirect, want: ptr(asResult(w1, 3, fFromSwitch|fECN, s01)),
				delta: cnt{rx: 1, agg: 1, done: 1}, idx: 3, slot: complete(7, 100, 3, 2, 2, 4, fECN), vals: s01},
		}},
		{name: "fan-in 1 completes at once", steps: []step{
			{name: "only worker", in: dataFrame(5, 1, 0, 0, 1, 1, -2, 3), verdict: xdpRedirect,
				want:  ptr(asResult(dataFrame(5, 1, 0, 0, 1, 1, -2, 3), 1, fFromSwitch, []int32{1, -2, 3})),
				delta: cnt{rx: 1, agg: 1, done: 1}, idx: 0, slot: complete(5, 1, 1, 1, 1, 3, 0), vals: []int32{1, -2, 3}},
			{name: "stray F_SHADOW and F_FROM_SWITCH in data are not copied", in: dataFrame(5, 2, 1, 0, 1, 9).with(flags(fShadow | fFromSwitch)),
				verdict: xdpRedirect, want: ptr(asResult(dataFrame(5, 2, 1, 0, 1, 9).with(flags(fShadow|fFromSwitch)), 1, fFromSwitch, []int32{9})),
				delta: cnt{rx: 1, agg: 1, done: 1}, idx: 1, slot: complete(5, 2, 1, 1, 1, 1, 0), vals: []int32{9}},
		}},
		{name: "level 1: bitmap1 and fan_in1", steps: func() []step {
			l0 := dataFrame(4, 1, 6, 0, 8, 5, 5).with(flags(fLevel1), setHdr(func(h *bpf.XdpaggHdr) { h.Bitmap0 = 0xff; h.FanIn1 = 2; h.Bitmap1 = 1 }))
			// The second edge switch joined as member 1 (its bit in bitmap1).
			l1 := dataFrame(4, 1, 6, 1, 8, 1, 2).with(flags(fLevel1), setHdr(func(h *bpf.XdpaggHdr) { h.Bitmap0 = 0xff; h.FanIn1 = 2; h.Bitmap1 = 2 }))
			return []step{
				{name: "first edge switch", in: l0, verdict: xdpDrop, delta: cnt{rx: 1, agg: 1}, idx: 6, slot: aggregating(4, 1, 1, 1, 2, 2, 0), vals: l0.Vals},
				{name: "second edge switch", in: l1, verdict: xdpRedirect, want: ptr(asResult(l1, 3, fLevel1|fFromSwitch, []int32{6, 7})),
					delta: cnt{rx: 1, agg: 1, done: 1}, idx: 6, slot: complete(4, 1, 3, 2, 2, 2, 0), vals: []int32{6, 7}},
			}
		}()},
		{name: "membership: foreign bits, spoofed ids and outsiders are dropped, never summed", steps: func() []step {
			ok := dataFrame(8, 1, 2, 0, 3, 5, 6)
			foreign := ok.with(setHdr(func(h *bpf.XdpaggHdr) { h.Bitmap0 = 0b011 })) // worker 0 claims worker 1's bit too
			idSpoof := dataFrame(8, 1, 2, 1, 3, 7, 7).with(func(f *frame) { f.SrcIP = workerIP(0); f.SrcPort = workerPort(0) })
			ipSpoof := dataFrame(8, 1, 2, 2, 3, 1, 1).with(func(f *frame) { f.SrcIP = [4]byte{10, 0, 1, 200} })
			portSpoof := dataFrame(8, 1, 2, 2, 3, 1, 1).with(func(f *frame) { f.SrcPort = 1234 })
			outsider := dataFrame(unenrolledJob, 1, 2, 0, 3, 1, 1)
			otherPort := dataFrame(otherPortJob, 1, 2, 0, 3, 1, 1)
			notPS := resultFrame(8, 1, 2, 3, 9, 9).with(func(f *frame) { f.SrcIP = workerIP(1) })
			outsiderResult := resultFrame(unenrolledJob, 1, 2, 3, 9, 9)
			floatSpoof := foreign.with(func(f *frame) { f.Hdr.Encoding = encFloat32 })
			drop := func(name string, in frame) step {
				return step{name: name, in: in, verdict: xdpDrop, delta: cnt{rx: 1, nmem: 1}, idx: 2, slot: &slotView{}}
			}
			return []step{
				drop("worker 0 with worker 1's bit", foreign),
				drop("worker 0 claiming worker 1's id", idSpoof),
				drop("worker 2 from another address", ipSpoof),
				drop("worker 2 from another UDP port", portSpoof),
				drop("a job nobody joined", outsider),
				drop("a member behind another switch port", otherPort),
				drop("float32 data with foreign bits (would reach the PS)", floatSpoof),
				drop("a RESULT not from the job's PS", notPS),
				drop("a RESULT for a job nobody joined", outsiderResult),
				{name: "the real worker 0 is summed", in: ok, verdict: xdpDrop, delta: cnt{rx: 1, agg: 1},
					idx: 2, slot: aggregating(8, 1, 1, 1, 3, 2, 0), vals: ok.Vals},
				{name: "a spoofed RESULT does not free the slot", in: notPS, verdict: xdpDrop, delta: cnt{rx: 1, nmem: 1},
					idx: 2, slot: aggregating(8, 1, 1, 1, 3, 2, 0), vals: ok.Vals},
			}
		}()},
		{name: "resend on a half-filled slot flushes its partial aggregate to the PS (ATP)", steps: func() []step {
			r0 := dataFrame(9, 4, 1, 0, 3, 5, 6)
			r1 := dataFrame(9, 4, 1, 1, 3, 10, 20).with(flags(fResend))
			flushed := asToPS(r1.with(setHdr(func(h *bpf.XdpaggHdr) { h.Bitmap0 = 0b011 }), func(f *frame) { f.Vals = []int32{15, 26} }), 0)
			r0again := r0.with(flags(fResend))
			return []step{
				{name: "worker 0 reserves", in: r0, verdict: xdpDrop, delta: cnt{rx: 1, agg: 1}, idx: 1, slot: aggregating(9, 4, 1, 1, 3, 2, 0), vals: r0.Vals},
				{name: "worker 1's resend is merged, flushed and frees the slot", in: r1, verdict: xdpPass, want: &flushed,
					delta: cnt{rx: 1, tops: 1, flsh: 1}, idx: 1, slot: &slotView{State: slotFree, Counter: 2, FanIn: 3, Scale: 24, Job: 9, Seq: 4, Bitmap: 0b011, Nvals: 2},
					vals: []int32{15, 26}}, // a free slot's values are stale, never read
				{name: "the next resend finds no slot and goes to the PS", in: r0again, verdict: xdpPass, want: ptr(asToPS(r0again, 0)),
					delta: cnt{rx: 1, tops: 1}},
				{name: "worker 0 reserves again", in: r0, verdict: xdpDrop, delta: cnt{rx: 1, agg: 1}, idx: 1, slot: aggregating(9, 4, 1, 1, 3, 2, 0), vals: r0.Vals},
				{name: "worker 0's own resend flushes its partial sum", in: r0again, verdict: xdpPass, want: ptr(asToPS(r0again, 0)),
					delta: cnt{rx: 1, tops: 1, flsh: 1}, idx: 1, slot: &slotView{State: slotFree, Counter: 1, FanIn: 3, Scale: 24, Job: 9, Seq: 4, Bitmap: 1, Nvals: 2},
					vals: r0.Vals},
			}
		}()},
		{name: "a resend that completes the sum completes it in the switch", steps: func() []step {
			c0 := dataFrame(9, 7, 3, 0, 2, 1, 2)
			c1 := dataFrame(9, 7, 3, 1, 2, 3, 4).with(flags(fResend))
			return []step{
				{name: "worker 0 reserves", in: c0, verdict: xdpDrop, delta: cnt{rx: 1, agg: 1}},
				{name: "worker 1's resend completes", in: c1, verdict: xdpRedirect, want: ptr(asResult(c1, 3, fFromSwitch, []int32{4, 6})),
					delta: cnt{rx: 1, agg: 1, done: 1}, idx: 3, slot: complete(9, 7, 3, 2, 2, 2, 0), vals: []int32{4, 6}},
			}
		}()},
		{name: "a job's later fragment takes over its own older half-filled slot", steps: []step{
			{name: "job 1 seq 5 reserves", in: c1, verdict: xdpDrop, delta: cnt{rx: 1, agg: 1}, idx: 2, slot: aggregating(1, 5, 1, 1, 2, 2, 0), vals: c1.Vals},
			{name: "job 1 seq 6 takes it (seq 5 is stale: a delayed packet, or already done at the PS)", in: c1next, verdict: xdpDrop,
				delta: cnt{rx: 1, agg: 1, recl: 1}, idx: 2, slot: aggregating(1, 6, 2, 1, 2, 2, 0), vals: c1next.Vals},
		}},
		{name: "collision: slot held by another job or seq", steps: []step{
			{name: "job 1 seq 5 reserves", in: c1, verdict: xdpDrop, delta: cnt{rx: 1, agg: 1}, idx: 2, slot: aggregating(1, 5, 1, 1, 2, 2, 0), vals: c1.Vals},
			{name: "job 2 seq 5", in: c2, verdict: xdpPass, want: ptr(asToPS(c2, fCollision)),
				delta: cnt{rx: 1, coll: 1, tops: 1}, idx: 2, slot: aggregating(1, 5, 1, 1, 2, 2, 0), vals: c1.Vals},
			{name: "job 1 seq 4", in: c1prev, verdict: xdpPass, want: ptr(asToPS(c1prev, fCollision)),
				delta: cnt{rx: 1, coll: 1, tops: 1}, idx: 2, slot: aggregating(1, 5, 1, 1, 2, 2, 0), vals: c1.Vals},
			{name: "resend of job 2 goes to the PS without F_COLLISION", in: c2.with(flags(fResend)), verdict: xdpPass,
				want: ptr(asToPS(c2.with(flags(fResend)), 0)), delta: cnt{rx: 1, tops: 1}, idx: 2, slot: aggregating(1, 5, 1, 1, 2, 2, 0), vals: c1.Vals},
			{name: "job 1 seq 5 worker 1 still completes", in: dataFrame(1, 5, 2, 1, 2, 1, 1), verdict: xdpRedirect,
				want:  ptr(asResult(dataFrame(1, 5, 2, 1, 2, 1, 1), 3, fFromSwitch, []int32{12, 13})),
				delta: cnt{rx: 1, agg: 1, done: 1}, idx: 2, slot: complete(1, 5, 3, 2, 2, 2, 0), vals: []int32{12, 13}},
			{name: "job 2 on the young completed slot of job 1", in: c2, verdict: xdpPass, want: ptr(asToPS(c2, fCollision)),
				delta: cnt{rx: 1, coll: 1, tops: 1}, idx: 2, slot: complete(1, 5, 3, 2, 2, 2, 0), vals: []int32{12, 13}},
			{name: "job 1 seq 4 on its own younger completed slot", in: c1prev, verdict: xdpPass, want: ptr(asToPS(c1prev, fCollision)),
				delta: cnt{rx: 1, coll: 1, tops: 1}, idx: 2, slot: complete(1, 5, 3, 2, 2, 2, 0), vals: []int32{12, 13}},
		}},
		{name: "same job later seq retakes its completed slot; partial last fragment", steps: []step{
			{name: "job 1 seq 1, MaxValues values, fan-in 1", in: full, verdict: xdpRedirect, want: ptr(asResult(full, 1, fFromSwitch, full.Vals)),
				delta: cnt{rx: 1, agg: 1, done: 1}, idx: 0, slot: complete(1, 1, 1, 1, 1, bpf.MaxValues, 0), vals: full.Vals},
			{name: "job 1 seq 2, 7 values, reserves afresh", in: part0, verdict: xdpDrop, delta: cnt{rx: 1, agg: 1},
				idx: 0, slot: aggregating(1, 2, 1, 1, 2, 7, 0), vals: part0.Vals},
			{name: "job 1 seq 2 worker 1 completes, same length out", in: part1, verdict: xdpRedirect,
				want:  ptr(asResult(part1, 3, fFromSwitch, sum(part0.Vals, part1.Vals))),
				delta: cnt{rx: 1, agg: 1, done: 1}, idx: 0, slot: complete(1, 2, 3, 2, 2, 7, 0), vals: sum(part0.Vals, part1.Vals),
				check: func(t *testing.T, s *sw, out []byte) {
					if len(out) != len(part1.bytes()) {
						t.Errorf("output %d bytes, input %d", len(out), len(part1.bytes()))
					}
				}},
			{name: "job 1 seq 1 resend after the slot moved on goes to the PS", in: full.with(flags(fResend)), verdict: xdpPass,
				want: ptr(asToPS(full.with(flags(fResend)), 0)), delta: cnt{rx: 1, tops: 1}, idx: 0, slot: complete(1, 2, 3, 2, 2, 7, 0),
				vals: sum(part0.Vals, part1.Vals)},
		}},
		{name: "seq comparison wraps around", steps: []step{
			{name: "job 1 seq 0xfffffffe", in: dataFrame(1, 0xfffffffe, 4, 0, 1, 5), verdict: xdpRedirect,
				delta: cnt{rx: 1, agg: 1, done: 1}, idx: 4, slot: complete(1, 0xfffffffe, 1, 1, 1, 1, 0), vals: []int32{5}},
			{name: "job 1 seq 1 is after it", in: dataFrame(1, 1, 4, 0, 2, 6), verdict: xdpDrop,
				delta: cnt{rx: 1, agg: 1}, idx: 4, slot: aggregating(1, 1, 1, 1, 2, 1, 0), vals: []int32{6}},
		}},
		{name: "resend without a matching slot", steps: []step{
			{name: "resend to a free slot", in: w0.with(flags(fResend)), verdict: xdpPass, want: ptr(asToPS(w0.with(flags(fResend)), 0)),
				delta: cnt{rx: 1, tops: 1}, idx: 3, slot: &slotView{}},
			{name: "worker 1 reserves", in: w1, verdict: xdpDrop, delta: cnt{rx: 1, agg: 1}, idx: 3, slot: aggregating(7, 100, 2, 1, 2, 4, 0), vals: w1.Vals},
			{name: "worker 0 resend to the aggregating slot is summed", in: w0.with(flags(fResend)), verdict: xdpRedirect,
				want:  ptr(asResult(w0.with(flags(fResend)), 3, fFromSwitch, s01)),
				delta: cnt{rx: 1, agg: 1, done: 1}, idx: 3, slot: complete(7, 100, 3, 2, 2, 4, 0), vals: s01},
		}},
		{name: "float32 data goes to the PS untouched, sparse is malformed", steps: []step{
			{name: "ENC_FLOAT32", in: w0.with(setHdr(func(h *bpf.XdpaggHdr) { h.Encoding = encFloat32 })), verdict: xdpPass,
				want:  ptr(asToPS(w0.with(setHdr(func(h *bpf.XdpaggHdr) { h.Encoding = encFloat32 })), 0)),
				delta: cnt{rx: 1, tops: 1}, idx: 3, slot: &slotView{}},
			{name: "ENC_FLOAT32 repair with F_OVERFLOW", in: w0.with(flags(fOverflow), setHdr(func(h *bpf.XdpaggHdr) { h.Encoding = encFloat32 })), verdict: xdpPass,
				want:  ptr(asToPS(w0.with(flags(fOverflow), setHdr(func(h *bpf.XdpaggHdr) { h.Encoding = encFloat32 })), 0)),
				delta: cnt{rx: 1, tops: 1}, idx: 3, slot: &slotView{}},
			{name: "ENC_SPARSE_KV is reserved: malformed", in: w0.with(setHdr(func(h *bpf.XdpaggHdr) { h.Encoding = encSparseKV })), verdict: xdpDrop,
				delta: cnt{rx: 1, bad: 1}, idx: 3, slot: &slotView{}},
			{name: "fixed32 already diverted upstream (F_COLLISION)", in: w0.with(flags(fCollision)), verdict: xdpPass,
				want: ptr(asToPS(w0.with(flags(fCollision)), 0)), delta: cnt{rx: 1, tops: 1}, idx: 3, slot: &slotView{}},
			{name: "float32 sent without UDP checksum", in: w0.with(func(f *frame) { f.Hdr.Encoding = encFloat32; f.NoUDPCsum = true }), verdict: xdpPass,
				want: ptr(w0.with(func(f *frame) { f.Hdr.Encoding = encFloat32; f.NoUDPCsum = true })), delta: cnt{rx: 1, tops: 1}, idx: 3, slot: &slotView{}},
		}},
		{name: "overflow wraps and is flagged", steps: []step{
			{name: "worker 0", in: o0, verdict: xdpDrop, delta: cnt{rx: 1, agg: 1}, idx: 1, slot: aggregating(9, 1, 1, 1, 2, 6, 0), vals: o0.Vals},
			{name: "worker 1 completes, overflowed", in: o1, verdict: xdpRedirect, want: ptr(asResult(o1, 3, fFromSwitch|fOverflow, oSum)),
				delta: cnt{rx: 1, agg: 1, done: 1, ovf: 1}, idx: 1, slot: complete(9, 1, 3, 2, 2, 6, fOverflow), vals: oSum},
			{name: "shadow copy keeps F_OVERFLOW", in: o1.with(flags(fResend)), verdict: xdpTX,
				want:  ptr(asShadow(o1.with(flags(fResend)), 3, fFromSwitch|fShadow|fOverflow, oSum)),
				delta: cnt{rx: 1, shad: 1}, idx: 1, slot: complete(9, 1, 3, 2, 2, 6, fOverflow), vals: oSum},
		}},
		{name: "sums that reach the limits exactly do not overflow", steps: []step{
			{name: "worker 0", in: dataFrame(9, 1, 1, 0, 2, math.MaxInt32-10, math.MinInt32+10, -1), verdict: xdpDrop, delta: cnt{rx: 1, agg: 1}},
			{name: "worker 1", in: dataFrame(9, 1, 1, 1, 2, 10, -10, 0), verdict: xdpRedirect,
				want:  ptr(asResult(dataFrame(9, 1, 1, 1, 2, 10, -10, 0), 3, fFromSwitch, []int32{math.MaxInt32, math.MinInt32, -1})),
				delta: cnt{rx: 1, agg: 1, done: 1}, idx: 1, slot: complete(9, 1, 3, 2, 2, 3, 0), vals: []int32{math.MaxInt32, math.MinInt32, -1}},
		}},
		{name: "a worker's F_OVERFLOW reaches the result", steps: []step{
			{name: "worker 0 clamped", in: dataFrame(9, 1, 1, 0, 2, math.MaxInt32).with(flags(fOverflow)), verdict: xdpDrop,
				delta: cnt{rx: 1, agg: 1}, idx: 1, slot: aggregating(9, 1, 1, 1, 2, 1, fOverflow), vals: []int32{math.MaxInt32}},
			{name: "worker 1", in: dataFrame(9, 1, 1, 1, 2, -1), verdict: xdpRedirect,
				want:  ptr(asResult(dataFrame(9, 1, 1, 1, 2, -1), 3, fFromSwitch|fOverflow, []int32{math.MaxInt32 - 1})),
				delta: cnt{rx: 1, agg: 1, done: 1, ovf: 1}},
		}},
		{name: "results from the PS", steps: []step{
			{name: "worker 0 reserves", in: p0, verdict: xdpDrop, delta: cnt{rx: 1, agg: 1}, idx: 5, slot: aggregating(3, 9, 1, 1, 2, 2, 0), vals: p0.Vals},
			{name: "result for another seq leaves the slot", in: resultFrame(3, 10, 5, 2, 1, 1), verdict: xdpRedirect,
				want: ptr(resultFrame(3, 10, 5, 2, 1, 1)), delta: cnt{rx: 1, psr: 1}, idx: 5, slot: aggregating(3, 9, 1, 1, 2, 2, 0), vals: p0.Vals},
			{name: "result for another job leaves the slot", in: resultFrame(4, 9, 5, 2, 1, 1), verdict: xdpRedirect,
				want: ptr(resultFrame(4, 9, 5, 2, 1, 1)), delta: cnt{rx: 1, psr: 1}, idx: 5, slot: aggregating(3, 9, 1, 1, 2, 2, 0), vals: p0.Vals},
			{name: "result for <3,9> frees the slot", in: resultFrame(3, 9, 5, 2, 10, 12), verdict: xdpRedirect,
				want: ptr(resultFrame(3, 9, 5, 2, 10, 12)), delta: cnt{rx: 1, psr: 1},
				idx: 5, slot: &slotView{State: slotFree, Counter: 1, FanIn: 2, Scale: 24, Job: 3, Seq: 9, Bitmap: 1, Nvals: 2}, vals: p0.Vals},
			{name: "worker 1 then reserves afresh", in: p1, verdict: xdpDrop, delta: cnt{rx: 1, agg: 1},
				idx: 5, slot: aggregating(3, 9, 2, 1, 2, 2, 0), vals: p1.Vals},
			{name: "worker 0 completes", in: p0, verdict: xdpRedirect, want: ptr(asResult(p0, 3, fFromSwitch, []int32{10, 12})),
				delta: cnt{rx: 1, agg: 1, done: 1}, idx: 5, slot: complete(3, 9, 3, 2, 2, 2, 0), vals: []int32{10, 12}},
			{name: "result for the completed <3,9> leaves the slot", in: resultFrame(3, 9, 5, 2, 10, 12), verdict: xdpRedirect,
				want: ptr(resultFrame(3, 9, 5, 2, 10, 12)), delta: cnt{rx: 1, psr: 1}, idx: 5, slot: complete(3, 9, 3, 2, 2, 2, 0), vals: []int32{10, 12}},
			{name: "result for a free slot", in: resultFrame(3, 1, 0, 1, 1), verdict: xdpRedirect,
				want: ptr(resultFrame(3, 1, 0, 1, 1)), delta: cnt{rx: 1, psr: 1}, idx: 0, slot: &slotView{}},
		}},
		{name: "reclaim: old completed slot is taken by another job", timeout: time.Millisecond, steps: []step{
			{name: "job 1 completes", in: dataFrame(1, 1, 0, 0, 1, 5), verdict: xdpRedirect, delta: cnt{rx: 1, agg: 1, done: 1},
				idx: 0, slot: complete(1, 1, 1, 1, 1, 1, 0), vals: []int32{5}},
			{name: "resend of job 2 after the timeout does not reclaim", before: sleep, in: dataFrame(2, 1, 0, 0, 2, 7).with(flags(fResend)),
				verdict: xdpPass, delta: cnt{rx: 1, tops: 1}, idx: 0, slot: complete(1, 1, 1, 1, 1, 1, 0), vals: []int32{5}},
			{name: "job 2 after the timeout reclaims", before: sleep, in: dataFrame(2, 1, 0, 0, 2, 7), verdict: xdpDrop,
				delta: cnt{rx: 1, agg: 1, recl: 1}, idx: 0, slot: aggregating(2, 1, 1, 1, 2, 1, 0), vals: []int32{7}},
			{name: "an abandoned half-filled slot is reclaimed (ATP's memory-leak fix)", before: sleep, in: dataFrame(3, 1, 0, 0, 1, 9),
				verdict: xdpRedirect, delta: cnt{rx: 1, agg: 1, done: 1, recl: 1}, idx: 0, slot: complete(3, 1, 1, 1, 1, 1, 0), vals: []int32{9}},
			{name: "job 2 takes it back after the timeout", before: sleep, in: dataFrame(2, 1, 0, 0, 2, 7), verdict: xdpDrop,
				delta: cnt{rx: 1, agg: 1, recl: 1}, idx: 0, slot: aggregating(2, 1, 1, 1, 2, 1, 0), vals: []int32{7}},
			{name: "a PS result of another fragment frees the stale slot", before: sleep, in: resultFrame(2, 99, 0, 2, 1),
				verdict: xdpRedirect, want: ptr(resultFrame(2, 99, 0, 2, 1)), delta: cnt{rx: 1, psr: 1, recl: 1}, idx: 0,
				slot: &slotView{State: slotFree, Counter: 1, FanIn: 2, Scale: 24, Job: 2, Seq: 1, Bitmap: 1, Nvals: 1}, vals: []int32{7}},
			{name: "job 2 reserves and completes", in: dataFrame(2, 1, 0, 0, 2, 7), verdict: xdpDrop, delta: cnt{rx: 1, agg: 1}},
			{name: "job 2 completes", in: dataFrame(2, 1, 0, 1, 2, 8), verdict: xdpRedirect, delta: cnt{rx: 1, agg: 1, done: 1},
				idx: 0, slot: complete(2, 1, 3, 2, 2, 1, 0), vals: []int32{15}},
			{name: "job 2 earlier seq after the timeout reclaims", before: sleep, in: dataFrame(2, 0, 0, 0, 1, 4), verdict: xdpRedirect,
				delta: cnt{rx: 1, agg: 1, done: 1, recl: 1}, idx: 0, slot: complete(2, 0, 1, 1, 1, 1, 0), vals: []int32{4}},
		}},
		{name: "no reclaim of a young completed slot", timeout: time.Hour, steps: []step{
			{name: "job 1 completes", in: dataFrame(1, 1, 0, 0, 1, 5), verdict: xdpRedirect, delta: cnt{rx: 1, agg: 1, done: 1}},
			{name: "job 2 collides", before: sleep, in: dataFrame(2, 1, 0, 0, 2, 7), verdict: xdpPass,
				want:  ptr(asToPS(dataFrame(2, 1, 0, 0, 2, 7), fCollision)),
				delta: cnt{rx: 1, coll: 1, tops: 1}, idx: 0, slot: complete(1, 1, 1, 1, 1, 1, 0), vals: []int32{5}},
		}},
		{name: "trailing bytes after the datagram are malformed, and touch no slot", steps: []step{
			{name: "padded worker 0", in: w0.with(func(f *frame) { f.Pad = 6 }), verdict: xdpDrop, delta: cnt{rx: 1, bad: 1},
				idx: 3, slot: &slotView{}},
			{name: "worker 0 without padding", in: w0, verdict: xdpDrop, delta: cnt{rx: 1, agg: 1},
				idx: 3, slot: aggregating(7, 100, 1, 1, 2, 4, 0), vals: w0.Vals},
			{name: "padded worker 1 does not complete", in: w1.with(func(f *frame) { f.Pad = 1 }), verdict: xdpDrop, delta: cnt{rx: 1, bad: 1},
				idx: 3, slot: aggregating(7, 100, 1, 1, 2, 4, 0), vals: w0.Vals},
		}},
	}
	runScenarios(t, scenarios)
}

// The generated header struct is exactly the 32-byte wire header.
func TestHeaderLayout(t *testing.T) {
	if n := binary.Size(bpf.XdpaggHdr{}); n != bpf.HdrSize {
		t.Fatalf("binary.Size(XdpaggHdr) = %d, want %d", n, bpf.HdrSize)
	}
	b := dataFrame(0x01020304, 0x05060708, 9, 3, 4, 1).bytes()
	h := b[offHdr:offVals]
	if h[0] != bpf.Version || h[1] != msgData || h[8] != 4 || h[11] != 1 || h[12] != 8 || h[16] != 9 || h[20] != 8 || h[28] != 4 || h[30] != 3 {
		t.Fatalf("header bytes %x do not follow the little-endian wire layout", h)
	}
}

// The phantom queue marks DATA with F_ECN once a port's arrivals outrun its configured rate; the
// mark is OR-ed into the slot and reaches the result. Off (PortRate 0), nothing is marked.
func TestPhantomQueueECN(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  loader.Config
		mark bool
	}{
		{"off", loader.Config{PoolSize: poolSize, NoSourceCheck: true}, false},
		{"1 KB/s, 200-byte threshold", loader.Config{PoolSize: poolSize, PortRate: 1000, ECNThreshold: 200, NoSourceCheck: true}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sl, err := loader.Load(tc.cfg)
			skipIfUnsupported(t, "load switch", err)
			t.Cleanup(func() { sl.Close() })
			s := &sw{Switch: sl}
			enroll(t, sl.Maps, loIfindex, testJobs...)
			s.base = s.counters(t)
			// Three 100-value frames of one fragment (fan-in 3): ~500 bytes each, far beyond a
			// 200-byte backlog at 1 KB/s from the second frame on.
			vals := mkVals(100, func(i int) int32 { return int32(i) })
			var out []byte
			for w := range uint8(3) {
				_, out = s.run(t, dataFrame(2, 50, 4, w, 3, vals...))
			}
			res := decode(t, out)
			marked := s.counters(t).Sub(s.base)[maps.CntECNMarked]
			if got := res.hdr.Flags&fECN != 0; got != tc.mark {
				t.Errorf("result F_ECN = %v, want %v (ecn_marked %d)", got, tc.mark, marked)
			}
			if tc.mark && marked < 2 || !tc.mark && marked != 0 {
				t.Errorf("ecn_marked = %d", marked)
			}
		})
	}
}
