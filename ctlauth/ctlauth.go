// Package ctlauth authenticates xdpagg control messages (JOIN, LEAVE, ACK, RETRANSMIT and the
// agent's answers) with a per-job key: HMAC-SHA256 from Go's standard library over the whole
// message, truncated to 128 bits, plus a sender stamp for replay protection. The trailer's layout
// is struct ctl_auth in bpf/xdpagg.h; docs/protocol.md and docs/security.md describe its use.
package ctlauth

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/xdpagg/xdpagg/wire"
)

// Sizes of the key and of the trailer (struct ctl_auth, struct job_key).
const (
	KeySize     = wire.JobKeySize
	TrailerSize = wire.CtlAuthSize
	TagSize     = TrailerSize - 8
)

// MaxSkew is how far a message's stamp may be from the receiver's clock (either way). Older
// messages are refused even by a receiver that has forgotten the sender (a restarted agent), so a
// recorded message can be replayed for at most this long after it was sent, and only to a
// receiver that has not seen a later one from the same sender.
const MaxSkew = 30 * time.Second

// Sentinel errors.
var (
	ErrBadKey = errors.New("invalid job key")
	// ErrUnauthenticated: no trailer, or a tag that does not match the message under the key.
	ErrUnauthenticated = errors.New("control message not authenticated")
	// ErrReplay: an authentic message whose stamp is not above the sender's last accepted one,
	// or too far from the receiver's clock.
	ErrReplay = errors.New("control message replayed or stale")
)

// NewKey makes a random job key.
func NewKey() ([]byte, error) {
	k := make([]byte, KeySize)
	if _, err := rand.Read(k); err != nil {
		return nil, fmt.Errorf("make job key: %w", err)
	}
	return k, nil
}

// ParseKey reads a key written by FormatKey (hex, KeySize bytes).
func ParseKey(s string) ([]byte, error) {
	k, err := hex.DecodeString(strings.TrimSpace(s))
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadKey, err)
	}
	if len(k) != KeySize {
		return nil, fmt.Errorf("%w: %d bytes, want %d", ErrBadKey, len(k), KeySize)
	}
	return k, nil
}

// FormatKey writes a key as hex.
func FormatKey(k []byte) string { return hex.EncodeToString(k) }

func tag(key, msg []byte) []byte {
	m := hmac.New(sha256.New, key)
	m.Write(msg)
	return m.Sum(nil)[:TagSize]
}

// Seal appends the trailer (stamp and tag) to msg and returns the result.
func Seal(key, msg []byte, stamp uint64) ([]byte, error) {
	if len(key) != KeySize {
		return nil, fmt.Errorf("%w: %d bytes, want %d", ErrBadKey, len(key), KeySize)
	}
	out := binary.LittleEndian.AppendUint64(msg, stamp)
	return append(out, tag(key, out)...), nil
}

// Open checks pkt's trailer under key and returns the message before it and its stamp. It does
// not check the stamp: see Replay.
func Open(key, pkt []byte) (msg []byte, stamp uint64, err error) {
	if len(key) != KeySize {
		return nil, 0, fmt.Errorf("%w: %d bytes, want %d", ErrBadKey, len(key), KeySize)
	}
	if len(pkt) < TrailerSize {
		return nil, 0, fmt.Errorf("%w: %d bytes, no room for the %d-byte trailer", ErrUnauthenticated, len(pkt), TrailerSize)
	}
	body := pkt[:len(pkt)-TagSize]
	if !hmac.Equal(tag(key, body), pkt[len(pkt)-TagSize:]) {
		return nil, 0, fmt.Errorf("%w: tag mismatch", ErrUnauthenticated)
	}
	n := len(pkt) - TrailerSize
	return pkt[:n], binary.LittleEndian.Uint64(pkt[n:]), nil
}

// Stamper hands out a sender's stamps: wall-clock nanoseconds, strictly increasing even when the
// clock steps back or two messages fall in one nanosecond. Safe for concurrent use.
type Stamper struct {
	mu   sync.Mutex
	last uint64
	now  func() time.Time // time.Now by default (tests)
}

// Next returns the next stamp.
func (s *Stamper) Next() uint64 {
	now := time.Now
	if s.now != nil {
		now = s.now
	}
	t := uint64(now().UnixNano())
	s.mu.Lock()
	defer s.mu.Unlock()
	if t <= s.last {
		t = s.last + 1
	}
	s.last = t
	return t
}

// Replay remembers the last stamp accepted from each sender and refuses stamps that are not
// newer, or are further than MaxSkew from the receiver's clock. A sender is whatever key the
// caller chooses (e.g. job and worker id): only authentic messages should reach Check, so the
// table grows only with the senders a job's key holders are. Safe for concurrent use.
type Replay[K comparable] struct {
	mu   sync.Mutex
	last map[K]uint64
	now  func() time.Time // time.Now by default (tests)
}

// Check accepts stamp from sender (and remembers it) or returns an error wrapping ErrReplay.
func (r *Replay[K]) Check(sender K, stamp uint64) error {
	now := time.Now
	if r.now != nil {
		now = r.now
	}
	t := now()
	st := time.Unix(0, int64(stamp))
	if d := st.Sub(t); d > MaxSkew || d < -MaxSkew {
		return fmt.Errorf("%w: stamp %v is %v from this clock (at most %v)", ErrReplay, st.UTC().Format(time.RFC3339Nano), d.Round(time.Millisecond), MaxSkew)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.last == nil {
		r.last = map[K]uint64{}
	}
	if last, ok := r.last[sender]; ok && stamp <= last {
		return fmt.Errorf("%w: stamp %d not after the last accepted %d", ErrReplay, stamp, last)
	}
	r.last[sender] = stamp
	return nil
}

// Forget drops every sender for which drop returns true (e.g. a removed job's workers).
func (r *Replay[K]) Forget(drop func(K) bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for k := range r.last {
		if drop(k) {
			delete(r.last, k)
		}
	}
}
