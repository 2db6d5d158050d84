package netns_tests

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"net"
	"net/netip"
	"os/exec"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/hostlib"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/netns_tests/topo"
	"github.com/xdpagg/xdpagg/wire"
	"golang.org/x/sys/unix"
)

// The attacker's toolkit for the netns attack tests (docs/security.md): an `xdpagg switch`
// daemon with jobs admitted through the CLI, and a host that sends any frame with any addresses
// from its own port, and listens to everything that reaches it.

// agentEnv is a topology whose switch is the real daemon (`xdpagg switch` in the switch
// namespace), driven through the CLI.
type agentEnv struct {
	bin, pinRoot string
	tp           *topo.Topology
	sw           *cliSwitch
	pool         uint32
	ps           *hostlib.PS // startPS's
}

// newAgentEnv builds n worker hosts and a PS around `xdpagg switch --pool pool extra...`.
func newAgentEnv(t *testing.T, n int, pool uint32, extra ...string) *agentEnv {
	t.Helper()
	a := &agentEnv{bin: buildCLI(t), pinRoot: bpffsDir(t), pool: pool}
	a.tp = newAgentTopo(t, n)
	a.sw = startSwitch(t, a.bin, a.pinRoot, a.tp, append([]string{"--pool", strconv.Itoa(int(pool))}, extra...)...)
	return a
}

// cli runs `xdpagg args... --name t --pin-root P` in the switch namespace and returns stdout.
func (a *agentEnv) cli(t *testing.T, args ...string) ([]byte, error) {
	t.Helper()
	full := append([]string{"netns", "exec", a.tp.SwitchNS, a.bin}, args...)
	full = append(full, "--name", "t", "--pin-root", a.pinRoot)
	out, err := exec.Command("ip", full...).Output()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		err = errors.New(err.Error() + ": " + string(ee.Stderr))
	}
	return out, err
}

// admit runs `xdpagg job add` for job with w workers and the topology's PS, returning the key.
func (a *agentEnv) admit(t *testing.T, job uint32, w int, extra ...string) []byte {
	t.Helper()
	args := append([]string{"job", "add", "--id", strconv.Itoa(int(job)), "--workers", strconv.Itoa(w),
		"--ps", netip.AddrPortFrom(a.tp.PS.IP, loader.DefaultPort).String(), "--json"}, extra...)
	out, err := a.cli(t, args...)
	if err != nil {
		t.Fatalf("job add %d: %v", job, err)
	}
	var added struct {
		Key string `json:"key"`
	}
	if err := json.Unmarshal(out, &added); err != nil {
		t.Fatalf("job add output %q: %v", out, err)
	}
	key, err := ctlauth.ParseKey(added.Key)
	if err != nil {
		t.Fatalf("job add key: %v", err)
	}
	return key
}

// jobSpec is one job to run in an agentEnv.
type jobSpec struct {
	id    uint32
	hosts []*topo.Host
	port  uint16   // workers' UDP port (default 9600)
	extra []string // `job add` flags
	key   []byte   // admitted already (e.g. through the management channel) under this key
	// threshold is the job's H (`job add --threshold`, and the PS's); timeout the workers'
	// retransmit timeout (0: the default); maxRetries their resends of a fragment before
	// ErrTimeout (0: the default; a test whose verdict must not depend on the machine's load
	// sets it high and lets its context be the hang guard).
	threshold  uint8
	timeout    time.Duration
	maxRetries int
}

type runningJob struct {
	id      uint32
	key     []byte
	hosts   []*topo.Host
	workers []*hostlib.Worker
	port    uint16
}

// startJobs admits every job, serves one PS for all of them (members configured, as an
// operator would), and starts and JOINs each job's workers with the job's key.
func (a *agentEnv) startJobs(ctx context.Context, t *testing.T, specs ...jobSpec) []*runningJob {
	t.Helper()
	a.startPS(ctx, t, specs...)
	jobs := make([]*runningJob, len(specs))
	for i, s := range specs {
		jobs[i] = a.startJob(ctx, t, s)
	}
	return jobs
}

