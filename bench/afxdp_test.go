package bench

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
)

// The A/B pair of AF_XDP receive: xdpagg (AF_XDP on unshaped links) and xdpagg-udp both sum
// correctly, the report says which path each took, and the pair has its ratio.
func TestXdpaggReceivePaths(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rep, err := Run(ctx, Options{Modes: []string{ModeXdpagg, ModeXdpaggUDP}, Workers: []int{2}, Bytes: []int{4, 40 << 10}, Rounds: 2})
	if errors.Is(err, ebpf.ErrNotSupported) {
		t.Skipf("kernel lacks a feature (ebpf.ErrNotSupported): %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Cells) != 4 {
		t.Fatalf("%d cells, want 4", len(rep.Cells))
	}
	for _, c := range rep.Cells {
		if c.Error != "" || !c.Verified {
			t.Errorf("%s %dB: error %q verified %v", c.Mode, c.Bytes, c.Error, c.Verified)
		}
	}
	var afxdp, udp bool
	for _, n := range rep.Notes {
		afxdp = afxdp || strings.Contains(n, ModeXdpagg+": ") && strings.Contains(n, "receive through AF_XDP")
		udp = udp || strings.Contains(n, ModeXdpaggUDP+": ") && strings.Contains(n, "AF_XDP")
	}
	if !afxdp || udp {
		t.Errorf("notes %q: want AF_XDP receive said of xdpagg only", rep.Notes)
	}
	found := false
	for _, x := range rep.Ratios {
		found = found || x.Mode == ModeXdpagg && x.Other == ModeXdpaggUDP
	}
	if !found {
		t.Error("no xdpagg / xdpagg-udp ratio")
	}
	for _, m := range []string{ModeXdpagg, ModeXdpaggUDP} {
		if rep.Environments[m] == "" {
			t.Errorf("no environment reported for %s", m)
		}
	}
}
