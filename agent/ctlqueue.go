package agent

import (
	"net"
	"net/netip"
	"sync"
)

// The control socket is one queue for every port: an agent slower than the ports' XDP budgets
// (a loaded machine; the budget is per port, 20,000 messages a second by default) would let one
// port's flood fill the socket and drop the others' messages there, before any per-job share
// could act: a tenant flooding authentic Help requests, or anyone flooding forged ones, would
// stall another job's recovery. So one goroutine only reads the socket (a receive and a copy
// a message, far cheaper than handling one) into a bounded queue per arrival interface, and the
// handler takes the queues in turn, a message from each: a port's flood fills its own queue,
// whose overflow is dropped and counted (RejectQueueFull), and costs the others one turn in N.

// PortQueueLen is how many control messages wait per arrival interface; more are dropped.
const PortQueueLen = 256

// ctlMsg is one control message as read: its bytes, the interface it arrived on, its sender and
// the address it was sent to (where the answer leaves from).
type ctlMsg struct {
	b       []byte
	ifindex int
	from    netip.AddrPort
	dst     net.IP
}

// portQueues are the per-interface queues between the reader and the handler.
type portQueues struct {
	mu     sync.Mutex
	queues map[int][]ctlMsg // ifindex -> waiting messages, oldest first
	order  []int            // interfaces with messages waiting, in the order they are served
	wake   chan struct{}    // the handler's wake-up: a message was queued
	free   sync.Pool        // message buffers
}

func newPortQueues() *portQueues {
	return &portQueues{queues: map[int][]ctlMsg{}, wake: make(chan struct{}, 1),
		free: sync.Pool{New: func() any { return make([]byte, 0, 2048) }}}
}

// push queues m, or reports false if its interface's queue is full.
func (q *portQueues) push(m ctlMsg) bool {
	q.mu.Lock()
	w := q.queues[m.ifindex]
	if len(w) >= PortQueueLen {
		q.mu.Unlock()
		return false
	}
	if len(w) == 0 {
		q.order = append(q.order, m.ifindex)
	}
	q.queues[m.ifindex] = append(w, m)
	q.mu.Unlock()
	select {
	case q.wake <- struct{}{}:
	default:
	}
	return true
}

// pop takes the oldest message of the next interface in turn, which then goes to the back of
// the turn if it has more; ok is false when nothing waits.
func (q *portQueues) pop() (m ctlMsg, ok bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.order) == 0 {
		return ctlMsg{}, false
	}
	i := q.order[0]
	q.order = q.order[1:]
	w := q.queues[i]
	m, w[0] = w[0], ctlMsg{}
	if w = w[1:]; len(w) > 0 {
		q.queues[i] = w
		q.order = append(q.order, i)
	} else {
		delete(q.queues, i) // the slice's array goes with it: a quiet port holds nothing
	}
	return m, true
}

// buffer returns a message buffer holding b; release gives it back once handled.
func (q *portQueues) buffer(b []byte) []byte { return append(q.free.Get().([]byte)[:0], b...) }

func (q *portQueues) release(b []byte) { q.free.Put(b[:0]) }
