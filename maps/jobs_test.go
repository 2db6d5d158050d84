package maps_test

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/internal/bpftest"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
	"github.com/xdpagg/xdpagg/wire"
)

// testKey is a job key made of one repeated byte (tests tell keys apart by it).
func testKey(b byte) []byte { return bytes.Repeat([]byte{b}, maps.KeySize) }

// admit admits job id with its PS at ps (behind switch port 1), workers workers and a quota of
// the whole pool, and returns its key.
func admit(t *testing.T, m *maps.Maps, id uint32, ps string, workers uint8) []byte {
	t.Helper()
	key := testKey(byte(id) | 0x80)
	j := maps.Job{JobID: id, PS: netip.MustParseAddrPort(ps), PSIfindex: 1, Workers: workers, MaxSlots: m.PoolSize()}
	if err := m.AddJob(j, key); err != nil {
		t.Fatalf("AddJob(%+v): %v", j, err)
	}
	return key
}

// jobs returns ListJobs or fails the test.
func jobs(t *testing.T, m *maps.Maps) []maps.Job {
	t.Helper()
	js, err := m.ListJobs()
	if err != nil {
		t.Fatalf("ListJobs: %v", err)
	}
	return js
}

func TestDefaultMaxSlots(t *testing.T) {
	for pool, want := range map[uint32]uint32{1: 1, 16: 16, 128: 128, 200: 128, 512: 128, 4096: 1024, 131072: 32768} {
		if got := maps.DefaultMaxSlots(pool); got != want {
			t.Errorf("DefaultMaxSlots(%d) = %d, want %d", pool, got, want)
		}
	}
}

func TestAddGetListJobs(t *testing.T) {
	sw := load(t, 64)
	m := sw.Maps
	if js := jobs(t, m); len(js) != 0 {
		t.Fatalf("fresh switch: ListJobs = %+v, want none", js)
	}
	a := maps.Job{JobID: 9, PS: netip.MustParseAddrPort("10.0.5.2:9510"), PSIfindex: 4, Workers: 3, MaxSlots: 16,
		Held: 7, Joined: 0xff} // Held and Joined are read back, never written
	b := maps.Job{JobID: 1 << 31, PS: netip.MustParseAddrPort("192.168.1.1:40000"), PSIfindex: 12, Workers: 32, MaxSlots: 64}
	c := maps.Job{JobID: 2, PS: netip.MustParseAddrPort("1.2.3.4:1"), PSIfindex: 1, Workers: 1, MaxSlots: 1}
	for i, j := range []maps.Job{a, b, c} {
		if err := m.AddJob(j, testKey(byte(i+1))); err != nil {
			t.Fatalf("AddJob(%+v): %v", j, err)
		}
	}
	a.Held, a.Joined = 0, 0
	got, err := m.GetJob(9)
	if err != nil {
		t.Fatalf("GetJob(9): %v", err)
	}
	if got != a {
		t.Errorf("GetJob(9) = %+v, want %+v", got, a)
	}
	if js := jobs(t, m); !slices.Equal(js, []maps.Job{c, a, b}) {
		t.Errorf("ListJobs = %+v, want by id %+v", js, []maps.Job{c, a, b})
	}
	for id, want := range map[uint32][]byte{9: testKey(1), 1 << 31: testKey(2), 2: testKey(3)} {
		if k, err := m.JobKey(id); err != nil || !bytes.Equal(k, want) {
			t.Errorf("JobKey(%d) = %x, %v; want %x", id, k, err, want)
		}
	}
	// The datapath reads the PS in network order (as packets carry it) and the quota in host order.
	var raw bpf.XdpaggJob
	if err := m.Jobs.Lookup(uint32(9), &raw); err != nil {
		t.Fatal(err)
	}
	ip := binary.LittleEndian.AppendUint32(nil, raw.PsIp)
	port := binary.LittleEndian.AppendUint16(nil, raw.PsPort)
	if !bytes.Equal(ip, []byte{10, 0, 5, 2}) || !bytes.Equal(port, []byte{9510 >> 8, 9510 & 0xff}) ||
		raw.PsIfindex != 4 || raw.FanIn != 3 || raw.MaxSlots != 16 || raw.Held != 0 {
		t.Errorf("raw job 9 = %+v (ip bytes %v, port bytes %v)", raw, ip, port)
	}

	// Joined follows the workers bound, per job.
	for _, mb := range []maps.Member{
		{JobID: 9, WorkerID: 0, Ifindex: 5, Addr: netip.MustParseAddrPort("10.0.1.2:5000"), MAC: mac(1), PortMAC: mac(2)},
		{JobID: 9, WorkerID: 2, Ifindex: 6, Addr: netip.MustParseAddrPort("10.0.2.2:5000"), MAC: mac(1), PortMAC: mac(2)},
		{JobID: 1 << 31, WorkerID: 31, Ifindex: 5, Addr: netip.MustParseAddrPort("10.0.1.3:5000"), MAC: mac(1), PortMAC: mac(2)},
	} {
		if err := m.PutMember(mb); err != nil {
			t.Fatalf("PutMember(%+v): %v", mb, err)
		}
	}
	if j, _ := m.GetJob(9); j.Joined != 0b101 {
		t.Errorf("job 9 joined %#b, want 0b101", j.Joined)
	}
	js := jobs(t, m)
	if len(js) != 3 || js[0].Joined != 0 || js[1].Joined != 0b101 || js[2].Joined != 1<<31 {
		t.Errorf("ListJobs joined = %+v, want job 2 none, job 9 0b101, job 2^31 bit 31", js)
	}

	// JSON names (the CLI's --json).
	bs, err := json.Marshal(a)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{`"job":9`, `"ps":"10.0.5.2:9510"`, `"ps_ifindex":4`, `"workers":3`, `"max_slots":16`, `"held":0`, `"joined":0`} {
		if !strings.Contains(string(bs), s) {
			t.Errorf("%s lacks %s", bs, s)
		}
	}
}

