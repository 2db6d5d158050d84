package hostlib

import (
	"github.com/xdpagg/xdpagg/wire"
	"time"

	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// batchConn is a UDP/IPv4 socket driven with recvmmsg/sendmmsg: one system call moves a whole
// batch of datagrams, and every buffer, iovec and message header is allocated once, up front, so
// the hot paths allocate nothing. The calls go through syscall.RawConn, so they wait in Go's
// netpoller (deadlines and Close work as for any net.Conn) instead of blocking a thread.
//
// The receive side (recv, rpkt, rfrom) belongs to one goroutine and the send side (queue, flush)
// to one goroutine, possibly another: the two sides share no fields.
type batchConn struct {
	conn *net.UDPConn
	rc   syscall.RawConn

	rmsgs  []unix.Mmsghdr
	riov   []unix.Iovec
	rnames []unix.RawSockaddrInet4
	rbuf   []byte // len(rmsgs) slots of rslot bytes
	rn     int
	rerr   syscall.Errno
	readFn func(fd uintptr) bool

	smsgs   []unix.Mmsghdr
	siov    []unix.Iovec // two per message: header and values may live apart
	snames  []unix.RawSockaddrInet4
	sq      int // messages queued
	soff    int // first message the next sendmmsg sends
	sn      int
	serr    syscall.Errno
	writeFn func(fd uintptr) bool
	slen    []int // bytes of each queued message

	// UDP GSO (UDP_SEGMENT): flush coalesces runs of queued datagrams into one message each; see
	// enableGSO. cur/ncur is what doSend sends: smsgs[:sq] or gmsgs[:ng].
	gso     bool
	gsoErr  atomic.Pointer[error] // why GSO was turned off (nil: never tried or still on)
	gsoMsgs atomic.Uint64         // messages sent with more than one segment
	gmsgs   []unix.Mmsghdr
	giov    []unix.Iovec
	gctl    []byte // gctlLen bytes of control data per message
	gfirst  []int  // first queued message of each coalesced one
	gcount  []int  // queued messages it carries
	cur     []unix.Mmsghdr
	ncur    int
}

// GSO limits: the kernel's UDP_MAX_SEGMENTS (64 on older kernels, 128 since 6.10) and the largest
// UDP/IPv4 payload.
const (
	gsoMaxSegs  = 64
	gsoMaxBytes = 0xffff - 20 - 8
)

var gctlLen = unix.CmsgSpace(2)

// rslot is the receive buffer per datagram: bigger than any valid packet, so an oversized one
// shows up as such instead of being silently cut to a plausible length (MSG_TRUNC catches the rest).
const rslot = 4096

// listenBatch binds a UDP/IPv4 socket to laddr in the calling thread's network namespace, sizes
// its kernel buffers to sockBuf bytes (0: leave them), and prepares rbatch receive and sbatch send
// slots.
func listenBatch(laddr netip.AddrPort, sockBuf, rbatch, sbatch int) (*batchConn, error) {
	return listenBatchOpt(laddr, sockBuf, rbatch, sbatch, false)
}

// listenBatchOpt is listenBatch, with SO_REUSEPORT set before binding if reusePort: then several
// sockets share laddr and the kernel spreads incoming flows over them (by a hash of the source
// and destination addresses), so each can have its own receive goroutine.
func listenBatchOpt(laddr netip.AddrPort, sockBuf, rbatch, sbatch int, reusePort bool) (*batchConn, error) {
	var lc net.ListenConfig
	if reusePort {
		lc.Control = func(_, _ string, rc syscall.RawConn) error {
			var serr error
			if err := rc.Control(func(fd uintptr) {
				serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1)
			}); err != nil {
				return err
			}
			if serr != nil {
				return fmt.Errorf("set SO_REUSEPORT: %w", serr)
			}
			return nil
		}
	}
	pc, err := lc.ListenPacket(context.Background(), "udp4", laddr.String())
	if err != nil {
		return nil, fmt.Errorf("bind %v: %w", laddr, err)
	}
	conn := pc.(*net.UDPConn)
	rc, err := conn.SyscallConn()
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("raw socket of %v: %w", laddr, err)
	}
	c := &batchConn{conn: conn, rc: rc}
	if sockBuf > 0 {
		if err := c.setBuffers(sockBuf); err != nil {
			conn.Close()
			return nil, err
		}
	}
	c.rmsgs = make([]unix.Mmsghdr, rbatch)
	c.riov = make([]unix.Iovec, rbatch)
	c.rnames = make([]unix.RawSockaddrInet4, rbatch)
	c.rbuf = make([]byte, rbatch*rslot)
	for i := range c.rmsgs {
		c.riov[i].Base = &c.rbuf[i*rslot]
		c.riov[i].SetLen(rslot)
		h := &c.rmsgs[i].Hdr
		h.Iov = &c.riov[i]
		h.SetIovlen(1)
		h.Name = (*byte)(unsafe.Pointer(&c.rnames[i]))
	}
	c.smsgs = make([]unix.Mmsghdr, sbatch)
	c.siov = make([]unix.Iovec, 2*sbatch)
	c.snames = make([]unix.RawSockaddrInet4, sbatch)
	c.slen = make([]int, sbatch)
	for i := range c.smsgs {
		h := &c.smsgs[i].Hdr
		h.Iov = &c.siov[2*i]
		h.Name = (*byte)(unsafe.Pointer(&c.snames[i]))
		h.Namelen = unix.SizeofSockaddrInet4
	}
	// Made once: a method value or closure built per call would allocate per batch.
	c.readFn = c.doRecv
	c.writeFn = c.doSend
	return c, nil
}

