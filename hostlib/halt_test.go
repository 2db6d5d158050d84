package hostlib

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"
)

// TestHaltResumeInStep: members that a halt stops in different calls go on in step after Resume.
// A member whose last result of a call arrives after the halt notice fails that call, while the
// others completed it and fail the next one (TestHaltJob hit this under load: after Resume the
// member behind sent the fragments of the call the others had done, under the same sequence
// numbers as another member's abandoned ones, and no fragment of the job ever completed). Here
// worker 0 is that member: workers 1 and 2 start call 1 and leave half-filled aggregations of
// it at the PS, then the halt stops them, worker 0 never reaches call 1. Resume must put all three
// at the halt's resume point, whichever member halted.
func TestHaltResumeInStep(t *testing.T) {
	const n = 5000 // 14 fragments: one window
	for _, halter := range []int{0, 1} {
		t.Run(fmt.Sprintf("halter=%d", halter), func(t *testing.T) {
			c := newDirectCluster(t, 3, 1)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute) // a hang guard
			defer cancel()
			in, ref := tensors(3, n, 1, uniform)
			if err := c.allReduce(ctx, in); err != nil {
				t.Fatal(err)
			}
			checkBound(t, in, ref, DefaultScaleLog2)

			// Call 1 on workers 1 and 2 only: they send every fragment and wait for worker 0.
			errs := make(chan error, 2)
			in, _ = tensors(3, n, 2, uniform)
			for i := 1; i < 3; i++ {
				go func() { errs <- c.workers[i].AllReduce(ctx, in[i]) }()
			}
			for i := 1; i < 3; i++ {
				waitFor(t, func() bool { return c.workers[i].Stats().DataSent >= 2*uint64(c.fragments(n)) }) // calls 0 and 1
			}
			// The halt: the halter stops itself, the agent's notice the others (handleHalt).
			at := c.workers[halter].haltHere()
			for i, w := range c.workers {
				if i != halter {
					w.mu.Lock()
					w.markHalted(at)
					w.mu.Unlock()
				}
			}
			for range 2 {
				if err := <-errs; !errors.Is(err, ErrHalted) {
					t.Fatalf("a halted call ended with %v, want ErrHalted", err)
				}
			}
			before := c.workers[0].nextSeq
			if err := c.workers[0].AllReduce(ctx, in[0]); !errors.Is(err, ErrHalted) {
				t.Fatalf("a call while halted: %v, want ErrHalted", err)
			}
			if c.workers[0].nextSeq != before {
				t.Errorf("a call refused while halted took sequence numbers %d..%d", before, c.workers[0].nextSeq)
			}

			for _, w := range c.workers {
				w.Resume()
			}
			for i, w := range c.workers {
				if w.nextSeq != c.workers[0].nextSeq || uint32(w.nextSeq) != at {
					t.Errorf("worker %d resumes at seq %d, worker 0 at %d, the halt's point %d", i, w.nextSeq, c.workers[0].nextSeq, at)
				}
			}
			for r := range 2 {
				in, ref := tensors(3, n, uint64(10+r), uniform)
				if err := c.allReduce(ctx, in); err != nil {
					t.Fatalf("resumed round %d: %v", r, err)
				}
				checkBound(t, in, ref, DefaultScaleLog2)
			}
		})
	}
}

// fragments is the number of fragments of an n-value tensor.
func (c *cluster) fragments(n int) int {
	k := c.workers[0].Config().ValuesPerPacket
	return (n + k - 1) / k
}

// TestResumeAt: whatever the 64-bit sequence numbers, every member within one call of the halter
// (either side) finds the same resume point, ahead of it and within 2^31 of it (serial-number
// arithmetic at the switch and the PS sees the resumed fragments as later).
func TestResumeAt(t *testing.T) {
	for _, h := range []uint64{0, 1000, 1<<32 - 5, 1<<32 + 3, 7<<40 + 1<<31} {
		want := h + haltGap
		at := uint32(want)
		for _, m := range []uint64{h, h + 1, h + maxCallFragments, max(h, maxCallFragments) - maxCallFragments} {
			got := resumeAt(m, at)
			if got != want || got <= m || got-m >= 1<<31 {
				t.Errorf("halter at %d, member at %d: resumes at %d, want %d", h, m, got, want)
			}
		}
	}
	if got := resumeAt(5000, 4000); got != 5000 {
		t.Errorf("a resume point behind the member moved it to %d: it must stay", got)
	}
}
