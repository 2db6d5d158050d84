package netns_tests

import (
	"context"
	"encoding/json"
	"net/netip"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/wire"
)

// Attacks on a running job (docs/security.md). Each test runs `xdpagg switch`, admits job 42 of
// three workers (hosts w0..w2) through `xdpagg job add`, and lets host w3 (its own switch port,
// no key) send hand-built frames while the job runs verified allreduces: every attack must fail,
// and the job must finish exact.

const (
	victimJob = 42
	aggPort   = loader.DefaultPort
	rounds    = 6
	roundLen  = 40*K + 11
)

type attackEnv struct {
	*agentEnv
	job *runningJob
	atk *attacker
	ctx context.Context
}

func newAttackEnv(t *testing.T, extra ...string) *attackEnv {
	t.Helper()
	a := newAgentEnv(t, 4, 256, extra...)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	tp := a.tp
	jobs := a.startJobs(ctx, t, jobSpec{id: victimJob, hosts: tp.Workers[:3]})
	return &attackEnv{agentEnv: a, job: jobs[0], atk: newAttacker(t, tp, tp.Workers[3]), ctx: ctx}
}

// noResultsLeaked fails if any of the victim job's results reached the attacker's host.
func (e *attackEnv) noResultsLeaked(t *testing.T) {
	t.Helper()
	if n := e.atk.results(victimJob); n != 0 {
		t.Errorf("the attacker received %d results of job %d", n, victimJob)
	}
}

// G3: RESULTs forged with the PS's address from another port, or from the attacker's own
// address, never reach the job; the real PS still completes what it must.
func TestAttackForgedResults(t *testing.T) {
	e := newAttackEnv(t)
	ps, w0 := e.tp.PS, e.tp.Workers[0]
	before := e.counters(t)
	const n = 200
	res := func(seq, idx uint32) []byte {
		return xpkt(wire.Header{Type: wire.MsgResult, JobId: victimJob, Seq: seq, AggIndex: idx,
			Bitmap0: 7, FanIn0: 3, Flags: wire.FlagFromSwitch}, K, 1<<24)
	}
	var seq uint32
	during(func() {
		for i := range uint32(5) {
			seq++
			// With the PS's source address (and its MAC), from the wrong switch port.
			f := e.atk.from(ps.IP, aggPort, w0.IP, aggPort, res(seq, (seq+i)%e.pool))
			f.srcMAC = ps.MAC
			e.atk.send(t, f, 1)
			// From its own address: not the job's PS.
			e.atk.send(t, e.atk.from(e.atk.h.IP, aggPort, w0.IP, aggPort, res(seq, (seq+i)%e.pool)), 1)
		}
	}, func() { reduceExact(e.ctx, t, e.job, rounds, roundLen, 100) })
	spoofed := e.atk.from(ps.IP, aggPort, w0.IP, aggPort, res(1, 1))
	spoofed.srcMAC = ps.MAC
	e.atk.send(t, spoofed, n)
	e.atk.send(t, e.atk.from(e.atk.h.IP, aggPort, w0.IP, aggPort, res(1, 1)), n)
	after := e.counters(t)
	// A RESULT is held to the PS's exact registration (address, UDP port, switch port), which
	// catches the spoofed source too: both kinds count as not_member.
	grew(t, before, after, "not_member", 2*n)
	t.Logf("forged results: %d frames; not_member +%d, ps_result +%d; job exact", e.atk.sent.Load(),
		after["not_member"]-before["not_member"], after["ps_result"]-before["ps_result"])
	if after["ps_result"] != before["ps_result"] {
		t.Errorf("ps_result moved by %d: a forged RESULT was taken for the PS's", after["ps_result"]-before["ps_result"])
	}
	e.noResultsLeaked(t)
}

