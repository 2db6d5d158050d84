package wire

import "net/netip"

// The switch's maps keep IPv4 addresses and UDP ports as they appear in packet headers (network
// byte order) in fields that bpf2go exposes as host-order (little-endian) integers, so the datapath
// compares them with the packet's without swapping. These helpers convert between those fields
// and netip values.

// IPv4ToMap returns the uint32 whose in-memory (little-endian) bytes are the IPv4 address a in
// network order: what a map field holding a __be32 address wants. a must be an IPv4 (or
// IPv4-mapped IPv6) address: it panics otherwise, like netip.Addr.As4.
func IPv4ToMap(a netip.Addr) uint32 {
	b := a.As4()
	return uint32(b[0]) | uint32(b[1])<<8 | uint32(b[2])<<16 | uint32(b[3])<<24
}

// IPv4FromMap is IPv4ToMap's inverse.
func IPv4FromMap(v uint32) netip.Addr {
	return netip.AddrFrom4([4]byte{byte(v), byte(v >> 8), byte(v >> 16), byte(v >> 24)})
}

// PortToMap converts a host-order UDP port to the network-order value a map's __be16 port field
// holds as a host-order integer (a byte swap on little-endian hosts, which every xdpagg host is).
func PortToMap(p uint16) uint16 { return p>>8 | p<<8 }

// PortFromMap is PortToMap's inverse (the same swap).
func PortFromMap(p uint16) uint16 { return p>>8 | p<<8 }
