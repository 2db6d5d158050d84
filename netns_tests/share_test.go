package netns_tests

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/http"
	"net/netip"
	"regexp"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/hostlib"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/netns_tests/topo"
	"github.com/xdpagg/xdpagg/wire"
	"golang.org/x/sys/unix"
)

// tenant is a hostile tenant: worker 0 of an admitted job of its own (one worker), holding the
// job's key, bound from a UDP socket of its own, which floods the agent with everything that key
// allows: Help requests for its own results, JOINs, and sums that complete in the switch and that
// it never acknowledges.
type tenant struct {
	conn     *net.UDPConn
	job      uint32
	key      []byte
	sw, ps   netip.AddrPort
	mac      net.HardwareAddr
	stamps   ctlauth.Stamper
	rtx      atomic.Uint64 // Help requests sent
	joins    atomic.Uint64 // JOINs sent
	sums     atomic.Uint64 // DATA sent (each a sum of one, complete at once)
	received atomic.Uint64 // datagrams back (ACKs, results)
}

// newTenant binds worker 0 of job (admitted with one worker under key) from h's address and port.
func newTenant(ctx context.Context, t *testing.T, env *agentEnv, h *topo.Host, job uint32, key []byte, port uint16) *tenant {
	t.Helper()
	tn := &tenant{job: job, key: key, mac: h.MAC, sw: netip.AddrPortFrom(h.Gateway, loader.DefaultPort),
		ps: netip.AddrPortFrom(env.tp.PS.IP, loader.DefaultPort)}
	if err := env.tp.InHost(h, func() (err error) {
		tn.conn, err = net.ListenUDP("udp4", net.UDPAddrFromAddrPort(netip.AddrPortFrom(h.IP, port)))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tn.conn.Close() })
	// JOIN until the agent's ACK comes back (a lost JOIN or ACK is only resent).
	buf := make([]byte, 4096)
	for joined := false; !joined; {
		if ctx.Err() != nil {
			t.Fatalf("tenant's JOIN: %v", ctx.Err())
		}
		tn.send(t, tn.sw, tn.join())
		_ = tn.conn.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		if n, _, err := tn.conn.ReadFromUDPAddrPort(buf); err == nil && n >= wire.HdrSize && buf[wire.OffType] == wire.MsgAck {
			joined = true
		}
	}
	_ = tn.conn.SetReadDeadline(time.Time{})
	go func() {
		for {
			if _, _, err := tn.conn.ReadFromUDPAddrPort(buf); err != nil {
				return
			}
			tn.received.Add(1)
		}
	}()
	return tn
}

func (tn *tenant) send(t *testing.T, to netip.AddrPort, b []byte) {
	if _, err := tn.conn.WriteToUDPAddrPort(b, to); err != nil && !isTransient(err) {
		t.Errorf("tenant send: %v", err)
	}
}

// isTransient: a send the kernel refused for now (a full queue); the flood goes on.
func isTransient(err error) bool {
	return errors.Is(err, unix.ENOBUFS) || errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.ECONNREFUSED)
}

func (tn *tenant) seal(h wire.Header, body []byte) []byte {
	h.Version, h.JobId, h.WorkerId, h.Bitmap0, h.FanIn0 = wire.Version, tn.job, 0, 1, 1
	b, _ := ctlauth.Seal(tn.key, append(wire.AppendHeader(nil, &h), body...), tn.stamps.Next())
	return b
}

func (tn *tenant) join() []byte {
	var body bpf.XdpaggJoinBody
	copy(body.Mac[:], tn.mac)
	b, _ := binary.Append(nil, binary.LittleEndian, &body)
	return tn.seal(wire.Header{Type: wire.MsgJoin, Seq: uint32(time.Now().UnixNano())}, b)
}

