package agent

// FuzzControlHandle: arbitrary datagrams through ControlServer.handle, the agent's parser of
// control messages, against a loaded switch's maps. Whatever the bytes: no panic, and no member,
// contributor (workers) or job entry appears or changes unless the message is a well-formed JOIN
// arriving on a switch port; a well-formed JOIN always registers exactly its sender.
//
//	go test ./agent/ -run '^$' -fuzz FuzzControlHandle -fuzztime 60s

import (
	"encoding/binary"
	"errors"
	"log/slog"
	"maps"
	"net"
	"net/netip"
	"sync"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/net/ipv4"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/internal/bpftest"
	"github.com/xdpagg/xdpagg/loader"
	xmaps "github.com/xdpagg/xdpagg/maps"
)

const (
	fzCtlPort  = 7 // the switch port (ifindex) of the fuzzed server; fzCtlPort+1 is not one
	fzCtlMaxDg = 16
)

var fzCtlPortMAC = net.HardwareAddr{0x02, 0xaa, 0, 0, 0, 0x07}

// fzCtl is the process's switch and control server, and two worker sockets that messages come
// from (they receive the ACKs, unread): loading a switch per input would cost more than the input.
// mu is held for a whole input, which starts from empty members/workers/jobs maps.
var fzCtl struct {
	mu      sync.Mutex
	sw      *loader.Switch
	c       *ControlServer
	senders [2]*net.UDPConn
}

func fzControl(t *testing.T) *ControlServer {
	t.Helper()
	fzCtl.mu.Lock()
	t.Cleanup(fzCtl.mu.Unlock)
	if fzCtl.c == nil {
		sw, err := loader.Load(loader.Config{PoolSize: 4})
		bpftest.Check(t, "load switch", err) // never closed: it lives as long as the process
		raw, err := net.ListenPacket("udp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		for i := range fzCtl.senders {
			c, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
			if err != nil {
				t.Fatal(err)
			}
			fzCtl.senders[i] = c
		}
		fzCtl.sw = sw
		fzCtl.c = &ControlServer{conn: ipv4.NewPacketConn(raw), raw: raw, maps: sw.Maps,
			log: slog.New(slog.DiscardHandler), ports: map[int]net.HardwareAddr{fzCtlPort: fzCtlPortMAC}}
	}
	m := fzCtl.sw.Maps
	fzClear[bpf.XdpaggMemberKey, bpf.XdpaggMember](t, m.Members)
	fzClear[bpf.XdpaggWorkerKey, bpf.XdpaggWorker](t, m.Workers)
	fzClear[uint32, bpf.XdpaggJob](t, m.Jobs)
	return fzCtl.c
}

// fzDump returns every entry of a hash map.
func fzDump[K comparable, V any](t *testing.T, m *ebpf.Map) map[K]V {
	t.Helper()
	out := map[K]V{}
	var (
		k K
		v V
	)
	it := m.Iterate()
	for it.Next(&k, &v) {
		out[k] = v
	}
	if err := it.Err(); err != nil {
		t.Fatalf("iterate %v: %v", m, err)
	}
	return out
}

func fzClear[K comparable, V any](t *testing.T, m *ebpf.Map) {
	t.Helper()
	for k := range fzDump[K, V](t, m) {
		if err := m.Delete(&k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			t.Fatalf("clear %v: %v", m, err)
		}
	}
}

// fzState is what a control message may change: the members, workers and jobs maps.
type fzState struct {
	members map[bpf.XdpaggMemberKey]bpf.XdpaggMember
	workers map[bpf.XdpaggWorkerKey]bpf.XdpaggWorker
	jobs    map[uint32]bpf.XdpaggJob
}

func fzSnapshot(t *testing.T, m *xmaps.Maps) fzState {
	t.Helper()
	return fzState{
		members: fzDump[bpf.XdpaggMemberKey, bpf.XdpaggMember](t, m.Members),
		workers: fzDump[bpf.XdpaggWorkerKey, bpf.XdpaggWorker](t, m.Workers),
		jobs:    fzDump[uint32, bpf.XdpaggJob](t, m.Jobs),
	}
}

// fzShrunk reports whether after holds nothing new or changed against before (removals are fine:
// LEAVE).
func fzShrunk[K comparable, V comparable](before, after map[K]V) (K, bool) {
	for k, v := range after {
		if w, ok := before[k]; !ok || w != v {
			return k, false
		}
	}
	var zero K
	return zero, true
}

