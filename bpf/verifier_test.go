package bpf_test

import (
	"testing"
	"time"

	"github.com/cilium/ebpf"
)

// TestVerifierInstructionCounts loads every program and reports how many instructions the
// verifier processed for each (docs/design.md quotes them), failing well before the kernel's
// limit of 1,000,000: a change that makes a program's verification explode shows here first.
func TestVerifierInstructionCounts(t *testing.T) {
	s := load(t, time.Hour)
	for name, p := range map[string]*ebpf.Program{
		"xdpagg_switch": s.Objects.XdpaggSwitch,
		"xdpagg_sparse": s.Objects.XdpaggSparse,
		"xdpagg_egress": s.Objects.XdpaggEgress,
		"xdpagg_gc":     s.Objects.XdpaggGc,
		"xdpagg_pass":   s.Objects.XdpaggPass,
	} {
		info, err := p.Info()
		skipIfUnsupported(t, "program info", err)
		n, ok := info.VerifiedInstructions()
		if !ok {
			t.Logf("%s: the kernel does not report verified instructions", name)
			continue
		}
		insns, err := info.Instructions()
		size := 0
		if err == nil {
			size = len(insns)
		}
		t.Logf("%s: %d instructions, %d processed by the verifier", name, size, n)
		if n > 500_000 {
			t.Errorf("%s: the verifier processed %d instructions, half the kernel's limit", name, n)
		}
	}
}
