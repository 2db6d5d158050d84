// Package bpftest holds the helpers every package's BPF tests share: loading a switch for a test
// and the one allowed reason to skip (house rule: tests skip only on ebpf.ErrNotSupported; CI is
// root, so a lack of privileges must fail, not skip).
package bpftest

import (
	"errors"
	"runtime"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netns"

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

// InNewNetns locks the test goroutine to its thread and moves the thread into a fresh, unnamed
// network namespace (only lo, down) for the rest of the test. At cleanup (after every cleanup
// registered later) the thread goes back to its namespace and is unlocked; the new namespace
// disappears with its last reference. Subtests run on other goroutines, in the original namespace.
func InNewNetns(tb testing.TB) {
	tb.Helper()
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		tb.Fatalf("get the thread's network namespace: %v", err)
	}
	ns, err := netns.New() // creates the namespace and moves this thread into it
	if err != nil {
		orig.Close()
		runtime.UnlockOSThread()
		tb.Fatalf("create a network namespace: %v", err)
	}
	tb.Cleanup(func() {
		if err := netns.Set(orig); err != nil {
			// Stay locked: the runtime discards the thread when the goroutine ends, instead of
			// letting it serve others in the wrong namespace.
			tb.Errorf("return to the original network namespace: %v", err)
			return
		}
		ns.Close()
		orig.Close()
		runtime.UnlockOSThread()
	})
}
