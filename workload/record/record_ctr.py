#!/usr/bin/python3
"""Record sparse-gradient key traces from a small click-through-rate (CTR) model.

The model is the sparse half of a DLRM-style recommender: one embedding table
(nn.EmbeddingBag, mode='sum', sparse=True) shared by F categorical fields, each
field owning a contiguous range of its rows, followed by a small MLP and a
binary cross-entropy loss. It trains on synthetic click logs whose feature ids
follow a Zipf law per field and whose click labels come from a hidden logistic
model over the same ids, so the loss falls as it learns (printed every 20
iterations).

Training is data parallel in simulation: every iteration, each of W workers
draws its own mini-batch and computes its gradient; the trace records, per
iteration and worker, the sorted distinct rows of that worker's sparse
embedding gradient (grad.coalesce().indices()), i.e. the keys the worker would
send for aggregation. The gradients are then averaged over the workers, as an
all-reduce would, and the optimizers step.

Ids within a field are numbered by popularity rank (0 = most frequent), as a
vocabulary built by frequency numbers them (Keras StringLookup, for one). That
is also what keeps the delta-coded trace small: the hot rows of every field
are consecutive.

The output is the trace file format of the Go package
github.com/xdpagg/xdpagg/workload (see its doc.go), written here directly:
gzip (no file name, mtime 0, so the same arguments always give the same bytes)
of magic "XAGGTRC1", uint16 name length, name, uint64 key space, uint32
iterations, uint32 workers, then per batch a uvarint count, the first key and
the gaps minus one, all uvarints.

The keys depend only on the data, which numpy draws from streams seeded by
(--seed, iteration, worker): the trace is deterministic for a seed whatever
torch's floating-point reductions do. Run it with Debian's interpreter,
/usr/bin/python3, which has torch 1.13 (python3-torch). The shipped traces
were recorded with (from the repository root):

  /usr/bin/python3 workload/record/record_ctr.py --workers 8 --iters 200 \
      --rows 100000 --fields 16 --min-vocab 4 --hot 1 --skew 1.3 --batch 300 \
      --seed 1 --out workload/testdata/ctr_w8.trace.gz
  /usr/bin/python3 workload/record/record_ctr.py --workers 8 --iters 200 \
      --rows 100000 --fields 8 --min-vocab 0 --hot 3 --skew 1.05 --batch 48 \
      --seed 2 --out workload/testdata/ctr_w8_flat.trace.gz

The first has 16 fields of geometrically growing vocabularies (4 to about
30,000 rows), one id each, Zipf exponent 1.3; the second ("flat") has 8 equal
fields of 12,500 rows, 1 to 3 ids each, and a flatter exponent of 1.05. Sizes
are what keeps each file under 1 MB: the key sets of independent batches carry
about 3.3 (first) to 6 (flat) bits of information per key, which no coding of
this format can beat, so 1,600 batches of about 1,000 keys is about the most
a megabyte holds.
"""

import argparse
import gzip
import struct
import sys

import numpy as np
import torch
from torch import nn

MAGIC = b"XAGGTRC1"


def uvarints(values):
    """LEB128-encodes a 1-D array of non-negative integers (the Go encoding/binary uvarint)."""
    v = np.asarray(values, dtype=np.uint64)
    if v.size == 0:
        return b""
    # Byte j of each value, for as many bytes as the largest value needs; a value's last byte is
    # the highest non-zero 7-bit group (or the first, for 0), and only earlier bytes get 0x80.
    nbytes = np.ones(v.shape, dtype=np.int64)
    rest = v >> np.uint64(7)
    while rest.any():
        nbytes += rest > 0
        rest >>= np.uint64(7)
    width = int(nbytes.max())
    groups = np.stack([(v >> np.uint64(7 * j)) & np.uint64(0x7F) for j in range(width)], axis=1)
    cont = np.arange(width)[None, :] < (nbytes[:, None] - 1)
    out = (groups | (cont.astype(np.uint64) << np.uint64(7))).astype(np.uint8)
    keep = np.arange(width)[None, :] < nbytes[:, None]
    return out[keep].tobytes()  # row-major: each value's bytes in order, values in order


