package hostlib

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"time"

	"github.com/xdpagg/xdpagg/bpf"
)

const msgAck = uint8(bpf.XdpaggMsgTypeMSG_ACK)

// Join registers this worker with the switch's agent (iSwitch's Join): the switch learns where
// the job's results must reach this worker — the packet's source address and arrival port, mac
// (this worker's MAC on its link to the switch) and resultIP (the source address results carry,
// normally the PS). sw is the switch's own address on this worker's subnet and the xdpagg port.
// The message is resent until the agent acknowledges it or ctx ends.
func (w *Worker) Join(ctx context.Context, sw netip.AddrPort, mac net.HardwareAddr, resultIP netip.Addr) error {
	return w.control(ctx, uint8(bpf.XdpaggMsgTypeMSG_JOIN), sw, mac, resultIP)
}

// Leave removes this worker from the switch's members of its job.
func (w *Worker) Leave(ctx context.Context, sw netip.AddrPort, mac net.HardwareAddr, resultIP netip.Addr) error {
	return w.control(ctx, uint8(bpf.XdpaggMsgTypeMSG_LEAVE), sw, mac, resultIP)
}

func (w *Worker) control(ctx context.Context, typ uint8, sw netip.AddrPort, mac net.HardwareAddr, resultIP netip.Addr) error {
	if len(mac) != 6 {
		return fmt.Errorf("%w: MAC %v: need a 6-byte Ethernet address", ErrConfig, mac)
	}
	if !resultIP.Is4() || !sw.Addr().Is4() {
		return fmt.Errorf("%w: switch %v and result source %v must be IPv4", ErrConfig, sw, resultIP)
	}
	nonce := uint32(time.Now().UnixNano())
	h := bpf.XdpaggHdr{Version: bpf.Version, Type: typ, JobId: w.cfg.JobID, Seq: nonce,
		FanIn0: w.cfg.NumWorkers, WorkerId: w.cfg.WorkerID, Bitmap0: 1 << w.cfg.WorkerID}
	var body bpf.XdpaggJoinBody
	copy(body.Mac[:], mac)
	ip := resultIP.As4()
	body.ResultIp = binary.LittleEndian.Uint32(ip[:]) // network-order bytes in memory
	pkt := make([]byte, bpf.HdrSize, bpf.HdrSize+12)
	EncodeHeader(pkt, &h)
	pkt, err := binary.Append(pkt, binary.LittleEndian, &body)
	if err != nil {
		return fmt.Errorf("encode control body: %w", err)
	}

	w.mu.Lock()
	w.ackWant, w.ackGot = nonce, false
	w.mu.Unlock()
	wait := 50 * time.Millisecond
	for {
		if _, err := w.bc.conn.WriteToUDPAddrPort(pkt, sw); err != nil {
			return fmt.Errorf("send control message to %v: %w", sw, err)
		}
		t := time.NewTimer(wait)
		for acked := false; !acked; {
			select {
			case <-ctx.Done():
				t.Stop()
				return fmt.Errorf("%w: no acknowledgement from the switch agent at %v: %w", ErrTimeout, sw, ctx.Err())
			case <-w.closing:
				t.Stop()
				return ErrClosed
			case <-t.C:
				acked = true // resend
			case <-w.kick:
				w.mu.Lock()
				got := w.ackGot
				w.mu.Unlock()
				if got {
					t.Stop()
					// From now on, results this worker misses are asked of the switch agent's
					// retransmit cache first; LEAVE turns that off.
					w.mu.Lock()
					w.ctrl, w.ctrlSet = sw, typ == uint8(bpf.XdpaggMsgTypeMSG_JOIN)
					w.ctrlRaw = sockaddr4(sw)
					w.mu.Unlock()
					return nil
				}
			}
		}
		wait = min(2*wait, time.Second)
	}
}
