/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * xdpagg wire contract and shared map layouts: the single source of truth.
 *
 * Go gets every type here through bpf2go `-type` (see gen.go); docs/protocol.md explains each field.
 * Everything in the xdpagg header and payload is LITTLE-ENDIAN. Workers, parameter servers and the
 * switch are all little-endian machines (x86-64, arm64), so the switch adds values without byte
 * swaps (360 bswaps per packet otherwise) and Go encodes the generated structs with
 * binary.LittleEndian. The Ethernet/IPv4/UDP headers around it stay in network byte order.
 */
#ifndef __XDPAGG_H
#define __XDPAGG_H

#include <linux/types.h>

/* Protocol version carried in every header; a switch drops (as malformed) any other version. */
#define XAGG_VERSION 1

/* Default UDP port of aggregation traffic (data, results, control). Runtime-configurable. */
#define XAGG_DEFAULT_PORT 9510

/* Most values one packet may carry. A 1500-byte MTU holds 360: 1500 - 20 (IPv4) - 8 (UDP) - 32
 * (header) = 1440 bytes. Hosts use as many as their MTU allows, (MTU - 60) / 4, up to this
 * maximum: 832 values fill an MTU of 3388, the largest frame a linear (non-frags) XDP buffer takes
 * on veth (~3500 bytes); a multi-buffer frame cannot be cloned for the broadcast. */
#ifndef XAGG_MAX_VALUES
#define XAGG_MAX_VALUES 832
#endif
/* Values the switch's adder handles per inner pass (see the value loop); divides XAGG_MAX_VALUES. */
#ifndef XAGG_CHUNK
#define XAGG_CHUNK 32
#endif
_Static_assert(XAGG_MAX_VALUES % XAGG_CHUNK == 0 && XAGG_CHUNK % 2 == 0, "XAGG_CHUNK must be even and divide XAGG_MAX_VALUES");
/* Values per packet at the standard 1500-byte MTU. */
#define XAGG_STD_VALUES 360

/* Values one member's MSG_HELP answer carries at most (a part of a result; struct help_body):
 * 32 header + 8 body + 1024 values + 24 trailer = 1088 bytes of UDP payload, inside any MTU of
 * 1280 or more, while a whole 1500-MTU result plus body and trailer would not be. */
#define XAGG_HELP_PART_VALUES 256

/* Workers per job at one aggregation level: one bit each in bitmap0. */
#define XAGG_MAX_WORKERS 32

/* Slots one run of the garbage collector (xdpagg_gc) visits at most. */
#define XAGG_GC_BATCH 256

/*
 * Sparse hot-parameter aggregation (Zebra; docs/sparse.md). The switch holds register arrays of
 * XAGG_REG_SLOTS slots each; a sparse job owns m of them (M = m * reg_slots hot ranks), twice:
 * one buffer per iteration parity.
 */
/* Hot <rank, value> pairs one packet may carry: (3360 - 32 header - 8 sparse header) / 8 at the
 * largest linear MTU (3388); 179 at a 1500-byte MTU. */
#define XAGG_SPARSE_MAX_PAIRS 415
#define XAGG_SPARSE_STD_PAIRS 179
/* Cold <key, value> pairs (12 bytes each) one packet may carry: 276 at MTU 3388, 119 at 1500. */
#define XAGG_COLD_MAX_PAIRS 276
#define XAGG_COLD_STD_PAIRS 119
/* Hot sums one update packet (ENC_SPARSE_HOT) may carry: (3360 - 32 - 8) / 4 at MTU 3388, 358
 * at 1500. */
#define XAGG_HOT_MAX_VALUES 830
#define XAGG_HOT_STD_VALUES 358
/* A rank of an ENC_SPARSE_HOT update that no worker touched (or whose sum is in the update's cold
 * pairs): a NaN no fixed-point sum can produce. */
#define XAGG_HOT_UNTOUCHED 0xffffffffu
/* Hot packets one worker may send the switch for one iteration: one bit each in the dedup record. */
#define XAGG_SPARSE_MAX_PKTS 256
/* Passes of the pipeline one packet may take: the first and up to MAX_PASSES - 1 recirculations
 * (tail calls). Pairs not placed by then go on to the PS. */
#define XAGG_SPARSE_MAX_PASSES 4
/* Slots per register array: the map value's size, fixed at compile time (the runtime r,
 * reg_slots, may be smaller). */
#define XAGG_REG_SLOTS 256
/* Register arrays one job may own (m): the per-pass "touched" mask has this many bits. */
#define XAGG_JOB_MAX_ARRAYS 256
/* Tries of one register add against concurrent adds to the same slot (compare-and-swap). */
#define XAGG_CAS_TRIES 8
/* The rank a placed pair gets in the packet: the pass loop skips it, the PS ignores it. */
#define XAGG_RANK_PLACED 0xffffffffu
/* struct reg_read.hits: the slot's hit counter in these bits, XAGG_REG_THIS_ITER above them. */
#define XAGG_REG_HITS_MASK 0x7fffffffu
#define XAGG_REG_THIS_ITER 0x80000000u

