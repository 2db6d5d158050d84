package netns_tests

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/mgmt"
	"github.com/xdpagg/xdpagg/netns_tests/topo"
	"github.com/xdpagg/xdpagg/wire"
)

// heartbeatOver sends one heartbeat under key from the controller namespace to the switch's
// management address sw and returns the statistics of its answer.
func heartbeatOver(t *testing.T, ctl string, sw netip.Addr, key []byte, seq uint32) (bpf.XdpaggHeartbeatStats, error) {
	t.Helper()
	var st bpf.XdpaggHeartbeatStats
	var conn *net.UDPConn
	if err := topo.Do(ctl, func() (err error) {
		conn, err = net.DialUDP("udp4", nil, net.UDPAddrFromAddrPort(netip.AddrPortFrom(sw, loader.DefaultPort)))
		return err
	}); err != nil {
		return st, err
	}
	defer conn.Close()
	answers, err := ctlauth.NewHeartbeatAnswers(key)
	if err != nil {
		return st, err
	}
	var stamps ctlauth.Stamper
	buf := make([]byte, 1024)
	// Resent until answered, each time with a new stamp (the agent refuses the same one twice):
	// the first may meet a neighbour entry or socket not yet there.
	for range 50 {
		b, err := ctlauth.Seal(key, wire.AppendHeader(nil, &wire.Header{Version: wire.Version, Type: wire.MsgHeartbeat, Seq: seq}), stamps.Next())
		if err != nil {
			return st, err
		}
		if _, err := conn.Write(b); err != nil {
			return st, err
		}
		_ = conn.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		n, err := conn.Read(buf)
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return st, err
		}
		aseq, _, st, err := answers.Open(buf[:n])
		if err == nil && aseq != seq {
			err = fmt.Errorf("answer for seq %d, want %d", aseq, seq)
		}
		return st, err
	}
	return st, errors.New("no heartbeat answer")
}

