package agent

import (
	"bytes"
	"encoding/binary"
	"errors"
	"log/slog"
	"net"
	"testing"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/wire"
)

// heartbeat is the controller's MSG_HEARTBEAT seq under key with stamp.
func heartbeat(t testing.TB, key []byte, seq uint32, stamp uint64) []byte {
	t.Helper()
	return sealAt(t, key, wire.AppendHeader(nil, &wire.Header{Version: wire.Version, Type: msgHeartbeat, Seq: seq}), stamp)
}

// readHeartbeat reads one datagram, which must be a heartbeat answer sealed under ctlKey's
// heartbeat key, and returns its seq, its statistics and the datagram.
func (w *worker) readHeartbeat(t *testing.T, ctlKey []byte) (uint32, bpf.XdpaggHeartbeatStats, []byte) {
	t.Helper()
	answers, err := ctlauth.NewHeartbeatAnswers(ctlKey)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := w.read(t, "heartbeat answer")
	seq, _, st, err := answers.Open(b)
	if err != nil {
		t.Fatalf("the heartbeat answer does not open under the controller key: %v", err)
	}
	return seq, st, b
}

// TestHeartbeatReplayFromAnotherAddress runs the real receive loop (Serve, loopback as a switch
// port): the controller's heartbeat is answered once, to it; the same bytes played back from
// another address, and from the controller's address but another port, are refused as replays
// (counted) and answered nothing. The answer does not carry the statistics in clear and opens
// only under the controller key, unchanged. A restarted controller (a new Stamper) is answered.
func TestHeartbeatReplayFromAnotherAddress(t *testing.T) {
	sw := loadSwitch(t, 4)
	lo, err := net.InterfaceByName("lo")
	if err != nil {
		t.Fatalf("loopback interface: %v", err)
	}
	c, err := ListenControl(0, sw.Maps, map[int]net.HardwareAddr{lo.Index: portMAC}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatalf("ListenControl: %v", err)
	}
	ctlKey := mgKey(t)
	if err := c.SetControllerKey(ctlKey); err != nil {
		t.Fatal(err)
	}
	to := serve(t, c)
	send := func(w *worker, b []byte) {
		t.Helper()
		if _, err := w.conn.WriteTo(b, to); err != nil {
			t.Fatal(err)
		}
	}

	ctl := newWorkerAt(t, "127.0.0.5")
	elsewhere := newWorkerAt(t, "127.0.0.7") // another host
	otherPort := newWorkerAt(t, "127.0.0.5") // the controller's host, another port
	var stamps ctlauth.Stamper               // the controller's
	b := heartbeat(t, ctlKey, 1, stamps.Next())
	send(ctl, b)
	seq, st, ans := ctl.readHeartbeat(t, ctlKey)
	if seq != 1 || st.PoolSize != 4 || st.UptimeNs == 0 {
		t.Errorf("answer for seq %d with %+v", seq, st)
	}

	// The statistics are not in clear: neither the whole struct nor its one field that is
	// surely not small (the uptime in ns).
	clear, err := binary.Append(nil, binary.LittleEndian, &st)
	if err != nil {
		t.Fatal(err)
	}
	uptime := binary.LittleEndian.AppendUint64(nil, st.UptimeNs)
	if bytes.Contains(ans, clear) || bytes.Contains(ans, uptime) {
		t.Errorf("heartbeat answer %x carries the statistics %x in clear", ans, clear)
	}
	if len(ans) != ctlauth.HeartbeatAnswerSize {
		t.Errorf("answer of %d bytes, want %d", len(ans), ctlauth.HeartbeatAnswerSize)
	}
	other, err := ctlauth.NewHeartbeatAnswers(mgKey(t))
	if err != nil {
		t.Fatal(err)
	}
	if _, _, _, err := other.Open(ans); !errors.Is(err, ctlauth.ErrUnauthenticated) {
		t.Errorf("the answer opens under another controller key: %v", err)
	}
	if _, _, err := ctlauth.Open(ctlKey, ans); err == nil {
		t.Error("the answer opens as a control message under the controller key itself")
	}
	answers, err := ctlauth.NewHeartbeatAnswers(ctlKey)
	if err != nil {
		t.Fatal(err)
	}
	for _, i := range []int{4 /* seq */, wire.HdrSize /* stamp */, len(ans) - 40 /* statistics */, len(ans) - 1 /* tag */} {
		bad := bytes.Clone(ans)
		bad[i] ^= 1
		if _, _, _, err := answers.Open(bad); !errors.Is(err, ctlauth.ErrUnauthenticated) {
			t.Errorf("the answer with byte %d changed opens: %v", i, err)
		}
	}

	// The recorded heartbeat from another host and from another port of the controller's.
	send(elsewhere, b)
	send(otherPort, b)
	// Serve handles datagrams in order: once the controller's next heartbeat, sent from
	// elsewhere (a controller restarted on another host, with a Stamper of its own), is
	// answered, both replays were handled, and their answers, if any, would be waiting.
	var restarted ctlauth.Stamper
	send(elsewhere, heartbeat(t, ctlKey, 2, restarted.Next()))
	if seq, _, _ := elsewhere.readHeartbeat(t, ctlKey); seq != 2 {
		t.Errorf("first datagram at the other host answers seq %d, want 2 (the replay of 1 answered?)", seq)
	}
	otherPort.noDatagram(t)
	ctl.noDatagram(t)
	if got := c.Rejected(); got[RejectReplay] != 2 {
		t.Errorf("Rejected() = %v, want 2 replayed", got)
	}
}

// TestHeartbeatRecordPerAgent: a controller's heartbeats to two switches come from one Stamper;
// each agent keeps its own record of the controller's stamps, so the later stamp reaching one
// switch first costs the other nothing, while a stamp below what an agent accepted is refused
// there whatever the sender.
func TestHeartbeatRecordPerAgent(t *testing.T) {
	ct := newCtlTest(t)
	primary, standby := ct.c, newControl(t, ct.sw.Maps)
	ctlKey := mgKey(t)
	for _, c := range []*ControlServer{primary, standby} {
		if err := c.SetControllerKey(ctlKey); err != nil {
			t.Fatal(err)
		}
	}
	ctl := newWorkerAt(t, "127.0.0.5")
	var stamps ctlauth.Stamper
	toStandby, toPrimary := heartbeat(t, ctlKey, 1, stamps.Next()), heartbeat(t, ctlKey, 1, stamps.Next())
	accept(t, primary, toPrimary, testPort, ctl.addr)
	accept(t, standby, toStandby, testPort, ctl.addr)
	for range 2 {
		ctl.readHeartbeat(t, ctlKey)
	}
	wantRefused(t, primary.handle(toStandby, testPort, ctl.addr), RejectReplay, "not after the last accepted")
}
