package hostlib

import (
	"context"
	"encoding/binary"
	"errors"
	"hash/fnv"
	"net"
	"net/netip"
	"reflect"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/wire"
)

func TestWorkerConfigDefaults(t *testing.T) {
	c := WorkerConfig{JobID: 1, NumWorkers: 2, PS: netip.MustParseAddrPort("[::ffff:10.0.0.1]:0")}.WithDefaults()
	want := WorkerConfig{JobID: 1, NumWorkers: 2, PS: netip.MustParseAddrPort("10.0.0.1:9510"),
		Local: netip.AddrPortFrom(netip.Addr{}, 0), PoolSize: 4096, Window: 64, ScaleLog2: 24,
		Timeout: 20 * time.Millisecond, MaxRetries: 50, SocketBuffer: 8 << 20, ValuesPerPacket: wire.StdValues}
	if !reflect.DeepEqual(c, want) {
		t.Fatalf("defaults:\n got %+v\nwant %+v", c, want)
	}
	if c := (WorkerConfig{PoolSize: 16}).WithDefaults(); c.Window != 8 {
		t.Errorf("Window default for a 16-slot pool = %d, want 8", c.Window)
	}
}

func TestWorkerConfigValidate(t *testing.T) {
	good := WorkerConfig{JobID: 1, WorkerID: 1, NumWorkers: 2, Local: netip.MustParseAddrPort("127.0.0.1:0"),
		PS: netip.MustParseAddrPort("127.0.0.1:9510")}.WithDefaults()
	if err := good.Validate(); err != nil {
		t.Fatalf("good config: %v", err)
	}
	bad := map[string]func(c *WorkerConfig){
		"JobID":       func(c *WorkerConfig) { c.JobID = 0 },
		"NumWorkers":  func(c *WorkerConfig) { c.NumWorkers = 33 },
		"WorkerID":    func(c *WorkerConfig) { c.WorkerID = 2 },
		"Local":       func(c *WorkerConfig) { c.Local = netip.MustParseAddrPort("[::1]:0") },
		"PS":          func(c *WorkerConfig) { c.PS = netip.MustParseAddrPort("0.0.0.0:9510") },
		"PoolSize":    func(c *WorkerConfig) { c.PoolSize = 1 },
		"2*Window":    func(c *WorkerConfig) { c.PoolSize, c.Window = 100, 51 },
		"Window":      func(c *WorkerConfig) { c.Window = -1 },
		"ScaleLog2":   func(c *WorkerConfig) { c.ScaleLog2 = 31 },
		"Timeout":     func(c *WorkerConfig) { c.Timeout = -time.Second },
		"MaxRetries":  func(c *WorkerConfig) { c.MaxRetries = -1 },
		"SocketBuffe": func(c *WorkerConfig) { c.SocketBuffer = -1 },
		"JobKey":      func(c *WorkerConfig) { c.JobKey = make([]byte, 16) },
	}
	for field, mutate := range bad {
		c := good
		mutate(&c)
		err := c.Validate()
		if !errors.Is(err, ErrConfig) {
			t.Errorf("%s: err = %v, want ErrConfig", field, err)
			continue
		}
		if !strings.Contains(err.Error(), field) {
			t.Errorf("%s: message %q does not name the field", field, err)
		}
		if _, err := NewWorker(c); !errors.Is(err, ErrConfig) {
			t.Errorf("%s: NewWorker err = %v, want ErrConfig", field, err)
		}
	}
}

