package netns_tests

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"

	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/netns_tests/topo"
	"github.com/xdpagg/xdpagg/wire"
)

// dropResultsXDP returns an XDP program for a worker's link that drops every MSG_RESULT (UDP from
// the xdpagg port) whose seq is rem modulo mod, unless it carries F_CACHED: the switch's
// broadcast, its shadow copies (F_SHADOW) and the PS's copies of those sums never arrive; only
// what the switch's agent sends on does. IPv4 without options, as the topology sends.
func dropResultsXDP(t *testing.T, mod, rem int32) *ebpf.Program {
	t.Helper()
	const (
		offEtherType = 12
		offProto     = 14 + 9
		offSrcPort   = 14 + 20
		offHdr       = 14 + 20 + 8
		end          = offHdr + wire.HdrSize
	)
	var port [2]byte
	binary.BigEndian.PutUint16(port[:], loader.DefaultPort)
	return hostXDP(t, "result-dropping", asm.Instructions{
		asm.LoadMem(asm.R2, asm.R1, 0, asm.Word), // data
		asm.LoadMem(asm.R3, asm.R1, 4, asm.Word), // data_end
		asm.Mov.Reg(asm.R4, asm.R2),
		asm.Add.Imm(asm.R4, end),
		asm.JGT.Reg(asm.R4, asm.R3, "pass"),
		asm.LoadMem(asm.R5, asm.R2, offEtherType, asm.Half),
		asm.JNE.Imm(asm.R5, 0x0008, "pass"), // ETH_P_IP, read little-endian
		asm.LoadMem(asm.R5, asm.R2, offProto, asm.Byte),
		asm.JNE.Imm(asm.R5, 17, "pass"), // UDP
		asm.LoadMem(asm.R5, asm.R2, offSrcPort, asm.Half),
		asm.JNE.Imm(asm.R5, int32(binary.LittleEndian.Uint16(port[:])), "pass"),
		asm.LoadMem(asm.R5, asm.R2, offHdr+wire.OffType, asm.Byte),
		asm.JNE.Imm(asm.R5, int32(wire.MsgResult), "pass"),
		asm.LoadMem(asm.R5, asm.R2, offHdr+wire.OffFlags, asm.Half),
		asm.And.Imm(asm.R5, int32(wire.FlagCached)),
		asm.JNE.Imm(asm.R5, 0, "pass"),
		asm.LoadMem(asm.R5, asm.R2, offHdr+wire.OffSeq, asm.Word),
		asm.Mod.Imm(asm.R5, mod),
		asm.JNE.Imm(asm.R5, rem, "pass"),
	})
}

// iSwitch's Help, completed by the job's members: `xdpagg switch --no-retransmit-cache`, four
// workers that JOIN, and worker 0 losing every copy of some results that the switch can send it
// (the broadcast, the slot's shadow copy, the PS's): neither the switch's cache nor its shadow
// copy can give them back, and worker 0's resends alone could never complete them (the others
// have their results and resend nothing). Worker 0's Help request reaches the agent, which asks
// workers 1..3 (MSG_HELP); their authenticated answers come back to worker 0 as F_CACHED results,
// and every sum is exact. Meanwhile an attacker on a fifth port, holding another admitted job's
// key, sends the agent answers with wrong values for the lost results (under that key, under a
// made-up one, claiming a worker id of the job): none of them reaches a sum.
func TestHelpRecoversFromMembers(t *testing.T) {
	const (
		w        = 4
		mod, rem = 61, 17 // results lost at worker 0: seq = 17 mod 61
		rounds   = 3
		frags    = 200 // per round (n below)
	)
	env := newAgentEnv(t, w+1, 1024, "--no-retransmit-cache")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	// Worker 0's lost results come only through the agent, beside a flood of forged answers: its
	// retries are not the verdict (the context is the hang guard; see TestTenantFloodHelpCacheJoin).
	job := env.startJobs(ctx, t, jobSpec{id: 13, hosts: env.tp.Workers[:w], maxRetries: 100_000})[0]
	workers := job.workers
	forged := forgeHelpAnswers(ctx, t, env, env.tp.Workers[w], 13, env.admit(t, 99, 1), mod, rem, rounds*frags)
	if err := env.tp.Workers[0].XDPLink.Update(dropResultsXDP(t, mod, rem)); err != nil {
		t.Fatalf("swap worker 0's XDP program: %v", err)
	}
	before := env.counters(t)
	start := time.Now()
	reduceExact(ctx, t, job, rounds, frags*K-3, 130) // the last fragment short: its parts are not all full
	elapsed := time.Since(start)
	lost := 0
	for seq := 0; seq < rounds*frags; seq++ {
		if seq%mod == rem {
			lost++
		}
	}
	st0 := workers[0].Stats()
	var answers uint64
	for _, wk := range workers[1:] {
		answers += wk.Stats().HelpAnswers
	}
	after := env.counters(t)
	// Every lost result came back through the agent: with its cache off, only from a member.
	if st0.CacheResults < uint64(lost) {
		t.Errorf("worker 0 got %d results through the agent, want at least the %d it lost: %+v", st0.CacheResults, lost, st0)
	}
	if answers < uint64(lost) {
		t.Errorf("workers 1..%d answered %d help requests, want at least %d", w-1, answers, lost)
	}
	if c := after["cached"] - before["cached"]; c != 0 {
		t.Errorf("switch copied %d results to a cache that is off", c)
	}
	if forged.Load() == 0 {
		t.Error("the attacker sent nothing")
	}
	fmt.Printf("member-assisted help (and %d forged answers refused): %d results lost at worker 0 (every switch and PS copy), %d recovered through members "+
		"(mean %v after the first help request; %d help requests, %d data resends); members answered %d; shadow_tx %d; %d rounds of %d fragments in %v\n",
		forged.Load(), lost, st0.CacheResults, st0.CacheLatency, st0.CacheRequests, st0.Retransmits, answers, after["shadow_tx"]-before["shadow_tx"], rounds, frags, elapsed.Round(time.Millisecond))
}