/* The limits above as an enum, so bpf2go exports them to Go (macros do not reach BTF). */
enum limit {
	LIMIT_VERSION = XAGG_VERSION,
	LIMIT_DEFAULT_PORT = XAGG_DEFAULT_PORT,
	LIMIT_MAX_VALUES = XAGG_MAX_VALUES,
	LIMIT_STD_VALUES = XAGG_STD_VALUES,
	LIMIT_MAX_WORKERS = XAGG_MAX_WORKERS,
	LIMIT_HDR_SIZE = 32, /* sizeof(struct hdr); checked by a static assertion below */
	LIMIT_GC_BATCH = XAGG_GC_BATCH,
	LIMIT_CTL_AUTH_SIZE = 24, /* sizeof(struct ctl_auth) */
	LIMIT_JOB_KEY_SIZE = 32,  /* sizeof(struct job_key) */
	LIMIT_SPARSE_MAX_PAIRS = XAGG_SPARSE_MAX_PAIRS,
	LIMIT_SPARSE_STD_PAIRS = XAGG_SPARSE_STD_PAIRS,
	LIMIT_COLD_MAX_PAIRS = XAGG_COLD_MAX_PAIRS,
	LIMIT_COLD_STD_PAIRS = XAGG_COLD_STD_PAIRS,
	LIMIT_SPARSE_MAX_PKTS = XAGG_SPARSE_MAX_PKTS,
	LIMIT_SPARSE_MAX_PASSES = XAGG_SPARSE_MAX_PASSES,
	LIMIT_REG_SLOTS = XAGG_REG_SLOTS,
	LIMIT_JOB_MAX_ARRAYS = XAGG_JOB_MAX_ARRAYS,
	LIMIT_SPARSE_HDR_SIZE = 8, /* sizeof(struct sparse_hdr) */
	LIMIT_HOT_MAX_VALUES = XAGG_HOT_MAX_VALUES,
	LIMIT_HOT_STD_VALUES = XAGG_HOT_STD_VALUES,
	LIMIT_HELP_PART_VALUES = XAGG_HELP_PART_VALUES,
	LIMIT_HELP_BODY_SIZE = 8, /* sizeof(struct help_body) */
	LIMIT_REG_HITS_MASK = XAGG_REG_HITS_MASK, /* XAGG_REG_THIS_ITER is the bit above it */
};

/* Message types (hdr.type). */
enum msg_type {
	MSG_DATA = 1,    /* worker -> switch/PS: one gradient fragment (or a partial aggregate) */
	MSG_RESULT = 2,  /* switch/PS -> workers: the complete sum of a fragment (ATP's parameter/ACK packet) */
	MSG_JOIN = 3,    /* control: worker asks to join a job (iSwitch Join) */
	MSG_LEAVE = 4,   /* control: worker leaves a job (iSwitch Leave) */
	MSG_RESET = 5,   /* control: a member asks the agent to clear its job's slots, registers and records (iSwitch Reset) */
	MSG_ACK = 6,     /* control: acknowledgement of a control message or of a result (retransmit cache) */
	MSG_RETRANSMIT = 7, /* control: iSwitch's Help: a worker asks the switch CPU for a lost result (cache, then members) */
	MSG_HEARTBEAT = 8,  /* control: the controller asks an agent how its switch is; answered with struct heartbeat_stats */
	MSG_PULL = 9,       /* sparse read-out: the PS asks the switch for a range of hot sums; the switch answers in place */
	MSG_HALT = 10,      /* control: a member asks the agent to suspend its job; the agent tells every member (iSwitch Halt) */
	MSG_SETH = 11,      /* control: a member sets its job's aggregation threshold H (iSwitch SetH); body struct seth_body */
	MSG_FBCAST = 12,    /* control: a member asks the switch to force the partial aggregate of <job, seq> out (iSwitch FBcast) */
	MSG_HELP = 13,      /* control: member-assisted Help. agent -> member: header only, "send me result seq";
			     * member -> agent: struct help_body and up to XAGG_HELP_PART_VALUES of its values */
};

/* Value encodings (hdr.encoding). */
enum encoding {
	ENC_FIXED32 = 0, /* int32 fixed point: value = round(x * 2^scale_log2); summed in-switch */
	ENC_FLOAT32 = 1, /* IEEE-754 binary32; summed at the PS (overflow repair); in-switch sums reserved */
	ENC_SPARSE_KV = 2,   /* hot pairs: struct sparse_hdr, then count struct kv_pair (rank, int32 fixed point) */
	ENC_SPARSE_COLD = 3, /* cold pairs: struct sparse_hdr, then count struct cold_pair (key, float32) */
	ENC_SPARSE_HOT = 4,  /* hot sums in an update RESULT: struct sparse_hdr, then count float32 for
			      * ranks bitmap1, bitmap1 + 1, ... (XAGG_HOT_UNTOUCHED: not in it) */
};

