package bpf_test

// Differential fuzzing of xdpagg_switch against the Go model of model_test.go: the fuzzer's bytes
// are a sequence of packets (valid, duplicated, resent, colliding, spoofed, malformed, PS
// results, control and non-xdpagg traffic); each goes through the model and, with
// BPF_PROG_TEST_RUN, through the switch, and the verdict, the output frame, the counter deltas and
// every slot must agree after every packet.
//
//	go test ./bpf/ -run '^$' -fuzz FuzzSwitchModel -fuzztime 60s

import (
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
)

// fuzzSwitch is the one switch of this process: loading one per fuzz input would cost more than
// the input. Inputs run one at a time (mu is held for a whole input) and each starts from a free
// pool and a fresh counter baseline.
var fuzzSwitch struct {
	mu sync.Mutex
	s  *sw
}

// switchForFuzz returns the process's switch, loading and enrolling it (as the model m) on first
// use, with its slots reset, its jobs' quotas and held slots set to m's, and its counter baseline
// taken. The lock is held until the input is done.
func switchForFuzz(t *testing.T, m *model) *sw {
	t.Helper()
	fuzzSwitch.mu.Lock()
	t.Cleanup(fuzzSwitch.mu.Unlock)
	if fuzzSwitch.s == nil {
		sl, err := loader.Load(modelConfig())
		skipIfUnsupported(t, "load switch", err)
		// Never closed: the switch lives as long as the (fuzz worker) process.
		enrollModel(t, sl.Maps, m)
		fuzzSwitch.s = &sw{Switch: sl}
	}
	s := fuzzSwitch.s
	// ResetSlots zeroes jobs.held too; resetJobs also sets this input's quotas.
	if err := s.Maps.ResetSlots(); err != nil {
		t.Fatalf("reset slots: %v", err)
	}
	resetJobs(t, s.Maps, m)
	s.base = s.counters(t)
	return s
}

// Packet categories of a fuzz sequence: what decides the expected outcome.
type fuzzCat uint8

const (
	catData      fuzzCat = iota // MSG_DATA the model steps (spoofed ones included)
	catResult                   // MSG_RESULT, from the PS or not
	catMalformed                // parse-level or header-level garbage: rx+malformed, drop, no slot touched
	catNonAgg                   // not xdpagg traffic at all: non_agg, passed untouched
	catControl                  // control messages (JOIN ... FBCAST): rx+control, passed untouched
	catIPInvalid                // to the agg port with IP options, as a first fragment, or a bad IP checksum: rx+ip_invalid, drop
)

type fuzzPkt struct {
	f    frame
	cat  fuzzCat
	desc string
}

// fuzzExpect is the model's verdict on p; unchanged says the output frame must equal the input.
func fuzzExpect(m *model, p fuzzPkt) (want outcome, unchanged bool) {
	f := p.f
	switch p.cat {
	case catData:
		return m.step(f), false
	case catResult:
		return m.result(f), false
	case catMalformed:
		return outcome{verdict: xdpDrop, delta: cnt{maps.CntRx: 1, maps.CntMalformed: 1}, what: "malformed"}, false
	case catNonAgg:
		return outcome{verdict: xdpPass, delta: cnt{maps.CntNonAgg: 1}, what: "not xdpagg traffic"}, true
	case catControl:
		return outcome{verdict: xdpPass, delta: cnt{maps.CntRx: 1, maps.CntControl: 1}, what: "control"}, true
	case catIPInvalid:
		return outcome{verdict: xdpDrop, delta: cnt{maps.CntRx: 1, maps.CntIPInvalid: 1}, what: "IP options, fragment or checksum"}, false
	}
	panic(fmt.Sprintf("category %d", p.cat))
}

