package hostlib

import (
	"context"
	"encoding/binary"
	"errors"
	"math"
	"net"
	"net/netip"
	"reflect"
	"runtime"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/wire"
)

// psBench is a PS with a socket standing in for the switch (results arrive there) and one for
// workers (data leaves from it; unicast re-sends come back to it).
type psBench struct {
	ps     *PS
	sw     *net.UDPConn
	worker *net.UDPConn
}

// benchJob is a job of a psBench's PS: every one of its fan worker ids sends from the bench's
// worker socket.
type benchJob struct {
	id  uint32
	fan int
}

// newPSBench starts the PS for jobs (none: an Open PS), then applies mod to its config.
func newPSBench(t *testing.T, mod func(*PSConfig), jobs ...benchJob) *psBench {
	t.Helper()
	b := &psBench{sw: blackHoleConn(t), worker: blackHoleConn(t)}
	cfg := PSConfig{Listen: netip.AddrPortFrom(loopback, freePort(t)), Switch: b.sw.LocalAddr().(*net.UDPAddr).AddrPort(),
		Open: len(jobs) == 0}
	for _, j := range jobs {
		pj := PSJob{ID: j.id}
		for range j.fan {
			pj.Workers = append(pj.Workers, b.worker.LocalAddr().(*net.UDPAddr).AddrPort())
		}
		cfg.Jobs = append(cfg.Jobs, pj)
	}
	if mod != nil {
		mod(&cfg)
	}
	ps, err := NewPS(cfg)
	if err != nil {
		t.Fatal(err)
	}
	b.ps = ps
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ps.Serve(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Errorf("Serve: %v, want context.Canceled", err)
		}
		ps.Close()
	})
	return b
}

type dataPkt struct {
	job, seq    uint32
	enc         uint8
	worker, fan uint8
	flags       uint16
	scale       uint8
	vals        []uint32
}

func (d dataPkt) bytes() []byte {
	h := wire.Header{Version: wire.Version, Type: wire.MsgData, Encoding: d.enc, ScaleLog2: d.scale, Flags: d.flags,
		Count: uint16(len(d.vals)), JobId: d.job, Seq: d.seq, AggIndex: 5, FanIn0: d.fan, WorkerId: d.worker,
		Bitmap0: 1 << d.worker}
	if d.flags&wire.FlagLevel1 != 0 {
		h.Bitmap0, h.FanIn0, h.Bitmap1, h.FanIn1 = 1, 1, 1<<d.worker, d.fan
	}
	b := make([]byte, wire.HdrSize+4*len(d.vals))
	wire.EncodeHeader(b, &h)
	for i, v := range d.vals {
		binary.LittleEndian.PutUint32(b[wire.HdrSize+4*i:], v)
	}
	return b
}

func (b *psBench) send(t *testing.T, pkts ...[]byte) {
	t.Helper()
	for _, p := range pkts {
		if _, err := b.worker.WriteToUDPAddrPort(p, b.ps.LocalAddr()); err != nil {
			t.Fatal(err)
		}
	}
}

// recv reads one result from c.
func recvResult(t *testing.T, c *net.UDPConn) (wire.Header, []uint32) {
	t.Helper()
	buf := make([]byte, 2048)
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second)) // a hang guard, not a timing assertion
	n, err := c.Read(buf)
	if err != nil {
		t.Fatal(err)
	}
	h, vals, err := wire.ParsePacket(buf[:n])
	if err != nil || h.Type != wire.MsgResult {
		t.Fatalf("not a result: %+v %v", h, err)
	}
	out := make([]uint32, h.Count)
	for i := range out {
		out[i] = binary.LittleEndian.Uint32(vals[4*i:])
	}
	return h, out
}

func i32s(vs ...int32) []uint32 {
	out := make([]uint32, len(vs))
	for i, v := range vs {
		out[i] = uint32(v)
	}
	return out
}

