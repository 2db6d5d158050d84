//go:build linux

package wire

import (
	"bytes"
	"encoding/binary"
	"math/rand/v2"
	"reflect"
	"testing"
	"unsafe"

	"github.com/xdpagg/xdpagg/bpf"
)

// TestHeaderLayout pins Header, the codec's offsets and sizes to bpf2go's bpf.XdpaggHdr (the C
// struct hdr): same size, and per field the same name, type and offset.
func TestHeaderLayout(t *testing.T) {
	var b bpf.XdpaggHdr
	if unsafe.Sizeof(b) != HdrSize || binary.Size(b) != HdrSize || bpf.HdrSize != HdrSize {
		t.Fatalf("bpf.XdpaggHdr: %d bytes (binary %d, bpf.HdrSize %d), want %d", unsafe.Sizeof(b), binary.Size(b), bpf.HdrSize, HdrSize)
	}
	bt, wt := reflect.TypeOf(b), reflect.TypeOf(Header{})
	if bt.NumField() != wt.NumField() {
		t.Fatalf("bpf.XdpaggHdr has %d fields, Header %d", bt.NumField(), wt.NumField())
	}
	for i := range bt.NumField() {
		bf, wf := bt.Field(i), wt.Field(i)
		if bf.Name != wf.Name || bf.Type.String() != wf.Type.String() || bf.Offset != wf.Offset {
			t.Errorf("field %d: bpf %s %v at %d, wire %s %v at %d", i, bf.Name, bf.Type, bf.Offset, wf.Name, wf.Type, wf.Offset)
		}
	}
	bpfOff := map[string]uintptr{
		"version": unsafe.Offsetof(b.Version), "type": unsafe.Offsetof(b.Type), "encoding": unsafe.Offsetof(b.Encoding),
		"scale_log2": unsafe.Offsetof(b.ScaleLog2), "flags": unsafe.Offsetof(b.Flags), "count": unsafe.Offsetof(b.Count),
		"job_id": unsafe.Offsetof(b.JobId), "seq": unsafe.Offsetof(b.Seq), "agg_index": unsafe.Offsetof(b.AggIndex),
		"bitmap0": unsafe.Offsetof(b.Bitmap0), "bitmap1": unsafe.Offsetof(b.Bitmap1), "fan_in0": unsafe.Offsetof(b.FanIn0),
		"fan_in1": unsafe.Offsetof(b.FanIn1), "worker_id": unsafe.Offsetof(b.WorkerId), "reserved": unsafe.Offsetof(b.Reserved),
	}
	fs := fieldOffsets()
	if len(fs) != len(bpfOff) {
		t.Fatalf("%d codec fields, %d bpf fields", len(fs), len(bpfOff))
	}
	for _, f := range fs {
		if o, ok := bpfOff[f.name]; !ok || o != f.codec {
			t.Errorf("%s: codec offset %d, bpf.XdpaggHdr offset %d", f.name, f.codec, o)
		}
	}
}

// toGenerated copies h field by field.
func toGenerated(h Header) bpf.XdpaggHdr {
	return bpf.XdpaggHdr{Version: h.Version, Type: h.Type, Encoding: h.Encoding, ScaleLog2: h.ScaleLog2,
		Flags: h.Flags, Count: h.Count, JobId: h.JobId, Seq: h.Seq, AggIndex: h.AggIndex,
		Bitmap0: h.Bitmap0, Bitmap1: h.Bitmap1, FanIn0: h.FanIn0, FanIn1: h.FanIn1, WorkerId: h.WorkerId, Reserved: h.Reserved}
}

// The codec encodes a header exactly as encoding/binary encodes the generated struct with the
// same field values, and decodes what encoding/binary makes of it.
func TestCodecMatchesGenerated(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	for range 1000 {
		w := randHdr(r)
		g := toGenerated(w)
		want, err := binary.Append(nil, binary.LittleEndian, &g)
		if err != nil {
			t.Fatal(err)
		}
		got := AppendHeader(nil, &w)
		if !bytes.Equal(got, want) {
			t.Fatalf("%+v:\n got %x\nwant %x", g, got, want)
		}
		var back Header
		DecodeHeader(want, &back)
		if back != w || toGenerated(back) != g {
			t.Fatalf("decode: %+v, want %+v", back, w)
		}
	}
}