/* Header flags (hdr.flags), a bit set. */
enum flag {
	F_RESEND = 1 << 0,    /* retransmitted fragment: switch answers from a completed slot, never reserves */
	F_COLLISION = 1 << 1, /* the switch could not aggregate (slot held by another <job,seq>): PS sums it */
	F_ECN = 1 << 2,       /* congestion seen on the path; copied into the result for the workers' AIMD */
	F_OVERFLOW = 1 << 3,  /* a fixed-point sum overflowed (the switch wraps, the PS saturates) or a value could not be quantised: PS repairs */
	F_LEVEL1 = 1 << 4,    /* already aggregated by a first-level switch: use bitmap1/fan_in1 (ATP edgeSwitchId) */
	F_FROM_SWITCH = 1 << 5, /* result produced by the switch (vs. the PS): diagnostics and counters */
	F_SHADOW = 1 << 6,    /* result re-sent from a completed slot's shadow copy to one worker */
	F_CACHED = 1 << 7,    /* result re-sent by the switch CPU's retransmit cache (agent) to one worker */
	F_REHASH = 1 << 8,    /* PS result after a collision: bitmap1 is the new slot for this seq's slot offset (ATP) */
	F_SPARSE_DONE = 1 << 9, /* sparse DATA the switch hands the PS: this packet completed the iteration's hot sums */
	F_PENDING = 1 << 10,    /* MSG_PULL answer: the switch does not hold a complete iteration seq (no values) */
};

/*
 * The xdpagg header: 32 bytes after the UDP header, followed by `count` values of the encoding.
 * Field order keeps every field naturally aligned.
 */
struct hdr {
	__u8 version;    /* XAGG_VERSION */
	__u8 type;       /* enum msg_type */
	__u8 encoding;   /* enum encoding */
	__u8 scale_log2; /* ENC_FIXED32: fixed-point exponent, so any receiver can decode without job state */
	__u16 flags;     /* enum flag bits */
	__u16 count;     /* number of values that follow; 1..XAGG_MAX_VALUES for data and results */
	__u32 job_id;    /* tenant id; 0 is reserved (never a job) */
	__u32 seq;       /* fragment sequence number within the job, monotonic across allreduces (wraps, serial arithmetic) */
	__u32 agg_index; /* aggregator slot in the switch pool; must be < pool size */
	__u32 bitmap0;   /* first-level contributors: one bit per worker (1 << worker_id) */
	__u32 bitmap1;   /* with F_LEVEL1: second-level contributors; else in DATA the sender's window, in a PS
			  * RESULT with F_REHASH the new slot (docs/protocol.md) */
	__u8 fan_in0;    /* workers that complete a first-level sum */
	__u8 fan_in1;    /* first-level switches that complete a second-level sum (0 = single level) */
	__u8 worker_id;  /* sender's id within the job, 0..31 (membership / anti-spoofing) */
	__u8 reserved;   /* must be 0 */
};

_Static_assert(sizeof(struct hdr) == LIMIT_HDR_SIZE, "struct hdr must stay 32 bytes");

/*
 * Sparse messages (encodings ENC_SPARSE_KV and ENC_SPARSE_COLD, and MSG_PULL) carry this after
 * the header. In sparse DATA and RESULTs, hdr.seq is the training iteration, hdr.agg_index the
 * packet's index among the sender's npkts packets of that kind for the iteration, and hdr.count
 * the pairs that follow (0 in an empty marker). docs/sparse.md has the whole exchange.
 */
struct sparse_hdr {
	__u32 hot_version; /* hot-set version the ranks belong to; every packet of an iteration agrees */
	__u16 npkts;       /* packets of this kind the sender sends for the iteration (>= 1) */
	__u16 spilled;     /* switch -> PS (F_SPARSE_DONE, MSG_PULL answers): hot packets of the
			    * iteration that reached the PS with pairs left to sum; else 0 */
};

_Static_assert(sizeof(struct sparse_hdr) == 8, "struct sparse_hdr must stay 8 bytes");

/* A hot gradient: rank in the job's hot set, [0, M), and its int32 fixed-point value. In a MSG_PULL
 * answer the same 8 bytes are struct reg_read. */
struct kv_pair {
	__u32 rank; /* XAGG_RANK_PLACED once the switch has summed it */
	__s32 val;  /* round(x * 2^scale_log2) */
};

/* A cold gradient (or an update in a PS RESULT): the model's 64-bit parameter key (as two
 * little-endian halves, which is the little-endian u64 on the wire, kept 4-byte aligned so the
 * pair is 12 bytes in C and Go alike) and a float32. Only hosts read these; the switch passes
 * them on. */
struct cold_pair {
	__u32 key_lo;
	__u32 key_hi;
	__u32 val; /* IEEE-754 binary32 bits */
};

_Static_assert(sizeof(struct cold_pair) == 12, "struct cold_pair must stay 12 bytes");