func TestPSSumsDedupsAndResends(t *testing.T) {
	b := newPSBench(t, nil, benchJob{5, 3})
	d := dataPkt{job: 5, seq: 1, enc: wire.EncFixed32, fan: 3, scale: 24}
	w := func(id uint8, flags uint16, vs ...int32) []byte {
		p := d
		p.worker, p.flags, p.vals = id, flags, i32s(vs...)
		return p.bytes()
	}
	b.send(t, w(0, 0, 1, -2, 3), w(0, wire.FlagResend, 1, -2, 3), w(1, wire.FlagECN, 10, 20, 30), w(2, wire.FlagCollision, 100, 200, -300))
	h, vals := recvResult(t, b.sw)
	want := wire.Header{Version: wire.Version, Type: wire.MsgResult, Encoding: wire.EncFixed32, ScaleLog2: 24,
		Flags: wire.FlagECN | wire.FlagCollision, Count: 3, JobId: 5, Seq: 1, AggIndex: 5, Bitmap0: 7, FanIn0: 3}
	if h != want || vals[0] != 111 || int32(vals[1]) != 218 || int32(vals[2]) != -267 {
		t.Fatalf("result %+v %v,\nwant %+v [111 218 -267]", h, vals, want)
	}
	// A worker that missed the broadcast resends: the PS answers it alone, F_SHADOW.
	b.send(t, w(1, wire.FlagResend, 10, 20, 30))
	h, vals2 := recvResult(t, b.worker)
	want.Flags |= wire.FlagShadow
	if h != want || vals2[0] != vals[0] || vals2[2] != vals[2] {
		t.Fatalf("re-sent result %+v %v, want %+v", h, vals2, want)
	}
	s := b.ps.Stats()
	if s != (PSStats{Received: 5, Aggregated: 3, Duplicates: 2, Completed: 1, ResultsResent: 1}) {
		t.Fatalf("stats %+v", s)
	}
}

func TestPSFixedOverflow(t *testing.T) {
	b := newPSBench(t, nil, benchJob{5, 2})
	// The sum leaves int32: saturated values and F_OVERFLOW.
	big := dataPkt{job: 5, seq: 2, enc: wire.EncFixed32, fan: 2, scale: 24}
	b0, b1 := big, big
	b0.vals, b1.worker, b1.vals = i32s(math.MaxInt32, math.MinInt32, 5), 1, i32s(1, -1, 5)
	b.send(t, b0.bytes(), b1.bytes())
	h, vals := recvResult(t, b.sw)
	if h.Flags&wire.FlagOverflow == 0 || int32(vals[0]) != math.MaxInt32 || int32(vals[1]) != math.MinInt32 || vals[2] != 10 {
		t.Fatalf("saturated result %+v %v", h, vals)
	}
	// A contribution that could not be quantised taints the sum even if it fits.
	b0.seq, b1.seq, b0.flags = 3, 3, wire.FlagOverflow
	b.send(t, b0.bytes(), b1.bytes())
	if h, _ := recvResult(t, b.sw); h.Flags&wire.FlagOverflow == 0 {
		t.Fatalf("result %+v lacks F_OVERFLOW", h)
	}
	if s := b.ps.Stats(); s.Overflows != 2 || s.Completed != 2 {
		t.Fatalf("stats %+v", s)
	}
}

func TestPSFloatRepairIsExact(t *testing.T) {
	b := newPSBench(t, nil, benchJob{9, 5})
	xs := []float32{0x1p100, 0x1p47, 0x1p-10, -0x1p100, -0x1p47}
	for i, x := range xs {
		// The repair packets carry F_OVERFLOW; the float result must not (nothing to repair).
		d := dataPkt{job: 9, seq: 4, enc: wire.EncFloat32, fan: 5, worker: uint8(i), flags: wire.FlagOverflow,
			vals: []uint32{math.Float32bits(x), math.Float32bits(float32(i))}}
		b.send(t, d.bytes())
	}
	h, vals := recvResult(t, b.sw)
	if h.Encoding != wire.EncFloat32 || h.Flags != 0 || h.Bitmap0 != 31 {
		t.Fatalf("float result header %+v", h)
	}
	if got := math.Float32frombits(vals[0]); got != 0x1p-10 {
		t.Fatalf("float sum = %g, want 2^-10", got)
	}
	if got := math.Float32frombits(vals[1]); got != 10 {
		t.Fatalf("float sum = %g, want 10", got)
	}
}

func TestPSLevel1(t *testing.T) {
	b := newPSBench(t, nil, benchJob{2, 2})
	for i := uint8(0); i < 2; i++ {
		d := dataPkt{job: 2, seq: 8, enc: wire.EncFixed32, fan: 2, worker: i, flags: wire.FlagLevel1, vals: i32s(int32(i) + 1)}
		b.send(t, d.bytes())
	}
	h, vals := recvResult(t, b.sw)
	if h.Flags != wire.FlagLevel1 || h.Bitmap1 != 3 || h.FanIn1 != 2 || vals[0] != 3 {
		t.Fatalf("level-1 result %+v %v", h, vals)
	}
}

