package hostlib

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/bpf/host"
)

// errFrame reports an AF_XDP frame that is not a UDP/IPv4 datagram to the worker's address (the
// host program lets only such frames through, so it means a bug or a forged frame) or whose
// nonzero UDP checksum is wrong (the kernel's UDP socket would have dropped it).
var errFrame = fmt.Errorf("%w: AF_XDP frame is not a valid UDP/IPv4 datagram to this worker", ErrMalformed)

// UMEM geometry. In copy mode the kernel writes a frame XDP_PACKET_HEADROOM (256) bytes into a
// chunk, which leaves 3840 bytes: the largest xdpagg frame (3388-byte MTU + 14) fits.
// xskFrames frames are 8 MiB, the worker's default socket buffer: every frame sits in the fill
// ring while the worker does not hold it, so the kernel can always take a window of results.
const (
	xskFrameSize = 4096
	xskFrames    = 2048
	xskDescSize  = int(unsafe.Sizeof(unix.XDPDesc{}))

	// How long newXSK waits for a busy queue (another socket's, or one just closed), in steps.
	xskBusyWait = 2 * time.Second
	xskBusyStep = 5 * time.Millisecond
)

// xskRing is one of the kernel's single-producer single-consumer rings, mapped into this
// process: producer and consumer indexes (free-running, the entry is index & mask) and the
// entries (8-byte UMEM addresses in the fill ring, struct xdp_desc in the rx ring).
type xskRing struct {
	mem        []byte
	prod, cons *uint32
	mask       uint32
	entries    unsafe.Pointer
}

func mapRing(fd int, off unix.XDPRingOffset, pgoff int64, n, entrySize int) (xskRing, error) {
	mem, err := unix.Mmap(fd, pgoff, int(off.Desc)+n*entrySize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return xskRing{}, err
	}
	return xskRing{
		mem:     mem,
		prod:    (*uint32)(unsafe.Pointer(&mem[off.Producer])),
		cons:    (*uint32)(unsafe.Pointer(&mem[off.Consumer])),
		mask:    uint32(n - 1),
		entries: unsafe.Pointer(&mem[off.Desc]),
	}, nil
}

// xskConn is an AF_XDP socket in copy mode (XDP_COPY: what a veth offers) bound to one receive
// queue of an interface, receive side only: its UMEM, fill ring and rx ring. It serves the same
// batch interface as batchConn's receive side (recv, then datagram for each of the batch): the
// frames of a batch stay the worker's until the next recv, which gives them back to the kernel
// through the fill ring. The socket waits in Go's netpoller, so Close works as for a net.Conn.
type xskConn struct {
	fd   int
	file *os.File
	rc   syscall.RawConn

	umem       []byte
	fill, comp xskRing
	rx         xskRing

	local  [4]byte        // the worker's IPv4 address
	lport  uint16         // its UDP port
	descs  []unix.XDPDesc // the last batch: frames the worker holds until the next recv
	names  []unix.RawSockaddrInet4
	n      int
	readFn func(fd uintptr) bool
	closed atomic.Bool
}

// setsockopt passes a struct to setsockopt(2), which x/sys/unix has no typed call for.
func setsockopt(fd, level, opt int, p unsafe.Pointer, size uintptr) error {
	_, _, e := unix.Syscall6(unix.SYS_SETSOCKOPT, uintptr(fd), uintptr(level), uintptr(opt), uintptr(p), size, 0)
	if e != 0 {
		return e
	}
	return nil
}

