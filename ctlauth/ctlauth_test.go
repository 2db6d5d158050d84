package ctlauth

import (
	"bytes"
	"encoding/binary"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"
)

func mustKey(t *testing.T) []byte {
	t.Helper()
	k, err := NewKey()
	if err != nil {
		t.Fatal(err)
	}
	if len(k) != KeySize {
		t.Fatalf("NewKey: %d bytes, want %d", len(k), KeySize)
	}
	return k
}

func TestSizes(t *testing.T) {
	if KeySize != 32 || TrailerSize != 24 || TagSize != 16 {
		t.Fatalf("KeySize %d TrailerSize %d TagSize %d: want 32, 24 (struct ctl_auth) and 16", KeySize, TrailerSize, TagSize)
	}
}

func TestSealOpenRoundTrip(t *testing.T) {
	key := mustKey(t)
	for _, msg := range [][]byte{nil, {}, []byte("x"), bytes.Repeat([]byte{0xa5}, 44), bytes.Repeat([]byte{1}, 1500)} {
		const stamp = 0x0123456789abcdef
		in := bytes.Clone(msg)
		sealed, err := Seal(key, in, stamp)
		if err != nil {
			t.Fatal(err)
		}
		if len(sealed) != len(msg)+TrailerSize {
			t.Fatalf("sealed %d bytes of %d, want +%d", len(sealed), len(msg), TrailerSize)
		}
		if !bytes.Equal(sealed[:len(msg)], msg) || binary.LittleEndian.Uint64(sealed[len(msg):]) != stamp {
			t.Fatalf("trailer layout: message, then the stamp little-endian, then the tag: %x", sealed)
		}
		got, st, err := Open(key, sealed)
		if err != nil {
			t.Fatalf("Open: %v", err)
		}
		if !bytes.Equal(got, msg) || st != stamp {
			t.Fatalf("Open = %x, %#x; want %x, %#x", got, st, msg, uint64(stamp))
		}
	}
	// Seal appends in place when msg has room, as workers use it for their fixed buffers.
	buf := make([]byte, 8, 8+TrailerSize)
	out, err := Seal(key, buf, 1)
	if err != nil {
		t.Fatal(err)
	}
	if &out[0] != &buf[0] {
		t.Fatal("Seal reallocated a message with room for the trailer")
	}
}

// Changing any byte of a sealed message, stamp and tag included, or cutting it, makes Open fail.
func TestOpenDetectsTampering(t *testing.T) {
	key := mustKey(t)
	sealed, err := Seal(key, []byte("0123456789abcdef0123456789abcdef join body"), 42)
	if err != nil {
		t.Fatal(err)
	}
	for i := range sealed {
		for _, flip := range []byte{0x01, 0x80, 0xff} {
			b := bytes.Clone(sealed)
			b[i] ^= flip
			if _, _, err := Open(key, b); !errors.Is(err, ErrUnauthenticated) {
				t.Fatalf("byte %d ^ %#x: Open err = %v, want ErrUnauthenticated", i, flip, err)
			}
		}
	}
	for n := range len(sealed) {
		if _, _, err := Open(key, sealed[:n]); !errors.Is(err, ErrUnauthenticated) {
			t.Fatalf("cut to %d bytes: Open err = %v, want ErrUnauthenticated", n, err)
		}
	}
	if _, _, err := Open(key, append(bytes.Clone(sealed), 0)); !errors.Is(err, ErrUnauthenticated) {
		t.Fatalf("a byte appended: Open err = %v, want ErrUnauthenticated", err)
	}
}

func TestWrongKey(t *testing.T) {
	key, other := mustKey(t), mustKey(t)
	sealed, err := Seal(key, []byte("ack"), 7)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := Open(other, sealed); !errors.Is(err, ErrUnauthenticated) {
		t.Fatalf("Open under another key: %v, want ErrUnauthenticated", err)
	}
	for _, bad := range [][]byte{nil, make([]byte, KeySize-1), make([]byte, KeySize+1)} {
		if _, err := Seal(bad, []byte("x"), 1); !errors.Is(err, ErrBadKey) {
			t.Errorf("Seal with a %d-byte key: %v, want ErrBadKey", len(bad), err)
		}
		if _, _, err := Open(bad, sealed); !errors.Is(err, ErrBadKey) {
			t.Errorf("Open with a %d-byte key: %v, want ErrBadKey", len(bad), err)
		}
	}
}