// Input layout. A 5-byte preamble: fan-in of jobs 1..3 (1..4 each), where their sequence numbers
// start (0, just before the 32-bit wrap, just before the sign flip, or anywhere), and their slot
// quotas (bits 2j-2..2j-1 of byte 4: 1 + that, 4 being the whole pool); bits 6-7 of byte 4 are
// job 1's threshold H (0: its fan-in). Then one packet per
// fuzzPktLen bytes (a short tail is zero-padded), at most fuzzMaxPkts:
//
//	b0  kind (b0 % 16): 0-7 DATA, 8 repeat the previous frame byte for byte, 9 PS result,
//	    10 move the job's base seq on (no packet), 11 spoofed DATA, 12-13 malformed, 14 control
//	    (or reserved), 15 not xdpagg traffic or IP-level invalid
//	b1  job 1 + b1%3; seq = base(job) + (b1/3)%6 - 2
//	b2  worker b2 % fan, or with bit 7 set b2 & 31 (may lie outside the fan-in)
//	b3  slot: bit 7 set: b3 % pool, else the job's own (3*job + seq) % pool
//	b4  flags: bit 0 F_RESEND, 1 F_ECN, 2 F_OVERFLOW, 3 F_COLLISION, 4 F_LEVEL1; bit 5 set: the
//	    fan-in is 1 + b4>>6 instead of the job's
//	b5  bits 6-7 encoding (01 float32, 10 sparse, else fixed32); bit 5 set: count
//	    modelCounts[b5&31 % len], else the fragment's own modelCount
//	b6  values seed (b6%8 == 0: magnitudes that overflow int32 sums), and the parameter of b7
//	b7  sub-kind: the malformation, spoof, non-xdpagg kind, control type, PS-result variant or
//	    how far the base seq moves
const (
	fuzzPreamble = 5
	fuzzPktLen   = 8
	fuzzMaxPkts  = 32

	// Sub-kinds (b7 modulo these) of kinds 12-13, 11 and 15.
	fuzzMalformations = 19
	fuzzSpoofs        = 7
	fuzzNonAggs       = 10
)

// switchIP is the switch's own address, where control messages go.
var switchIP = [4]byte{10, 0, 1, 1}

// fuzzSeq builds the fuzz input of a preamble and packets (tests' seeds).
func fuzzSeq(pre [fuzzPreamble]byte, pkts ...[fuzzPktLen]byte) []byte {
	b := append([]byte(nil), pre[:]...)
	for _, p := range pkts {
		b = append(b, p[:]...)
	}
	return b
}

// fpkt is one packet of a seed: kind, job, seq offset (-2..3), worker, then b3..b7 raw.
func fpkt(kind uint8, job uint32, off int, w uint8, b3, b4, b5, b6, b7 uint8) [fuzzPktLen]byte {
	return [fuzzPktLen]byte{kind, uint8(int(job-1) + 3*(off+2)), w, b3, b4, b5, b6, b7}
}