// setBuffers sets SO_RCVBUF and SO_SNDBUF. The *FORCE variants ignore net.core.[rw]mem_max, which
// is far below what a window of fragments needs on stock kernels; they need CAP_NET_ADMIN, so
// without it we fall back to the plain options, which the kernel silently caps.
func (c *batchConn) setBuffers(n int) error {
	var serr error
	err := c.rc.Control(func(fd uintptr) {
		for _, o := range [][2]int{{unix.SO_RCVBUFFORCE, unix.SO_RCVBUF}, {unix.SO_SNDBUFFORCE, unix.SO_SNDBUF}} {
			if e := unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, o[0], n); e == nil {
				continue
			}
			if e := unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, o[1], n); e != nil {
				serr = fmt.Errorf("set socket buffer to %d bytes: %w", n, e)
				return
			}
		}
	})
	if err != nil {
		return fmt.Errorf("set socket buffers: %w", err)
	}
	return serr
}

// setBusyPoll turns on busy polling of the socket's receive queue for up to d (WorkerConfig.BusyPoll).
func (c *batchConn) setBusyPoll(d time.Duration) error {
	var serr error
	err := c.rc.Control(func(fd uintptr) {
		us := max(1, int(d/time.Microsecond))
		if e := unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_BUSY_POLL, us); e != nil {
			serr = fmt.Errorf("set SO_BUSY_POLL to %d µs: %w", us, e)
			return
		}
		if e := unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_PREFER_BUSY_POLL, 1); e != nil {
			serr = fmt.Errorf("set SO_PREFER_BUSY_POLL: %w", e)
		}
	})
	if err != nil {
		return fmt.Errorf("set busy polling: %w", err)
	}
	return serr
}

func (c *batchConn) localAddr() netip.AddrPort {
	a := c.conn.LocalAddr().(*net.UDPAddr).AddrPort()
	return netip.AddrPortFrom(a.Addr().Unmap(), a.Port())
}

func (c *batchConn) close() error { return c.conn.Close() }

func (c *batchConn) doRecv(fd uintptr) bool {
	for {
		n, _, e := unix.Syscall6(unix.SYS_RECVMMSG, fd, uintptr(unsafe.Pointer(&c.rmsgs[0])),
			uintptr(len(c.rmsgs)), unix.MSG_DONTWAIT, 0, 0)
		switch e {
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			return false // wait in the netpoller for readability
		}
		c.rn, c.rerr = int(n), e
		return true
	}
}

// recv waits for at least one datagram and returns how many arrived; read each with rpkt and
// rfrom. Errors: net.ErrClosed after close, os.ErrDeadlineExceeded, or the socket's errno.
func (c *batchConn) recv() (int, error) {
	for i := range c.rmsgs {
		c.rmsgs[i].Hdr.Namelen = unix.SizeofSockaddrInet4 // the kernel overwrites these per call
		c.rmsgs[i].Hdr.Flags = 0
	}
	// Source checks read rfrom: a name the kernel did not write must not be the previous batch's.
	clear(c.rnames)
	if err := c.rc.Read(c.readFn); err != nil {
		return 0, err
	}
	if c.rerr != 0 {
		return 0, c.rerr
	}
	return c.rn, nil
}

// rpkt returns datagram i of the last recv (valid until the next recv), or errTruncated if it was
// larger than any xdpagg packet.
func (c *batchConn) rpkt(i int) ([]byte, error) {
	m := &c.rmsgs[i]
	if m.Hdr.Flags&unix.MSG_TRUNC != 0 || int(m.Len) > wire.MaxPacket {
		return nil, errTruncated
	}
	return c.rbuf[i*rslot : i*rslot+int(m.Len)], nil
}

