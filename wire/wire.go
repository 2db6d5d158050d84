// Package wire is the xdpagg wire format on the host side, in one place and free of Linux: the
// 32-byte header (struct hdr of bpf/xdpagg.h) and its little-endian codec, the rules that make an
// xdpagg UDP payload well formed (ParsePacket, the switch's rules of docs/protocol.md), the
// protocol's constants under Go names, and the byte-order helpers for addresses and ports kept in
// the switch's maps.
//
// The package imports only the standard library, so that it builds anywhere; the bpf package's
// bpf2go types and constants are Linux-only. wire_linux_test.go pins every constant, offset and
// the Header layout to them, and bpf/wire_diff_test.go checks ParsePacket against the XDP switch.
package wire

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"structs"
)

// Protocol limits (enum limit of bpf/xdpagg.h).
const (
	// Version is the only header version there is (XAGG_VERSION).
	Version = uint8(1)
	// DefaultPort is the UDP port of xdpagg traffic unless configured otherwise.
	DefaultPort = uint16(9510)
	// MaxValues is the most 32-bit values one packet may carry (at an MTU of 3388 or more).
	MaxValues = 832
	// StdValues is how many values fill a packet at the standard 1500-byte MTU (K).
	StdValues = 360
	// MaxWorkers is the number of workers one job can have at one aggregation level.
	MaxWorkers = 32
	// HdrSize is the size of the xdpagg header on the wire.
	HdrSize = 32
	// CtlAuthSize is the size of a control message's authentication trailer (struct ctl_auth).
	CtlAuthSize = 24
	// JobKeySize is the size of a job's (and the controller's) control key (struct job_key).
	JobKeySize = 32
	// MaxPacket is the largest xdpagg UDP payload: the header and MaxValues 4-byte values.
	MaxPacket = HdrSize + 4*MaxValues
	// SparseHdrSize is the size of the sparse header (struct sparse_hdr) after the header.
	SparseHdrSize = 8
	// KVPairSize and ColdPairSize are the sizes of a hot pair (struct kv_pair; also struct
	// reg_read in a MSG_PULL answer) and a cold pair (struct cold_pair).
	KVPairSize   = 8
	ColdPairSize = 12
	// SparseMaxPairs and ColdMaxPairs are the most hot and cold pairs a packet may carry (at an
	// MTU of 3388 or more); SparseStdPairs and ColdStdPairs fill a 1500-byte MTU.
	SparseMaxPairs = 415
	SparseStdPairs = 179
	ColdMaxPairs   = 276
	ColdStdPairs   = 119
	// HotMaxValues and HotStdValues are the most hot sums an ENC_SPARSE_HOT update packet may
	// carry (MTU 3388) and what fills a 1500-byte MTU; HotUntouched marks a rank not in it.
	HotMaxValues = 830
	HotStdValues = 358
	HotUntouched = uint32(0xffffffff)
	// SparseMaxPkts is the most hot packets one worker may send the switch for one iteration.
	SparseMaxPkts = 256
	// SparseMaxPasses bounds the passes (1 + recirculations) of a hot packet in the switch.
	SparseMaxPasses = 4
	// RankPlaced marks a hot pair the switch has summed (in packets it hands the PS).
	RankPlaced = uint32(0xffffffff)
	// RegHitsMask is a MSG_PULL answer's hit counter within its hits word; the bit above it,
	// RegThisIter, says the slot holds a sum of the iteration read (struct reg_read).
	RegHitsMask = uint32(0x7fffffff)
	RegThisIter = RegHitsMask + 1
)

// Message types (enum msg_type), typed as Header.Type.
const (
	MsgData       = uint8(1)
	MsgResult     = uint8(2)
	MsgJoin       = uint8(3)
	MsgLeave      = uint8(4)
	MsgReset      = uint8(5)
	MsgAck        = uint8(6)
	MsgRetransmit = uint8(7) // iSwitch's Help request (MsgHelpRequest)
	MsgHeartbeat  = uint8(8)
	MsgPull       = uint8(9)
	MsgHalt       = uint8(10)
	MsgSetH       = uint8(11)
	MsgFBcast     = uint8(12)
	MsgHelp       = uint8(13) // member-assisted Help: the agent's request to a member, and the member's answer
)

// MsgHelpRequest is iSwitch's Help: a worker asks the switch's agent for a result it lost (type 7,
// MSG_RETRANSMIT on the wire). The agent answers from its retransmit cache, else asks the job's
// other members (MsgHelp).
const MsgHelpRequest = MsgRetransmit