func TestAddJobRejects(t *testing.T) {
	sw := load(t, 16)
	m := sw.Maps
	good := maps.Job{JobID: 5, PS: netip.MustParseAddrPort("10.0.0.9:9510"), PSIfindex: 3, Workers: 4, MaxSlots: 8}
	for _, tc := range []struct {
		name string
		edit func(*maps.Job)
		key  []byte
		want string
	}{
		{"job 0", func(j *maps.Job) { j.JobID = 0 }, nil, "job id 0"},
		{"no PS", func(j *maps.Job) { j.PS = netip.AddrPort{} }, nil, "IPv4"},
		{"IPv6 PS", func(j *maps.Job) { j.PS = netip.MustParseAddrPort("[fd00::9]:9510") }, nil, "IPv4"},
		{"IPv4-mapped PS", func(j *maps.Job) { j.PS = netip.MustParseAddrPort("[::ffff:10.0.0.9]:9510") }, nil, "IPv4"},
		{"PS port 0", func(j *maps.Job) { j.PS = netip.MustParseAddrPort("10.0.0.9:0") }, nil, "port"},
		{"no PS port", func(j *maps.Job) { j.PSIfindex = 0 }, nil, "no switch port"},
		{"0 workers", func(j *maps.Job) { j.Workers = 0 }, nil, "0 workers"},
		{"33 workers", func(j *maps.Job) { j.Workers = 33 }, nil, "use 1..32"},
		{"255 workers", func(j *maps.Job) { j.Workers = 255 }, nil, "use 1..32"},
		{"quota 0", func(j *maps.Job) { j.MaxSlots = 0 }, nil, "slot quota 0"},
		{"no key", func(j *maps.Job) {}, []byte{}, "key of 0 bytes"},
		{"short key", func(j *maps.Job) {}, make([]byte, maps.KeySize-1), "want 32"},
		{"long key", func(j *maps.Job) {}, make([]byte, maps.KeySize+1), "want 32"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			j := good
			tc.edit(&j)
			key := tc.key
			if key == nil {
				key = testKey(1)
			}
			err := m.AddJob(j, key)
			if !errors.Is(err, maps.ErrBadJob) {
				t.Fatalf("AddJob(%+v, %d-byte key) = %v, want ErrBadJob", j, len(key), err)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q does not say %q", err, tc.want)
			}
			if js := jobs(t, m); len(js) != 0 {
				t.Errorf("rejected job was admitted: %+v", js)
			}
			if _, err := m.JobKey(j.JobID); !errors.Is(err, maps.ErrNoJob) {
				t.Errorf("rejected job left a key: JobKey = %v", err)
			}
		})
	}

	// 32 workers is the most.
	j := good
	j.Workers = 32
	if err := m.AddJob(j, testKey(1)); err != nil {
		t.Fatalf("AddJob(32 workers): %v", err)
	}
	// A second admission of the id fails and changes nothing: PS, fan-in, quota and key stay.
	other := maps.Job{JobID: 5, PS: netip.MustParseAddrPort("10.6.6.6:1"), PSIfindex: 9, Workers: 2, MaxSlots: 1}
	if err := m.AddJob(other, testKey(2)); !errors.Is(err, maps.ErrJobExists) {
		t.Fatalf("AddJob of an admitted id = %v, want ErrJobExists", err)
	}
	if got, err := m.GetJob(5); err != nil || got != j {
		t.Errorf("after a refused re-admission: GetJob = %+v, %v; want %+v", got, err, j)
	}
	if k, err := m.JobKey(5); err != nil || !bytes.Equal(k, testKey(1)) {
		t.Errorf("after a refused re-admission: JobKey = %x, %v; want the first key", k, err)
	}
}

