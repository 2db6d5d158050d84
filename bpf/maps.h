/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The switch's maps and its runtime configuration: what every program of xdpagg.c shares. Each
 * map says what its key and value mean and in which byte order. Included once, by xdpagg.c.
 */
#ifndef __XDPAGG_MAPS_H
#define __XDPAGG_MAPS_H

/* Runtime configuration, set by the loader through VariableSpec.Set before load. */
volatile const __u16 agg_port = XAGG_DEFAULT_PORT;  /* UDP port of xdpagg traffic, host order */
volatile const __u32 pool_size = 1;                 /* slots in `slots`; agg_index must be below */
volatile const __u64 slot_timeout_ns = 5000000000ULL; /* idle age after which any slot may be taken by anyone */
volatile const __u32 cache_results = 0; /* nonzero: copy every completed sum and sparse update to `results` (agent's retransmit cache) */
volatile const __u64 port_rate_Bps = 0;     /* ports' capacity for the ECN phantom queue, bytes/s; 0: no marking */
volatile const __u64 ecn_threshold_bytes = 65536; /* phantom backlog above which DATA is marked F_ECN */
volatile const __u32 source_check = 1; /* nonzero: strict uRPF on every port (docs/security.md) */
volatile const __u64 ctl_interval_ns = 50000; /* control messages per port: one per interval on average (20,000/s) */
volatile const __u64 ctl_burst_ns = 100000000; /* ... and a burst of burst/interval messages (2,000) */
volatile const __u32 reg_arrays = 512; /* register arrays per parity buffer (`registers` holds 2x) */
volatile const __u32 reg_slots = XAGG_REG_SLOTS; /* r: slots used per register array, <= XAGG_REG_SLOTS */

#ifndef XAGG_POOL_SIZE
#define XAGG_POOL_SIZE 4096 /* default max_entries of `slots`; the loader sets the real pool size */
#endif
#ifndef XAGG_MAX_PORTS
#define XAGG_MAX_PORTS 64
#endif
#ifndef XAGG_MAX_MEMBERS
#define XAGG_MAX_MEMBERS 4096
#endif
#ifndef XAGG_MAX_JOBS
#define XAGG_MAX_JOBS 1024
#endif
#ifndef XAGG_REG_ARRAYS
#define XAGG_REG_ARRAYS 1024 /* default max_entries of `registers`; the loader sets 2 * reg_arrays */
#endif
#ifndef XAGG_MAX_SPARSE_JOBS
#define XAGG_MAX_SPARSE_JOBS 64
#endif
#ifndef XAGG_RESULTS_RING
#define XAGG_RESULTS_RING (8 << 20) /* bytes: about 2,400 results of 832 values */
#endif

/* Aggregator pool. Key: agg_index (u32, host order). Value: struct slot (host order, spin-locked). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, XAGG_POOL_SIZE);
	__type(key, __u32);
	__type(value, struct slot);
} slots SEC(".maps");

/* Switch ports that results are broadcast to. Key: ifindex (u32, host order). Value: devmap value
 * with xdpagg_egress as the per-port program. */
struct {
	__uint(type, BPF_MAP_TYPE_DEVMAP_HASH);
	__uint(max_entries, XAGG_MAX_PORTS);
	__type(key, __u32);
	__type(value, struct bpf_devmap_val);
} ports SEC(".maps");

