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
//   - an accepted JOIN binds exactly its sender, and took no live binding from another host, no
//     live member's place behind the port and no place beyond the port's quota; an accepted LEAVE
//     came from the binding and unbinds the worker id; an accepted ACK or RETRANSMIT came from
//     the binding and changes nothing; an accepted SETH came from the binding and set only its
//     job's threshold, to 1..its workers; a replayed or stale stamp is never accepted;
//   - a fresh, authentic, well-formed JOIN for a free worker id on a port with room is accepted.
//
//	go test ./agent/ -run '^$' -fuzz FuzzControlHandle -fuzztime 60s

import (
	"bytes"
	"encoding/binary"
	"errors"
	"log/slog"
	"maps"
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
	"github.com/xdpagg/xdpagg/wire"
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

// A fuzz input is a sequence of at most fzCtlMaxDg records, each one message. Records are small
// (the minimizer's work grows with the square of the input's length, and each input runs a few
// hundred map syscalls): a structured record names a message by a few bytes, which the harness
// encodes; a raw record carries the datagram's bytes (the parser's side).
//
//	structured: k (bit 7 clear), meta, stamp, type, job, worker, seq, body   (8 bytes)
//	raw:        k = 0x80 | n, meta, stamp, n bytes of datagram
//
// job: 0, 1 = fzJobA, 2 = fzJobB, 3 = 99 (never admitted), else that id. body: bits 0-1 the
// result address (0; the job's PS; the other job's PS; 10.66.0.1), bit 2 toggles the body (JOIN
// and LEAVE carry one), bit 3 sets its reserved field, bits 4-7 the MAC's last byte.
type fzRecord struct {
	meta, stamp byte
	d           []byte // the datagram, before any trailer
}

const fzStructSize = 8

func fzCtlSplit(b []byte) []fzRecord {
	var out []fzRecord
	for len(b) >= 3 && len(out) < fzCtlMaxDg {
		k := b[0]
		if k&0x80 == 0 {
			if len(b) < fzStructSize {
				break
			}
			r := b[1:fzStructSize]
			out = append(out, fzRecord{meta: r[0], stamp: r[1], d: fzEncode(r[2], r[3], r[4], r[5], r[6])})
			b = b[fzStructSize:]
			continue
		}
		n := min(int(k&0x7f), len(b)-3)
		out = append(out, fzRecord{meta: b[1], stamp: b[2], d: b[3 : 3+n]})
		b = b[3+n:]
	}
	return out
}

func fzEncode(typ, job, worker, seq, body byte) []byte {
	id := uint32(job)
	switch job {
	case 1:
		id = fzJobA
	case 2:
		id = fzJobB
	case 3:
		id = 99
	}
	h := wire.Header{Version: wire.Version, Type: typ, JobId: id, Seq: uint32(seq), WorkerId: worker}
	b := wire.AppendHeader(nil, &h)
	withBody := typ == wire.MsgJoin || typ == wire.MsgLeave || typ == wire.MsgSetH
	if body&4 != 0 {
		withBody = !withBody
	}
	if !withBody {
		return b
	}
	if typ == wire.MsgSetH {
		return binary.LittleEndian.AppendUint32(b, uint32(body>>4)) // H 0..15
	}
	jb := bpf.XdpaggJoinBody{Mac: [6]byte{0x02, 0xbb, 0, 0, 0, body >> 4}}
	if body&8 != 0 {
		jb.Reserved = 1
	}
	rip := [4]netip.Addr{{}, fzJobs[fzJobA].ps.Addr(), fzJobs[fzJobB].ps.Addr(), netip.MustParseAddr("10.66.0.1")}[body&3]
	if j, ok := fzJobs[id]; ok && body&3 == 1 {
		rip = j.ps.Addr()
	}
	if rip.IsValid() {
		jb.ResultIp = wire.IPv4ToMap(rip)
	}
	b, err := binary.Append(b, binary.LittleEndian, &jb)
	if err != nil {
		panic(err)
	}
	return b
}

// fzOp is a structured record (seeds).
func fzOp(meta, stamp, typ, job, worker, seq, body byte) []byte {
	return []byte{0, meta, stamp, typ, job, worker, seq, body}
}

// fzRaw is a raw record (seeds).
func fzRaw(meta, stamp byte, d []byte) []byte {
	if len(d) > 0x7f {
		panic("raw record too long")
	}
	return append([]byte{0x80 | byte(len(d)), meta, stamp}, d...)
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

func FuzzControlHandle(f *testing.F) {
	const (
		join  = wire.MsgJoin
		leave = wire.MsgLeave
		ack   = wire.MsgAck
		rtx   = wire.MsgRetransmit
		data  = wire.MsgData
		seth  = wire.MsgSetH
		fbc   = wire.MsgFBcast
		sA0   = 0 << 2
		sA1   = 1 << 2
		sB    = 2 << 2
		p2    = 1
		np    = 2
		S     = fzSeal
		A, B  = 1, 2 // jobs
		mac1  = 0x10 // body: MAC ...:01, no result address
		ps    = 0x21 // body: MAC ...:02, the job's own PS
		other = 0x32 // body: MAC ...:03, the other job's PS
	)
	seq := func(recs ...[]byte) []byte { return bytes.Join(recs, nil) }
	// SETH and FBCAST: from the binding (H 2, then a bad H 9 of 4), and from another host.
	f.Add(seq(
		fzOp(S|sA0, 0, join, A, 1, 1, mac1),
		fzOp(S|sA0, 0, seth, A, 1, 2, 0x20),
		fzOp(S|sA0, 0, seth, A, 1, 3, 0x90),
		fzOp(S|sB, 0, seth, A, 1, 4, 0x30),
		fzOp(S|sA0, 0, fbc, A, 1, 5, 0),
		fzOp(S|sB, 0, fbc, A, 1, 6, 0),
	))
	// A job's life: JOIN, ACK, RETRANSMIT, LEAVE from the binding; others refused.
	f.Add(seq(
		fzOp(S|sA0, 0, join, A, 3, 1, mac1),
		fzOp(S|sA0, 0, ack, A, 3, 9, 0),
		fzOp(S|sA0, 0, rtx, A, 3, 9, 0),
		fzOp(S|sB, 0, rtx, A, 3, 9, 0),     // another host claims worker 3
		fzOp(S|sA0, 0, rtx, A, 1, 9, 0),    // an unbound worker id
		fzOp(S|sB, 0, join, A, 2, 2, mac1), // another id behind the port
		fzOp(S|sB|p2, 0, join, A, 2, 2, ps),
		fzOp(S|sB, 0, leave, A, 3, 3, mac1), // not the binding
		fzOp(S|sA0, 0, leave, A, 3, 3, mac1),
		fzOp(S|sA0, 0, leave, A, 3, 4, mac1), // resent
	))
	// Binding rules: the same host rebinds from a new UDP port; another host only after the TTL;
	// the port quota; JOINs naming another PS or a worker id beyond the job's.
	f.Add(seq(
		fzOp(S|sA0, 0, join, A, 0, 1, mac1),
		fzOp(S|sA1, 0, join, A, 0, 2, mac1),
		fzOp(S|sB, 0, join, A, 0, 3, mac1),
		fzOp(S|sB|fzTinyTTL, 0, join, A, 0, 4, mac1),
		fzOp(S|sA0|p2, 0, join, B, 1, 1, mac1),
		fzOp(S|sA0|p2, 0, join, A, 1, 1, mac1),
		fzOp(S|sA0|p2, 0, join, B, 0, 2, mac1), // the job's other id behind the port: refused
		fzOp(S|sA0, 0, join, B, 0, 3, mac1),    // port full
		fzOp(S|sA0, 0, join, A, 2, 5, other),
		fzOp(S|sA0, 0, join, B, 2, 5, mac1),
		fzOp(S|sA0|p2|fzTinyTTL, 0, join, A, 3, 6, mac1), // replaces a silent member
	))
	// Replays: the same stamp, an older one, ahead, beyond the window; messages that do not
	// open (no trailer, a trailer of zeros, the other job's key).
	sealedB, err := ctlauth.Seal(fzJobs[fzJobB].key, fzEncode(join, A, 1, 1, mac1), uint64(time.Now().UnixNano()))
	if err != nil {
		f.Fatal(err)
	}
	f.Add(seq(
		fzOp(S|sA0, 0, join, A, 1, 1, mac1),
		fzOp(S|sA0, 0, ack, A, 1, 7, 0),
		fzOp(S|sA0|fzStampOld, 0, ack, A, 1, 7, 0),
		fzOp(S|sA0|fzStampOld, 5, ack, A, 1, 7, 0),
		fzOp(S|sA0|fzStampAhead, 60, ack, A, 1, 7, 0),
		fzOp(S|sA0|fzStampAhead, 20, ack, A, 1, 7, 0),
		fzOp(S|sA0, 0, ack, A, 1, 7, 0),
		fzOp(sA0, 0, join, A, 2, 1, mac1),
		fzRaw(sA0, 0, append(fzEncode(ack, A, 1, 1, 0), make([]byte, ctlauth.TrailerSize)...)),
		fzRaw(sA0, 0, sealedB),
	))
	// The parser: not a port, job 0, unknown job, worker 32, bodies where none belongs and none
	// where one does, DATA, unknown types, reserved fields, junk.
	v2 := fzEncode(join, A, 1, 1, mac1)
	v2[0] = 2
	res := fzEncode(join, A, 1, 1, mac1)
	res[31] = 1
	cnt := fzEncode(ack, A, 1, 1, 0)
	cnt[6] = 1
	f.Add(seq(
		fzOp(S|sA0|np, 0, join, A, 0, 1, mac1),
		fzOp(S|sA0, 0, join, 0, 0, 1, mac1),
		fzOp(S|sA0, 0, join, 3, 0, 1, mac1),
		fzOp(S|sA0, 0, join, A, 32, 1, mac1),
		fzOp(S|sA0, 0, join, A, 0, 1, mac1|4),
		fzOp(S|sA0, 0, ack, A, 0, 1, mac1|4),
		fzOp(S|sA0, 0, join, A, 0, 1, mac1|8),
		fzOp(S|sA0, 0, data, A, 0, 1, 0),
		fzOp(S|sA0, 0, 200, A, 0, 1, 0),
		fzRaw(S|sA0, 0, v2),
		fzRaw(S|sA0, 0, res),
		fzRaw(S|sA0, 0, cnt),
		fzRaw(S|sA0, 0, fzEncode(join, A, 0, 1, mac1)[:wire.HdrSize+11]),
		fzRaw(sA0, 0, []byte("junk")),
		fzRaw(0, 0, nil),
	))

	fzSetup(f)
	f.Fuzz(func(t *testing.T, in []byte) {
		c := fzControl(t)
		m := c.maps
		last := map[workerRef]uint64{} // last accepted stamp per <job, worker id>
		var prevStamp uint64
		for i, r := range fzCtlSplit(in) {
			meta, sb, d := r.meta, r.stamp, r.d
			ifindex := [4]int{fzCtlPort, fzCtlPort2, fzCtlNotAPort, fzCtlPort}[meta&fzPortMask]
			sender := fzCtl.senders[[4]int{0, 1, 2, 0}[(meta&fzSenderMask)>>2]]
			from := sender.LocalAddr().(*net.UDPAddr).AddrPort()
			c.cfg.MemberTTL = DefaultMemberTTL
			if meta&fzTinyTTL != 0 {
				c.cfg.MemberTTL = time.Nanosecond
			}
			var h wire.Header
			if len(d) >= wire.HdrSize {
				wire.DecodeHeader(d, &h)
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
			if admitted && len(d) >= wire.HdrSize {
				var oerr error
				body, stamp, oerr = ctlauth.Open(j.key, d)
				authentic = oerr == nil
			}
			ref := workerRef{job: h.JobId, worker: h.WorkerId, answers: h.Type == wire.MsgHelp}
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
				mk := bpf.XdpaggMemberKey{JobId: h.JobId, Ifindex: uint32(ifindex)}
				w, bound := after.workers[wk]
				// Who held the worker id (and the job's place behind this port) before.
				a4 := from.Addr().As4()
				sender := bpf.XdpaggWorker{Ip: binary.LittleEndian.Uint32(a4[:]), Ifindex: uint32(ifindex), Port: from.Port()>>8 | from.Port()<<8}
				prev, wasBound := before.workers[wk]
				fromBinding := wasBound && prev == sender
				takeable := meta&fzTinyTTL != 0 // a fresh server: nobody is silent for the default TTL
				switch h.Type {
				case wire.MsgJoin:
					var jb bpf.XdpaggJoinBody
					_, _ = binary.Decode(body[wire.HdrSize:], binary.LittleEndian, &jb)
					mv, ok := after.members[mk]
					if !bound || w != sender || !ok || mv.WorkerId != h.WorkerId || mv.DstMac != jb.Mac {
						t.Fatalf("message %d: JOIN %+v from %v on %d accepted, but bound %+v (%v), member %+v (%v)", i, h, from, ifindex, w, bound, mv, ok)
					}
					sameHost := wasBound && prev.Ip == sender.Ip && prev.Ifindex == sender.Ifindex
					if wasBound && !sameHost && !takeable {
						t.Fatalf("message %d: JOIN %+v from %v on %d took over worker id bound at %+v, which is alive", i, h, from, ifindex, prev)
					}
					old, there := before.members[mk]
					if there && old.WorkerId != h.WorkerId && !takeable {
						t.Fatalf("message %d: JOIN %+v on %d replaced live worker %d behind the port", i, h, ifindex, old.WorkerId)
					}
					n := 0
					for k := range before.members {
						if k.Ifindex == uint32(ifindex) {
							n++
						}
					}
					if !there && n >= fzCtlPerPort {
						t.Fatalf("message %d: JOIN %+v made a member behind port %d, which had %d (at most %d)", i, h, ifindex, n, fzCtlPerPort)
					}
				case wire.MsgSetH:
					hv := binary.LittleEndian.Uint32(body[wire.HdrSize:])
					if !fromBinding || hv < 1 || hv > uint32(j.workers) || after.jobs[h.JobId].Threshold != uint8(hv) {
						t.Fatalf("message %d: SETH %+v (H %d) from %v on %d accepted: binding %v, threshold now %d", i, h, hv, from, ifindex, fromBinding, after.jobs[h.JobId].Threshold)
					}
					want := before
					want.jobs = maps.Clone(before.jobs)
					v := want.jobs[h.JobId]
					v.Threshold = uint8(hv)
					want.jobs[h.JobId] = v
					if !reflect.DeepEqual(want, after) {
						t.Fatalf("message %d: SETH %+v changed more than its job's threshold", i, h)
					}
				case wire.MsgLeave:
					if bound {
						t.Fatalf("message %d: LEAVE %+v accepted, worker still bound at %+v", i, h, w)
					}
					if wasBound && !fromBinding {
						t.Fatalf("message %d: LEAVE %+v from %v on %d accepted; the worker id was bound at %+v", i, h, from, ifindex, prev)
					}
				default:
					if !unchanged {
						t.Fatalf("message %d: %s %+v changed the maps", i, msgName(h.Type), h)
					}
					if !fromBinding {
						t.Fatalf("message %d: %s %+v from %v on %d accepted, not from the worker id's binding (%+v, %v)", i, msgName(h.Type), h, from, ifindex, prev, wasBound)
					}
				}
			}

			// Liveness: what nothing in the policy may refuse. An ACK or RETRANSMIT from the
			// worker id's binding with a fresh stamp (above the last one accepted for the id:
			// refused messages, the binding's or anyone else's, must not have used one up).
			if authentic && err != nil && (h.Type == wire.MsgAck || h.Type == wire.MsgRetransmit) &&
				len(d) == wire.HdrSize+ctlauth.TrailerSize && h.Version == wire.Version && h.Reserved == 0 && h.Count == 0 {
				a4 := from.Addr().As4()
				w, ok := before.workers[bpf.XdpaggWorkerKey{JobId: h.JobId, WorkerId: uint32(h.WorkerId)}]
				l, seen := last[ref]
				fresh := (!seen || stamp > l) && time.Unix(0, int64(stamp)).Sub(now).Abs() < ctlauth.MaxSkew-time.Second
				if ok && fresh && w.Ifindex == uint32(ifindex) && w.Ip == binary.LittleEndian.Uint32(a4[:]) && w.Port == from.Port()>>8|from.Port()<<8 {
					t.Fatalf("message %d: fresh authentic %s %+v from the worker id's binding refused: %v", i, msgName(h.Type), h, err)
				}
			}
			// A JOIN for a free worker id on a port with room.
			if authentic && err != nil && ifindex != fzCtlNotAPort && len(d) == wire.HdrSize+12+ctlauth.TrailerSize &&
				h.Type == wire.MsgJoin && h.Version == wire.Version && h.Reserved == 0 && h.Count == 0 &&
				h.WorkerId < j.workers {
				var jb bpf.XdpaggJoinBody
				_, _ = binary.Decode(body[wire.HdrSize:], binary.LittleEndian, &jb)
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