/*
 * One slot of a MSG_PULL answer for iteration t. hits bit 31 (XAGG_REG_THIS_ITER): the cell holds
 * a sum of t, i.e. some worker's pair for this rank was added in t (the sum may still be 0); clear,
 * nobody's was and sum is 0. The PS builds the update's key list from this bit alone: the switch
 * knows which iteration its cell belongs to, while a difference of counters does not survive a
 * counter that restarts (a standby's registers, a reset job). Bits 0-30 (XAGG_REG_HITS_MASK):
 * the adds the slot's buffer has taken since its registers were last zeroed (admission, reset, or
 * a switch that started empty), mod 2^31; only hot-key ranking uses them.
 */
struct reg_read {
	__s32 sum;  /* the iteration's fixed-point sum at this rank (0: nobody sent it) */
	__u32 hits; /* XAGG_REG_THIS_ITER | the slot's hit counter & XAGG_REG_HITS_MASK */
};

/*
 * A register array: map `registers`, ARRAY keyed by parity * reg_arrays + array (u32, host order),
 * where a job owns arrays [reg_base, reg_base + m) of each parity. cells[s] holds the slot's sum
 * and the iteration it belongs to: bits 0-31 the int32 sum, bits 32-62 the iteration (mod 2^31),
 * bit 63 set when an add overflowed. A slot whose iteration is not the one asked for reads as
 * zero, so a buffer is zero for iteration t+2 without being cleared. hits[s] counts adds (wraps
 * at 2^32; the read-out keeps its low 31 bits). A cell never added to is all zero, which is also
 * the tag of iteration 0 (mod 2^31): a zero hit counter tells the two apart (but for a counter
 * wrapped to exactly 0, docs/sparse.md Read-out).
 */
struct reg_array {
	__u64 cells[XAGG_REG_SLOTS];
	__u32 hits[XAGG_REG_SLOTS];
};

/* A sparse job's record of one iteration (one per parity): which hot packets each worker has sent,
 * so a retransmitted or duplicated packet never adds twice, and when the iteration is complete. */
struct sparse_iter {
	__u32 iter;       /* iteration the record holds */
	__u32 version;    /* its hot-set version (from its first packet) */
	__u16 npkts[XAGG_MAX_WORKERS]; /* hot packets each worker announced; 0: none seen yet */
	__u16 done[XAGG_MAX_WORKERS];  /* packets of each worker whose pairs are all summed or handed to the PS */
	__u64 seen[XAGG_MAX_WORKERS][XAGG_SPARSE_MAX_PKTS / 64]; /* packets taken (claimed at their first pass) */
	__u16 spilled;    /* packets handed to the PS with pairs left */
	__u8 fan_in;      /* workers of the iteration (from its first packet) */
	__u8 state;       /* enum sparse_state */
	__u32 pad;
};

enum sparse_state {
	SPARSE_EMPTY = 0,    /* never used */
	SPARSE_OPEN = 1,     /* taking packets */
	SPARSE_COMPLETE = 2, /* every worker's packets are in: the PS may pull */
};

/* Map `sparse_jobs`, HASH keyed by job_id (u32, host order): made at admission for a sparse job.
 * Both records change only under `lock`. Host order. */
struct sparse_job {
	struct bpf_spin_lock lock;
	__u32 pad;
	struct sparse_iter it[2]; /* by iteration parity */
};

/* The per-CPU progress of one hot packet through its passes (map `sparse_pass`): the pairs are
 * copied here at the first pass and marked XAGG_RANK_PLACED as they are summed, so each tail call
 * (recirculation) picks up where the last pass stopped. Host order. */
struct sparse_pass {
	__u32 job_id;
	__u32 iter;
	__u32 key_base; /* `registers` key of the job's array 0 for the iteration's parity */
	__u32 arrays;   /* m of the job */
	__u32 tag;      /* iteration tag of the cells (iter mod 2^31) */
	__u16 npairs;   /* pairs in the packet */
	__u16 left;     /* pairs not placed yet */
	__u8 worker;    /* sender's worker id */
	__u8 pass;      /* passes done */
	__u16 index;    /* packet index */
	__u32 pad;
	__u64 touched[XAGG_JOB_MAX_ARRAYS / 64]; /* arrays touched in the current pass */
	struct kv_pair pairs[XAGG_SPARSE_MAX_PAIRS];
};

/*
 * Body of a member's MSG_HELP answer (member -> agent): between the header and the values. The
 * header is the result's as the member received it (encoding, scale_log2, flags, seq, agg_index,
 * bitmaps, fan-ins), but type MSG_HELP, worker_id the answering member's and count the values in
 * this part. A result of `total` values travels in ceil(total / XAGG_HELP_PART_VALUES) parts,
 * part i holding values [i * XAGG_HELP_PART_VALUES, min(total, (i+1) * XAGG_HELP_PART_VALUES)):
 * with the body and the ctl_auth trailer a whole result would not fit the MTU it was cut for.
 * Host order (little-endian), like the header.
 */