func FuzzSwitchModel(f *testing.F) {
	fans := [fuzzPreamble]byte{1, 1, 2, 0, 0xff} // fan-in 2, 2, 3; seqs from 0; no quotas
	const (
		rs  = 1 << 0 // F_RESEND
		ecn = 1 << 1
		ovf = 1 << 2
		col = 1 << 3
		l1  = 1 << 4
	)
	// Job 1 (fan-in 2): reserve, duplicate, complete, shadow, PS result, next fragment.
	f.Add(fuzzSeq(fans,
		fpkt(0, 1, 0, 0, 0, 0, 0, 1, 0),
		fpkt(8, 0, 0, 0, 0, 0, 0, 0, 0),
		fpkt(0, 1, 0, 1, 0, ecn, 0, 2, 0),
		fpkt(0, 1, 0, 0, 0, rs, 0, 3, 0),
		fpkt(9, 1, 0, 0, 0, 0, 0, 4, 3),
		fpkt(10, 1, 0, 0, 0, 0, 0, 0, 0),
		fpkt(0, 1, 0, 1, 0, 0, 0, 5, 0),
	))
	// Collisions between jobs on one slot, resends without a slot, a partial flush, overflow.
	f.Add(fuzzSeq(fans,
		fpkt(0, 3, 0, 0, 0x80|1, 0, 0, 8, 0),
		fpkt(0, 2, 0, 0, 0x80|1, 0, 0, 8, 0),
		fpkt(0, 2, 0, 1, 0x80|1, rs, 0, 16, 0),
		fpkt(0, 3, 0, 1, 0x80|1, rs, 0, 24, 0),
		fpkt(0, 3, 0, 2, 0x80|1, ovf, 0, 0, 0),
		fpkt(0, 3, 1, 0, 0, col, 0, 9, 0),
		fpkt(0, 1, 1, 0, 0, l1, 0, 9, 0),
		fpkt(0, 1, 1, 1, 0, l1, 0, 10, 0),
		fpkt(0, 1, 1, 0, 0, 0, 0x40, 11, 0),
	))
	// Every malformation, spoof, non-xdpagg kind and control type once, between valid data.
	var mixed [][fuzzPktLen]byte
	mixed = append(mixed, fpkt(0, 2, 0, 0, 0, 0, 0x20|12, 7, 0))
	for k := range uint8(fuzzMalformations) {
		mixed = append(mixed, fpkt(12, 2, 0, 1, 0, 0, 0x20|uint8(k), 5+k, k))
	}
	for k := range uint8(fuzzSpoofs) {
		mixed = append(mixed, fpkt(11, 2, 0, 1, 0, 0, 0, k, k))
	}
	for k := range uint8(fuzzNonAggs) {
		mixed = append(mixed, fpkt(15, 1, 0, 0, 0, 0, 0, 3*k, k))
	}
	for k := range uint8(6) {
		mixed = append(mixed, fpkt(14, 1, 0, 0, 0, 0, 0, k, k))
	}
	for k := range uint8(6) {
		mixed = append(mixed, fpkt(9, 2, 0, 0, 0, 0, 0, k, k))
	}
	mixed = append(mixed, fpkt(0, 2, 0, 1, 0, 0, 0x20|12, 7, 0))
	f.Add(fuzzSeq(fans, mixed...))
	// Sequence numbers around the wrap, fan-in 1 (every packet completes), wrong fan-ins/counts.
	f.Add(fuzzSeq([fuzzPreamble]byte{0, 0, 3, 1, 0xff},
		fpkt(0, 1, 1, 0, 0, 0, 0, 1, 0),
		fpkt(0, 1, 3, 0, 0, 0, 0, 1, 0),
		fpkt(10, 1, 0, 0, 0, 0, 0, 0, 2),
		fpkt(0, 1, 1, 0, 0, 0, 0, 1, 0),
		fpkt(0, 3, 0, 2, 0, 0, 0, 1, 0),
		fpkt(0, 3, 0, 1, 0, 0x20|0x40, 0, 1, 0),
		fpkt(0, 3, 0, 1, 0, rs, 0x20|3, 1, 0),
		fpkt(0, 3, 0, 0x80|7, 0, 0, 0, 1, 0),
		fpkt(10, 1, 0, 0, 0, 0, 0, 0, 0xff),
		fpkt(0, 1, 0, 0, 0, 0, 0, 1, 0),
	))

	// Quotas: job 1 may hold 1 slot, job 2 2; jobs 1 and 2 reach them, complete or retake their
	// own slots without quota, a PS result and a flush give slots back.
	f.Add(fuzzSeq([fuzzPreamble]byte{1, 1, 2, 0, 0x04 | 0x30},
		fpkt(0, 1, 0, 0, 0, 0, 0, 1, 0),
		fpkt(0, 1, 1, 0, 0, 0, 0, 1, 0),
		fpkt(0, 1, 0, 1, 0, 0, 0, 1, 0),
		fpkt(0, 1, 4, 0, 0, 0, 0, 1, 0),
		fpkt(0, 2, 0, 0, 0, 0, 0, 2, 0),
		fpkt(0, 2, 1, 0, 0, 0, 0, 2, 0),
		fpkt(0, 2, 2, 0, 0, 0, 0, 2, 0),
		fpkt(9, 2, 0, 0, 0, 0, 0, 2, 7),
		fpkt(0, 2, 2, 1, 0, 0, 0, 2, 0),
		fpkt(0, 2, 1, 0, 0, rs, 0, 2, 0),
		fpkt(0, 2, 3, 0, 0, 0, 0, 2, 0),
		fpkt(9, 1, 1, 0, 0, 0, 0, 2, 3),
		fpkt(9, 1, 1, 0, 0, 0, 0, 2, 4),
		fpkt(0, 1, 1, 1, 0, 0, 0, 1, 0),
	))

	f.Fuzz(func(t *testing.T, data []byte) {
		var pre [fuzzPreamble]byte
		copy(pre[:], data)
		m := newModel([3]uint32{1 + uint32(pre[4]&3), 1 + uint32(pre[4]>>2&3), 1 + uint32(pre[4]>>4&3)})
		m.jobs[1].threshold = pre[4] >> 6 // 0: the fan-in
		s := switchForFuzz(t, m)
		fan := map[uint32]uint8{1: 1 + pre[0]%4, 2: 1 + pre[1]%4, 3: 1 + pre[2]%4}
		start := [4]uint32{0, 0xfffffffe, 0x7ffffffe, uint32(pre[3]) << 24}[pre[3]%4]
		base := map[uint32]uint32{1: start, 2: start + 100, 3: start - 100}

		var (
			prev    *fuzzPkt
			history []string
		)
		for i, n := fuzzPreamble, 0; i < len(data) && n < fuzzMaxPkts; i, n = i+fuzzPktLen, n+1 {
			var b [fuzzPktLen]byte
			copy(b[:], data[i:])
			p, ok := fuzzPacket(b, n, fan, base, prev)
			if !ok {
				history = append(history, fmt.Sprintf("#%d %s", n, p.desc))
				continue
			}
			prev = &p
			want, unchanged := fuzzExpect(m, p)
			history = append(history, fmt.Sprintf("#%d %s -> %s", n, p.desc, want.what))
			if len(history) > 16 {
				history = history[len(history)-16:]
			}

			in := p.f.bytes()
			got, out := runProg(t, s.Objects.XdpaggSwitch, in)
			if got != want.verdict {
				t.Errorf("%s: verdict %s, model says %s (%s)", p.desc, verdictName(got), verdictName(want.verdict), want.what)
			}
			if want.out != nil && got == want.verdict {
				expectFrame(t, out, *want.out)
			}
			if unchanged && got == want.verdict {
				expectUnchangedBut(t, out, in)
			}
			s.expectDelta(t, want.delta)
			// A packet may only touch the slot it names: compare that one now (reading all of
			// them per packet would double the cost of an input), and the whole pool at the end.
			if idx := p.f.Hdr.AggIndex; idx < modelPool {
				m.expectSlot(t, s, idx)
			}
			m.expectHeld(t, s)
			if t.Failed() {
				t.Fatalf("diverged from the model at packet %d (fan-ins %v); last packets:\n\t%s", n, fan, joinLines(history))
			}
		}
		m.expectSlots(t, s)
		m.expectHeld(t, s)
		if t.Failed() {
			t.Fatalf("a slot no packet named diverged from the model (fan-ins %v); last packets:\n\t%s", fan, joinLines(history))
		}
	})
}