// Every constant is the C header's.
func TestConstantsMatchGenerated(t *testing.T) {
	type pair struct {
		name      string
		wire, bpf uint64
	}
	for _, c := range []pair{
		{"Version", uint64(Version), uint64(bpf.Version)},
		{"DefaultPort", uint64(DefaultPort), uint64(bpf.DefaultPort)},
		{"MaxValues", MaxValues, uint64(bpf.MaxValues)},
		{"StdValues", StdValues, uint64(bpf.StdValues)},
		{"MaxWorkers", MaxWorkers, uint64(bpf.MaxWorkers)},
		{"HdrSize", HdrSize, uint64(bpf.HdrSize)},
		{"CtlAuthSize", CtlAuthSize, uint64(bpf.XdpaggLimitLIMIT_CTL_AUTH_SIZE)},
		{"JobKeySize", JobKeySize, uint64(bpf.XdpaggLimitLIMIT_JOB_KEY_SIZE)},
		{"JobKeySize (struct)", JobKeySize, uint64(unsafe.Sizeof(bpf.XdpaggJobKey{}))},
		{"MsgData", uint64(MsgData), uint64(bpf.XdpaggMsgTypeMSG_DATA)},
		{"MsgResult", uint64(MsgResult), uint64(bpf.XdpaggMsgTypeMSG_RESULT)},
		{"MsgJoin", uint64(MsgJoin), uint64(bpf.XdpaggMsgTypeMSG_JOIN)},
		{"MsgLeave", uint64(MsgLeave), uint64(bpf.XdpaggMsgTypeMSG_LEAVE)},
		{"MsgReset", uint64(MsgReset), uint64(bpf.XdpaggMsgTypeMSG_RESET)},
		{"MsgAck", uint64(MsgAck), uint64(bpf.XdpaggMsgTypeMSG_ACK)},
		{"MsgRetransmit", uint64(MsgRetransmit), uint64(bpf.XdpaggMsgTypeMSG_RETRANSMIT)},
		{"MsgHeartbeat", uint64(MsgHeartbeat), uint64(bpf.XdpaggMsgTypeMSG_HEARTBEAT)},
		{"EncFixed32", uint64(EncFixed32), uint64(bpf.XdpaggEncodingENC_FIXED32)},
		{"EncFloat32", uint64(EncFloat32), uint64(bpf.XdpaggEncodingENC_FLOAT32)},
		{"EncSparseKV", uint64(EncSparseKV), uint64(bpf.XdpaggEncodingENC_SPARSE_KV)},
		{"FlagResend", uint64(FlagResend), uint64(bpf.XdpaggFlagF_RESEND)},
		{"FlagCollision", uint64(FlagCollision), uint64(bpf.XdpaggFlagF_COLLISION)},
		{"FlagECN", uint64(FlagECN), uint64(bpf.XdpaggFlagF_ECN)},
		{"FlagOverflow", uint64(FlagOverflow), uint64(bpf.XdpaggFlagF_OVERFLOW)},
		{"FlagLevel1", uint64(FlagLevel1), uint64(bpf.XdpaggFlagF_LEVEL1)},
		{"FlagFromSwitch", uint64(FlagFromSwitch), uint64(bpf.XdpaggFlagF_FROM_SWITCH)},
		{"FlagShadow", uint64(FlagShadow), uint64(bpf.XdpaggFlagF_SHADOW)},
		{"FlagCached", uint64(FlagCached), uint64(bpf.XdpaggFlagF_CACHED)},
		{"FlagRehash", uint64(FlagRehash), uint64(bpf.XdpaggFlagF_REHASH)},
		{"FlagSparseDone", uint64(FlagSparseDone), uint64(bpf.XdpaggFlagF_SPARSE_DONE)},
		{"FlagPending", uint64(FlagPending), uint64(bpf.XdpaggFlagF_PENDING)},
		{"MsgPull", uint64(MsgPull), uint64(bpf.XdpaggMsgTypeMSG_PULL)},
		{"MsgHalt", uint64(MsgHalt), uint64(bpf.XdpaggMsgTypeMSG_HALT)},
		{"MsgSetH", uint64(MsgSetH), uint64(bpf.XdpaggMsgTypeMSG_SETH)},
		{"MsgFBcast", uint64(MsgFBcast), uint64(bpf.XdpaggMsgTypeMSG_FBCAST)},
		{"MsgHelp", uint64(MsgHelp), uint64(bpf.XdpaggMsgTypeMSG_HELP)},
		{"HelpPartValues", HelpPartValues, uint64(bpf.XdpaggLimitLIMIT_HELP_PART_VALUES)},
		{"HelpBodySize", HelpBodySize, uint64(bpf.XdpaggLimitLIMIT_HELP_BODY_SIZE)},
		{"HelpBodySize (struct)", HelpBodySize, uint64(unsafe.Sizeof(bpf.XdpaggHelpBody{}))},
		{"EncSparseCold", uint64(EncSparseCold), uint64(bpf.XdpaggEncodingENC_SPARSE_COLD)},
		{"EncSparseHot", uint64(EncSparseHot), uint64(bpf.XdpaggEncodingENC_SPARSE_HOT)},
		{"HotMaxValues", HotMaxValues, uint64(bpf.XdpaggLimitLIMIT_HOT_MAX_VALUES)},
		{"HotStdValues", HotStdValues, uint64(bpf.XdpaggLimitLIMIT_HOT_STD_VALUES)},
		{"HotStdValues fills 1500", uint64(1500-28-HdrSize-SparseHdrSize) / 4, HotStdValues},
		{"HotMaxValues fills 3388", uint64(3388-28-HdrSize-SparseHdrSize) / 4, HotMaxValues},
		{"SparseHdrSize", SparseHdrSize, uint64(bpf.XdpaggLimitLIMIT_SPARSE_HDR_SIZE)},
		{"SparseHdrSize (struct)", SparseHdrSize, uint64(unsafe.Sizeof(bpf.XdpaggSparseHdr{}))},
		{"KVPairSize", KVPairSize, uint64(unsafe.Sizeof(bpf.XdpaggKvPair{}))},
		{"KVPairSize (reg_read)", KVPairSize, uint64(unsafe.Sizeof(bpf.XdpaggRegRead{}))},
		{"ColdPairSize", ColdPairSize, uint64(unsafe.Sizeof(bpf.XdpaggColdPair{}))},
		{"SparseMaxPairs", SparseMaxPairs, uint64(bpf.XdpaggLimitLIMIT_SPARSE_MAX_PAIRS)},
		{"SparseStdPairs", SparseStdPairs, uint64(bpf.XdpaggLimitLIMIT_SPARSE_STD_PAIRS)},
		{"ColdMaxPairs", ColdMaxPairs, uint64(bpf.XdpaggLimitLIMIT_COLD_MAX_PAIRS)},
		{"ColdStdPairs", ColdStdPairs, uint64(bpf.XdpaggLimitLIMIT_COLD_STD_PAIRS)},
		{"SparseMaxPkts", SparseMaxPkts, uint64(bpf.XdpaggLimitLIMIT_SPARSE_MAX_PKTS)},
		{"SparseMaxPasses", SparseMaxPasses, uint64(bpf.XdpaggLimitLIMIT_SPARSE_MAX_PASSES)},
		{"RegHitsMask", uint64(RegHitsMask), uint64(bpf.XdpaggLimitLIMIT_REG_HITS_MASK)},
		{"SparseStdPairs fills 1500", uint64(1500-28-HdrSize-SparseHdrSize) / KVPairSize, SparseStdPairs},
		{"ColdStdPairs fills 1500", uint64(1500-28-HdrSize-SparseHdrSize) / ColdPairSize, ColdStdPairs},
		{"SparseMaxPairs fills 3388", uint64(3388-28-HdrSize-SparseHdrSize) / KVPairSize, SparseMaxPairs},
		{"ColdMaxPairs fills 3388", uint64(3388-28-HdrSize-SparseHdrSize) / ColdPairSize, ColdMaxPairs},
	} {
		if c.wire != c.bpf {
			t.Errorf("wire.%s = %d, C header says %d", c.name, c.wire, c.bpf)
		}
	}
}

func TestValuesForMTUMatchesBPF(t *testing.T) {
	for _, mtu := range []int{0, 60, 68, 576, 1500, 3388, 9000} {
		if ValuesForMTU(mtu) != bpf.ValuesForMTU(mtu) {
			t.Errorf("ValuesForMTU(%d) = %d, bpf says %d", mtu, ValuesForMTU(mtu), bpf.ValuesForMTU(mtu))
		}
	}
}
