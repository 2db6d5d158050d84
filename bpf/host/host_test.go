package host_test

// Table-driven BPF_PROG_TEST_RUN tests of xdpagg_host: input frame -> verdict and counter deltas.

import (
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/bpf/host"
	"github.com/xdpagg/xdpagg/internal/bpftest"
	"github.com/xdpagg/xdpagg/wire"
)

var (
	workerAddr = netip.MustParseAddrPort("10.200.1.2:9600")
	psAddr     = netip.MustParseAddrPort("10.200.5.2:9510")
)

const jobID = 7

// XDP verdicts (enum xdp_action).
const (
	xdpPass     = 2
	xdpRedirect = 4
)

// frame is a result frame from the PS's address to the worker, with knobs for every field the
// program reads.
type frame struct {
	etherType    uint16
	version, ihl byte
	proto        byte
	fragOff      uint16
	dst          netip.AddrPort
	hdrVersion   byte
	typ          byte
	job          uint32
	payload      int // values after the xdpagg header
	cut          int // bytes cut off the end
}

func result() frame {
	return frame{etherType: 0x0800, version: 4, ihl: 5, proto: unix.IPPROTO_UDP, dst: workerAddr,
		hdrVersion: wire.Version, typ: wire.MsgResult, job: jobID, payload: 8}
}

func (f frame) bytes() []byte {
	n := 14 + 20 + 8 + wire.HdrSize + 4*f.payload
	b := make([]byte, n)
	binary.BigEndian.PutUint16(b[12:], f.etherType)
	ip := b[14:]
	ip[0] = f.version<<4 | f.ihl
	binary.BigEndian.PutUint16(ip[2:], uint16(n-14))
	binary.BigEndian.PutUint16(ip[6:], f.fragOff)
	ip[8], ip[9] = 64, f.proto
	s, d := psAddr.Addr().As4(), f.dst.Addr().As4()
	copy(ip[12:], s[:])
	copy(ip[16:], d[:])
	udp := ip[20:]
	binary.BigEndian.PutUint16(udp[0:], psAddr.Port())
	binary.BigEndian.PutUint16(udp[2:], f.dst.Port())
	binary.BigEndian.PutUint16(udp[4:], uint16(n-14-20))
	wire.EncodeHeader(udp[8:], &wire.Header{Version: f.hdrVersion, Type: f.typ, JobId: f.job, Count: uint16(f.payload)})
	return b[:n-f.cut]
}

func load(t *testing.T) *host.HostObjects {
	t.Helper()
	objs, err := host.Load(host.Config{Addr: workerAddr, JobID: jobID})
	bpftest.Check(t, "load xdpagg_host", err)
	t.Cleanup(func() { objs.Close() })
	return objs
}

// TestHostProgram: only this worker's job's results go to the socket map; everything else passes.
// With a socket in the map the redirect verdict shows; the counters tell the two paths apart
// either way.
func TestHostProgram(t *testing.T) {
	objs := load(t)
	// An AF_XDP socket in the map at queue 0 (test runs use queue 0): its presence turns the
	// redirect's default XDP_PASS into XDP_REDIRECT.
	fd, err := unix.Socket(unix.AF_XDP, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("AF_XDP socket: %v", err)
	}
	defer unix.Close(fd)
	withSocket := objs.Xsks.Put(uint32(0), uint32(fd)) == nil
	if !withSocket {
		t.Logf("an unbound AF_XDP socket does not go into an XSKMAP on this kernel: checking the counters only")
	}
	toXSK := uint32(xdpPass)
	if withSocket {
		toXSK = xdpRedirect
	}
	tests := []struct {
		name  string
		f     func(*frame)
		toXSK bool
	}{
		{"result of the job to the worker", func(*frame) {}, true},
		{"header-only result", func(f *frame) { f.payload = 0 }, true},
		{"DATA", func(f *frame) { f.typ = wire.MsgData }, false},
		{"control ACK", func(f *frame) { f.typ = wire.MsgAck }, false},
		{"HALT", func(f *frame) { f.typ = wire.MsgHalt }, false},
		{"other job", func(f *frame) { f.job = jobID + 1 }, false},
		{"other version", func(f *frame) { f.hdrVersion = wire.Version + 1 }, false},
		{"other port", func(f *frame) { f.dst = netip.AddrPortFrom(workerAddr.Addr(), 9601) }, false},
		{"other address", func(f *frame) { f.dst = netip.AddrPortFrom(netip.MustParseAddr("10.200.1.3"), workerAddr.Port()) }, false},
		{"IPv6 ethertype", func(f *frame) { f.etherType = 0x86dd }, false},
		{"ARP", func(f *frame) { f.etherType = 0x0806 }, false},
		{"IP options", func(f *frame) { f.ihl = 6 }, false},
		{"TCP", func(f *frame) { f.proto = unix.IPPROTO_TCP }, false},
		{"first fragment", func(f *frame) { f.fragOff = 0x2000 }, false},
		{"later fragment", func(f *frame) { f.fragOff = 10 }, false},
		{"cut inside the xdpagg header", func(f *frame) { f.payload, f.cut = 0, 1 }, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := result()
			tc.f(&f)
			before, err := objs.Counters()
			if err != nil {
				t.Fatal(err)
			}
			ret, err := objs.XdpaggHost.Run(&ebpf.RunOptions{Data: f.bytes()})
			bpftest.Check(t, "run xdpagg_host", err)
			after, err := objs.Counters()
			if err != nil {
				t.Fatal(err)
			}
			want, wantCnt := uint32(xdpPass), host.CounterPass
			if tc.toXSK {
				want, wantCnt = toXSK, host.CounterXSK
			}
			if ret != want {
				t.Errorf("verdict %d, want %d", ret, want)
			}
			for id := range after {
				d := after[id] - before[id]
				if (id == wantCnt) != (d == 1) || d > 1 {
					t.Errorf("counter %d moved by %d (want 1 only for counter %d)", id, d, wantCnt)
				}
			}
		})
	}
}

// TestHostConfig: a configuration the program cannot serve is refused before loading.
func TestHostConfig(t *testing.T) {
	for _, c := range []host.Config{
		{Addr: netip.MustParseAddrPort("[::1]:9600"), JobID: 1},
		{Addr: netip.MustParseAddrPort("10.0.0.1:0"), JobID: 1},
		{Addr: workerAddr},
	} {
		if _, err := host.Load(c); err == nil {
			t.Errorf("Load(%+v) succeeded", c)
		}
	}
}

// TestHostVerifierCount reports the instructions the verifier processes for xdpagg_host
// (docs/design.md quotes it), failing far below the kernel's limit.
func TestHostVerifierCount(t *testing.T) {
	objs := load(t)
	info, err := objs.XdpaggHost.Info()
	bpftest.Check(t, "program info", err)
	n, ok := info.VerifiedInstructions()
	if !ok {
		t.Logf("xdpagg_host: the kernel does not report verified instructions")
		return
	}
	insns, err := info.Instructions()
	size := 0
	if err == nil {
		size = len(insns)
	}
	t.Logf("xdpagg_host: %d instructions, %d processed by the verifier", size, n)
	if n > 500_000 {
		t.Errorf("xdpagg_host: the verifier processed %d instructions", n)
	}
}
