package hostlib

import (
	"bytes"
	"context"
	"fmt"
	"math/bits"
	"sync"

	"github.com/xdpagg/xdpagg/wire"
)

// Asynchronous training (iSwitch, Alg. 1): workers do not wait for one another. Each keeps
// computing gradients from its own copy of the weights while the switch aggregates; a round's
// update is the sum of the first H gradients to reach it (the job's threshold, `xdpagg job add
// --threshold`, MSG_SETH), broadcast to every worker, and every worker applies every round's
// update in round order, so all copies of the weights go through the same updates.
//
// Rounds and sequence numbers. Round r all-reduces a gradient of AsyncConfig.Params values:
// F = ceil(Params/K) fragments, sequence numbers r·F .. r·F+F-1 of the job (the worker's
// sequence counter, as AllReduce takes it). Every worker goes through every round, in order,
// whether it has a gradient for it or not, so all of them agree on the numbers without lockstep:
//   - with a gradient ready (and fresh enough, see Staleness), a worker contributes it to the
//     round it is in;
//   - without one, it listens: it sends nothing and takes the round's result when the others'
//     contributions complete it;
//   - a round that completed without it (its result arrived before the worker got to the round,
//     which the switch's broadcast to every member makes the common case for a slow worker) is
//     taken from the results kept on arrival: the worker sends nothing for it and moves on.
//
// A result lost on its way is asked of the switch agent's retransmit cache (after Join), which
// keeps it until every worker of the job acknowledged it. A contribution that arrives after its
// fragment completed gets the completed sum back (the switch's shadow copy, or the PS's stored
// result) without being added. Each update's Bitmaps say whose gradients it holds.

// AsyncConfig configures an Async.
type AsyncConfig struct {
	// Params is the size of the model's gradient: every round all-reduces exactly this many
	// values (ValuesPerPacket per fragment). Every worker of the job must use the same.
	Params int
	// Staleness is S: a gradient computed from weights more than S updates behind the latest
	// update applied when its round starts is dropped, not sent (AsyncStats.Stale). A gradient
	// that arrived too late for its round (none of its fragments is in the round's sum) is tried
	// again in the next round while it is no staler than S (AsyncStats.Late counts it each time).
	Staleness int
}

// AsyncUpdate is one round's aggregate, as Async.Run hands it to the application.
type AsyncUpdate struct {
	Round uint64
	// Sum is the element-wise sum of the contributors' gradients (Params values). Valid only
	// during the apply callback.
	Sum []float32
	// Bitmaps holds each fragment's contributors: the worker ids whose gradients are in Sum for
	// values [i·K, (i+1)·K), K = ValuesPerFragment. A fragment holds at least H gradients.
	Bitmaps           []uint32
	ValuesPerFragment int
	// Contributed is the gradient this worker sent in the round (nil: it listened), and
	// ContributedVersion the update count of the weights it was computed from. Valid only during
	// the apply callback.
	Contributed        []float32
	ContributedVersion uint64
}

// Contributors returns how many gradients value i of Sum adds up.
func (u *AsyncUpdate) Contributors(i int) int {
	return bits.OnesCount32(u.Bitmaps[i/u.ValuesPerFragment])
}

// AsyncStats are an Async's counters.
type AsyncStats struct {
	Rounds      uint64 // rounds applied
	Contributed uint64 // rounds this worker sent a gradient in
	Listened    uint64 // rounds it had no gradient for (it sent nothing and took the result)
	Included    uint64 // rounds whose sum holds (some of) its gradient
	Partial     uint64 // of Included: some fragments of its gradient were late and not in the sum
	Late        uint64 // contributions none of whose fragments made it into the round's sum
	Stale       uint64 // gradients dropped unsent: computed more than Staleness updates ago
}

// Async runs asynchronous training rounds on a Worker (see above). Push is called by the
// goroutine that computes gradients, Run by another; Version may be called from anywhere. While
// an Async runs, the worker's AllReduce must not be called.
type Async struct {
	w   *Worker
	cfg AsyncConfig

	mu       sync.Mutex
	pending  []float32 // the gradient waiting for a round (nil: none)
	pendVer  uint64
	applied  uint64        // updates applied: the weights' version
	freed    chan struct{} // pending was taken (or dropped)
	pushed   chan struct{} // a gradient is pending
	st       AsyncStats
	buf, own []float32
}