func TestNoJob(t *testing.T) {
	sw := load(t, 4)
	m := sw.Maps
	admit(t, m, 1, "10.0.0.9:9510", 2)
	if _, err := m.GetJob(2); !errors.Is(err, maps.ErrNoJob) {
		t.Errorf("GetJob(unadmitted) = %v, want ErrNoJob", err)
	}
	if _, err := m.JobKey(2); !errors.Is(err, maps.ErrNoJob) {
		t.Errorf("JobKey(unadmitted) = %v, want ErrNoJob", err)
	}
	if n, err := m.RemoveJob(2); !errors.Is(err, maps.ErrNoJob) || n != 0 {
		t.Errorf("RemoveJob(unadmitted) = %d, %v; want 0, ErrNoJob", n, err)
	}
	if js := jobs(t, m); len(js) != 1 || js[0].JobID != 1 {
		t.Errorf("jobs = %+v, want job 1 only", js)
	}
}

// PutMember refuses a job that was not admitted, a source other than the job's PS and a worker id
// beyond the admitted workers, and writes nothing for any of them.
func TestPutMemberNeedsAdmittedJob(t *testing.T) {
	sw := load(t, 4)
	m := sw.Maps
	mb := maps.Member{JobID: 3, WorkerID: 1, Ifindex: 2, Addr: netip.MustParseAddrPort("10.0.0.2:9510"), MAC: mac(1), PortMAC: mac(2)}
	if err := m.PutMember(mb); !errors.Is(err, maps.ErrNoJob) {
		t.Errorf("PutMember of an unadmitted job = %v, want ErrNoJob", err)
	}
	admit(t, m, 3, "10.0.0.9:9510", 2)
	for _, tc := range []struct {
		name string
		edit func(*maps.Member)
		want string
	}{
		{"another source", func(mb *maps.Member) { mb.SrcIP = netip.MustParseAddr("10.0.0.8") }, "its PS 10.0.0.9, not 10.0.0.8"},
		{"worker id = workers", func(mb *maps.Member) { mb.WorkerID = 2 }, "worker id 2: job 3 has workers 0..1"},
		{"worker id 31", func(mb *maps.Member) { mb.WorkerID = 31 }, "worker id 31"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := mb
			tc.edit(&b)
			err := m.PutMember(b)
			if !errors.Is(err, maps.ErrBadMember) {
				t.Fatalf("PutMember(%+v) = %v, want ErrBadMember", b, err)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q does not say %q", err, tc.want)
			}
		})
	}
	if ms, err := m.ListMembers(); err != nil || len(ms) != 0 {
		t.Errorf("refused members were written: %+v, %v", ms, err)
	}
	if _, err := m.Worker(3, 2); !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Errorf("refused worker id 2 was bound: %v", err)
	}
	// The admitted job itself is unchanged by members (its PS in particular).
	j, err := m.GetJob(3)
	if err != nil || j.PS != netip.MustParseAddrPort("10.0.0.9:9510") || j.Workers != 2 || j.Joined != 0 {
		t.Errorf("job 3 = %+v, %v", j, err)
	}
	if err := m.PutMember(mb); err != nil {
		t.Fatalf("PutMember(worker 1, no source) = %v", err)
	}
	if got, _ := m.Member(3, 2); got.SrcIP != netip.MustParseAddr("10.0.0.9") {
		t.Errorf("member's source = %v, want the PS", got.SrcIP)
	}
	if j2, _ := m.GetJob(3); j2.PS != j.PS || j2.Joined != 1<<1 {
		t.Errorf("after PutMember: job 3 = %+v", j2)
	}
}

