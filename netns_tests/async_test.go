package netns_tests

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"math/rand/v2"
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/hostlib"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
)

// Asynchronous aggregation (iSwitch Alg. 1) through the real switch: a job's threshold H, SETH
// and FBCAST through the agent, and a small model trained synchronously and asynchronously.

// regression is a linear-regression problem on synthetic data: each worker has its own shard of
// samples x ~ N(0, 1/D) per coordinate, y = x·w* + noise.
type regression struct {
	d, perWorker, batch int
	x                   [][][]float32 // [worker][sample][coordinate]
	y                   [][]float32   // [worker][sample]
}

func newRegression(workers, d, perWorker, batch int, seed uint64) *regression {
	r := rand.New(rand.NewPCG(seed, 7))
	wstar := make([]float64, d)
	for i := range wstar {
		wstar[i] = r.NormFloat64()
	}
	g := &regression{d: d, perWorker: perWorker, batch: batch}
	sd := 1 / math.Sqrt(float64(d))
	for range workers {
		var xs [][]float32
		var ys []float32
		for range perWorker {
			x := make([]float32, d)
			var y float64
			for i := range x {
				x[i] = float32(r.NormFloat64() * sd)
				y += float64(x[i]) * wstar[i]
			}
			xs = append(xs, x)
			ys = append(ys, float32(y+0.01*r.NormFloat64()))
		}
		g.x, g.y = append(g.x, xs), append(g.y, ys)
	}
	return g
}

// grad writes into g the mean-squared-error gradient at weights w of a minibatch of worker's
// shard, chosen by step.
func (g *regression) grad(worker int, step uint64, w, out []float32) {
	clear(out)
	r := rand.New(rand.NewPCG(uint64(worker), step))
	for range g.batch {
		s := r.IntN(g.perWorker)
		x := g.x[worker][s]
		var pred float64
		for i, xi := range x {
			pred += float64(xi) * float64(w[i])
		}
		e := float32((pred - float64(g.y[worker][s])) / float64(g.batch))
		for i, xi := range x {
			out[i] += e * xi
		}
	}
}

// loss is the mean squared error (halved) over every worker's samples.
func (g *regression) loss(w []float32) float64 {
	var sum float64
	n := 0
	for k := range g.x {
		for s, x := range g.x[k] {
			var pred float64
			for i, xi := range x {
				pred += float64(xi) * float64(w[i])
			}
			d := pred - float64(g.y[k][s])
			sum += d * d / 2
			n++
		}
	}
	return sum / float64(n)
}

// checkSum fails unless sum is, value by value, the sum of the named gradients within the
// fixed-point bound (|names| · 2^-(e+1), plus float32 rounding).
func checkSum(t *testing.T, what string, sum []float32, grads [][]float32, lo, hi int) {
	t.Helper()
	bound := float64(len(grads)) * math.Ldexp(1, -hostlib.DefaultScaleLog2-1)
	for j := lo; j < hi; j++ {
		var want float64
		for _, g := range grads {
			want += float64(g[j])
		}
		if d := math.Abs(float64(sum[j]) - want); d > bound+math.Abs(want)*0x1p-23 {
			t.Fatalf("%s value %d: %v, the named gradients add up to %v", what, j, sum[j], want)
		}
	}
}

