package controller

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/xdpagg/xdpagg/ctlauth"
)

// Config is `xdpagg controller --config`: the switch groups and the jobs the controller owns.
type Config struct {
	Groups []GroupConfig `json:"groups"`
	Jobs   []JobConfig   `json:"jobs"`
	// Heartbeat is the failure policy (zero fields: Policy's defaults).
	Heartbeat HeartbeatConfig `json:"heartbeat,omitzero"`
	// Degrade is the degradation policy (zero fields: its defaults).
	Degrade DegradePolicy `json:"degrade,omitzero"`
}

// GroupConfig is one primary/standby pair. The standby has the primary's port names, port
// addresses and MACs, and every host of the group is dual-homed (docs/operations.md).
type GroupConfig struct {
	Name    string       `json:"name"`
	Primary SwitchConfig `json:"primary"`
	Standby SwitchConfig `json:"standby"`
}

// SwitchConfig is how the controller reaches one switch's agent, over the management network.
type SwitchConfig struct {
	Name      string         `json:"name"`
	Mgmt      netip.AddrPort `json:"mgmt"`      // `xdpagg switch --mgmt-listen`
	Heartbeat netip.AddrPort `json:"heartbeat"` // the agent's xdpagg port on its management address
	KeyFile   string         `json:"key_file"`  // the file given to its --controller-key-file
	key       []byte
}

// Key is the switch's controller key, read by LoadConfig.
func (s SwitchConfig) Key() []byte { return s.key }

// JobConfig is one job the controller admits on both switches of its group.
type JobConfig struct {
	ID      uint32         `json:"id"`
	Workers uint8          `json:"workers"`
	PS      netip.AddrPort `json:"ps"`
	PSPort  string         `json:"ps_port"` // the switch port name the PS is behind
	Quota   uint32         `json:"quota"`   // slots; 0: the switch's default
	Group   string         `json:"group"`
	// RegArrays: a sparse job's register arrays per parity (as `xdpagg job add --reg-arrays`);
	// 0 for a dense job.
	RegArrays uint16 `json:"reg_arrays,omitempty"`
	// Threshold is the H a dense job is admitted with (as `xdpagg job add --threshold`):
	// 1..Workers, asynchronous aggregation; 0 (absent) synchronous. The job's binding may change
	// it at run time (MSG_SETH); a failover carries the H of the moment to the standby.
	Threshold uint8 `json:"threshold,omitempty"`
	// KeyFile is where the controller writes the job's key (hex, mode 0600) for its hosts;
	// empty: <state-dir>/keys/job-<id>.key.
	KeyFile string `json:"key_file,omitempty"`
}

// HeartbeatConfig is the JSON form of the heartbeat part of Policy.
type HeartbeatConfig struct {
	Interval     Duration `json:"interval,omitzero"`
	SuspectAfter int      `json:"suspect_after,omitzero"`
	FailAfter    int      `json:"fail_after,omitzero"`
}

// DegradePolicy says when an answering switch is degraded (Libra §3.6: loss rates and the
// response delay) and is drained to its standby: over the last Heartbeats answers, the workers'
// resends it saw (DATA it had already summed, resends answered from a shadow copy or flushing a
// partial slot, and RETRANSMIT requests to its cache) exceed MaxResendShare of the DATA it
// aggregated, with at least MinPackets of both; or, with MaxRTT set, every one of those answers
// took longer than MaxRTT (its agent is starved).
type DegradePolicy struct {
	MaxResendShare float64  `json:"max_resend_share,omitzero"` // default 0.25
	MinPackets     uint64   `json:"min_packets,omitzero"`      // default 200
	Heartbeats     int      `json:"heartbeats,omitzero"`       // default 5
	MaxRTT         Duration `json:"max_rtt,omitzero"`          // default 0: off
	Off            bool     `json:"off,omitzero"`              // never drain on statistics
}