// fzWellFormedJoin is the JOIN the agent must accept (docs/protocol.md, Control messages): a
// version-1 header of type JOIN for a job (not 0) and a worker id 0..31, followed by the 12-byte
// join_body, arriving on a switch port, with the header's reserved byte and count and the body's
// reserved field zero. (Trailing bytes after the body are ignored.)
func fzWellFormedJoin(b []byte, ifindex int) (bpf.XdpaggHdr, bpf.XdpaggJoinBody, bool) {
	var (
		h    bpf.XdpaggHdr
		body bpf.XdpaggJoinBody
	)
	if len(b) < bpf.HdrSize+binary.Size(body) {
		return h, body, false
	}
	if _, err := binary.Decode(b, binary.LittleEndian, &h); err != nil {
		return h, body, false
	}
	if _, err := binary.Decode(b[bpf.HdrSize:], binary.LittleEndian, &body); err != nil {
		return h, body, false
	}
	ok := h.Version == bpf.Version && h.Type == uint8(bpf.XdpaggMsgTypeMSG_JOIN) && h.JobId != 0 &&
		int(h.WorkerId) < bpf.MaxWorkers && ifindex == fzCtlPort && h.Reserved == 0 && h.Count == 0 && body.Reserved == 0
	return h, body, ok
}

// fzCtlMsg encodes a control message (seeds): header, then the join body if any.
func fzCtlMsg(typ uint8, job, seq uint32, worker uint8, body *bpf.XdpaggJoinBody) []byte {
	h := bpf.XdpaggHdr{Version: bpf.Version, Type: typ, JobId: job, Seq: seq, WorkerId: worker, Bitmap0: 1 << (worker & 31), FanIn0: 2}
	b, err := binary.Append(nil, binary.LittleEndian, &h)
	if err == nil && body != nil {
		b, err = binary.Append(b, binary.LittleEndian, body)
	}
	if err != nil {
		panic(err)
	}
	return b
}

// fzCtlSeq builds a fuzz input: per message a little-endian uint16 length, then a byte choosing
// the arrival port (bit 0: not a switch port) and the sender (bit 1), then the message.
func fzCtlSeq(msgs ...[]byte) []byte {
	var b []byte
	for _, m := range msgs {
		b = binary.LittleEndian.AppendUint16(b, uint16(len(m)))
		b = append(b, m...)
	}
	return b
}

func fzCtlSplit(b []byte) [][]byte {
	var out [][]byte
	for len(b) >= 2 && len(out) < fzCtlMaxDg {
		n := min(int(binary.LittleEndian.Uint16(b)), len(b)-2)
		out = append(out, b[2:2+n])
		b = b[2+n:]
	}
	return out
}

