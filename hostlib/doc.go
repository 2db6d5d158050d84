// Package hostlib is the host side of xdpagg: the Worker that all-reduces float32 tensors through
// the XDP switch, Async, which trains asynchronously on a Worker (iSwitch), the parameter server
// (PS) that sums whatever the switch cannot (or, Direct, everything, with no switch), the
// fixed-point codec both share with the switch, and Ring, a switchless ring all-reduce over the
// same wire header.
//
// The wire format is defined once, in bpf/xdpagg.h; this package reads and writes it through
// package wire (wire.Header, whose layout is pinned to bpf2go's bpf.XdpaggHdr, the codec and
// wire.ParsePacket) and never redefines a field.
//
// Trust: a Worker takes results only from its PS's address and port (which the switch's results
// carry) and, after Join, from the switch agent; its control messages (JOIN, LEAVE, RESET, HALT,
// SETH, FBCAST, ACK, RETRANSMIT and its HELP answers) and the agent's (ACKs, HALT notices, HELP
// requests) are authenticated with the job's key (package ctlauth, WorkerConfig.JobKey). A PS sums DATA only from the members of the jobs it is given
// (PSConfig.Jobs), and bounds each job's share of its memory. Whatever fails these checks is
// dropped and counted (WorkerStats.Foreign, Unauthenticated, Replayed; PSStats.UnknownJob,
// NotMember, OverQuota).
//
// hostlib never logs and never exits the process: everything goes back to the caller as an error
// wrapping one of the sentinel errors below, or as a counter in Stats.
package hostlib

import (
	"errors"
	"fmt"

	"github.com/xdpagg/xdpagg/wire"
)

// Sentinel errors. Functions wrap them with details; test with errors.Is.
var (
	// ErrConfig: a configuration cannot work; the message says which field to change.
	ErrConfig = errors.New("invalid configuration")
	// ErrTimeout: a fragment got no result (a ring packet no acknowledgement) after the
	// configured retries.
	ErrTimeout = errors.New("timed out")
	// ErrClosed: the Worker, PS or Ring was closed.
	ErrClosed = errors.New("closed")
	// ErrMalformed: a packet does not follow the wire contract of bpf/xdpagg.h. It is
	// wire.ErrMalformed, which every wire.ParsePacket error wraps.
	ErrMalformed = wire.ErrMalformed
	// ErrBusy: an operation that must not overlap with itself (AllReduce, Serve) already runs.
	ErrBusy = errors.New("busy")
	// ErrHalted: a member of the job asked the switch to halt it (iSwitch's Halt), and the
	// switch's agent said so; AllReduce fails until Worker.Resume.
	ErrHalted = errors.New("job halted")
	// ErrAsync: a misuse of Async (a bad configuration, a gradient of the wrong size).
	ErrAsync = errors.New("asynchronous training")
	// ErrThreshold: an aggregation threshold outside 1..the job's workers, or for a job the PS
	// does not serve (PS.SetThreshold).
	ErrThreshold = errors.New("bad aggregation threshold")
	// ErrAFXDP: a worker cannot receive through AF_XDP (WorkerConfig.AFXDP): no AF_XDP sockets
	// or XSKMAPs in the kernel, no interface holding the worker's address, or one that already
	// runs another XDP program.
	ErrAFXDP = errors.New("AF_XDP receive unavailable")
)

// errTruncated reports a datagram larger than any xdpagg packet; made once, like wire's errors.
var errTruncated = fmt.Errorf("%w: datagram larger than %d bytes", ErrMalformed, wire.MaxPacket)