// newXSK makes an AF_XDP socket bound to queue of interface ifindex, receiving UDP datagrams to
// local:port (the frames the host program redirects). The caller puts xsk.fd into the program's
// XSKMAP at queue.
func newXSK(ifindex, queue int, local [4]byte, port uint16, batch int) (_ *xskConn, err error) {
	fd, err := unix.Socket(unix.AF_XDP, unix.SOCK_RAW|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("%w: AF_XDP socket: %w", ErrAFXDP, err)
	}
	x := &xskConn{fd: fd, local: local, lport: port, descs: make([]unix.XDPDesc, batch), names: make([]unix.RawSockaddrInet4, batch)}
	defer func() {
		if err != nil {
			if x.file != nil {
				x.file.Close()
			}
			x.free()
		}
	}()
	x.umem, err = unix.Mmap(-1, 0, xskFrames*xskFrameSize, unix.PROT_READ|unix.PROT_WRITE,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_POPULATE)
	if err != nil {
		return nil, fmt.Errorf("%w: UMEM of %d bytes: %w", ErrAFXDP, xskFrames*xskFrameSize, err)
	}
	reg := unix.XDPUmemReg{Addr: uint64(uintptr(unsafe.Pointer(&x.umem[0]))), Len: uint64(len(x.umem)), Size: xskFrameSize}
	if err := setsockopt(fd, unix.SOL_XDP, unix.XDP_UMEM_REG, unsafe.Pointer(&reg), unsafe.Sizeof(reg)); err != nil {
		return nil, fmt.Errorf("%w: register UMEM: %w", ErrAFXDP, err)
	}
	// The completion ring is unused (no AF_XDP transmit) but the kernel wants one to bind.
	for _, o := range [][2]int{{unix.XDP_UMEM_FILL_RING, xskFrames}, {unix.XDP_UMEM_COMPLETION_RING, 64}, {unix.XDP_RX_RING, xskFrames}} {
		if err := unix.SetsockoptInt(fd, unix.SOL_XDP, o[0], o[1]); err != nil {
			return nil, fmt.Errorf("%w: ring option %d: %w", ErrAFXDP, o[0], err)
		}
	}
	var off unix.XDPMmapOffsets
	size := uint32(unsafe.Sizeof(off))
	if _, _, e := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), unix.SOL_XDP, unix.XDP_MMAP_OFFSETS,
		uintptr(unsafe.Pointer(&off)), uintptr(unsafe.Pointer(&size)), 0); e != 0 {
		return nil, fmt.Errorf("%w: ring offsets: %w", ErrAFXDP, e)
	}
	if x.fill, err = mapRing(fd, off.Fr, unix.XDP_UMEM_PGOFF_FILL_RING, xskFrames, 8); err != nil {
		return nil, fmt.Errorf("%w: map fill ring: %w", ErrAFXDP, err)
	}
	if x.comp, err = mapRing(fd, off.Cr, unix.XDP_UMEM_PGOFF_COMPLETION_RING, 64, 8); err != nil {
		return nil, fmt.Errorf("%w: map completion ring: %w", ErrAFXDP, err)
	}
	if x.rx, err = mapRing(fd, off.Rx, unix.XDP_PGOFF_RX_RING, xskFrames, xskDescSize); err != nil {
		return nil, fmt.Errorf("%w: map rx ring: %w", ErrAFXDP, err)
	}
	// Every frame starts in the fill ring: the kernel copies arriving frames into them.
	for i := range xskFrames {
		x.descs[0] = unix.XDPDesc{Addr: uint64(i * xskFrameSize)}
		x.n = 1
		x.refill()
	}
	// A closed socket's queue is released by the kernel's deferred work (the UMEM's pool is
	// freed from a workqueue), so a worker started right after another on the same interface
	// can find the queue busy for a moment: wait for it, boundedly.
	sa := &unix.SockaddrXDP{Flags: unix.XDP_COPY, Ifindex: uint32(ifindex), QueueID: uint32(queue)}
	for wait := time.Duration(0); ; wait += xskBusyStep {
		err = unix.Bind(fd, sa)
		if err == nil {
			break
		}
		if err != unix.EBUSY || wait >= xskBusyWait {
			return nil, fmt.Errorf("%w: bind to queue %d of interface %d in copy mode: %w", ErrAFXDP, queue, ifindex, err)
		}
		time.Sleep(xskBusyStep)
	}
	x.file = os.NewFile(uintptr(fd), "xsk")
	if x.rc, err = x.file.SyscallConn(); err != nil {
		return nil, fmt.Errorf("%w: raw AF_XDP socket: %w", ErrAFXDP, err)
	}
	x.readFn = x.doRecv
	return x, nil
}

// refill gives the frames of the last batch back to the kernel. The fill ring has room for every
// frame, so it never overflows.
func (x *xskConn) refill() {
	if x.n == 0 {
		return
	}
	prod := *x.fill.prod // this process is the fill ring's only producer
	for i, d := range x.descs[:x.n] {
		*(*uint64)(unsafe.Add(x.fill.entries, uintptr((prod+uint32(i))&x.fill.mask)*8)) = d.Addr &^ (xskFrameSize - 1)
	}
	atomic.StoreUint32(x.fill.prod, prod+uint32(x.n)) // publish the entries (release)
	x.n = 0
}

// doRecv takes up to a batch of frames from the rx ring; false if it is empty (wait for the
// socket to become readable: the kernel wakes it after each batch it delivers).
func (x *xskConn) doRecv(uintptr) bool {
	cons := *x.rx.cons // this process is the rx ring's only consumer
	avail := atomic.LoadUint32(x.rx.prod) - cons
	if avail == 0 {
		return false
	}
	n := min(int(avail), len(x.descs))
	for i := range n {
		x.descs[i] = *(*unix.XDPDesc)(unsafe.Add(x.rx.entries, uintptr((cons+uint32(i))&x.rx.mask)*uintptr(xskDescSize)))
	}
	atomic.StoreUint32(x.rx.cons, cons+uint32(n)) // the descriptors are copied: free their slots
	x.n = n
	return true
}

