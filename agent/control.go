package agent

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"

	"github.com/cilium/ebpf"
	"golang.org/x/net/ipv4"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/maps"
)

// ControlServer answers control messages (iSwitch's Join/Leave) that the XDP program passes up:
// a JOIN registers the sender as a member of its job behind the port it arrived on, so results
// reach it; LEAVE removes it. Every handled message is acknowledged with MSG_ACK.
type ControlServer struct {
	conn  *ipv4.PacketConn
	raw   net.PacketConn
	maps  *maps.Maps
	log   *slog.Logger
	ports map[int]net.HardwareAddr // attached ifindex -> port MAC
	cache *ResultCache             // nil: no retransmit cache (RETRANSMIT answered as a miss)
}

// SetCache makes the server answer MSG_RETRANSMIT from c and feed it workers' MSG_ACKs. Call
// before Serve.
func (c *ControlServer) SetCache(rc *ResultCache) { c.cache = rc }

// ListenControl opens the control socket on the xdpagg port of every local address. ports maps
// the switch ports' ifindexes to their MACs; messages arriving elsewhere are ignored.
func ListenControl(port uint16, m *maps.Maps, ports map[int]net.HardwareAddr, log *slog.Logger) (*ControlServer, error) {
	raw, err := net.ListenPacket("udp4", fmt.Sprintf("0.0.0.0:%d", port))
	if err != nil {
		return nil, fmt.Errorf("listen for control messages on port %d: %w", port, err)
	}
	pc := ipv4.NewPacketConn(raw)
	if err := pc.SetControlMessage(ipv4.FlagInterface|ipv4.FlagDst, true); err != nil {
		raw.Close()
		return nil, fmt.Errorf("enable IP_PKTINFO: %w", err)
	}
	return &ControlServer{conn: pc, raw: raw, maps: m, log: log, ports: ports}, nil
}

// Close stops the server.
func (c *ControlServer) Close() error { return c.raw.Close() }

// Serve handles messages until ctx is done or the socket is closed.
func (c *ControlServer) Serve(ctx context.Context) error {
	go func() {
		<-ctx.Done()
		c.raw.Close()
	}()
	buf := make([]byte, 2048)
	for {
		n, cm, src, err := c.conn.ReadFrom(buf)
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return nil
			}
			return fmt.Errorf("read control socket: %w", err)
		}
		ua, ok := src.(*net.UDPAddr)
		if !ok || cm == nil {
			continue
		}
		from := ua.AddrPort()
		from = netip.AddrPortFrom(from.Addr().Unmap(), from.Port())
		if err := c.handle(buf[:n], cm.IfIndex, from); err != nil {
			c.log.Warn("control message rejected", "from", from, "ifindex", cm.IfIndex, "err", err)
		}
	}
}

var errBadControl = errors.New("malformed control message")

func msgName(t uint8) string {
	switch bpf.XdpaggMsgType(t) {
	case bpf.XdpaggMsgTypeMSG_RETRANSMIT:
		return "RETRANSMIT"
	case bpf.XdpaggMsgTypeMSG_ACK:
		return "ACK"
	case bpf.XdpaggMsgTypeMSG_LEAVE:
		return "LEAVE"
	}
	return fmt.Sprintf("type %d", t)
}

// checkSender verifies that the member of h's job behind ifindex is worker h.WorkerId at from.
// With no member there, the error wraps ebpf.ErrKeyNotExist.
func (c *ControlServer) checkSender(h *bpf.XdpaggHdr, ifindex int, from netip.AddrPort) error {
	m, err := c.maps.Member(h.JobId, uint32(ifindex))
	if err != nil {
		return fmt.Errorf("%w: %s from a non-member of job %d on ifindex %d: %w", errBadControl, msgName(h.Type), h.JobId, ifindex, err)
	}
	if m.WorkerID != h.WorkerId || m.Addr != from {
		return fmt.Errorf("%w: %s claims worker %d of job %d from %v", errBadControl, msgName(h.Type), h.WorkerId, h.JobId, from)
	}
	return nil
}

