// Package capacity measures how many gradient values the xdpagg switch can aggregate per second
// on one CPU core, and compares that with the fastest thing an XDP program can do with the same
// frames: send them straight back out (a bare XDP_TX program).
//
// # Setup
//
// Measure builds a private topology (netns_tests/topo): a switch namespace with one veth port per
// worker of a synthetic job (Options.Workers, default 4), each host on the other end. It loads
// the switch with loader.Load, attaches xdpagg_switch to every port (which also puts every port
// into the broadcast devmap, with xdpagg_egress as the per-port program) and registers the host
// behind each port as a member of the job, so that a completed sum is really broadcast: Workers
// copies, each rewritten by xdpagg_egress and transmitted through its veth. On the host side
// every veth runs xdp_sink (this package's BPF object), which counts and drops what arrives. It
// stands in for the wire; a veth only accepts redirected frames when its peer runs XDP. The
// measuring thread is locked, moved into the switch namespace and pinned to one CPU
// (Result.CPU). The veth receive processing that a transmit triggers runs in softirq on that same
// CPU, inside the BPF_PROG_RUN call. So every figure is the work of one core, wire included.
//
// # Driving the switch: the packet mix
//
// Frames are injected with BPF_PROG_RUN in live-frame mode (BPF_F_TEST_XDP_LIVE_FRAMES, Repeat,
// BatchSize = Options.Batch, xdp_md.ingress_ifindex = worker 0's port). XDP_TX and XDP_REDIRECT
// then really transmit, as from a NIC's receive queue. But BPF_PROG_RUN runs one frame over and
// over. Identical xdpagg frames are all the same contribution, so every repeat after the first
// would be a duplicate, and that measures the duplicate path, not aggregation. Resetting slot
// state between repeats is impossible, and one syscall per packet measures the syscall (about
// 17µs per live-frame call here, against about 2µs per aggregated packet).
//
// So a small generator program, xdp_gen, runs first and tail-calls the program under test. For
// every packet it copies the 74 bytes of Ethernet/IPv4/UDP/xdpagg headers from a template (live
// frames keep whatever the previous run of that page wrote, such as a broadcast result's
// rewritten addresses). It then writes the next packet of the job into the header: worker w's
// contribution (bitmap 1<<w) to fragment f at slot f mod 2*Window. Each worker sends Window
// fragments back to back, then the next worker does the same, and after the last worker the
// window moves on (the order of SwitchML's pool of 2*window slots). The values are a fixed
// gradient. The generator restores them only in frames that the switch turned into results
// (1 in Workers). So the switch sees the steady state of a real job. Per fragment, one packet
// retakes the job's completed slot from 2*Window fragments earlier, Workers-2 add, and one adds,
// completes, is rewritten into the result and broadcast to all Workers ports. That is Workers
// packets in and Workers packets out, like XDP_TX. After each run the switch's counters are
// checked against this mix: every packet aggregated, 1 in Workers completed, Workers egress
// copies per completion, no duplicates, collisions, PS traffic or errors. Measure fails with
// ErrMix if they disagree. Result.AggCounters has the deltas. AggPPS counts the generator's own
// cost (RunNsPerPacket["generator"], about 40ns) against the switch.
//
// # Method
//
// Each driven program runs in chunks of about 10ms (Repeat sized by a warm-up chunk). The rate is
// packets over wall-clock time, so syscall and page-pool setup are amortised and included. The
// aggregation run and the bare XDP_TX run alternate in 4 slices of Duration/4 each, so both see
// the same machine. AggElementsPerSec = AggPPS * Values and Ratio = AggPPS / TxPPS. The XDP_TX
// baseline is the bare program, without the generator in front of it, which makes Ratio
// conservative. GenTxPPS is the generator in front of XDP_TX, for comparison.
//
// All driven programs are attached somewhere: xdpagg_switch to the ports, and xdp_gen and xdp_tx to
// a spare veth pair that is left down. This matters. BPF_PROG_RUN of XDP with Repeat > 1 installs
// the program in the kernel's XDP dispatcher for the duration of the call. Unless the program is
// already attached, that means rewriting the dispatcher and waiting for an RCU grace period on the
// way in and on the way out: about 8ms per call here, which cut a bare XDP_TX from 6M to 0.13M
// packets/s.
//
// RunNsPerPacket is the kernel's average duration per run of a non-live BPF_PROG_RUN with
// Repeat = RunRepeat (after 1000 warm-up runs), the median of 5 measurements, each from freshly
// reset slots and checked against the switch's counters. The paths are:
//
//   - aggregate: driven by the generator, 31 workers of a fan-in of 32, so nothing completes
//     (the first packet of a fragment reserves its slot; the value loop is the same).
//   - complete: driven by the generator, fan-in 1, so every packet completes a new fragment:
//     sum, rewrite into the result, bpf_redirect_map. The redirect itself only happens with
//     live frames.
//   - duplicate: one frame repeated.
//   - non_agg: a UDP datagram of the same size to another port.
//
// The generator's cost (xdp_gen tail-calling xdp_tx) is subtracted from aggregate and complete.
//
// VerifiedInsns is ProgramInfo.VerifiedInstructions of each switch program (or, on kernels
// before 5.16, the "processed N insns" of a LogLevelStats load), and Insns the length of each
// ProgramSpec's instructions.
package capacity