// recv gives the previous batch's frames back and waits for at least one frame; it returns how
// many arrived (read each with datagram). After close it fails with an error isClosed knows.
func (x *xskConn) recv() (int, error) {
	x.refill()
	if err := x.rc.Read(x.readFn); err != nil {
		if x.closed.Load() {
			return 0, net.ErrClosed // as the UDP socket says it: isClosed
		}
		return 0, err
	}
	return x.n, nil
}

// datagram returns the source and UDP payload of frame i of the last batch (valid until the next
// recv), or errFrame for a frame the worker's UDP socket would not have received as a datagram.
func (x *xskConn) datagram(i int) (*unix.RawSockaddrInet4, []byte, error) {
	d := x.descs[i]
	from := &x.names[i]
	if d.Addr+uint64(d.Len) > uint64(len(x.umem)) {
		*from = unix.RawSockaddrInet4{}
		return from, nil, errFrame
	}
	b, err := parseFrame(x.umem[d.Addr:d.Addr+uint64(d.Len)], x.local, x.lport, from)
	return from, b, err
}

// parseFrame returns the UDP payload of an Ethernet/IPv4/UDP frame to local:lport and writes its
// source into from. It checks what the kernel checks before a UDP socket gets a datagram (IPv4
// without fragmentation, lengths, the destination, a nonzero UDP checksum); IP options are
// refused (the host program passes such frames to the kernel instead).
func parseFrame(f []byte, local [4]byte, lport uint16, from *unix.RawSockaddrInet4) ([]byte, error) {
	const eth, ipl, udpl = 14, 20, 8
	*from = unix.RawSockaddrInet4{}
	if len(f) < eth+ipl+udpl || binary.BigEndian.Uint16(f[12:]) != 0x0800 {
		return nil, errFrame
	}
	ip := f[eth:]
	tot := int(binary.BigEndian.Uint16(ip[2:]))
	if ip[0] != 0x45 || ip[9] != unix.IPPROTO_UDP || binary.BigEndian.Uint16(ip[6:])&0x3fff != 0 ||
		tot < ipl+udpl || tot > len(ip) || [4]byte(ip[16:20]) != local {
		return nil, errFrame
	}
	udp := ip[ipl:tot]
	ulen := int(binary.BigEndian.Uint16(udp[4:]))
	if ulen < udpl || ulen > len(udp) || binary.BigEndian.Uint16(udp[2:]) != lport {
		return nil, errFrame
	}
	udp = udp[:ulen]
	if binary.BigEndian.Uint16(udp[6:]) != 0 && udpChecksum(ip[12:20], udp) != 0xffff {
		return nil, errFrame
	}
	*from = unix.RawSockaddrInet4{Family: unix.AF_INET, Addr: [4]byte(ip[12:16])}
	p := (*[2]byte)(unsafe.Pointer(&from.Port))
	p[0], p[1] = udp[0], udp[1] // network byte order, as the kernel writes it
	return udp[udpl:], nil
}

// udpChecksum is the ones'-complement sum of the IPv4 pseudo-header (addrs: source and
// destination) and the UDP datagram, checksum field included: 0xffff when the checksum is right.
func udpChecksum(addrs, udp []byte) uint16 {
	sum := uint64(unix.IPPROTO_UDP) + uint64(len(udp))
	for i := 0; i+1 < len(addrs); i += 2 {
		sum += uint64(binary.BigEndian.Uint16(addrs[i:]))
	}
	n := len(udp) &^ 1
	for i := 0; i < n; i += 2 {
		sum += uint64(binary.BigEndian.Uint16(udp[i:]))
	}
	if len(udp)&1 != 0 {
		sum += uint64(udp[n]) << 8
	}
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	return uint16(sum)
}

// stats returns the kernel's drop counters of the socket: frames dropped because the rx ring was
// full or no fill-ring frame was free.
func (x *xskConn) stats() (dropped uint64) {
	var st unix.XDPStatistics
	size := uint32(unsafe.Sizeof(st))
	var e syscall.Errno
	_ = x.rc.Control(func(fd uintptr) {
		_, _, e = unix.Syscall6(unix.SYS_GETSOCKOPT, fd, unix.SOL_XDP, unix.XDP_STATISTICS,
			uintptr(unsafe.Pointer(&st)), uintptr(unsafe.Pointer(&size)), 0)
	})
	if e != 0 {
		return 0
	}
	return st.Rx_dropped + st.Rx_ring_full + st.Rx_fill_ring_empty_descs
}

// close closes the socket: a recv under way returns. Call free once the receiving goroutine is done.
func (x *xskConn) close() error {
	x.closed.Store(true)
	return x.file.Close()
}

