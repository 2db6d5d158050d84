package bpf_test

import (
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/maps"
)

// TestSwitchContinuesMovedSlot: a half-filled slot read from one switch under its lock and written
// into another with its age rebased on that switch's clock (what the management channel's
// Snapshot and Restore do, agent.Manager) is continued there as if it had never moved: the next
// contribution completes it with the exact sum, a resend gets the shadow copy, and the job's held
// count follows the slot.
func TestSwitchContinuesMovedSlot(t *testing.T) {
	a := load(t, time.Minute)
	b := load(t, time.Minute)
	w0 := dataFrame(7, 100, 3, 0, 2, 1, 2, 3, -4)
	w1 := dataFrame(7, 100, 3, 1, 2, 10, 20, 30, 40)
	s01 := sum(w0.Vals, w1.Vals)
	a.runExpect(t, w0, xdpDrop)

	moved, err := a.Maps.SlotLocked(3)
	if err != nil {
		t.Fatal(err)
	}
	nowA, err := a.Maps.DatapathNow()
	if err != nil {
		t.Fatal(err)
	}
	idle := nowA - moved.TsNs
	nowB, err := b.Maps.DatapathNow()
	if err != nil {
		t.Fatal(err)
	}
	moved.TsNs = nowB - idle
	if err := b.Maps.PutSlotLocked(3, &moved); err != nil {
		t.Fatal(err)
	}
	if err := b.Maps.AddHeld(7, 1); err != nil {
		t.Fatal(err)
	}
	expectSlot(t, b.slot(t, 3), slotView{State: slotAggregating, Counter: 1, FanIn: 2, Scale: 24, Job: 7, Seq: 100, Bitmap: 1, Nvals: 4}, w0.Vals)

	out := b.runExpect(t, w1, xdpRedirect)
	expectFrame(t, out, asResult(w1, 3, fFromSwitch, s01))
	b.expectDelta(t, cnt{maps.CntRx: 1, maps.CntAggregated: 1, maps.CntCompleted: 1})
	expectSlot(t, b.slot(t, 3), slotView{State: slotComplete, Counter: 2, FanIn: 2, Scale: 24, Job: 7, Seq: 100, Bitmap: 3, Nvals: 4}, s01)
	w0resend := w0.with(flags(fResend))
	out = b.runExpect(t, w0resend, xdpTX)
	expectFrame(t, out, asShadow(w0resend, 3, fFromSwitch|fShadow, s01))
	if j, err := b.Maps.Admission(7); err != nil || j.Held != 1 {
		t.Errorf("job 7 holds %d slots on the switch the slot moved to (%v), want 1", j.Held, err)
	}
	// Freed there, the count goes back to zero: nothing leaked, nothing negative.
	if _, err := b.Maps.ResetJob(7); err != nil {
		t.Fatal(err)
	}
	if j, _ := b.Maps.Admission(7); j.Held != 0 {
		t.Errorf("job 7 holds %d slots after its reset, want 0", j.Held)
	}
}