// fuzzPacket decodes packet n of a sequence from b. ok is false for kinds that send nothing
// (moving a base seq on, repeating when there is nothing to repeat).
func fuzzPacket(b [fuzzPktLen]byte, n int, fan map[uint32]uint8, base map[uint32]uint32, prev *fuzzPkt) (fuzzPkt, bool) {
	kind := b[0] % 16
	job := 1 + uint32(b[1]%3)
	seq := base[job] + uint32(int(b[1]/3%6)-2)
	param := b[6]

	switch kind {
	case 8:
		if prev == nil {
			return fuzzPkt{desc: "repeat: nothing yet"}, false
		}
		p := *prev
		p.desc = "again: " + p.desc
		return p, true
	case 10:
		step := uint32(1 + b[7]%4)
		if b[7] == 0xff {
			step = 1 << 31 // exactly half the seq space away: neither before nor after
		}
		base[job] += step
		return fuzzPkt{desc: fmt.Sprintf("job %d base seq += %d -> %d", job, step, base[job])}, false
	}

	// A DATA frame from the fields (also the starting point of spoofs and malformations).
	fn := fan[job]
	if b[4]&0x20 != 0 {
		fn = 1 + b[4]>>6
	}
	w := b[2] % fn
	if b[2]&0x80 != 0 {
		w = b[2] & 31
	}
	idx := (3*job + seq) % modelPool
	if b[3]&0x80 != 0 {
		idx = uint32(b[3]) % modelPool
	}
	count := modelCount(job, seq)
	if b[5]&0x20 != 0 {
		count = modelCounts[int(b[5]&31)%len(modelCounts)]
	}
	r := rand.New(rand.NewPCG(uint64(param), uint64(n)))
	vals := mkVals(count, func(int) int32 {
		switch param % 8 {
		case 0:
			return int32(r.Uint32()) // sums overflow
		case 1:
			return math.MaxInt32 - int32(r.IntN(1000)) // near the limit
		}
		return int32(r.IntN(2_000_001) - 1_000_000)
	})
	d := dataFrame(job, seq, idx, w, fn, vals...)
	d.Hdr.ScaleLog2 = uint8(16 + job)
	flagBits := []uint16{fResend, fECN, fOverflow, fCollision, fLevel1}
	for i, fl := range flagBits {
		if b[4]&(1<<i) != 0 {
			d.Hdr.Flags |= fl
		}
	}
	if d.Hdr.Flags&fLevel1 != 0 {
		// A first-level switch's partial sum: the next level reads bitmap1/fan_in1 only.
		d.Hdr.Bitmap1, d.Hdr.FanIn1 = d.Hdr.Bitmap0, d.Hdr.FanIn0
		d.Hdr.Bitmap0, d.Hdr.FanIn0 = uint32(param)<<8, param
	}
	switch b[5] >> 6 {
	case 1:
		d.Hdr.Encoding = encFloat32
	case 2:
		d.Hdr.Encoding = encSparseKV
	}
	desc := fmt.Sprintf("job %d seq %#x idx %d worker %d fan %d count %d flags %#x enc %d",
		job, seq, idx, w, fn, count, d.Hdr.Flags, d.Hdr.Encoding)

	switch kind {
	case 9:
		res := resultFrame(job, seq, idx, fan[job], vals...)
		desc = fmt.Sprintf("PS result job %d seq %#x idx %d count %d", job, seq, idx, count)
		desc += forgeResult(&res, int(b[7]%8), w, uint16(param))
		return fuzzPkt{f: res, cat: catResult, desc: desc}, true
	case 11:
		switch b[7] % fuzzSpoofs {
		case 0:
			d.Hdr.WorkerId = (w + 1) % uint8(bpf.MaxWorkers) // another worker's id
		case 1:
			d.SrcIP = [4]byte{10, 9, 9, param}
		case 2:
			d.SrcPort += 1 + uint16(param)
		case 3:
			d.Hdr.JobId = unenrolledJob
		case 4:
			// A worker sending a partial aggregate: more bits than its own.
			if d.Hdr.Flags&fLevel1 != 0 {
				d.Hdr.Bitmap1 |= 1 << ((uint32(w) + 1) % uint32(fn))
			} else {
				d.Hdr.Bitmap0 |= 1 << ((uint32(w) + 1) % uint32(fn))
			}
		case 5:
			d.Hdr.WorkerId = uint8(bpf.MaxWorkers) + param%224 // no such worker
		case 6:
			d.Hdr.JobId = modelUnadmitted // workers bound, job never admitted
		}
		return fuzzPkt{f: d, cat: catData, desc: desc + fmt.Sprintf(" (spoof %d)", b[7]%fuzzSpoofs)}, true
	case 12, 13:
		return fuzzMalformed(d, b[7]%fuzzMalformations, param, desc), true
	case 14:
		ctl := []bpf.XdpaggMsgType{bpf.XdpaggMsgTypeMSG_JOIN, bpf.XdpaggMsgTypeMSG_LEAVE, bpf.XdpaggMsgTypeMSG_RESET,
			bpf.XdpaggMsgTypeMSG_ACK, bpf.XdpaggMsgTypeMSG_RETRANSMIT, bpf.XdpaggMsgTypeMSG_HEARTBEAT,
			bpf.XdpaggMsgTypeMSG_HALT, bpf.XdpaggMsgTypeMSG_SETH, bpf.XdpaggMsgTypeMSG_FBCAST}
		typ := uint8(ctl[int(b[7])%len(ctl)])
		c := d.with(func(f *frame) {
			f.DstIP = switchIP
			f.Hdr.Type = typ
			f.Hdr.Count = uint16(param) // not checked for control messages
			f.Hdr.AggIndex = uint32(param) << 20
			f.Vals = f.Vals[:min(len(f.Vals), int(param%3))]
		})
		return fuzzPkt{f: c, cat: catControl, desc: fmt.Sprintf("control type %d count %d", typ, param)}, true
	case 15:
		return fuzzNonAgg(d, b[7]%fuzzNonAggs, param), true
	}
	return fuzzPkt{f: d, cat: catData, desc: desc}, true
}