/* Job members per port. Key: struct member_key (host order). Value: struct member (addresses in
 * network order). Written by the control plane. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XAGG_MAX_MEMBERS);
	__type(key, struct member_key);
	__type(value, struct member);
} members SEC(".maps");

/* Job contributors, for the ingress membership check. Key: struct worker_key (host order). Value:
 * struct worker (address and port in network order, ifindex host order). Written by the control
 * plane. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XAGG_MAX_MEMBERS);
	__type(key, struct worker_key);
	__type(value, struct worker);
} workers SEC(".maps");

/* Jobs. Key: job_id (u32, host order). Value: struct job (ps_ip network order). Written by the
 * control plane. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XAGG_MAX_JOBS);
	__type(key, __u32);
	__type(value, struct job);
} jobs SEC(".maps");

/* Job control keys, read by the agent and written by `xdpagg job add`; never read here. Key: job_id
 * (u32, host order). Value: struct job_key. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XAGG_MAX_JOBS);
	__type(key, __u32);
	__type(value, struct job_key);
} job_keys SEC(".maps");

/* Control-message rate budget per port (GCRA). Key: ingress ifindex (u32, host order). Value:
 * struct ctl_bucket (host order, spin-locked); made on a port's first control message. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XAGG_MAX_PORTS);
	__type(key, __u32);
	__type(value, struct ctl_bucket);
} ctl_budget SEC(".maps");

/* Completed in-switch sums and the PS's sparse updates for the agent's retransmit cache (when
 * cache_results is set): records of struct result_rec (header little-endian as on the wire). */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, XAGG_RESULTS_RING);
} results SEC(".maps");

/* Phantom queues for ECN marking. Key: ingress ifindex (u32, host order). Value: struct
 * port_queue (host order, spin-locked). Entries are made by the program on a port's first packet
 * when port_rate_Bps is set. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XAGG_MAX_PORTS);
	__type(key, __u32);
	__type(value, struct port_queue);
} port_queues SEC(".maps");

/* Verdict counters. Key: 0 (one entry). Value: struct counters per CPU, indexed by enum counter,
 * host order. One entry, looked up once per packet: a switch touches each register array once per
 * pass, and one lookup is cheaper than one per counter bump. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct counters);
} counters SEC(".maps");

/* One-entry per-CPU scratch for the partial last chunk of a fragment (zero-padded to a chunk). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct scratch);
} scratch_buf SEC(".maps");

/* Hot-parameter registers (sparse jobs). Key: parity * reg_arrays + array (u32, host order).
 * Value: struct reg_array (cells: iteration tag and int32 sum, host order; hits host order). Sums
 * are changed with compare-and-swap, hits with atomic adds; the control plane zeroes a job's
 * arrays at admission. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, XAGG_REG_ARRAYS);
	__type(key, __u32);
	__type(value, struct reg_array);
} registers SEC(".maps");

/* Sparse jobs' iteration records. Key: job_id (u32, host order). Value: struct sparse_job (host
 * order, spin-locked). Made (zeroed) by the control plane when it admits a sparse job. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XAGG_MAX_SPARSE_JOBS);
	__type(key, __u32);
	__type(value, struct sparse_job);
} sparse_jobs SEC(".maps");

/* A hot packet's progress through its passes. Key: 0. Value: struct sparse_pass per CPU: a tail
 * call runs on the CPU that made it, before that CPU takes another packet. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct sparse_pass);
} sparse_pass SEC(".maps");

/* Recirculation histogram. Key: passes a hot packet took, 1..XAGG_SPARSE_MAX_PASSES (0: an empty
 * marker, no pairs), u32 host order. Value: packets, u64 per CPU. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, XAGG_SPARSE_MAX_PASSES + 1);
	__type(key, __u32);
	__type(value, __u64);
} recirc_hist SEC(".maps");

static __always_inline struct counters *counters_get(void)
{
	__u32 zero = 0;
	return bpf_map_lookup_elem(&counters, &zero);
}

static __always_inline void count(struct counters *c, __u32 id)
{
	if (c && id < CNT_MAX)
		c->cnt[id] += 1; /* per-CPU: no atomics needed */
}

/* Fields that other CPUs change outside the value's lock (atomic adds, the agent's updates in place). */
#ifndef READ_ONCE
#define READ_ONCE(x) (*(volatile typeof(x) *)&(x))
#endif
#ifndef WRITE_ONCE
#define WRITE_ONCE(x, v) (*(volatile typeof(x) *)&(x) = (v))
#endif

/* The entry of a per-port map (keyed by ifindex) for this port, made from zero on first use. */
static __always_inline void *port_entry(void *map, __u32 ifindex, void *zero)
{
	void *v = bpf_map_lookup_elem(map, &ifindex);
	if (v)
		return v;
	bpf_map_update_elem(map, &ifindex, zero, BPF_NOEXIST);
	return bpf_map_lookup_elem(map, &ifindex);
}

#endif