// flood sends, every 200 ms until ctx ends, a burst of 800 Help requests for results of its own
// job that no slot aggregates (each a new seq, so each wants an entry of the agent's pending-Help
// table) and 200 JOINs: five times its port's control burst (floodBurst), so the port's budget
// always cuts it. With sums it also sends 200 DATA of one worker, each completing at once in a
// slot of its own (from slot base on): results the switch copies to the agent's cache, never
// acknowledged.
func (tn *tenant) flood(ctx context.Context, t *testing.T, sums bool, base, pool uint32) {
	rtxSeq, dataSeq := uint32(1<<30), uint32(0)
	for ctx.Err() == nil {
		for i := range 1000 {
			if i%5 == 4 {
				tn.send(t, tn.sw, tn.join())
				tn.joins.Add(1)
				continue
			}
			rtxSeq++
			tn.send(t, tn.sw, tn.seal(wire.Header{Type: wire.MsgRetransmit, Seq: rtxSeq, AggIndex: base}, nil))
			tn.rtx.Add(1)
		}
		for range 200 {
			if !sums {
				break
			}
			dataSeq++
			tn.send(t, tn.ps, xpkt(wire.Header{Type: wire.MsgData, ScaleLog2: 24, JobId: tn.job, Seq: dataSeq,
				AggIndex: (base + dataSeq%64) % pool, Bitmap0: 1, FanIn0: 1}, K, 1))
			tn.sums.Add(1)
		}
		select {
		case <-ctx.Done():
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// floodBurst is the control burst of each port in TestTenantFloodHelpCacheJoin (at 2,000/s).
const floodBurst = 200

// agentMetric reads one series of the agent's Prometheus metrics (e.g.
// `xdpagg_agent_help_total{outcome="full"}`): 0 if absent.
func agentMetric(t *testing.T, env *agentEnv, series string) uint64 {
	t.Helper()
	var conn net.Conn
	if err := env.tp.InSwitch(func() (err error) { conn, err = net.Dial("tcp4", env.sw.ready.MetricsAddr); return err }); err != nil {
		t.Fatal(err)
	}
	// The transport dials on goroutines of its own (outside the namespace): hand it the connection.
	hc := &http.Client{Transport: &http.Transport{DisableKeepAlives: true,
		DialContext: func(context.Context, string, string) (net.Conn, error) { return conn, nil }}}
	resp, err := hc.Get("http://" + env.sw.ready.MetricsAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(series) + ` (\S+)$`).FindSubmatch(body)
	if m == nil {
		return 0
	}
	v, err := strconv.ParseFloat(string(m[1]), 64)
	if err != nil {
		t.Fatalf("metric %s: %v", series, err)
	}
	return uint64(v)
}

func helpMetric(t *testing.T, env *agentEnv, outcome string) uint64 {
	t.Helper()
	return agentMetric(t, env, `xdpagg_agent_help_total{outcome="`+outcome+`"}`)
}

// G4 for the agent's tables: a hostile tenant (job 44, one worker, its own key and binding) floods
// the agent with Help requests for its own results (distinct seqs: each wants a pending-Help
// entry), JOINs, and, with the cache on, sums it never acknowledges, while the victim job of three
// workers runs allreduces in which worker 0 loses every copy of some results that the switch and
// the PS send (the broadcast, the shadow copy, the PS's): only the agent can give them back. In
// "help" the agent has no cache, so each comes from the victim's other members through a
// pending-Help entry; in "cache" it comes from the retransmit cache (or Help). Midway, a victim
// worker leaves and JOINs again. The tenant fills the Help table (and the cache) first; its
// requests beyond its share are refused (`full`), the victim's take the tenant's entries
// (`evicted`), the tenant's control messages beyond its port's budget are dropped in XDP
// (`ctl_limited`), and the victim finishes every allreduce exact.
func TestTenantFloodHelpCacheJoin(t *testing.T) {
	for _, tc := range []struct {
		name  string
		cache bool
	}{{"help", false}, {"cache", true}} {
		t.Run(tc.name, func(t *testing.T) { tenantFlood(t, tc.cache) })
	}
}

func tenantFlood(t *testing.T, cache bool) {
	const (
		w        = 3
		mod, rem = 61, 17 // results lost at victim worker 0: seq = 17 mod 61
		rounds   = 3
		frags    = 200 // per round
		pool     = 1024
		hostile  = 44
	)
	extra := []string{"--control-rate", "2000", "--control-burst", strconv.Itoa(floodBurst), "--metrics-addr", "127.0.0.1:0"}
	if cache {
		extra = append(extra, "--cache-entries", "256")
	} else {
		extra = append(extra, "--no-retransmit-cache")
	}
	env := newAgentEnv(t, w+1, pool, extra...)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	// The victim's lost results come only through the agent, whose one goroutine also works
	// through the tenant's flood: on a loaded machine a recovery may outlast the default 50
	// resends. Its verdict is exactness and the path, not speed: the context is the hang guard.
	spec := jobSpec{id: victimJob, hosts: env.tp.Workers[:w], maxRetries: 100_000}
	env.startPS(ctx, t, spec)
	victim := env.startJob(ctx, t, spec)
	atk := newTenant(ctx, t, env, env.tp.Workers[w], hostile, env.admit(t, hostile, 1), 9800)
	if err := env.tp.Workers[0].XDPLink.Update(dropResultsXDP(t, mod, rem)); err != nil {
		t.Fatalf("swap worker 0's XDP program: %v", err)
	}

	before := env.counters(t)
	t.Cleanup(func() {
		if t.Failed() { // what the agent's Help did, for a red run's message
			for _, o := range []string{"requests", "cache_hits", "asked", "parts", "recovered", "resent", "late", "unanswered", "full", "evicted", "incomplete"} {
				t.Logf("agent help %s: %d", o, helpMetric(t, env, o))
			}
		}
	})
	// The tenant's sums use slots half the pool away from the victim's.
	base := (hostlib.SlotBase(victimJob, pool) + pool/2) % pool
	floodCtx, stopFlood := context.WithCancel(ctx)
	var flooding sync.WaitGroup
	flooding.Go(func() { atk.flood(floodCtx, t, cache, base, pool) })
	defer func() { stopFlood(); flooding.Wait() }()
	// The tenant's flood fills the pending-Help table (and the cache) first. (The limit only
	// bounds a broken run.)
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
		full := helpMetric(t, env, "full") > 0
		if cache {
			c := inspect(t, env.bin, env.pinRoot).Cache
			full = full && c != nil && c.EvictedAge > 0
		}
		if full {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the tenant's flood did not fill the agent's tables in a minute: %d help requests, %d sums sent", atk.rtx.Load(), atk.sums.Load())
		}
	}

	start := time.Now()
	reduceExact(ctx, t, victim, 1, frags*K-3, 900)
	// A victim worker leaves and JOINs again while the tenant floods JOINs.
	h := victim.hosts[w-1]
	swAddr := netip.AddrPortFrom(h.Gateway, loader.DefaultPort)
	if err := victim.workers[w-1].Leave(ctx, swAddr, h.MAC); err != nil {
		t.Fatalf("victim worker %d leave during the flood: %v", w-1, err)
	}
	if err := victim.workers[w-1].Join(ctx, swAddr, h.MAC); err != nil {
		t.Fatalf("victim worker %d join during the flood: %v", w-1, err)
	}
	reduceExact(ctx, t, victim, rounds-1, frags*K-3, 901)
	elapsed := time.Since(start)
	stopFlood()
	flooding.Wait()

	lost := 0
	for seq := 0; seq < rounds*frags; seq++ {
		if seq%mod == rem {
			lost++
		}
	}
	after := env.counters(t)
	st0 := victim.workers[0].Stats()
	var answers uint64
	for _, wk := range victim.workers[1:] {
		answers += wk.Stats().HelpAnswers
	}
	full, evicted := helpMetric(t, env, "full"), helpMetric(t, env, "evicted")
	// Every lost result came back through the agent: from a member (Help) or the cache.
	if st0.CacheResults < uint64(lost) {
		t.Errorf("victim worker 0 got %d results through the agent, want at least the %d it lost: %+v", st0.CacheResults, lost, st0)
	}
	// The tenant's Help requests beyond its share were refused, and its control messages beyond
	// its port's budget dropped.
	if full == 0 {
		t.Error("no Help request of the tenant refused")
	}
	grew(t, before, after, "ctl_limited", 1)
	var hits, evictedAge uint64
	if cache {
		// Only the victim asks for results the cache holds (the tenant's requests are for seqs
		// no sum has).
		// Unless the switch's results ring, which all jobs share (docs/security.md), was full
		// when the victim's sums completed: then their copies never reached the cache, and
		// the losses came back through Help (checked above), which a loaded machine can cause.
		ringFull := after["cache_full"] - before["cache_full"]
		if hits = helpMetric(t, env, "cache_hits"); hits == 0 && ringFull == 0 {
			t.Error("none of the victim's losses was answered from the cache")
		} else if hits == 0 {
			t.Logf("no cache hit: the shared results ring was full %d times (its copies not made)", ringFull)
		}
		if c := inspect(t, env.bin, env.pinRoot).Cache; c != nil {
			evictedAge = c.EvictedAge
		}
	} else {
		// With no cache, each lost result came from a member, through an entry of the full
		// table: the victim's requests took the tenant's entries.
		if evicted == 0 {
			t.Errorf("no pending-Help entry of the tenant evicted for the victim (full %d)", full)
		}
		if answers < uint64(lost) {
			t.Errorf("victim workers 1..%d answered %d help requests, want at least %d", w-1, answers, lost)
		}
	}
	mode := "help"
	if cache {
		mode = "cache"
	}
	t.Logf("tenant flood of help/cache/join (%s): tenant sent %d help requests, %d joins, %d unacknowledged sums (ctl_limited %d); "+
		"agent refused %d of its help requests (full) and evicted %d of its entries for the victim; cache hits %d, evicted %d; "+
		"victim lost %d results at worker 0, %d came back through the agent (mean %v), members answered %d; "+
		"%d rounds of %d fragments and a leave/join in %v, every sum exact",
		mode, atk.rtx.Load(), atk.joins.Load(), atk.sums.Load(), after["ctl_limited"]-before["ctl_limited"],
		full, evicted, hits, evictedAge, lost, st0.CacheResults, st0.CacheLatency, answers, rounds, frags, elapsed.Round(time.Millisecond))
}