// A worker id is bound at one place: putting it behind another port moves it (the old member
// stops receiving, the old binding stops contributing); another worker id behind the same port
// replaces the member there and unbinds it.
func TestPutMemberMoves(t *testing.T) {
	sw := load(t, 4)
	m := sw.Maps
	admit(t, m, 3, "10.0.0.9:9510", 4)
	at := func(id uint8, ifindex uint32, addr string) maps.Member {
		return maps.Member{JobID: 3, WorkerID: id, Ifindex: ifindex, Addr: netip.MustParseAddrPort(addr), MAC: mac(id), PortMAC: mac(0x10)}
	}
	put := func(mb maps.Member) {
		t.Helper()
		if err := m.PutMember(mb); err != nil {
			t.Fatalf("PutMember(%+v): %v", mb, err)
		}
	}
	put(at(1, 5, "10.0.0.1:1000"))
	put(at(1, 6, "10.0.0.2:1000")) // worker 1 moves to port 6
	ms, _ := m.ListMembers()
	if len(ms) != 1 || ms[0].Ifindex != 6 || ms[0].WorkerID != 1 {
		t.Errorf("members after a move = %+v, want worker 1 behind port 6 only", ms)
	}
	if c, err := m.Worker(3, 1); err != nil || c.Ifindex != 6 || c.Addr != netip.MustParseAddrPort("10.0.0.2:1000") {
		t.Errorf("worker 1 binding = %+v, %v; want 10.0.0.2:1000 on port 6", c, err)
	}
	put(at(2, 6, "10.0.0.2:2000")) // worker 2 replaces worker 1 behind port 6
	ms, _ = m.ListMembers()
	if len(ms) != 1 || ms[0].Ifindex != 6 || ms[0].WorkerID != 2 {
		t.Errorf("members after a replacement = %+v, want worker 2 behind port 6 only", ms)
	}
	if _, err := m.Worker(3, 1); !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Errorf("replaced worker 1 still bound: %v", err)
	}
	if j, _ := m.GetJob(3); j.Joined != 1<<2 {
		t.Errorf("joined %#b, want worker 2 only", j.Joined)
	}
	// Deleting a member whose worker id moved on leaves the id's new binding alone.
	put(at(3, 7, "10.0.0.3:1000"))
	if err := m.PutWorker(3, 3, netip.MustParseAddrPort("10.0.0.4:1000"), 8); err != nil { // contributor elsewhere
		t.Fatal(err)
	}
	if err := m.DeleteMember(3, 7); err != nil {
		t.Fatal(err)
	}
	if c, err := m.Worker(3, 3); err != nil || c.Ifindex != 8 {
		t.Errorf("DeleteMember of an old port removed the worker's binding on port 8: %+v, %v", c, err)
	}
}

