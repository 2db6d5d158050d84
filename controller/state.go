package controller

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/xdpagg/xdpagg/mgmt"
)

// Files in the state directory (mode 0700: job keys are in it).
const (
	StateFile  = "state.json"   // State (0600)
	StatusFile = "status.json"  // View, for `xdpagg inspect --controller-status` (0644, no keys)
	SocketFile = "control.sock" // operator requests (Request), e.g. `xdpagg failover`
	KeysDir    = "keys"         // job keys for the hosts, job-<id>.key (0600), unless a job names its own
)

// State is what the controller keeps across restarts: everything but the switches' live status.
type State struct {
	Groups map[string]*GroupState `json:"groups"`
	Jobs   map[uint32]*JobState   `json:"jobs"`
}

// GroupState is one group's part of State.
type GroupState struct {
	// Active is the switch the group's traffic goes through (the primary until a failover).
	Active string `json:"active"`
	// Armed: an automatic failover (failed, degraded) may go to the other switch. A failover
	// away from a switch disarms the group: the controller never sends traffic back to a switch
	// it declared failed or degraded; an operator failover re-arms it.
	Armed bool `json:"armed"`
	// Replica is the active switch's last control snapshot (jobs, keys, members).
	Replica *mgmt.Snapshot `json:"replica,omitempty"`
	// Mirrored is the Taken time of the last replica mirrored onto the standby (zero: none).
	Mirrored     time.Time `json:"mirrored,omitzero"`
	LastFailover *Failover `json:"last_failover,omitempty"`
	// Pending is the reason of a failover that drained the active switch (so the hosts moved)
	// but did not restore on the other one: it is retried every round, whatever its trigger
	// says now, until it completes.
	Pending   string         `json:"pending,omitempty"`
	Failovers map[string]int `json:"failovers,omitempty"` // completed failovers by reason
}

// JobState is one job's part of State.
type JobState struct {
	Key      []byte          `json:"key"`      // the job's control key, made by the controller
	KeyFile  string          `json:"key_file"` // where it was written for the hosts
	Admitted map[string]bool `json:"admitted"` // switch name -> admitted there
}

// Failover is the record of one failover.
type Failover struct {
	Group   string    `json:"group"`
	From    string    `json:"from"`
	To      string    `json:"to"`
	Reason  string    `json:"reason"` // ReasonFailed, ReasonDegraded, ReasonOperator
	Detail  string    `json:"detail,omitempty"`
	Started time.Time `json:"started"`
	// Source of the state restored on To: "drained" (a ScopeAll snapshot of From after Drain:
	// slots, registers, cache and members move), "replica" (the last control snapshot: jobs and
	// members; aggregation in flight is recovered by resends), or "none".
	Source string `json:"source"`
	// Hot: the target was a hot standby (mirrored from the active switch, every replica, since
	// this controller reset it), so it aggregated the job from the moment the hosts moved.
	Hot bool `json:"hot,omitempty"`
	// Phases, and the whole failover from its decision to the restore's end.
	Drain    time.Duration     `json:"drain_ns"`
	Snapshot time.Duration     `json:"snapshot_ns"`
	Restore  time.Duration     `json:"restore_ns"`
	Total    time.Duration     `json:"total_ns"`
	Migrated mgmt.RestoreStats `json:"migrated"`
	// Error, if set, says why the failover did not complete (the group stayed on From).
	Error string `json:"error,omitempty"`
	// Notes: what went wrong on the way without stopping it (e.g. a drain that failed, so the
	// replica was used).
	Notes []string `json:"notes,omitempty"`
}

// loadState reads dir's state file; a missing one is an empty state.
func loadState(dir string) (*State, error) {
	st := &State{Groups: map[string]*GroupState{}, Jobs: map[uint32]*JobState{}}
	b, err := os.ReadFile(filepath.Join(dir, StateFile))
	if errors.Is(err, os.ErrNotExist) {
		return st, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read controller state: %w", err)
	}
	if err := json.Unmarshal(b, st); err != nil {
		return nil, fmt.Errorf("%w: controller state %s: %w", ErrState, filepath.Join(dir, StateFile), err)
	}
	if st.Groups == nil {
		st.Groups = map[string]*GroupState{}
	}
	if st.Jobs == nil {
		st.Jobs = map[uint32]*JobState{}
	}
	return st, nil
}

// writeAtomic writes data to path through a synced temporary file and a rename, so a reader (or
// a controller restarted after a crash) sees the old file or the new one, never part of one.
func writeAtomic(path string, data []byte, mode os.FileMode) error {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if err == nil {
		err = f.Chmod(mode)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), path)
	}
	if err != nil {
		_ = os.Remove(f.Name())
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}