// startPS serves one PS on the PS host for the given jobs' members.
func (a *agentEnv) startPS(ctx context.Context, t *testing.T, specs ...jobSpec) {
	t.Helper()
	ps := a.tp.PS
	var psJobs []hostlib.PSJob
	for _, s := range specs {
		pj := hostlib.PSJob{ID: s.id, Threshold: s.threshold}
		for _, h := range s.hosts {
			pj.Workers = append(pj.Workers, netip.AddrPortFrom(h.IP, s.workerPort()))
		}
		psJobs = append(psJobs, pj)
	}
	var srv *hostlib.PS
	if err := a.tp.InHost(ps, func() (err error) {
		srv, err = hostlib.NewPS(hostlib.PSConfig{Listen: netip.AddrPortFrom(ps.IP, loader.DefaultPort),
			Switch: netip.AddrPortFrom(ps.Gateway, loader.DefaultPort), Jobs: psJobs})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	a.ps = srv
	go srv.Serve(ctx)
	t.Cleanup(func() { srv.Close() })
}

func (s jobSpec) workerPort() uint16 {
	if s.port == 0 {
		return 9600
	}
	return s.port
}

// startJob admits one job (`xdpagg job add`, unless s.key says it is admitted) and starts and JOINs its workers with its key.
func (a *agentEnv) startJob(ctx context.Context, t *testing.T, s jobSpec) *runningJob {
	t.Helper()
	psAddr := netip.AddrPortFrom(a.tp.PS.IP, loader.DefaultPort)
	extra := slices.Clip(s.extra) // appending below must not write into the caller's array
	if s.threshold != 0 {
		extra = append(extra, "--threshold", strconv.Itoa(int(s.threshold)))
	}
	j := &runningJob{id: s.id, hosts: s.hosts, port: s.workerPort(), key: s.key}
	if j.key == nil {
		j.key = a.admit(t, s.id, len(s.hosts), extra...)
	}
	for i, h := range j.hosts {
		var wk *hostlib.Worker
		if err := a.tp.InHost(h, func() (err error) {
			wk, err = hostlib.NewWorker(hostlib.WorkerConfig{JobID: j.id, WorkerID: uint8(i), NumWorkers: uint8(len(j.hosts)),
				Local: netip.AddrPortFrom(h.IP, j.port), PS: psAddr, PoolSize: a.pool, JobKey: j.key, Timeout: s.timeout, MaxRetries: s.maxRetries})
			return err
		}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { wk.Close() })
		jctx, jcancel := context.WithTimeout(ctx, time.Minute)
		err := wk.Join(jctx, netip.AddrPortFrom(h.Gateway, loader.DefaultPort), h.MAC)
		jcancel()
		if err != nil {
			t.Fatalf("job %d worker %d join: %v\n%s", j.id, i, err, a.sw.stderr.String())
		}
		j.workers = append(j.workers, wk)
	}
	return j
}

// reduceExact runs rounds verified allreduces of n values on the job's workers.
func reduceExact(ctx context.Context, t *testing.T, j *runningJob, rounds, n int, seed uint64) {
	t.Helper()
	for r := range rounds {
		in, ref := inputs(len(j.workers), n, seed+uint64(r), uniform)
		errs := make(chan error, len(j.workers))
		for i, w := range j.workers {
			go func() { errs <- w.AllReduce(ctx, in[i]) }()
		}
		for range j.workers {
			if err := <-errs; err != nil {
				for i, w := range j.workers {
					t.Logf("job %d worker %d: %+v", j.id, i, w.Stats())
				}
				t.Fatalf("job %d round %d: %v", j.id, r, err)
			}
		}
		checkFixed(t, in, ref, 24)
	}
}

// counters reads the switch's counters through `xdpagg inspect`.
func (a *agentEnv) counters(t *testing.T) map[string]uint64 {
	t.Helper()
	return inspect(t, a.bin, a.pinRoot).Counters
}

// frame is a hand-built Ethernet/IPv4/UDP frame: anything the attacker wants.
type frame struct {
	dstMAC, srcMAC net.HardwareAddr
	src, dst       netip.Addr
	sport, dport   uint16
	ipOptions      []byte // a multiple of 4 bytes
	fragOffset     uint16 // in 8-byte units
	moreFrags      bool
	badChecksum    bool
	payload        []byte
	trailing       int    // bytes after the IPv4 total length
	udpChecksum    uint16 // 0: none
}

func (f frame) bytes() []byte {
	ihl := 5 + len(f.ipOptions)/4
	udpLen := 8 + len(f.payload)
	b := make([]byte, 0, 14+ihl*4+udpLen+f.trailing)
	b = append(b, f.dstMAC...)
	b = append(b, f.srcMAC...)
	b = append(b, 0x08, 0x00)
	ip := make([]byte, ihl*4)
	ip[0] = 0x40 | byte(ihl)
	binary.BigEndian.PutUint16(ip[2:], uint16(ihl*4+udpLen))
	fo := f.fragOffset
	if f.moreFrags {
		fo |= 0x2000
	}
	binary.BigEndian.PutUint16(ip[6:], fo)
	ip[8], ip[9] = 64, 17
	s4, d4 := f.src.As4(), f.dst.As4()
	copy(ip[12:], s4[:])
	copy(ip[16:], d4[:])
	copy(ip[20:], f.ipOptions)
	var sum uint32
	for i := 0; i < len(ip); i += 2 {
		sum += uint32(binary.BigEndian.Uint16(ip[i:]))
	}
	for sum > 0xffff {
		sum = sum&0xffff + sum>>16
	}
	cs := ^uint16(sum)
	if f.badChecksum {
		cs ^= 0x5555
	}
	binary.BigEndian.PutUint16(ip[10:], cs)
	b = append(b, ip...)
	b = binary.BigEndian.AppendUint16(b, f.sport)
	b = binary.BigEndian.AppendUint16(b, f.dport)
	b = binary.BigEndian.AppendUint16(b, uint16(udpLen))
	b = binary.BigEndian.AppendUint16(b, f.udpChecksum)
	b = append(b, f.payload...)
	return append(b, make([]byte, f.trailing)...)
}

// xpkt encodes an xdpagg header and n values (all v).
func xpkt(h wire.Header, n int, v int32) []byte {
	h.Version = wire.Version
	h.Count = uint16(n)
	b := make([]byte, wire.HdrSize, wire.HdrSize+4*n)
	wire.EncodeHeader(b, &h)
	for range n {
		b = binary.LittleEndian.AppendUint32(b, uint32(v))
	}
	return b
}

// attacker is a host that injects raw frames out of its own port and counts what reaches it.
type attacker struct {
	h      *topo.Host
	tp     *topo.Topology
	fd     int
	sent   atomic.Uint64
	stop   chan struct{}
	done   chan struct{}
	mu     sync.Mutex
	seen   map[uint32]int // job -> xdpagg RESULT frames received
	anyUDP int
}

// newAttacker opens a packet socket on h's link (in h's namespace) for sending and sniffing.
func newAttacker(t *testing.T, tp *topo.Topology, h *topo.Host) *attacker {
	t.Helper()
	a := &attacker{h: h, tp: tp, stop: make(chan struct{}), done: make(chan struct{}), seen: map[uint32]int{}}
	if err := tp.InHost(h, func() error {
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, int(htons(unix.ETH_P_ALL)))
		if err != nil {
			return err
		}
		if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: h.Ifindex}); err != nil {
			unix.Close(fd)
			return err
		}
		tv := unix.NsecToTimeval((50 * time.Millisecond).Nanoseconds())
		_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
		a.fd = fd
		return nil
	}); err != nil {
		t.Fatalf("attacker socket: %v", err)
	}
	go a.sniff()
	t.Cleanup(func() {
		close(a.stop)
		<-a.done
		unix.Close(a.fd)
	})
	return a
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

