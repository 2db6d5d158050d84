package hostlib

import (
	"bytes"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// gsoPair binds a GSO sender and two receivers on loopback.
func gsoPair(t *testing.T) (s *batchConn, r [2]*batchConn) {
	t.Helper()
	var err error
	if s, err = listenBatch(netip.AddrPortFrom(loopback, 0), 1<<20, 8, 128); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.close() })
	for i := range r {
		if r[i], err = listenBatch(netip.AddrPortFrom(loopback, 0), 1<<20, 128, 1); err != nil {
			t.Fatal(err)
		}
		c := r[i]
		t.Cleanup(func() { c.close() })
	}
	return s, r
}

// sendGSO queues datagrams of the given sizes (negative: to the second receiver), flushes them,
// and checks every receiver got its datagrams intact and in order.
func sendGSO(t *testing.T, s *batchConn, r [2]*batchConn, sizes []int) {
	t.Helper()
	to := [2]unix.RawSockaddrInet4{sockaddr4(r[0].localAddr()), sockaddr4(r[1].localAddr())}
	var want [2][][]byte
	for i, n := range sizes {
		dst := 0
		if n < 0 {
			dst, n = 1, -n
		}
		b := bytes.Repeat([]byte{byte(i)}, n)
		if i%3 == 0 && n > 1 { // a header and values apart, as the PS queues them
			s.queue(&to[dst], b[:1], b[1:])
		} else {
			s.queue(&to[dst], b, nil)
		}
		want[dst] = append(want[dst], b)
	}
	if refused, lastErr, err := s.flush(); refused != 0 || err != nil {
		t.Fatalf("flush: %d refused (%v), %v", refused, lastErr, err)
	}
	for d := range r {
		var got [][]byte
		r[d].conn.SetReadDeadline(time.Now().Add(2 * time.Second))
		for len(got) < len(want[d]) {
			n, err := r[d].recv()
			if err != nil {
				t.Fatalf("receiver %d: %v after %d of %d datagrams", d, err, len(got), len(want[d]))
			}
			for i := 0; i < n; i++ {
				p, err := r[d].rpkt(i)
				if err != nil {
					t.Fatal(err)
				}
				got = append(got, bytes.Clone(p))
			}
		}
		if fmt.Sprint(got) != fmt.Sprint(want[d]) {
			t.Fatalf("receiver %d: got %d datagrams, want %d (or contents differ)", d, len(got), len(want[d]))
		}
	}
}

func TestGSOCoalesce(t *testing.T) {
	s, r := gsoPair(t)
	s.enableGSO()
	if on, _, fb := s.gsoState(); !on {
		t.Fatalf("the kernel refuses UDP GSO (Linux >= 4.18 has it): %v", fb)
	}
	sizes := []int{100, 100, 100, 60, 100, 100, -100, -100, 100, 7, 100, 200, 200}
	for range 70 { // more than one message's segments
		sizes = append(sizes, 1000)
	}
	sendGSO(t, s, r, sizes)
	// GSO: 100x3+60, 100x2, -100x2, 100+7, 200x2, 1000x64, 1000x6; alone: the 100 before the 200s
	if _, msgs, fb := s.gsoState(); msgs != 7 || fb != nil {
		t.Errorf("GSO messages = %d, fallback %v; want 7, nil", msgs, fb)
	}
}

func TestGSOFallback(t *testing.T) {
	s, r := gsoPair(t)
	s.enableGSO()
	if on, _, fb := s.gsoState(); !on {
		t.Fatalf("the kernel refuses UDP GSO (Linux >= 4.18 has it): %v", fb)
	}
	// Without UDP checksums the kernel refuses GSO (EINVAL): the batch must still arrive.
	if err := s.rc.Control(func(fd uintptr) {
		if err := unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_NO_CHECK, 1); err != nil {
			t.Fatal(err)
		}
	}); err != nil {
		t.Fatal(err)
	}
	sendGSO(t, s, r, []int{50, 50, 50, -20, 50, 50})
	on, msgs, fb := s.gsoState()
	if on || msgs != 0 || fb == nil {
		t.Fatalf("after a refused GSO send: on %v, %d messages, fallback %v", on, msgs, fb)
	}
	t.Logf("fallback: %v", fb)
	sendGSO(t, s, r, []int{50, 50}) // per datagram from now on
}