// fuzzMalformed makes DATA frame d malformed in way k (parameter p): every way is one the switch
// must drop as malformed before it reads or writes a slot.
func fuzzMalformed(d frame, k, p uint8, desc string) fuzzPkt {
	n := len(d.Vals)
	realUDP := 8 + bpf.HdrSize + 4*n
	realIP := 20 + realUDP
	delta := 1 + int(p%16)
	if p&0x80 != 0 {
		delta = -delta
	}
	var what string
	g := d.with(func(f *frame) {
		switch k {
		case 0:
			f.Truncate = offHdr + int(p%32)
			what = fmt.Sprintf("cut to %d bytes, inside the header", f.Truncate)
		case 1:
			f.Truncate = offVals + int(p)%(4*n)
			what = fmt.Sprintf("cut to %d bytes, inside the values", f.Truncate)
		case 2:
			f.UDPLen = realUDP + delta
			what = fmt.Sprintf("UDP length %d, datagram %d", f.UDPLen, realUDP)
		case 3:
			f.IPLen = realIP + delta
			what = fmt.Sprintf("IP total length %d, datagram %d", f.IPLen, realIP)
		case 4:
			f.UDPLen, f.IPLen = realUDP+4*delta, realIP+4*delta
			what = fmt.Sprintf("UDP/IP lengths %d/%d agree but the datagram is %d", f.UDPLen, f.IPLen, realUDP)
		case 5:
			f.Hdr.Version = p
			if p == bpf.Version {
				f.Hdr.Version = 0
			}
			what = fmt.Sprintf("version %d", f.Hdr.Version)
		case 6:
			f.Hdr.Reserved = p | 1
			what = fmt.Sprintf("reserved %#x", f.Hdr.Reserved)
		case 7:
			f.Hdr.Type = p
			if p >= 1 && p <= 16 { // the known types, and 13..16 for types being added elsewhere
				f.Hdr.Type = p % 2 * (p + 100) // 0 or 101..115
			}
			what = fmt.Sprintf("type %d", f.Hdr.Type)
		case 8:
			f.Vals, f.Hdr.Count = nil, 0
			what = "count 0"
		case 9:
			c := bpf.MaxValues + 1 + int(p%4)
			f.Vals = mkVals(c, func(i int) int32 { return int32(i) })
			f.Hdr.Count = uint16(c)
			what = fmt.Sprintf("count %d > MaxValues", c)
		case 10:
			f.Hdr.Count = uint16(n + delta)
			if p%5 == 0 {
				f.Hdr.Count = math.MaxUint16
			}
			what = fmt.Sprintf("count %d, %d values", f.Hdr.Count, n)
		case 11:
			f.Hdr.AggIndex = modelPool + uint32(p)*0x01010101
			if p == 0xff {
				f.Hdr.AggIndex = math.MaxUint32
			}
			what = fmt.Sprintf("agg_index %#x >= pool", f.Hdr.AggIndex)
		case 12:
			f.Hdr.Encoding = 3 + p%253
			what = fmt.Sprintf("encoding %d", f.Hdr.Encoding)
		case 13:
			f.Hdr.JobId = 0
			what = "DATA of job 0"
		case 14:
			// From worker 0 of a fan-in of 2 (a member), then one field out of range.
			f.Hdr.Flags &^= fLevel1
			f.Hdr.WorkerId, f.Hdr.Bitmap0, f.Hdr.FanIn0 = 0, 1, 2
			f.SrcIP, f.SrcPort = workerIP(0), workerPort(0)
			switch p % 4 {
			case 0:
				f.Hdr.FanIn0 = 0
			case 1:
				f.Hdr.FanIn0 = uint8(bpf.MaxWorkers) + 1 + p%200
			case 2:
				f.Hdr.Bitmap0 = 0
			case 3:
				f.Hdr.Bitmap0 |= 1 << (2 + uint32(p)%30)
			}
			what = fmt.Sprintf("fan_in0 %d bitmap0 %#x", f.Hdr.FanIn0, f.Hdr.Bitmap0)
		case 15:
			*f = resultFrame(f.Hdr.JobId, f.Hdr.Seq, f.Hdr.AggIndex, 2, f.Vals...)
			switch p % 4 {
			case 0:
				f.Hdr.JobId = 0
			case 1:
				f.Vals, f.Hdr.Count = nil, 0
			case 2:
				f.Hdr.AggIndex = modelPool + uint32(p)
			case 3:
				f.Hdr.Encoding = 3 + p%253
			}
			what = fmt.Sprintf("result job %d count %d agg_index %d encoding %d", f.Hdr.JobId, f.Hdr.Count, f.Hdr.AggIndex, f.Hdr.Encoding)
		case 16:
			f.Pad = 1 + int(p%8)
			what = fmt.Sprintf("%d bytes after the IPv4 total length", f.Pad)
		case 17:
			f.Hdr.Type = [2]uint8{20, 21 + p%5}[p%2]
			what = fmt.Sprintf("reserved type %d", f.Hdr.Type)
		case 18:
			f.Hdr.Encoding = encSparseKV
			if p%2 == 1 {
				*f = resultFrame(f.Hdr.JobId, f.Hdr.Seq, f.Hdr.AggIndex, 2, f.Vals...)
				f.Hdr.Encoding = encSparseKV
			}
			what = fmt.Sprintf("ENC_SPARSE_KV type %d", f.Hdr.Type)
		}
	})
	return fuzzPkt{f: g, cat: catMalformed, desc: desc + " malformed: " + what}
}

