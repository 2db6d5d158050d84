package ctlauth

import (
	"bytes"
	"encoding/binary"
	"errors"
	"testing"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/wire"
)

// TestHeartbeatAnswers: an answer opens under its controller key to the seq, stamp and
// statistics sealed; its header and stamp are in clear where docs/protocol.md says, the
// statistics are not; two answers of the same statistics differ (random nonces); any byte
// changed, a wrong length, another controller key, or the management channel's keys derived
// from the same key fail with ErrUnauthenticated.
func TestHeartbeatAnswers(t *testing.T) {
	key := mustKey(t)
	a, err := NewHeartbeatAnswers(key)
	if err != nil {
		t.Fatal(err)
	}
	st := bpf.XdpaggHeartbeatStats{UptimeNs: 0x1122334455667788, PoolSize: 4096, Jobs: 3, Rx: 0x0102030405060708, Flushed: 0xfeedface}
	const seq, stamp = 0xabcdef01, 0x0123456789abcdef
	b, err := a.Seal(seq, stamp, &st)
	if err != nil {
		t.Fatal(err)
	}
	if len(b) != HeartbeatAnswerSize || HeartbeatAnswerSize != wire.HdrSize+8+12+binary.Size(st)+16 {
		t.Fatalf("answer of %d bytes, HeartbeatAnswerSize %d", len(b), HeartbeatAnswerSize)
	}
	var h wire.Header
	wire.DecodeHeader(b, &h)
	if h != (wire.Header{Version: wire.Version, Type: wire.MsgHeartbeat, Seq: seq}) || binary.LittleEndian.Uint64(b[wire.HdrSize:]) != stamp {
		t.Errorf("clear part: header %+v, stamp %#x", h, binary.LittleEndian.Uint64(b[wire.HdrSize:]))
	}
	clear, _ := binary.Append(nil, binary.LittleEndian, &st)
	for _, field := range [][]byte{clear, clear[:8], binary.LittleEndian.AppendUint64(nil, st.Rx)} {
		if bytes.Contains(b, field) {
			t.Errorf("answer %x carries %x in clear", b, field)
		}
	}
	gotSeq, gotStamp, got, err := a.Open(b)
	if err != nil || gotSeq != seq || gotStamp != stamp || got != st {
		t.Fatalf("Open = %#x, %#x, %+v, %v", gotSeq, gotStamp, got, err)
	}
	if b2, _ := a.Seal(seq, stamp, &st); bytes.Equal(b[wire.HdrSize+8:], b2[wire.HdrSize+8:]) {
		t.Error("two answers share their nonce and ciphertext")
	}
	for i := range b {
		bad := bytes.Clone(b)
		bad[i] ^= 0x80
		if _, _, _, err := a.Open(bad); !errors.Is(err, ErrUnauthenticated) {
			t.Fatalf("byte %d changed: Open = %v", i, err)
		}
	}
	for _, bad := range [][]byte{nil, b[:len(b)-1], append(bytes.Clone(b), 0)} {
		if _, _, _, err := a.Open(bad); !errors.Is(err, ErrUnauthenticated) {
			t.Errorf("%d bytes: Open = %v", len(bad), err)
		}
	}
	other, _ := NewHeartbeatAnswers(mustKey(t))
	if _, _, _, err := other.Open(b); !errors.Is(err, ErrUnauthenticated) {
		t.Errorf("another controller key: Open = %v", err)
	}
	// The same key under another purpose's info (the management channel's) does not open it.
	for _, info := range []string{"xdpagg mgmt v1 controller->switch", "xdpagg mgmt v1 switch->controller"} {
		g, err := AEAD(key, info)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := g.Open(nil, b[wire.HdrSize+8:wire.HdrSize+20], b[wire.HdrSize+20:], b[:wire.HdrSize+8]); err == nil {
			t.Errorf("opens under %q", info)
		}
	}
	if _, err := NewHeartbeatAnswers(key[:5]); !errors.Is(err, ErrBadKey) {
		t.Errorf("short key: %v", err)
	}
}