func TestPSMalformed(t *testing.T) {
	b := newPSBench(t, nil, benchJob{5, 2})
	d := dataPkt{job: 5, seq: 1, enc: wire.EncFixed32, fan: 2, scale: 24, vals: i32s(1, 2)}
	res := d.bytes()
	res[wire.OffType] = wire.MsgResult
	other := d
	other.worker, other.vals = 1, i32s(1) // count disagrees with the aggregation
	scale := d
	scale.worker, scale.scale = 1, 20 // fixed-point scale disagrees
	sparse := d
	sparse.enc = wire.EncSparseKV
	b.send(t, []byte("hello"), res, d.bytes(), other.bytes(), scale.bytes(), sparse.bytes(), make([]byte, 4000))
	waitFor(t, func() bool { s := b.ps.Stats(); return s.Received == 7 && psSettled(s) })
	if s := b.ps.Stats(); s.Malformed != 5 || s.Unsupported != 1 || s.Aggregated != 1 {
		t.Fatalf("stats %+v: want 5 malformed, 1 unsupported (sparse), 1 aggregated", s)
	}
}

func TestPSBoundedMemory(t *testing.T) {
	// The third send must find the table full, not already emptied by eviction: StaleAfter is far
	// above any delay a loaded machine puts between the PS's handling of three packets sent back
	// to back (300 ms was not), at the cost of waiting that long for the stale eviction below.
	b := newPSBench(t, func(c *PSConfig) { c.MaxEntries = 2; c.StaleAfter = 2 * time.Second })
	for seq := uint32(0); seq < 3; seq++ {
		d := dataPkt{job: 5, seq: seq, enc: wire.EncFixed32, fan: 2, vals: i32s(1)}
		b.send(t, d.bytes())
	}
	// Two aggregations in progress fill the table: the third fragment is dropped, and the stale
	// ones go on the next eviction tick.
	waitFor(t, func() bool { return b.ps.Stats().Stale == 2 })
	if s := b.ps.Stats(); s.Dropped != 1 || s.Aggregated != 2 {
		t.Fatalf("stats %+v: want 1 dropped, 2 aggregated", s)
	}
	// Completed results make room for new aggregations, oldest first.
	for seq := uint32(10); seq < 13; seq++ {
		d := dataPkt{job: 5, seq: seq, enc: wire.EncFixed32, fan: 1, vals: i32s(int32(seq))}
		b.send(t, d.bytes())
		if _, vals := recvResult(t, b.sw); vals[0] != seq {
			t.Fatalf("seq %d: result %v", seq, vals)
		}
	}
	if s := b.ps.Stats(); s.Dropped != 1 || s.Completed != 3 {
		t.Fatalf("stats %+v", s)
	}
}

func TestPSConfig(t *testing.T) {
	c := PSConfig{Listen: netip.MustParseAddrPort("10.0.0.2:0"), Switch: netip.MustParseAddrPort("10.0.0.1:0")}.WithDefaults()
	want := PSConfig{Listen: netip.MustParseAddrPort("10.0.0.2:9510"), Switch: netip.MustParseAddrPort("10.0.0.1:9510"),
		Shards: runtime.NumCPU(), ResultTTL: 5 * time.Second, StaleAfter: 30 * time.Second, SocketBuffer: 8 << 20, MaxEntries: 16384}
	if !reflect.DeepEqual(c, want) {
		t.Fatalf("defaults %+v, want %+v", c, want)
	}
	// Jobs are copied and their addresses unmapped, never aliased.
	in := []PSJob{{ID: 3, Workers: []netip.AddrPort{netip.MustParseAddrPort("[::ffff:10.0.0.3]:9600")}}}
	c = PSConfig{Listen: want.Listen, Switch: want.Switch, Jobs: in}.WithDefaults()
	if got := c.Jobs[0].Workers[0]; got != netip.MustParseAddrPort("10.0.0.3:9600") || &c.Jobs[0] == &in[0] {
		t.Fatalf("WithDefaults Jobs %+v (input %+v)", c.Jobs, in)
	}
	if err := c.Validate(); err != nil {
		t.Fatalf("one admitted job: %v", err)
	}

	w := func(n int) []netip.AddrPort {
		out := make([]netip.AddrPort, n)
		for i := range out {
			out[i] = netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 0, 1, byte(i + 1)}), 9600)
		}
		return out
	}
	job := func(id uint32, ws ...netip.AddrPort) PSJob { return PSJob{ID: id, Workers: ws} }
	for name, bad := range map[string]PSConfig{
		"Listen":          {Listen: netip.MustParseAddrPort("[::1]:1"), Switch: want.Switch, Open: true},
		"Switch":          {Listen: want.Listen, Open: true},
		"ResultTTL":       {Listen: want.Listen, Switch: want.Switch, ResultTTL: -1, Open: true},
		"MaxEntries":      {Listen: want.Listen, Switch: want.Switch, MaxEntries: -1, Open: true},
		"Shards":          {Listen: want.Listen, Switch: want.Switch, Shards: -1, Open: true},
		"no Jobs":         {Listen: want.Listen, Switch: want.Switch},
		"Open with Jobs":  {Listen: want.Listen, Switch: want.Switch, Open: true, Jobs: []PSJob{job(1, w(1)...)}},
		"job id 0":        {Listen: want.Listen, Switch: want.Switch, Jobs: []PSJob{job(0, w(1)...)}},
		"job twice":       {Listen: want.Listen, Switch: want.Switch, Jobs: []PSJob{job(1, w(1)...), job(1, w(2)...)}},
		"no workers":      {Listen: want.Listen, Switch: want.Switch, Jobs: []PSJob{job(1)}},
		"33 workers":      {Listen: want.Listen, Switch: want.Switch, Jobs: []PSJob{job(1, w(33)...)}},
		"IPv6 worker":     {Listen: want.Listen, Switch: want.Switch, Jobs: []PSJob{job(1, netip.MustParseAddrPort("[::1]:9600"))}},
		"no worker addr":  {Listen: want.Listen, Switch: want.Switch, Jobs: []PSJob{job(1, w(1)[0], netip.AddrPort{})}},
		"0.0.0.0 worker":  {Listen: want.Listen, Switch: want.Switch, Jobs: []PSJob{job(1, netip.MustParseAddrPort("0.0.0.0:9600"))}},
		"share below one": {Listen: want.Listen, Switch: want.Switch, MaxEntries: 1, Jobs: []PSJob{job(1, w(1)...), job(2, w(1)...)}},
	} {
		if _, err := NewPS(bad); !errors.Is(err, ErrConfig) {
			t.Errorf("%s: NewPS(%+v): %v, want ErrConfig", name, bad, err)
		}
	}
}

