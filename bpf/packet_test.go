package bpf_test

// Test helpers: a packet builder for xdpagg frames (Ethernet + IPv4 + UDP + xdpagg header + values)
// that can also build malformed ones, a decoder for what the programs return, and a harness that
// runs a program with BPF_PROG_TEST_RUN and tracks counter deltas.

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
)

// XDP verdicts (enum xdp_action).
const (
	xdpAborted  = 0
	xdpDrop     = 1
	xdpPass     = 2
	xdpTX       = 3
	xdpRedirect = 4
)

func verdictName(v uint32) string {
	switch v {
	case xdpAborted:
		return "XDP_ABORTED"
	case xdpDrop:
		return "XDP_DROP"
	case xdpPass:
		return "XDP_PASS"
	case xdpTX:
		return "XDP_TX"
	case xdpRedirect:
		return "XDP_REDIRECT"
	}
	return fmt.Sprintf("verdict_%d", v)
}

// Header field values under short names.
const (
	msgData   = uint8(bpf.XdpaggMsgTypeMSG_DATA)
	msgResult = uint8(bpf.XdpaggMsgTypeMSG_RESULT)

	encFixed32  = uint8(bpf.XdpaggEncodingENC_FIXED32)
	encFloat32  = uint8(bpf.XdpaggEncodingENC_FLOAT32)
	encSparseKV = uint8(bpf.XdpaggEncodingENC_SPARSE_KV)

	fResend     = uint16(bpf.XdpaggFlagF_RESEND)
	fCollision  = uint16(bpf.XdpaggFlagF_COLLISION)
	fECN        = uint16(bpf.XdpaggFlagF_ECN)
	fOverflow   = uint16(bpf.XdpaggFlagF_OVERFLOW)
	fLevel1     = uint16(bpf.XdpaggFlagF_LEVEL1)
	fFromSwitch = uint16(bpf.XdpaggFlagF_FROM_SWITCH)
	fShadow     = uint16(bpf.XdpaggFlagF_SHADOW)

	slotFree        = uint8(bpf.XdpaggSlotStateSLOT_FREE)
	slotAggregating = uint8(bpf.XdpaggSlotStateSLOT_AGGREGATING)
	slotComplete    = uint8(bpf.XdpaggSlotStateSLOT_COMPLETE)

	aggPort  = bpf.DefaultPort
	poolSize = 16

	offIP   = 14
	offUDP  = offIP + 20
	offHdr  = offUDP + 8
	offVals = offHdr + 32
)

var (
	switchMAC = [6]byte{0x02, 0x00, 0x00, 0x00, 0x00, 0xfe}
	psMAC     = [6]byte{0x02, 0x00, 0x00, 0x00, 0x00, 0x01}
	psIP      = [4]byte{10, 0, 0, 1}
)

func workerMAC(w uint8) [6]byte { return [6]byte{0x02, 0x00, 0x00, 0x00, 0x01, w} }
func workerIP(w uint8) [4]byte  { return [4]byte{10, 0, 1, 10 + w} }
func workerPort(w uint8) uint16 { return 40000 + uint16(w) }

// frame describes one test frame. Zero length/checksum overrides mean "compute it correctly".
type frame struct {
	DstMAC, SrcMAC [6]byte
	EtherType      uint16
	IPVersion      uint8 // default 4
	IHL            uint8 // default 5; more adds NOP option words
	TOS            uint8
	FragOff        uint16 // raw flags+offset field (host order)
	TTL            uint8
	Proto          uint8 // default UDP
	SrcIP, DstIP   [4]byte
	SrcPort        uint16
	DstPort        uint16
	Hdr            bpf.XdpaggHdr
	Vals           []int32
	Payload        []byte // replaces header + values when non-nil (non-xdpagg UDP, ICMP...)
	UDPLen, IPLen  int    // overrides; 0 = correct
	Pad            int    // bytes after the IP datagram (link padding; malformed after an xdpagg datagram)
	Truncate       int    // > 0: cut the frame to this many bytes (after everything else)
	NoUDPCsum      bool   // send with UDP checksum 0
	BadIPCsum      bool   // send with a wrong IPv4 header checksum (the builder's is valid otherwise)
	Raw            []byte // when non-nil the frame is exactly these bytes
}

