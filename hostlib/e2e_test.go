package hostlib

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/big"
	"math/rand/v2"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/wire"
)

const K = wire.StdValues // the workers' default ValuesPerPacket

var loopback = netip.MustParseAddr("127.0.0.1")

// freePort returns a UDP port on loopback that was free a moment ago: the PS's Listen port 0
// means "the default agg port", so tests pick a port themselves.
func freePort(t testing.TB) uint16 {
	t.Helper()
	c, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	return uint16(c.LocalAddr().(*net.UDPAddr).Port)
}

// fakeSwitch stands in for the XDP switch's broadcast: every RESULT it receives (from the PS) goes
// out to every worker's address, each copy dropped with probability drop. Like the switch, it
// sends them with the PS's address and port as source: through the PS's own socket (out), since
// workers take results from nowhere else.
type fakeSwitch struct {
	conn    *net.UDPConn
	out     *net.UDPConn // a socket bound to the PS's address (the PS's own)
	workers []netip.AddrPort
	drop    float64
	rng     *rand.Rand
	done    chan struct{}

	mu      sync.Mutex
	results int
	dropped int
}

func newFakeSwitch(t testing.TB, drop float64, seed uint64) *fakeSwitch {
	t.Helper()
	c, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadBuffer(8 << 20)
	return &fakeSwitch{conn: c, drop: drop, rng: rand.New(rand.NewPCG(seed, 99)), done: make(chan struct{})}
}

func (s *fakeSwitch) addr() netip.AddrPort { return s.conn.LocalAddr().(*net.UDPAddr).AddrPort() }

func (s *fakeSwitch) run() {
	defer close(s.done)
	buf := make([]byte, 2048)
	for {
		n, _, err := s.conn.ReadFromUDPAddrPort(buf)
		if err != nil {
			return
		}
		h, _, err := wire.ParsePacket(buf[:n])
		if err != nil || h.Type != wire.MsgResult {
			continue
		}
		s.mu.Lock()
		s.results++
		for _, w := range s.workers {
			if s.rng.Float64() < s.drop {
				s.dropped++
				continue
			}
			_, _ = s.out.WriteToUDPAddrPort(buf[:n], w)
		}
		s.mu.Unlock()
	}
}

func (s *fakeSwitch) close() {
	s.conn.Close()
	<-s.done
}

// cluster is a PS, a fake switch and W workers of one job on loopback.
type cluster struct {
	ps      *PS
	sw      *fakeSwitch
	workers []*Worker
	psErr   chan error
}

type clusterOpts struct {
	w        int
	drop     float64
	job      uint32
	pool     uint32
	window   int
	psConfig func(*PSConfig)
}

func newCluster(t testing.TB, o clusterOpts) *cluster {
	t.Helper()
	if o.job == 0 {
		o.job = 42
	}
	c := &cluster{sw: newFakeSwitch(t, o.drop, uint64(o.w)), psErr: make(chan error, 1)}
	// The workers first (on ports of their own), so that the PS can admit exactly them.
	listen := netip.AddrPortFrom(loopback, freePort(t))
	job := PSJob{ID: o.job}
	for i := 0; i < o.w; i++ {
		wk, err := NewWorker(WorkerConfig{JobID: o.job, WorkerID: uint8(i), NumWorkers: uint8(o.w),
			Local: netip.AddrPortFrom(loopback, 0), PS: listen, PoolSize: o.pool, Window: o.window})
		if err != nil {
			t.Fatal(err)
		}
		c.workers = append(c.workers, wk)
		c.sw.workers = append(c.sw.workers, wk.LocalAddr())
		job.Workers = append(job.Workers, wk.LocalAddr())
	}
	pscfg := PSConfig{Listen: listen, Switch: c.sw.addr(), Jobs: []PSJob{job}}
	if o.psConfig != nil {
		o.psConfig(&pscfg)
	}
	ps, err := NewPS(pscfg)
	if err != nil {
		for _, w := range c.workers {
			w.Close()
		}
		t.Fatal(err)
	}
	c.ps = ps
	c.sw.out = ps.socks[0].bc.conn
	ctx, cancel := context.WithCancel(context.Background())
	go func() { c.psErr <- ps.Serve(ctx) }()
	go c.sw.run()
	t.Cleanup(func() {
		for _, w := range c.workers {
			if err := w.Close(); err != nil {
				t.Errorf("close worker: %v", err)
			}
		}
		cancel()
		if err := <-c.psErr; !errors.Is(err, context.Canceled) {
			t.Errorf("Serve returned %v, want context.Canceled", err)
		}
		if err := ps.Close(); err != nil {
			t.Errorf("close PS: %v", err)
		}
		c.sw.close()
	})
	return c
}

