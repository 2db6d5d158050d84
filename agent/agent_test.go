package agent

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"

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