// dataFrame is worker w's DATA contribution to <job, seq> at slot idx, in a job of fan workers.
func dataFrame(job, seq, idx uint32, w, fan uint8, vals ...int32) frame {
	return frame{
		DstMAC: switchMAC, SrcMAC: workerMAC(w), EtherType: 0x0800, TTL: 64,
		SrcIP: workerIP(w), DstIP: psIP, SrcPort: workerPort(w), DstPort: aggPort,
		Hdr: bpf.XdpaggHdr{
			Version: bpf.Version, Type: msgData, Encoding: encFixed32, ScaleLog2: 24,
			Count: uint16(len(vals)), JobId: job, Seq: seq, AggIndex: idx,
			Bitmap0: 1 << w, FanIn0: fan, WorkerId: w,
		},
		Vals: vals,
	}
}

// resultFrame is a RESULT from the PS for <job, seq> at idx, bitmap all of fan workers.
func resultFrame(job, seq, idx uint32, fan uint8, vals ...int32) frame {
	return frame{
		DstMAC: switchMAC, SrcMAC: psMAC, EtherType: 0x0800, TTL: 64,
		SrcIP: psIP, DstIP: [4]byte{10, 0, 1, 255}, SrcPort: aggPort, DstPort: aggPort,
		Hdr: bpf.XdpaggHdr{
			Version: bpf.Version, Type: msgResult, Encoding: encFixed32, ScaleLog2: 24,
			Count: uint16(len(vals)), JobId: job, Seq: seq, AggIndex: idx,
			Bitmap0: uint32(1)<<fan - 1, FanIn0: fan,
		},
		Vals: vals,
	}
}

func (f frame) with(mods ...func(*frame)) frame {
	f.Vals = append([]int32(nil), f.Vals...)
	for _, m := range mods {
		m(&f)
	}
	return f
}

func csum16(b []byte, sum uint32) uint32 {
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(b[i])<<8 | uint32(b[i+1])
	}
	if len(b)%2 == 1 {
		sum += uint32(b[len(b)-1]) << 8
	}
	return sum
}

func fold(sum uint32) uint16 {
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	return ^uint16(sum)
}

// ipChecksumOK verifies an IPv4 header checksum (sum over the header, checksum included, is 0).
func ipChecksumOK(iph []byte) bool { return fold(csum16(iph, 0)) == 0 }

func (f frame) bytes() []byte {
	if f.Raw != nil {
		return append([]byte(nil), f.Raw...)
	}
	var payload []byte
	if f.Payload != nil {
		payload = append([]byte(nil), f.Payload...)
	} else {
		payload = make([]byte, bpf.HdrSize, bpf.HdrSize+4*len(f.Vals))
		if _, err := binary.Encode(payload, binary.LittleEndian, &f.Hdr); err != nil {
			panic(err)
		}
		for _, v := range f.Vals {
			payload = binary.LittleEndian.AppendUint32(payload, uint32(v))
		}
	}
	ihl := f.IHL
	if ihl == 0 {
		ihl = 5
	}
	ver := f.IPVersion
	if ver == 0 {
		ver = 4
	}
	proto := f.Proto
	if proto == 0 {
		proto = 17
	}
	var l4 []byte
	if proto == 17 {
		udpLen := 8 + len(payload)
		if f.UDPLen != 0 {
			udpLen = f.UDPLen
		}
		l4 = make([]byte, 8, 8+len(payload))
		binary.BigEndian.PutUint16(l4[0:], f.SrcPort)
		binary.BigEndian.PutUint16(l4[2:], f.DstPort)
		binary.BigEndian.PutUint16(l4[4:], uint16(udpLen))
		l4 = append(l4, payload...)
		if !f.NoUDPCsum {
			// Pseudo-header + UDP datagram (as it really is), so zeroing by the switch shows.
			sum := csum16(f.SrcIP[:], 0)
			sum = csum16(f.DstIP[:], sum)
			sum += 17 + uint32(len(l4))
			sum = csum16(l4, sum)
			c := fold(sum)
			if c == 0 {
				c = 0xffff
			}
			binary.BigEndian.PutUint16(l4[6:], c)
		}
	} else {
		l4 = payload
	}
	hl := int(ihl) * 4
	ipLen := hl + len(l4)
	if f.IPLen != 0 {
		ipLen = f.IPLen
	}
	ip := make([]byte, hl)
	ip[0] = ver<<4 | ihl&0xf
	ip[1] = f.TOS
	binary.BigEndian.PutUint16(ip[2:], uint16(ipLen))
	binary.BigEndian.PutUint16(ip[4:], 0x1234)
	binary.BigEndian.PutUint16(ip[6:], f.FragOff)
	ip[8] = f.TTL
	ip[9] = proto
	copy(ip[12:], f.SrcIP[:])
	copy(ip[16:], f.DstIP[:])
	for i := 20; i < hl; i++ {
		ip[i] = 1 // NOP options
	}
	ipCsum := fold(csum16(ip, 0))
	if f.BadIPCsum {
		// Not ^ipCsum: 0x0000 and 0xffff are the same number in ones' complement, so flipping
		// every bit of a 0x0000 checksum would leave the header valid.
		ipCsum ^= 0x5a5a
	}
	binary.BigEndian.PutUint16(ip[10:], ipCsum)

	b := make([]byte, 0, 14+len(ip)+len(l4)+f.Pad)
	b = append(b, f.DstMAC[:]...)
	b = append(b, f.SrcMAC[:]...)
	b = binary.BigEndian.AppendUint16(b, f.EtherType)
	b = append(b, ip...)
	b = append(b, l4...)
	b = append(b, make([]byte, f.Pad)...)
	if f.Truncate > 0 && f.Truncate < len(b) {
		b = b[:f.Truncate]
	}
	return b
}

