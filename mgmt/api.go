// Package mgmt is a switch's management channel: the controller's authenticated and encrypted
// TCP connection to one agent (`xdpagg switch --mgmt-listen`), over which it admits, resets and
// removes jobs, reads the switch's state (a Snapshot), writes a snapshot into another switch
// (Restore) and drains a switch (takes its host ports down so that dual-homed hosts move to the
// standby). Frames are sealed with AES-256-GCM under a key derived from the switch's controller
// key (`xdpagg switch --controller-key-file`), so job keys inside snapshots never cross the
// management network in the clear, and every request carries a fresh stamp.
//
// The package never logs and never exits: errors are %w-wrapped, with the sentinels below.
//
// This file fixes the API shared by the agent (Handler) and the controller (Client).
package mgmt

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"sync"
	"time"

	"github.com/xdpagg/xdpagg/ctlauth"
)

// Sentinels.
var (
	// ErrAuth: a frame that does not open under the key, or a stale or replayed stamp.
	ErrAuth = errors.New("management frame not authentic")
	// ErrRefused: the agent understood the request and refused it (the error text says why).
	ErrRefused = errors.New("refused by the switch")
	// ErrIncompatible: a snapshot that does not fit this switch (pool size, register arrays,
	// a port name it does not have).
	ErrIncompatible = errors.New("snapshot does not fit this switch")
	// ErrFailed: the agent accepted the request but could not carry it out (a map operation
	// failed; the error text says which).
	ErrFailed = errors.New("the switch failed the request")
	// ErrFrame: a frame that cannot be read (length beyond MaxFrame, truncated, or a connection
	// closed before the answer: the agent closes connections on frames it does not accept).
	ErrFrame = errors.New("bad management frame")
)

// DefaultPort is the agent's management TCP port.
const DefaultPort = 9520

// Job is a job's admission as the controller makes it on every switch of its group.
type Job struct {
	ID        uint32         `json:"id"`
	Workers   uint8          `json:"workers"`
	PS        netip.AddrPort `json:"ps"`         // the PS's IPv4 address and UDP port
	PSPort    string         `json:"ps_port"`    // switch port name the PS is behind (same name on primary and standby)
	MaxSlots  uint32         `json:"max_slots"`  // 0: the switch's default quota
	RegArrays uint16         `json:"reg_arrays"` // sparse jobs: register arrays; 0 dense
	Key       []byte         `json:"key"`        // the job's 32-byte control key
	// Threshold is H, asynchronous aggregation (iSwitch): a fragment completes once H distinct
	// workers contributed (1..Workers); 0 is synchronous (Workers). Dense jobs only. In a
	// Snapshot it is the job's H at that moment (MSG_SETH may have changed it since Admit).
	Threshold uint8 `json:"threshold,omitzero"`
}

// Member is one bound worker: the `workers` binding and the `members` egress entry together.
type Member struct {
	Job     uint32           `json:"job"`
	Worker  uint8            `json:"worker"`
	Port    string           `json:"port"` // switch port name (ports are matched by name across switches)
	Addr    netip.AddrPort   `json:"addr"` // the worker's IPv4 address and UDP port
	MAC     net.HardwareAddr `json:"mac"`
	PortMAC net.HardwareAddr `json:"port_mac,omitempty"`
}

// Slot is one aggregator slot in use, as the map holds it (struct slot without its lock).
// Idle is its age when read (the datapath's clock is per machine, so Restore rebases it).
type Slot struct {
	Index uint32        `json:"index"`
	Value []byte        `json:"value"` // struct slot bytes, lock zeroed
	Idle  time.Duration `json:"idle_ns"`
}

// Raw is one entry of another map moved verbatim (sparse registers and iteration records).
type Raw struct {
	Map   string `json:"map"`
	Key   []byte `json:"key"`
	Value []byte `json:"value"`
}

// Scope says how much a Snapshot reads.
type Scope uint8

const (
	// ScopeControl: jobs and members only (cheap; the controller's periodic replica).
	ScopeControl Scope = iota
	// ScopeAll: also slots, sparse registers and records, and the retransmit cache.
	ScopeAll
)

// Snapshot is what the controller moves from one switch to another.
type Snapshot struct {
	Switch   string    `json:"switch"` // the agent's --name
	Taken    time.Time `json:"taken"`
	Scope    Scope     `json:"scope"`
	Pool     uint32    `json:"pool"`
	Arrays   uint32    `json:"reg_arrays"`
	Jobs     []Job     `json:"jobs"`
	Members  []Member  `json:"members"`
	Slots    []Slot    `json:"slots,omitempty"`
	Sparse   []Raw     `json:"sparse,omitempty"`
	Cache    [][]byte  `json:"cache,omitempty"` // struct result_rec records of the retransmit cache, and sparse update packets of the sparse one
	Draining bool      `json:"draining"`        // the switch was drained before this was read
}

