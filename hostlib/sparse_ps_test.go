package hostlib

import (
	"encoding/binary"
	"math"
	"net"
	"net/netip"
	"testing"

	"github.com/xdpagg/xdpagg/sparse"
	"github.com/xdpagg/xdpagg/wire"
)

// TestSparsePSMergeCountersRestart: the PS takes a hot rank as touched iff the read-out says the
// slot holds a sum of the iteration, so hit counters that restart below the PS's last reading (a
// standby that took over with empty registers, a reset job) change nothing in the update: an
// untouched rank whose counter fell (a difference would wrap to a huge "touched") stays out, and
// a rank touched exactly as often as the old reading (a difference of 0) keeps its sum.
func TestSparsePSMergeCountersRestart(t *testing.T) {
	sw, err := net.ListenUDP("udp4", net.UDPAddrFromAddrPort(netip.MustParseAddrPort("127.0.0.1:0")))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sw.Close() })
	hs, err := sparse.NewHotSet(1, sparse.Ranking{100, 101, 102, 103, 104})
	if err != nil {
		t.Fatal(err)
	}
	const scale = 8
	p, err := NewSparsePS(SparsePSConfig{Listen: netip.MustParseAddrPort("127.0.0.1:0"),
		Switch: sw.LocalAddr().(*net.UDPAddr).AddrPort(),
		Jobs: []SparsePSJob{{ID: 1, Workers: []netip.AddrPort{netip.MustParseAddrPort("127.0.0.1:1")},
			Hot: hs, Arrays: 5, ScaleLog2: scale, Online: &sparse.Online{Period: 1000}}}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	j := p.jobs[1]
	// The counters of parity 0 as the PS last read them (iteration 2, on the old primary).
	j.prevHits[0] = []uint32{5, 3, 0, 7, 4}
	// Iteration 4 read from the standby, whose registers started at zero.
	reads := []struct {
		sum     int32
		hits    uint32
		touched bool
	}{
		{0, 0, false}, // (a) untouched, counter restarted below the old reading
		{9, 3, true},  // (b) touched three times since the restart: hits == the old reading
		{0, 2, true},  // touched, contributions summing to 0: still in the update
		{0, 7, false}, // untouched, counter unchanged (the primary survived for this one)
		{-4, 1, true}, // touched once since the restart: hits below the old reading
	}
	b := make([]byte, len(reads)*wire.KVPairSize)
	for i, r := range reads {
		w := r.hits
		if r.touched {
			w |= wire.RegThisIter
		}
		wire.PutKV(b, i, uint32(r.sum), int32(w))
	}
	it := &spIter{iter: 4, version: 1, cold: map[uint64]*spAcc{}, ranges: map[uint32][]byte{0: b}}
	p.complete(j, it)

	want := []uint32{wire.HotUntouched, math.Float32bits(9.0 / (1 << scale)), 0, wire.HotUntouched,
		math.Float32bits(-4.0 / (1 << scale))}
	var got []uint32
	for _, u := range it.update {
		var h wire.Header
		wire.DecodeHeader(u, &h)
		if h.Encoding != wire.EncSparseHot {
			if h.Count != 0 {
				t.Errorf("cold update packet with %d pairs, want none", h.Count)
			}
			continue
		}
		vals := u[wire.HdrSize+wire.SparseHdrSize:]
		for i := range int(h.Count) {
			got = append(got, binary.LittleEndian.Uint32(vals[4*i:]))
		}
	}
	if len(got) != len(want) {
		t.Fatalf("update has %d hot values, want %d", len(got), len(want))
	}
	for r := range want {
		if got[r] != want[r] {
			t.Errorf("rank %d: update %#x, want %#x", r, got[r], want[r])
		}
	}
	for r, h := range []uint32{0, 3, 2, 7, 1} {
		if j.prevHits[0][r] != h {
			t.Errorf("rank %d: PS keeps counter %d, want the new reading %d", r, j.prevHits[0][r], h)
		}
	}
}

// TestSparseHitDelta: the online ranking's count for a touched hot slot is the counter's rise,
// or the new reading where the counter restarted; never a wrapped difference.
func TestSparseHitDelta(t *testing.T) {
	for _, c := range []struct {
		hits, prev uint32
		want       uint64
	}{
		{7, 4, 3},                        // the usual case
		{3, 3, 3},                        // restarted and touched as often as before
		{2, 5, 2},                        // restarted below the old reading
		{0, 5, 1},                        // touched: at least one
		{wire.RegHitsMask, 0, 1<<31 - 1}, // the largest reading
	} {
		if got := hitDelta(c.hits, c.prev); got != c.want {
			t.Errorf("hitDelta(%d, %d) = %d, want %d", c.hits, c.prev, got, c.want)
		}
	}
}
