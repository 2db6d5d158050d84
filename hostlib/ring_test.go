package hostlib

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/wire"
)

// newRings makes w ranks of one ring on loopback. drop, if > 0, makes every rank lose that
// fraction of its outgoing packets (data and acks).
func newRings(t testing.TB, w int, drop float64, mod func(*RingConfig)) []*Ring {
	t.Helper()
	peers := make([]netip.AddrPort, w)
	for i := range peers {
		peers[i] = netip.AddrPortFrom(loopback, freePort(t))
	}
	rings := make([]*Ring, w)
	for i := range rings {
		cfg := RingConfig{Rank: i, Peers: peers}
		if mod != nil {
			mod(&cfg)
		}
		var hook func() bool
		if drop > 0 {
			rng := rand.New(rand.NewPCG(uint64(i), 7)) // used by rank i's loop goroutine only
			hook = func() bool { return rng.Float64() < drop }
		}
		r, err := newRing(cfg, hook)
		if err != nil {
			t.Fatal(err)
		}
		rings[i] = r
	}
	t.Cleanup(func() {
		for i, r := range rings {
			if err := r.Close(); err != nil && !errors.Is(err, ErrClosed) { // a test may have closed it
				t.Errorf("close rank %d: %v", i, err)
			}
		}
	})
	return rings
}

