package netns_tests

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"

	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/netns_tests/testbed"
)

// lossyXDP returns an XDP program that drops each packet with probability p: attached to a
// worker's interface it loses results on their way in.
func lossyXDP(t *testing.T, p float64) *ebpf.Program {
	t.Helper()
	threshold := int32(p * (1 << 31)) // prandom_u32 is uniform over 2^32; compare its top half
	return hostXDP(t, "lossy", asm.Instructions{
		asm.FnGetPrandomU32.Call(),
		asm.RSh.Imm(asm.R0, 1),
		asm.JGE.Imm(asm.R0, threshold, "pass"),
	})
}

// hostXDP loads an XDP program for a host's link (a replacement for topo's XDP_PASS program, so
// swapped in with XDPLink.Update) from a classifier: it jumps to "pass" for a frame to keep and
// falls through for one to drop.
func hostXDP(t *testing.T, what string, classify asm.Instructions) *ebpf.Program {
	t.Helper()
	insns := append(slices.Clone(classify),
		asm.Mov.Imm(asm.R0, 1), // XDP_DROP
		asm.Return(),
		asm.Mov.Imm(asm.R0, 2).WithSymbol("pass"), // XDP_PASS
		asm.Return(),
	)
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:         ebpf.XDP,
		AttachType:   ebpf.AttachXDP, // a link update needs the attach type of the program it replaces
		Instructions: insns,
		License:      "GPL",
	})
	if err != nil {
		t.Fatalf("%s XDP program: %v", what, err)
	}
	t.Cleanup(func() { prog.Close() })
	return prog
}

// A worker that misses results gets them back from the switch's completed slots (the shadow
// copy), alone, and every sum stays exact.
func TestShadowCopyRecoversMissedResults(t *testing.T) {
	const w = 4
	b := newBed(t, testbed.Options{Workers: w, Timeout: 5 * time.Millisecond})
	h := b.Topo.Workers[0]
	if err := h.XDPLink.Update(lossyXDP(t, 0.05)); err != nil {
		t.Fatalf("swap worker 0's XDP program: %v", err)
	}
	before, _ := b.Counters()
	n := 400 * K
	in, ref := inputs(w, n, 5, uniform)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if _, err := b.AllReduce(ctx, in); err != nil {
		t.Fatal(err)
	}
	checkFixed(t, in, ref, 24)
	checkNoHalfSlots(t, b.Switch.Maps)
	after, _ := b.Counters()
	d := after.Sub(before)
	if d[maps.CntShadowTx] == 0 {
		t.Errorf("no result served from a shadow copy: %v", d.Map())
	}
	st0 := b.Workers[0].Stats()
	if st0.ShadowResults == 0 {
		t.Errorf("worker 0 got no shadow results: %+v", st0)
	}
	// Workers whose windows stalled behind worker 0 resend too; a resend that finds its slot
	// half-filled flushes it to the PS (ATP), so some fragments complete at the PS.
	if d[maps.CntCompleted] == 0 || d[maps.CntCompleted] > uint64(n/K) {
		t.Errorf("completed %d in-switch, want 1..%d fragments", d[maps.CntCompleted], n/K)
	}
	var others uint64
	for _, wk := range b.Workers[1:] {
		others += wk.Stats().Retransmits
	}
	t.Logf("worker 0: %d retransmits, %d shadow results; other workers: %d retransmits (window stalls); switch: %v",
		st0.Retransmits, st0.ShadowResults, others, d.Map())
}
