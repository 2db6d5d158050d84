//go:build linux

package capacity

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"

	"github.com/xdpagg/xdpagg/wire"
)

// Frame layout of an xdpagg packet: Ethernet, IPv4 without options, UDP, xdpagg header, values.
const (
	offIP   = 14
	offUDP  = offIP + 20
	offHdr  = offUDP + 8
	offVals = offHdr + wire.HdrSize
)

// endpoints are the addresses of a frame.
type endpoints struct {
	dstMAC, srcMAC   net.HardwareAddr
	srcIP, dstIP     netip.Addr
	srcPort, dstPort uint16
}

// udpFrame builds an Ethernet/IPv4/UDP frame around payload, with a valid IPv4 header checksum
// and UDP checksum 0 (none), as workers on veth send them.
func udpFrame(e endpoints, payload []byte) ([]byte, error) {
	if len(e.dstMAC) != 6 || len(e.srcMAC) != 6 || !e.srcIP.Is4() || !e.dstIP.Is4() {
		return nil, fmt.Errorf("frame endpoints %v -> %v, %v -> %v: need MACs and IPv4 addresses",
			e.srcMAC, e.dstMAC, e.srcIP, e.dstIP)
	}
	ipLen := 20 + 8 + len(payload)
	if ipLen > 0xffff {
		return nil, fmt.Errorf("payload of %d bytes does not fit an IPv4 datagram", len(payload))
	}
	b := make([]byte, 0, offIP+ipLen)
	b = append(b, e.dstMAC...)
	b = append(b, e.srcMAC...)
	b = binary.BigEndian.AppendUint16(b, 0x0800)

	ip := make([]byte, 20)
	ip[0] = 4<<4 | 5
	binary.BigEndian.PutUint16(ip[2:], uint16(ipLen))
	binary.BigEndian.PutUint16(ip[4:], 0x5eed)
	ip[8] = 64 // TTL
	ip[9] = 17 // UDP
	src, dst := e.srcIP.As4(), e.dstIP.As4()
	copy(ip[12:], src[:])
	copy(ip[16:], dst[:])
	var sum uint32
	for i := 0; i < len(ip); i += 2 {
		sum += uint32(binary.BigEndian.Uint16(ip[i:]))
	}
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	binary.BigEndian.PutUint16(ip[10:], ^uint16(sum))
	b = append(b, ip...)

	b = binary.BigEndian.AppendUint16(b, e.srcPort)
	b = binary.BigEndian.AppendUint16(b, e.dstPort)
	b = binary.BigEndian.AppendUint16(b, uint16(8+len(payload)))
	b = binary.BigEndian.AppendUint16(b, 0)
	return append(b, payload...), nil
}

// xdpaggPayload is the UDP payload of an xdpagg packet: the header (little-endian) and values.
func xdpaggPayload(h wire.Header, vals []int32) ([]byte, error) {
	b := wire.AppendHeader(make([]byte, 0, wire.HdrSize+4*len(vals)), &h)
	for _, v := range vals {
		b = binary.LittleEndian.AppendUint32(b, uint32(v))
	}
	return b, nil
}

// gradient returns n fixed-point values that look like a gradient fragment: mixed signs, small
// enough that 32 of them sum without saturating.
func gradient(n int) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = int32((i*7919)%2001-1000) << 8
	}
	return out
}
