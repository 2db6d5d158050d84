// Package sparse holds the host-side algorithms of sparse hot-parameter aggregation after Zebra
// ("Accelerating Distributed Sparse Deep Learning with In-network Gradient Aggregation", §III-C
// and §III-D): which parameters are hot, where each hot parameter lives in the switch's register
// file, and how a worker packs its hot gradients into packets so that the switch rarely has to
// recirculate one. It imports only the standard library and never touches the network, so it
// builds and tests anywhere; the datapath that consumes its output is in bpf/ (bpf/sparse.h).
//
// The pieces, in the order a job uses them:
//
//   - Hot identification. RankByFrequency orders keys by update frequency (a Ranking, hottest
//     first) and ChooseK applies Zebra's Principle 1 to pick k: the fewest hottest keys that
//     carry a share p of all updates, capped by the fraction c of switch memory the job may use
//     (4 bytes per register value). The frequencies come either offline from a sample of the
//     training data (SampledRanking, Zebra's sampling-based method) or online from the running
//     job (Online, Zebra's iteration-based method, which re-ranks every Period iterations and
//     proposes a new hot set only when it differs enough, by KendallTauDistance, from the one in
//     use). Precision and KendallTauDistance are the two accuracy measures of Zebra §V-C.
//
//   - Rank mapping. A HotSet maps the k hot keys to dense ranks [0, k) and back, so that a rank
//     can index the switch's registers directly and workers can restore keys from results.
//
//   - Placement. A Layout is the switch's register file, m arrays of r slots. Zebra's heat-based
//     placement puts rank i in array i % m: hot ranks of similar heat, which tend to appear in
//     the same packet, land in different arrays, because a switch pipeline (and our XDP pass
//     loop) may touch each register array only once per pass. Permutation models the random
//     placement Zebra compares against.
//
//   - Packing. Pack is Zebra's Algorithm 1 (PARAMETER_ORCHESTRATING): it spreads one worker's
//     hot ranks over packets so that, where possible, no packet carries two ranks of the same
//     array. PackInOrder is the layout-unaware baseline. Passes and Recirculations model what
//     the datapath then does with a packet: one pass per round of array accesses, a
//     recirculation for each pass after the first, and the PS for whatever is left after the
//     last pass allowed.
//
// Every function is deterministic: ties are broken by key, and the random ones take a seed.
// Nothing here logs or exits; errors wrap the sentinel errors below (test with errors.Is), and
// functions without an error result panic only on arguments that are programming errors (a
// non-positive array count or packet size), as slice indexing would.
package sparse

import "errors"

// Sentinel errors. Functions wrap them with details; test with errors.Is.
var (
	// ErrBadParameter: an argument is out of its documented range; the message says which.
	ErrBadParameter = errors.New("bad parameter")
	// ErrDuplicateKey: a ranking that must list each key once lists one twice.
	ErrDuplicateKey = errors.New("duplicate key")
)
