package netns_tests

import (
	"context"
	"encoding/binary"
	"net/netip"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/netns_tests/testbed"
	"github.com/xdpagg/xdpagg/wire"
)

// sparsePkt encodes a sparse message: header, sparse header and n pairs of psize bytes (each
// pair's first word = rank 0 or key 0, value 1<<20).
func sparsePkt(h wire.Header, sh wire.SparseHeader, n, psize int) []byte {
	h.Version = wire.Version
	h.Count = uint16(n)
	b := make([]byte, wire.HdrSize+wire.SparseHdrSize+n*psize)
	wire.EncodeHeader(b, &h)
	wire.EncodeSparseHeader(b[wire.HdrSize:], &sh)
	for i := range n {
		binary.LittleEndian.PutUint32(b[wire.HdrSize+wire.SparseHdrSize+i*psize+psize-4:], 1<<20)
	}
	return b
}

// TestAttackSparse: a host that is no member of a sparse job (it runs another job's worker)
// forges everything the sparse exchange has — hot pairs as a member (spoofed and from its own
// address), read-outs as the PS, updates as the PS, cold pairs to the PS — while the job runs.
// Every iteration stays exact, no update of the job reaches the attacker, and the switch counts
// the forgeries as spoofed, not_member or malformed.
func TestAttackSparse(t *testing.T) {
	const job = 41
	b := newSparseBed(t, 4, testbed.SparseJobSpec{ID: job, Hosts: []int{0, 1, 2}, Arrays: 8, Hot: hotSetOf(t, 1, 1024, 0)})
	j := b.SparseJob(job)
	ev := b.Topo.Workers[3] // not a member of job 41
	a := newAttacker(t, b.Topo, ev)
	victim := b.Topo.Workers[0]
	ps := b.SparsePSAddr()
	sw := netip.AddrPortFrom(b.Topo.PS.Gateway, wire.DefaultPort)
	vport := uint16(testbed.SparseWorkerPort)
	hotHdr := func(w uint8, iter uint32) wire.Header {
		return wire.Header{Type: wire.MsgData, Encoding: wire.EncSparseKV, ScaleLog2: 24, JobId: job, Seq: iter,
			Bitmap0: 1 << w, FanIn0: 3, WorkerId: w}
	}
	attacks := []struct {
		name string
		f    func(iter uint32) frame
	}{
		// A member's hot pairs, from the member's address (spoofed: uRPF and the binding refuse it).
		{"spoofed hot pairs", func(it uint32) frame {
			return a.from(victim.IP, vport, ps.Addr(), wire.DefaultPort, sparsePkt(hotHdr(0, it), wire.SparseHeader{HotVersion: 1, Npkts: 1}, 8, 8))
		}},
		// The same from the attacker's own address as worker 2 (not bound there).
		{"hot pairs as a member id", func(it uint32) frame {
			return a.from(ev.IP, vport, ps.Addr(), wire.DefaultPort, sparsePkt(hotHdr(2, it), wire.SparseHeader{HotVersion: 1, Npkts: 1}, 8, 8))
		}},
		// A read-out as the PS: it would learn the job's sums.
		{"pull as the PS", func(it uint32) frame {
			h := wire.Header{Type: wire.MsgPull, Encoding: wire.EncSparseKV, JobId: job, Seq: it}
			return a.from(ps.Addr(), ps.Port(), sw.Addr(), wire.DefaultPort, sparsePkt(h, wire.SparseHeader{}, 8, 8))
		}},
		{"pull from its own address", func(it uint32) frame {
			h := wire.Header{Type: wire.MsgPull, Encoding: wire.EncSparseKV, JobId: job, Seq: it}
			return a.from(ev.IP, wire.DefaultPort, sw.Addr(), wire.DefaultPort, sparsePkt(h, wire.SparseHeader{}, 8, 8))
		}},
		// An update as the PS (forged sums for every worker).
		{"update as the PS", func(it uint32) frame {
			h := wire.Header{Type: wire.MsgResult, Encoding: wire.EncSparseCold, JobId: job, Seq: it, Bitmap0: 7, FanIn0: 3}
			return a.from(ps.Addr(), ps.Port(), victim.IP, vport, sparsePkt(h, wire.SparseHeader{HotVersion: 1, Npkts: 1}, 4, 12))
		}},
		// Cold pairs straight to the PS as worker 1, from its own address.
		{"cold pairs as a member id", func(it uint32) frame {
			h := hotHdr(1, it)
			h.Encoding = wire.EncSparseCold
			return a.from(ev.IP, vport, ps.Addr(), wire.DefaultPort, sparsePkt(h, wire.SparseHeader{HotVersion: 1, Npkts: 1}, 4, 12))
		}},
	}
	before, err := b.Counters()
	if err != nil {
		t.Fatal(err)
	}
	psBefore := b.SparsePS.Stats()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	iter := uint32(1)
	during(func() {
		for _, at := range attacks {
			// Aim at the iterations around the job's, so a forgery would land in a live one.
			for d := uint32(0); d < 3; d++ {
				a.send(t, at.f(iter+d), 1)
			}
		}
	}, func() {
		runSparse(ctx, t, j, 1, 30, 41)
	})
	after, err := b.Counters()
	if err != nil {
		t.Fatal(err)
	}
	d := after.Sub(before)
	if d[mapsCnt("spoofed")] == 0 || d[mapsCnt("not_member")] == 0 {
		t.Errorf("forgeries not refused by the switch: spoofed +%d, not_member +%d", d[mapsCnt("spoofed")], d[mapsCnt("not_member")])
	}
	if n := a.results(job); n != 0 {
		t.Errorf("%d updates of job %d reached the attacker", n, job)
	}
	ps2 := b.SparsePS.Stats()
	t.Logf("attacker sent %d frames; switch: spoofed +%d, not_member +%d, malformed +%d; PS not_member +%d",
		a.sent.Load(), d[mapsCnt("spoofed")], d[mapsCnt("not_member")], d[mapsCnt("malformed")], ps2.NotMember-psBefore.NotMember)
}
