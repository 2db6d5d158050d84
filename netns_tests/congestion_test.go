package netns_tests

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/xdpagg/xdpagg/hostlib"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/netns_tests/testbed"
	"github.com/xdpagg/xdpagg/netns_tests/topo"
)

// The bottleneck of the congestion tests: worker 0's link towards the switch is shaped to
// linkRate (TBF on its eth0), and the switch's phantom queues mark at 90% of it.
const linkRate = 200_000_000 // bytes/s (1.6 Gbit/s): well above one fragment per round trip

// shape puts a TBF of rate bytes/s on h's eth0 (host -> switch).
func shape(t *testing.T, tp *topo.Topology, h *topo.Host, rate uint64) {
	t.Helper()
	if err := tp.InHost(h, func() error {
		l, err := netlink.LinkByName(h.Ifname)
		if err != nil {
			return err
		}
		q := &netlink.Tbf{
			QdiscAttrs: netlink.QdiscAttrs{LinkIndex: l.Attrs().Index, Handle: netlink.MakeHandle(1, 0), Parent: netlink.HANDLE_ROOT},
			Rate:       rate, Limit: 512 << 10, Buffer: 256 << 10,
		}
		return netlink.QdiscReplace(q)
	}); err != nil {
		t.Fatalf("shape %s: %v", h.Name, err)
	}
}

// bulkTCP runs a TCP flow from `from` to the PS host through the switch until stop is called.
func bulkTCP(t *testing.T, tp *topo.Topology, from *topo.Host) (stop func() uint64) {
	t.Helper()
	var ln net.Listener
	if err := tp.InHost(tp.PS, func() (err error) {
		ln, err = net.Listen("tcp4", netip.AddrPortFrom(tp.PS.IP, 5001).String())
		return err
	}); err != nil {
		t.Fatal(err)
	}
	var moved atomic.Uint64
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				buf := make([]byte, 64<<10)
				for {
					n, err := c.Read(buf)
					moved.Add(uint64(n))
					if err != nil {
						return
					}
				}
			}()
		}
	}()
	var c net.Conn
	if err := tp.InHost(from, func() (err error) {
		c, err = net.Dial("tcp4", netip.AddrPortFrom(tp.PS.IP, 5001).String())
		return err
	}); err != nil {
		ln.Close()
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 64<<10)
		for {
			if _, err := c.Write(buf); err != nil {
				return
			}
		}
	}()
	var once sync.Once
	stopFn := func() uint64 {
		once.Do(func() {
			c.Close()
			<-done
			ln.Close()
		})
		return moved.Load()
	}
	t.Cleanup(func() { stopFn() })
	return stopFn
}

// sampleWindow records a worker's congestion window every millisecond until stop.
type windowSampler struct {
	mu   sync.Mutex
	sum  float64
	n    int
	done chan struct{}
	wg   sync.WaitGroup
}

func sampleWindow(w *hostlib.Worker) *windowSampler {
	s := &windowSampler{done: make(chan struct{})}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		tk := time.NewTicker(time.Millisecond)
		defer tk.Stop()
		for {
			select {
			case <-s.done:
				return
			case <-tk.C:
				s.mu.Lock()
				s.sum += w.Stats().CongestionWindow
				s.n++
				s.mu.Unlock()
			}
		}
	}()
	return s
}

func (s *windowSampler) stop() float64 {
	close(s.done)
	s.wg.Wait()
	return s.sum / float64(max(s.n, 1))
}

// keepReducing runs allreduces of n values on ws (one job) until ctx ends; it returns how many
// completed and the first error (ctx's end is not one).
func keepReducing(ctx context.Context, t *testing.T, ws []*hostlib.Worker, n int, seed uint64) (int, error) {
	done := 0
	for ctx.Err() == nil {
		in, ref := inputs(len(ws), n, seed+uint64(done), uniform)
		errs := make(chan error, len(ws))
		for i, w := range ws {
			go func() { errs <- w.AllReduce(context.Background(), in[i]) }()
		}
		for range ws {
			if err := <-errs; err != nil {
				return done, err
			}
		}
		checkFixed(t, in, ref, 24)
		done++
	}
	return done, nil
}