struct help_body {
	__u16 total;    /* values of the whole result, 1..XAGG_MAX_VALUES */
	__u16 offset;   /* index of this part's first value: a multiple of XAGG_HELP_PART_VALUES */
	__u32 reserved; /* 0 */
};
_Static_assert(sizeof(struct help_body) == LIMIT_HELP_BODY_SIZE, "struct help_body must stay 8 bytes");

/*
 * Body of MSG_JOIN / MSG_LEAVE (after a header with count = 0, before the struct ctl_auth
 * trailer): what the switch needs to send a job's results to this worker. The worker's IP and UDP
 * port are the packet's source; the switch port is where the packet arrived. Answered by an
 * authenticated MSG_ACK from the agent.
 */
struct join_body {
	__u8 mac[6];     /* worker's MAC on its link to the switch */
	__u16 reserved;  /* 0 */
	__u32 result_ip; /* 0, or the job's PS address (network byte order): results always carry the
			  * admitted PS's address; a JOIN can never choose another */
};

/*
 * Body of MSG_SETH (after a header with count = 0, before the struct ctl_auth trailer): the job's
 * new aggregation threshold. Little-endian. Answered by an authenticated MSG_ACK.
 */
struct seth_body {
	__u32 threshold; /* H, 1..the job's admitted workers (else the agent refuses it: bad_threshold) */
};

/* Slot states (slot.state). */
enum slot_state {
	SLOT_FREE = 0,
	SLOT_AGGREGATING = 1, /* reserved by <job,seq>, waiting for more contributions */
	SLOT_COMPLETE = 2,    /* sum complete; kept as the shadow copy for retransmits until reused */
};

/*
 * One aggregator (ATP Fig. 6 / a SwitchML slot). Map `slots`, ARRAY keyed by agg_index (u32, host
 * order). All fields are updated under `lock`. Values are host-order (little-endian) int32.
 */
struct slot {
	struct bpf_spin_lock lock;
	__u32 job_id;    /* owner of the slot while state != SLOT_FREE */
	__u32 seq;       /* fragment the slot aggregates */
	__u32 bitmap;    /* contributors already summed (packet bitmap of the switch's level) */
	__u16 nvals;     /* value count of this fragment; every contribution must match */
	__u8 state;      /* enum slot_state */
	__u8 counter;    /* contribution packets summed (a packet may carry several contributors) */
	__u8 fan_in;     /* contributors (bitmap bits) that complete the sum */
	__u8 scale_log2; /* copied from the first packet */
	__u16 flags;     /* F_ECN | F_OVERFLOW accumulated over contributions */
	__u64 ts_ns;     /* bpf_ktime_get_ns() of the last update: age for reclaiming abandoned slots */
	__s32 vals[XAGG_MAX_VALUES];
};

/*
 * Where a job's results go out of one switch port. Map `members`, HASH keyed by struct member_key.
 * The devmap egress program rewrites each broadcast copy of a result with this.
 */
struct member_key {
	__u32 job_id;  /* host order */
	__u32 ifindex; /* switch port (egress ifindex), host order */
};

struct member {
	__u8 dst_mac[6]; /* worker's MAC */
	__u8 src_mac[6]; /* switch port's MAC */
	__u32 dst_ip;    /* worker's IPv4, network byte order */
	__u32 src_ip;    /* source address results carry (the PS), network byte order */
	__u16 dst_port;  /* worker's UDP port, network byte order */
	__u8 worker_id;  /* worker id within the job */
	__u8 pad;
};

/*
 * Who may contribute to a job: map `workers`, HASH keyed by struct worker_key. Written by the
 * control plane on JOIN (maps.PutMember / PutWorker). A DATA packet is summed or passed on only if
 * its <job, worker_id> is here and its source address, UDP port and ingress port match, and its
 * contributor bit is exactly 1 << worker_id: no spoofed ids, no foreign bits.
 */
struct worker_key {
	__u32 job_id;    /* host order */
	__u32 worker_id; /* 0..XAGG_MAX_WORKERS-1, host order */
};

struct worker {
	__u32 ip;      /* worker's IPv4 (packet source), network byte order */
	__u32 ifindex; /* switch port it is behind (ingress ifindex), host order */
	__u16 port;    /* worker's UDP source port, network byte order */
	__u16 pad;
};

/*
 * A job admitted by the operator (`xdpagg job add`, maps.AddJob): map `jobs`, HASH keyed by job_id
 * (u32, host order). Nothing of a job exists before admission: JOINs, DATA and RESULTs of an
 * unknown job are dropped. Only the control plane writes it, except `held`, which the datapath
 * and the garbage collector change with atomic adds.
 */