// decoded is an output frame taken apart (IPv4 without options, UDP, xdpagg).
type decoded struct {
	raw              []byte
	dstMAC, srcMAC   [6]byte
	srcIP, dstIP     [4]byte
	ttl              uint8
	srcPort, dstPort uint16
	udpLen, udpCsum  uint16
	hdr              bpf.XdpaggHdr
	vals             []int32
}

func decode(t *testing.T, b []byte) decoded {
	t.Helper()
	if len(b) < offVals {
		t.Fatalf("output frame of %d bytes is too short to decode", len(b))
	}
	d := decoded{raw: b}
	copy(d.dstMAC[:], b[0:6])
	copy(d.srcMAC[:], b[6:12])
	copy(d.srcIP[:], b[offIP+12:])
	copy(d.dstIP[:], b[offIP+16:])
	d.ttl = b[offIP+8]
	d.srcPort = binary.BigEndian.Uint16(b[offUDP:])
	d.dstPort = binary.BigEndian.Uint16(b[offUDP+2:])
	d.udpLen = binary.BigEndian.Uint16(b[offUDP+4:])
	d.udpCsum = binary.BigEndian.Uint16(b[offUDP+6:])
	if _, err := binary.Decode(b[offHdr:offVals], binary.LittleEndian, &d.hdr); err != nil {
		t.Fatalf("decode xdpagg header: %v", err)
	}
	n := int(d.hdr.Count)
	if offVals+4*n > len(b) {
		t.Fatalf("output header counts %d values but the frame holds %d bytes of them", n, len(b)-offVals)
	}
	for i := range n {
		d.vals = append(d.vals, int32(binary.LittleEndian.Uint32(b[offVals+4*i:])))
	}
	return d
}

// ---- harness ----

// sw is a freshly loaded switch with a counter baseline.
type sw struct {
	*loader.Switch
	base maps.Counters
}

// skipIfUnsupported skips the test when err says the kernel lacks a feature, and fails it on any
// other error.
func skipIfUnsupported(t *testing.T, what string, err error) {
	t.Helper()
	if err == nil {
		return
	}
	if errors.Is(err, ebpf.ErrNotSupported) {
		t.Skipf("%s: kernel lacks a feature (ebpf.ErrNotSupported): %v", what, err)
	}
	t.Fatalf("%s: %v", what, err)
}

// testConfig is the switch configuration of the BPF_PROG_TEST_RUN tests: source validation off
// (Program.Run's ingress is the loopback device, and no route of the host namespace explains the
// test addresses; the uRPF tests in urpf_test.go turn it on in a namespace of their own).
func testConfig(timeout time.Duration) loader.Config {
	return loader.Config{PoolSize: poolSize, SlotTimeout: timeout, NoSourceCheck: true}
}

func load(t *testing.T, timeout time.Duration) *sw {
	t.Helper()
	return loadCfg(t, testConfig(timeout))
}

// loadCfg loads a switch with cfg, enrolls the test jobs (testJobs behind loIfindex,
// otherPortJob's workers behind otherPortIfindex) and takes the counter baseline.
func loadCfg(t *testing.T, cfg loader.Config) *sw {
	t.Helper()
	s, err := loader.Load(cfg)
	skipIfUnsupported(t, "load switch", err)
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("close switch: %v", err)
		}
	})
	e := &sw{Switch: s}
	enroll(t, s.Maps, loIfindex, testJobs...)
	enroll(t, s.Maps, otherPortIfindex, otherPortJob)
	e.base = e.counters(t)
	return e
}

