package agent

// FuzzControlHandle: sequences of datagrams through ControlServer.handle, the agent's parser and
// policy for control messages, against a loaded switch's maps with two admitted jobs. The harness
// can seal a message under its job's key with a fresh, replayed, old or future stamp, so the
// fuzzer reaches the policy behind the authentication as well as the parser in front of it.
// Whatever the bytes:
//
//   - no panic;
//   - a message that does not open under its job's key is refused and changes nothing;
//   - any refused message changes nothing (members, contributors, jobs, keys);
//   - a job's admission (its PS, fan-in, quota, key) never changes;
//   - members and contributor bindings stay one-to-one: a worker id is bound at one address and
//     one port, with its member behind that port, a job has at most one member per port, every
//     member's results come from the job's PS, worker ids stay below the admitted count and no
//     port has more than MaxMembersPerPort members;
//   - an accepted JOIN binds exactly its sender; an accepted LEAVE unbinds the worker id; an
//     accepted ACK or RETRANSMIT changes nothing; a replayed or stale stamp is never accepted;
//   - a fresh, authentic, well-formed JOIN for a free worker id on a port with room is accepted.
//
//	go test ./agent/ -run '^$' -fuzz FuzzControlHandle -fuzztime 60s

import (
	"bytes"
	"encoding/binary"
	"errors"
	"log/slog"
	"net"
	"net/netip"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/internal/bpftest"
	"github.com/xdpagg/xdpagg/loader"
	xmaps "github.com/xdpagg/xdpagg/maps"
)

const (
	fzCtlPort     = 7 // switch ports of the fuzzed server (ifindex); fzCtlNotAPort is not one
	fzCtlPort2    = 8
	fzCtlNotAPort = 9
	fzCtlMaxDg    = 16
	fzCtlPerPort  = 2 // MaxMembersPerPort: small, so that the quota is reached
	fzJobA        = 42
	fzJobB        = 43
)

var (
	fzCtlPortMAC  = net.HardwareAddr{0x02, 0xaa, 0, 0, 0, 0x07}
	fzCtlPort2MAC = net.HardwareAddr{0x02, 0xaa, 0, 0, 0, 0x08}
	// The admitted jobs: fixed keys, so that seeds and crashers replay.
	fzJobs = map[uint32]struct {
		ps      netip.AddrPort
		workers uint8
		key     []byte
	}{
		fzJobA: {netip.MustParseAddrPort("10.200.3.2:9510"), 4, bytes.Repeat([]byte{0xa1}, ctlauth.KeySize)},
		fzJobB: {netip.MustParseAddrPort("10.200.4.2:9511"), 2, bytes.Repeat([]byte{0xb2}, ctlauth.KeySize)},
	}
)

// fzCtl is the process's switch and three sender sockets (two on one host, one on another) that
// messages come from; they receive the agent's ACKs, unread. Loading a switch per input would cost
// more than the input. mu is held for a whole input, which starts from empty members and workers
// maps and a fresh server (no replay or liveness state).
var fzCtl struct {
	mu      sync.Mutex
	sw      *loader.Switch
	raw     net.PacketConn
	senders [3]*net.UDPConn
	stamps  ctlauth.Stamper
}

// fzSetup loads the switch and opens the sockets, once per process, before any input runs: its
// one-time code paths are not attributed to the first input (whose minimization would chase
// coverage that no input reproduces).
func fzSetup(t testing.TB) {
	t.Helper()
	fzCtl.mu.Lock()
	defer fzCtl.mu.Unlock()
	if fzCtl.sw != nil {
		return
	}
	sw, err := loader.Load(loader.Config{PoolSize: 4})
	bpftest.Check(t, "load switch", err) // never closed: it lives as long as the process
	for id, j := range fzJobs {
		adm := xmaps.Job{JobID: id, PS: j.ps, PSIfindex: fzCtlPort, Workers: j.workers, MaxSlots: 4}
		if err := sw.Maps.AddJob(adm, j.key); err != nil {
			t.Fatal(err)
		}
	}
	raw, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	for i, ip := range []string{"127.0.0.1", "127.0.0.1", "127.0.0.2"} {
		c, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.ParseIP(ip)})
		if err != nil {
			t.Fatal(err)
		}
		fzCtl.senders[i] = c
	}
	fzCtl.sw, fzCtl.raw = sw, raw
}