func TestParseFormatKey(t *testing.T) {
	key := mustKey(t)
	got, err := ParseKey("  " + FormatKey(key) + "\n")
	if err != nil || !bytes.Equal(got, key) {
		t.Fatalf("ParseKey(FormatKey(k)) = %x, %v; want %x", got, err, key)
	}
	for _, bad := range []string{"", "zz", strings.Repeat("ab", KeySize-1), strings.Repeat("ab", KeySize+1), FormatKey(key)[1:]} {
		if _, err := ParseKey(bad); !errors.Is(err, ErrBadKey) {
			t.Errorf("ParseKey(%q): %v, want ErrBadKey", bad, err)
		}
	}
}

// Stamps strictly increase: with the clock, when it stands still, when it steps back, and across
// goroutines.
func TestStamperMonotonic(t *testing.T) {
	clock := time.Unix(1_700_000_000, 0)
	s := Stamper{now: func() time.Time { return clock }}
	a := s.Next()
	if a != uint64(clock.UnixNano()) {
		t.Fatalf("first stamp %d, want the clock %d", a, clock.UnixNano())
	}
	b := s.Next() // same nanosecond
	clock = clock.Add(-time.Hour)
	c := s.Next() // clock stepped back
	clock = clock.Add(2 * time.Hour)
	d := s.Next()
	if !(a < b && b < c && c < d) || d != uint64(clock.UnixNano()) {
		t.Fatalf("stamps %d %d %d %d: want strictly increasing, the last at the clock", a, b, c, d)
	}

	var real Stamper
	const goroutines, each = 4, 1000
	out := make([][]uint64, goroutines)
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range each {
				out[g] = append(out[g], real.Next())
			}
		}()
	}
	wg.Wait()
	seen := map[uint64]bool{}
	for _, o := range out {
		for i, v := range o {
			if seen[v] {
				t.Fatalf("stamp %d handed out twice", v)
			}
			seen[v] = true
			if i > 0 && v <= o[i-1] {
				t.Fatalf("a goroutine got %d after %d", v, o[i-1])
			}
		}
	}
}

func TestReplay(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	at := func(d time.Duration) uint64 { return uint64(now.Add(d).UnixNano()) }
	r := Replay[string]{now: func() time.Time { return now }}
	for _, c := range []struct {
		name   string
		sender string
		stamp  uint64
		ok     bool
	}{
		{"first from a", "a", at(0), true},
		{"equal", "a", at(0), false},
		{"older", "a", at(-time.Millisecond), false},
		{"newer", "a", at(time.Nanosecond), true},
		{"another sender's own history", "b", at(-time.Second), true},
		{"b older than its last", "b", at(-2 * time.Second), false},
		{"too old for anyone", "c", at(-MaxSkew - time.Nanosecond), false},
		{"too far ahead", "c", at(MaxSkew + time.Nanosecond), false},
		{"at the skew's edge, behind", "c", at(-MaxSkew), true},
		{"at the skew's edge, ahead", "d", at(MaxSkew), true},
		{"a refused stamp left no trace", "a", at(2 * time.Nanosecond), true},
	} {
		err := r.Check(c.sender, c.stamp)
		if c.ok != (err == nil) {
			t.Fatalf("%s: Check(%s, %d) = %v, want ok %v", c.name, c.sender, c.stamp, err, c.ok)
		}
		if err != nil && !errors.Is(err, ErrReplay) {
			t.Fatalf("%s: %v, want ErrReplay", c.name, err)
		}
	}
	// An out-of-skew stamp is refused even from a sender never seen, and does not become the last.
	if err := r.Check("e", at(-time.Hour)); !errors.Is(err, ErrReplay) {
		t.Fatalf("hour-old stamp from a new sender: %v", err)
	}
	if err := r.Check("e", at(-time.Second)); err != nil {
		t.Fatalf("a fresh stamp after a refused one: %v", err)
	}
	// Forget drops senders' history: their next stamp is judged by the clock alone.
	r.Forget(func(s string) bool { return s == "a" })
	if err := r.Check("a", at(-time.Second)); err != nil {
		t.Fatalf("forgotten sender: %v", err)
	}
	if err := r.Check("b", at(-time.Second)); !errors.Is(err, ErrReplay) {
		t.Fatalf("b was forgotten too: %v", err)
	}
}