// loIfindex is the ingress ifindex BPF_PROG_TEST_RUN gives a frame run without a context: the
// loopback device of the caller's namespace.
const loIfindex = 1

// testJobs are the job ids the tests send as; unenrolledJob is one nobody joined (nor admitted).
var testJobs = []uint32{1, 2, 3, 4, 5, 7, 8, 9, 0x01020304}

const (
	unenrolledJob = 66
	// otherPortJob's workers joined behind switch port otherPortIfindex, not the test's ingress.
	otherPortJob     = 6
	otherPortIfindex = 999
)

// testJob is how the tests admit a job: its PS at psIP:aggPort behind the test's ingress port
// (loopback), 32 workers, and a slot quota of the whole pool (no quota in effect).
func testJob(m *maps.Maps, job uint32) maps.Job {
	return maps.Job{JobID: job, PS: netip.AddrPortFrom(netip.AddrFrom4(psIP), aggPort), PSIfindex: loIfindex,
		Workers: uint8(bpf.MaxWorkers), MaxSlots: m.PoolSize()}
}

// testKey is a job's control key in the tests (XDP never reads it).
func testKey(job uint32) []byte {
	k := make([]byte, maps.KeySize)
	binary.LittleEndian.PutUint32(k, job)
	return k
}

// admit admits job j (maps.AddJob) with a test key.
func admit(t testing.TB, m *maps.Maps, j maps.Job) {
	t.Helper()
	if err := m.AddJob(j, testKey(j.JobID)); err != nil {
		t.Fatalf("admit job %d: %v", j.JobID, err)
	}
}

// enrollWorkers lets workers 0..MaxWorkers-1 of job contribute from workerIP(w):workerPort(w)
// through switch port ifindex (the ingress half of what JOIN sets up).
func enrollWorkers(t testing.TB, m *maps.Maps, ifindex uint32, job uint32) {
	t.Helper()
	for w := range uint8(bpf.MaxWorkers) {
		if err := m.PutWorker(job, w, netip.AddrPortFrom(netip.AddrFrom4(workerIP(w)), workerPort(w)), ifindex); err != nil {
			t.Fatalf("enroll: %v", err)
		}
	}
}

// enroll admits each job (testJob: PS psIP:aggPort behind loIfindex, quota the whole pool) and
// lets its workers 0..MaxWorkers-1 contribute from workerIP(w):workerPort(w) through switch port
// ifindex: what `xdpagg job add` and the workers' JOINs set up in production.
func enroll(t testing.TB, m *maps.Maps, ifindex uint32, jobs ...uint32) {
	t.Helper()
	for _, job := range jobs {
		admit(t, m, testJob(m, job))
		enrollWorkers(t, m, ifindex, job)
	}
}

func (s *sw) counters(t testing.TB) maps.Counters {
	t.Helper()
	c, err := s.Maps.ReadCounters()
	if err != nil {
		t.Fatalf("read counters: %v", err)
	}
	return c
}

// cnt lists expected counter deltas; counters not named must not move.
type cnt map[maps.Counter]uint64

func (c cnt) String() string {
	var b bytes.Buffer
	for i := range maps.NumCounters {
		if v := c[maps.Counter(i)]; v != 0 {
			fmt.Fprintf(&b, "%s+%d ", maps.CounterName(maps.Counter(i)), v)
		}
	}
	return b.String()
}

func deltaOf(c maps.Counters) cnt {
	out := cnt{}
	for i, v := range c {
		if v != 0 {
			out[maps.Counter(i)] = v
		}
	}
	return out
}

// expectDelta checks the counter deltas since the last call (or load) and moves the baseline.
func (s *sw) expectDelta(t *testing.T, want cnt) {
	t.Helper()
	now := s.counters(t)
	got := now.Sub(s.base)
	s.base = now
	for i := range maps.NumCounters {
		if got[i] != want[maps.Counter(i)] {
			t.Errorf("counter deltas: got {%v}, want {%v}", deltaOf(got), want)
			return
		}
	}
}

func (s *sw) slot(t *testing.T, idx uint32) bpf.XdpaggSlot {
	t.Helper()
	sl, err := s.Maps.Slot(idx)
	if err != nil {
		t.Fatalf("read slot %d: %v", idx, err)
	}
	return sl
}