// Every window of 2*Window consecutive fragments of a job lands on distinct slots inside the pool,
// also across the 32-bit wrap of the wire's seq.
func TestAggIndex(t *testing.T) {
	for _, c := range []struct {
		pool   uint32
		window int
	}{{4096, 64}, {16, 8}, {100, 3}, {2, 1}, {4096, 2048}} {
		for _, job := range []uint32{1, 7, 0xdeadbeef} {
			base := SlotBase(job, c.pool)
			if base >= c.pool {
				t.Fatalf("base %d outside pool %d", base, c.pool)
			}
			for _, start := range []uint64{0, 1<<32 - 5, 1<<32 - uint64(c.window), 12345} {
				seen := map[uint32]uint64{}
				for s := start; s < start+uint64(2*c.window); s++ {
					i := AggIndex(job, s, c.window, c.pool)
					if i >= c.pool {
						t.Fatalf("index %d outside pool %d", i, c.pool)
					}
					if prev, ok := seen[i]; ok {
						t.Fatalf("pool %d window %d job %d: seqs %d and %d share slot %d", c.pool, c.window, job, prev, s, i)
					}
					seen[i] = s
				}
			}
			if AggIndex(job, 0, c.window, c.pool) != base {
				t.Fatalf("seq 0 is not at the base")
			}
		}
	}
	// SlotBase is FNV-1a of the job id's little-endian bytes, as hash/fnv computes it.
	for _, job := range []uint32{1, 2, 0xdeadbeef, 1 << 31} {
		h := fnv.New32a()
		h.Write(binary.LittleEndian.AppendUint32(nil, job))
		if got, want := SlotBase(job, 4096), h.Sum32()%4096; got != want {
			t.Fatalf("SlotBase(%d) = %d, want %d", job, got, want)
		}
	}
}

// blackHole is a UDP socket that receives and never answers: a PS that is not there.
func blackHole(t *testing.T) netip.AddrPort {
	c, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c.LocalAddr().(*net.UDPAddr).AddrPort()
}

func newLoneWorker(t *testing.T, cfg WorkerConfig) *Worker {
	t.Helper()
	cfg.JobID, cfg.NumWorkers = 3, 2
	return newKeyedWorker(t, cfg)
}

func TestAllReduceTimeout(t *testing.T) {
	w := newLoneWorker(t, WorkerConfig{Timeout: time.Millisecond, MaxRetries: 3})
	err := w.AllReduce(context.Background(), make([]float32, 3*K))
	if !errors.Is(err, ErrTimeout) {
		t.Fatalf("err = %v, want ErrTimeout", err)
	}
	s := w.Stats()
	if s.Retransmits < 3 || s.DataSent != 3+s.Retransmits {
		t.Errorf("stats %+v: want 3 first sends and at least 3 resends", s)
	}
}

func TestAllReduceCanceled(t *testing.T) {
	w := newLoneWorker(t, WorkerConfig{})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- w.AllReduce(ctx, make([]float32, 10)) }()
	waitFor(t, func() bool { return w.Stats().DataSent > 0 })
	// The worker is busy: a second AllReduce must not interleave its fragments.
	if err := w.AllReduce(context.Background(), make([]float32, 10)); !errors.Is(err, ErrBusy) {
		t.Errorf("concurrent AllReduce: %v, want ErrBusy", err)
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
}

func TestAllReduceClosed(t *testing.T) {
	w := newLoneWorker(t, WorkerConfig{})
	done := make(chan error)
	go func() { done <- w.AllReduce(context.Background(), make([]float32, 10)) }()
	waitFor(t, func() bool { return w.Stats().DataSent > 0 })
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; !errors.Is(err, ErrClosed) {
		t.Fatalf("AllReduce after Close: %v, want ErrClosed", err)
	}
	if err := w.AllReduce(context.Background(), make([]float32, 10)); !errors.Is(err, ErrClosed) {
		t.Fatalf("AllReduce on a closed worker: %v, want ErrClosed", err)
	}
	if err := w.Close(); !errors.Is(err, ErrClosed) {
		t.Fatalf("second Close: %v, want ErrClosed", err)
	}
}

// waitFor polls cond: for state changes made by other goroutines, without asserting any timing.
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	for i := 0; !cond(); i++ {
		if i > 100000 {
			t.Fatal("condition never became true")
		}
		time.Sleep(100 * time.Microsecond)
	}
}

// The worker drops what is not a result of its job, and counts stale results as duplicates; the
// same datagrams from anywhere but its PS's address and port are dropped unread (Foreign). Over
// real sockets, so the source recvmmsg reports is what is checked.
func TestWorkerDropsForeignPackets(t *testing.T) {
	ps := blackHoleConn(t)
	w := newLoneWorker(t, WorkerConfig{PS: ps.LocalAddr().(*net.UDPAddr).AddrPort()})
	other, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)}) // same host, another port
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	_, data := validData(3) // a DATA packet of job 7: not a result, not our job
	res := append([]byte(nil), data...)
	res[wire.OffType] = wire.MsgResult
	res[wire.OffJob] = 3 // our job, but no AllReduce is running: a duplicate
	pkts := [][]byte{{1, 2, 3}, data, make([]byte, 3000), res}
	for _, c := range []*net.UDPConn{other, ps} {
		for _, b := range pkts {
			if _, err := c.WriteToUDPAddrPort(b, w.LocalAddr()); err != nil {
				t.Fatal(err)
			}
		}
	}
	waitFor(t, func() bool { s := w.Stats(); return s.Malformed+s.DuplicateResults+s.Foreign == 8 })
	if s := w.Stats(); s.Malformed != 3 || s.DuplicateResults != 1 || s.Foreign != 4 {
		t.Fatalf("stats %+v: want 3 malformed, 1 duplicate (from the PS), 4 foreign (from elsewhere)", s)
	}
}

