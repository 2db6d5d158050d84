package hostlib

import (
	"encoding/binary"
	"fmt"

	"github.com/xdpagg/xdpagg/bpf"
)

// MaxPacket is the largest xdpagg UDP payload: the header and bpf.MaxValues 4-byte values.
const MaxPacket = bpf.HdrSize + 4*bpf.MaxValues

// Byte offsets of struct hdr's fields (bpf/xdpagg.h). The header is little-endian throughout, so
// the switch adds values without byte swaps; TestEncodeHeaderMatchesBinary pins these offsets to
// the generated struct through encoding/binary.
const (
	offVersion  = 0
	offType     = 1
	offEncoding = 2
	offScale    = 3
	offFlags    = 4
	offCount    = 6
	offJob      = 8
	offSeq      = 12
	offAggIndex = 16
	offBitmap0  = 20
	offBitmap1  = 24
	offFanIn0   = 28
	offFanIn1   = 29
	offWorkerID = 30
	offReserved = 31
)

// The C enums as the field types of bpf.XdpaggHdr, so comparisons need no conversions.
const (
	msgData   = uint8(bpf.XdpaggMsgTypeMSG_DATA)
	msgResult = uint8(bpf.XdpaggMsgTypeMSG_RESULT)
	msgLast   = uint8(bpf.XdpaggMsgTypeMSG_HEARTBEAT) // highest known message type

	encFixed32  = uint8(bpf.XdpaggEncodingENC_FIXED32)
	encFloat32  = uint8(bpf.XdpaggEncodingENC_FLOAT32)
	encSparseKV = uint8(bpf.XdpaggEncodingENC_SPARSE_KV) // highest known encoding

	fResend     = uint16(bpf.XdpaggFlagF_RESEND)
	fCollision  = uint16(bpf.XdpaggFlagF_COLLISION)
	fECN        = uint16(bpf.XdpaggFlagF_ECN)
	fOverflow   = uint16(bpf.XdpaggFlagF_OVERFLOW)
	fLevel1     = uint16(bpf.XdpaggFlagF_LEVEL1)
	fFromSwitch = uint16(bpf.XdpaggFlagF_FROM_SWITCH)
	fShadow     = uint16(bpf.XdpaggFlagF_SHADOW)
	fCached     = uint16(bpf.XdpaggFlagF_CACHED)
	fRehash     = uint16(bpf.XdpaggFlagF_REHASH)
)

// Malformed-packet errors, made once: parsing sits on every receive path, and a flood of garbage
// must not turn into a flood of allocations.
var (
	errShort     = fmt.Errorf("%w: shorter than the %d-byte header", ErrMalformed, bpf.HdrSize)
	errVersion   = fmt.Errorf("%w: unknown version (want %d)", ErrMalformed, bpf.Version)
	errReserved  = fmt.Errorf("%w: reserved byte is not 0", ErrMalformed)
	errType      = fmt.Errorf("%w: unknown message type", ErrMalformed)
	errCount     = fmt.Errorf("%w: count outside 1..%d", ErrMalformed, bpf.MaxValues)
	errLength    = fmt.Errorf("%w: length disagrees with count", ErrMalformed)
	errEncoding  = fmt.Errorf("%w: unknown encoding", ErrMalformed)
	errJob       = fmt.Errorf("%w: job id 0", ErrMalformed)
	errFanIn     = fmt.Errorf("%w: fan-in outside 1..%d", ErrMalformed, bpf.MaxWorkers)
	errBitmap    = fmt.Errorf("%w: contributor bitmap empty or beyond the fan-in", ErrMalformed)
	errTruncated = fmt.Errorf("%w: datagram larger than %d bytes", ErrMalformed, MaxPacket)
)

// EncodeHeader writes h into dst[:bpf.HdrSize] in wire order (little-endian, C offsets). It panics
// if dst is shorter, like binary.LittleEndian.PutUint32.
func EncodeHeader(dst []byte, h *bpf.XdpaggHdr) {
	_ = dst[bpf.HdrSize-1] // one bounds check for all the stores below
	dst[offVersion] = h.Version
	dst[offType] = h.Type
	dst[offEncoding] = h.Encoding
	dst[offScale] = h.ScaleLog2
	binary.LittleEndian.PutUint16(dst[offFlags:], h.Flags)
	binary.LittleEndian.PutUint16(dst[offCount:], h.Count)
	binary.LittleEndian.PutUint32(dst[offJob:], h.JobId)
	binary.LittleEndian.PutUint32(dst[offSeq:], h.Seq)
	binary.LittleEndian.PutUint32(dst[offAggIndex:], h.AggIndex)
	binary.LittleEndian.PutUint32(dst[offBitmap0:], h.Bitmap0)
	binary.LittleEndian.PutUint32(dst[offBitmap1:], h.Bitmap1)
	dst[offFanIn0] = h.FanIn0
	dst[offFanIn1] = h.FanIn1
	dst[offWorkerID] = h.WorkerId
	dst[offReserved] = h.Reserved
}