// Member-assisted Help (MsgHelp) answers: a result travels in parts of at most HelpPartValues
// values, each after a HelpBodySize-byte body (struct help_body: total u16, offset u16, reserved
// u32), so that body and authentication trailer still fit the MTU the result was cut for.
const (
	HelpPartValues = 256
	HelpBodySize   = 8
)

// Value encodings (enum encoding), typed as Header.Encoding.
const (
	EncFixed32    = uint8(0)
	EncFloat32    = uint8(1)
	EncSparseKV   = uint8(2) // hot pairs: DATA (worker -> switch) and MSG_PULL
	EncSparseCold = uint8(3) // cold pairs: DATA (worker -> PS) and RESULT (the PS's update)
	EncSparseHot  = uint8(4) // hot sums by rank: RESULT (the PS's update)
)

// Header flags (enum flag), typed as Header.Flags.
const (
	FlagResend     = uint16(1 << 0)
	FlagCollision  = uint16(1 << 1)
	FlagECN        = uint16(1 << 2)
	FlagOverflow   = uint16(1 << 3)
	FlagLevel1     = uint16(1 << 4)
	FlagFromSwitch = uint16(1 << 5)
	FlagShadow     = uint16(1 << 6)
	FlagCached     = uint16(1 << 7)
	FlagRehash     = uint16(1 << 8)
	FlagSparseDone = uint16(1 << 9)
	FlagPending    = uint16(1 << 10)
)

// Byte offsets of struct hdr's fields. The header is little-endian throughout, so the switch adds
// values without byte swaps; TestHeaderLayout pins these offsets to bpf.XdpaggHdr.
const (
	OffVersion  = 0
	OffType     = 1
	OffEncoding = 2
	OffScale    = 3
	OffFlags    = 4
	OffCount    = 6
	OffJob      = 8
	OffSeq      = 12
	OffAggIndex = 16
	OffBitmap0  = 20
	OffBitmap1  = 24
	OffFanIn0   = 28
	OffFanIn1   = 29
	OffWorkerID = 30
	OffReserved = 31
)

// Header is struct hdr of bpf/xdpagg.h: the same fields, names, types and layout as bpf2go's
// bpf.XdpaggHdr (wire_linux_test.go checks it), which stays Linux-only. Go does not convert one to
// the other (their blank HostLayout fields belong to different packages): code that has a
// bpf.XdpaggHdr copies it field by field or goes through the wire encoding.
type Header struct {
	_         structs.HostLayout
	Version   uint8
	Type      uint8
	Encoding  uint8
	ScaleLog2 uint8
	Flags     uint16
	Count     uint16
	JobId     uint32
	Seq       uint32
	AggIndex  uint32
	Bitmap0   uint32
	Bitmap1   uint32
	FanIn0    uint8
	FanIn1    uint8
	WorkerId  uint8
	Reserved  uint8
}

// LevelBits returns the contributor bitmap and fan-in of the aggregation level a DATA packet
// belongs to: bitmap1/fan_in1 for partial sums from first-level switches (F_LEVEL1), else level 0.
func (h *Header) LevelBits() (bitmap uint32, fanIn uint8) {
	if h.Flags&FlagLevel1 != 0 {
		return h.Bitmap1, h.FanIn1
	}
	return h.Bitmap0, h.FanIn0
}

// EncodeHeader writes h into dst[:HdrSize] in wire order (little-endian, C offsets). It panics if
// dst is shorter, like binary.LittleEndian.PutUint32.
func EncodeHeader(dst []byte, h *Header) {
	_ = dst[HdrSize-1] // one bounds check for all the stores below
	dst[OffVersion] = h.Version
	dst[OffType] = h.Type
	dst[OffEncoding] = h.Encoding
	dst[OffScale] = h.ScaleLog2
	binary.LittleEndian.PutUint16(dst[OffFlags:], h.Flags)
	binary.LittleEndian.PutUint16(dst[OffCount:], h.Count)
	binary.LittleEndian.PutUint32(dst[OffJob:], h.JobId)
	binary.LittleEndian.PutUint32(dst[OffSeq:], h.Seq)
	binary.LittleEndian.PutUint32(dst[OffAggIndex:], h.AggIndex)
	binary.LittleEndian.PutUint32(dst[OffBitmap0:], h.Bitmap0)
	binary.LittleEndian.PutUint32(dst[OffBitmap1:], h.Bitmap1)
	dst[OffFanIn0] = h.FanIn0
	dst[OffFanIn1] = h.FanIn1
	dst[OffWorkerID] = h.WorkerId
	dst[OffReserved] = h.Reserved
}

