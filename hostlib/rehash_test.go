package hostlib

import (
	"encoding/binary"
	"testing"

	"github.com/xdpagg/xdpagg/wire"
)

// collided is worker w's DATA for <job, seq> as the switch forwards it after a collision, from
// workers with window win (bitmap1).
func collided(job, seq uint32, w uint8, win uint32) []byte {
	b := dataPkt{job: job, seq: seq, enc: wire.EncFixed32, worker: w, fan: 2, scale: 24, flags: wire.FlagCollision, vals: []uint32{1}}.bytes()
	binary.LittleEndian.PutUint32(b[24:], win) // bitmap1
	return b
}

// ATP's rehash at the PS: a collided fragment's result moves its slot offset to a new slot,
// outside the job's own rotation and distinct from the job's other remapped offsets.
func TestPSRehashesCollidedOffsets(t *testing.T) {
	const pool, win, job = 64, 4, 9
	b := newPSBench(t, func(c *PSConfig) { c.PoolSize = pool })
	base := SlotBase(job, pool)
	targets := map[uint32]uint32{}
	for seq := uint32(0); seq < 2*win; seq++ {
		b.send(t, collided(job, seq, 0, win), collided(job, seq, 1, win))
		h, _ := recvResult(t, b.sw)
		if h.Flags&wire.FlagRehash == 0 {
			t.Fatalf("result of collided seq %d without F_REHASH: %+v", seq, h)
		}
		tgt := h.Bitmap1
		if tgt >= pool || (tgt+pool-base)%pool < 2*win {
			t.Errorf("seq %d moved to slot %d: outside the pool or inside the job's rotation from %d", seq, tgt, base)
		}
		if o, dup := targets[tgt]; dup {
			t.Errorf("offsets %d and %d both moved to slot %d", o, seq, tgt)
		}
		targets[tgt] = seq
	}
	// Without a collision, no rehash and bitmap1 cleared.
	plain := dataPkt{job: job, seq: 100, enc: wire.EncFixed32, fan: 1, scale: 24, vals: []uint32{1}}.bytes()
	binary.LittleEndian.PutUint32(plain[24:], win)
	b.send(t, plain)
	if h, _ := recvResult(t, b.sw); h.Flags&wire.FlagRehash != 0 || h.Bitmap1 != 0 {
		t.Errorf("plain result %+v", h)
	}
	if s := b.ps.Stats(); s.Rehashes != 2*win {
		t.Errorf("rehashes %d, want %d", s.Rehashes, 2*win)
	}
}

// A worker applies a rehash to the offset's later fragments only.
func TestWorkerAppliesRehash(t *testing.T) {
	w := &Worker{cfg: WorkerConfig{Window: 4, PoolSize: 64}.WithDefaults(), slotBase: SlotBase(3, 64)}
	w.cfg.Window, w.cfg.PoolSize = 4, 64
	before := w.aggIndex(10)
	w.remap = map[uint32]slotRemap{10 % 8: {idx: 50, from: 10}}
	if got := w.aggIndex(10); got != before {
		t.Errorf("seq 10 itself moved: %d, want %d", got, before)
	}
	if got := w.aggIndex(18); got != 50 {
		t.Errorf("seq 18 at slot %d, want the remapped 50", got)
	}
	if got, want := w.aggIndex(11), AggIndex(3, 11, 4, 64); got != want {
		t.Errorf("another offset moved: %d, want %d", got, want)
	}
	_ = wire.HdrSize
}
