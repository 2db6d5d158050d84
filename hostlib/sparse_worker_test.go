package hostlib

import (
	"context"
	"encoding/binary"
	"errors"
	"net/netip"
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
