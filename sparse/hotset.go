package sparse

import (
	"fmt"
	"math"
)

// HotSet maps hot keys to ranks [0, len) and back; Version orders hot sets (a newer set has a
// higher version).
//
// Ranks are what workers put on the wire and what the switch uses as register addresses (Zebra
// §III-D maps parameter indices into [0, M-1] by rank), so a packet is only meaningful against
// the hot set it was built from; Version is how workers, switch and PS tell sets apart when an
// Online re-ranking swaps them. A HotSet is immutable after NewHotSet (apart from the exported
// Version field, which callers own) and safe for concurrent readers. A nil *HotSet is an empty
// set.
type HotSet struct {
	Version uint32

	keys  Ranking           // rank -> key
	ranks map[uint64]uint32 // key -> rank
}

// NewHotSet returns the hot set whose rank i is keys[i]. It copies keys, so the caller may reuse
// the slice. Errors: ErrDuplicateKey if a key appears twice (two ranks for one parameter would
// split its gradients over two registers), ErrBadParameter if there are more keys than uint32
// ranks.
func NewHotSet(version uint32, keys Ranking) (*HotSet, error) {
	if uint64(len(keys)) > math.MaxUint32+1 {
		return nil, fmt.Errorf("%w: %d hot keys, at most 2^32 ranks", ErrBadParameter, len(keys))
	}
	h := &HotSet{
		Version: version,
		keys:    append(Ranking(nil), keys...),
		ranks:   make(map[uint64]uint32, len(keys)),
	}
	for i, k := range h.keys {
		if r, dup := h.ranks[k]; dup {
			return nil, fmt.Errorf("%w: key %d at ranks %d and %d", ErrDuplicateKey, k, r, i)
		}
		h.ranks[k] = uint32(i)
	}
	return h, nil
}

// Len returns the number of hot keys.
func (h *HotSet) Len() int {
	if h == nil {
		return 0
	}
	return len(h.keys)
}

// Rank returns key's rank, and whether key is hot at all (cold keys go to the PS).
func (h *HotSet) Rank(key uint64) (rank uint32, hot bool) {
	if h == nil {
		return 0, false
	}
	rank, hot = h.ranks[key]
	return rank, hot
}

// Key returns the key of rank: how a worker restores keys from the switch's results. It panics
// if rank is out of range, like a slice: a rank the set did not hand out is a bug, not an input.
func (h *HotSet) Key(rank uint32) uint64 {
	if h == nil {
		panic(fmt.Sprintf("sparse: HotSet.Key(%d) on a nil hot set", rank))
	}
	return h.keys[rank]
}

// Keys returns a copy of the hot keys in rank order.
func (h *HotSet) Keys() Ranking {
	if h == nil {
		return nil
	}
	return append(Ranking(nil), h.keys...)
}
