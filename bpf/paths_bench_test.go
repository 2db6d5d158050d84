package bpf_test

// What one packet costs on each path of xdpagg_switch, with strict source validation on and off:
//
//	go test ./bpf/ -run '^$' -bench BenchmarkSwitchPaths -benchtime 200000x
//
// The switch runs in a network namespace whose routes explain the workers' addresses (portNS), so
// that with validation on every frame passes it and takes the path measured. Each packet is one
// BPF_PROG_TEST_RUN of one run, made directly with bpf(2) to read the kernel's own time of the run
// (attr.test.duration): every packet can be a fresh frame (a new fragment, the next worker), with
// no generator program in front. That time includes the kernel's fixed cost around one run (a
// clock read, bottom halves off and on); the "baseline" path, xdpagg_pass on the same frame,
// measures it, and ns/pkt-net subtracts it. The "…-repeat" paths run one frame Repeat times in one
// call instead (the way the capacity benchmark measures), for the paths whose frame can repeat.

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"runtime"
	"slices"
	"testing"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
)

// progRunAttr is the BPF_PROG_TEST_RUN member of union bpf_attr (64-bit pointers).
type progRunAttr struct {
	progFd, retval, dataSizeIn, dataSizeOut uint32
	dataIn, dataOut                         unsafe.Pointer
	repeat, duration                        uint32
	ctxSizeIn, ctxSizeOut                   uint32
	ctxIn, ctxOut                           unsafe.Pointer
	flags, cpu, batchSize, _                uint32
}

// timedRun runs prog once per repeat on data arriving at ingress and returns the last verdict and
// the kernel's mean time per run.
func timedRun(prog *ebpf.Program, data []byte, ingress int, repeat uint32) (uint32, time.Duration, error) {
	ctx := xdpMd{DataEnd: uint32(len(data)), IngressIfindex: uint32(ingress)}
	attr := progRunAttr{
		progFd: uint32(prog.FD()), dataSizeIn: uint32(len(data)), dataIn: unsafe.Pointer(&data[0]),
		repeat: repeat, ctxSizeIn: uint32(unsafe.Sizeof(ctx)), ctxIn: unsafe.Pointer(&ctx),
	}
	for {
		_, _, e := unix.Syscall(unix.SYS_BPF, unix.BPF_PROG_TEST_RUN, uintptr(unsafe.Pointer(&attr)), unsafe.Sizeof(attr))
		runtime.KeepAlive(data)
		runtime.KeepAlive(&ctx)
		if e == unix.EINTR {
			continue
		}
		if e != 0 {
			return 0, 0, fmt.Errorf("BPF_PROG_TEST_RUN: %w", e)
		}
		return attr.retval, time.Duration(attr.duration), nil
	}
}

const (
	benchJob    = 7
	benchPool   = 4096
	benchWindow = 64 // the complete path cycles its own 2*window slots
)

// benchSwitch loads a switch into p (validation on or off) with job benchJob admitted: 32
// workers at nsWorkerIP(w):workerPort(w) behind port a, no quota in effect.
func benchSwitch(b *testing.B, p *portNS, check bool) *sw {
	b.Helper()
	sl, err := loader.Load(loader.Config{PoolSize: benchPool, SlotTimeout: time.Hour, NoSourceCheck: !check})
	if err != nil {
		b.Fatalf("load switch: %+v", err)
	}
	b.Cleanup(func() { sl.Close() })
	if err := sl.Maps.AddJob(maps.Job{JobID: benchJob, PS: netip.AddrPortFrom(netip.AddrFrom4(nsPS), aggPort),
		PSIfindex: uint32(p.b.Attrs().Index), Workers: uint8(bpf.MaxWorkers), MaxSlots: benchPool}, testKey(benchJob)); err != nil {
		b.Fatal(err)
	}
	for w := range uint8(bpf.MaxWorkers) {
		if err := sl.Maps.PutWorker(benchJob, w, netip.AddrPortFrom(netip.AddrFrom4(nsWorkerIP(w)), workerPort(w)), uint32(p.a.Attrs().Index)); err != nil {
			b.Fatal(err)
		}
	}
	return &sw{Switch: sl}
}

// benchFrame is worker w's DATA of a fan-in fan, StdValues values, from its namespace address.
func benchFrame(w, fan uint8) []byte {
	vals := mkVals(bpf.StdValues, func(i int) int32 { return int32(i%97) - 48 })
	f := dataFrame(benchJob, 0, 0, w, fan, vals...).with(func(f *frame) { f.SrcIP = nsWorkerIP(w); f.DstIP = nsPS })
	return f.bytes()
}

// setFragment writes seq and agg_index into a DATA frame (neither is under the IPv4 checksum).
func setFragment(b []byte, seq, idx uint32) {
	binary.LittleEndian.PutUint32(b[offHdr+12:], seq)
	binary.LittleEndian.PutUint32(b[offHdr+16:], idx)
}

type benchPath struct {
	name   string
	pass   bool                              // run xdpagg_pass instead of the switch
	repeat bool                              // one frame, Repeat = b.N in one call
	frame  func(i int) []byte                // packet i
	check  func(d maps.Counters, n int) bool // the counters say every packet took the path
}