// allSlotsFree checks that no slot was ever written (the whole pool is still zero).
func (s *sw) allSlotsFree(t *testing.T) {
	t.Helper()
	var zero bpf.XdpaggSlot
	for i := range uint32(poolSize) {
		if sl := s.slot(t, i); sl != zero {
			t.Errorf("slot %d was touched: %+v", i, slotSummary(sl))
		}
	}
}

// runProg runs prog on the frame and returns the verdict and output frame.
func runProg(t *testing.T, prog *ebpf.Program, in []byte) (uint32, []byte) {
	t.Helper()
	opts := &ebpf.RunOptions{Data: in, DataOut: make([]byte, len(in)+512)}
	ret, err := prog.Run(opts)
	skipIfUnsupported(t, "BPF_PROG_TEST_RUN", err)
	return ret, opts.DataOut
}

func (s *sw) run(t *testing.T, f frame) (uint32, []byte) {
	t.Helper()
	return runProg(t, s.Objects.XdpaggSwitch, f.bytes())
}

// runExpect runs the switch on f and checks the verdict.
func (s *sw) runExpect(t *testing.T, f frame, verdict uint32) []byte {
	t.Helper()
	got, out := s.run(t, f)
	if got != verdict {
		t.Fatalf("verdict %s, want %s", verdictName(got), verdictName(verdict))
	}
	return out
}

type slotView struct {
	State, Counter, FanIn, Scale uint8
	Job, Seq, Bitmap             uint32
	Nvals, Flags                 uint16
}

func slotSummary(s bpf.XdpaggSlot) slotView {
	return slotView{
		State: s.State, Counter: s.Counter, FanIn: s.FanIn, Scale: s.ScaleLog2,
		Job: s.JobId, Seq: s.Seq, Bitmap: s.Bitmap, Nvals: s.Nvals, Flags: s.Flags,
	}
}

// expectSlot checks a slot's fields and that vals[:len(vals)] are vals and the rest is zero.
// chunk is XAGG_CHUNK, the switch adder's lanes per pass.
const chunk = 32

func expectSlot(t *testing.T, got bpf.XdpaggSlot, want slotView, vals []int32) {
	t.Helper()
	if g := slotSummary(got); g != want {
		t.Errorf("slot: got %+v\n\t\twant %+v", g, want)
	}
	// Lanes of the fragment's chunks must match (zero past its values); lanes of chunks past the
	// fragment are never read and may hold an older fragment's values.
	lanes := (int(got.Nvals) + chunk - 1) / chunk * chunk
	for i, v := range got.Vals[:lanes] {
		w := int32(0)
		if i < len(vals) {
			w = vals[i]
		}
		if v != w {
			t.Errorf("slot vals[%d] = %d, want %d (vals %v...)", i, v, w, got.Vals[:max(len(vals), 8)])
			return
		}
	}
}

func equalVals(t *testing.T, what string, got, want []int32) {
	t.Helper()
	if len(got) != len(want) {
		t.Errorf("%s: %d values %v, want %d values %v", what, len(got), got, len(want), want)
		return
	}
	for i := range got {
		if got[i] != want[i] {
			t.Errorf("%s: values %v, want %v", what, got, want)
			return
		}
	}
}

// expectUnchangedBut compares out with in, allowing differences only inside the given byte ranges.
func expectUnchangedBut(t *testing.T, out, in []byte, ranges ...[2]int) {
	t.Helper()
	if len(out) != len(in) {
		t.Fatalf("output frame %d bytes, input %d", len(out), len(in))
	}
outer:
	for i := range in {
		for _, r := range ranges {
			if i >= r[0] && i < r[1] {
				continue outer
			}
		}
		if out[i] != in[i] {
			t.Errorf("output byte %d = %#02x, input had %#02x (only %v may change)", i, out[i], in[i], ranges)
			return
		}
	}
}

var (
	rangeUDPCsum = [2]int{offUDP + 6, offUDP + 8}
	rangeFlags   = [2]int{offHdr + 4, offHdr + 6}
)

func mkVals(n int, f func(i int) int32) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = f(i)
	}
	return out
}

func sum(a, b []int32) []int32 {
	out := make([]int32, len(a))
	for i := range a {
		out[i], _ = wrapAddOvf(a[i], b[i])
	}
	return out
}

// wrapAddOvf is the switch's int32 addition: two's-complement wrap-around, and whether it
// overflowed. The switch only flags an overflow (the sum is then invalid whatever it holds and is
// repaired at the PS), so it need not saturate.
func wrapAddOvf(a, b int32) (int32, bool) {
	r := int64(a) + int64(b)
	return int32(r), r > math.MaxInt32 || r < math.MinInt32
}
