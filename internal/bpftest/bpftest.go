// Package bpftest holds the helpers every package's BPF tests share: loading a switch for a test
// and the one allowed reason to skip (house rule: tests skip only on ebpf.ErrNotSupported; CI is
// root, so a lack of privileges must fail, not skip).
package bpftest

import (
	"errors"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/xdpagg/xdpagg/loader"
)

// Check skips the test if err is ebpf.ErrNotSupported (the kernel lacks a feature) and fails it on
// any other error; what says what was being done.
func Check(t testing.TB, what string, err error) {
	t.Helper()
	if errors.Is(err, ebpf.ErrNotSupported) {
		t.Skipf("%s: kernel lacks a feature (ebpf.ErrNotSupported): %v", what, err)
	}
	if err != nil {
		t.Fatalf("%s: %+v", what, err) // %+v: a verifier error prints its log
	}
}

// LoadSwitch loads a switch with cfg and closes it when the test ends. cfg is used as given:
// strict source validation is on unless cfg.NoSourceCheck is set, so a test that feeds frames with
// BPF_PROG_TEST_RUN in the host namespace (ingress: the loopback device, whose routes explain no
// test address) must set NoSourceCheck, or every IPv4 and ARP frame is dropped as spoofed.
func LoadSwitch(t testing.TB, cfg loader.Config) *loader.Switch {
	t.Helper()
	sw, err := loader.Load(cfg)
	Check(t, "load switch", err)
	t.Cleanup(func() {
		if err := sw.Close(); err != nil {
			t.Errorf("close switch: %v", err)
		}
	})
	return sw
}