// AppendHeader appends h in wire order to dst.
func AppendHeader(dst []byte, h *Header) []byte {
	n := len(dst)
	dst = append(dst, make([]byte, HdrSize)...)
	EncodeHeader(dst[n:], h)
	return dst
}

// DecodeHeader is EncodeHeader's inverse: it reads b[:HdrSize] into h, checking nothing. It panics
// if b is shorter.
func DecodeHeader(b []byte, h *Header) {
	_ = b[HdrSize-1]
	h.Version = b[OffVersion]
	h.Type = b[OffType]
	h.Encoding = b[OffEncoding]
	h.ScaleLog2 = b[OffScale]
	h.Flags = binary.LittleEndian.Uint16(b[OffFlags:])
	h.Count = binary.LittleEndian.Uint16(b[OffCount:])
	h.JobId = binary.LittleEndian.Uint32(b[OffJob:])
	h.Seq = binary.LittleEndian.Uint32(b[OffSeq:])
	h.AggIndex = binary.LittleEndian.Uint32(b[OffAggIndex:])
	h.Bitmap0 = binary.LittleEndian.Uint32(b[OffBitmap0:])
	h.Bitmap1 = binary.LittleEndian.Uint32(b[OffBitmap1:])
	h.FanIn0 = b[OffFanIn0]
	h.FanIn1 = b[OffFanIn1]
	h.WorkerId = b[OffWorkerID]
	h.Reserved = b[OffReserved]
}

// PacketFlags returns the flags of the encoded header at the start of b; SetPacketFlags rewrites
// them in place. Both panic if b is shorter than the flags field.
func PacketFlags(b []byte) uint16 { return binary.LittleEndian.Uint16(b[OffFlags:]) }

// SetPacketFlags stores fl as the flags of the encoded header at the start of b.
func SetPacketFlags(b []byte, fl uint16) { binary.LittleEndian.PutUint16(b[OffFlags:], fl) }

// ErrMalformed is what every ParsePacket error wraps.
var ErrMalformed = errors.New("malformed xdpagg packet")

// ParsePacket's errors, made once: parsing sits on every receive path, and a flood of garbage must
// not turn into a flood of allocations. Each wraps ErrMalformed.
var (
	ErrShort    = fmt.Errorf("%w: shorter than the %d-byte header", ErrMalformed, HdrSize)
	ErrVersion  = fmt.Errorf("%w: unknown version (want %d)", ErrMalformed, Version)
	ErrReserved = fmt.Errorf("%w: reserved byte is not 0", ErrMalformed)
	ErrType     = fmt.Errorf("%w: unknown or reserved message type", ErrMalformed)
	ErrCount    = fmt.Errorf("%w: count outside 1..%d", ErrMalformed, MaxValues)
	ErrLength   = fmt.Errorf("%w: length disagrees with count", ErrMalformed)
	// ErrEncoding is the one error after which the header's lengths are known good and its
	// sender's identity (job, worker id) can still be checked: the PS tells it apart
	// ("unsupported" rather than "malformed").
	ErrEncoding = fmt.Errorf("%w: unknown or reserved encoding", ErrMalformed)
	ErrJob      = fmt.Errorf("%w: job id 0", ErrMalformed)
	ErrFanIn    = fmt.Errorf("%w: fan-in outside 1..%d", ErrMalformed, MaxWorkers)
	ErrBitmap   = fmt.Errorf("%w: contributor bitmap empty or beyond the fan-in", ErrMalformed)
	// ErrSparseCount: more pairs than a packet may carry, or a PULL for none.
	ErrSparseCount = fmt.Errorf("%w: sparse pair count out of range", ErrMalformed)
	// ErrNpkts: a sparse header whose packet count disagrees with the packet's index or type.
	ErrNpkts = fmt.Errorf("%w: sparse packet count or index out of range", ErrMalformed)
)

// KnownType reports whether t is a message type the switch acts on: DATA, RESULT and PULL, which
// it handles, and JOIN, LEAVE, RESET, HALT, SETH, FBCAST, ACK, RETRANSMIT (Help), HEARTBEAT and
// HELP, which it passes to its agent. Every other value is malformed.
func KnownType(t uint8) bool {
	switch t {
	case MsgData, MsgResult, MsgJoin, MsgLeave, MsgReset, MsgAck, MsgRetransmit, MsgHeartbeat, MsgPull, MsgHalt, MsgSetH, MsgFBcast, MsgHelp:
		return true
	}
	return false
}