func benchPaths() []benchPath {
	agg := make([][]byte, bpf.MaxWorkers-1)
	for w := range agg {
		agg[w] = benchFrame(uint8(w), uint8(bpf.MaxWorkers))
	}
	one := benchFrame(0, 1)
	dup := benchFrame(0, uint8(bpf.MaxWorkers))
	nonAgg := benchFrame(0, 1)
	binary.BigEndian.PutUint16(nonAgg[offUDP+2:], 9001) // another UDP port: not xdpagg traffic
	aggregate := func(i int) []byte {
		// 31 workers of a fan-in of 32: no fragment completes; the first packet of each
		// reserves the slot (a copy), the others add.
		f := agg[i%len(agg)]
		frag := uint32(i / len(agg))
		setFragment(f, frag, frag%benchPool)
		return f
	}
	complete := func(i int) []byte {
		// Fan-in 1: every packet is a new fragment that it completes (retaking the job's own
		// completed slot of 2*window fragments before).
		setFragment(one, uint32(i), uint32(i)%(2*benchWindow))
		return one
	}
	same := func(f []byte) func(int) []byte { return func(int) []byte { return f } }
	return []benchPath{
		{name: "baseline", pass: true, frame: same(nonAgg), check: func(d maps.Counters, n int) bool { return d == maps.Counters{} }},
		{name: "aggregate", frame: aggregate, check: func(d maps.Counters, n int) bool {
			return d[maps.CntAggregated] == uint64(n) && d[maps.CntRx] == uint64(n) && d[maps.CntCompleted] == 0
		}},
		{name: "complete", frame: complete, check: func(d maps.Counters, n int) bool {
			return d[maps.CntCompleted] == uint64(n) && d[maps.CntRx] == uint64(n)
		}},
		{name: "duplicate", frame: same(dup), check: func(d maps.Counters, n int) bool {
			return d[maps.CntDuplicate] == uint64(n) && d[maps.CntRx] == uint64(n)
		}},
		{name: "non-agg", frame: same(nonAgg), check: func(d maps.Counters, n int) bool {
			return d[maps.CntNonAgg] == uint64(n) && d[maps.CntRx] == 0
		}},
		{name: "baseline-repeat", pass: true, repeat: true, frame: same(nonAgg), check: func(d maps.Counters, n int) bool { return d == maps.Counters{} }},
		{name: "duplicate-repeat", repeat: true, frame: same(dup), check: func(d maps.Counters, n int) bool {
			return d[maps.CntDuplicate] >= uint64(n) && d[maps.CntRx] == d[maps.CntDuplicate]
		}},
		{name: "non-agg-repeat", repeat: true, frame: same(nonAgg), check: func(d maps.Counters, n int) bool {
			return d[maps.CntNonAgg] >= uint64(n) && d[maps.CntRx] == 0
		}},
	}
}

func BenchmarkSwitchPaths(b *testing.B) {
	p := newPortNS(b)
	ingress := p.a.Attrs().Index
	// The kernel's fixed cost per timed run (baseline path), per source-check setting.
	baseline := map[bool]float64{}
	for _, check := range []bool{false, true} {
		for _, path := range benchPaths() {
			name := fmt.Sprintf("check=%s/%s", map[bool]string{false: "off", true: "on"}[check], path.name)
			b.Run(name, func(b *testing.B) {
				p.enter(b)
				s := benchSwitch(b, p, check)
				prog := s.Objects.XdpaggSwitch
				if path.pass {
					prog = s.Objects.XdpaggPass
				}
				// Warm up (and, for the duplicate path, reserve the slot it duplicates).
				if _, _, err := timedRun(prog, path.frame(0), ingress, 1); err != nil {
					b.Fatal(err)
				}
				if err := s.Maps.ResetSlots(); err != nil {
					b.Fatal(err)
				}
				if path.name == "duplicate" || path.name == "duplicate-repeat" {
					if _, _, err := timedRun(prog, path.frame(0), ingress, 1); err != nil {
						b.Fatal(err)
					}
				}
				c0 := s.counters(b)
				var total time.Duration
				per := make([]time.Duration, 0, b.N)
				b.ResetTimer()
				if path.repeat {
					_, d, err := timedRun(prog, path.frame(0), ingress, uint32(b.N))
					if err != nil {
						b.Fatal(err)
					}
					total = d * time.Duration(b.N)
				} else {
					for i := range b.N {
						_, d, err := timedRun(prog, path.frame(i+1), ingress, 1)
						if err != nil {
							b.Fatal(err)
						}
						total += d
						per = append(per, d)
					}
				}
				b.StopTimer()
				d := s.counters(b).Sub(c0)
				if !path.check(d, b.N) {
					b.Fatalf("%d packets, switch counted {%v}", b.N, deltaOf(d))
				}
				mean := float64(total) / float64(b.N)
				b.ReportMetric(mean, "ns/pkt")
				if len(per) > 0 {
					slices.Sort(per)
					b.ReportMetric(float64(per[len(per)/2]), "ns/pkt-median")
				}
				if path.name == "baseline" {
					baseline[check] = mean
				} else if !path.repeat {
					b.ReportMetric(mean-baseline[check], "ns/pkt-net")
				}
			})
		}
	}
}
