package workload

// Point is one data point of Zebra's Figure 4 (the cumulative share of updates taken by a model's
// k most frequently updated parameters) together with a generator setting that reproduces it.
//
// A trace's TopShare depends not only on the law but also on how many batches it spans (the longer
// the trace, the more of the cold tail it reaches, and the lower the share) and on the batch size
// (a key counts at most once per batch, so TopShare(k) <= k/KeysPerBatch). A Point's Skew is thus
// fitted for its own window, PointWorkers x PointIterations batches of KeysPerBatch keys:
// generating longer traces with it gives lower shares. Over four times the iterations,
// DeepLight's share falls from 0.40 to 0.35 (its V spreads the updates over many keys, and more
// batches reach more of them); the other points move by less than 0.005.
type Point struct {
	// Name is the model: OA (online advertising, Zebra's Task 1), SE (search engine, Task 2),
	// DeepLight (Task 3) or NCF (Task 4), with the k for models that have two points.
	Name string
	// PaperKeySpace and PaperK are the model's parameter count and k as in the paper.
	PaperKeySpace uint64
	PaperK        int
	// KeySpace and K are what the generator uses: the paper's, or both scaled down by the same
	// factor for the industrial models, whose 9 and 150 million parameters make for slow tests.
	KeySpace uint64
	K        int
	// Share is the paper's TopShare(K). "Over half" is read as 0.55, so that Share ± 0.05 spans
	// exactly the shares above one half without running to the next figure's 0.6.
	Share float64
	// KeysPerBatch and V complete the generator setting, and Skew is the exponent Fit found for it
	// with seed PointFitSeed (TestZebraPointsRefit, with -workload.refit, recomputes all five).
	KeysPerBatch int
	V            float64
	Skew         float64
}

// The window every Point is fitted for, and the seed its Skew was fitted with.
const (
	PointWorkers    = 8
	PointIterations = 25
	PointFitSeed    = 1
)

// Config returns the generator configuration of p with the given seed.
func (p Point) Config(seed uint64) GenConfig {
	return GenConfig{
		Workers:      PointWorkers,
		Iterations:   PointIterations,
		KeysPerBatch: p.KeysPerBatch,
		KeySpace:     p.KeySpace,
		Skew:         p.Skew,
		V:            p.V,
		Seed:         seed,
	}
}

// ZebraPoints are the data points Zebra's §III-A quotes from its Figure 4:
//
//   - OA: "across the 150 million parameters, the top 30,000 parameters of Task 1 constitute over
//     half of all updates". Scaled down tenfold, keys and k alike: 15 million keys, top 3,000.
//     (Scaling further, to 1.5 million and 300, would force batches under 545 keys, since
//     TopShare(300) <= 300/KeysPerBatch.)
//   - SE: "for Task 2, its top 30,000 parameters even account for about 70% of updates", out of
//     about 9 million. Scaled down tenfold like OA: 900,000 keys, top 3,000.
//   - DeepLight: "the top 30,000 parameters of Task 3 contribute 40% updates", of 0.32 million.
//     So flat a curve needs a Zipf offset V (see GenConfig): with V = 1, even s = 1.001 gives 0.72.
//   - NCF: "the top 5,000 parameters of Task 4 account for over half of all updates (the top 100
//     parameters already contribute about 40%)", of 0.07 million. These are two presets: no single
//     Zipf law matches both, since a law with s > 1 whose top 100 take 40% leaves far less than
//     half of the updates to the 65,000 keys beyond the top 5,000 (the NCF-100 preset gives
//     TopShare(5000) = 0.93 in its window, the NCF-5000 one TopShare(100) = 0.03).
//
// OA, SE and DeepLight use 2,000 keys per batch, NCF-5000 3,000 and NCF-100 128 (TopShare(k) is
// at most k/KeysPerBatch).
var ZebraPoints = []Point{
	{Name: "OA", PaperKeySpace: 150_000_000, PaperK: 30_000, KeySpace: 15_000_000, K: 3_000, Share: 0.55, KeysPerBatch: 2000, V: 1, Skew: 1.3366},
	{Name: "SE", PaperKeySpace: 9_000_000, PaperK: 30_000, KeySpace: 900_000, K: 3_000, Share: 0.70, KeysPerBatch: 2000, V: 1, Skew: 1.6438},
	{Name: "DeepLight", PaperKeySpace: 320_000, PaperK: 30_000, KeySpace: 320_000, K: 30_000, Share: 0.40, KeysPerBatch: 2000, V: 30_000, Skew: 1.2261},
	{Name: "NCF-100", PaperKeySpace: 70_000, PaperK: 100, KeySpace: 70_000, K: 100, Share: 0.40, KeysPerBatch: 128, V: 1, Skew: 1.2321},
	{Name: "NCF-5000", PaperKeySpace: 70_000, PaperK: 5_000, KeySpace: 70_000, K: 5_000, Share: 0.55, KeysPerBatch: 3000, V: 1, Skew: 1.0859},
}