// decodeHeader is EncodeHeader's inverse; b must hold bpf.HdrSize bytes.
func decodeHeader(b []byte, h *bpf.XdpaggHdr) {
	_ = b[bpf.HdrSize-1]
	h.Version = b[offVersion]
	h.Type = b[offType]
	h.Encoding = b[offEncoding]
	h.ScaleLog2 = b[offScale]
	h.Flags = binary.LittleEndian.Uint16(b[offFlags:])
	h.Count = binary.LittleEndian.Uint16(b[offCount:])
	h.JobId = binary.LittleEndian.Uint32(b[offJob:])
	h.Seq = binary.LittleEndian.Uint32(b[offSeq:])
	h.AggIndex = binary.LittleEndian.Uint32(b[offAggIndex:])
	h.Bitmap0 = binary.LittleEndian.Uint32(b[offBitmap0:])
	h.Bitmap1 = binary.LittleEndian.Uint32(b[offBitmap1:])
	h.FanIn0 = b[offFanIn0]
	h.FanIn1 = b[offFanIn1]
	h.WorkerId = b[offWorkerID]
	h.Reserved = b[offReserved]
}

// ParsePacket parses one xdpagg UDP payload and checks it exactly as the switch does (parse and
// handle_data/handle_result in bpf/xdpagg.c), so a packet hostlib accepts is one the switch would
// act on, and vice versa:
//
//   - version is bpf.Version and the reserved byte is 0;
//   - the type is a known message type;
//   - DATA and RESULT: 1 <= count <= bpf.MaxValues, the payload is exactly header + 4*count bytes
//     (the UDP length the switch checks), the encoding is known, and job_id != 0;
//   - DATA also: the fan-in of its level (fan_in0, or fan_in1 with F_LEVEL1) is 1..32 and that
//     level's bitmap is nonzero with no bit at or above the fan-in.
//
// Control messages (JOIN..HEARTBEAT) get only the first two checks, like the switch, which hands
// them to its agent; their values are the rest of the payload.
//
// agg_index is not checked: only the switch knows its pool size (the Worker checks results
// against the index it chose). values aliases b. Every failure wraps ErrMalformed.
func ParsePacket(b []byte) (h bpf.XdpaggHdr, values []byte, err error) {
	if len(b) < bpf.HdrSize {
		return h, nil, errShort
	}
	decodeHeader(b, &h)
	if h.Version != bpf.Version {
		return h, nil, errVersion
	}
	if h.Reserved != 0 {
		return h, nil, errReserved
	}
	if h.Type == 0 || h.Type > msgLast {
		return h, nil, errType
	}
	if h.Type != msgData && h.Type != msgResult {
		return h, b[bpf.HdrSize:], nil
	}
	n := int(h.Count)
	if n == 0 || n > bpf.MaxValues {
		return h, nil, errCount
	}
	if len(b) != bpf.HdrSize+4*n {
		return h, nil, errLength
	}
	if h.Encoding > encSparseKV {
		return h, nil, errEncoding
	}
	if h.JobId == 0 {
		return h, nil, errJob
	}
	if h.Type == msgData {
		bm, fan := levelBits(&h)
		if fan == 0 || int(fan) > bpf.MaxWorkers {
			return h, nil, errFanIn
		}
		if bm == 0 || (fan < 32 && bm>>fan != 0) {
			return h, nil, errBitmap
		}
	}
	return h, b[bpf.HdrSize:], nil
}

// levelBits returns the contributor bitmap and fan-in of the aggregation level a DATA packet
// belongs to: bitmap1/fan_in1 for partial sums from first-level switches (F_LEVEL1), else level 0.
func levelBits(h *bpf.XdpaggHdr) (bitmap uint32, fanIn uint8) {
	if h.Flags&fLevel1 != 0 {
		return h.Bitmap1, h.FanIn1
	}
	return h.Bitmap0, h.FanIn0
}
