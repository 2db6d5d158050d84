package mgmt

import (
	"crypto/cipher"
	"crypto/rand"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"time"

	"github.com/xdpagg/xdpagg/ctlauth"
)

// Framing (docs/protocol.md, "Management channel"). On the TCP stream each frame is
//
//	length  u32, big-endian: bytes that follow, at most MaxFrame
//	nonce   12 random bytes
//	sealed  AES-256-GCM(stamp u64 little-endian | JSON body) with its 16-byte tag
//
// Requests and responses are sealed under two different keys derived from the controller key
// with HKDF-SHA256 (info strings below), so a response never opens as a request (nor the other
// way round). A request's stamp is the controller's wall clock in ns, strictly increasing; the
// agent accepts only stamps above the last it accepted and within ctlauth.MaxSkew of its clock.
// A response echoes the request's stamp, so an old response does not answer a new request.

// MaxFrame bounds a frame's length (after the length prefix): a ScopeAll snapshot of a full
// 4096-slot pool is about 18.5 MB of JSON, and sparse registers add 8 KiB per array of a job (2
// parities x 3 KiB, base64); 256 MiB leaves room for both and still bounds what a peer can make
// the other side buffer.
const MaxFrame = 256 << 20

const (
	nonceSize = 12
	stampSize = 8
	// infoRequest and infoResponse are the HKDF info strings of the two directions' keys.
	infoRequest  = "xdpagg mgmt v1 controller->switch"
	infoResponse = "xdpagg mgmt v1 switch->controller"
)

// frameKeys are one channel's two directional AEADs.
type frameKeys struct {
	req, resp cipher.AEAD
}

func deriveKeys(key []byte) (fk frameKeys, err error) {
	if fk.req, err = ctlauth.AEAD(key, infoRequest); err != nil {
		return fk, fmt.Errorf("management request key: %w", err)
	}
	if fk.resp, err = ctlauth.AEAD(key, infoResponse); err != nil {
		return fk, fmt.Errorf("management response key: %w", err)
	}
	return fk, nil
}

// seal makes a frame's payload (after the length): nonce | AEAD(stamp | body).
func seal(a cipher.AEAD, stamp uint64, body []byte) ([]byte, error) {
	out := make([]byte, nonceSize, nonceSize+stampSize+len(body)+a.Overhead())
	if _, err := rand.Read(out); err != nil {
		return nil, fmt.Errorf("management nonce: %w", err)
	}
	pt := binary.LittleEndian.AppendUint64(make([]byte, 0, stampSize+len(body)), stamp)
	pt = append(pt, body...)
	return a.Seal(out, out[:nonceSize], pt, nil), nil
}

// open checks and opens a frame's payload; the error wraps ErrAuth.
func open(a cipher.AEAD, payload []byte) (stamp uint64, body []byte, err error) {
	if len(payload) < nonceSize+stampSize+a.Overhead() {
		return 0, nil, fmt.Errorf("%w: frame of %d bytes", ErrAuth, len(payload))
	}
	pt, err := a.Open(nil, payload[:nonceSize], payload[nonceSize:], nil)
	if err != nil {
		return 0, nil, fmt.Errorf("%w: %w", ErrAuth, err)
	}
	return binary.LittleEndian.Uint64(pt), pt[stampSize:], nil
}

// fresh checks that a stamp is within ctlauth.MaxSkew of now; the error wraps ErrAuth.
func fresh(stamp uint64, now time.Time) error {
	d := time.Unix(0, int64(stamp)).Sub(now)
	if d > ctlauth.MaxSkew || d < -ctlauth.MaxSkew {
		return fmt.Errorf("%w: stamp %v from this clock (at most %v)", ErrAuth, d.Round(time.Millisecond), ctlauth.MaxSkew)
	}
	return nil
}

// writeFrame writes a length-prefixed payload.
func writeFrame(w io.Writer, payload []byte) error {
	if len(payload) > MaxFrame {
		return fmt.Errorf("%w: %d bytes, at most %d", ErrFrame, len(payload), MaxFrame)
	}
	var l [4]byte
	binary.BigEndian.PutUint32(l[:], uint32(len(payload)))
	if _, err := w.Write(l[:]); err != nil {
		return err
	}
	_, err := w.Write(payload)
	return err
}

// readFrame reads one length-prefixed payload. The buffer grows with the bytes that arrive (not
// with the length claimed), so a peer that announces MaxFrame and sends nothing costs nothing.
func readFrame(r io.Reader) ([]byte, error) {
	var l [4]byte
	if _, err := io.ReadFull(r, l[:]); err != nil {
		return nil, err
	}
	n := binary.BigEndian.Uint32(l[:])
	if n > MaxFrame {
		return nil, fmt.Errorf("%w: length %d, at most %d", ErrFrame, n, MaxFrame)
	}
	buf := make([]byte, 0, min(n, 1<<20))
	for len(buf) < int(n) {
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)]
		}
		m, err := r.Read(buf[len(buf):min(cap(buf), int(n))])
		buf = buf[:len(buf)+m]
		if err != nil && len(buf) < int(n) {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return nil, fmt.Errorf("%w: %d of %d bytes: %w", ErrFrame, len(buf), n, err)
		}
	}
	return buf, nil
}

// Operations.
const (
	opAdmit    = "admit"
	opRemove   = "remove"
	opReset    = "reset"
	opSnapshot = "snapshot"
	opRestore  = "restore"
	opDrain    = "drain"
	opSync     = "sync" // added after the others: an agent without it refuses it as unknown
)

// request is a request frame's body.
type request struct {
	Op   string          `json:"op"`
	Args json.RawMessage `json:"args,omitempty"`
}

// Error kinds of a response: which sentinel the client wraps.
const (
	kindRefused      = "refused"
	kindIncompatible = "incompatible"
	kindFailed       = "failed"
)

// response is a response frame's body.
type response struct {
	Re     uint64          `json:"re"` // the request's stamp
	Kind   string          `json:"kind,omitempty"`
	Err    string          `json:"err,omitempty"`
	Result json.RawMessage `json:"result,omitempty"`
}
