package hostlib

import (
	"context"
	"encoding/binary"
	"errors"
	"math"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/wire"

	"github.com/xdpagg/xdpagg/sparse"
	"github.com/xdpagg/xdpagg/workload"
)

// BenchmarkSparseBuild measures a worker's packing of one iteration of the recorded trace (W=4):
// hot-set lookups, Algorithm 1 and packet encoding.
func BenchmarkSparseBuild(b *testing.B) {
	full, err := workload.Recorded("ctr_w8")
	if err != nil {
		b.Fatal(err)
	}
	tr, err := full.Regroup(4)
	if err != nil {
		b.Fatal(err)
	}
	r := sparse.SampledRanking(full.Iters, 0.08, 1)
	hot, err := sparse.NewHotSet(1, r[:6529])
	if err != nil {
		b.Fatal(err)
	}
	for _, c := range []struct {
		name string
		hot  *sparse.HotSet
	}{{"hot", hot}, {"ps-only", nil}} {
		b.Run(c.name, func(b *testing.B) {
			w := &SparseWorker{cfg: SparseWorkerConfig{JobID: 1, NumWorkers: 4, Hot: c.hot, Arrays: 256, ScaleLog2: 24, MTU: 1500}.WithDefaults(), bound: 1 << 28}
			keys := tr.Iters[0][0]
			vals := workload.Values(0, 0, keys, 1)
			b.ReportAllocs()
			for b.Loop() {
				if _, err := w.build(1, keys, vals); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func TestSparseBuildRefusesDuplicateKeys(t *testing.T) {
	w := &SparseWorker{cfg: SparseWorkerConfig{JobID: 1, NumWorkers: 2, ScaleLog2: 24, MTU: 1500}.WithDefaults(), bound: 1 << 28}
	for _, keys := range [][]uint64{{1, 2, 2, 3}, {5, 1, 5}} {
		if _, err := w.build(1, keys, make([]float32, len(keys))); !errors.Is(err, ErrConfig) {
			t.Errorf("keys %v: %v, want ErrConfig", keys, err)
		}
	}
	for _, keys := range [][]uint64{{1, 2, 3}, {3, 1, 2}, nil} {
		if _, err := w.build(1, keys, make([]float32, len(keys))); err != nil {
			t.Errorf("keys %v: %v", keys, err)
		}
	}
}

// SparseWorker.Join sends the same authenticated JOIN as Worker.Join and completes only on the
// agent's authenticated ACK of its nonce; an ACK under another key leaves it waiting until ctx
// ends.
func TestSparseWorkerJoin(t *testing.T) {
	key, other := testKey(t), testKey(t)
	var stamps ctlauth.Stamper
	for _, c := range []struct {
		name   string
		ackKey []byte
		ok     bool
	}{{"authentic", key, true}, {"another job's key", other, false}} {
		t.Run(c.name, func(t *testing.T) {
			w, err := NewSparseWorker(SparseWorkerConfig{JobID: 3, WorkerID: 1, NumWorkers: 2, Local: netip.AddrPortFrom(loopback, 0),
				PS: netip.AddrPortFrom(loopback, 9), JobKey: key})
			if err != nil {
				t.Fatal(err)
			}
			defer w.Close()
			agent := newFakeAgent(t, key, nil, func(h wire.Header) []byte { return ackOf(t, c.ackKey, h, h.Seq, h.WorkerId, stamps.Next()) })
			ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			defer cancel()
			err = w.Join(ctx, agent.addr(), testMAC)
			if c.ok != (err == nil) || (!c.ok && !errors.Is(err, ErrTimeout)) {
				t.Fatalf("Join: %v", err)
			}
			msgs, _, bodies, _ := agent.received()
			if len(msgs) == 0 || msgs[0].Type != wire.MsgJoin || msgs[0].WorkerId != 1 || msgs[0].JobId != 3 ||
				len(bodies[0]) != binary.Size(bpf.XdpaggJoinBody{}) {
				t.Errorf("the agent got %+v", msgs)
			}
		})
	}
	w, err := NewSparseWorker(SparseWorkerConfig{JobID: 3, NumWorkers: 1, Local: netip.AddrPortFrom(loopback, 0), PS: netip.AddrPortFrom(loopback, 9)})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if err := w.Join(context.Background(), netip.AddrPortFrom(loopback, 9510), testMAC); !errors.Is(err, ErrConfig) {
		t.Errorf("Join without a key: %v, want ErrConfig", err)
	}
}

// coldUpdate is packet index of a two-packet sparse update of job 3's iteration iter: one cold
// pair <key index, value index + 1>.
func coldUpdate(iter, index uint32, flags uint16) []byte { return coldUpdateOf(iter, index, 2, flags) }

// coldUpdateOf is packet index of an update of npkts packets.
func coldUpdateOf(iter, index uint32, npkts uint16, flags uint16) []byte {
	b := make([]byte, wire.HdrSize+wire.SparseHdrSize+wire.ColdPairSize)
	wire.EncodeHeader(b, &wire.Header{Version: wire.Version, Type: wire.MsgResult, Encoding: wire.EncSparseCold, Flags: flags, Count: 1,
		JobId: 3, Seq: iter, AggIndex: index, Bitmap0: 1, FanIn0: 1})
	wire.EncodeSparseHeader(b[wire.HdrSize:], &wire.SparseHeader{Npkts: npkts})
	wire.PutCold(b[wire.HdrSize+wire.SparseHdrSize:], 0, uint64(index), math.Float32bits(float32(index+1)))
	return b
}

// A joined SparseWorker that lacks update packets asks the switch agent for exactly those (a
// sealed MSG_RETRANSMIT, encoding ENC_SPARSE_HOT) and takes the agent's F_CACHED copies; on the
// agent's miss it resends its iteration to the PS. Here the PS sends only packet 0 of iteration
// 1 and answers nothing but a resend in iteration 2, so iteration 1 completes only through the
// agent and iteration 2 only through the resend.
func TestSparseWorkerAsksAgent(t *testing.T) {
	key := testKey(t)
	var stamps ctlauth.Stamper
	agent := newFakeAgent(t, key, nil, func(h wire.Header) []byte {
		switch {
		case h.Type == wire.MsgRetransmit && h.Seq == 1 && h.Encoding == wire.EncSparseHot && h.AggIndex == 1 && h.Bitmap0 == 1:
			return coldUpdate(1, 1, wire.FlagCached)
		case h.Type == wire.MsgRetransmit && h.Seq == 1:
			return nil // not what the worker lacks: no answer, so the test fails on its counters
		}
		return ackOf(t, key, h, h.Seq, h.WorkerId, stamps.Next()) // the Join's ACK, and the miss of iteration 2
	})
	ps := fakeSparsePS(t, func(h wire.Header) [][]byte {
		switch {
		case h.Seq == 1 && h.Flags&wire.FlagResend == 0:
			return [][]byte{coldUpdate(1, 0, 0)}
		case h.Seq == 2 && h.Flags&wire.FlagResend != 0:
			return [][]byte{coldUpdate(2, 0, 0), coldUpdate(2, 1, 0)}
		}
		return nil
	})
	ctx := hangGuard(t)
	w := joinedSparseWorker(ctx, t, key, ps, agent.addr(), 20*time.Millisecond, 1000)
	for iter := uint32(1); iter <= 2; iter++ {
		up, err := w.Step(ctx, iter, []uint64{7}, []float32{1})
		if err != nil {
			t.Fatalf("iteration %d: %v", iter, err)
		}
		if !slices.Equal(up.Keys, []uint64{0, 1}) || !slices.Equal(up.Vals, []float32{1, 2}) {
			t.Errorf("iteration %d: update %+v", iter, up)
		}
	}
	st := w.Stats()
	if st.CacheRecovered != 1 || st.CacheRequests < 2 || st.CacheMisses < 1 || st.Resends < 1 {
		t.Errorf("stats %+v: want 1 packet recovered from the agent, and a miss answered by a resend", st)
	}
	msgs, _, _, unauth := agent.received()
	if unauth != 0 || msgs[1].Type != wire.MsgRetransmit || msgs[1].Encoding != wire.EncSparseHot || msgs[1].WorkerId != 0 {
		t.Errorf("the agent got %+v (%d unauthenticated)", msgs, unauth)
	}
}

// An update of 100 packets of which only the first arrives, an agent that has none of them: the
// worker asks for the missing runs (4 requests), the agent answers each with a miss, and only the
// first miss of an ask sends the iteration to the PS. The PS ignores the first resend and
// answers the second with the whole update, so the step needs 2 resends: within MaxRetries 4.
// (Each miss once counted a resend and asked again, running out the retries in round trips.)
func TestSparseWorkerAgentMissesResendOnce(t *testing.T) {
	const npkts = 100
	key := testKey(t)
	var stamps ctlauth.Stamper
	agent := newFakeAgent(t, key, nil, func(h wire.Header) []byte {
		return ackOf(t, key, h, h.Seq, h.WorkerId, stamps.Next()) // the Join's ACK, and a miss of every request
	})
	resends := 0 // the fake PS's goroutine only
	ps := fakeSparsePS(t, func(h wire.Header) [][]byte {
		if h.Flags&wire.FlagResend == 0 {
			return [][]byte{coldUpdateOf(1, 0, npkts, 0)}
		}
		var all [][]byte
		if resends++; resends == 2 {
			for i := range uint32(npkts) {
				all = append(all, coldUpdateOf(1, i, npkts, 0))
			}
		}
		return all
	})
	ctx := hangGuard(t)
	// A timeout no loaded machine reaches: only the agent's misses drive resends.
	w := joinedSparseWorker(ctx, t, key, ps, agent.addr(), time.Second, 4)
	up, err := w.Step(ctx, 1, []uint64{7}, []float32{1})
	if err != nil {
		t.Fatalf("step: %v (stats %+v)", err, w.Stats())
	}
	if len(up.Keys) != npkts {
		t.Errorf("update of %d keys, want %d", len(up.Keys), npkts)
	}
	if st := w.Stats(); st.Resends != 2 || st.CacheRequests != 8 {
		t.Errorf("stats %+v: want 2 resends, each after an ask of 4 requests", st)
	}
}

// hangGuard is a test's context: a minute, then the test fails instead of hanging.
func hangGuard(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// joinedSparseWorker is worker 0 of job 3 (one worker) on loopback, sending to ps, joined through
// the (fake) agent at sw under key.
func joinedSparseWorker(ctx context.Context, t *testing.T, key []byte, ps, sw netip.AddrPort, timeout time.Duration, retries int) *SparseWorker {
	t.Helper()
	w, err := NewSparseWorker(SparseWorkerConfig{JobID: 3, NumWorkers: 1, Local: netip.AddrPortFrom(loopback, 0), PS: ps, JobKey: key,
		Timeout: timeout, MaxRetries: retries})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	if err := w.Join(ctx, sw, testMAC); err != nil {
		t.Fatal(err)
	}
	return w
}

// fakeSparsePS is a PS on loopback that sends back to each DATA's sender the packets answer
// returns for its header.
func fakeSparsePS(t *testing.T, answer func(h wire.Header) [][]byte) netip.AddrPort {
	ps := listenOn(t, "127.0.0.1", 0)
	go func() {
		buf := make([]byte, 2048)
		for {
			n, from, err := ps.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			var h wire.Header
			wire.DecodeHeader(buf[:n], &h)
			for _, p := range answer(h) {
				_, _ = ps.WriteToUDPAddrPort(p, from)
			}
		}
	}()
	return connAddr(ps)
}