// G2, G6: JOINs without the key (as an existing worker id from another port, as an unused id,
// naming the attacker as the result source), and a genuine JOIN replayed from another port,
// change no binding; the attacker receives nothing and the job stays exact.
func TestAttackJoinTakeover(t *testing.T) {
	e := newAttackEnv(t)
	w0 := e.tp.Workers[0]
	me := e.atk.h
	join := func(worker uint8, resultIP netip.Addr, key []byte, stamp uint64) []byte {
		h := wire.Header{Version: wire.Version, Type: wire.MsgJoin, JobId: victimJob, Seq: 77,
			FanIn0: 3, WorkerId: worker, Bitmap0: 1 << worker}
		b := make([]byte, wire.HdrSize, wire.HdrSize+12+ctlauth.TrailerSize)
		wire.EncodeHeader(b, &h)
		b = append(b, me.MAC...)
		b = append(b, 0, 0)
		ip := [4]byte{}
		if resultIP.IsValid() {
			ip = resultIP.As4()
		}
		b = append(b, ip[:]...)
		if key == nil { // no key: a made-up trailer
			b = append(b, make([]byte, ctlauth.TrailerSize)...)
			return b
		}
		out, err := ctlauth.Seal(key, b, stamp)
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	before := inspect(t, e.bin, e.pinRoot)
	wrongKey, _ := ctlauth.NewKey()
	// A genuine JOIN of worker 0, sealed with the job's key as worker 0 would, recorded and
	// played by the attacker from its own port, twice: worker 0's binding is alive, so both are
	// refused (bound elsewhere), and a refused message uses up no stamp of worker 0's.
	genuine := join(0, netip.Addr{}, e.job.key, uint64(time.Now().UnixNano()))
	e.atk.send(t, e.atk.from(me.IP, 9600, me.Gateway, aggPort, genuine), 2)
	during(func() {
		for _, id := range []uint8{0, 1, 2, 3, 31} {
			e.atk.send(t, e.atk.from(me.IP, 9600, me.Gateway, aggPort, join(id, me.IP, nil, 0)), 1)
			e.atk.send(t, e.atk.from(me.IP, 9600, me.Gateway, aggPort, join(id, e.tp.PS.IP, wrongKey, uint64(time.Now().UnixNano()))), 1)
		}
		// The same JOIN with worker 0's source address: uRPF drops it at the attacker's port.
		f := e.atk.from(w0.IP, 9600, w0.Gateway, aggPort, join(0, me.IP, nil, 0))
		e.atk.send(t, f, 1)
	}, func() { reduceExact(e.ctx, t, e.job, rounds, roundLen, 200) })
	after := inspect(t, e.bin, e.pinRoot)
	if len(after.Members) != 3 {
		t.Errorf("members after the attack: %+v (before %+v)", after.Members, before.Members)
	}
	for _, m := range after.Members {
		if m.JobID == victimJob && m.WorkerID > 2 {
			t.Errorf("worker id %d bound by the attacker", m.WorkerID)
		}
	}
	for _, port := range e.attackerPortMembers(t) {
		t.Errorf("a member of job %d is bound behind the attacker's port: %+v", victimJob, port)
	}
	grew(t, before.Counters, after.Counters, "spoofed", 1)
	t.Logf("join takeover: %d frames; members %d before and after; spoofed +%d; job exact", e.atk.sent.Load(),
		len(after.Members), after.Counters["spoofed"]-before.Counters["spoofed"])
	e.noResultsLeaked(t)
}

// attackerPortMembers lists the members bound behind the attacker's switch port.
func (e *attackEnv) attackerPortMembers(t *testing.T) []maps.Member {
	t.Helper()
	m, err := maps.OpenPinned(e.sw.ready.PinDir)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	all, err := m.ListMembers()
	if err != nil {
		t.Fatal(err)
	}
	var out []maps.Member
	for _, mb := range all {
		if mb.Ifindex == uint32(e.atk.h.PortIndex) {
			out = append(out, mb)
		}
	}
	return out
}

// G1: DATA for the job from the attacker's own address (claiming a worker id) or with a
// member's address is never summed.
func TestAttackSpoofedData(t *testing.T) {
	e := newAttackEnv(t)
	w1, ps := e.tp.Workers[1], e.tp.PS
	data := func(seq uint32) []byte {
		return xpkt(wire.Header{Type: wire.MsgData, JobId: victimJob, Seq: seq, AggIndex: seq % e.pool,
			Bitmap0: 1 << 1, FanIn0: 3, WorkerId: 1}, K, 1<<28)
	}
	before := e.counters(t)
	var seq uint32
	during(func() {
		for range 4 {
			seq++
			e.atk.send(t, e.atk.from(e.atk.h.IP, 9600, ps.IP, aggPort, data(seq)), 1)
			f := e.atk.from(w1.IP, 9600, ps.IP, aggPort, data(seq))
			f.srcMAC = w1.MAC
			e.atk.send(t, f, 1)
		}
	}, func() { reduceExact(e.ctx, t, e.job, rounds, roundLen, 300) })
	after := e.counters(t)
	// DATA is held to the member's exact registration (address, UDP port, switch port): the
	// attacker's own address and worker 1's address from the wrong port both fail it.
	grew(t, before, after, "not_member", 2)
	t.Logf("spoofed data: %d frames; not_member +%d; job exact", e.atk.sent.Load(), after["not_member"]-before["not_member"])
	e.noResultsLeaked(t)
}

// G1: DATA with IP options or as IP fragments is dropped at the switch port instead of being
// passed to the kernel (which would have routed it to the PS).
func TestAttackIPOptionsAndFragments(t *testing.T) {
	e := newAttackEnv(t)
	w1, ps := e.tp.Workers[1], e.tp.PS
	// 100 values: room for IP options within the 1500-byte MTU.
	payload := xpkt(wire.Header{Type: wire.MsgData, JobId: victimJob, Seq: 5, AggIndex: 5,
		Bitmap0: 1 << 1, FanIn0: 3, WorkerId: 1}, 100, 1<<28)
	before := e.counters(t)
	const n = 50
	during(func() {
		// IP options (a no-op option list), from the attacker's own address.
		f := e.atk.from(e.atk.h.IP, 9600, ps.IP, aggPort, payload)
		f.ipOptions = []byte{1, 1, 1, 0}
		e.atk.send(t, f, 1)
		// The datagram in two fragments: the first is dropped, so the PS can never reassemble it.
		first := e.atk.from(e.atk.h.IP, 9600, ps.IP, aggPort, payload[:256])
		first.moreFrags = true
		e.atk.send(t, first, 1)
		// A bad IPv4 header checksum.
		bad := e.atk.from(e.atk.h.IP, 9600, ps.IP, aggPort, payload)
		bad.badChecksum = true
		e.atk.send(t, bad, 1)
		// Trailing bytes after the IP datagram.
		tr := e.atk.from(e.atk.h.IP, 9600, ps.IP, aggPort, payload)
		tr.trailing = 16
		e.atk.send(t, tr, 1)
		// Options with a member's address: uRPF first.
		sp := e.atk.from(w1.IP, 9600, ps.IP, aggPort, payload)
		sp.ipOptions = []byte{1, 1, 1, 0}
		e.atk.send(t, sp, 1)
	}, func() { reduceExact(e.ctx, t, e.job, rounds, roundLen, 400) })
	f := e.atk.from(e.atk.h.IP, 9600, ps.IP, aggPort, payload)
	f.ipOptions = []byte{1, 1, 1, 0}
	e.atk.send(t, f, n)
	after := e.counters(t)
	grew(t, before, after, "ip_invalid", n)
	grew(t, before, after, "malformed", 1)
	grew(t, before, after, "spoofed", 1)
	t.Logf("options and fragments: %d frames; ip_invalid +%d, malformed +%d, spoofed +%d; job exact", e.atk.sent.Load(),
		after["ip_invalid"]-before["ip_invalid"], after["malformed"]-before["malformed"], after["spoofed"]-before["spoofed"])
	e.noResultsLeaked(t)
}

// G3: a RESULT sent straight to a worker's UDP port (not to the xdpagg port, so the switch
// forwards it like any datagram) is refused by the worker: it is not from the PS.
func TestAttackDirectResult(t *testing.T) {
	e := newAttackEnv(t)
	w0 := e.tp.Workers[0]
	res := func(seq uint32) []byte {
		return xpkt(wire.Header{Type: wire.MsgResult, JobId: victimJob, Seq: seq, AggIndex: seq % e.pool,
			Bitmap0: 7, FanIn0: 3, Flags: wire.FlagFromSwitch}, K, 1<<27)
	}
	var seq uint32
	during(func() {
		for range 8 {
			seq++
			e.atk.send(t, e.atk.from(e.atk.h.IP, aggPort, w0.IP, e.job.port, res(seq)), 1)
		}
	}, func() { reduceExact(e.ctx, t, e.job, rounds, roundLen, 500) })
	got := e.job.workers[0].Stats().Foreign
	if got == 0 {
		t.Errorf("worker 0 counted no foreign results, though %d were sent to it", e.atk.sent.Load())
	}
	t.Logf("direct results: %d frames to worker 0's port; worker 0 refused %d as foreign; job exact", e.atk.sent.Load(), got)
	e.noResultsLeaked(t)
}

// G4, G5: a flood of JOINs for a thousand made-up jobs from one port, faster than its control
// budget, locks nobody out: they create no job, the flood is cut in XDP, and the operator
// admits a new job whose worker joins from another port meanwhile.
func TestAttackControlFlood(t *testing.T) {
	a := newAgentEnv(t, 4, 256, "--control-rate", "2000", "--control-burst", "200")
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	victimSpec := jobSpec{id: victimJob, hosts: a.tp.Workers[:3]}
	lateSpec := jobSpec{id: 43, hosts: a.tp.Workers[:1], port: 9700}
	a.startPS(ctx, t, victimSpec, lateSpec)
	e := &attackEnv{agentEnv: a, job: a.startJob(ctx, t, victimSpec), atk: newAttacker(t, a.tp, a.tp.Workers[3]), ctx: ctx}
	me := e.atk.h
	before := e.counters(t)
	join := func(job uint32) []byte {
		h := wire.Header{Version: wire.Version, Type: wire.MsgJoin, JobId: job, Seq: job, FanIn0: 1}
		b := make([]byte, wire.HdrSize, wire.HdrSize+12+ctlauth.TrailerSize)
		wire.EncodeHeader(b, &h)
		b = append(b, me.MAC...)
		b = append(b, make([]byte, 6+ctlauth.TrailerSize)...)
		return b
	}
	var job uint32 = 1000
	during(func() {
		for range 64 {
			job++
			e.atk.send(t, e.atk.from(me.IP, 9600, me.Gateway, aggPort, join(job)), 1)
		}
	}, func() {
		reduceExact(e.ctx, t, e.job, 2, roundLen, 600)
		// The operator admits another job while the flood goes on; its worker (on w0's host,
		// another UDP port) joins and runs.
		other := a.startJob(ctx, t, lateSpec)
		reduceExact(e.ctx, t, other, 2, roundLen, 650)
		reduceExact(e.ctx, t, e.job, 2, roundLen, 660)
	})
	after := e.counters(t)
	t.Logf("control flood: %d frames sent, ctl_limited %d, control passed up %d", e.atk.sent.Load(),
		after["ctl_limited"]-before["ctl_limited"], after["control"]-before["control"])
	grew(t, before, after, "ctl_limited", 1)
	out, err := e.cli(t, "job", "list", "--json")
	if err != nil {
		t.Fatal(err)
	}
	var jobs []maps.Job
	if err := json.Unmarshal(out, &jobs); err != nil {
		t.Fatal(err)
	}
	if len(jobs) != 2 || jobs[0].JobID != victimJob || jobs[1].JobID != 43 {
		t.Errorf("jobs after the flood: %+v, want exactly 42 and 43", jobs)
	}
	e.noResultsLeaked(t)
}

// G4: a hostile tenant — a member of its own admitted job 44, holding its key — tries to take
// every slot of the pool and to fill the PS with sums that never complete. Its slot quota and its
// share of the PS hold it; the victim job finishes exact.
func TestAttackTenantFlood(t *testing.T) {
	a := newAgentEnv(t, 4, 256)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	tp := a.tp
	jobs := a.startJobs(ctx, t, jobSpec{id: victimJob, hosts: tp.Workers[:3]},
		jobSpec{id: 44, hosts: tp.Workers[3:4], port: 9800, extra: []string{"--max-slots", "32"}})
	victim, hostile := jobs[0], jobs[1]
	atk := newAttacker(t, tp, tp.Workers[3])
	me := atk.h
	before := a.counters(t)
	data := func(seq uint32, flags uint16) []byte {
		// Fan-in 2 from a job of one worker: the slot never completes, so it stays held.
		return xpkt(wire.Header{Type: wire.MsgData, JobId: 44, Seq: seq, AggIndex: seq % a.pool,
			Bitmap0: 1, FanIn0: 2, WorkerId: 0, Flags: flags}, K, 1)
	}
	var seq uint32
	flood := func(n int) {
		for range n {
			seq++
			atk.send(t, atk.from(me.IP, hostile.port, tp.PS.IP, aggPort, data(seq, 0)), 1)
			atk.send(t, atk.from(me.IP, hostile.port, tp.PS.IP, aggPort, data(seq+1<<20, wire.FlagResend)), 1)
		}
	}
	flood(int(a.pool)) // one fragment at every slot of the pool first
	during(func() { flood(16) }, func() { reduceExact(ctx, t, victim, rounds, roundLen, 700) })
	after := a.counters(t)
	grew(t, before, after, "over_quota", 1)
	m, err := maps.OpenPinned(a.sw.ready.PinDir)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	j, err := m.GetJob(44)
	if err != nil {
		t.Fatal(err)
	}
	// The quota check reads an atomic counter before taking the slot's lock: racing CPUs may
	// each overshoot by one slot.
	if limit := int32(32 + 2); j.Held > limit {
		t.Errorf("hostile job holds %d slots, quota 32", j.Held)
	}
	t.Logf("tenant flood: %d frames; hostile job holds %d slots (quota 32); over_quota %d; victim stats %+v",
		atk.sent.Load(), j.Held, after["over_quota"]-before["over_quota"], victim.workers[0].Stats())
	if n := atk.results(victimJob); n != 0 {
		t.Errorf("the hostile tenant received %d results of job %d", n, victimJob)
	}
}

// G7: a job that stops (its workers die mid-allreduce) leaves half-filled slots; the agent's
// garbage collector frees them after the slot timeout, and the pool drains to empty.
func TestAttackJobStops(t *testing.T) {
	e := newAttackEnv(t, "--slot-timeout", "400ms")
	reduceExact(e.ctx, t, e.job, 2, roundLen, 800)
	// Two of three workers start an allreduce and die: their fragments hold slots half-filled.
	ctx, cancel := context.WithTimeout(e.ctx, 300*time.Millisecond)
	in, _ := inputs(2, 20*K, 9, uniform)
	done := make(chan struct{}, 2)
	for i, w := range e.job.workers[:2] {
		go func() { _ = w.AllReduce(ctx, in[i]); done <- struct{}{} }()
	}
	<-done
	<-done
	cancel()
	for _, w := range e.job.workers {
		w.Close()
	}
	held := inspect(t, e.bin, e.pinRoot).InUse
	deadline := time.Now().Add(10 * time.Second)
	for inspect(t, e.bin, e.pinRoot).InUse != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("slots still in use 10s after the job stopped (slot timeout 400ms): %+v", inspect(t, e.bin, e.pinRoot))
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("job stopped with %d slots in use; the agent freed them all", held)
	// `xdpagg job rm` ends it: its members are gone.
	if _, err := e.cli(t, "job", "rm", "--id", "42"); err != nil {
		t.Fatal(err)
	}
	if got := inspect(t, e.bin, e.pinRoot); len(got.Members) != 0 {
		t.Errorf("members left after job rm: %+v", got.Members)
	}
}