// TestAsyncTraining: a linear regression of 2048 parameters trained by four workers through the
// switch, one of them slow (it sleeps per step): synchronously (H = W = 4, every step waits for
// the slow worker) and asynchronously (H = 3, iSwitch Alg. 1: hostlib.Async with staleness bound
// S). Every aggregated update is checked exact for the gradients its bitmap names (sync: all
// four), every worker ends with the same weights, both runs converge, and the asynchronous run's
// final loss is at most the synchronous one's plus 5% of the initial loss. Wall times and losses
// are logged, not asserted.
func TestAsyncTraining(t *testing.T) {
	const (
		w, h      = 4, 3
		d         = 2048
		steps     = 120
		staleness = 8
		lr        = 100.0
		// The asynchronous run's final loss may exceed the synchronous one's by at most this share
		// of the initial loss (it applies the same number of updates, each of H instead of W
		// gradients, some of them stale).
		tolerance = 0.05
	)
	slow := []time.Duration{2 * time.Millisecond, 2 * time.Millisecond, 2 * time.Millisecond, 20 * time.Millisecond}
	a := newAgentEnv(t, w, 256)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	hosts := a.tp.Workers[:w]
	jobs := a.startJobs(ctx, t, jobSpec{id: 61, hosts: hosts}, jobSpec{id: 62, hosts: hosts, port: 9700, threshold: h})
	sync4, async3 := jobs[0], jobs[1]
	prob := newRegression(w, d, 2048, 32, 1)
	initial := prob.loss(make([]float32, d))

	// Synchronous: every step, every worker's gradient, one allreduce, the mean applied.
	start := time.Now()
	weights := make([][]float32, w)
	var wg sync.WaitGroup
	errs := make([]error, w)
	sums := make([][][]float32, w) // [worker][step] the allreduced sum
	grads := make([][][]float32, w)
	for i, wk := range sync4.workers {
		weights[i] = make([]float32, d)
		wg.Go(func() {
			g := make([]float32, d)
			for s := range steps {
				prob.grad(i, uint64(s), weights[i], g)
				time.Sleep(slow[i])
				grads[i] = append(grads[i], slices.Clone(g))
				if err := wk.AllReduce(ctx, g); err != nil {
					errs[i] = fmt.Errorf("worker %d step %d: %w", i, s, err)
					return
				}
				sums[i] = append(sums[i], slices.Clone(g))
				for j := range weights[i] {
					weights[i][j] -= lr * g[j] / w
				}
			}
		})
	}
	wg.Wait()
	syncWall := time.Since(start)
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	for s := range steps {
		for i := range w {
			checkSum(t, fmt.Sprintf("sync step %d worker %d", s, i), sums[i][s], [][]float32{grads[0][s], grads[1][s], grads[2][s], grads[3][s]}, 0, d)
		}
	}
	for i := 1; i < w; i++ {
		if !slices.Equal(weights[i], weights[0]) {
			t.Fatalf("sync: worker %d ends with other weights than worker 0", i)
		}
	}
	syncLoss := prob.loss(weights[0])

	// Asynchronous: each worker computes from its own weights while its rounds run; a round's
	// update is the mean of the (at least H) gradients its bitmaps name.
	type round struct {
		sum, own []float32
		bitmaps  []uint32
	}
	rounds := make([][]round, w)
	asyncs := make([]*hostlib.Async, w)
	aw := make([][]float32, w)
	var mus [w]sync.Mutex
	start = time.Now()
	for i, wk := range async3.workers {
		as, err := hostlib.NewAsync(wk, hostlib.AsyncConfig{Params: d, Staleness: staleness})
		if err != nil {
			t.Fatal(err)
		}
		asyncs[i] = as
		aw[i] = make([]float32, d)
		runCtx, stop := context.WithCancel(ctx)
		wg.Go(func() { // computes
			g := make([]float32, d)
			snap := make([]float32, d)
			for step := uint64(0); runCtx.Err() == nil; step++ {
				mus[i].Lock()
				v := as.Version()
				copy(snap, aw[i])
				mus[i].Unlock()
				prob.grad(i, step, snap, g)
				time.Sleep(slow[i])
				if err := as.Push(runCtx, g, v); err != nil {
					return
				}
			}
		})
		wg.Go(func() { // aggregates and applies, concurrently with the next gradient
			defer stop()
			errs[i] = as.Run(ctx, steps, func(u *hostlib.AsyncUpdate) {
				r := round{sum: slices.Clone(u.Sum), bitmaps: slices.Clone(u.Bitmaps)}
				if u.Contributed != nil {
					r.own = slices.Clone(u.Contributed)
				}
				rounds[i] = append(rounds[i], r)
				mus[i].Lock()
				for j := range aw[i] {
					aw[i][j] -= lr * u.Sum[j] / float32(u.Contributors(j))
				}
				mus[i].Unlock()
			})
		})
	}
	wg.Wait()
	asyncWall := time.Since(start)
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("%v\n%s", err, a.sw.stderr.String())
	}
	k := async3.workers[0].Config().ValuesPerPacket
	contributors := map[int]int{}
	for r := range steps {
		ref := rounds[0][r]
		for i := 1; i < w; i++ {
			if !slices.Equal(rounds[i][r].sum, ref.sum) || !slices.Equal(rounds[i][r].bitmaps, ref.bitmaps) {
				t.Fatalf("async round %d: worker %d applied another update than worker 0", r, i)
			}
		}
		for f, bm := range ref.bitmaps {
			if bits.OnesCount32(bm) < h {
				t.Fatalf("async round %d fragment %d: contributors %#b, fewer than H", r, f, bm)
			}
			contributors[bits.OnesCount32(bm)]++
			var named [][]float32
			for i := range w {
				if bm&(1<<i) != 0 {
					if rounds[i][r].own == nil {
						t.Fatalf("async round %d fragment %d names worker %d, which sent nothing", r, f, i)
					}
					named = append(named, rounds[i][r].own)
				}
			}
			checkSum(t, fmt.Sprintf("async round %d fragment %d (%#b)", r, f, bm), ref.sum, named, f*k, min((f+1)*k, d))
		}
	}
	for i := 1; i < w; i++ {
		if !slices.Equal(aw[i], aw[0]) {
			t.Fatalf("async: worker %d ends with other weights than worker 0", i)
		}
	}
	asyncLoss := prob.loss(aw[0])
	for i, as := range asyncs {
		t.Logf("async worker %d (compute %v per step): %+v", i, slow[i], as.Stats())
	}
	t.Logf("async vs sync convergence (%d parameters, %d workers, one %v slower per step, %d updates, lr %g): initial loss %.4f; "+
		"sync (H=%d) loss %.4f in %v; async (H=%d, S=%d) loss %.4f in %v (%.1fx less wall time); fragments by contributors %v",
		d, w, slow[3]-slow[0], steps, lr, initial, w, syncLoss, syncWall.Round(time.Millisecond), h, staleness, asyncLoss,
		asyncWall.Round(time.Millisecond), float64(syncWall)/float64(asyncWall), contributors)
	if !(syncLoss < initial/10) {
		t.Errorf("the synchronous run did not converge: loss %.4f from %.4f", syncLoss, initial)
	}
	if asyncLoss > syncLoss+tolerance*initial {
		t.Errorf("async loss %.4f exceeds the sync loss %.4f by more than %g of the initial loss %.4f", asyncLoss, syncLoss, tolerance, initial)
	}
}