// TestMgmtChannel: the controller, on a management network of its own, drives `xdpagg switch
// --mgmt-listen` through mgmt.Client: it admits a job (again: idempotent; under another key:
// refused), whose workers join and reduce exactly; reads a full snapshot with the job's key,
// members and slots; is heartbeaten over the management interface; drains the switch (every
// host port down, the channel and heartbeats still up) and removes the job. A client with
// another key gets nothing, and the agent counts its connections.
func TestMgmtChannel(t *testing.T) {
	const pool = 64
	keyFile := filepath.Join(t.TempDir(), "controller.key")
	a := &agentEnv{bin: buildCLI(t), pinRoot: bpffsDir(t), pool: pool}
	a.tp = newAgentTopoOf(t, topo.Config{Workers: 2, PS: true, Mgmt: true})
	ctl, mgmtIP := a.tp.Mgmt.NS, a.tp.Mgmt.Primary.Switch
	mgmtAddr := netip.AddrPortFrom(mgmtIP, mgmt.DefaultPort)
	a.sw = startSwitch(t, a.bin, a.pinRoot, a.tp, "--pool", fmt.Sprint(pool), "--controller-key-file", keyFile,
		"--mgmt-listen", mgmtAddr.String(), "--metrics-addr", "127.0.0.1:0")
	if a.sw.ready.MgmtAddr != mgmtAddr.String() {
		t.Errorf("ready file says the channel is at %q, want %v", a.sw.ready.MgmtAddr, mgmtAddr)
	}
	b, err := os.ReadFile(keyFile)
	if err != nil {
		t.Fatal(err)
	}
	key, err := ctlauth.ParseKey(string(b))
	if err != nil {
		t.Fatal(err)
	}
	c, err := mgmt.Dial(mgmtAddr, key)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// A host behind a switch port has a route to the management address (through its gateway,
	// the switch), but the channel is bound to the management interface: no connection.
	if err := a.tp.InHost(a.tp.Workers[0], func() error {
		conn, err := net.DialTimeout("tcp", mgmtAddr.String(), 3*time.Second)
		if err == nil {
			conn.Close()
			return fmt.Errorf("connected from %v", conn.LocalAddr())
		}
		return nil
	}); err != nil {
		t.Errorf("a host behind a switch port reached the management channel at %v: %v", mgmtAddr, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	// Each call connects from the controller namespace.
	inCtl := func(fn func() error) error { return topo.Do(ctl, fn) }

	jobKey, _ := ctlauth.NewKey()
	ps := a.tp.PS
	job := mgmt.Job{ID: 81, Workers: 2, PS: netip.AddrPortFrom(ps.IP, loader.DefaultPort), PSPort: ps.Port, Key: jobKey}
	for i := range 2 { // again: idempotent
		if err := inCtl(func() error { return c.Admit(ctx, job) }); err != nil {
			t.Fatalf("Admit #%d: %v\n%s", i, err, a.sw.stderr.String())
		}
	}
	// An asynchronous job (H 2 of 3) crosses the channel with its threshold, both ways.
	async := mgmt.Job{ID: 82, Workers: 3, Threshold: 2, PS: job.PS, PSPort: ps.Port, Key: jobKey}
	var ctlSnap *mgmt.Snapshot
	if err := inCtl(func() (err error) {
		if err = c.Admit(ctx, async); err == nil {
			ctlSnap, err = c.Snapshot(ctx, mgmt.ScopeControl)
		}
		return err
	}); err != nil {
		t.Fatalf("asynchronous job: %v", err)
	}
	if i := slices.IndexFunc(ctlSnap.Jobs, func(j mgmt.Job) bool { return j.ID == async.ID }); i < 0 || ctlSnap.Jobs[i].Threshold != 2 {
		t.Errorf("snapshot jobs %+v: want job 82 with threshold 2", ctlSnap.Jobs)
	}
	if err := inCtl(func() error { return c.Remove(ctx, async.ID) }); err != nil {
		t.Fatal(err)
	}
	other := job
	other.Key, _ = ctlauth.NewKey()
	if err := inCtl(func() error { return c.Admit(ctx, other) }); !errors.Is(err, mgmt.ErrRefused) {
		t.Errorf("Admit under another key: %v, want ErrRefused", err)
	}

	j := a.startJobs(ctx, t, jobSpec{id: 81, hosts: a.tp.Workers, key: jobKey})[0]
	reduceExact(ctx, t, j, 3, 20_000, 81)

	var snap *mgmt.Snapshot
	start := time.Now()
	if err := inCtl(func() (err error) { snap, err = c.Snapshot(ctx, mgmt.ScopeAll); return err }); err != nil {
		t.Fatalf("Snapshot: %v", err)
	}
	t.Logf("ScopeAll snapshot: %d slots, %d cached results, in %v", len(snap.Slots), len(snap.Cache), time.Since(start).Round(time.Microsecond))
	if snap.Switch != "t" || snap.Pool != pool || len(snap.Jobs) != 1 || snap.Jobs[0].PSPort != ps.Port || string(snap.Jobs[0].Key) != string(jobKey) {
		t.Errorf("snapshot %+v: want switch t, pool %d, job 81 behind %s with its key", snap, pool, ps.Port)
	}
	if len(snap.Members) != 2 {
		t.Fatalf("snapshot members %+v, want 2", snap.Members)
	}
	for _, m := range snap.Members {
		h := a.tp.Workers[m.Worker]
		if m.Job != 81 || m.Port != h.Port || m.Addr != netip.AddrPortFrom(h.IP, 9600) || m.MAC.String() != h.MAC.String() {
			t.Errorf("member %+v, want worker %d at %v:9600 behind %s", m, m.Worker, h.IP, h.Port)
		}
	}

	// Heartbeats arrive on the management interface, not a switch port: answered.
	st, err := heartbeatOver(t, ctl, mgmtIP, key, 1)
	if err != nil {
		t.Fatalf("heartbeat over the management network: %v", err)
	}
	if st.Jobs != 1 || st.Members != 2 || st.PoolSize != pool {
		t.Errorf("heartbeat statistics %+v", st)
	}

	// Another key: no answer, counted.
	otherKey, _ := ctlauth.NewKey()
	bad, _ := mgmt.Dial(mgmtAddr, otherKey)
	if err := inCtl(func() error { return bad.Drain(ctx) }); !errors.Is(err, mgmt.ErrFrame) {
		t.Errorf("Drain under another key: %v, want ErrFrame", err)
	}
	if got := agentMetric(t, a, `xdpagg_agent_mgmt_dropped_total{reason="auth"}`); got != 1 {
		t.Errorf(`xdpagg_agent_mgmt_dropped_total{reason="auth"} = %d, want 1`, got)
	}
	for _, p := range portsUp(t, a.tp) {
		if !p {
			t.Fatal("a port is down before the drain")
		}
	}

	for range 2 { // idempotent
		if err := inCtl(func() error { return c.Drain(ctx) }); err != nil {
			t.Fatalf("Drain: %v", err)
		}
	}
	for name, up := range portsUp(t, a.tp) {
		if up {
			t.Errorf("port %s still up after the drain", name)
		}
	}
	if err := inCtl(func() (err error) { snap, err = c.Snapshot(ctx, mgmt.ScopeControl); return err }); err != nil || !snap.Draining || len(snap.Members) != 2 {
		t.Errorf("snapshot after the drain: %+v, %v", snap, err)
	}
	if _, err := heartbeatOver(t, ctl, mgmtIP, key, 2); err != nil {
		t.Errorf("heartbeat after the drain: %v", err)
	}
	if err := inCtl(func() error { return c.Remove(ctx, 81) }); err != nil {
		t.Fatalf("Remove: %v", err)
	}
	if err := inCtl(func() (err error) { snap, err = c.Snapshot(ctx, mgmt.ScopeControl); return err }); err != nil || len(snap.Jobs) != 0 || len(snap.Members) != 0 {
		t.Errorf("snapshot after Remove: %+v, %v", snap, err)
	}
}

// portsUp says, by switch port name, whether each host port is administratively up.
func portsUp(t *testing.T, tp *topo.Topology) map[string]bool {
	t.Helper()
	out := map[string]bool{}
	if err := tp.InSwitch(func() error {
		h, err := netlink.NewHandle()
		if err != nil {
			return err
		}
		defer h.Close()
		for _, host := range tp.Hosts() {
			l, err := h.LinkByName(host.Port)
			if err != nil {
				return err
			}
			out[host.Port] = l.Attrs().Flags&net.FlagUp != 0
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return out
}
