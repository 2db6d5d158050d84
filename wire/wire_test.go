package wire

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"net/netip"
	"testing"
	"unsafe"
)

func randHdr(r *rand.Rand) Header {
	return Header{
		Version: uint8(r.Uint32()), Type: uint8(r.Uint32()), Encoding: uint8(r.Uint32()), ScaleLog2: uint8(r.Uint32()),
		Flags: uint16(r.Uint32()), Count: uint16(r.Uint32()), JobId: r.Uint32(), Seq: r.Uint32(),
		AggIndex: r.Uint32(), Bitmap0: r.Uint32(), Bitmap1: r.Uint32(),
		FanIn0: uint8(r.Uint32()), FanIn1: uint8(r.Uint32()), WorkerId: uint8(r.Uint32()), Reserved: uint8(r.Uint32()),
	}
}

// fieldOffsets is every Header field's codec offset next to its offset in the Go struct (which
// wire_linux_test.go pins to bpf.XdpaggHdr, hence to struct hdr of the C header).
func fieldOffsets() []struct {
	name        string
	codec, gost uintptr
	size        uintptr
} {
	var h Header
	type f = struct {
		name        string
		codec, gost uintptr
		size        uintptr
	}
	return []f{
		{"version", OffVersion, unsafe.Offsetof(h.Version), unsafe.Sizeof(h.Version)},
		{"type", OffType, unsafe.Offsetof(h.Type), unsafe.Sizeof(h.Type)},
		{"encoding", OffEncoding, unsafe.Offsetof(h.Encoding), unsafe.Sizeof(h.Encoding)},
		{"scale_log2", OffScale, unsafe.Offsetof(h.ScaleLog2), unsafe.Sizeof(h.ScaleLog2)},
		{"flags", OffFlags, unsafe.Offsetof(h.Flags), unsafe.Sizeof(h.Flags)},
		{"count", OffCount, unsafe.Offsetof(h.Count), unsafe.Sizeof(h.Count)},
		{"job_id", OffJob, unsafe.Offsetof(h.JobId), unsafe.Sizeof(h.JobId)},
		{"seq", OffSeq, unsafe.Offsetof(h.Seq), unsafe.Sizeof(h.Seq)},
		{"agg_index", OffAggIndex, unsafe.Offsetof(h.AggIndex), unsafe.Sizeof(h.AggIndex)},
		{"bitmap0", OffBitmap0, unsafe.Offsetof(h.Bitmap0), unsafe.Sizeof(h.Bitmap0)},
		{"bitmap1", OffBitmap1, unsafe.Offsetof(h.Bitmap1), unsafe.Sizeof(h.Bitmap1)},
		{"fan_in0", OffFanIn0, unsafe.Offsetof(h.FanIn0), unsafe.Sizeof(h.FanIn0)},
		{"fan_in1", OffFanIn1, unsafe.Offsetof(h.FanIn1), unsafe.Sizeof(h.FanIn1)},
		{"worker_id", OffWorkerID, unsafe.Offsetof(h.WorkerId), unsafe.Sizeof(h.WorkerId)},
		{"reserved", OffReserved, unsafe.Offsetof(h.Reserved), unsafe.Sizeof(h.Reserved)},
	}
}

// The codec's offsets are the Go struct's, the fields tile the 32 bytes with no gap, and the
// struct is HdrSize bytes both in memory and to encoding/binary.
func TestHeaderOffsets(t *testing.T) {
	if n := unsafe.Sizeof(Header{}); n != HdrSize {
		t.Fatalf("unsafe.Sizeof(Header{}) = %d, want %d", n, HdrSize)
	}
	if n := binary.Size(Header{}); n != HdrSize {
		t.Fatalf("binary.Size(Header{}) = %d, want %d", n, HdrSize)
	}
	next := uintptr(0)
	for _, f := range fieldOffsets() {
		if f.codec != f.gost {
			t.Errorf("%s: codec offset %d, struct offset %d", f.name, f.codec, f.gost)
		}
		if f.codec != next {
			t.Errorf("%s at %d: the previous field ends at %d", f.name, f.codec, next)
		}
		next = f.codec + f.size
	}
	if next != HdrSize {
		t.Errorf("fields end at %d, want %d", next, HdrSize)
	}
	if MaxPacket != 32+4*832 {
		t.Errorf("MaxPacket = %d", MaxPacket)
	}
}

