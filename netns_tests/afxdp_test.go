package netns_tests

import (
	"context"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/netns_tests/testbed"
	"github.com/xdpagg/xdpagg/wire"
)

// AF_XDP receive (hostlib.WorkerConfig.AFXDP): exact sums with every worker taking its results
// from an AF_XDP socket, at both MTUs, while forged RESULT frames aimed at a worker's port are
// refused by the same checks as on the UDP socket.

// TestAFXDPAllReduce: W = 3 AF_XDP workers sum exactly, every result goes through the socket.
func TestAFXDPAllReduce(t *testing.T) {
	for _, mtu := range []int{0, 3388} {
		t.Run(fmt.Sprintf("mtu=%d", mtu), func(t *testing.T) {
			b := newBed(t, testbed.Options{Workers: 3, MTU: mtu, AFXDP: true})
			k := b.ValuesPerPacket()
			var frags uint64
			for r, n := range []int{1, k + 1, 1 << 18, 1 << 20} {
				in, ref := inputs(3, n, uint64(77+r), uniform)
				ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
				took, err := b.AllReduce(ctx, in)
				cancel()
				if err != nil {
					t.Fatalf("n=%d: %v", n, err)
				}
				checkFixed(t, in, ref, 24)
				frags += uint64((n + k - 1) / k)
				t.Logf("n=%d values: %v", n, took)
			}
			for i, w := range b.Workers {
				on, fb := w.AFXDP()
				if !on {
					t.Fatalf("worker %d: AF_XDP off (%v)", i, fb)
				}
				red, drops, err := w.AFXDPCounters()
				if err != nil {
					t.Fatal(err)
				}
				st := w.Stats()
				got := st.ResultsReceived + st.DuplicateResults
				t.Logf("worker %d: %d results (+%d duplicates), %d redirected to its AF_XDP socket, %d dropped by the kernel (rings full)",
					i, st.ResultsReceived, st.DuplicateResults, red, drops)
				if st.ResultsReceived != frags {
					t.Errorf("worker %d: %d results for %d fragments", i, st.ResultsReceived, frags)
				}
				// Results come from the switch over queue 0: every one went through the socket.
				if red < got-drops || red == 0 {
					t.Errorf("worker %d: the host program redirected %d results, the worker took %d", i, red, got)
				}
				if st.Malformed != 0 || st.Foreign != 0 {
					t.Errorf("worker %d: malformed %d, foreign %d on a clean run", i, st.Malformed, st.Foreign)
				}
			}
		})
	}
}

// TestAFXDPForgedResults: while the job runs exact allreduces, a host with no part in it sends
// RESULT frames of the job to worker 0's port from its own address (through the switch, which
// forwards them as ordinary traffic), and frames are injected straight into worker 0's link from
// the switch side: from an address that is not the PS, and with the PS's address but a bad UDP
// checksum. All reach the AF_XDP socket (they pass the host program's filter) and all are
// refused: foreign sources counted Foreign, the bad checksum Malformed, as the UDP socket's
// path would (the kernel would have dropped the latter).
func TestAFXDPForgedResults(t *testing.T) {
	b := newBed(t, testbed.Options{Workers: 4, AFXDP: true, Jobs: []testbed.JobSpec{{ID: 5, Hosts: []int{0, 1, 2}}}})
	job := b.Job(5)
	w0 := job.Hosts[0]
	atk := newAttacker(t, b.Topo, b.Topo.Workers[3])
	ps := b.Topo.PS
	psPort := b.Opts.Switch.Port
	res := func(seq uint32) []byte {
		return xpkt(wire.Header{Type: wire.MsgResult, JobId: 5, Seq: seq, AggIndex: seq % b.Opts.Switch.PoolSize,
			Bitmap0: 7, FanIn0: 3, Flags: wire.FlagFromSwitch}, K, 1<<27)
	}
	// Straight into worker 0's link: a packet socket on its switch port, in the switch namespace.
	var fd int
	if err := b.Topo.InSwitch(func() error {
		var err error
		if fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, 0); err != nil {
			return err
		}
		return nil
	}); err != nil {
		t.Fatalf("packet socket: %v", err)
	}
	defer unix.Close(fd)
	inject := func(f frame) {
		to := &unix.SockaddrLinklayer{Ifindex: w0.PortIndex, Halen: 6}
		copy(to.Addr[:], f.dstMAC)
		if err := unix.Sendto(fd, f.bytes(), 0, to); err != nil && err != unix.ENOBUFS {
			t.Errorf("inject: %v", err)
		}
	}
	direct := func(src netip.Addr, seq uint32, badSum bool) frame {
		f := frame{dstMAC: w0.MAC, srcMAC: w0.PortMAC, src: src, dst: w0.IP, sport: psPort, dport: job.Port, payload: res(seq)}
		if badSum {
			f.udpChecksum = 0x1234 // wrong for any content here
		}
		return f
	}
	var seq uint32
	const rounds = 4
	during(func() {
		seq++
		atk.send(t, atk.from(atk.h.IP, psPort, w0.IP, job.Port, res(seq)), 1)
		inject(direct(netip.MustParseAddr("10.200.99.2"), seq, false))
		inject(direct(ps.IP, seq, true))
	}, func() {
		for r := range rounds {
			in, ref := inputs(3, 40*K+11, uint64(900+r), uniform)
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			_, err := b.AllReduceJob(ctx, 5, in)
			cancel()
			if err != nil {
				t.Fatalf("round %d: %v", r, err)
			}
			checkFixed(t, in, ref, 24)
		}
	})
	wk := job.Workers[0]
	st := wk.Stats()
	red, _, err := wk.AFXDPCounters()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d rounds of forgery: worker 0 refused %d foreign, %d malformed; %d redirected, %d results; job exact",
		seq, st.Foreign, st.Malformed, red, st.ResultsReceived)
	if st.Foreign < 2*uint64(seq) {
		t.Errorf("worker 0 counted %d foreign results, %d were sent from foreign sources", st.Foreign, 2*seq)
	}
	if st.Malformed < uint64(seq) {
		t.Errorf("worker 0 counted %d malformed, %d frames with a bad UDP checksum were injected", st.Malformed, seq)
	}
	if red < st.ResultsReceived+st.Foreign+st.Malformed {
		t.Errorf("redirected %d < results %d + foreign %d + malformed %d: some went another way", red, st.ResultsReceived, st.Foreign, st.Malformed)
	}
}
