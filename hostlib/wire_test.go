package hostlib

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/xdpagg/xdpagg/bpf"
)

func TestHeaderSize(t *testing.T) {
	if got := binary.Size(bpf.XdpaggHdr{}); got != bpf.HdrSize {
		t.Fatalf("binary.Size(bpf.XdpaggHdr{}) = %d, want bpf.HdrSize = %d", got, bpf.HdrSize)
	}
	if MaxPacket != 32+4*bpf.MaxValues {
		t.Fatalf("MaxPacket = %d", MaxPacket)
	}
}

func randHdr(r *rand.Rand) bpf.XdpaggHdr {
	return bpf.XdpaggHdr{
		Version: uint8(r.Uint32()), Type: uint8(r.Uint32()), Encoding: uint8(r.Uint32()), ScaleLog2: uint8(r.Uint32()),
		Flags: uint16(r.Uint32()), Count: uint16(r.Uint32()), JobId: r.Uint32(), Seq: r.Uint32(),
		AggIndex: r.Uint32(), Bitmap0: r.Uint32(), Bitmap1: r.Uint32(),
		FanIn0: uint8(r.Uint32()), FanIn1: uint8(r.Uint32()), WorkerId: uint8(r.Uint32()), Reserved: uint8(r.Uint32()),
	}
}

// The hand encoder must put every field where encoding/binary (which follows the generated struct,
// hence the C layout) puts it, and decodeHeader must invert it.
func TestEncodeHeaderMatchesBinary(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < 1000; i++ {
		h := randHdr(r)
		want := make([]byte, bpf.HdrSize)
		if _, err := binary.Encode(want, binary.LittleEndian, &h); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, bpf.HdrSize)
		EncodeHeader(got, &h)
		if !bytes.Equal(got, want) {
			t.Fatalf("header %+v:\n got %x\nwant %x", h, got, want)
		}
		var back bpf.XdpaggHdr
		decodeHeader(got, &back)
		if back != h {
			t.Fatalf("decode(encode(%+v)) = %+v", h, back)
		}
	}
}

// validData is a DATA packet the switch accepts, with n values.
func validData(n int) (bpf.XdpaggHdr, []byte) {
	h := bpf.XdpaggHdr{Version: bpf.Version, Type: msgData, Encoding: encFixed32, ScaleLog2: 24,
		Count: uint16(n), JobId: 7, Seq: 9, AggIndex: 3, Bitmap0: 1 << 2, FanIn0: 4, WorkerId: 2}
	b := make([]byte, bpf.HdrSize+4*n)
	EncodeHeader(b, &h)
	for i := 0; i < n; i++ {
		binary.LittleEndian.PutUint32(b[bpf.HdrSize+4*i:], uint32(i*1000-7))
	}
	return h, b
}