// The hand codec must put every field where encoding/binary (which follows the struct's field
// order and sizes) puts it, and DecodeHeader and AppendHeader must agree with EncodeHeader.
func TestCodecMatchesBinary(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for range 1000 {
		h := randHdr(r)
		want := make([]byte, HdrSize)
		if _, err := binary.Encode(want, binary.LittleEndian, &h); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, HdrSize)
		EncodeHeader(got, &h)
		if !bytes.Equal(got, want) {
			t.Fatalf("header %+v:\n got %x\nwant %x", h, got, want)
		}
		if app := AppendHeader([]byte{0xaa}, &h); app[0] != 0xaa || !bytes.Equal(app[1:], want) {
			t.Fatalf("AppendHeader: %x", app)
		}
		var back Header
		DecodeHeader(got, &back)
		if back != h {
			t.Fatalf("decode(encode(%+v)) = %+v", h, back)
		}
		if PacketFlags(got) != h.Flags {
			t.Fatalf("PacketFlags = %#x, want %#x", PacketFlags(got), h.Flags)
		}
		SetPacketFlags(got, h.Flags^FlagCached)
		DecodeHeader(got, &back)
		if back.Flags != h.Flags^FlagCached {
			t.Fatalf("SetPacketFlags: flags %#x", back.Flags)
		}
	}
}

func TestCodecAllocs(t *testing.T) {
	var h Header
	b := make([]byte, MaxPacket)
	_, vb := validData(4)
	if n := testing.AllocsPerRun(100, func() {
		EncodeHeader(b, &h)
		DecodeHeader(b, &h)
		_, _, _ = ParsePacket(vb)
		_, _, _ = ParsePacket(b[:3])
		_, _, _ = ParsePacket(b)
	}); n != 0 {
		t.Fatalf("%v allocations per run", n)
	}
}

// validData is a DATA packet the switch accepts, with n values.
func validData(n int) (Header, []byte) {
	h := Header{Version: Version, Type: MsgData, Encoding: EncFixed32, ScaleLog2: 24,
		Count: uint16(n), JobId: 7, Seq: 9, AggIndex: 3, Bitmap0: 1 << 2, FanIn0: 4, WorkerId: 2}
	b := make([]byte, HdrSize+4*n)
	EncodeHeader(b, &h)
	for i := range n {
		binary.LittleEndian.PutUint32(b[HdrSize+4*i:], uint32(i*1000-7))
	}
	return h, b
}