func FuzzControlHandle(f *testing.F) {
	const (
		join  = uint8(bpf.XdpaggMsgTypeMSG_JOIN)
		leave = uint8(bpf.XdpaggMsgTypeMSG_LEAVE)
		ack   = uint8(bpf.XdpaggMsgTypeMSG_ACK)
		rtx   = uint8(bpf.XdpaggMsgTypeMSG_RETRANSMIT)
	)
	body := &bpf.XdpaggJoinBody{Mac: [6]byte{0x02, 0xbb, 0, 0, 0, 1}, ResultIp: 0x0203c80a}
	at := func(meta byte, m []byte) []byte { return append([]byte{meta}, m...) }
	f.Add(fzCtlSeq(
		at(0, fzCtlMsg(join, 42, 1, 3, body)),
		at(0, fzCtlMsg(ack, 42, 9, 3, nil)),
		at(0, fzCtlMsg(rtx, 42, 9, 3, nil)),
		at(2, fzCtlMsg(rtx, 42, 9, 3, nil)), // another sender claims worker 3
		at(0, fzCtlMsg(rtx, 42, 9, 4, nil)),
		at(2, fzCtlMsg(join, 42, 2, 5, body)), // replaces the member of job 42 behind the port
		at(0, fzCtlMsg(leave, 42, 3, 3, body)),
		at(0, fzCtlMsg(leave, 42, 3, 3, body)),
	))
	f.Add(fzCtlSeq(
		at(1, fzCtlMsg(join, 1, 1, 0, body)), // not a switch port
		at(0, fzCtlMsg(join, 0, 1, 0, body)),
		at(0, fzCtlMsg(join, 1, 1, 32, body)),
		at(0, fzCtlMsg(join, 1, 1, 0, nil)),
		at(0, fzCtlMsg(join, 1, 1, 0, body)[:bpf.HdrSize+11]),
		at(0, fzCtlMsg(uint8(bpf.XdpaggMsgTypeMSG_DATA), 1, 1, 0, body)),
		at(0, fzCtlMsg(200, 1, 1, 0, body)),
		at(0, []byte("junk")),
		at(0, nil),
		nil,
	))
	v2 := fzCtlMsg(join, 7, 1, 1, body)
	v2[0] = 2
	f.Add(fzCtlSeq(at(0, v2), at(0, fzCtlMsg(uint8(bpf.XdpaggMsgTypeMSG_HEARTBEAT), 7, 1, 1, nil)),
		at(0, fzCtlMsg(uint8(bpf.XdpaggMsgTypeMSG_RESET), 7, 1, 1, nil)), at(0, fzCtlMsg(join, 7, 1, 31, body))))

	f.Fuzz(func(t *testing.T, in []byte) {
		c := fzControl(t)
		m := c.maps
		for i, d := range fzCtlSplit(in) {
			meta := byte(0)
			if len(d) > 0 {
				meta, d = d[0], d[1:]
			}
			ifindex := fzCtlPort + int(meta&1)
			from := fzCtl.senders[meta>>1&1].LocalAddr().(*net.UDPAddr).AddrPort()
			before := fzSnapshot(t, m)
			err := c.handle(d, ifindex, from)
			after := fzSnapshot(t, m)

			h, body, isJoin := fzWellFormedJoin(d, ifindex)
			if !isJoin {
				if k, ok := fzShrunk(before.members, after.members); !ok {
					t.Fatalf("message %d (%x, ifindex %d, err %v) created or changed member %+v", i, d, ifindex, err, k)
				}
				if k, ok := fzShrunk(before.workers, after.workers); !ok {
					t.Fatalf("message %d (%x, ifindex %d, err %v) created or changed contributor %+v", i, d, ifindex, err, k)
				}
				for k, v := range after.jobs {
					// LEAVE may take a worker's bit out of its job, nothing else.
					if w, ok := before.jobs[k]; !ok || v.PsIp != w.PsIp || v.Workers&^w.Workers != 0 {
						t.Fatalf("message %d (%x, ifindex %d, err %v) created or changed job %d: %+v -> %+v", i, d, ifindex, err, k, w, v)
					}
				}
				continue
			}
			if err != nil {
				t.Fatalf("message %d: well-formed JOIN %+v rejected: %v", i, h, err)
			}
			// Exactly this member behind this port; nothing else but its contributor entry and job.
			var got *xmaps.Member
			ms, lerr := m.ListMembers()
			if lerr != nil {
				t.Fatal(lerr)
			}
			for j := range ms {
				if ms[j].JobID == h.JobId && ms[j].Ifindex == uint32(ifindex) {
					got = &ms[j]
				}
			}
			rip := body.ResultIp
			srcIP := netip.AddrFrom4([4]byte{byte(rip), byte(rip >> 8), byte(rip >> 16), byte(rip >> 24)})
			if got == nil || got.WorkerID != h.WorkerId || got.Addr != from || got.MAC.String() != net.HardwareAddr(body.Mac[:]).String() ||
				got.PortMAC.String() != fzCtlPortMAC.String() || got.SrcIP != srcIP {
				t.Fatalf("message %d: JOIN %+v body %+v from %v registered %+v", i, h, body, from, got)
			}
			mk := bpf.XdpaggMemberKey{JobId: h.JobId, Ifindex: uint32(ifindex)}
			wk := bpf.XdpaggWorkerKey{JobId: h.JobId, WorkerId: uint32(h.WorkerId)}
			// A JOIN that replaces another worker id behind this port also revokes that worker's
			// right to contribute.
			if old, ok := before.members[mk]; ok && old.WorkerId != h.WorkerId {
				delete(before.workers, bpf.XdpaggWorkerKey{JobId: h.JobId, WorkerId: uint32(old.WorkerId)})
			}
			delete(after.members, mk)
			delete(after.workers, wk)
			delete(after.jobs, h.JobId)
			delete(before.members, mk)
			delete(before.workers, wk)
			delete(before.jobs, h.JobId)
			if !maps.Equal(before.members, after.members) || !maps.Equal(before.workers, after.workers) || !maps.Equal(before.jobs, after.jobs) {
				t.Fatalf("message %d: JOIN %+v changed entries of other jobs or workers", i, h)
			}
		}
	})
}