func TestRemoveJob(t *testing.T) {
	// More than one garbage collector batch, so that RemoveJob covers the whole pool.
	const batch = uint32(bpf.XdpaggLimitLIMIT_GC_BATCH)
	pool := 2*batch + 10
	sw := load(t, pool)
	m := sw.Maps
	admit(t, m, 7, "10.0.0.9:9510", 4)
	keep := admit(t, m, 8, "10.0.0.8:9510", 4)
	for _, mb := range []maps.Member{
		{JobID: 7, WorkerID: 0, Ifindex: 5, Addr: netip.MustParseAddrPort("10.0.1.2:5000"), MAC: mac(1), PortMAC: mac(2)},
		{JobID: 7, WorkerID: 3, Ifindex: 6, Addr: netip.MustParseAddrPort("10.0.2.2:5000"), MAC: mac(1), PortMAC: mac(2)},
		{JobID: 8, WorkerID: 0, Ifindex: 5, Addr: netip.MustParseAddrPort("10.0.1.2:5001"), MAC: mac(1), PortMAC: mac(2)},
	} {
		if err := m.PutMember(mb); err != nil {
			t.Fatal(err)
		}
	}
	// A contributor without a member (PutWorker alone).
	if err := m.PutWorker(7, 2, netip.MustParseAddrPort("10.0.3.2:5000"), 9); err != nil {
		t.Fatal(err)
	}
	// Slots of both jobs, in every state but free, in each batch of the pool.
	mine := []uint32{0, 1, batch - 1, batch, pool - 1}
	theirs := []uint32{2, batch + 1, pool - 2}
	for i, idx := range append(slices.Clone(mine), theirs...) {
		job := uint32(7)
		if i >= len(mine) {
			job = 8
		}
		st := bpf.XdpaggSlotStateSLOT_AGGREGATING
		if i%2 == 1 {
			st = bpf.XdpaggSlotStateSLOT_COMPLETE
		}
		// Fresh stamps in any clock: the job's slots go whatever their age.
		s := bpf.XdpaggSlot{JobId: job, Seq: idx, State: uint8(st), FanIn: 4, Nvals: 1, TsNs: ^uint64(0) >> 1}
		if err := m.Slots.Put(idx, &s); err != nil {
			t.Fatal(err)
		}
	}

	n, err := m.RemoveJob(7)
	if err != nil || n != len(mine) {
		t.Fatalf("RemoveJob(7) = %d, %v; want %d slots freed", n, err, len(mine))
	}
	if _, err := m.GetJob(7); !errors.Is(err, maps.ErrNoJob) {
		t.Errorf("GetJob after RemoveJob = %v, want ErrNoJob", err)
	}
	if _, err := m.JobKey(7); !errors.Is(err, maps.ErrNoJob) {
		t.Errorf("JobKey after RemoveJob = %v, want ErrNoJob", err)
	}
	ms, _ := m.ListMembers()
	if len(ms) != 1 || ms[0].JobID != 8 {
		t.Errorf("members after RemoveJob(7) = %+v, want job 8's only", ms)
	}
	for id := range uint8(wire.MaxWorkers) {
		if _, err := m.Worker(7, id); !errors.Is(err, ebpf.ErrKeyNotExist) {
			t.Errorf("worker %d of the removed job still bound: %v", id, err)
		}
	}
	if _, err := m.Worker(8, 0); err != nil {
		t.Errorf("worker 0 of job 8 unbound by RemoveJob(7): %v", err)
	}
	used, err := m.SlotsInUse()
	if err != nil {
		t.Fatal(err)
	}
	var idx []uint32
	for _, u := range used {
		if u.JobID != 8 {
			t.Errorf("slot %d of job %d left in use", u.Index, u.JobID)
		}
		idx = append(idx, u.Index)
	}
	slices.Sort(idx)
	if !slices.Equal(idx, theirs) {
		t.Errorf("slots in use after RemoveJob(7) = %v, want job 8's %v", idx, theirs)
	}
	if k, err := m.JobKey(8); err != nil || !bytes.Equal(k, keep) {
		t.Errorf("job 8's key after RemoveJob(7) = %x, %v", k, err)
	}

	// A second removal is refused; the id can be admitted again, afresh.
	if n, err := m.RemoveJob(7); !errors.Is(err, maps.ErrNoJob) || n != 0 {
		t.Errorf("second RemoveJob(7) = %d, %v; want 0, ErrNoJob", n, err)
	}
	j := maps.Job{JobID: 7, PS: netip.MustParseAddrPort("10.0.0.1:1"), PSIfindex: 2, Workers: 1, MaxSlots: 1}
	if err := m.AddJob(j, testKey(0x42)); err != nil {
		t.Fatalf("AddJob after RemoveJob: %v", err)
	}
	if got, err := m.GetJob(7); err != nil || got != j {
		t.Errorf("re-admitted job = %+v, %v; want %+v", got, err, j)
	}
}