func TestParsePacketAccepts(t *testing.T) {
	h, b := validData(5)
	got, vals, err := ParsePacket(b)
	if err != nil || got != h || !bytes.Equal(vals, b[HdrSize:]) || &vals[0] != &b[HdrSize] {
		t.Fatalf("valid DATA: %+v %x %v", got, vals, err)
	}
	type accept struct {
		name   string
		mutate func(h *Header, b []byte) []byte
		nvals  int // bytes of values returned
	}
	for _, c := range []accept{
		{"DATA, fixed32", func(h *Header, b []byte) []byte { return b }, 20},
		{"DATA, float32", func(h *Header, b []byte) []byte { h.Encoding = EncFloat32; return b }, 20},
		{"DATA, every flag", func(h *Header, b []byte) []byte { h.Flags = 0xffff &^ FlagLevel1; return b }, 20},
		{"DATA, fan-in 32, bit 31", func(h *Header, b []byte) []byte { h.FanIn0, h.Bitmap0 = 32, 1<<31; return b }, 20},
		{"DATA, fan-in 1", func(h *Header, b []byte) []byte { h.FanIn0, h.Bitmap0 = 1, 1; return b }, 20},
		{"DATA, partial aggregate", func(h *Header, b []byte) []byte { h.Bitmap0 = 0xf; return b }, 20},
		{"DATA, level 1 fan-in 32", func(h *Header, b []byte) []byte {
			h.Flags, h.Bitmap0, h.FanIn0, h.Bitmap1, h.FanIn1 = FlagLevel1, 0, 0, 1<<31, 32
			return b
		}, 20},
		{"DATA, level 0 ignores bitmap1", func(h *Header, b []byte) []byte { h.Bitmap1, h.FanIn1 = 0xffffffff, 0; return b }, 20},
		{"DATA, any agg_index", func(h *Header, b []byte) []byte { h.AggIndex = 0xffffffff; return b }, 20},
		{"DATA, MaxValues values", func(h *Header, b []byte) []byte {
			h.Count = MaxValues
			return make([]byte, MaxPacket)
		}, 4 * MaxValues},
		{"RESULT, no contributor checks", func(h *Header, b []byte) []byte {
			h.Type, h.Bitmap0, h.FanIn0 = MsgResult, 0, 0
			return b
		}, 20},
		{"RESULT, float32", func(h *Header, b []byte) []byte { h.Type, h.Encoding = MsgResult, EncFloat32; return b }, 20},
		{"JOIN with a body, any encoding", func(h *Header, b []byte) []byte {
			h.Type, h.Encoding, h.Count, h.JobId = MsgJoin, 99, 0, 0
			return b[:HdrSize+3]
		}, 3},
		{"LEAVE", func(h *Header, b []byte) []byte { h.Type = MsgLeave; return b }, 20},
		{"ACK, header only", func(h *Header, b []byte) []byte { h.Type = MsgAck; return b[:HdrSize] }, 0},
		{"RETRANSMIT, count not checked", func(h *Header, b []byte) []byte { h.Type, h.Count = MsgRetransmit, 9999; return b }, 20},
	} {
		t.Run(c.name, func(t *testing.T) {
			h, b := validData(5)
			b = c.mutate(&h, b)
			EncodeHeader(b, &h)
			got, vals, err := ParsePacket(b)
			if err != nil || got != h || len(vals) != c.nvals {
				t.Fatalf("got %+v, %d value bytes, %v; want %+v, %d, nil", got, len(vals), err, h, c.nvals)
			}
		})
	}
}