// ringAllReduce runs AllReduce on every rank at once, in[i] on rank i.
func ringAllReduce(ctx context.Context, rings []*Ring, in [][]float32) error {
	var wg sync.WaitGroup
	errs := make([]error, len(rings))
	for i, r := range rings {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := r.AllReduce(ctx, in[i]); err != nil {
				errs[i] = fmt.Errorf("rank %d: %w", i, err)
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// ringOrderSum emulates the ring's float32 arithmetic: element j lies in chunk c, and its sum
// starts with rank c's value and adds ranks c+1, c+2, ... in float32.
func ringOrderSum(in [][]float32) []float32 {
	w, n := len(in), len(in[0])
	out := make([]float32, n)
	q, rem := n/w, n%w
	for c := 0; c < w; c++ {
		lo := c*q + min(c, rem)
		hi := lo + q
		if c < rem {
			hi++
		}
		for j := lo; j < hi; j++ {
			acc := in[c][j]
			for k := 1; k < w; k++ {
				acc += in[(c+k)%w][j]
			}
			out[j] = acc
		}
	}
	return out
}

// checkRing checks that every rank holds bitwise the ring-order sum, which is also within
// float32 rounding of the float64 reference.
func checkRing(t *testing.T, got [][]float32, want []float32, ref []float64) {
	t.Helper()
	bad := 0
	for i, g := range got {
		for j, v := range g {
			if math.Float32bits(v) != math.Float32bits(want[j]) {
				if bad < 5 {
					t.Errorf("rank %d element %d: got %v, want %v (ring order)", i, j, v, want[j])
				}
				bad++
			}
		}
	}
	for j, v := range want {
		// W-1 float32 roundings of partial sums of values in [-1, 1).
		if d := math.Abs(float64(v) - ref[j]); d > float64(len(got))*0x1p-23 {
			if bad < 5 {
				t.Errorf("element %d: ring-order sum %v is %g from the float64 sum %v", j, v, d, ref[j])
			}
			bad++
		}
	}
	if bad > 0 {
		t.Fatalf("%d wrong elements", bad)
	}
}

func TestRingAllReduce(t *testing.T) {
	for _, w := range []int{2, 3, 4, 8} {
		t.Run(fmt.Sprintf("W=%d", w), func(t *testing.T) {
			rings := newRings(t, w, 0, nil)
			// Back to back on the same ranks, sizes changing: the seq space carries over.
			sizes := []int{1, w - 1, 359, 360, 361, 100003, 7}
			var recv uint64
			for round, n := range sizes {
				in, ref := tensors(w, n, uint64(100*w+round), uniform)
				want := ringOrderSum(in)
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				err := ringAllReduce(ctx, rings, in)
				cancel()
				if err != nil {
					t.Fatalf("n=%d: %v", n, err)
				}
				checkRing(t, in, want, ref)
				// Each chunk is received by W-1 ranks in each phase.
				for c := 0; c < w; c++ {
					recv += uint64(2*(w-1)) * uint64(rings[0].pieces(n/w+b2i(c < n%w)))
				}
			}
			var got uint64
			for i, r := range rings {
				s := r.Stats()
				got += s.DataReceived
				if s.Malformed != 0 || s.EarlyDropped != 0 {
					t.Errorf("rank %d: %+v", i, s)
				}
			}
			if got != recv {
				t.Errorf("%d packets applied over all ranks, want %d", got, recv)
			}
		})
	}
}

// Jumbo packets (the most values a packet may carry) work the same.
func TestRingValuesPerPacket(t *testing.T) {
	const w = 3
	for _, k := range []int{1, 7, wire.MaxValues} {
		rings := newRings(t, w, 0, func(c *RingConfig) { c.ValuesPerPacket = k })
		for _, n := range []int{1, 2, 3*k - 1, 3 * k, 3*k + 1, 5000} {
			in, ref := tensors(w, n, uint64(n), uniform)
			want := ringOrderSum(in)
			if err := ringAllReduce(context.Background(), rings, in); err != nil {
				t.Fatalf("K=%d n=%d: %v", k, n, err)
			}
			checkRing(t, in, want, ref)
		}
	}
}

// Many short calls in a row: ranks run ahead of their successors, whose next call's packets
// arrive early and wait in the stash.
func TestRingBackToBack(t *testing.T) {
	const w = 4
	rings := newRings(t, w, 0, nil)
	for round := 0; round < 50; round++ {
		n := 1 + round*97
		in, ref := tensors(w, n, uint64(round), uniform)
		want := ringOrderSum(in)
		if err := ringAllReduce(context.Background(), rings, in); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		checkRing(t, in, want, ref)
	}
	var early uint64
	for _, r := range rings {
		early += r.Stats().Early
	}
	t.Logf("%d packets arrived before their call started", early)
}

// A rank that joins late finds its predecessor's packets waiting (kept while idle, resent
// meanwhile): nothing is lost and nothing counted twice. The straggler's 30 ms are many 1 ms
// timeouts; MaxRetries puts the others' give-up (ErrTimeout after a stall of about 8 s) far
// beyond the straggler's lateness on a loaded machine (the default 50 gives up after 0.4 s).
func TestRingStraggler(t *testing.T) {
	const w = 3
	rings := newRings(t, w, 0, func(c *RingConfig) { c.Timeout = time.Millisecond; c.MaxRetries = 1000 })
	for round := 0; round < 3; round++ {
		in, ref := tensors(w, 5000, uint64(round), uniform)
		want := ringOrderSum(in)
		var wg sync.WaitGroup
		errs := make([]error, w)
		for i, r := range rings {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if i == round {
					time.Sleep(30 * time.Millisecond)
				}
				errs[i] = r.AllReduce(context.Background(), in[i])
			}()
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		checkRing(t, in, want, ref)
	}
}

func TestRingLossy(t *testing.T) {
	const w = 4
	rings := newRings(t, w, 0.05, func(c *RingConfig) { c.Timeout = 2 * time.Millisecond; c.Window = 64 })
	for round, n := range []int{100003, 361, 1, 3 * 360} {
		in, ref := tensors(w, n, uint64(round), uniform)
		want := ringOrderSum(in)
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		err := ringAllReduce(ctx, rings, in)
		cancel()
		if err != nil {
			t.Fatalf("n=%d: %v", n, err)
		}
		checkRing(t, in, want, ref)
	}
	var sent, resent uint64
	for i, r := range rings {
		s := r.Stats()
		t.Logf("rank %d: %+v", i, s)
		sent += s.DataSent
		resent += s.Retransmits
	}
	// Lost acks are mostly repaired by the next ack of the same block; lost data is resent.
	if resent == 0 {
		t.Errorf("no retransmissions in %d packets: the losses tested nothing", sent)
	}
}

func TestRingOneRank(t *testing.T) {
	rings := newRings(t, 1, 0, nil)
	data := []float32{1, 2, 3}
	if err := rings[0].AllReduce(context.Background(), data); err != nil || data[0] != 1 || data[2] != 3 {
		t.Fatalf("one rank: %v %v", data, err)
	}
}

func TestRingConfig(t *testing.T) {
	a, b := netip.MustParseAddrPort("10.0.0.1:9600"), netip.MustParseAddrPort("10.0.0.2:9600")
	c := RingConfig{Rank: 1, Peers: []netip.AddrPort{a, b}}.WithDefaults()
	if c.Timeout != DefaultTimeout || c.MaxRetries != DefaultMaxRetries || c.Window != DefaultRingWindow ||
		c.SocketBuffer != DefaultSocketBuffer || c.ID == 0 {
		t.Fatalf("defaults %+v", c)
	}
	if c2 := (RingConfig{Rank: 0, Peers: []netip.AddrPort{a, b}}).WithDefaults(); c2.ID != c.ID {
		t.Fatalf("ranks derive different IDs: %d, %d", c.ID, c2.ID)
	}
	for _, bad := range []RingConfig{
		{},
		{Rank: 2, Peers: []netip.AddrPort{a, b}},
		{Rank: -1, Peers: []netip.AddrPort{a, b}},
		{Peers: []netip.AddrPort{a, a}},
		{Peers: []netip.AddrPort{a, netip.MustParseAddrPort("10.0.0.2:0")}},
		{Peers: []netip.AddrPort{a, netip.MustParseAddrPort("[::1]:5")}},
		{Peers: []netip.AddrPort{a, b}, Window: -1},
		{Peers: []netip.AddrPort{a, b}, MaxRetries: -1},
		{Peers: make([]netip.AddrPort, 33)},
	} {
		if _, err := NewRing(bad); !errors.Is(err, ErrConfig) {
			t.Errorf("NewRing(%+v): %v, want ErrConfig", bad, err)
		}
	}
}

// A rank whose successor never joins the call gives up with ErrTimeout.
func TestRingTimeout(t *testing.T) {
	rings := newRings(t, 2, 0, func(c *RingConfig) { c.Timeout = time.Millisecond; c.MaxRetries = 3 })
	err := rings[0].AllReduce(context.Background(), make([]float32, 1000))
	if !errors.Is(err, ErrTimeout) {
		t.Fatalf("AllReduce alone: %v, want ErrTimeout", err)
	}
}

func TestRingCanceledAndClosed(t *testing.T) {
	rings := newRings(t, 2, 0, nil)
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- rings[0].AllReduce(ctx, make([]float32, 1000)) }()
	time.Sleep(5 * time.Millisecond)
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Fatalf("canceled AllReduce: %v, want context.Canceled", err)
	}
	go func() { errc <- rings[1].AllReduce(context.Background(), make([]float32, 1000)) }()
	time.Sleep(5 * time.Millisecond)
	if err := rings[1].Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; !errors.Is(err, ErrClosed) {
		t.Fatalf("AllReduce during Close: %v, want ErrClosed", err)
	}
	if err := rings[1].AllReduce(context.Background(), make([]float32, 10)); !errors.Is(err, ErrClosed) {
		t.Fatalf("AllReduce after Close: %v, want ErrClosed", err)
	}
	if err := rings[1].Close(); !errors.Is(err, ErrClosed) {
		t.Fatalf("second Close: %v, want ErrClosed", err)
	}
}

// A warmed-up AllReduce allocates nothing per packet.
func TestRingAllocs(t *testing.T) {
	const w = 2
	rings := newRings(t, w, 0, nil)
	in, _ := tensors(w, 20*360, 1, uniform)
	// Rank 1 runs in its own goroutine throughout; AllocsPerRun counts the whole process.
	start, finished := make(chan struct{}), make(chan error)
	go func() {
		for range start {
			finished <- rings[1].AllReduce(context.Background(), in[1])
		}
	}()
	defer close(start)
	run := func() {
		start <- struct{}{}
		if err := rings[0].AllReduce(context.Background(), in[0]); err != nil {
			t.Fatal(err)
		}
		if err := <-finished; err != nil {
			t.Fatal(err)
		}
		for i := range in { // keep the values from growing without bound
			for j := range in[i] {
				in[i][j] *= 0.5
			}
		}
	}
	for i := 0; i < 20; i++ {
		run()
	}
	// Waking a rank's loop for a call (a poke) and every retransmit or stall timer that fires
	// make its receive fail with a deadline error, which net allocates: at least one per rank and
	// call, more the longer a call takes on a loaded machine. allocsPerRun reports those apart.
	hot, wake := allocsPerRun(t, 50, run)
	t.Logf("%.2f allocations per AllReduce of %d packets per rank, and %.2f by wake-ups (not counted)", hot, 2*(w-1)*10, wake)
	// One per packet is the bug this catches.
	if hot >= 2*w+1 {
		t.Errorf("%.2f allocations per AllReduce, want about none", hot)
	}
}

// BenchmarkRingAllReduce measures loopback throughput of the ring: W ranks, 1 Mi values each.
func BenchmarkRingAllReduce(b *testing.B) {
	for _, w := range []int{2, 4} {
		b.Run(fmt.Sprintf("W=%d", w), func(b *testing.B) {
			rings := newRings(b, w, 0, nil)
			benchAllReduce(b, w, func(ctx context.Context, in [][]float32) error { return ringAllReduce(ctx, rings, in) })
		})
	}
}