// KnownEncoding reports whether e is an encoding DATA, RESULT or PULL may carry.
func KnownEncoding(e uint8) bool { return e <= EncSparseHot }

// Sparse reports whether e is one of the sparse encodings, whose payload starts with a
// SparseHeader.
func Sparse(e uint8) bool { return e == EncSparseKV || e == EncSparseCold || e == EncSparseHot }

// SparseHeader is struct sparse_hdr: what sparse packets carry after the header.
type SparseHeader struct {
	_          structs.HostLayout
	HotVersion uint32
	Npkts      uint16
	Spilled    uint16
}

// EncodeSparseHeader writes sh into dst[:SparseHdrSize]; DecodeSparseHeader reads it. Both panic
// if the slice is shorter.
func EncodeSparseHeader(dst []byte, sh *SparseHeader) {
	_ = dst[SparseHdrSize-1]
	binary.LittleEndian.PutUint32(dst[0:], sh.HotVersion)
	binary.LittleEndian.PutUint16(dst[4:], sh.Npkts)
	binary.LittleEndian.PutUint16(dst[6:], sh.Spilled)
}

// DecodeSparseHeader reads a sparse header from b[:SparseHdrSize].
func DecodeSparseHeader(b []byte, sh *SparseHeader) {
	_ = b[SparseHdrSize-1]
	sh.HotVersion = binary.LittleEndian.Uint32(b[0:])
	sh.Npkts = binary.LittleEndian.Uint16(b[4:])
	sh.Spilled = binary.LittleEndian.Uint16(b[6:])
}

// PutKV writes hot pair i (rank, fixed-point value) into pairs, the bytes after the sparse header;
// KV reads it. In a MSG_PULL answer the same 8 bytes are a struct reg_read: KV's rank is then the
// sum's bits and its value the hits word's (use RegRead).
func PutKV(pairs []byte, i int, rank uint32, v int32) {
	binary.LittleEndian.PutUint32(pairs[i*KVPairSize:], rank)
	binary.LittleEndian.PutUint32(pairs[i*KVPairSize+4:], uint32(v))
}

// KV reads hot pair i.
func KV(pairs []byte, i int) (rank uint32, v int32) {
	return binary.LittleEndian.Uint32(pairs[i*KVPairSize:]), int32(binary.LittleEndian.Uint32(pairs[i*KVPairSize+4:]))
}

// RegRead reads slot i of a MSG_PULL answer: the fixed-point sum, the slot's hit counter (31
// bits) and whether some worker's pair was summed there in the iteration read (the sum may be 0).
func RegRead(pairs []byte, i int) (sum int32, hits uint32, touched bool) {
	w := binary.LittleEndian.Uint32(pairs[i*KVPairSize+4:])
	return int32(binary.LittleEndian.Uint32(pairs[i*KVPairSize:])), w & RegHitsMask, w&RegThisIter != 0
}

// PutCold writes cold pair i (key, float32 bits) into pairs; Cold reads it.
func PutCold(pairs []byte, i int, key uint64, bits uint32) {
	binary.LittleEndian.PutUint64(pairs[i*ColdPairSize:], key)
	binary.LittleEndian.PutUint32(pairs[i*ColdPairSize+8:], bits)
}

// Cold reads cold pair i.
func Cold(pairs []byte, i int) (key uint64, bits uint32) {
	return binary.LittleEndian.Uint64(pairs[i*ColdPairSize:]), binary.LittleEndian.Uint32(pairs[i*ColdPairSize+8:])
}

