package main

import (
	"errors"
	"path/filepath"
	"testing"
)

// --mgmt-listen reaches the agent's configuration, needs --controller-key-file, and takes only
// host:port.
func TestSwitchMgmtFlag(t *testing.T) {
	key := filepath.Join(t.TempDir(), "ctl.key")
	cfg, err := parseSwitch([]string{"--iface", "p0", "--controller-key-file", key, "--mgmt-listen", "10.0.9.1:9520"})
	if err != nil {
		t.Fatalf("parseSwitch: %v", err)
	}
	if cfg.MgmtListen != "10.0.9.1:9520" || len(cfg.ControllerKey) != 32 {
		t.Errorf("config %q with a %d-byte key", cfg.MgmtListen, len(cfg.ControllerKey))
	}
	if cfg, err := parseSwitch([]string{"--iface", "p0"}); err != nil || cfg.MgmtListen != "" {
		t.Errorf("default: %q, %v; want off", cfg.MgmtListen, err)
	}
	for _, args := range [][]string{
		{"--iface", "p0", "--mgmt-listen", "10.0.9.1:9520"},
		{"--iface", "p0", "--controller-key-file", key, "--mgmt-listen", "10.0.9.1"},
	} {
		if _, err := parseSwitch(args); !errors.Is(err, errUsage) {
			t.Errorf("parseSwitch(%q): %v, want a usage error", args, err)
		}
	}
}

// --cache-entries reaches the agent's configuration (default 65536) and must be positive.
func TestSwitchCacheEntriesFlag(t *testing.T) {
	for args, want := range map[string]int{"": 65536, "--cache-entries=512": 512} {
		a := []string{"--iface", "p0"}
		if args != "" {
			a = append(a, args)
		}
		if cfg, err := parseSwitch(a); err != nil || cfg.CacheEntries != want {
			t.Errorf("parseSwitch(%q): %d, %v; want %d", a, cfg.CacheEntries, err, want)
		}
	}
	if _, err := parseSwitch([]string{"--iface", "p0", "--cache-entries", "0"}); !errors.Is(err, errUsage) {
		t.Errorf("--cache-entries 0: %v, want a usage error", err)
	}
}