// NewAsync prepares w for asynchronous rounds: from now on w keeps the results of fragments it
// has not sent yet (at most earlyMax), so that a round that completes without it costs it
// nothing to catch up with.
func NewAsync(w *Worker, cfg AsyncConfig) (*Async, error) {
	if cfg.Params < 1 || cfg.Staleness < 0 {
		return nil, fmt.Errorf("%w: Params %d, Staleness %d: use Params >= 1, Staleness >= 0", ErrAsync, cfg.Params, cfg.Staleness)
	}
	w.mu.Lock()
	if w.early == nil {
		w.early = map[uint32]earlyResult{}
		w.earlyKick = make(chan struct{}, 1)
	}
	w.mu.Unlock()
	return &Async{w: w, cfg: cfg, freed: make(chan struct{}, 1), pushed: make(chan struct{}, 1),
		buf: make([]float32, cfg.Params), own: make([]float32, cfg.Params)}, nil
}

// Version returns how many updates have been applied (the weights' version).
func (a *Async) Version() uint64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.applied
}

// Stats returns the counters.
func (a *Async) Stats() AsyncStats {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.st
}

// Push hands Run a gradient (Params values, copied) computed from the weights after `version`
// updates. It waits while the previous gradient is still waiting for a round, so a worker
// computes at most one gradient ahead of its rounds; then it returns, and the worker computes
// its next gradient while the switch aggregates this one.
func (a *Async) Push(ctx context.Context, grad []float32, version uint64) error {
	if len(grad) != a.cfg.Params {
		return fmt.Errorf("%w: gradient of %d values, want %d", ErrAsync, len(grad), a.cfg.Params)
	}
	for {
		a.mu.Lock()
		if a.pending == nil {
			a.pending, a.pendVer = append(make([]float32, 0, len(grad)), grad...), version
			a.mu.Unlock()
			signal(a.pushed)
			return nil
		}
		a.mu.Unlock()
		select {
		case <-a.freed:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

func signal(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// Run goes through rounds 0..rounds-1 in order (see above) and calls apply with each round's
// update, from Run's goroutine, before the next round starts; the Version goes up by one after
// each call. It stops at the first error (ctx done, ErrTimeout, ErrClosed, ErrHalted), having
// applied the rounds before it.
func (a *Async) Run(ctx context.Context, rounds int, apply func(*AsyncUpdate)) error {
	w := a.w
	k := w.cfg.ValuesPerPacket
	nfrags := (a.cfg.Params + k - 1) / k
	bitmaps := make([]uint32, nfrags)
	for r := 0; r < rounds; r++ {
		w.mu.Lock()
		base := w.nextSeq // Run owns the worker's operations: only Resume, after it stopped, moves it
		w.mu.Unlock()
		grad, ver, err := a.take(ctx, base, nfrags)
		if err != nil {
			return fmt.Errorf("round %d: %w", r, err)
		}
		listen := grad == nil
		if !listen {
			copy(a.buf, grad)
			copy(a.own, grad)
		}
		clear(bitmaps)
		if err := w.allReduce(ctx, a.buf, listen, bitmaps); err != nil {
			return fmt.Errorf("round %d: %w", r, err)
		}
		u := &AsyncUpdate{Round: uint64(r), Sum: a.buf, Bitmaps: bitmaps, ValuesPerFragment: k}
		if !listen {
			u.Contributed, u.ContributedVersion = a.own, ver
		}
		a.account(u, grad, ver)
		apply(u)
		a.mu.Lock()
		a.applied++
		a.st.Rounds++
		a.mu.Unlock()
	}
	return nil
}

// take waits for what round (sequence numbers base..base+nfrags-1) starts with: a fresh gradient
// to contribute, or (nil) the round's results, all arrived without this worker. Stale gradients
// are dropped on the way.
func (a *Async) take(ctx context.Context, base uint64, nfrags int) ([]float32, uint64, error) {
	for {
		a.mu.Lock()
		if g := a.pending; g != nil {
			ver := a.pendVer
			a.pending = nil
			stale := a.applied-ver > uint64(a.cfg.Staleness)
			if stale {
				a.st.Stale++
			}
			a.mu.Unlock()
			signal(a.freed)
			if !stale {
				return g, ver, nil
			}
			continue
		}
		a.mu.Unlock()
		if a.w.roundArrived(base, nfrags) {
			return nil, 0, nil
		}
		select {
		case <-a.pushed:
		case <-a.w.earlyKick:
		case <-ctx.Done():
			return nil, 0, ctx.Err()
		case <-a.w.closing:
			return nil, 0, ErrClosed
		}
	}
}

// account counts how the round went for this worker; a contribution that made none of the
// round's fragments goes back to wait for the next round (unless a newer gradient is waiting).
func (a *Async) account(u *AsyncUpdate, grad []float32, ver uint64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if grad == nil {
		a.st.Listened++
		return
	}
	a.st.Contributed++
	bit := uint32(1) << a.w.cfg.WorkerID
	in := 0
	for _, b := range u.Bitmaps {
		if b&bit != 0 {
			in++
		}
	}
	switch {
	case in == len(u.Bitmaps):
		a.st.Included++
	case in > 0:
		a.st.Included++
		a.st.Partial++
	default:
		a.st.Late++
		if a.pending == nil {
			a.pending, a.pendVer = grad, ver // the staleness check of the next round decides
		}
	}
}

// earlyMax bounds the results a worker keeps for fragments it has not sent yet.
const earlyMax = 1 << 12

// earlyResult is a result kept for a fragment not sent yet: its header, as parsed on arrival, and
// a copy of its values (wire bytes), so that takeEarly applies it without parsing it again.
type earlyResult struct {
	h    wire.Header
	vals []byte
}

// keepEarly keeps result h (values vals) of a fragment this worker has not sent yet, if it is
// ahead of what the worker has done and there is room: asynchronous rounds complete without slow
// workers, who take the results when they get to them (takeEarly). Called with mu held.
func (w *Worker) keepEarly(h *wire.Header, vals []byte) bool {
	low := w.earlyLow
	if w.op.active {
		low = w.op.seqBase + uint64(w.op.next)
	}
	d := h.Seq - uint32(low)
	if int32(d) < 0 || d >= earlyMax || len(w.early) >= earlyMax {
		return false
	}
	if _, dup := w.early[h.Seq]; dup {
		return false
	}
	w.early[h.Seq] = earlyResult{h: *h, vals: bytes.Clone(vals)}
	w.st.early.Add(1)
	signal(w.earlyKick)
	return true
}

// takeEarly gives the running operation's next fragment (initialised in its ring entry) the
// result kept for it, if any, instead of sending it: true if it did. Called with mu held.
func (w *Worker) takeEarly(op *operation, now int64) bool {
	seq := uint32(op.seqBase + uint64(op.next))
	e, ok := w.early[seq]
	if !ok {
		return false
	}
	delete(w.early, seq)
	w.st.early.Add(^uint64(0)) // it counts where applyResult says from now on
	off := op.next
	f := &op.ring[off%len(op.ring)]
	f.sentAt, f.deadline = now, now+int64(w.cfg.Timeout)
	op.next++
	w.applyResult(int64(off), &e.h, e.vals)
	if f.state == fragFixed {
		op.next-- // not this fragment's result after all (counted malformed): send it
		return false
	}
	return true
}

// roundArrived reports whether the results of sequence numbers base..base+n-1 have all arrived
// ahead of the worker (kept by keepEarly).
func (w *Worker) roundArrived(base uint64, n int) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	for i := 0; i < n; i++ {
		if _, ok := w.early[uint32(base+uint64(i))]; !ok {
			return false
		}
	}
	return true
}

// dropEarly forgets kept results below seq base (of fragments the worker is past: duplicates).
// Called with mu held.
func (w *Worker) dropEarly(base uint64) {
	for s := range w.early {
		if int32(s-uint32(base)) < 0 {
			delete(w.early, s)
			w.st.early.Add(^uint64(0))
			w.st.duplicates.Add(1)
		}
	}
}