// ParsePacket parses one xdpagg UDP payload and checks it as the switch does (parse_l4 in
// bpf/parse.h, handle_data/handle_result in bpf/dense_handlers.h, the type dispatch of
// bpf/xdpagg.c), so a packet
// a host accepts is one the switch would not count malformed, and vice versa:
//
//   - version is Version and the reserved byte is 0;
//   - the type is one KnownType accepts;
//   - dense DATA and RESULT: 1 <= count <= MaxValues, the payload is exactly HdrSize + 4*count
//     bytes (the UDP length the switch checks), the encoding is ENC_FIXED32 or ENC_FLOAT32
//     (ErrEncoding otherwise), and job_id != 0;
//   - dense DATA also: the fan-in of its level (fan_in0, or fan_in1 with F_LEVEL1) is
//     1..MaxWorkers and that level's bitmap is nonzero with no bit at or above the fan-in;
//   - sparse DATA, RESULT and PULL: the encoding fits the type, the pair count its bound, the
//     length the sparse header and pairs exactly, the sparse header's packet count the rules of
//     docs/sparse.md, job_id != 0, and DATA the level rules above.
//
// Control messages (every other known type) get only the first two checks, like the switch, which
// hands them to its agent; their values are the rest of the payload.
//
// agg_index is not checked: only the switch knows its pool size. values aliases b. Every failure
// is one of the Err variables above, each wrapping ErrMalformed; h holds the decoded header
// whenever b was long enough to hold one.
func ParsePacket(b []byte) (h Header, values []byte, err error) {
	if len(b) < HdrSize {
		return h, nil, ErrShort
	}
	DecodeHeader(b, &h)
	if h.Version != Version {
		return h, nil, ErrVersion
	}
	if h.Reserved != 0 {
		return h, nil, ErrReserved
	}
	if !KnownType(h.Type) {
		return h, nil, ErrType
	}
	if h.Type != MsgData && h.Type != MsgResult && h.Type != MsgPull {
		return h, b[HdrSize:], nil
	}
	n := int(h.Count)
	if !Sparse(h.Encoding) && h.Type != MsgPull {
		if n == 0 || n > MaxValues {
			return h, nil, ErrCount
		}
		if len(b) != HdrSize+4*n {
			return h, nil, ErrLength
		}
		if !KnownEncoding(h.Encoding) {
			return h, nil, ErrEncoding
		}
		if h.JobId == 0 {
			return h, nil, ErrJob
		}
		if err := checkLevel(&h); err != nil {
			return h, nil, err
		}
		return h, b[HdrSize:], nil
	}
	// Sparse: hot pairs in DATA and PULL, cold pairs in DATA and RESULT.
	psize, pmax := KVPairSize, SparseMaxPairs
	switch {
	case h.Encoding == EncSparseCold && h.Type != MsgPull:
		psize, pmax = ColdPairSize, ColdMaxPairs
	case h.Encoding == EncSparseHot && h.Type == MsgResult:
		psize, pmax = 4, HotMaxValues
	case h.Encoding == EncSparseKV && h.Type != MsgResult:
	default:
		return h, nil, ErrEncoding
	}
	if n > pmax || (h.Type == MsgPull && n == 0) {
		return h, nil, ErrSparseCount
	}
	if len(b) != HdrSize+SparseHdrSize+psize*n {
		return h, nil, ErrLength
	}
	var sh SparseHeader
	DecodeSparseHeader(b[HdrSize:], &sh)
	if h.Type == MsgPull {
		if sh.Npkts != 0 {
			return h, nil, ErrNpkts
		}
	} else if sh.Npkts == 0 || h.AggIndex >= uint32(sh.Npkts) {
		return h, nil, ErrNpkts
	}
	if h.JobId == 0 {
		return h, nil, ErrJob
	}
	if h.Type != MsgData {
		return h, b[HdrSize:], nil
	}
	if h.Encoding == EncSparseKV && (h.Flags&FlagLevel1 != 0 || sh.Npkts > SparseMaxPkts) {
		return h, nil, ErrNpkts
	}
	if err := checkLevel(&h); err != nil {
		return h, nil, err
	}
	return h, b[HdrSize:], nil
}

// checkLevel applies DATA's contributor rules: the fan-in of its level (fan_in0, or fan_in1 with
// F_LEVEL1) is 1..MaxWorkers and that level's bitmap is nonzero with no bit at or above it.
func checkLevel(h *Header) error {
	if h.Type != MsgData {
		return nil
	}
	bm, fan := h.LevelBits()
	if fan == 0 || int(fan) > MaxWorkers {
		return ErrFanIn
	}
	if bm == 0 || (fan < MaxWorkers && bm>>fan != 0) {
		return ErrBitmap
	}
	return nil
}

// ValuesForMTU is how many values fill one packet at an IPv4 MTU: (MTU - 20 IPv4 - 8 UDP - 32
// header) / 4, capped at MaxValues.
func ValuesForMTU(mtu int) int {
	return max(0, min(MaxValues, (mtu-20-8-HdrSize)/4))
}

// UnicastMAC reports whether mac is a 6-byte Ethernet address a single host can own: not a
// group address (multicast, broadcast: the I/G bit, bit 0 of the first byte) and not all zeros.
// A member's MAC is where the switch sends the job's results (JOIN's body).
func UnicastMAC(mac net.HardwareAddr) bool {
	return len(mac) == 6 && mac[0]&1 == 0 && !bytes.Equal(mac, make(net.HardwareAddr, 6))
}