func TestPSServeLifecycle(t *testing.T) {
	ps, err := NewPS(PSConfig{Listen: netip.AddrPortFrom(loopback, freePort(t)), Switch: netip.AddrPortFrom(loopback, 9), Open: true})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- ps.Serve(context.Background()) }()
	waitFor(t, func() bool { return ps.serving.Load() })
	if err := ps.Serve(context.Background()); !errors.Is(err, ErrBusy) {
		t.Errorf("second Serve: %v, want ErrBusy", err)
	}
	if err := ps.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; !errors.Is(err, ErrClosed) {
		t.Fatalf("Serve after Close: %v, want ErrClosed", err)
	}
	if err := ps.Serve(context.Background()); !errors.Is(err, ErrClosed) {
		t.Fatalf("Serve on a closed PS: %v, want ErrClosed", err)
	}
}

// The PS completes a job's fragments at its threshold H, as the switch does: H distinct workers,
// the sum of exactly them (bitmap), and a late contribution gets that result back alone
// (F_SHADOW) without being added. SetThreshold changes H while the PS runs.
func TestPSThreshold(t *testing.T) {
	b := newPSBench(t, func(c *PSConfig) { c.Jobs[0].Threshold = 2 }, benchJob{5, 4})
	w := func(seq uint32, id uint8, vs ...int32) []byte {
		return dataPkt{job: 5, seq: seq, enc: wire.EncFixed32, fan: 4, scale: 24, worker: id, vals: i32s(vs...)}.bytes()
	}
	b.send(t, w(1, 3, 1, 2), w(1, 1, 10, 20))
	h, vals := recvResult(t, b.sw)
	if h.Bitmap0 != 0b1010 || h.Seq != 1 || vals[0] != 11 || vals[1] != 22 {
		t.Fatalf("H=2 result %+v %v, want bitmap 0b1010 [11 22]", h, vals)
	}
	b.send(t, w(1, 0, 100, 200)) // the slow worker
	h, vals = recvResult(t, b.worker)
	if h.Flags&wire.FlagShadow == 0 || h.Bitmap0 != 0b1010 || vals[0] != 11 || vals[1] != 22 {
		t.Fatalf("late contribution's answer %+v %v, want the H=2 result with F_SHADOW", h, vals)
	}
	if err := b.ps.SetThreshold(5, 5); !errors.Is(err, ErrThreshold) {
		t.Fatalf("SetThreshold(5) of 4 workers: %v", err)
	}
	if err := b.ps.SetThreshold(6, 1); !errors.Is(err, ErrThreshold) {
		t.Fatalf("SetThreshold of a job the PS does not serve: %v", err)
	}
	if err := b.ps.SetThreshold(5, 0); err != nil { // back to synchronous
		t.Fatal(err)
	}
	b.send(t, w(2, 0, 1), w(2, 1, 2), w(2, 2, 4))
	b.send(t, w(2, 3, 8))
	h, vals = recvResult(t, b.sw)
	if h.Bitmap0 != 0b1111 || vals[0] != 15 {
		t.Fatalf("H=0 result %+v %v, want every worker [15]", h, vals)
	}
	if s := b.ps.Stats(); s.Completed != 2 || s.Duplicates != 1 || s.ResultsResent != 1 || s.Aggregated != 6 {
		t.Fatalf("stats %+v", s)
	}
}
