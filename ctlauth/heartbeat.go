package ctlauth

import (
	"bytes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/binary"
	"fmt"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/wire"
)

// The agent's MSG_HEARTBEAT answer (docs/protocol.md, MSG_HEARTBEAT) carries the switch's
// statistics encrypted, so that only the controller reads them:
//
//	hdr     32 bytes, clear: version, MSG_HEARTBEAT, the request's seq; every other field 0
//	stamp   u64 little-endian, clear: the agent's stamp (Stamper), for the controller's replay check
//	nonce   12 random bytes
//	sealed  AES-256-GCM(struct heartbeat_stats) and its 16-byte tag; additional data: hdr | stamp
//
// under a key derived from the switch's controller key (AEAD, heartbeatInfo): not the key of the
// management channel's frames, so neither opens as the other. The request stays header and
// struct ctl_auth trailer (Seal): it carries nothing secret.
//
// The nonce is random rather than derived from the stamp: the controller key may be given to
// more than one switch, and a stamp repeats across agents, or in one agent restarted after its
// clock stepped back, while GCM must never see one nonce twice under one key. With 96 random
// bits a repeat among n answers under one key has a chance below n²/2^97: under 2^-32 for the
// 2^32 answers NIST SP 800-38D allows, which heartbeats every 200 ms reach after 27 years (that
// many years divided by the switches sharing the key).
const (
	heartbeatInfo  = "xdpagg heartbeat v1 switch->controller"
	hbNonceSize    = 12
	hbClearSize    = wire.HdrSize + 8 // hdr and stamp: the additional data
	hbNonceOffset  = hbClearSize
	hbSealedOffset = hbClearSize + hbNonceSize
)

// HeartbeatAnswerSize is the length of a heartbeat answer.
var HeartbeatAnswerSize = hbSealedOffset + binary.Size(bpf.XdpaggHeartbeatStats{}) + 16

// HeartbeatAnswers seals (the agent) and opens (the controller) heartbeat answers under one
// switch's controller key. Safe for concurrent use.
type HeartbeatAnswers struct{ aead cipher.AEAD }

// NewHeartbeatAnswers derives the heartbeat answers' key from the controller key.
func NewHeartbeatAnswers(ctlKey []byte) (*HeartbeatAnswers, error) {
	a, err := AEAD(ctlKey, heartbeatInfo)
	if err != nil {
		return nil, fmt.Errorf("heartbeat answer key: %w", err)
	}
	return &HeartbeatAnswers{aead: a}, nil
}

// answerHeader is the only header a heartbeat answer for seq has.
func answerHeader(seq uint32) []byte {
	return wire.AppendHeader(make([]byte, 0, HeartbeatAnswerSize), &wire.Header{Version: wire.Version, Type: wire.MsgHeartbeat, Seq: seq})
}

// Seal makes the answer to the heartbeat seq, with the agent's stamp and statistics st.
func (a *HeartbeatAnswers) Seal(seq uint32, stamp uint64, st *bpf.XdpaggHeartbeatStats) ([]byte, error) {
	body, err := binary.Append(nil, binary.LittleEndian, st)
	if err != nil {
		return nil, err
	}
	out := binary.LittleEndian.AppendUint64(answerHeader(seq), stamp)
	out = append(out, make([]byte, hbNonceSize)...)
	if _, err := rand.Read(out[hbNonceOffset:]); err != nil {
		return nil, fmt.Errorf("heartbeat nonce: %w", err)
	}
	return a.aead.Seal(out, out[hbNonceOffset:], body, out[:hbClearSize]), nil
}

// Open checks a heartbeat answer and returns its seq, its stamp (not checked: see Replay) and
// the statistics. The error wraps ErrUnauthenticated: a wrong length, another key, or any byte
// changed.
func (a *HeartbeatAnswers) Open(pkt []byte) (seq uint32, stamp uint64, st bpf.XdpaggHeartbeatStats, err error) {
	if len(pkt) != HeartbeatAnswerSize {
		return 0, 0, st, fmt.Errorf("%w: heartbeat answer of %d bytes, want %d", ErrUnauthenticated, len(pkt), HeartbeatAnswerSize)
	}
	body, err := a.aead.Open(nil, pkt[hbNonceOffset:hbSealedOffset], pkt[hbSealedOffset:], pkt[:hbClearSize])
	if err != nil {
		return 0, 0, st, fmt.Errorf("%w: heartbeat answer: %w", ErrUnauthenticated, err)
	}
	var h wire.Header
	wire.DecodeHeader(pkt, &h)
	if !bytes.Equal(pkt[:wire.HdrSize], answerHeader(h.Seq)) {
		return 0, 0, st, fmt.Errorf("%w: header %+v is not a heartbeat answer's", ErrUnauthenticated, h)
	}
	if _, err := binary.Decode(body, binary.LittleEndian, &st); err != nil {
		return 0, 0, st, fmt.Errorf("%w: heartbeat statistics: %w", ErrUnauthenticated, err)
	}
	return h.Seq, binary.LittleEndian.Uint64(pkt[wire.HdrSize:]), st, nil
}