func TestWorkerUsesItsSlots(t *testing.T) {
	ps := blackHoleConn(t)
	w := newLoneWorker(t, WorkerConfig{PS: ps.LocalAddr().(*net.UDPAddr).AddrPort(), PoolSize: 64, Window: 4, Timeout: time.Hour})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go w.AllReduce(ctx, make([]float32, 10*K))
	buf := make([]byte, 2048)
	for i := 0; i < 4; i++ { // the window: four fragments, then it waits for results
		n, err := ps.Read(buf)
		if err != nil {
			t.Fatal(err)
		}
		h, vals, err := wire.ParsePacket(buf[:n])
		if err != nil {
			t.Fatal(err)
		}
		want := wire.Header{Version: wire.Version, Type: wire.MsgData, Encoding: wire.EncFixed32, ScaleLog2: 24,
			Count: uint16(K), JobId: 3, Seq: uint32(i), AggIndex: AggIndex(3, uint64(i), 4, 64), Bitmap0: 1, Bitmap1: 4, FanIn0: 2}
		if h != want || len(vals) != 4*K {
			t.Fatalf("fragment %d header %+v, want %+v", i, h, want)
		}
	}
	_ = ps.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	if n, err := ps.Read(buf); err == nil {
		t.Fatalf("a fifth fragment (%d bytes) left before any result: the window is 4", n)
	}
}

func blackHoleConn(t *testing.T) *net.UDPConn {
	c, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// validData is a DATA packet of job 7 that the switch accepts, with n values.
func validData(n int) (wire.Header, []byte) {
	h := wire.Header{Version: wire.Version, Type: wire.MsgData, Encoding: wire.EncFixed32, ScaleLog2: 24,
		Count: uint16(n), JobId: 7, Seq: 9, AggIndex: 3, Bitmap0: 1 << 2, FanIn0: 4, WorkerId: 2}
	b := make([]byte, wire.HdrSize+4*n)
	wire.EncodeHeader(b, &h)
	for i := 0; i < n; i++ {
		binary.LittleEndian.PutUint32(b[wire.HdrSize+4*i:], uint32(i*1000-7))
	}
	return h, b
}

// WorkerConfig.BusyPoll reaches the socket: SO_BUSY_POLL in µs and SO_PREFER_BUSY_POLL; without
// it neither is set.
func TestWorkerBusyPoll(t *testing.T) {
	for _, bp := range []time.Duration{0, 50 * time.Microsecond} {
		w, err := NewWorker(WorkerConfig{JobID: 1, NumWorkers: 1, Local: netip.MustParseAddrPort("127.0.0.1:0"),
			PS: netip.MustParseAddrPort("127.0.0.1:9510"), BusyPoll: bp})
		if err != nil {
			t.Fatalf("NewWorker(BusyPoll %v): %v", bp, err)
		}
		var us, prefer int
		var gerr error
		if err := w.bc.rc.Control(func(fd uintptr) {
			us, gerr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_BUSY_POLL)
			if gerr == nil {
				prefer, gerr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_PREFER_BUSY_POLL)
			}
		}); err != nil || gerr != nil {
			t.Fatalf("getsockopt: %v %v", err, gerr)
		}
		w.Close()
		wantPrefer := 0
		if bp > 0 {
			wantPrefer = 1
		}
		if us != int(bp/time.Microsecond) || prefer != wantPrefer {
			t.Errorf("BusyPoll %v: SO_BUSY_POLL %d µs, SO_PREFER_BUSY_POLL %d; want %d, %d", bp, us, prefer, bp/time.Microsecond, wantPrefer)
		}
	}
}