struct job {
	__u32 ps_ip;      /* the job's parameter server, network byte order: the only RESULT source */
	__u32 ps_ifindex; /* switch port the PS is behind (RESULTs must arrive there), host order */
	__u16 ps_port;    /* the PS's UDP port (RESULTs' source port), network byte order */
	__u8 fan_in;      /* admitted workers: the agent binds worker ids below it (the datapath takes
			   * fan_in0 from DATA: members are trusted with their own job's sums) */
	__u8 threshold;   /* H, asynchronous aggregation (iSwitch): a dense slot completes once it holds
			   * H distinct contributions, if H < its fan-in; 0 = the fan-in (synchronous).
			   * Set at admission, changed at run time only by xdpagg_gc's OP_SET_H (one
			   * byte stored in place, read with READ_ONCE): a map update would replace
			   * the entry and lose `held`'s concurrent atomic adds. */
	__u32 max_slots;  /* most aggregator slots the job may hold at once (quota), host order */
	__s32 held;       /* slots the job holds now (aggregating or shadow copy); atomic, host order.
			   * The control plane writes a job at admission, and again only in a restore
			   * before the job's traffic arrives (maps.AddHeld): a rewrite loses adds. */
	__u16 reg_base;   /* sparse jobs: first register array the job owns (of each parity) */
	__u16 reg_arrays; /* sparse jobs: register arrays it owns (m); 0: a dense job */
};

/*
 * A job's control key: map `job_keys`, HASH keyed by job_id (u32, host order). Written by `xdpagg
 * job add`, read by the agent to authenticate control messages; never read by XDP (it lives in
 * the switch's pinned maps only so the CLI and the agent share it; the pin directory is 0700).
 */
struct job_key {
	__u8 key[32]; /* HMAC-SHA256 key, random, made at admission */
};

/*
 * Authentication trailer of every control message (JOIN, LEAVE, RESET, HALT, SETH, FBCAST, ACK,
 * RETRANSMIT, HELP answers, and the agent's ACK answers, HALT notices and HELP requests):
 * appended after the header and body.
 * tag = HMAC-SHA256(job key, every byte before tag), first 16 bytes. stamp orders a sender's messages for replay protection: the receiver
 * accepts only a stamp above the last it accepted from that sender and within a freshness window
 * of its own clock (docs/security.md).
 */
struct ctl_auth {
	__u64 stamp;  /* sender's wall clock, ns since the Unix epoch, strictly increasing; little-endian */
	__u8 tag[16]; /* truncated HMAC-SHA256 */
};

_Static_assert(sizeof(struct ctl_auth) == LIMIT_CTL_AUTH_SIZE, "struct ctl_auth must stay 24 bytes");
_Static_assert(sizeof(struct job_key) == LIMIT_JOB_KEY_SIZE, "struct job_key must stay 32 bytes");

/*
 * Body of the agent's MSG_HEARTBEAT answer to the controller, which travels encrypted (AES-256-GCM
 * under a key derived from the switch's controller key; layout in docs/protocol.md, Go
 * ctlauth.HeartbeatAnswers). The request has no body and the struct ctl_auth trailer under the
 * controller key; both have job_id 0. Little-endian.
 * Counters are cumulative since the switch was loaded; the controller differences them.
 */
struct heartbeat_stats {
	__u64 uptime_ns;        /* since this agent started */
	__u32 pool_size;        /* aggregator slots */
	__u32 slots_held;       /* slots the admitted jobs hold (aggregating or shadow copies) */
	__u32 jobs;             /* admitted jobs */
	__u32 members;          /* job members (egress) */
	__u32 reg_arrays;       /* register arrays per parity */
	__u32 reg_arrays_used;  /* of which sparse jobs own */
	__u64 rx;               /* xdpagg packets seen */
	__u64 aggregated;       /* DATA summed in slots */
	__u64 to_ps;            /* DATA sent on to the PS */
	__u64 duplicate;        /* DATA already summed (resends) */
	__u64 dropped;          /* malformed, not_member, spoofed, ip_invalid and ctl_limited */
	__u64 cache_entries;    /* retransmit cache: results held */
	__u64 cache_hits;       /* RETRANSMITs answered from it */
	__u64 cache_misses;     /* RETRANSMITs it could not answer */
	__u64 control_refused;  /* control messages the agent refused */
	/* Resend evidence for the controller's degradation policy (Libra §3.6: loss and resend
	 * rates): what the switch answered to workers' F_RESEND DATA. With cache_hits and
	 * cache_misses (RETRANSMIT requests) and duplicate, per aggregated packet, it says how much
	 * the workers are resending through this switch. */
	__u64 completed;        /* sums completed in-switch (CNT_COMPLETED) */
	__u64 shadow_tx;        /* resends answered from a completed slot's shadow copy (CNT_SHADOW_TX) */
	__u64 flushed;          /* resends that flushed a half-filled slot to the PS (CNT_FLUSHED) */
};

/*
 * Arguments and answer of `xdpagg_gc`, the in-kernel slot garbage collector the agent runs with
 * BPF_PROG_TEST_RUN: the program frees, each under its slot's spin lock, the slots in
 * [first, first + count) that match, and writes how many it freed into `freed`. Host order.
 */