// rfrom returns the source address of datagram i of the last recv (all zero, family included,
// if the kernel gave none).
func (c *batchConn) rfrom(i int) *unix.RawSockaddrInet4 { return &c.rnames[i] }

// datagram returns the source and bytes of datagram i of the last recv (rfrom and rpkt at once,
// the recvSource interface that the worker's XDP socket also serves).
func (c *batchConn) datagram(i int) (*unix.RawSockaddrInet4, []byte, error) {
	b, err := c.rpkt(i)
	return &c.rnames[i], b, err
}

// free reports how many more messages fit in the send batch.
func (c *batchConn) free() int { return len(c.smsgs) - c.sq }

// queue adds a datagram of hdr followed by vals (either may be empty) to the send batch. The
// slices must stay unchanged until flush returns. The caller keeps within free().
func (c *batchConn) queue(to *unix.RawSockaddrInet4, hdr, vals []byte) {
	i := c.sq
	c.sq++
	c.snames[i] = *to
	n := 0
	for _, b := range [2][]byte{hdr, vals} {
		if len(b) > 0 {
			c.siov[2*i+n].Base = &b[0]
			c.siov[2*i+n].SetLen(len(b))
			n++
		}
	}
	c.smsgs[i].Hdr.SetIovlen(n)
	c.slen[i] = len(hdr) + len(vals)
}

// enableGSO makes flush send runs of consecutive queued datagrams to one destination and of one
// size (the run's last may be shorter) as single UDP GSO messages, if the kernel knows UDP_SEGMENT.
// The first GSO send the kernel rejects as unsupported turns GSO off for good; gsoFallback says why.
func (c *batchConn) enableGSO() {
	var serr error
	if err := c.rc.Control(func(fd uintptr) {
		_, serr = unix.GetsockoptInt(int(fd), unix.SOL_UDP, unix.UDP_SEGMENT)
	}); err != nil {
		serr = err
	}
	if serr != nil {
		c.disableGSO(fmt.Errorf("UDP_SEGMENT not supported: %w", serr))
		return
	}
	n := len(c.smsgs)
	c.gmsgs = make([]unix.Mmsghdr, n)
	c.giov = make([]unix.Iovec, 2*n)
	c.gctl = make([]byte, n*gctlLen)
	c.gfirst = make([]int, n)
	c.gcount = make([]int, n)
	for j := range c.gmsgs {
		h := (*unix.Cmsghdr)(unsafe.Pointer(&c.gctl[j*gctlLen]))
		h.Level, h.Type = unix.SOL_UDP, unix.UDP_SEGMENT
		h.SetLen(unix.CmsgLen(2))
	}
	c.gso = true
}

func (c *batchConn) disableGSO(reason error) {
	c.gso = false
	c.gsoErr.Store(&reason)
}

// gsoState reports whether GSO is on, how many multi-segment messages went out, and why GSO was
// turned off (nil if it never was).
func (c *batchConn) gsoState() (on bool, msgs uint64, fallback error) {
	if p := c.gsoErr.Load(); p != nil {
		fallback = *p
	}
	return fallback == nil && c.gmsgs != nil, c.gsoMsgs.Load(), fallback
}

// coalesce builds gmsgs from the queued messages from..sq and returns how many it made.
func (c *batchConn) coalesce(from int) int {
	ng, k := 0, 0
	for i := from; i < c.sq; {
		seg := c.slen[i]
		n, total := 1, seg
		for i+n < c.sq && n < gsoMaxSegs && c.snames[i+n] == c.snames[i] {
			l := c.slen[i+n]
			if l > seg || l == 0 || total+l > gsoMaxBytes {
				break
			}
			total += l
			n++
			if l < seg {
				break // a shorter datagram ends the run
			}
		}
		m := &c.gmsgs[ng].Hdr
		m.Name = (*byte)(unsafe.Pointer(&c.snames[i]))
		m.Namelen = unix.SizeofSockaddrInet4
		m.Iov = &c.giov[k]
		niov := 0
		for q := i; q < i+n; q++ {
			src := c.smsgs[q].Hdr
			iov := unsafe.Slice(src.Iov, src.Iovlen)
			k += copy(c.giov[k:], iov)
			niov += len(iov)
		}
		m.SetIovlen(niov)
		if n > 1 {
			ctl := c.gctl[ng*gctlLen:]
			*(*uint16)(unsafe.Pointer(&ctl[unix.CmsgLen(0)])) = uint16(seg)
			m.Control = &ctl[0]
			m.SetControllen(gctlLen)
		} else {
			m.Control = nil
			m.SetControllen(0)
		}
		c.gfirst[ng], c.gcount[ng] = i, n
		ng++
		i += n
	}
	return ng
}