// dataFrame is an Ethernet/IPv4/UDP frame with worker id w's DATA for <job, seq> at slot idx
// (one value), from src to the switch's port.
func dataFrame(job, seq, idx uint32, w, fan uint8, src netip.AddrPort) []byte {
	h := bpf.XdpaggHdr{Version: wire.Version, Type: wire.MsgData,
		Encoding: wire.EncFixed32, ScaleLog2: 24, Count: 1,
		JobId: job, Seq: seq, AggIndex: idx, Bitmap0: 1 << w, FanIn0: fan, WorkerId: w}
	payload, err := binary.Append(nil, binary.LittleEndian, &h)
	if err != nil {
		panic(err)
	}
	payload = binary.LittleEndian.AppendUint32(payload, 1)
	udp := binary.BigEndian.AppendUint16(nil, src.Port())
	udp = binary.BigEndian.AppendUint16(udp, wire.DefaultPort)
	udp = binary.BigEndian.AppendUint16(udp, uint16(8+len(payload)))
	udp = append(udp, 0, 0) // no checksum
	udp = append(udp, payload...)
	ip := make([]byte, 20)
	ip[0], ip[8], ip[9] = 0x45, 64, 17
	binary.BigEndian.PutUint16(ip[2:], uint16(20+len(udp)))
	s4, d4 := src.Addr().As4(), [4]byte{10, 0, 0, 9}
	copy(ip[12:], s4[:])
	copy(ip[16:], d4[:])
	var sum uint32
	for i := 0; i < 20; i += 2 {
		sum += uint32(binary.BigEndian.Uint16(ip[i:]))
	}
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	binary.BigEndian.PutUint16(ip[10:], ^uint16(sum))
	f := append([]byte{2, 0, 0, 0, 0, 0xfe, 2, 0, 0, 0, 1, w, 0x08, 0x00}, ip...)
	return append(f, udp...)
}