// allReduce runs AllReduce on every worker at once with in[i] as worker i's tensor.
func (c *cluster) allReduce(ctx context.Context, in [][]float32) error {
	var wg sync.WaitGroup
	errs := make([]error, len(in))
	for i, w := range c.workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := w.AllReduce(ctx, in[i]); err != nil {
				errs[i] = fmt.Errorf("worker %d: %w", i, err)
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// tensors returns w tensors of n values from gen and the float64 sum of each element.
func tensors(w, n int, seed uint64, gen func(r *rand.Rand, j int) float32) ([][]float32, []float64) {
	r := rand.New(rand.NewPCG(seed, 1))
	in := make([][]float32, w)
	ref := make([]float64, n)
	for i := range in {
		in[i] = make([]float32, n)
		for j := range in[i] {
			in[i][j] = gen(r, j)
			ref[j] += float64(in[i][j])
		}
	}
	return in, ref
}

func uniform(r *rand.Rand, _ int) float32 { return float32(r.Float64()*2 - 1) }

// checkBound checks every worker's result against the reference within the bound of fixed.go,
// and that all workers hold bitwise the same tensor.
func checkBound(t *testing.T, got [][]float32, ref []float64, scale uint8) {
	t.Helper()
	w := float64(len(got))
	bad := 0
	for i, g := range got {
		for j, v := range g {
			// W*2^-(s+1) for quantisation, half an ulp for the float32 result, and a hair for
			// the float64 reference's own rounding.
			tol := w*math.Ldexp(1, -int(scale)-1) + halfULP32(ref[j]) + math.Abs(ref[j])*0x1p-50
			if d := math.Abs(float64(v) - ref[j]); !(d <= tol) {
				if bad < 5 {
					t.Errorf("worker %d element %d: got %v, want %v ± %g", i, j, v, ref[j], tol)
				}
				bad++
			}
			if math.Float32bits(v) != math.Float32bits(got[0][j]) {
				if bad < 5 {
					t.Errorf("worker %d element %d: %v differs from worker 0's %v", i, j, v, got[0][j])
				}
				bad++
			}
		}
	}
	if bad > 0 {
		t.Fatalf("%d wrong elements", bad)
	}
}

func TestAllReduceLoopback(t *testing.T) {
	sizes := []int{1, K - 1, K, K + 1, 100000}
	for _, w := range []int{1, 2, 4} {
		t.Run(fmt.Sprintf("W=%d", w), func(t *testing.T) {
			c := newCluster(t, clusterOpts{w: w})
			// Back to back on one cluster: the job's sequence carries over between calls.
			for round := 0; round < 2; round++ {
				for _, n := range sizes {
					in, ref := tensors(w, n, uint64(1000*w+n+round), uniform)
					ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
					err := c.allReduce(ctx, in)
					cancel()
					if err != nil {
						t.Fatalf("n=%d: %v", n, err)
					}
					checkBound(t, in, ref, DefaultScaleLog2)
				}
			}
			var frags uint64
			for _, n := range sizes {
				frags += 2 * uint64((n+K-1)/K)
			}
			for i, wk := range c.workers {
				s := wk.Stats()
				if s.ResultsReceived != frags || s.Malformed != 0 || s.OverflowRepairs != 0 {
					t.Errorf("worker %d: %+v, want %d results", i, s, frags)
				}
				if s.ResultsFromPS != s.ResultsReceived {
					t.Errorf("worker %d: %d of %d results from the PS, want all (there is no switch)", i, s.ResultsFromPS, s.ResultsReceived)
				}
			}
			if s := c.ps.Stats(); s.Completed != frags || s.Malformed != 0 || s.Overflows != 0 {
				t.Errorf("PS: %+v, want %d completed", s, frags)
			}
			// An empty tensor is a no-op.
			if err := c.workers[0].AllReduce(context.Background(), nil); err != nil {
				t.Errorf("empty AllReduce: %v", err)
			}
		})
	}
}

// exactF32 is the correctly rounded float32 of the exact sum of xs.
func exactF32(xs ...float32) float32 {
	s := new(big.Float).SetPrec(2000)
	for _, x := range xs {
		s.Add(s, big.NewFloat(float64(x)))
	}
	f, _ := s.Float32()
	return f
}

// Saturating fragments go through the PS's float32 repair and come out exact.
func TestAllReduceOverflowRepair(t *testing.T) {
	for _, w := range []int{2, 4} {
		t.Run(fmt.Sprintf("W=%d", w), func(t *testing.T) {
			c := newCluster(t, clusterOpts{w: w})
			n := 5*K + 17
			// Every fragment starts with one of: a value that cannot be quantised at 2^24
			// (|x| >= 128), values that fit but whose sum does not, or a NaN-free mix; the rest
			// are ordinary. Element classes depend on the index only, so the float64 reference
			// is exact and float32(ref) is the correctly rounded exact sum.
			gen := func(r *rand.Rand, j int) float32 {
				switch {
				case j%K == 0 && (j/K)%2 == 0:
					return float32((r.Float64()*2 - 1) * 1e6) // value saturates
				case j%K == 0:
					return float32(100 + r.Float64()*20) // sum saturates (W >= 2)
				case j%K == 1:
					return float32(math.Round((r.Float64()*2-1)*1e6) / 8)
				}
				return float32(r.Float64()*2 - 1)
			}
			in, ref := tensors(w, n, uint64(w), gen)
			orig := make([][]float32, w)
			for i := range in {
				orig[i] = append([]float32(nil), in[i]...)
			}
			if err := c.allReduce(context.Background(), in); err != nil {
				t.Fatal(err)
			}
			col := make([]float32, w)
			for j := 0; j < n; j++ {
				for i := range orig {
					col[i] = orig[i][j]
				}
				exact := exactF32(col...)
				if want := float32(ref[j]); want != exact {
					t.Fatalf("test data: element %d: float32(float64 sum) %v is not the exact %v", j, want, exact)
				}
				for i := range in {
					if in[i][j] != exact {
						t.Fatalf("worker %d element %d: got %v, want exactly %v", i, j, in[i][j], exact)
					}
				}
			}
			frags := uint64((n + K - 1) / K)
			for i, wk := range c.workers {
				if s := wk.Stats(); s.OverflowRepairs != frags {
					t.Errorf("worker %d: %d overflow repairs, want %d", i, s.OverflowRepairs, frags)
				}
			}
			if s := c.ps.Stats(); s.Overflows != frags {
				t.Errorf("PS: %d overflows, want %d", s.Overflows, frags)
			}
			// The job goes on in fixed point afterwards.
			in, ref = tensors(w, 2*K, 77, uniform)
			if err := c.allReduce(context.Background(), in); err != nil {
				t.Fatal(err)
			}
			checkBound(t, in, ref, DefaultScaleLog2)
		})
	}
}

// Five workers whose sum defeats float64 Neumaier summation still get the exact result.
func TestAllReduceRepairIsExact(t *testing.T) {
	c := newCluster(t, clusterOpts{w: 5})
	vals := []float32{0x1p100, 0x1p47, 0x1p-10, -0x1p100, -0x1p47}
	in := make([][]float32, 5)
	for i := range in {
		in[i] = []float32{vals[i], float32(i)}
	}
	if err := c.allReduce(context.Background(), in); err != nil {
		t.Fatal(err)
	}
	for i := range in {
		if in[i][0] != 0x1p-10 || in[i][1] != 10 {
			t.Fatalf("worker %d: %v, want [2^-10 10]", i, in[i])
		}
	}
}

// Results lost on the way to workers are recovered by resends, answered by the PS's unicast.
func TestAllReduceLossyResults(t *testing.T) {
	const w = 4
	c := newCluster(t, clusterOpts{w: w, drop: 0.05, pool: 64, window: 8})
	for round, n := range []int{100000, K + 1, 3 * K} {
		in, ref := tensors(w, n, uint64(round), uniform)
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		err := c.allReduce(ctx, in)
		cancel()
		if err != nil {
			t.Fatalf("n=%d: %v", n, err)
		}
		checkBound(t, in, ref, DefaultScaleLog2)
	}
	var retrans, shadow uint64
	for _, wk := range c.workers {
		s := wk.Stats()
		retrans += s.Retransmits
		shadow += s.ShadowResults
	}
	ps := c.ps.Stats()
	c.sw.mu.Lock()
	dropped := c.sw.dropped
	c.sw.mu.Unlock()
	t.Logf("dropped %d results; worker retransmits %d, shadow results %d; PS %+v", dropped, retrans, shadow, ps)
	if dropped == 0 {
		t.Fatal("the fake switch dropped nothing: the test tested nothing")
	}
	if retrans == 0 || ps.ResultsResent == 0 || shadow == 0 {
		t.Errorf("losses were not recovered by resends: retransmits %d, PS re-sends %d, shadow results %d",
			retrans, ps.ResultsResent, shadow)
	}
}
