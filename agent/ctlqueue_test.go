package agent

import "testing"

// TestPortQueues: a port's queue holds PortQueueLen messages and refuses more, and the handler
// takes the ports in turn, so a quiet port's messages wait one turn in N behind a flood, not
// behind the flood's whole queue.
func TestPortQueues(t *testing.T) {
	q := newPortQueues()
	for i := range PortQueueLen {
		if !q.push(ctlMsg{b: q.buffer([]byte{byte(i)}), ifindex: 1}) {
			t.Fatalf("port 1's message %d refused below the limit", i)
		}
	}
	if q.push(ctlMsg{b: q.buffer([]byte{0}), ifindex: 1}) {
		t.Fatalf("port 1's queue took a message beyond its %d", PortQueueLen)
	}
	for i := range 3 {
		if !q.push(ctlMsg{b: q.buffer([]byte{byte(100 + i)}), ifindex: 2}) {
			t.Fatal("port 2's message refused: another port's full queue is not its own")
		}
	}
	var got []int
	for {
		m, ok := q.pop()
		if !ok {
			break
		}
		got = append(got, m.ifindex)
		q.release(m.b)
	}
	if len(got) != PortQueueLen+3 {
		t.Fatalf("popped %d messages, want %d", len(got), PortQueueLen+3)
	}
	// Port 2's three messages are served in the first six turns, not after port 1's 256.
	want := []int{1, 2, 1, 2, 1, 2, 1, 1}
	for i, w := range want {
		if got[i] != w {
			t.Fatalf("service order starts %v, want %v", got[:len(want)], want)
		}
	}
	if q.push(ctlMsg{b: q.buffer([]byte{1}), ifindex: 1}) != true {
		t.Fatal("port 1's drained queue refuses a message")
	}
}
