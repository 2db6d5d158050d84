package hostlib

// Slot assignment. A worker picks the aggregator slot of each fragment itself (the switch trusts
// agg_index), so every worker of a job must compute the same index for the same seq, and a job's
// slots must be safe to reuse:
//
//	AggIndex(job, seq) = (SlotBase(job) + seq % (2*Window)) % PoolSize
//
// A job uses 2*Window slots in rotation and every worker keeps at most Window fragments in flight
// (fragment s is sent only once every fragment below s-Window+1 has its result). Fragment s+2W
// therefore lands on the slot of s only after its sender has the result of s+W, which every worker
// sent only after it had the result of s: nobody can still need slot s's sum (the switch's shadow
// copy). That is SwitchML's argument, and why the switch lets a job's later seq retake its own
// completed slot. Different jobs start at different bases so they rarely collide; when they do,
// the switch diverts the fragment to the PS (F_COLLISION) and nothing is lost.
//
// seq here is the worker's 64-bit fragment counter, of which the wire carries the low 32 bits.
// Until the first 2^32 fragments this is exactly the 32-bit formula; past them, the 64-bit
// counter keeps seq % (2*Window) continuous, whereas a 32-bit counter would jump at the wrap
// (unless 2*Window divides 2^32) and could put two in-flight fragments on one slot.

// SlotBase is the first slot of a job's rotation: FNV-1a (32-bit) of the job id's four
// little-endian bytes, modulo the pool size.
func SlotBase(jobID, poolSize uint32) uint32 {
	h := uint32(2166136261) // FNV-1a offset basis
	for i := 0; i < 4; i++ {
		h ^= (jobID >> (8 * i)) & 0xff
		h *= 16777619 // FNV prime
	}
	return h % poolSize
}

// AggIndex is the slot of fragment seq of a job whose workers keep window fragments in flight.
// It needs 1 <= window and 2*window <= poolSize (WorkerConfig.Validate checks this).
func AggIndex(jobID uint32, seq uint64, window int, poolSize uint32) uint32 {
	return aggIndexFrom(SlotBase(jobID, poolSize), seq, window, poolSize)
}

func aggIndexFrom(base uint32, seq uint64, window int, poolSize uint32) uint32 {
	return uint32((uint64(base) + seq%uint64(2*window)) % uint64(poolSize))
}

// ATP's dynamic rehash. When a fragment collided (the switch sent it to the PS with F_COLLISION),
// the PS picks a new slot for that slot offset of the job (seq % 2W) and says so in its result:
// F_REHASH, bitmap1 = the new index. Every worker applies it to that offset's later fragments
// (seq after the result's), so they all move together: each worker sends seq+2W only after it
// has the result of seq, which carries the remap. The PS knows the job's window from bitmap1 of
// its level-0 DATA (workers put Window there) and never gives one job two offsets on one slot or
// a slot of its own base rotation, so the shadow-copy argument above still holds per slot; a
// fragment that collided was completed by the PS, which keeps its result for retransmissions.

// slotRemap is a worker's remap of one slot offset: fragments after seq `from` use idx.
type slotRemap struct {
	idx  uint32
	from uint64
}

// jobRemaps is the PS's record of one job's remapped offsets, so that new targets stay distinct.
type jobRemaps struct {
	window  uint32
	targets map[uint32]uint32 // offset -> slot
	owner   map[uint32]uint32 // slot -> offset
}

// rehashTries bounds the search for a free target.
const rehashTries = 16

// pick chooses a new slot for offset off of job (seq gives the hash variety), outside the job's
// base rotation and other offsets' targets. ok is false if none was found.
func (r *jobRemaps) pick(job, seq, off, base, pool uint32) (uint32, bool) {
	for try := uint32(0); try < rehashTries; try++ {
		h := uint32(2166136261)
		for _, v := range [4]uint32{job, seq, off, try} {
			for i := 0; i < 4; i++ {
				h ^= (v >> (8 * i)) & 0xff
				h *= 16777619
			}
		}
		t := h % pool
		if (t+pool-base)%pool < 2*r.window {
			continue // inside the job's own rotation
		}
		if o, used := r.owner[t]; used && o != off {
			continue
		}
		if old, ok := r.targets[off]; ok {
			delete(r.owner, old)
		}
		r.targets[off], r.owner[t] = t, off
		return t, true
	}
	return 0, false
}