func (c *ControlServer) handle(b []byte, ifindex int, from netip.AddrPort) error {
	var h bpf.XdpaggHdr
	if len(b) < bpf.HdrSize {
		return fmt.Errorf("%w: %d bytes", errBadControl, len(b))
	}
	if _, err := binary.Decode(b[:bpf.HdrSize], binary.LittleEndian, &h); err != nil {
		return fmt.Errorf("%w: %w", errBadControl, err)
	}
	if h.Version != bpf.Version || h.JobId == 0 {
		return fmt.Errorf("%w: version %d job %d", errBadControl, h.Version, h.JobId)
	}
	if h.Reserved != 0 || h.Count != 0 {
		return fmt.Errorf("%w: reserved %d, count %d: control messages carry neither", errBadControl, h.Reserved, h.Count)
	}
	portMAC, ok := c.ports[ifindex]
	if !ok {
		return fmt.Errorf("%w: arrived on ifindex %d, not a switch port", errBadControl, ifindex)
	}
	switch bpf.XdpaggMsgType(h.Type) {
	case bpf.XdpaggMsgTypeMSG_JOIN, bpf.XdpaggMsgTypeMSG_LEAVE:
		var body bpf.XdpaggJoinBody
		if _, err := binary.Decode(b[bpf.HdrSize:], binary.LittleEndian, &body); err != nil {
			return fmt.Errorf("%w: join body: %w", errBadControl, err)
		}
		if body.Reserved != 0 {
			return fmt.Errorf("%w: join body reserved %#x, must be 0", errBadControl, body.Reserved)
		}
		if bpf.XdpaggMsgType(h.Type) == bpf.XdpaggMsgTypeMSG_LEAVE {
			// Only the member itself may leave; a resent LEAVE finds none.
			if err := c.checkSender(&h, ifindex, from); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
				return err
			}
			// A resent LEAVE (its ACK was lost) finds the member gone: acknowledge it again.
			if err := c.maps.DeleteMember(h.JobId, uint32(ifindex)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
				return err
			}
			c.log.Info("worker left", "job", h.JobId, "worker", h.WorkerId, "addr", from)
			break
		}
		rip := body.ResultIp
		m := maps.Member{
			JobID: h.JobId, WorkerID: h.WorkerId, Ifindex: uint32(ifindex), Addr: from,
			MAC: net.HardwareAddr(body.Mac[:]), PortMAC: portMAC,
			SrcIP: netip.AddrFrom4([4]byte{byte(rip), byte(rip >> 8), byte(rip >> 16), byte(rip >> 24)}),
		}
		if err := c.maps.PutMember(m); err != nil {
			return err
		}
		c.log.Info("worker joined", "job", h.JobId, "worker", h.WorkerId, "addr", from, "ifindex", ifindex, "mac", m.MAC)
	case bpf.XdpaggMsgTypeMSG_RETRANSMIT, bpf.XdpaggMsgTypeMSG_ACK:
		// Only a member may ask for (or acknowledge) its job's results, from where it joined.
		if err := c.checkSender(&h, ifindex, from); err != nil {
			return err
		}
		if bpf.XdpaggMsgType(h.Type) == bpf.XdpaggMsgTypeMSG_ACK {
			if c.cache != nil {
				c.cache.Ack(h.JobId, h.WorkerId, h.Seq) // cumulative: every result before seq
			}
			return nil // acknowledgements are not acknowledged
		}
		if c.cache != nil {
			if pkt, ok := c.cache.Get(h.JobId, h.Seq); ok {
				out := append([]byte(nil), pkt...)
				fl := binary.LittleEndian.Uint16(out[4:6]) | uint16(bpf.XdpaggFlagF_CACHED)
				binary.LittleEndian.PutUint16(out[4:6], fl)
				if _, err := c.raw.WriteTo(out, net.UDPAddrFromAddrPort(from)); err != nil {
					return fmt.Errorf("send cached result: %w", err)
				}
				return nil
			}
		}
		// A miss is answered with ACK (same job and seq), so the worker resends its data at once
		// instead of waiting for a timeout.
	default:
		return fmt.Errorf("%w: type %d not handled by the agent", errBadControl, h.Type)
	}
	ack := bpf.XdpaggHdr{Version: bpf.Version, Type: uint8(bpf.XdpaggMsgTypeMSG_ACK), JobId: h.JobId, Seq: h.Seq, WorkerId: h.WorkerId}
	out, err := binary.Append(nil, binary.LittleEndian, &ack)
	if err != nil {
		return fmt.Errorf("encode ack: %w", err)
	}
	if _, err := c.raw.WriteTo(out, net.UDPAddrFromAddrPort(from)); err != nil {
		return fmt.Errorf("send ack: %w", err)
	}
	return nil
}