// free unmaps the rings and the UMEM (and closes the socket if newXSK failed before wrapping it).
func (x *xskConn) free() {
	for _, r := range []*xskRing{&x.fill, &x.comp, &x.rx} {
		if r.mem != nil {
			_ = unix.Munmap(r.mem)
			r.mem = nil
		}
	}
	if x.umem != nil {
		_ = unix.Munmap(x.umem)
		x.umem = nil
	}
	if x.file == nil && x.fd >= 0 {
		_ = unix.Close(x.fd)
		x.fd = -1
	}
}

// startAFXDP sets up AF_XDP receive (WorkerConfig.AFXDP): the host program for the worker's
// address and job, an AF_XDP socket on queue 0 of the interface holding that address, the socket
// in the program's map, and the program attached. On error nothing stays behind.
func (w *Worker) startAFXDP() (err error) {
	local := w.bc.localAddr()
	if !local.Addr().Is4() || local.Addr().IsUnspecified() {
		return fmt.Errorf("%w: Local %v: AF_XDP needs the address of the interface results arrive on", ErrAFXDP, w.cfg.Local)
	}
	ifindex, err := ifindexOf(local.Addr().As4())
	if err != nil {
		return err
	}
	objs, err := host.Load(host.Config{Addr: local, JobID: w.cfg.JobID})
	if err != nil {
		return fmt.Errorf("%w: %w", ErrAFXDP, err)
	}
	defer func() {
		if err != nil {
			objs.Close()
		}
	}()
	// Attach first: an interface that runs another XDP program (or another worker's) is refused
	// at once. Until the socket is in the map, results pass to the UDP socket.
	l, err := link.AttachXDP(link.XDPOptions{Program: objs.XdpaggHost, Interface: ifindex, Flags: link.XDPDriverMode})
	if err != nil {
		if errors.Is(err, unix.EBUSY) {
			return fmt.Errorf("%w: interface %d already runs an XDP program: detach it (xdpagg_host passes what it does not redirect, as xdpagg_pass does): %w",
				ErrAFXDP, ifindex, err)
		}
		return fmt.Errorf("%w: attach xdpagg_host to interface %d in native mode: %w", ErrAFXDP, ifindex, err)
	}
	defer func() {
		if err != nil {
			l.Close()
		}
	}()
	const queue = 0
	x, err := newXSK(ifindex, queue, local.Addr().As4(), local.Port(), recvBatch)
	if err != nil {
		return err
	}
	if err = objs.Xsks.Put(uint32(queue), uint32(x.fd)); err != nil {
		x.close()
		x.free()
		return fmt.Errorf("%w: put the AF_XDP socket into the host program's map: %w", ErrAFXDP, err)
	}
	w.xsk, w.xskObjs, w.xskLink, w.xskDone = x, objs, l, make(chan struct{})
	return nil
}

// stopAFXDP detaches the host program, closes the AF_XDP socket, waits for its receive goroutine
// and frees the rings and UMEM.
func (w *Worker) stopAFXDP() {
	_ = w.xskLink.Close()
	_ = w.xsk.close()
	<-w.xskDone
	w.xsk.free()
	_ = w.xskObjs.Close()
}

// ifindexOf returns the index of the interface holding IPv4 address a, in the calling thread's
// network namespace.
func ifindexOf(a [4]byte) (int, error) {
	ifs, err := net.Interfaces()
	if err != nil {
		return 0, fmt.Errorf("%w: list interfaces: %w", ErrAFXDP, err)
	}
	for _, ifc := range ifs {
		addrs, err := ifc.Addrs()
		if err != nil {
			continue
		}
		for _, ad := range addrs {
			if n, ok := ad.(*net.IPNet); ok {
				if ip4 := n.IP.To4(); ip4 != nil && [4]byte(ip4) == a {
					return ifc.Index, nil
				}
			}
		}
	}
	return 0, fmt.Errorf("%w: no interface holds %v", ErrAFXDP, net.IP(a[:]))
}

// AFXDP reports whether the worker receives its results through AF_XDP, and, if it fell back to
// its UDP socket alone (WorkerConfig.AFXDPFallback), why. Both are false/nil without
// WorkerConfig.AFXDP.
func (w *Worker) AFXDP() (on bool, fallback error) { return w.xsk != nil, w.xskFallb }

// AFXDPCounters reports the AF_XDP path's figures: results the host program redirected (to the
// socket, or passed when its queue had none) and frames the kernel dropped for want of room in
// the socket's rings (the retransmit timer covers them). Zero without AF_XDP.
func (w *Worker) AFXDPCounters() (redirected, dropped uint64, err error) {
	if w.xsk == nil {
		return 0, 0, nil
	}
	c, err := w.xskObjs.Counters()
	if err != nil {
		return 0, 0, err
	}
	return c[host.CounterXSK], w.xsk.stats(), nil
}