func fzControl(t *testing.T) *ControlServer {
	t.Helper()
	fzCtl.mu.Lock()
	m := fzCtl.sw.Maps
	// Emptied after each input rather than before the next: what an input costs (its coverage
	// included) then depends on that input alone, not on what the one before it left.
	t.Cleanup(func() {
		defer fzCtl.mu.Unlock()
		fzClear[bpf.XdpaggMemberKey, bpf.XdpaggMember](t, m.Members)
		fzClear[bpf.XdpaggWorkerKey, bpf.XdpaggWorker](t, m.Workers)
	})
	c := newControlServer(fzCtl.raw, m, map[int]net.HardwareAddr{fzCtlPort: fzCtlPortMAC, fzCtlPort2: fzCtlPort2MAC}, slog.New(slog.DiscardHandler))
	c.SetConfig(ControlConfig{MaxMembersPerPort: fzCtlPerPort})
	return c
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

// fzState is what a control message may change (members, workers) and what it must never change
// (jobs, job keys).
type fzState struct {
	members map[bpf.XdpaggMemberKey]bpf.XdpaggMember
	workers map[bpf.XdpaggWorkerKey]bpf.XdpaggWorker
	jobs    map[uint32]bpf.XdpaggJob
	keys    map[uint32]bpf.XdpaggJobKey
}

func fzSnapshot(t *testing.T, m *xmaps.Maps) fzState {
	t.Helper()
	return fzState{
		members: fzDump[bpf.XdpaggMemberKey, bpf.XdpaggMember](t, m.Members),
		workers: fzDump[bpf.XdpaggWorkerKey, bpf.XdpaggWorker](t, m.Workers),
		jobs:    fzDump[uint32, bpf.XdpaggJob](t, m.Jobs),
		keys:    fzDump[uint32, bpf.XdpaggJobKey](t, m.JobKeys),
	}
}

// fzCheckState checks the invariants of the maps that hold whatever messages came before.
func fzCheckState(t *testing.T, s fzState) {
	t.Helper()
	for id, j := range fzJobs {
		v, ok := s.jobs[id]
		k, kok := s.keys[id]
		ps := j.ps.Addr().As4()
		if !ok || !kok || v.PsIp != binary.LittleEndian.Uint32(ps[:]) || v.PsPort != j.ps.Port()>>8|j.ps.Port()<<8 ||
			v.PsIfindex != fzCtlPort || v.FanIn != j.workers || v.MaxSlots != 4 || !bytes.Equal(k.Key[:], j.key) {
			t.Fatalf("job %d's admission changed: %+v (key %x)", id, v, k.Key)
		}
	}
	if len(s.jobs) != len(fzJobs) || len(s.keys) != len(fzJobs) {
		t.Fatalf("jobs %v / keys %d: admissions appeared", s.jobs, len(s.keys))
	}
	perPort := map[uint32]int{}
	for mk, mv := range s.members {
		perPort[mk.Ifindex]++
		j, ok := s.jobs[mk.JobId]
		if !ok {
			t.Fatalf("member %+v of a job that is not admitted", mk)
		}
		if mv.SrcIp != j.PsIp {
			t.Fatalf("member %+v %+v: results would carry %#x, not the job's PS %#x", mk, mv, mv.SrcIp, j.PsIp)
		}
		w, ok := s.workers[bpf.XdpaggWorkerKey{JobId: mk.JobId, WorkerId: uint32(mv.WorkerId)}]
		if !ok || w.Ifindex != mk.Ifindex || w.Ip != mv.DstIp || w.Port != mv.DstPort {
			t.Fatalf("member %+v %+v is not its worker id's binding %+v (%v)", mk, mv, w, ok)
		}
	}
	for port, n := range perPort {
		if n > fzCtlPerPort {
			t.Fatalf("%d members behind port %d, at most %d", n, port, fzCtlPerPort)
		}
	}
	for wk, wv := range s.workers {
		j, ok := s.jobs[wk.JobId]
		if !ok || wk.WorkerId >= uint32(j.FanIn) {
			t.Fatalf("worker %+v bound beyond its job's admitted workers (%+v)", wk, j)
		}
		mv, ok := s.members[bpf.XdpaggMemberKey{JobId: wk.JobId, Ifindex: wv.Ifindex}]
		if !ok || uint32(mv.WorkerId) != wk.WorkerId {
			t.Fatalf("worker %+v bound at %+v without its member there (%+v, %v): bound at two places?", wk, wv, mv, ok)
		}
	}
}

// fzCtlSeq builds a fuzz input: per message a little-endian uint16 length, then the message
// (fzCtlIn: a meta byte, a stamp byte and the datagram).
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

// The meta byte of a message.
const (
	fzPortMask   = 0x03 // 0, 3: fzCtlPort; 1: fzCtlPort2; 2: not a switch port
	fzSenderMask = 0x0c // >>2: 0, 3: host A socket 0; 1: host A socket 1; 2: host B
	fzSeal       = 0x10 // the harness appends the trailer, under the key of the header's job
	fzStampOld   = 0x20 // stamp: the previous message's minus stamp byte ms (0: the same stamp)
	fzStampAhead = 0x40 // stamp: now plus stamp byte seconds (past 30: beyond the window)
	fzTinyTTL    = 0x80 // MemberTTL of 1ns for this message: every binding is takeable
)

// fzCtlIn is one message of a seed: meta, stamp byte, datagram (before any trailer).
func fzCtlIn(meta, stamp byte, d []byte) []byte { return append([]byte{meta, stamp}, d...) }

// fzCtlMsg encodes a control message (seeds): header, then the join body if any.
func fzCtlMsg(typ uint8, job, seq uint32, worker uint8, body *bpf.XdpaggJoinBody) []byte {
	h := bpf.XdpaggHdr{Version: bpf.Version, Type: typ, JobId: job, Seq: seq, WorkerId: worker}
	b, err := binary.Append(nil, binary.LittleEndian, &h)
	if err == nil && body != nil {
		b, err = binary.Append(b, binary.LittleEndian, body)
	}
	if err != nil {
		panic(err)
	}
	return b
}

func FuzzControlHandle(f *testing.F) {
	const (
		join  = uint8(bpf.XdpaggMsgTypeMSG_JOIN)
		leave = uint8(bpf.XdpaggMsgTypeMSG_LEAVE)
		ack   = uint8(bpf.XdpaggMsgTypeMSG_ACK)
		rtx   = uint8(bpf.XdpaggMsgTypeMSG_RETRANSMIT)
		sA0   = 0 << 2
		sA1   = 1 << 2
		sB    = 2 << 2
		p2    = 1
		np    = 2
	)
	body := &bpf.XdpaggJoinBody{Mac: [6]byte{0x02, 0xbb, 0, 0, 0, 1}}
	psBody := &bpf.XdpaggJoinBody{Mac: [6]byte{0x02, 0xbb, 0, 0, 0, 2}, ResultIp: 0x0203c80a}  // job A's PS, 10.200.3.2
	otherPS := &bpf.XdpaggJoinBody{Mac: [6]byte{0x02, 0xbb, 0, 0, 0, 3}, ResultIp: 0x0204c80a} // job B's
	// A job's life: JOIN, ACK, RETRANSMIT, LEAVE from the binding; others refused.
	f.Add(fzCtlSeq(
		fzCtlIn(fzSeal|sA0, 0, fzCtlMsg(join, fzJobA, 1, 3, body)),
		fzCtlIn(fzSeal|sA0, 0, fzCtlMsg(ack, fzJobA, 9, 3, nil)),
		fzCtlIn(fzSeal|sA0, 0, fzCtlMsg(rtx, fzJobA, 9, 3, nil)),
		fzCtlIn(fzSeal|sB, 0, fzCtlMsg(rtx, fzJobA, 9, 3, nil)),   // another host claims worker 3
		fzCtlIn(fzSeal|sA0, 0, fzCtlMsg(rtx, fzJobA, 9, 1, nil)),  // an unbound worker id
		fzCtlIn(fzSeal|sB, 0, fzCtlMsg(join, fzJobA, 2, 2, body)), // another id behind the port
		fzCtlIn(fzSeal|sB|p2, 0, fzCtlMsg(join, fzJobA, 2, 2, psBody)),
		fzCtlIn(fzSeal|sB, 0, fzCtlMsg(leave, fzJobA, 3, 3, body)), // not the binding
		fzCtlIn(fzSeal|sA0, 0, fzCtlMsg(leave, fzJobA, 3, 3, body)),
		fzCtlIn(fzSeal|sA0, 0, fzCtlMsg(leave, fzJobA, 4, 3, body)), // resent
	))
	// Binding rules: the same host rebinds from a new UDP port; another host only after the TTL;
	// the port quota; JOINs naming another PS or a worker id beyond the job's.
	f.Add(fzCtlSeq(
		fzCtlIn(fzSeal|sA0, 0, fzCtlMsg(join, fzJobA, 1, 0, body)),
		fzCtlIn(fzSeal|sA1, 0, fzCtlMsg(join, fzJobA, 2, 0, body)),
		fzCtlIn(fzSeal|sB, 0, fzCtlMsg(join, fzJobA, 3, 0, body)),
		fzCtlIn(fzSeal|sB|fzTinyTTL, 0, fzCtlMsg(join, fzJobA, 4, 0, body)),
		fzCtlIn(fzSeal|sA0|p2, 0, fzCtlMsg(join, fzJobB, 1, 1, body)),
		fzCtlIn(fzSeal|sA0|p2, 0, fzCtlMsg(join, fzJobA, 1, 1, body)),
		fzCtlIn(fzSeal|sA0|p2, 0, fzCtlMsg(join, fzJobB, 2, 0, body)), // same job behind the port: refused
		fzCtlIn(fzSeal|sA0, 0, fzCtlMsg(join, fzJobB, 3, 0, body)),    // port full
		fzCtlIn(fzSeal|sA0, 0, fzCtlMsg(join, fzJobA, 5, 2, otherPS)),
		fzCtlIn(fzSeal|sA0, 0, fzCtlMsg(join, fzJobB, 5, 2, body)),
		fzCtlIn(fzSeal|sA0|p2|fzTinyTTL, 0, fzCtlMsg(join, fzJobA, 6, 3, body)), // replaces a silent member
	))
	// Replays: the same stamp, an older one, a minute ahead, beyond the window; and messages that
	// do not open (no trailer, a trailer of zeros, the other job's key).
	ackA := fzCtlMsg(ack, fzJobA, 7, 1, nil)
	sealedB, err := ctlauth.Seal(fzJobs[fzJobB].key, fzCtlMsg(join, fzJobA, 1, 1, body), uint64(time.Now().UnixNano()))
	if err != nil {
		f.Fatal(err)
	}
	f.Add(fzCtlSeq(
		fzCtlIn(fzSeal|sA0, 0, fzCtlMsg(join, fzJobA, 1, 1, body)),
		fzCtlIn(fzSeal|sA0, 0, ackA),
		fzCtlIn(fzSeal|sA0|fzStampOld, 0, ackA),
		fzCtlIn(fzSeal|sA0|fzStampOld, 5, ackA),
		fzCtlIn(fzSeal|sA0|fzStampAhead, 60, ackA),
		fzCtlIn(fzSeal|sA0|fzStampAhead, 20, ackA),
		fzCtlIn(fzSeal|sA0, 0, ackA),
		fzCtlIn(sA0, 0, fzCtlMsg(join, fzJobA, 1, 2, body)),
		fzCtlIn(sA0, 0, append(fzCtlMsg(ack, fzJobA, 1, 1, nil), make([]byte, ctlauth.TrailerSize)...)),
		fzCtlIn(sA0, 0, sealedB),
	))
	// The parser: not a port, job 0, unknown job, worker 32, bodies of the wrong size, DATA,
	// unknown types, reserved fields, junk.
	v2 := fzCtlMsg(join, fzJobA, 1, 1, body)
	v2[0] = 2
	res := fzCtlMsg(join, fzJobA, 1, 1, body)
	res[31] = 1
	bodyRes := &bpf.XdpaggJoinBody{Mac: body.Mac, Reserved: 1}
	f.Add(fzCtlSeq(
		fzCtlIn(fzSeal|sA0|np, 0, fzCtlMsg(join, fzJobA, 1, 0, body)),
		fzCtlIn(fzSeal|sA0, 0, fzCtlMsg(join, 0, 1, 0, body)),
		fzCtlIn(fzSeal|sA0, 0, fzCtlMsg(join, 7, 1, 0, body)),
		fzCtlIn(fzSeal|sA0, 0, fzCtlMsg(join, fzJobA, 1, 32, body)),
		fzCtlIn(fzSeal|sA0, 0, fzCtlMsg(join, fzJobA, 1, 0, nil)),
		fzCtlIn(fzSeal|sA0, 0, fzCtlMsg(ack, fzJobA, 1, 0, body)),
		fzCtlIn(fzSeal|sA0, 0, fzCtlMsg(join, fzJobA, 1, 0, body)[:bpf.HdrSize+11]),
		fzCtlIn(fzSeal|sA0, 0, fzCtlMsg(uint8(bpf.XdpaggMsgTypeMSG_DATA), fzJobA, 1, 0, body)),
		fzCtlIn(fzSeal|sA0, 0, fzCtlMsg(uint8(bpf.XdpaggMsgTypeMSG_HEARTBEAT), fzJobA, 1, 0, nil)),
		fzCtlIn(fzSeal|sA0, 0, fzCtlMsg(200, fzJobA, 1, 0, body)),
		fzCtlIn(fzSeal|sA0, 0, v2),
		fzCtlIn(fzSeal|sA0, 0, res),
		fzCtlIn(fzSeal|sA0, 0, fzCtlMsg(join, fzJobA, 1, 0, bodyRes)),
		fzCtlIn(sA0, 0, []byte("junk")),
		fzCtlIn(0, 0, nil),
		nil,
	))

	fzSetup(f)
	f.Fuzz(func(t *testing.T, in []byte) {
		c := fzControl(t)
		m := c.maps
		last := map[workerRef]uint64{} // last accepted stamp per <job, worker id>
		var prevStamp uint64
		for i, d := range fzCtlSplit(in) {
			var meta, sb byte
			if len(d) > 0 {
				meta, d = d[0], d[1:]
			}
			if len(d) > 0 {
				sb, d = d[0], d[1:]
			}
			ifindex := [4]int{fzCtlPort, fzCtlPort2, fzCtlNotAPort, fzCtlPort}[meta&fzPortMask]
			sender := fzCtl.senders[[4]int{0, 1, 2, 0}[(meta&fzSenderMask)>>2]]
			from := sender.LocalAddr().(*net.UDPAddr).AddrPort()
			c.cfg.MemberTTL = DefaultMemberTTL
			if meta&fzTinyTTL != 0 {
				c.cfg.MemberTTL = time.Nanosecond
			}
			var h bpf.XdpaggHdr
			if len(d) >= bpf.HdrSize {
				_, _ = binary.Decode(d[:bpf.HdrSize], binary.LittleEndian, &h)
			}
			if meta&fzSeal != 0 {
				stamp := fzCtl.stamps.Next()
				switch {
				case meta&fzStampOld != 0:
					stamp = prevStamp - uint64(sb)*uint64(time.Millisecond)
				case meta&fzStampAhead != 0:
					stamp = uint64(time.Now().Add(time.Duration(sb) * time.Second).UnixNano())
				}
				prevStamp = stamp
				key := fzJobs[fzJobA].key
				if j, ok := fzJobs[h.JobId]; ok {
					key = j.key
				}
				var err error
				if d, err = ctlauth.Seal(key, append([]byte(nil), d...), stamp); err != nil {
					t.Fatal(err)
				}
			}

			before := fzSnapshot(t, m)
			now := time.Now()
			err := c.handle(d, ifindex, from)
			after := fzSnapshot(t, m)
			fzCheckState(t, after)
			unchanged := reflect.DeepEqual(before, after)

			// Did it open under its job's key, and with which stamp?
			j, admitted := fzJobs[h.JobId]
			var body []byte
			var stamp uint64
			authentic := false
			if admitted && len(d) >= bpf.HdrSize {
				var oerr error
				body, stamp, oerr = ctlauth.Open(j.key, d)
				authentic = oerr == nil
			}
			ref := workerRef{h.JobId, h.WorkerId}
			if err != nil {
				if !unchanged {
					t.Fatalf("message %d (%x, ifindex %d, from %v): refused (%v) but changed the maps", i, d, ifindex, from, err)
				}
				if !authentic {
					switch r := reasonOf(err); r {
					case RejectMalformed, RejectNotAPort, RejectNotAdmitted, RejectUnauth:
					default:
						t.Fatalf("message %d (%x): does not open under its job's key, refused as %q: %v", i, d, r, err)
					}
				}
			} else {
				if !authentic {
					t.Fatalf("message %d (%x, ifindex %d): accepted without opening under its job's key", i, d, ifindex)
				}
				if l, ok := last[ref]; ok && stamp <= l {
					t.Fatalf("message %d: stamp %d accepted after %d for %+v (a replay)", i, stamp, l, ref)
				}
				if st := time.Unix(0, int64(stamp)); st.Sub(now) > ctlauth.MaxSkew+time.Second || now.Sub(st) > ctlauth.MaxSkew+time.Second {
					t.Fatalf("message %d: stamp %v accepted at %v", i, st, now)
				}
				last[ref] = stamp
				wk := bpf.XdpaggWorkerKey{JobId: h.JobId, WorkerId: uint32(h.WorkerId)}
				w, bound := after.workers[wk]
				switch bpf.XdpaggMsgType(h.Type) {
				case bpf.XdpaggMsgTypeMSG_JOIN:
					var jb bpf.XdpaggJoinBody
					_, _ = binary.Decode(body[bpf.HdrSize:], binary.LittleEndian, &jb)
					a4 := from.Addr().As4()
					mv, ok := after.members[bpf.XdpaggMemberKey{JobId: h.JobId, Ifindex: uint32(ifindex)}]
					if !bound || w.Ifindex != uint32(ifindex) || w.Ip != binary.LittleEndian.Uint32(a4[:]) ||
						w.Port != from.Port()>>8|from.Port()<<8 || !ok || mv.WorkerId != h.WorkerId || mv.DstMac != jb.Mac {
						t.Fatalf("message %d: JOIN %+v from %v on %d accepted, but bound %+v (%v), member %+v (%v)", i, h, from, ifindex, w, bound, mv, ok)
					}
				case bpf.XdpaggMsgTypeMSG_LEAVE:
					if bound {
						t.Fatalf("message %d: LEAVE %+v accepted, worker still bound at %+v", i, h, w)
					}
				default:
					if !unchanged {
						t.Fatalf("message %d: %s %+v changed the maps", i, msgName(h.Type), h)
					}
				}
			}

			// Liveness: what nothing in the policy may refuse.
			if authentic && err != nil && ifindex != fzCtlNotAPort && len(d) == bpf.HdrSize+12+ctlauth.TrailerSize &&
				h.Type == uint8(bpf.XdpaggMsgTypeMSG_JOIN) && h.Version == bpf.Version && h.Reserved == 0 && h.Count == 0 &&
				h.WorkerId < j.workers {
				var jb bpf.XdpaggJoinBody
				_, _ = binary.Decode(body[bpf.HdrSize:], binary.LittleEndian, &jb)
				ps := j.ps.Addr().As4()
				l, seen := last[ref]
				fresh := (!seen || stamp > l) && time.Unix(0, int64(stamp)).Sub(now).Abs() < ctlauth.MaxSkew-time.Second
				_, bound := before.workers[bpf.XdpaggWorkerKey{JobId: h.JobId, WorkerId: uint32(h.WorkerId)}]
				_, taken := before.members[bpf.XdpaggMemberKey{JobId: h.JobId, Ifindex: uint32(ifindex)}]
				n := 0
				for mk := range before.members {
					if mk.Ifindex == uint32(ifindex) {
						n++
					}
				}
				if fresh && jb.Reserved == 0 && (jb.ResultIp == 0 || jb.ResultIp == binary.LittleEndian.Uint32(ps[:])) &&
					!bound && !taken && n < fzCtlPerPort {
					t.Fatalf("message %d: fresh authentic JOIN %+v for a free worker id on a port with room refused: %v", i, h, err)
				}
			}
		}
	})
}
