package agent

import (
	"context"
	"errors"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/internal/bpftest"
	"github.com/xdpagg/xdpagg/loader"
)

func TestPinDir(t *testing.T) {
	if got, want := PinDir("", "default"), filepath.Join(DefaultPinRoot, "default"); got != want {
		t.Errorf(`PinDir("", "default") = %q, want %q`, got, want)
	}
	if got := PinDir("/x/bpf", "sw1"); got != "/x/bpf/sw1" {
		t.Errorf(`PinDir("/x/bpf", "sw1") = %q, want "/x/bpf/sw1"`, got)
	}
	if DefaultPinRoot != "/sys/fs/bpf/xdpagg" {
		t.Errorf("DefaultPinRoot = %q", DefaultPinRoot)
	}
}

func TestConfigValidate(t *testing.T) {
	ok := Config{Name: "default", Interfaces: []string{"p0", "p1"}}
	if err := ok.Validate(); err != nil {
		t.Fatalf("Validate(%+v) = %v", ok, err)
	}
	for _, tc := range []struct {
		name string
		edit func(*Config)
		want string
		is   error
	}{
		{"empty name", func(c *Config) { c.Name = "" }, `switch name ""`, ErrConfig},
		{"name with a slash", func(c *Config) { c.Name = "a/b" }, `switch name "a/b": use a plain name`, ErrConfig},
		{"absolute name", func(c *Config) { c.Name = "/sw" }, "plain name", ErrConfig},
		{"dot", func(c *Config) { c.Name = "." }, "plain name", ErrConfig},
		{"dot dot", func(c *Config) { c.Name = ".." }, "plain name", ErrConfig},
		{"no interfaces", func(c *Config) { c.Interfaces = nil }, "no interfaces", ErrConfig},
		{"empty interface list", func(c *Config) { c.Interfaces = []string{} }, "--iface", ErrConfig},
		{"duplicate interface", func(c *Config) { c.Interfaces = []string{"p0", "p1", "p0"} }, `interface "p0" named twice`, ErrConfig},
		{"pool too big", func(c *Config) { c.Switch.PoolSize = loader.MaxPoolSize + 1 }, "pool size", loader.ErrConfig},
		{"tiny slot timeout", func(c *Config) { c.Switch.SlotTimeout = time.Nanosecond }, "slot timeout", loader.ErrConfig},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := ok
			c.Interfaces = append([]string(nil), ok.Interfaces...)
			tc.edit(&c)
			err := c.Validate()
			if !errors.Is(err, tc.is) {
				t.Fatalf("Validate(%+v) = %v, want an error wrapping %v", c, err, tc.is)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q does not say %q", err, tc.want)
			}
		})
	}
	// Zero switch settings are defaults, not errors.
	c := ok
	c.Switch = loader.Config{}
	if err := c.Validate(); err != nil {
		t.Errorf("zero switch config: %v", err)
	}
}

// loadSwitch loads a switch with pool slots for this package's tests.
func loadSwitch(t *testing.T, pool uint32) *loader.Switch {
	t.Helper()
	return bpftest.LoadSwitch(t, loader.Config{PoolSize: pool})
}

func skipIfUnsupported(t *testing.T, what string, err error) { t.Helper(); bpftest.Check(t, what, err) }

// collectGarbage frees idle slots every tick (the in-BPF collector, on the datapath's clock) and
// forgets removed jobs' control state; it logs a failing collector once per failure streak, and
// stops with its context.
func TestCollectGarbage(t *testing.T) {
	sw := bpftest.LoadSwitch(t, loader.Config{PoolSize: 8, SlotTimeout: 20 * time.Millisecond})
	m := sw.Maps
	ctrl := newControl(t, m)
	key := admitJob(t, m, testJob, psAddr, 2)
	w := newWorker(t)
	accept(t, ctrl, join(t, key, 1, 0), testPort, w.addr)
	w.readAck(t, key)
	// A slot stamped at boot: idle in any clock.
	s := bpf.XdpaggSlot{JobId: testJob, Seq: 1, State: uint8(bpf.XdpaggSlotStateSLOT_COMPLETE), FanIn: 2, Nvals: 1, TsNs: 1}
	if err := m.Slots.Put(uint32(3), &s); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		collectGarbage(ctx, m, ctrl, 5*time.Millisecond, slog.New(slog.DiscardHandler))
	}()
	deadline := time.Now().Add(5 * time.Second)
	for {
		used, err := m.SlotsInUse()
		if err != nil {
			t.Fatal(err)
		}
		if len(used) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("idle slot not collected: %+v", used)
		}
		time.Sleep(5 * time.Millisecond)
	}
	// The job is still admitted: its control state stays. Removed, it goes at a later tick.
	ctrl.mu.Lock()
	n := len(ctrl.lastSeen)
	ctrl.mu.Unlock()
	if n != 1 {
		t.Errorf("lastSeen has %d entries while the job is admitted, want 1", n)
	}
	if _, err := m.RemoveJob(testJob); err != nil {
		t.Fatal(err)
	}
	for {
		ctrl.mu.Lock()
		n := len(ctrl.lastSeen) + len(ctrl.keys)
		ctrl.mu.Unlock()
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("a removed job's control state was not forgotten")
		}
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	select {
	case <-done:
	case <-time.After(failsafeFor):
		t.Fatal("collectGarbage did not return after its context ended")
	}

	// Without a collector program: one error line per failure streak, not one per tick.
	broken := *m
	broken.GC = nil
	var logs syncBuffer
	ctx, cancel = context.WithCancel(context.Background())
	done = make(chan struct{})
	go func() {
		defer close(done)
		collectGarbage(ctx, &broken, ctrl, time.Millisecond, slog.New(slog.NewTextHandler(&logs, nil)))
	}()
	time.Sleep(50 * time.Millisecond)
	cancel()
	<-done
	if n := strings.Count(logs.String(), "slot garbage collection"); n != 1 {
		t.Errorf("%d error lines for one failure streak, want 1:\n%s", n, logs.String())
	}
}
