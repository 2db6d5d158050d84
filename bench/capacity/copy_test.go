//go:build linux

package capacity

import (
	"bytes"
	"errors"
	"net"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/rlimit"

	"github.com/xdpagg/xdpagg/wire"
)

// xdp_copy, the ceiling: every path through it, run with Program.Run. The values must come out
// as they went in (it loads and stores them back, never changes them); only the completing
// contribution is rewritten into a RESULT and broadcast; anything short is dropped and counted.
func TestCopyProgram(t *testing.T) {
	if err := rlimit.RemoveMemlock(); err != nil {
		t.Fatal(err)
	}
	objs, err := loadObjects(nil)
	if errors.Is(err, ebpf.ErrNotSupported) {
		t.Skipf("kernel lacks a feature (ebpf.ErrNotSupported): %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer objs.Close()

	e := endpoints{
		dstMAC: net.HardwareAddr{2, 0, 10, 200, 1, 1}, srcMAC: net.HardwareAddr{2, 0, 10, 200, 1, 2},
		srcIP: netip.MustParseAddr("10.200.1.2"), dstIP: netip.MustParseAddr("10.200.250.2"),
		srcPort: memberUDP, dstPort: wire.DefaultPort,
	}
	frame := func(t *testing.T, count, nvals int, worker, fanIn uint8) []byte {
		t.Helper()
		vals := gradient(nvals)
		b, err := xdpaggPayload(wire.Header{Version: wire.Version, Type: wire.MsgData, Encoding: wire.EncFixed32,
			ScaleLog2: 16, Count: uint16(count), JobId: jobID, Seq: seqBase, Bitmap0: 1 << worker,
			FanIn0: fanIn, WorkerId: worker}, vals)
		if err != nil {
			t.Fatal(err)
		}
		f, err := udpFrame(e, b)
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	const (
		xdpDrop     = 1
		xdpRedirect = 4
	)
	for _, tc := range []struct {
		name          string
		count, nvals  int // header count, values carried
		worker, fanIn uint8
		verdict       uint32
		broadcast     bool
		errors        uint64
	}{
		{"one value (tail only)", 1, 1, 0, 4, xdpDrop, false, 0},
		{"one chunk", 32, 32, 1, 4, xdpDrop, false, 0},
		{"chunks and a tail (1500 MTU)", 360, 360, 2, 4, xdpDrop, false, 0},
		{"most values (3388 MTU)", wire.MaxValues, wire.MaxValues, 0, 4, xdpDrop, false, 0},
		{"completing, chunks and a tail", 360, 360, 3, 4, xdpRedirect, true, 0},
		{"completing, most values", wire.MaxValues, wire.MaxValues, 31, 32, xdpRedirect, true, 0},
		{"completing alone (fan-in 1)", 33, 33, 0, 1, xdpRedirect, true, 0},
		{"count beyond the frame", 361, 360, 3, 4, xdpDrop, false, 1},
		{"count zero", 0, 8, 3, 4, xdpDrop, false, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := frame(t, tc.count, tc.nvals, tc.worker, tc.fanIn)
			ncpu, err := ebpf.PossibleCPU()
			if err != nil {
				t.Fatal(err)
			}
			if err := objs.CopyStats.Put(uint32(0), make([]XdptxCopyStats, ncpu)); err != nil {
				t.Fatal(err)
			}
			out := make([]byte, len(in))
			ret, err := objs.XdpCopy.Run(&ebpf.RunOptions{Data: in, DataOut: out})
			if err != nil {
				t.Fatal(err)
			}
			if ret != tc.verdict {
				t.Fatalf("verdict %d, want %d", ret, tc.verdict)
			}
			var per []XdptxCopyStats
			if err := objs.CopyStats.Lookup(uint32(0), &per); err != nil {
				t.Fatal(err)
			}
			var st XdptxCopyStats
			for _, p := range per {
				st.Packets += p.Packets
				st.Broadcasts += p.Broadcasts
				st.Errors += p.Errors
			}
			wantPackets := uint64(1)
			if tc.errors > 0 {
				wantPackets = 0
			}
			wantBroadcasts := uint64(0)
			if tc.broadcast {
				wantBroadcasts = 1
			}
			if st.Packets != wantPackets || st.Broadcasts != wantBroadcasts || st.Errors != tc.errors {
				t.Errorf("stats %+v, want packets %d broadcasts %d errors %d", st, wantPackets, wantBroadcasts, tc.errors)
			}
			// The values, and everything before the header, are untouched.
			if !bytes.Equal(out[offVals:], in[offVals:]) {
				t.Error("values changed")
			}
			if !bytes.Equal(out[:offUDP+6], in[:offUDP+6]) {
				t.Error("Ethernet/IP/UDP ports changed")
			}
			var h wire.Header
			wire.DecodeHeader(out[offHdr:], &h)
			if !tc.broadcast {
				if !bytes.Equal(out, in) {
					t.Error("a dropped frame was changed")
				}
				return
			}
			wantBitmap := uint32(1)<<tc.fanIn - 1
			if tc.fanIn == 32 {
				wantBitmap = ^uint32(0)
			}
			if h.Type != wire.MsgResult || h.Flags&wire.FlagFromSwitch == 0 || h.Bitmap0 != wantBitmap ||
				h.Count != uint16(tc.count) || h.Seq != seqBase || h.JobId != jobID {
				t.Errorf("result header %+v", h)
			}
			if out[offUDP+6] != 0 || out[offUDP+7] != 0 {
				t.Error("UDP checksum not zeroed")
			}
		})
	}
}
