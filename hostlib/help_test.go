package hostlib

import (
	"bytes"
	"context"
	"encoding/binary"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/wire"
)

// A joined worker keeps its results and answers the switch agent's MSG_HELP with one, in parts of
// at most wire.HelpPartValues values, each authenticated; it answers nobody else, and nothing it
// does not keep.
func TestWorkerAnswersHelp(t *testing.T) {
	key, otherKey := testKey(t), testKey(t)
	var agentStamps ctlauth.Stamper
	ps := listenOn(t, "127.0.0.1", 0)
	const k = 300
	w := newKeyedWorker(t, WorkerConfig{JobKey: key, PS: connAddr(ps), ValuesPerPacket: k})
	a := newFakeAgent(t, key, nil, func(h wire.Header) []byte { return ackOf(t, key, h, h.Seq, h.WorkerId, agentStamps.Next()) })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second) // failsafe only
	defer cancel()
	if err := w.Join(ctx, a.addr(), testMAC); err != nil {
		t.Fatal(err)
	}
	// The PS answers every DATA with a result: its values plus one, from the PS's address.
	sent := map[uint32][]byte{} // seq -> the result's values as sent
	results := make(chan struct{}, 8)
	go func() {
		buf := make([]byte, wire.MaxPacket)
		for {
			n, from, err := ps.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			h, vals, err := wire.ParsePacket(buf[:n])
			if err != nil || h.Type != wire.MsgData || h.Flags&wire.FlagResend != 0 {
				continue
			}
			h.Type, h.Flags, h.Bitmap0 = wire.MsgResult, wire.FlagFromSwitch, 0b11
			out := wire.AppendHeader(nil, &h)
			for i := 0; i < len(vals); i += 4 {
				out = binary.LittleEndian.AppendUint32(out, binary.LittleEndian.Uint32(vals[i:])+1)
			}
			sent[h.Seq] = out[wire.HdrSize:]
			_, _ = ps.WriteToUDPAddrPort(out, from)
			results <- struct{}{}
		}
	}()
	data := make([]float32, 2*k-10) // seq 0: k values, seq 1: k-10
	for i := range data {
		data[i] = float32(i) / 64
	}
	if err := w.AllReduce(ctx, data); err != nil {
		t.Fatal(err)
	}
	<-results
	<-results
	want := sent[1]

	request := func(seq uint32, worker uint8, key []byte, stamp uint64) []byte {
		b := wire.AppendHeader(nil, &wire.Header{Version: wire.Version, Type: wire.MsgHelp, JobId: 3, Seq: seq, WorkerId: worker})
		out, err := ctlauth.Seal(key, b, stamp)
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	answers := func() (parts []wire.Header, bodies [][]byte) {
		msgs, _, bs, _ := a.received()
		for i, h := range msgs {
			if h.Type == wire.MsgHelp {
				parts, bodies = append(parts, h), append(bodies, bs[i])
			}
		}
		return parts, bodies
	}
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("no %s: %+v", what, w.Stats())
			}
		}
	}

	// Refused first, each counted and unanswered: another job's key, an outsider's address, a
	// result the worker does not keep, and a replay of an authentic request.
	if _, err := a.conn.WriteToUDPAddrPort(request(1, 1, otherKey, agentStamps.Next()), w.LocalAddr()); err != nil {
		t.Fatal(err)
	}
	waitFor("Unauthenticated", func() bool { return w.Stats().Unauthenticated == 1 })
	outsider := listenOn(t, "127.0.0.2", 0)
	if _, err := outsider.WriteToUDPAddrPort(request(1, 1, key, agentStamps.Next()), w.LocalAddr()); err != nil {
		t.Fatal(err)
	}
	waitFor("Foreign", func() bool { return w.Stats().Foreign == 1 })
	if _, err := a.conn.WriteToUDPAddrPort(request(9, 1, key, agentStamps.Next()), w.LocalAddr()); err != nil {
		t.Fatal(err)
	}
	waitFor("HelpUnknown", func() bool { return w.Stats().HelpUnknown == 1 })
	if _, err := a.conn.WriteToUDPAddrPort(request(1, 0, key, agentStamps.Next()), w.LocalAddr()); err != nil {
		t.Fatal(err) // for another worker id
	}
	waitFor("Malformed", func() bool { return w.Stats().Malformed == 1 })
	if p, _ := answers(); len(p) != 0 {
		t.Fatalf("refused requests answered: %+v", p)
	}

	// The authentic request: answered with seq 1's values, in two parts.
	good := request(1, 1, key, agentStamps.Next())
	if _, err := a.conn.WriteToUDPAddrPort(good, w.LocalAddr()); err != nil {
		t.Fatal(err)
	}
	waitFor("answer", func() bool { p, _ := answers(); return len(p) == 2 })
	parts, bodies := answers()
	var got []byte
	for i, h := range parts {
		total, off := binary.LittleEndian.Uint16(bodies[i]), binary.LittleEndian.Uint16(bodies[i][2:])
		n := min(wire.HelpPartValues, k-10-i*wire.HelpPartValues)
		if h.Seq != 1 || h.JobId != 3 || h.WorkerId != 1 || int(h.Count) != n || total != k-10 || int(off) != i*wire.HelpPartValues ||
			binary.LittleEndian.Uint32(bodies[i][4:]) != 0 || len(bodies[i]) != wire.HelpBodySize+4*n ||
			h.Encoding != wire.EncFixed32 || h.Flags != wire.FlagFromSwitch || h.Bitmap0 != 0b11 {
			t.Errorf("answer part %d: %+v, body %x", i, h, bodies[i][:wire.HelpBodySize])
		}
		got = append(got, bodies[i][wire.HelpBodySize:]...)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("answered values differ from the result the worker received")
	}
	if st := w.Stats(); st.HelpAnswers != 1 {
		t.Errorf("HelpAnswers = %d, want 1", st.HelpAnswers)
	}
	// The same request again (a replay): counted, not answered.
	if _, err := a.conn.WriteToUDPAddrPort(good, w.LocalAddr()); err != nil {
		t.Fatal(err)
	}
	waitFor("Replayed", func() bool { return w.Stats().Replayed == 1 })
	if p, _ := answers(); len(p) != 2 {
		t.Errorf("a replayed request was answered: %d parts", len(p))
	}
}

// BenchmarkKeep is what keeping a result for member-assisted Help adds to each result a joined
// worker takes: one copy of its K values into the ring (compare BenchmarkDequantizeFrom, which
// every result pays anyway).
func BenchmarkKeep(b *testing.B) {
	w := &Worker{cfg: WorkerConfig{Window: DefaultWindow, ValuesPerPacket: wire.StdValues}}
	w.startKeeping()
	vals := make([]byte, 4*wire.StdValues)
	h := wire.Header{Type: wire.MsgResult, Count: wire.StdValues}
	b.SetBytes(int64(len(vals)))
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		h.Seq = uint32(i)
		w.keep(&h, vals)
	}
}
