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