// RestoreStats says what a Restore (or a Sync) wrote.
type RestoreStats struct {
	Jobs, Members, Slots, Sparse, Cache int
	Skipped                             int // entries that did not apply (e.g. a job already admitted with another key)
	// Sync only: bindings it removed or replaced because the snapshot's switch no longer has
	// them as they were (a LEAVE, a worker rebound on another address or port), and jobs it
	// removed (SyncRequest.Gone).
	Unbound int `json:",omitzero"`
	Removed int `json:",omitzero"`
}

// SyncRequest is the controller's mirror of its active switch's control state onto the group's
// standby (a hot standby, docs/operations.md). Unlike Restore, which only adds (a binding here
// is kept), Sync makes this switch's jobs and members equal to the snapshot's for the snapshot's
// jobs: jobs admitted (or found admitted with the same key and parameters) and given the
// snapshot's H, worker ids bound exactly as in the snapshot (address, UDP port, port name),
// bindings of those jobs that the snapshot does not have removed (except, without Force, those a
// worker made by a JOIN to this switch), and the jobs in Gone removed. Slots, registers, records and the cache are never read or written: only a control snapshot
// (ScopeControl) is accepted.
type SyncRequest struct {
	Snapshot *Snapshot `json:"snapshot"`
	// Gone: jobs the controller owns on this group that the snapshot's switch no longer has.
	Gone []uint32 `json:"gone,omitempty"`
	// Force: replace and remove bindings that workers made by a JOIN to this switch too. Without
	// it they are kept (and counted skipped): a worker joined here because its traffic reached
	// this switch, which a snapshot of the other one may not know yet. The controller forces the
	// first mirror after it reset the standby and the cooling before a drain, when it knows no
	// traffic of the jobs reaches this switch.
	Force bool `json:"force,omitempty"`
}

// Syncer is the Handler's optional Sync (added after the first Handler; a Handler without it
// answers the sync operation as unknown, as an agent of before it does).
type Syncer interface {
	Sync(SyncRequest) (RestoreStats, error)
}

// Handler is what an agent does for the controller; the agent implements it, Serve calls it.
type Handler interface {
	Admit(Job) error
	Remove(id uint32) error
	Reset(id uint32) error
	Snapshot(Scope) (*Snapshot, error)
	Restore(*Snapshot) (RestoreStats, error)
	Drain() error // take every host port down; maps stay readable; heartbeats keep answering
}

// Client is the controller's side of one switch's management channel. Calls on one Client are
// made one at a time (each takes its stamp just before it is sent, so the agent sees them in
// stamp order); concurrent callers queue.
type Client struct {
	addr netip.AddrPort

	mu      sync.Mutex // one exchange at a time
	keys    frameKeys
	stamper ctlauth.Stamper
	// Timeout bounds an exchange whose ctx has no deadline (default DefaultTimeout).
	Timeout time.Duration
}

// DefaultTimeout bounds one exchange (connect, request, the switch's work, response) when the
// caller's context has no deadline.
const DefaultTimeout = 2 * time.Minute

// Dial returns a client of the agent at addr under the switch's controller key. Connections are
// made per call (and re-made after a failure), so a Client outlives agent restarts.
func Dial(addr netip.AddrPort, key []byte) (*Client, error) {
	keys, err := deriveKeys(key)
	if err != nil {
		return nil, err
	}
	return &Client{addr: addr, keys: keys}, nil
}

// Admit admits j on the switch; a job already admitted with the same key and parameters is
// success.
func (c *Client) Admit(ctx context.Context, j Job) error { return c.call(ctx, opAdmit, j, nil) }

// Remove ends a job on the switch (`xdpagg job rm`).
func (c *Client) Remove(ctx context.Context, id uint32) error { return c.call(ctx, opRemove, id, nil) }

// Reset clears a job's slots, registers and iteration records, keeping its admission and members
// (MSG_RESET).
func (c *Client) Reset(ctx context.Context, id uint32) error { return c.call(ctx, opReset, id, nil) }

// Snapshot reads the switch's state.
func (c *Client) Snapshot(ctx context.Context, s Scope) (*Snapshot, error) {
	var out Snapshot
	if err := c.call(ctx, opSnapshot, s, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// Restore writes a snapshot (of another switch) into the switch.
func (c *Client) Restore(ctx context.Context, s *Snapshot) (RestoreStats, error) {
	var out RestoreStats
	err := c.call(ctx, opRestore, s, &out)
	return out, err
}

// Sync mirrors another switch's control snapshot here (SyncRequest): the hot standby's refresh.
// An agent that predates it refuses it (ErrRefused, unknown operation).
func (c *Client) Sync(ctx context.Context, r SyncRequest) (RestoreStats, error) {
	var out RestoreStats
	err := c.call(ctx, opSync, r, &out)
	return out, err
}

// Drain takes the switch's host ports down (idempotent).
func (c *Client) Drain(ctx context.Context) error { return c.call(ctx, opDrain, nil, nil) }

// Close releases the client (it holds no connection between calls).
func (c *Client) Close() error { return nil }