// jobSlots reads the switch's slots of job through `xdpagg inspect --slots --json`.
func (a *agentEnv) jobSlots(t *testing.T, job uint32) []maps.SlotInfo {
	t.Helper()
	out, err := exec.Command(a.bin, "inspect", "--json", "--slots", "--pin-root", a.pinRoot, "--name", "t").Output()
	if err != nil {
		t.Fatalf("inspect: %v", err)
	}
	var in struct {
		Slots []maps.SlotInfo `json:"slots"`
	}
	if err := json.Unmarshal(out, &in); err != nil {
		t.Fatal(err)
	}
	var mine []maps.SlotInfo
	for _, s := range in.Slots {
		if s.JobID == job {
			mine = append(mine, s)
		}
	}
	return mine
}

// jobThreshold reads job's H through `xdpagg job list --json`.
func (a *agentEnv) jobThreshold(t *testing.T, job uint32) uint8 {
	t.Helper()
	out, err := a.cli(t, "job", "list", "--json")
	if err != nil {
		t.Fatal(err)
	}
	var jobs []maps.Job
	if err := json.Unmarshal(out, &jobs); err != nil {
		t.Fatalf("job list %q: %v", out, err)
	}
	for _, j := range jobs {
		if j.JobID == job {
			return j.Threshold
		}
	}
	t.Fatalf("job %d not listed", job)
	return 0
}