func TestParsePacket(t *testing.T) {
	h, b := validData(5)
	got, vals, err := ParsePacket(b)
	if err != nil || got != h || !bytes.Equal(vals, b[bpf.HdrSize:]) {
		t.Fatalf("valid DATA: %+v %x %v", got, vals, err)
	}
	res := h
	res.Type, res.Bitmap0, res.FanIn0 = msgResult, 0, 0 // results are not checked for contributors
	rb := make([]byte, len(b))
	EncodeHeader(rb, &res)
	if _, _, err := ParsePacket(rb); err != nil {
		t.Fatalf("valid RESULT: %v", err)
	}
	ctl := bpf.XdpaggHdr{Version: bpf.Version, Type: uint8(bpf.XdpaggMsgTypeMSG_JOIN), Encoding: 99}
	cb := make([]byte, bpf.HdrSize+3)
	EncodeHeader(cb, &ctl)
	if _, vals, err := ParsePacket(cb); err != nil || len(vals) != 3 {
		t.Fatalf("control: %v, %d values bytes", err, len(vals))
	}
	_, full := validData(bpf.MaxValues)
	if _, _, err := ParsePacket(full); err != nil {
		t.Fatalf("K values: %v", err)
	}
	lvl1 := h
	lvl1.Flags, lvl1.Bitmap0, lvl1.FanIn0, lvl1.Bitmap1, lvl1.FanIn1 = fLevel1, 0, 0, 1<<31, 32
	l1 := append([]byte(nil), b...)
	EncodeHeader(l1, &lvl1)
	if _, _, err := ParsePacket(l1); err != nil {
		t.Fatalf("level-1 DATA with fan-in 32: %v", err)
	}

	bad := map[string]func(h *bpf.XdpaggHdr, b []byte) []byte{
		"short":    func(h *bpf.XdpaggHdr, b []byte) []byte { return b[:bpf.HdrSize-1] },
		"empty":    func(h *bpf.XdpaggHdr, b []byte) []byte { return nil },
		"version":  func(h *bpf.XdpaggHdr, b []byte) []byte { h.Version = 2; return b },
		"reserved": func(h *bpf.XdpaggHdr, b []byte) []byte { h.Reserved = 1; return b },
		"type 0":   func(h *bpf.XdpaggHdr, b []byte) []byte { h.Type = 0; return b },
		"type 9":   func(h *bpf.XdpaggHdr, b []byte) []byte { h.Type = 9; return b },
		"count 0":  func(h *bpf.XdpaggHdr, b []byte) []byte { h.Count = 0; return b[:bpf.HdrSize] },
		"count > K": func(h *bpf.XdpaggHdr, b []byte) []byte {
			h.Count = uint16(bpf.MaxValues + 1)
			return make([]byte, MaxPacket+4)
		},
		"length short":   func(h *bpf.XdpaggHdr, b []byte) []byte { return b[:len(b)-1] },
		"length long":    func(h *bpf.XdpaggHdr, b []byte) []byte { return append(b, 0, 0, 0, 0) },
		"count lies":     func(h *bpf.XdpaggHdr, b []byte) []byte { h.Count = 4; return b },
		"encoding":       func(h *bpf.XdpaggHdr, b []byte) []byte { h.Encoding = 3; return b },
		"job 0":          func(h *bpf.XdpaggHdr, b []byte) []byte { h.JobId = 0; return b },
		"fan-in 0":       func(h *bpf.XdpaggHdr, b []byte) []byte { h.FanIn0 = 0; return b },
		"fan-in 33":      func(h *bpf.XdpaggHdr, b []byte) []byte { h.FanIn0 = 33; return b },
		"bitmap 0":       func(h *bpf.XdpaggHdr, b []byte) []byte { h.Bitmap0 = 0; return b },
		"bit >= fan-in":  func(h *bpf.XdpaggHdr, b []byte) []byte { h.Bitmap0 = 1 << 4; return b },
		"level-1 bitmap": func(h *bpf.XdpaggHdr, b []byte) []byte { h.Flags = fLevel1; h.FanIn1 = 2; h.Bitmap1 = 4; return b },
		"level-1 fan-in": func(h *bpf.XdpaggHdr, b []byte) []byte { h.Flags = fLevel1; h.FanIn1 = 0; h.Bitmap1 = 1; return b },
	}
	for name, mutate := range bad {
		h, b := validData(5)
		b = mutate(&h, b)
		if len(b) >= bpf.HdrSize {
			EncodeHeader(b, &h)
		}
		if _, _, err := ParsePacket(b); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: err = %v, want ErrMalformed", name, err)
		}
	}
}

func FuzzParsePacket(f *testing.F) {
	for _, n := range []int{1, 5, bpf.MaxValues} {
		_, b := validData(n)
		f.Add(b)
		f.Add(b[:len(b)-1])
		f.Add(append(b, 1))
	}
	_, b := validData(2)
	res := append([]byte(nil), b...)
	res[offType] = msgResult
	f.Add(res)
	ctl := append([]byte(nil), b[:bpf.HdrSize]...)
	ctl[offType] = uint8(bpf.XdpaggMsgTypeMSG_HEARTBEAT)
	f.Add(ctl)
	f.Add([]byte{})
	f.Add(make([]byte, bpf.HdrSize))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, vals, err := ParsePacket(b)
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("error %v does not wrap ErrMalformed", err)
			}
			return
		}
		if h.Type == msgData || h.Type == msgResult {
			if len(vals) != 4*int(h.Count) || h.Count == 0 || int(h.Count) > bpf.MaxValues {
				t.Fatalf("accepted count %d with %d value bytes", h.Count, len(vals))
			}
		}
		// Round trip: the packet is exactly its parsed header followed by its values.
		out := make([]byte, bpf.HdrSize, bpf.HdrSize+len(vals))
		EncodeHeader(out, &h)
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