func TestParsePacketRejects(t *testing.T) {
	for _, c := range []struct {
		name   string
		mutate func(h *Header, b []byte) []byte
		want   error
	}{
		{"empty", func(h *Header, b []byte) []byte { return nil }, ErrShort},
		{"31 bytes", func(h *Header, b []byte) []byte { return b[:HdrSize-1] }, ErrShort},
		{"version 0", func(h *Header, b []byte) []byte { h.Version = 0; return b }, ErrVersion},
		{"version 2", func(h *Header, b []byte) []byte { h.Version = 2; return b }, ErrVersion},
		{"reserved", func(h *Header, b []byte) []byte { h.Reserved = 1; return b }, ErrReserved},
		{"reserved on a control message", func(h *Header, b []byte) []byte { h.Type, h.Reserved = MsgJoin, 0x80; return b }, ErrReserved},
		{"type 0", func(h *Header, b []byte) []byte { h.Type = 0; return b }, ErrType},
		{"type 200", func(h *Header, b []byte) []byte { h.Type = 200; return b }, ErrType},
		{"PULL of dense values", func(h *Header, b []byte) []byte { h.Type = MsgPull; return b }, ErrEncoding},
		{"type 255", func(h *Header, b []byte) []byte { h.Type = 255; return b }, ErrType},
		{"count 0", func(h *Header, b []byte) []byte { h.Count = 0; return b[:HdrSize] }, ErrCount},
		{"RESULT count 0", func(h *Header, b []byte) []byte { h.Type, h.Count = MsgResult, 0; return b[:HdrSize] }, ErrCount},
		{"count > MaxValues", func(h *Header, b []byte) []byte {
			h.Count = MaxValues + 1
			return make([]byte, MaxPacket+4)
		}, ErrCount},
		{"count 0xffff", func(h *Header, b []byte) []byte { h.Count = 0xffff; return b }, ErrCount},
		{"length short", func(h *Header, b []byte) []byte { return b[:len(b)-1] }, ErrLength},
		{"length long by a value", func(h *Header, b []byte) []byte { return append(b, 0, 0, 0, 0) }, ErrLength},
		{"length long by a byte", func(h *Header, b []byte) []byte { return append(b, 0) }, ErrLength},
		{"count lies", func(h *Header, b []byte) []byte { h.Count = 4; return b }, ErrLength},
		{"header only", func(h *Header, b []byte) []byte { return b[:HdrSize] }, ErrLength},
		{"ENC_SPARSE_KV with a dense length", func(h *Header, b []byte) []byte { h.Encoding = EncSparseKV; return b }, ErrLength},
		{"ENC_SPARSE_KV result", func(h *Header, b []byte) []byte { h.Type, h.Encoding = MsgResult, EncSparseKV; return b }, ErrEncoding},
		{"ENC_SPARSE_COLD with a dense length", func(h *Header, b []byte) []byte { h.Encoding = EncSparseCold; return b }, ErrLength},
		{"hot sums in DATA", func(h *Header, b []byte) []byte { h.Encoding = EncSparseHot; return b }, ErrEncoding},
		{"encoding 5", func(h *Header, b []byte) []byte { h.Encoding = 5; return b }, ErrEncoding},
		{"encoding before job id", func(h *Header, b []byte) []byte { h.Encoding, h.JobId = 5, 0; return b }, ErrEncoding},
		{"job 0", func(h *Header, b []byte) []byte { h.JobId = 0; return b }, ErrJob},
		{"RESULT job 0", func(h *Header, b []byte) []byte { h.Type, h.JobId = MsgResult, 0; return b }, ErrJob},
		{"fan-in 0", func(h *Header, b []byte) []byte { h.FanIn0 = 0; return b }, ErrFanIn},
		{"fan-in 33", func(h *Header, b []byte) []byte { h.FanIn0 = 33; return b }, ErrFanIn},
		{"fan-in 255", func(h *Header, b []byte) []byte { h.FanIn0 = 255; return b }, ErrFanIn},
		{"bitmap 0", func(h *Header, b []byte) []byte { h.Bitmap0 = 0; return b }, ErrBitmap},
		{"bit >= fan-in", func(h *Header, b []byte) []byte { h.Bitmap0 = 1 << 4; return b }, ErrBitmap},
		{"bit 31 at fan-in 31", func(h *Header, b []byte) []byte { h.FanIn0, h.Bitmap0 = 31, 1<<31; return b }, ErrBitmap},
		{"level-1 bitmap", func(h *Header, b []byte) []byte { h.Flags, h.FanIn1, h.Bitmap1 = FlagLevel1, 2, 4; return b }, ErrBitmap},
		{"level-1 bitmap 0", func(h *Header, b []byte) []byte { h.Flags, h.FanIn1, h.Bitmap1 = FlagLevel1, 2, 0; return b }, ErrBitmap},
		{"level-1 fan-in 0", func(h *Header, b []byte) []byte { h.Flags, h.FanIn1, h.Bitmap1 = FlagLevel1, 0, 1; return b }, ErrFanIn},
	} {
		t.Run(c.name, func(t *testing.T) {
			h, b := validData(5)
			b = c.mutate(&h, b)
			if len(b) >= HdrSize {
				EncodeHeader(b, &h)
			}
			got, vals, err := ParsePacket(b)
			if err != c.want || !errors.Is(err, ErrMalformed) || vals != nil {
				t.Fatalf("err = %v (%d value bytes), want %v", err, len(vals), c.want)
			}
			if len(b) >= HdrSize && got != h {
				t.Fatalf("header on error: %+v, want %+v", got, h)
			}
		})
	}
}

func TestKnown(t *testing.T) {
	for ty := range 256 {
		want := ty >= 1 && ty <= 12
		if KnownType(uint8(ty)) != want {
			t.Errorf("KnownType(%d) = %v", ty, !want)
		}
	}
	for e := range 256 {
		if KnownEncoding(uint8(e)) != (e <= 4) {
			t.Errorf("KnownEncoding(%d) = %v", e, !(e <= 4))
		}
	}
}