// TestSetHAndFBcast: iSwitch's SetH and FBcast through the real agent. A member lowers its
// running job's H from 3 to 2 (SETH): an allreduce of two members completes with exactly their
// sum, and the third, late, gets that sum back (the shadow copy) without being added. Back at
// H = 3, two members' fragment waits half-filled in the switch until one of them asks for it
// (FBCAST): both get the partial sum from the agent, and the late third gets it too. A key holder
// on another host that is not the binding of the worker id it claims gets neither through.
func TestSetHAndFBcast(t *testing.T) {
	a := newAgentEnv(t, 4, 64)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	// A long retransmit timeout: the half-filled fragment must wait for the FBCAST, not be
	// flushed to the PS by a resend.
	j := a.startJobs(ctx, t, jobSpec{id: 63, hosts: a.tp.Workers[:3], timeout: 30 * time.Second})[0]
	sw := func(i int) netip.AddrPort { return netip.AddrPortFrom(j.hosts[i].Gateway, loader.DefaultPort) }
	control := func(what string, f func(context.Context) error) {
		t.Helper()
		cctx, ccancel := context.WithTimeout(ctx, time.Minute)
		defer ccancel()
		if err := f(cctx); err != nil {
			t.Fatalf("%s: %v\n%s", what, err, a.sw.stderr.String())
		}
	}
	const n = 3000 // 9 fragments, well within a window: no slot is reused below

	// SETH: H = 2 at the switch and the PS.
	control("seth", func(c context.Context) error { return j.workers[0].SetThreshold(c, sw(0), 2) })
	if err := a.ps.SetThreshold(j.id, 2); err != nil {
		t.Fatal(err)
	}
	if got := a.jobThreshold(t, j.id); got != 2 {
		t.Fatalf("threshold after SETH 2: %d", got)
	}
	in, _ := inputs(3, n, 11, uniform)
	orig := [][]float32{slices.Clone(in[0]), slices.Clone(in[1]), slices.Clone(in[2])}
	errs := make(chan error, 2)
	for i := range 2 {
		go func() { errs <- j.workers[i].AllReduce(ctx, in[i]) }()
	}
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatalf("allreduce at H=2: %v", err)
		}
	}
	checkSum(t, "H=2 worker 0", in[0], orig[:2], 0, n)
	checkSum(t, "H=2 worker 1", in[1], orig[:2], 0, n)
	if err := j.workers[2].AllReduce(ctx, in[2]); err != nil {
		t.Fatalf("late worker: %v", err)
	}
	checkSum(t, "H=2 the late worker", in[2], orig[:2], 0, n)
	// The late worker is a member, so the switch's broadcast of each completed sum reached it
	// too; whether its AllReduce took those or the shadow copies the switch sent back for its own
	// late fragments depends on scheduling (under load the broadcast still sits in its socket
	// when the call starts). Either way the sum is the two others' (checked above), and the
	// switch answered its fragments without adding them.
	if st := j.workers[2].Stats(); st.ShadowResults == 0 && st.DuplicateResults == 0 {
		t.Errorf("the late worker's fragments were not answered from the completed slots: %+v", st)
	}

	// An intruder on another host holding the job's key but bound to nothing (worker id 0 is
	// bound elsewhere) can neither change H nor, below, flush the job's fragment: the agent
	// refuses both (not_member) and never answers.
	var intruder *hostlib.Worker
	ih := a.tp.Workers[3]
	if err := a.tp.InHost(ih, func() (err error) {
		intruder, err = hostlib.NewWorker(hostlib.WorkerConfig{JobID: j.id, WorkerID: 0, NumWorkers: 3,
			Local: netip.AddrPortFrom(ih.IP, 9600), PS: netip.AddrPortFrom(a.tp.PS.IP, loader.DefaultPort), PoolSize: a.pool, JobKey: j.key})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer intruder.Close()
	intrude := func(what string, f func(context.Context) error) {
		t.Helper()
		ictx, icancel := context.WithTimeout(ctx, 300*time.Millisecond)
		defer icancel()
		if err := f(ictx); !errors.Is(err, hostlib.ErrTimeout) {
			t.Errorf("intruder's %s: %v, want no acknowledgement (ErrTimeout)", what, err)
		}
	}
	ihSw := netip.AddrPortFrom(ih.Gateway, loader.DefaultPort)
	intrude("SETH", func(c context.Context) error { return intruder.SetThreshold(c, ihSw, 1) })
	if got := a.jobThreshold(t, j.id); got != 2 {
		t.Fatalf("threshold after the intruder's SETH: %d, want still 2", got)
	}

	// FBCAST: H = 3 again; a one-fragment allreduce of workers 0 and 1 waits half-filled.
	control("seth", func(c context.Context) error { return j.workers[1].SetThreshold(c, sw(1), 3) })
	if err := a.ps.SetThreshold(j.id, 0); err != nil {
		t.Fatal(err)
	}
	if got := a.jobThreshold(t, j.id); got != 3 {
		t.Fatalf("threshold after SETH 3: %d", got)
	}
	seq := uint64((n + 359) / 360) // the fragment's sequence number: the first allreduce took these
	in, _ = inputs(3, 100, 12, uniform)
	orig = [][]float32{slices.Clone(in[0]), slices.Clone(in[1]), slices.Clone(in[2])}
	for i := range 2 {
		go func() { errs <- j.workers[i].AllReduce(ctx, in[i]) }()
	}
	var half []maps.SlotInfo
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(10 * time.Millisecond) {
		half = nil
		for _, s := range a.jobSlots(t, j.id) {
			if s.State == "aggregating" && uint64(s.Seq) == seq {
				half = append(half, s)
			}
		}
		if len(half) == 1 && half[0].Bitmap == 0b011 || time.Now().After(deadline) {
			break
		}
	}
	if len(half) != 1 || half[0].Bitmap != 0b011 {
		t.Fatalf("no half-filled slot of seq %d with workers 0 and 1: %+v", seq, a.jobSlots(t, j.id))
	}
	intrude("FBCAST", func(c context.Context) error { return intruder.FBcast(c, ihSw, seq) })
	if sl := a.jobSlots(t, j.id); !slices.ContainsFunc(sl, func(s maps.SlotInfo) bool { return uint64(s.Seq) == seq && s.State == "aggregating" }) {
		t.Fatalf("the intruder's FBCAST flushed the fragment: %+v", sl)
	}
	control("fbcast", func(c context.Context) error { return j.workers[0].FBcast(c, sw(0), seq) })
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatalf("allreduce after FBCAST: %v", err)
		}
	}
	checkSum(t, "FBCAST worker 0", in[0], orig[:2], 0, len(in[0]))
	checkSum(t, "FBCAST worker 1", in[1], orig[:2], 0, len(in[1]))
	if err := j.workers[2].AllReduce(ctx, in[2]); err != nil {
		t.Fatalf("late worker after FBCAST: %v", err)
	}
	checkSum(t, "FBCAST the late worker", in[2], orig[:2], 0, len(in[2]))
	for _, s := range a.jobSlots(t, j.id) {
		if uint64(s.Seq) == seq && (s.State != "complete" || s.Bitmap != 0b011) {
			t.Errorf("the flushed slot: %+v, want complete with workers 0 and 1", s)
		}
	}
	if log := a.sw.stderr.String(); strings.Count(log, "reason=not_member") < 1 {
		t.Errorf("the agent logged no refusal of the intruder:\n%s", log)
	}
	// And the job goes on, synchronous and exact.
	reduceExact(ctx, t, j, 2, 5000, 13)
	t.Logf("SETH 3->2->3 and FBCAST through the agent: sums exact for their contributors; agent log:\n%s", a.sw.stderr.String())
}