// A job sharing worker 0's shaped link with a bulk TCP flow is marked by the switch's phantom
// queue, halves its window, and grows it back once the flow is gone; every sum stays exact.
func TestCongestionBackOffAndRecover(t *testing.T) {
	b := newBed(t, testbed.Options{Workers: 1,
		Switch: loader.Config{PortRate: linkRate * 9 / 10, ECNThreshold: 64 << 10}})
	shape(t, b.Topo, b.Topo.Workers[0], linkRate)
	w := b.Workers[0]
	phase := func(name string, d time.Duration) (meanWin float64, done int, ecn uint64) {
		ecn0 := w.Stats().ECNResults
		s := sampleWindow(w)
		ctx, cancel := context.WithTimeout(context.Background(), d)
		defer cancel()
		done, err := keepReducing(ctx, t, b.Workers, 20*K, 7)
		meanWin = s.stop()
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		return meanWin, done, w.Stats().ECNResults - ecn0
	}
	c0, _ := b.Counters()
	aWin, aDone, aECN := phase("alone", 1500*time.Millisecond)
	stop := bulkTCP(t, b.Topo, b.Topo.Workers[0])
	bWin, bDone, bECN := phase("with TCP", 1500*time.Millisecond)
	tcpBytes := stop()
	cWin, cDone, cECN := phase("alone again", 1500*time.Millisecond)
	c1, _ := b.Counters()
	st := w.Stats()
	report := fmt.Sprintf("congestion: mean window alone %.1f (%d allreduces, %d ECN results), with bulk TCP %.1f (%d, %d ECN; TCP moved %d MB), alone again %.1f (%d, %d ECN); min window %.1f, %d cuts; switch marked %d",
		aWin, aDone, aECN, bWin, bDone, bECN, tcpBytes>>20, cWin, cDone, cECN, st.MinWindow, st.WindowCuts, c1.Sub(c0)[maps.CntECNMarked])
	fmt.Println(report)
	if bECN == 0 {
		t.Errorf("no ECN while sharing the link with TCP: %s", report)
	}
	if !(bWin < aWin && cWin > bWin) {
		t.Errorf("window did not back off and recover: %s", report)
	}
}

// Two equal jobs behind one shaped link converge to similar windows: AIMD with the same marks.
func TestCongestionTwoJobsConverge(t *testing.T) {
	// Half the rate of the other test: two jobs together must overrun it to be marked.
	const rate = linkRate / 2
	b := newBed(t, testbed.Options{Workers: 1, JobID: 1,
		Switch: loader.Config{PortRate: rate * 9 / 10, ECNThreshold: 64 << 10}})
	shape(t, b.Topo, b.Topo.Workers[0], rate)
	h, ps := b.Topo.Workers[0], b.Topo.PS
	// Job 2: a second worker on the same host, another UDP port.
	const port2 = testbed.WorkerPort + 1
	if err := b.Switch.Maps.PutMember(maps.Member{JobID: 2, WorkerID: 0, Ifindex: uint32(h.PortIndex),
		Addr: netip.AddrPortFrom(h.IP, port2), MAC: h.MAC, PortMAC: h.PortMAC, SrcIP: ps.IP}); err != nil {
		t.Fatal(err)
	}
	var w2 *hostlib.Worker
	if err := b.Topo.InHost(h, func() (err error) {
		w2, err = hostlib.NewWorker(hostlib.WorkerConfig{JobID: 2, NumWorkers: 1, Local: netip.AddrPortFrom(h.IP, port2),
			PS: netip.AddrPortFrom(ps.IP, loader.DefaultPort), PoolSize: b.Opts.Switch.PoolSize})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w2.Close() })
	jobs := [][]*hostlib.Worker{b.Workers, {w2}}

	// Job 1 alone first, so it starts the shared phase with the larger window.
	ctx1, cancel1 := context.WithCancel(context.Background())
	defer cancel1()
	var wg sync.WaitGroup
	errs := make([]error, 2)
	done := make([]int, 2)
	wg.Add(1)
	go func() { defer wg.Done(); done[0], errs[0] = keepReducing(ctx1, t, jobs[0], 20*K, 100) }()
	time.Sleep(500 * time.Millisecond)
	ctx2, cancel2 := context.WithCancel(context.Background())
	defer cancel2()
	wg.Add(1)
	go func() { defer wg.Done(); done[1], errs[1] = keepReducing(ctx2, t, jobs[1], 20*K, 200) }()
	time.Sleep(500 * time.Millisecond) // converge
	s1, s2 := sampleWindow(b.Workers[0]), sampleWindow(w2)
	before := [2]uint64{b.Workers[0].Stats().ResultsReceived, w2.Stats().ResultsReceived}
	time.Sleep(2 * time.Second)
	after := [2]uint64{b.Workers[0].Stats().ResultsReceived, w2.Stats().ResultsReceived}
	m1, m2 := s1.stop(), s2.stop()
	cancel1()
	cancel2()
	wg.Wait()
	for i, err := range errs {
		if err != nil && !errors.Is(err, context.Canceled) {
			t.Fatalf("job %d: %v", i+1, err)
		}
	}
	x1, x2 := float64(after[0]-before[0]), float64(after[1]-before[1])
	jainWin := (m1 + m2) * (m1 + m2) / (2 * (m1*m1 + m2*m2))
	jainTput := (x1 + x2) * (x1 + x2) / (2 * (x1*x1 + x2*x2))
	report := fmt.Sprintf("congestion: two jobs on one link: mean windows %.1f and %.1f (Jain %.3f); fragments in the shared 2 s %.0f and %.0f (Jain %.3f); window cuts %d and %d",
		m1, m2, jainWin, x1, x2, jainTput, b.Workers[0].Stats().WindowCuts, w2.Stats().WindowCuts)
	fmt.Println(report)
	if jainWin < 0.9 {
		t.Errorf("windows did not converge: %s", report)
	}
}