func (d DegradePolicy) withDefaults() DegradePolicy {
	if d.MaxResendShare == 0 {
		d.MaxResendShare = 0.25
	}
	if d.MinPackets == 0 {
		d.MinPackets = 200
	}
	if d.Heartbeats == 0 {
		d.Heartbeats = 5
	}
	return d
}

// Duration is a time.Duration written as a Go duration string ("200ms") in JSON.
type Duration time.Duration

func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(time.Duration(d).String()) }

func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return err
	}
	v, err := time.ParseDuration(s)
	*d = Duration(v)
	return err
}

// LoadConfig reads and checks a config file and the switches' controller keys (relative key
// paths are taken from the config file's directory).
func LoadConfig(path string) (*Config, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	var c Config
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrConfig, path, err)
	}
	dir := filepath.Dir(path)
	for i := range c.Groups {
		for _, s := range []*SwitchConfig{&c.Groups[i].Primary, &c.Groups[i].Standby} {
			kf := s.KeyFile
			if kf != "" && !filepath.IsAbs(kf) {
				kf = filepath.Join(dir, kf)
			}
			kb, err := os.ReadFile(kf)
			if err != nil {
				return nil, fmt.Errorf("%w: switch %s: controller key: %w", ErrConfig, s.Name, err)
			}
			if s.key, err = ctlauth.ParseKey(strings.TrimSpace(string(kb))); err != nil {
				return nil, fmt.Errorf("%w: switch %s: controller key %s: %w", ErrConfig, s.Name, kf, err)
			}
		}
	}
	return &c, c.check()
}

// check validates a config whose keys are loaded.
func (c *Config) check() error {
	switches, groups := map[string]bool{}, map[string]bool{}
	for _, g := range c.Groups {
		if g.Name == "" || groups[g.Name] {
			return fmt.Errorf("%w: group name %q empty or given twice", ErrConfig, g.Name)
		}
		groups[g.Name] = true
		for _, s := range []SwitchConfig{g.Primary, g.Standby} {
			switch {
			case s.Name == "" || switches[s.Name]:
				return fmt.Errorf("%w: group %s: switch name %q empty or given twice", ErrConfig, g.Name, s.Name)
			case !s.Mgmt.IsValid() || s.Mgmt.Port() == 0 || !s.Heartbeat.Addr().Is4() || s.Heartbeat.Port() == 0:
				return fmt.Errorf("%w: switch %s: need a management address and an IPv4 heartbeat address, with ports", ErrConfig, s.Name)
			case len(s.key) != ctlauth.KeySize:
				return fmt.Errorf("%w: switch %s: no controller key", ErrConfig, s.Name)
			}
			switches[s.Name] = true
		}
	}
	if len(groups) == 0 {
		return fmt.Errorf("%w: no groups", ErrConfig)
	}
	ids := map[uint32]bool{}
	for _, j := range c.Jobs {
		switch {
		case j.ID == 0 || ids[j.ID]:
			return fmt.Errorf("%w: job id %d zero or given twice", ErrConfig, j.ID)
		case j.Workers == 0:
			return fmt.Errorf("%w: job %d: no workers", ErrConfig, j.ID)
		case !j.PS.Addr().Is4() || j.PS.Port() == 0 || j.PSPort == "":
			return fmt.Errorf("%w: job %d: need the PS's IPv4 address and port and its switch port name", ErrConfig, j.ID)
		case !groups[j.Group]:
			return fmt.Errorf("%w: job %d: no group %q", ErrConfig, j.ID, j.Group)
		case j.Threshold > j.Workers || (j.Threshold != 0 && j.RegArrays > 0):
			return fmt.Errorf("%w: job %d: threshold %d: use 1..%d for a dense job (0: synchronous), none for a sparse one", ErrConfig, j.ID, j.Threshold, j.Workers)
		}
		ids[j.ID] = true
	}
	if d := c.Degrade; d.MaxResendShare < 0 || d.Heartbeats < 0 {
		return fmt.Errorf("%w: degrade policy %+v", ErrConfig, d)
	}
	return nil
}