// ReclaimIdle frees slots idle past the switch's slot timeout, half-filled or completed, on the
// datapath's clock, and releases them from their job's quota; young slots stay. The slots are
// stamped by the datapath itself (DATA through xdpagg_switch) and aged by waiting, so the test
// holds whatever CLOCK_MONOTONIC this process sees (e.g. in a time namespace, unshare -T).
func TestReclaimIdle(t *testing.T) {
	const timeout = 300 * time.Millisecond
	pool := uint32(bpf.XdpaggLimitLIMIT_GC_BATCH + 8) // two garbage collector batches
	sw := bpftest.LoadSwitch(t, loader.Config{PoolSize: pool, SlotTimeout: timeout, NoSourceCheck: true})
	m := sw.Maps
	admit(t, m, 1, "10.0.0.9:9510", 2)
	const lo = 1 // BPF_PROG_TEST_RUN's ingress ifindex
	w0, w1 := netip.MustParseAddrPort("10.0.1.1:4000"), netip.MustParseAddrPort("10.0.1.2:4000")
	for id, a := range []netip.AddrPort{w0, w1} {
		if err := m.PutWorker(1, uint8(id), a, lo); err != nil {
			t.Fatal(err)
		}
	}
	send := func(seq, idx uint32, w uint8, src netip.AddrPort) {
		t.Helper()
		f := dataFrame(1, seq, idx, w, 2, src)
		_, err := sw.Objects.XdpaggSwitch.Run(&ebpf.RunOptions{Data: f, DataOut: make([]byte, len(f)+256)})
		skipIfUnsupported(t, "BPF_PROG_TEST_RUN", err)
	}
	held := func() int32 {
		t.Helper()
		j, err := m.GetJob(1)
		if err != nil {
			t.Fatal(err)
		}
		return j.Held
	}
	// DatapathNow reads the clock slots are stamped with.
	t0, err := m.DatapathNow()
	if err != nil {
		t.Fatal(err)
	}
	send(1, 1, 0, w0) // half-filled
	t1, err := m.DatapathNow()
	if err != nil {
		t.Fatal(err)
	}
	if s, err := m.Slot(1); err != nil || s.TsNs < t0 || s.TsNs > t1 {
		t.Errorf("slot stamped at %d (%v), not between DatapathNow %d and %d", s.TsNs, err, t0, t1)
	}
	send(2, pool-1, 0, w0)
	send(2, pool-1, 1, w1) // completed, in the second batch
	used, err := m.SlotsInUse()
	if err != nil || len(used) != 2 {
		c, _ := m.ReadCounters()
		t.Fatalf("slots in use after three DATA = %+v, %v; want two (counters %v)", used, err, c.Map())
	}
	if h := held(); h != 2 {
		t.Fatalf("job holds %d slots, want 2", h)
	}
	if n, err := m.ReclaimIdle(); err != nil || n != 0 {
		t.Fatalf("ReclaimIdle of young slots = %d, %v; want 0", n, err)
	}

	time.Sleep(timeout + timeout/2)
	start := time.Now()
	send(3, 3, 0, w0) // young
	n, err := m.ReclaimIdle()
	// The young slot is spared unless this process was descheduled for longer than the
	// timeout between touching it and collecting, when it is idle too: both hold on a
	// loaded machine, nothing else does.
	if descheduled := time.Since(start) >= timeout; err != nil || !(n == 2 || descheduled && n == 3) {
		t.Fatalf("ReclaimIdle = %d, %v; want 2 freed (3 if descheduled past the timeout: %v)", n, err, descheduled)
	}
	if n == 2 { // the young slot was kept: it goes once it is idle too
		used, err = m.SlotsInUse()
		if err != nil || len(used) != 1 || used[0].Index != 3 {
			t.Fatalf("in use after reclaim: %+v, %v; want only the young slot 3", used, err)
		}
		if h := held(); h != 1 {
			t.Errorf("job holds %d slots after two were reclaimed, want 1", h)
		}
		time.Sleep(timeout + timeout/2)
		if n, err := m.ReclaimIdle(); err != nil || n != 1 {
			t.Fatalf("second ReclaimIdle = %d, %v; want 1 freed", n, err)
		}
	}
	if used, err := m.SlotsInUse(); err != nil || len(used) != 0 {
		t.Errorf("in use after reclaiming everything: %+v, %v", used, err)
	}
	if h := held(); h != 0 {
		t.Errorf("job holds %d slots with the pool empty, want 0", h)
	}
	if n, err := m.ReclaimIdle(); err != nil || n != 0 {
		t.Errorf("ReclaimIdle of an empty pool = %d, %v; want 0", n, err)
	}
}

func TestReclaimWithoutCollector(t *testing.T) {
	sw := load(t, 4)
	m := *sw.Maps
	m.GC = nil
	if _, err := m.ReclaimIdle(); err == nil || !strings.Contains(err.Error(), "garbage collector") {
		t.Errorf("ReclaimIdle without the program = %v, want an error naming the garbage collector", err)
	}
}