// iSwitch's Join, Ack and Leave end to end against `xdpagg switch`: workers JOIN over the wire
// (the agent binds them and the switch sends them results), their cumulative ACKs let the
// retransmit cache drop what every member has, a LEAVE removes the member, and the worker can
// JOIN again and sum exactly. The senders' rights are the agent tests' (TestHandleJoinLeave,
// TestHandleJoinBinding, TestHandleRefusesWorkers, TestHandleRetransmit).
func TestJoinAckLeave(t *testing.T) {
	const w = 3
	env := newAgentEnv(t, w, 1024)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	job := env.startJobs(ctx, t, jobSpec{id: 14, hosts: env.tp.Workers[:w]})[0]
	membersOf := func() map[uint8]bool {
		got := map[uint8]bool{}
		for _, m := range inspect(t, env.bin, env.pinRoot).Members {
			if m.JobID == job.id {
				got[m.WorkerID] = true
			}
		}
		return got
	}
	if got := membersOf(); len(got) != w {
		t.Fatalf("members after JOIN: %v, want %d", got, w)
	}
	reduceExact(ctx, t, job, 2, 100*K+1, 140)
	// The ACKs reach the agent's cache: results every member acknowledged are dropped. (The
	// agent publishes its cache statistics every 100 ms; the limit only bounds a broken agent.)
	got := inspect(t, env.bin, env.pinRoot)
	for deadline := time.Now().Add(30 * time.Second); (got.Cache == nil || got.Cache.EvictedAcked == 0) && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond)
		got = inspect(t, env.bin, env.pinRoot)
	}
	if got.Cache == nil || got.Cache.EvictedAcked == 0 {
		t.Errorf("no cached result dropped on the members' ACKs: %+v", got.Cache)
	}
	h := job.hosts[w-1]
	sw := netip.AddrPortFrom(h.Gateway, loader.DefaultPort)
	if err := job.workers[w-1].Leave(ctx, sw, h.MAC); err != nil {
		t.Fatalf("leave: %v", err)
	}
	if got := membersOf(); len(got) != w-1 || got[w-1] {
		t.Errorf("members after worker %d's LEAVE: %v", w-1, got)
	}
	if err := job.workers[w-1].Join(ctx, sw, h.MAC); err != nil {
		t.Fatalf("join again: %v", err)
	}
	if got := membersOf(); len(got) != w {
		t.Errorf("members after JOIN again: %v", got)
	}
	reduceExact(ctx, t, job, 1, 100*K+1, 150)
}

// forgeHelpAnswers sends the switch's agent, from host h until ctx ends, HELP answers with wrong
// values for job's results seq = rem mod mod (seq < n), as every worker id of the job: sealed under
// otherKey (another admitted job's, which the attacker holds), and under a key of its own. It
// returns the count of answers sent so far.
func forgeHelpAnswers(ctx context.Context, t *testing.T, env *agentEnv, h *topo.Host, job uint32, otherKey []byte, mod, rem, n int) *atomic.Uint64 {
	t.Helper()
	var conn *net.UDPConn
	if err := env.tp.InHost(h, func() (err error) {
		conn, err = net.ListenUDP("udp4", net.UDPAddrFromAddrPort(netip.AddrPortFrom(h.IP, 0)))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	ownKey, err := ctlauth.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	sw := netip.AddrPortFrom(h.Gateway, loader.DefaultPort)
	var stamps ctlauth.Stamper
	var sent atomic.Uint64
	go func() {
		vals := make([]byte, 4*K)
		for i := range vals {
			vals[i] = 0x5a
		}
		// A steady trickle, not a flood (TestAttackControlFlood is that): each lost result in
		// turn, as each worker id, under each key, every few milliseconds.
		keys := [][]byte{otherKey, ownKey}
		for round := 0; ctx.Err() == nil; round++ {
			worker, key := uint8(round%4), keys[round/4%2]
			for seq := rem; seq < n && ctx.Err() == nil; seq += mod {
				for off := 0; off < K; off += wire.HelpPartValues {
					c := min(wire.HelpPartValues, K-off)
					hd := wire.Header{Version: wire.Version, Type: wire.MsgHelp, Encoding: wire.EncFixed32, ScaleLog2: 24,
						Count: uint16(c), JobId: job, Seq: uint32(seq), WorkerId: worker, Bitmap0: 0xf, FanIn0: 4}
					b := wire.AppendHeader(nil, &hd)
					b = binary.LittleEndian.AppendUint16(b, K)
					b = binary.LittleEndian.AppendUint16(b, uint16(off))
					b = binary.LittleEndian.AppendUint32(b, 0)
					b, _ = ctlauth.Seal(key, append(b, vals[:4*c]...), stamps.Next())
					if _, err := conn.WriteToUDPAddrPort(b, sw); err == nil {
						sent.Add(1)
					}
				}
			}
			time.Sleep(5 * time.Millisecond)
		}
	}()
	return &sent
}