func TestAddressHelpers(t *testing.T) {
	a := netip.MustParseAddr("10.1.2.3")
	v := IPv4ToMap(a)
	var mem [4]byte
	binary.LittleEndian.PutUint32(mem[:], v) // the map field's bytes as the datapath sees them
	if mem != a.As4() {
		t.Fatalf("IPv4ToMap(%v) = %#x: in memory %v, want network order", a, v, mem)
	}
	if v != 0x0302010a {
		t.Fatalf("IPv4ToMap(%v) = %#x", a, v)
	}
	if back := IPv4FromMap(v); back != a {
		t.Fatalf("IPv4FromMap(%#x) = %v", v, back)
	}
	if got := IPv4ToMap(netip.MustParseAddr("::ffff:10.1.2.3")); got != v {
		t.Fatalf("IPv4-mapped: %#x", got)
	}
	r := rand.New(rand.NewPCG(3, 4))
	for range 1000 {
		x := r.Uint32()
		if IPv4ToMap(IPv4FromMap(x)) != x {
			t.Fatalf("round trip of %#x", x)
		}
		p := uint16(x)
		var be [2]byte
		binary.BigEndian.PutUint16(be[:], p)
		if PortToMap(p) != binary.LittleEndian.Uint16(be[:]) || PortFromMap(PortToMap(p)) != p {
			t.Fatalf("port %d: to map %#x", p, PortToMap(p))
		}
	}
	if PortToMap(9510) != 0x2625 {
		t.Fatalf("PortToMap(9510) = %#x", PortToMap(9510))
	}
}

func FuzzParsePacket(f *testing.F) {
	for _, n := range []int{1, 5, MaxValues} {
		_, b := validData(n)
		f.Add(b)
		f.Add(b[:len(b)-1])
		f.Add(append(b, 1))
	}
	_, b := validData(2)
	for _, ty := range []uint8{MsgResult, MsgJoin, MsgReset, MsgAck, MsgHeartbeat, 9} {
		c := append([]byte(nil), b...)
		c[OffType] = ty
		f.Add(c)
	}
	f.Add(sparseData(EncSparseKV, MsgData, 3, 1, 0))
	f.Add(sparseData(EncSparseCold, MsgResult, 2, 4, 3))
	f.Add(sparseData(EncSparseKV, MsgPull, 5, 0, 7))
	for _, enc := range []uint8{EncFloat32, EncSparseKV, 3} {
		c := append([]byte(nil), b...)
		c[OffEncoding] = enc
		f.Add(c)
	}
	f.Add([]byte{})
	f.Add(make([]byte, HdrSize))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, vals, err := ParsePacket(b)
		if err != nil {
			if !errors.Is(err, ErrMalformed) || vals != nil {
				t.Fatalf("error %v does not wrap ErrMalformed, or values returned", err)
			}
			if len(b) >= HdrSize {
				var d Header
				DecodeHeader(b, &d)
				if d != h {
					t.Fatalf("header on error %+v, want %+v", h, d)
				}
			}
			return
		}
		if h.Version != Version || h.Reserved != 0 || !KnownType(h.Type) {
			t.Fatalf("accepted %+v", h)
		}
		if Sparse(h.Encoding) && (h.Type == MsgData || h.Type == MsgResult || h.Type == MsgPull) {
			psize := KVPairSize
			switch h.Encoding {
			case EncSparseCold:
				psize = ColdPairSize
			case EncSparseHot:
				psize = 4
			}
			if len(vals) != SparseHdrSize+psize*int(h.Count) || h.JobId == 0 {
				t.Fatalf("accepted sparse %+v with %d bytes", h, len(vals))
			}
		} else if h.Type == MsgData || h.Type == MsgResult {
			if len(vals) != 4*int(h.Count) || h.Count == 0 || int(h.Count) > MaxValues || !KnownEncoding(h.Encoding) || h.JobId == 0 {
				t.Fatalf("accepted %+v with %d value bytes", h, len(vals))
			}
		}
		if h.Type == MsgData {
			bm, fan := h.LevelBits()
			if fan == 0 || fan > MaxWorkers || bm == 0 || uint64(bm)>>fan != 0 {
				t.Fatalf("accepted DATA with bitmap %#x fan-in %d", bm, fan)
			}
		}
		// The packet is exactly its parsed header followed by its values.
		out := AppendHeader(make([]byte, 0, HdrSize+len(vals)), &h)
		out = append(out, vals...)
		if !bytes.Equal(out, b) {
			t.Fatalf("round trip:\n got %x\nwant %x", out, b)
		}
		h2, vals2, err := ParsePacket(out)
		if err != nil || h2 != h || !bytes.Equal(vals2, vals) {
			t.Fatalf("re-parse: %+v %v", h2, err)
		}
	})
}

