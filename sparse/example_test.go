package sparse_test

import (
	"fmt"

	"github.com/xdpagg/xdpagg/sparse"
)

// A job's life in small: rank the keys, choose k by Principle 1, map hot keys to ranks, place
// them in two register arrays and pack one worker's gradients.
func Example() {
	// Update counts per key from a sampled run.
	freq := map[uint64]uint64{1010: 8, 1011: 8, 1012: 5, 1013: 1, 1014: 1, 1015: 1}
	ranking := sparse.RankByFrequency(freq) // 1010 and 1011 tie: the smaller key first

	// The fewest keys that carry 80% of the updates, within 5% of a 20 MiB switch.
	k, share, capped, err := sparse.ChooseK(sparse.Frequencies(ranking, freq), 0.8, 0.05, 20<<20)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("k = %d, share %.3f, capped %v\n", k, share, capped)

	hot, err := sparse.NewHotSet(1, ranking[:k])
	if err != nil {
		fmt.Println(err)
		return
	}
	layout := sparse.Layout{Arrays: 2, Slots: 4}

	// A worker's gradient keys: the hot ones go to the switch as ranks, the rest to the PS.
	var ranks []uint32
	for _, key := range []uint64{1012, 1010, 1013, 1011} {
		if r, ok := hot.Rank(key); ok {
			ranks = append(ranks, r)
			fmt.Printf("key %d: rank %d, array %d, slot %d\n", key, r, layout.Array(r), layout.Slot(r))
		} else {
			fmt.Printf("key %d: cold\n", key)
		}
	}
	for _, packet := range sparse.Pack(ranks, layout.Arrays, 2) {
		var pr []uint32
		for _, i := range packet {
			pr = append(pr, ranks[i])
		}
		passes, _ := sparse.Passes(pr, layout.Arrays, 4)
		fmt.Printf("packet of ranks %v: %d pass(es)\n", pr, passes)
	}
	// Output:
	// k = 3, share 0.875, capped false
	// key 1012: rank 2, array 0, slot 1
	// key 1010: rank 0, array 0, slot 0
	// key 1013: cold
	// key 1011: rank 1, array 1, slot 0
	// packet of ranks [2 1]: 1 pass(es)
	// packet of ranks [0]: 1 pass(es)
}