// fuzzNonAgg turns DATA frame d into traffic the switch must pass to the kernel untouched
// (catNonAgg), or into xdpagg traffic it must drop for its IP header (catIPInvalid).
func fuzzNonAgg(d frame, k, p uint8) fuzzPkt {
	var what string
	cat := catNonAgg
	g := d.with(func(f *frame) {
		switch k {
		case 0:
			f.EtherType = [2]uint16{0x0806, 0x86dd}[p%2]
			what = fmt.Sprintf("ethertype %#04x", f.EtherType)
		case 1:
			f.Proto = [3]uint8{1, 6, 132}[p%3]
			what = fmt.Sprintf("IP protocol %d", f.Proto)
		case 2:
			f.DstPort = aggPort + 1 + uint16(p)
			what = fmt.Sprintf("UDP to port %d", f.DstPort)
		case 3:
			f.FragOff = [2]uint16{0x2000 | uint16(p), 1 + uint16(p)}[p%2]
			what = fmt.Sprintf("IPv4 fragment (frag_off %#x)", f.FragOff)
			if f.FragOff == 0x2000 {
				cat = catIPInvalid // the first fragment: it shows the port
			}
		case 4:
			f.IHL = 6 + p%10
			what = fmt.Sprintf("IPv4 with options (IHL %d)", f.IHL)
			cat = catIPInvalid
		case 5:
			f.IPVersion = p % 16
			if f.IPVersion == 0 || f.IPVersion == 4 {
				f.IPVersion = 6
			}
			what = fmt.Sprintf("IP version %d", f.IPVersion)
		case 6:
			f.Truncate = 14 + int(p%28)
			what = fmt.Sprintf("cut to %d bytes, inside the IPv4/UDP headers", f.Truncate)
		case 7:
			f.BadIPCsum = true
			what = "bad IPv4 header checksum"
			cat = catIPInvalid
		case 8:
			f.DstPort = aggPort + 1 + uint16(p)
			switch p % 3 {
			case 0:
				f.IHL = 6 + p%10
			case 1:
				f.FragOff = 0x2000
			case 2:
				f.BadIPCsum = true
			}
			what = fmt.Sprintf("UDP to port %d with IHL %d, frag_off %#x, bad checksum %v", f.DstPort, f.IHL, f.FragOff, f.BadIPCsum)
		case 9:
			f.FragOff = 0x2000
			f.IPLen = 20 + int(p%8)
			if p&8 != 0 {
				f.Truncate = offIP + f.IPLen
			}
			what = fmt.Sprintf("tiny first fragment (IP length %d, frame cut %v)", f.IPLen, p&8 != 0)
			cat = catIPInvalid
		}
	})
	if cat == catIPInvalid {
		return fuzzPkt{f: g, cat: cat, desc: "IP-level invalid: " + what}
	}
	return fuzzPkt{f: g, cat: cat, desc: "not xdpagg: " + what}
}