struct gc_args {
	__u32 first;  /* first slot index */
	__u32 count;  /* slots to visit, at most XAGG_GC_BATCH */
	__u32 job_id; /* 0: free slots idle past the slot timeout; else: free every slot of this job */
	__u32 freed;  /* out: slots freed */
	__u64 now_ns; /* out: the datapath's clock (bpf_ktime_get_ns), which ages slots */
};

/*
 * A completed in-switch sum as copied to the `results` ring buffer for the agent's retransmit
 * cache (Libra's switch-CPU copy): the result's xdpagg header (little-endian, as on the wire:
 * type MSG_RESULT, flags with F_FROM_SWITCH) and its first hdr.count values. A sparse update
 * packet from the PS (ENC_SPARSE_HOT, ENC_SPARSE_COLD) is copied the same way: its header, struct
 * sparse_hdr and hdr.count sums or pairs (at most 3,360 bytes, which vals holds). Fixed size; the
 * tail past the packet is undefined.
 */
struct result_rec {
	struct hdr h;
	__s32 vals[XAGG_MAX_VALUES];
};

/*
 * A slot operation of the agent, run like the garbage collector: `xdpagg_gc` on a "packet" of
 * exactly sizeof(struct slot_op) bytes (a struct gc_args-sized one is a collection). Each
 * operation happens in the kernel under the lock that the datapath takes, so it never races a
 * packet. Host order.
 */
enum slot_op_kind {
	OP_SET_H = 1, /* jobs[job_id].threshold = threshold (in place) */
	OP_FLUSH = 2, /* FBcast: complete the slot agg_index if it aggregates <job_id, seq>, and copy
		       * its sum out into rec */
};

enum slot_op_status {
	OPS_NONE = 0,     /* nothing done: no such job, or the slot holds no aggregation of <job, seq> */
	OPS_SET = 1,      /* OP_SET_H: written */
	OPS_FLUSHED = 2,  /* OP_FLUSH: the slot held a partial aggregate; it is complete now, rec holds it */
	OPS_COMPLETE = 3, /* OP_FLUSH: the slot was complete already; rec holds its sum */
};

struct slot_op {
	__u32 op;        /* enum slot_op_kind */
	__u32 job_id;
	__u32 seq;       /* OP_FLUSH: the fragment */
	__u32 agg_index; /* OP_FLUSH: its slot */
	__u32 threshold; /* OP_SET_H: the new H (0..XAGG_MAX_WORKERS) */
	__u32 status;    /* out: enum slot_op_status */
	struct result_rec rec; /* out (OPS_FLUSHED, OPS_COMPLETE): the sum as a MSG_RESULT with
				* F_FROM_SWITCH, bitmap0 its contributors, fan_in0 the slot's fan-in */
};

/*
 * Congestion at a switch port as XDP ingress can see it: a phantom (virtual) queue of the
 * arrival rate against the port's configured capacity (HULL). Map `port_queues`, HASH keyed by
 * ingress ifindex (u32, host order), created on a port's first packet. Host order.
 */
struct port_queue {
	struct bpf_spin_lock lock;
	__u32 pad;
	__u64 vq_bytes; /* virtual backlog: bytes arrived beyond what the capacity drains */
	__u64 last_ns;  /* bpf_ktime_get_ns() of the last update */
	__u64 marks;    /* DATA packets marked F_ECN at this port */
};

/*
 * A port's control-message budget (map `ctl_budget`): GCRA, one message per ctl_interval_ns with
 * bursts up to ctl_burst_ns of credit. Host order.
 */
struct ctl_bucket {
	struct bpf_spin_lock lock;
	__u32 pad;
	__u64 tat;     /* theoretical arrival time of the next message, bpf_ktime_get_ns() */
	__u64 dropped; /* messages dropped at this port for being over budget */
};

/*
 * The agent's retransmit cache, as `xdpagg inspect` sees it: map `cache_stats`, a one-entry ARRAY
 * (key 0) that the agent creates and pins next to the switch's maps and rewrites as it works.
 * Host order.
 */
struct cache_stats {
	__u64 entries;       /* results held now */
	__u64 bytes;         /* their size */
	__u64 stored;        /* results taken from the `results` ring buffer */
	__u64 hits;          /* MSG_RETRANSMIT answered from the cache */
	__u64 misses;        /* MSG_RETRANSMIT for a result not (or no longer) cached: answered with MSG_ACK */
	__u64 evicted_acked; /* dropped because every worker of the job acknowledged them */
	__u64 evicted_age;   /* dropped by age (or to stay under the size limit) */
	__u64 acks;          /* MSG_ACK watermarks received from workers */
};