// sparseData is a sparse packet of n pairs (zeros) of encoding enc and type ty, for job 5 from
// worker 1 of 2.
func sparseData(enc, ty uint8, n int, npkts uint16, index uint32) []byte {
	psize := KVPairSize
	switch enc {
	case EncSparseCold:
		psize = ColdPairSize
	case EncSparseHot:
		psize = 4
	}
	h := Header{Version: Version, Type: ty, Encoding: enc, Count: uint16(n), JobId: 5, AggIndex: index,
		Bitmap0: 2, FanIn0: 2, WorkerId: 1}
	b := make([]byte, HdrSize+SparseHdrSize+psize*n)
	EncodeHeader(b, &h)
	EncodeSparseHeader(b[HdrSize:], &SparseHeader{HotVersion: 3, Npkts: npkts})
	return b
}

func TestParseSparse(t *testing.T) {
	for _, c := range []struct {
		name string
		b    []byte
		want error
	}{
		{"hot DATA", sparseData(EncSparseKV, MsgData, 3, 2, 1), nil},
		{"empty marker", sparseData(EncSparseKV, MsgData, 0, 1, 0), nil},
		{"most hot pairs", sparseData(EncSparseKV, MsgData, SparseMaxPairs, 1, 0), nil},
		{"too many hot pairs", sparseData(EncSparseKV, MsgData, SparseMaxPairs+1, 1, 0), ErrSparseCount},
		{"cold DATA", sparseData(EncSparseCold, MsgData, ColdMaxPairs, 1, 0), nil},
		{"too many cold pairs", sparseData(EncSparseCold, MsgData, ColdMaxPairs+1, 1, 0), ErrSparseCount},
		{"cold RESULT", sparseData(EncSparseCold, MsgResult, 1, 9, 8), nil},
		{"hot RESULT", sparseData(EncSparseKV, MsgResult, 1, 1, 0), ErrEncoding},
		{"PULL", sparseData(EncSparseKV, MsgPull, 4, 0, 100), nil},
		{"hot sums RESULT", sparseData(EncSparseHot, MsgResult, HotMaxValues, 3, 2), nil},
		{"too many hot sums", sparseData(EncSparseHot, MsgResult, HotMaxValues+1, 3, 2), ErrSparseCount},
		{"hot sums DATA", sparseData(EncSparseHot, MsgData, 3, 1, 0), ErrEncoding},
		{"PULL of nothing", sparseData(EncSparseKV, MsgPull, 0, 0, 0), ErrSparseCount},
		{"PULL with npkts", sparseData(EncSparseKV, MsgPull, 1, 1, 0), ErrNpkts},
		{"cold PULL", sparseData(EncSparseCold, MsgPull, 1, 0, 0), ErrEncoding},
		{"npkts 0", sparseData(EncSparseKV, MsgData, 1, 0, 0), ErrNpkts},
		{"index at npkts", sparseData(EncSparseKV, MsgData, 1, 2, 2), ErrNpkts},
		{"too many hot packets", sparseData(EncSparseKV, MsgData, 1, SparseMaxPkts+1, 0), ErrNpkts},
		{"many cold packets", sparseData(EncSparseCold, MsgData, 1, 1000, 999), nil},
		{"length short", sparseData(EncSparseKV, MsgData, 2, 1, 0)[:HdrSize+SparseHdrSize+15], ErrLength},
		{"no sparse header", sparseData(EncSparseKV, MsgData, 0, 1, 0)[:HdrSize], ErrLength},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, vals, err := ParsePacket(c.b)
			if err != c.want {
				t.Fatalf("err = %v, want %v", err, c.want)
			}
			if err == nil && len(vals) != len(c.b)-HdrSize {
				t.Fatalf("values of %d bytes", len(vals))
			}
		})
	}
}