def write_trace(path, name, key_space, batches):
    """Writes batches[i][w] (sorted distinct numpy arrays of keys) in the workload trace format."""
    iters, workers = len(batches), len(batches[0]) if batches else 0
    name = name.encode()
    body = [MAGIC, struct.pack("<H", len(name)), name, struct.pack("<QII", key_space, iters, workers)]
    for it in batches:
        for keys in it:
            keys = np.asarray(keys, dtype=np.uint64)
            body.append(uvarints([keys.size]))
            if keys.size:
                gaps = np.empty_like(keys)
                gaps[0] = keys[0]
                gaps[1:] = keys[1:] - keys[:-1] - np.uint64(1)
                body.append(uvarints(gaps))
    with open(path, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0, compresslevel=9) as gz:
        gz.write(b"".join(body))


class Fields:
    """F fields sharing `rows` table rows, each with a Zipf(skew) law over its own range of rows.

    Vocabulary sizes grow geometrically from min_vocab (the smallest field) so that they add up
    to rows, as in real click logs, where a few fields have a handful of values (always present
    in a batch: the always-hot parameters) and a few have most of the rows. min_vocab 0 gives
    every field an equal share.
    """

    def __init__(self, rows, fields, skew, min_vocab):
        if min_vocab <= 0 or fields == 1:
            sizes = np.full(fields, rows // fields, dtype=np.int64)
        else:
            # Bisect the growth ratio so that the rounded sizes fit in rows; the last field takes
            # whatever rounding leaves over.
            lo, hi = 1.0, 64.0
            for _ in range(200):
                mid = (lo + hi) / 2
                if np.round(min_vocab * mid ** np.arange(fields)).sum() > rows:
                    hi = mid
                else:
                    lo = mid
            sizes = np.maximum(np.round(min_vocab * lo ** np.arange(fields)).astype(np.int64), 1)
        sizes[-1] += rows - sizes.sum()
        if sizes.min() < 1:
            raise ValueError("fields do not fit in rows")
        self.sizes = sizes
        self.offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        self.cdfs = []
        for n in sizes:
            w = np.arange(1, n + 1, dtype=np.float64) ** -skew
            cdf = np.cumsum(w)
            self.cdfs.append(cdf / cdf[-1])

    def draw(self, rng, f, count):
        """Draws `count` ids of field f by inverting its CDF."""
        r = np.searchsorted(self.cdfs[f], rng.random(count), side="right")
        return self.offsets[f] + np.minimum(r, len(self.cdfs[f]) - 1)


class CTR(nn.Module):
    def __init__(self, rows, fields, dim, hidden):
        super().__init__()
        self.fields = fields
        self.emb = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
        nn.init.normal_(self.emb.weight, std=0.01)
        self.mlp = nn.Sequential(nn.Linear(fields * dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, ids, offsets, batch):
        # Bags are field-major (bag f*batch + s is field f of sample s): regroup them per sample.
        e = self.emb(ids, offsets).view(self.fields, batch, -1).transpose(0, 1).reshape(batch, -1)
        return self.mlp(e).squeeze(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rows", type=int, default=100_000, help="embedding rows = key space")
    ap.add_argument("--fields", type=int, default=8, help="categorical fields per sample")
    ap.add_argument("--min-vocab", type=int, default=0,
                    help="smallest field's vocabulary; sizes grow geometrically (0: equal sizes)")
    ap.add_argument("--hot", type=int, default=1, help="ids per field: uniform in 1..HOT (multi-hot)")
    ap.add_argument("--skew", type=float, default=1.2, help="Zipf exponent of each field's ids")
    ap.add_argument("--batch", type=int, default=256, help="samples per worker per iteration")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if min(a.workers, a.iters, a.rows, a.fields, a.hot, a.batch, a.dim) < 1 or a.rows < a.fields:
        sys.exit("record_ctr: every count must be positive and --rows at least --fields")

    torch.manual_seed(a.seed)
    fields = Fields(a.rows, a.fields, a.skew, a.min_vocab)
    # The hidden click model: a logistic regression on the same ids, with a weight per row, scaled
    # so that a sample's logit varies by about 1.5 whatever the number of ids it sums.
    hidden = np.random.default_rng([a.seed, 0x1D]).normal(0, 1.5 / np.sqrt(a.fields * (a.hot + 1) / 2), a.rows)
    bias = -1.0

    model = CTR(a.rows, a.fields, a.dim, 64)
    sparse_opt = torch.optim.SparseAdam(list(model.emb.parameters()), lr=0.01)
    dense_opt = torch.optim.Adam(model.mlp.parameters(), lr=0.003)
    loss_fn = nn.BCEWithLogitsLoss()
    params = [model.emb.weight] + list(model.mlp.parameters())

    trace, window, floor = [], [], []
    for it in range(a.iters):
        batches, sparse, dense, losses = [], [], None, []
        for w in range(a.workers):
            rng = np.random.default_rng([a.seed, it, w])
            ids, lengths, logit = [], [], np.full(a.batch, bias)
            for f in range(a.fields):
                n = rng.integers(1, a.hot + 1, size=a.batch)
                x = fields.draw(rng, f, int(n.sum()))
                ids.append(x)
                lengths.append(n)
                logit += np.add.reduceat(hidden[x], np.concatenate([[0], np.cumsum(n)[:-1]]))
            ids, lengths = np.concatenate(ids), np.concatenate(lengths)
            offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            labels = (rng.random(a.batch) < 1 / (1 + np.exp(-logit))).astype(np.float32)
            # The hidden model's own loss on these labels: the floor training can approach.
            floor.append(np.mean(np.logaddexp(0, logit) - labels * logit))

            out = model(torch.from_numpy(ids), torch.from_numpy(offsets), a.batch)
            loss = loss_fn(out, torch.from_numpy(labels))
            grads = torch.autograd.grad(loss, params)
            g = grads[0].coalesce()
            rows = g.indices()[0].numpy()  # coalesce sorts the indices: ascending, distinct
            if not np.array_equal(rows, np.unique(ids)):
                sys.exit("record_ctr: gradient rows differ from the looked-up ids")
            batches.append(rows.astype(np.uint64))
            sparse.append(g)
            dense = [d.clone() for d in grads[1:]] if dense is None else [s + d for s, d in zip(dense, grads[1:])]
            losses.append(loss.item())
        # The all-reduce: average the workers' gradients, then step.
        model.emb.weight.grad = sum(sparse[1:], sparse[0]).coalesce() / a.workers
        for p, d in zip(model.mlp.parameters(), dense):
            p.grad = d / a.workers
        sparse_opt.step()
        dense_opt.step()
        trace.append(batches)
        window.append(np.mean(losses))
        if (it + 1) % 20 == 0 or it == 0:
            keys = np.mean([b.size for b in batches])
            print(f"iter {it + 1:4d}  loss {np.mean(window):.4f} (hidden model {np.mean(floor):.4f})  "
                  f"keys/worker {keys:.0f}", flush=True)
            window, floor = [], []

    name = (f"ctr rows={a.rows} fields={a.fields} min-vocab={a.min_vocab} hot={a.hot} skew={a.skew} batch={a.batch} "
            f"dim={a.dim} workers={a.workers} iters={a.iters} seed={a.seed}")
    write_trace(a.out, name, a.rows, trace)
    total = sum(b.size for it in trace for b in it)
    print(f"wrote {a.out}: {a.iters} iterations x {a.workers} workers, "
          f"{total / (a.iters * a.workers):.0f} keys per batch")


if __name__ == "__main__":
    main()