/*
 * Per-CPU counters. Map `counters`, a one-entry PERCPU_ARRAY whose value is struct counters: one
 * u64 (host order) per enum counter.
 * Source validation comes first: an IPv4 or ARP frame whose source address the ingress port may
 * not send counts in CNT_SPOOFED alone. Every other packet at the aggregation port counts in
 * CNT_RX and in exactly one verdict: AGGREGATED, DUPLICATE, TO_PS, MALFORMED, IP_INVALID,
 * NOT_MEMBER, PS_RESULT, SHADOW_TX, CONTROL, CTL_LIMITED, SPARSE_STALE or PULL (bar the
 * XDP_ABORTED paths, which cannot happen for a frame that parsed). COMPLETED, COLLISION, OVERFLOW,
 * RECLAIMED, FLUSHED, CACHED, CACHE_FULL, ECN_MARKED, OVER_QUOTA, REDIRECT_ERR, SPARSE_PAIRS,
 * SPARSE_SPILLED, SPARSE_DONE, RECIRCULATED, PULL_PENDING, REG_OVERFLOW and TAILCALL_ERR count
 * events on top of a verdict;
 * EGRESS_* count broadcast copies per port; NON_AGG counts the other frames that pass source
 * validation.
 */
enum counter {
	CNT_RX = 0,          /* xdpagg packets (UDP to the aggregation port) seen at ingress */
	CNT_AGGREGATED,      /* data packets summed into a slot (including the completing one) */
	CNT_COMPLETED,       /* sums completed in-switch and broadcast to the job */
	CNT_DUPLICATE,       /* data packets whose contributor was already in the slot: dropped */
	CNT_COLLISION,       /* data packets sent on to the PS because the slot was held by another <job,seq> */
	CNT_OVERFLOW,        /* completed sums that overflowed (or had a flagged contribution): broadcast with F_OVERFLOW for PS repair */
	CNT_TO_PS,           /* data packets sent on to the PS for any reason (collision, encoding, resend) */
	CNT_MALFORMED,       /* truncated, lying lengths, bad version/type/encoding/index: dropped */
	CNT_NON_AGG,         /* not xdpagg traffic: passed to the kernel to be forwarded or delivered */
	CNT_PS_RESULT,       /* results from the PS broadcast to the job */
	CNT_SHADOW_TX,       /* retransmitted fragments answered from a completed slot (shadow copy) */
	CNT_RECLAIMED,       /* slots taken over by a packet: idle past the timeout (any job), or the job's own older half-filled one; not the agent's GC */
	CNT_EGRESS_TX,       /* result copies rewritten and sent out a member port */
	CNT_EGRESS_SKIP,     /* result copies dropped on ports with no member of the job */
	CNT_REDIRECT_ERR,    /* broadcasts bpf_redirect_map refused (copies lost later are not seen here) */
	CNT_CONTROL,         /* control messages passed up to the agent */
	CNT_NOT_MEMBER,      /* DATA from a non-member or with a spoofed id/bit, RESULTs not from the job's PS: dropped */
	CNT_FLUSHED,         /* resends that flushed a half-filled slot's partial aggregate to the PS (ATP) */
	CNT_CACHED,          /* completed sums and sparse update packets copied to the agent's retransmit cache (ring buffer) */
	CNT_CACHE_FULL,      /* completed sums (and sparse update packets) the ring buffer had no room for */
	CNT_ECN_MARKED,      /* DATA that arrived while its port's phantom queue was over the threshold: F_ECN set */
	CNT_SPOOFED,         /* IPv4 or ARP frames whose source the port may not send (strict uRPF): dropped */
	CNT_IP_INVALID,      /* frames to the xdpagg port with IP options, as fragments, or with a bad IPv4 checksum: dropped */
	CNT_OVER_QUOTA,      /* data sent on to the PS because its job holds its quota of slots */
	CNT_CTL_LIMITED,     /* control messages over their port's rate budget: dropped */
	CNT_SPARSE_STALE,    /* hot packets of an iteration the switch no longer (or does not yet) hold, or of another hot-set version: dropped */
	CNT_SPARSE_PAIRS,    /* hot pairs summed into registers */
	CNT_SPARSE_SPILLED,  /* hot pairs handed to the PS unsummed (pass bound, contention) */
	CNT_SPARSE_DONE,     /* iterations whose hot sums completed (F_SPARSE_DONE sent to the PS) */
	CNT_RECIRCULATED,    /* passes beyond the first: tail calls back into the pipeline */
	CNT_PULL,            /* MSG_PULL read-outs answered (with values or F_PENDING) */
	CNT_PULL_PENDING,    /* ... of which answered F_PENDING */
	CNT_REG_OVERFLOW,    /* register adds that overflowed int32 (the PS refuses the sum) */
	CNT_TAILCALL_ERR,    /* tail calls that failed: the packet's pairs went to the PS */
	CNT_MAX,
};

struct counters {
	__u64 cnt[CNT_MAX];
};

/* Per-CPU scratch for the partial last chunk of a fragment (full chunks are summed in the packet). */
struct scratch {
	__s32 vals[XAGG_CHUNK];
};

#endif /* __XDPAGG_H */
