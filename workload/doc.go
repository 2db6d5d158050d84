// Package workload models the sparse gradients of data-parallel training for xdpagg's hot-parameter
// aggregation (after Zebra, Pan et al., "Accelerating Distributed Sparse Deep Training with
// In-network Gradient Aggregation for Hot Parameters"): which parameter rows (keys) each worker's
// gradient touches in each iteration, and deterministic values for them.
//
// Zebra's observation (§III-A, Figure 4) is that update frequencies are extremely skewed: a few
// thousand hot rows out of millions take half or more of all updates, so a switch with room for
// only those rows still aggregates most of the traffic. A Trace records the key sets; TopShare
// measures that skew; Generate synthesises traces from a Zipf law; Fit finds the Zipf exponent that
// reproduces a measured skew; ZebraPoints are Figure 4's data points as generator presets; and
// testdata/ holds traces recorded from a real sparse model (record/record_ctr.py, see
// testdata/README.md), against which the generator is checked.
//
// The package imports only the standard library and has nothing Linux-specific, so that
// benchmarks, simulations and tests can use it anywhere.
//
// # Trace file format
//
// A trace file is one gzip stream (RFC 1952; concatenated members are read as one stream, as
// compress/gzip does) whose decompressed content is, all integers little-endian:
//
//	magic     8 bytes   "XAGGTRC1"
//	nameLen   uint16    length of name, at most MaxNameLen
//	name      nameLen bytes
//	keySpace  uint64    every key is < keySpace
//	iters     uint32    number of iterations
//	workers   uint32    number of workers (0 if and only if iters is 0)
//	then iters*workers batches, iteration-major (all workers of iteration 0, then iteration 1, ...):
//	  n       uvarint   number of keys in the batch
//	  k[0]    uvarint   first key
//	  d[j]    uvarint   for j = 1..n-1: k[j] - k[j-1] - 1
//
// and nothing after the last batch. Coding the gap minus one makes every encodable batch strictly
// increasing, so "sorted and distinct" needs no separate check, and the small gaps between hot
// rows (which the recorded traces number by frequency) become runs of zero bytes that gzip
// compresses well. uvarint is encoding/binary's (LEB128); overlong encodings are rejected.
//
// Read rejects anything else with an error wrapping ErrBadTrace and never trusts a length before
// checking it: names, worker counts, batch counts and key counts are held to MaxNameLen,
// MaxWorkers, MaxBatches and MaxKeys, and key slices grow with the keys actually decoded rather
// than being sized from the claimed count, so memory stays proportional to the decompressed input
// and bounded even for a decompression bomb.
package workload
