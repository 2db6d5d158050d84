package netns_tests

// Sparse jobs on the real daemon (`xdpagg switch`): the switch CPU's copy of the PS's updates
// (a worker that lost update packets gets them from the agent before it resends to the PS), and
// a drained failover in the middle of an iteration, with the hot registers, iteration records and
// cached updates migrated to the standby.

import (
	"context"
	"encoding/json"
	"math/rand/v2"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/controller"
	"github.com/xdpagg/xdpagg/hostlib"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/netns_tests/testbed"
	"github.com/xdpagg/xdpagg/netns_tests/topo"
	"github.com/xdpagg/xdpagg/sparse"
)

// sparseAgentPort is the UDP port the workers of these tests bind.
const sparseAgentPort = 7300

// sparseAgentJob is a sparse job served by a SparsePS on the topology's PS host (its first
// address), with one worker per host, joined through the switch agent.
type sparseAgentJob struct {
	id      uint32
	ps      *hostlib.SparsePS
	workers []*hostlib.SparseWorker
}

// startSparseAgentJob serves job id (admitted under key with m register arrays and hot set hot)
// and starts and JOINs its workers on hosts; stderr is the switch's log, for failures.
func startSparseAgentJob(ctx context.Context, t *testing.T, tp *topo.Topology, id uint32, key []byte, hosts []*topo.Host, hot *sparse.HotSet, m int, stderr func() string) *sparseAgentJob {
	t.Helper()
	j := &sparseAgentJob{id: id}
	psAddr := netip.AddrPortFrom(tp.PS.IP, loader.DefaultPort)
	pj := hostlib.SparsePSJob{ID: id, Hot: hot, Arrays: m, ScaleLog2: hostlib.DefaultScaleLog2}
	for _, h := range hosts {
		pj.Workers = append(pj.Workers, netip.AddrPortFrom(h.IP, sparseAgentPort))
	}
	if err := tp.InHost(tp.PS, func() (err error) {
		j.ps, err = hostlib.NewSparsePS(hostlib.SparsePSConfig{Listen: psAddr, Switch: netip.AddrPortFrom(tp.PS.Gateway, loader.DefaultPort),
			Jobs: []hostlib.SparsePSJob{pj}})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	go j.ps.Serve(ctx)
	t.Cleanup(func() { j.ps.Close() })
	for i, h := range hosts {
		var w *hostlib.SparseWorker
		if err := tp.InHost(h, func() (err error) {
			w, err = hostlib.NewSparseWorker(hostlib.SparseWorkerConfig{JobID: id, WorkerID: uint8(i), NumWorkers: uint8(len(hosts)),
				Local: netip.AddrPortFrom(h.IP, sparseAgentPort), PS: psAddr, Hot: hot, Arrays: m, JobKey: key, Timeout: 20 * time.Millisecond,
				MaxRetries: 1000}) // the test's context is the hang guard
			return err
		}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { w.Close() })
		jctx, cancel := context.WithTimeout(ctx, time.Minute)
		err := w.Join(jctx, netip.AddrPortFrom(h.Gateway, loader.DefaultPort), h.MAC)
		cancel()
		if err != nil {
			t.Fatalf("sparse job %d worker %d join: %v\n%s", id, i, err, stderr())
		}
		j.workers = append(j.workers, w)
	}
	return j
}

// stepSome runs iteration iter on the workers of j listed in which, worker i pushing keys[i]
// and vals[i], and returns their updates.
func (j *sparseAgentJob) stepSome(ctx context.Context, iter uint32, keys [][]uint64, vals [][]float32, which ...int) ([]hostlib.Update, error) {
	ws := make([]*hostlib.SparseWorker, len(which))
	k, v := make([][]uint64, len(which)), make([][]float32, len(which))
	for x, i := range which {
		ws[x], k[x], v[x] = j.workers[i], keys[i], vals[i]
	}
	return testbed.StepAll(ctx, ws, iter, k, v)
}

// step runs iteration iter on every worker of j and checks every update.
func (j *sparseAgentJob) step(ctx context.Context, t *testing.T, iter uint32, keys [][]uint64, vals [][]float32) {
	t.Helper()
	all := make([]int, len(j.workers))
	for i := range all {
		all[i] = i
	}
	ups, err := j.stepSome(ctx, iter, keys, vals, all...)
	if err != nil {
		t.Fatal(err)
	}
	expectUpdates(t, iter, keys, vals, ups)
}

// stats sums the workers' resends and the update packets they recovered from the switch CPU.
func (j *sparseAgentJob) stats() (s hostlib.SparseStats) {
	for _, w := range j.workers {
		st := w.Stats()
		s.Resends += st.Resends
		s.CacheRecovered += st.CacheRecovered
	}
	return s
}

// TestSparseCacheRecovery: worker 0's link from the switch loses 10% of what it carries, update
// packets included. The worker asks the switch agent for the packets it lacks (a sparse
// MSG_RETRANSMIT): the switch copied every update packet the PS sent through it to the agent,
// which answers from that copy; only what the agent cannot answer is resent to the PS. Every
// update is exact, and at least one lost packet came from the switch CPU.
func TestSparseCacheRecovery(t *testing.T) {
	const job, m = 81, 8
	a := newAgentEnv(t, 3, 64)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	key := a.admit(t, job, 3, "--reg-arrays", strconv.Itoa(m))
	hot := hotSetOf(t, 1, 1024, 0)
	j := startSparseAgentJob(ctx, t, a.tp, job, key, a.tp.Workers[:3], hot, m, a.sw.stderr.String)
	if err := a.tp.Impair(a.tp.Workers[0], topo.FromSwitch, topo.Impairment{Loss: 10}); err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(81, 1))
	start := time.Now()
	// At least 30 iterations, and on until worker 0 has had a lost packet from the agent (the
	// loss is random: the count of iterations that takes is not a verdict); 400 is a hang guard.
	it := uint32(1)
	for ; it <= 400 && (it <= 30 || j.workers[0].Stats().CacheRecovered == 0); it++ {
		keys, vals := sparseKeys(rng, 3, 300, 20000)
		j.step(ctx, t, it, keys, vals)
	}
	elapsed := time.Since(start)
	w0 := j.workers[0].Stats()
	c := a.counters(t)
	t.Logf("sparse cache: %d iterations exact with 10%% loss to worker 0 in %v; worker 0 recovered %d update packets from the switch CPU with %d requests (%d misses), resent %d iterations to the PS; switch copied %d packets to the agent (%d ring full); PS resends served %d",
		it-1, elapsed.Round(time.Millisecond), w0.CacheRecovered, w0.CacheRequests, w0.CacheMisses, w0.Resends, c["cached"], c["cache_full"], j.ps.Stats().ResendsServed)
	if w0.CacheRecovered == 0 || w0.CacheRequests == 0 {
		t.Errorf("worker 0 recovered no update packet from the switch CPU: %+v", w0)
	}
	if c["cached"] == 0 {
		t.Errorf("the switch copied no update packet to the agent: %v", c)
	}
}

// TestSparseFailoverDrained: a sparse job on a primary/standby pair; in the middle of an iteration
// (two of its three workers have sent their packets, which the primary summed into its
// registers), the operator moves the group (`xdpagg failover`): the controller drains the
// primary, reads its whole state and restores it on the standby. The hot registers (their sums
// and hit counters), both iteration records and the cached updates move: the third worker's
// packets complete the iteration on the standby, the first two's resends are dropped there as
// duplicates (their record came along), and every update is exact, then and after.
func TestSparseFailoverDrained(t *testing.T) {
	const job, m, n = 82, 8, 3
	e := newFailoverEnv(t, n, job, `{"off": true}`, 0)
	sparseJobConfig(t, e.cfgPath, m)
	e.startController(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	key := e.admittedKey(t)
	hot := hotSetOf(t, 1, 1024, 0)
	j := startSparseAgentJob(ctx, t, e.tp, job, key, e.hosts, hot, m, e.primary.stderr.String)
	e.waitMirrored(t, n)
	rng := rand.New(rand.NewPCG(82, 1))
	for it := uint32(1); it <= 5; it++ {
		keys, vals := sparseKeys(rng, n, 300, 20000)
		j.step(ctx, t, it, keys, vals)
	}

	// Iteration 6: workers 0 and 1 send theirs and wait for the update.
	const mid = 6
	keys, vals := sparseKeys(rng, n, 300, 20000)
	type result struct {
		ups []hostlib.Update
		err error
	}
	first := make(chan result, 1)
	go func() {
		ups, err := j.stepSome(ctx, mid, keys, vals, 0, 1)
		first <- result{ups, err}
	}()
	rec := waitRecord(t, e.bin, e.pinP, job, mid, func(r maps.SparseIteration) bool {
		return r.Announced[0] > 0 && r.Done[0] == r.Announced[0] && r.Announced[1] > 0 && r.Done[1] == r.Announced[1]
	})
	moved := time.Now()
	out, err := exec.CommandContext(ctx, e.bin, "failover", "--state-dir", e.dir, "--group", "g").Output()
	if err != nil {
		t.Fatalf("xdpagg failover: %v\n%s", err, e.ctl.stderr.String())
	}
	var f controller.Failover
	if err := json.Unmarshal(out, &f); err != nil || f.To != "sw-b" || f.Source != "drained" || f.Reason != controller.ReasonOperator || f.Error != "" {
		t.Fatalf("xdpagg failover printed %s (%v)", out, err)
	}
	// Every register array of both parities and the job's iteration records; the updates of the
	// iterations before.
	if f.Migrated.Sparse != 2*m+1 || f.Migrated.Cache == 0 || f.Migrated.Members != n {
		t.Errorf("migrated %+v, want %d sparse entries (2 x %d register arrays and the records), cached updates and %d members", f.Migrated, 2*m+1, m, n)
	}
	got := waitRecord(t, e.bin, e.pinS, job, mid, func(maps.SparseIteration) bool { return true })
	if !slices.Equal(got.Done, rec.Done) || !slices.Equal(got.Announced, rec.Announced) || got.State != "open" {
		t.Errorf("the standby's record of iteration %d: %+v, the primary's was %+v", mid, got, rec)
	}
	// Worker 2 completes the iteration on the standby.
	last, err := j.stepSome(ctx, mid, keys, vals, 2)
	r := <-first
	if err != nil || r.err != nil {
		t.Fatalf("iteration %d across the failover: %v; %v", mid, r.err, err)
	}
	expectUpdates(t, mid, keys, vals, append(r.ups, last...))
	for it := uint32(mid + 1); it <= mid+5; it++ {
		keys, vals := sparseKeys(rng, n, 300, 20000)
		j.step(ctx, t, it, keys, vals)
	}
	c := inspect(t, e.bin, e.pinS).Counters
	st := j.stats()
	t.Logf("sparse failover: drained mid-iteration, moved in %v (drain %v, snapshot %v, restore %v); migrated %+v; standby: %d iterations done, %d duplicates dropped; workers resent %d, recovered %d update packets from the switch CPU",
		time.Since(moved).Round(time.Millisecond), f.Drain.Round(time.Microsecond), f.Snapshot.Round(time.Microsecond), f.Restore.Round(time.Microsecond),
		f.Migrated, c["sparse_done"], c["duplicate"], st.Resends, st.CacheRecovered)
	if c["sparse_done"] != 6 {
		t.Errorf("the standby completed %d iterations, want 6 (the one migrated mid-way and 5 more)", c["sparse_done"])
	}
}

// sparseJobConfig makes the first job of the controller config at path a sparse one with m
// register arrays.
func sparseJobConfig(t *testing.T, path string, m int) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var cfg map[string]any
	if err := json.Unmarshal(b, &cfg); err != nil {
		t.Fatal(err)
	}
	cfg["jobs"].([]any)[0].(map[string]any)["reg_arrays"] = m
	if b, err = json.Marshal(cfg); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// waitRecord waits until the switch pinned under pinRoot holds a record of job's iteration iter
// that ok accepts, and returns it.
func waitRecord(t *testing.T, bin, pinRoot string, job, iter uint32, ok func(maps.SparseIteration) bool) maps.SparseIteration {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second) // a hang guard
	for {
		for _, s := range inspect(t, bin, pinRoot).Sparse {
			if s.JobID != job {
				continue
			}
			if r := s.Records[iter%2]; r.Iteration == iter && ok(r) {
				return r
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no record of job %d iteration %d as wanted at %s", job, iter, pinRoot)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