func (a *attacker) sniff() {
	defer close(a.done)
	buf := make([]byte, 4096)
	for {
		select {
		case <-a.stop:
			return
		default:
		}
		n, from, err := unix.Recvfrom(a.fd, buf, 0)
		if err != nil {
			continue
		}
		if ll, ok := from.(*unix.SockaddrLinklayer); ok && ll.Pkttype == unix.PACKET_OUTGOING {
			continue // our own injections
		}
		p := buf[:n]
		if len(p) < 14+20+8 || p[12] != 0x08 || p[13] != 0 || p[23] != 17 {
			continue
		}
		ihl := int(p[14]&0xf) * 4
		if len(p) < 14+ihl+8+wire.HdrSize {
			continue
		}
		x := p[14+ihl+8:]
		a.mu.Lock()
		a.anyUDP++
		if x[0] == wire.Version && x[1] == wire.MsgResult {
			a.seen[binary.LittleEndian.Uint32(x[8:])]++
		}
		a.mu.Unlock()
	}
}

// results returns how many RESULT frames of job reached the attacker.
func (a *attacker) results(job uint32) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.seen[job]
}

// send injects f count times.
func (a *attacker) send(t *testing.T, f frame, count int) {
	t.Helper()
	a.sendOn(t, a.h.Ifindex, f, count)
}

// sendOn is send out of another of the host's links (e.g. Ifindex2, to the standby switch).
func (a *attacker) sendOn(t *testing.T, ifindex int, f frame, count int) {
	t.Helper()
	b := f.bytes()
	to := &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: ifindex, Halen: 6}
	copy(to.Addr[:], f.dstMAC)
	for range count {
		if err := unix.Sendto(a.fd, b, 0, to); err != nil {
			if errors.Is(err, unix.ENOBUFS) || errors.Is(err, unix.EAGAIN) {
				time.Sleep(time.Millisecond)
				continue
			}
			t.Fatalf("inject: %v", err)
		}
		a.sent.Add(1)
	}
}

// from returns a frame from the attacker's own link to the switch, with the given addresses.
func (a *attacker) from(src netip.Addr, sport uint16, dst netip.Addr, dport uint16, payload []byte) frame {
	return frame{dstMAC: a.h.PortMAC, srcMAC: a.h.MAC, src: src, dst: dst, sport: sport, dport: dport, payload: payload}
}

// during runs attack in a loop (every 1 ms) while fn runs, then stops it.
func during(attack func(), fn func()) {
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			attack()
			time.Sleep(time.Millisecond)
		}
	}()
	fn()
	close(stop)
	<-done
}

// grew fails unless counter c grew by at least min between two readings.
func grew(t *testing.T, before, after map[string]uint64, c string, min uint64) {
	t.Helper()
	if d := after[c] - before[c]; d < min {
		t.Errorf("counter %s grew by %d, want at least %d (before %v, after %v)", c, d, min, before, after)
	}
}