// gsoUnsupported reports errors that mean the kernel or route cannot do UDP GSO at all.
func gsoUnsupported(e syscall.Errno) bool {
	switch e {
	case unix.EIO, unix.EINVAL, unix.ENOPROTOOPT, unix.EOPNOTSUPP, unix.EMSGSIZE:
		return true
	}
	return false
}

func (c *batchConn) doSend(fd uintptr) bool {
	for {
		n, _, e := unix.Syscall6(unix.SYS_SENDMMSG, fd, uintptr(unsafe.Pointer(&c.cur[c.soff])),
			uintptr(c.ncur-c.soff), 0, 0, 0)
		switch e {
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			return false // socket buffer full: wait in the netpoller for room
		}
		c.sn, c.serr = int(n), e
		return true
	}
}

// flush sends the queued batch and empties it. A datagram the kernel refuses (ENOBUFS, EPERM from
// a firewall, an unreachable route...) is skipped so the rest still go out: the protocol's
// retransmissions cover losses. It reports how many were refused and the last such error;
// err is set only if the socket itself failed (closed).
func (c *batchConn) flush() (refused int, lastErr, err error) {
	from := 0
	if c.gso {
		from, refused, lastErr, err = c.flushGSO()
		if err != nil {
			c.sq = 0
			return refused, lastErr, err
		}
	}
	c.cur, c.ncur = c.smsgs, c.sq
	for c.soff = from; c.soff < c.sq; {
		if err := c.rc.Write(c.writeFn); err != nil {
			c.sq = 0
			return refused, lastErr, err
		}
		if c.serr != 0 {
			refused++
			lastErr = c.serr
			c.soff++ // sendmmsg failed on its first message: skip it
			continue
		}
		c.soff += c.sn
	}
	c.sq = 0
	return refused, lastErr, nil
}

// flushGSO sends the queued batch as coalesced GSO messages. It returns sq when all went out (or
// were refused), or the first queued message still to send one by one if GSO turned out not to work.
func (c *batchConn) flushGSO() (next, refused int, lastErr, err error) {
	c.cur, c.ncur = c.gmsgs, c.coalesce(0)
	for c.soff = 0; c.soff < c.ncur; {
		if err := c.rc.Write(c.writeFn); err != nil {
			return c.sq, refused, lastErr, err
		}
		if c.serr != 0 {
			if c.gcount[c.soff] > 1 && gsoUnsupported(c.serr) {
				c.disableGSO(fmt.Errorf("UDP GSO send of %d datagrams of %d bytes failed: %w",
					c.gcount[c.soff], c.slen[c.gfirst[c.soff]], c.serr))
				return c.gfirst[c.soff], refused, lastErr, nil
			}
			refused += c.gcount[c.soff]
			lastErr = c.serr
			c.soff++
			continue
		}
		for j := c.soff; j < c.soff+c.sn; j++ {
			if c.gcount[j] > 1 {
				c.gsoMsgs.Add(1)
			}
		}
		c.soff += c.sn
	}
	return c.sq, refused, lastErr, nil
}

// sockaddr4 converts an IPv4 address to the kernel's sockaddr_in.
func sockaddr4(a netip.AddrPort) unix.RawSockaddrInet4 {
	sa := unix.RawSockaddrInet4{Family: unix.AF_INET, Addr: a.Addr().Unmap().As4()}
	p := (*[2]byte)(unsafe.Pointer(&sa.Port))
	p[0], p[1] = byte(a.Port()>>8), byte(a.Port()) // network byte order
	return sa
}

// isClosed reports whether err means the socket was closed under us.
func isClosed(err error) bool { return errors.Is(err, net.ErrClosed) }

// isTimeout reports whether err is a passed read deadline.
func isTimeout(err error) bool { return errors.Is(err, os.ErrDeadlineExceeded) }

// transientRecv reports receive errors that say nothing about the socket itself: a signal, or an
// ICMP error queued by an earlier send.
func transientRecv(err error) bool {
	var e syscall.Errno
	if !errors.As(err, &e) {
		return false
	}
	switch e {
	case unix.EINTR, unix.ECONNREFUSED, unix.EHOSTUNREACH, unix.ENETUNREACH, unix.ENOBUFS, unix.ENOMEM:
		return true
	}
	return false
}
