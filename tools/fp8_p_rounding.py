#!/usr/bin/env python3
"""A numpy model of the sm90 FP8 kernel's softmax, for choosing its P offset and rescale threshold without a GPU.

    python3 tools/fp8_p_rounding.py [--keys 16384] [--block 192] [--schemes 8:0,4:4,8:0.75]

A scheme OFFSET:GROWTH is csrc/sm90/softmax.cuh's P = exp2(S * scale_log2 - m * scale_log2 + OFFSET), rounded to
e4m3 for P V (the row sums l in float32 before the rounding), with the running maximum m moved only once a row's
block maximum exceeds it by more than GROWTH (log2 units; 0: every growth, the shipped FP8 kernels' eager rescale).
e4m3 holds at most 448 = 2^8.8, so OFFSET + GROWTH must stay below 8.8. Prints, per score pattern, each scheme's
largest output error relative to the largest output of a float64 softmax (the model's only rounding is P's: V is
exact), then how often a warp (16 rows) rescales O on random scores.
"""

import argparse

import ml_dtypes
import numpy as np

LOG2E = 1.0 / np.log(2.0)


def blocked_softmax(scores, v, offset, growth, block):
    """O of one row: scores (S,) in natural-log units, v (S, D); the kernel's block loop."""
    m, l, o = -np.inf, 0.0, np.zeros(v.shape[1])
    for j in range(0, len(scores), block):
        s = scores[j:j + block]
        block_max = s.max()
        if m == -np.inf or block_max > m + growth / LOG2E:
            alpha = 0.0 if m == -np.inf else np.exp2((m - block_max) * LOG2E)
            o, l, m = o * alpha, l * alpha, block_max
        p = np.exp2((s - m) * LOG2E + offset).astype(np.float32)
        l += p.sum(dtype=np.float32)
        o += p.astype(ml_dtypes.float8_e4m3fn).astype(np.float32) @ v[j:j + block]
    return o / l


def patterns(rng, keys, dim):
    """(name, scores, v): random scores, and one key g nats above a flat tail (an attention sink over a long
    context) whose values have a mean, so the tail's mass shows in the output."""
    v = rng.standard_normal((keys, dim)).astype(np.float32)
    yield "random N(0, 1)", rng.standard_normal(keys), v
    v_tail = (1.0 + rng.standard_normal((keys, dim))).astype(np.float32)
    v_tail[0] = -3.0
    for g in (8, 10, 12):
        yield f"sink +{g} nats, flat tail", np.concatenate([[float(g)], 0.05 * rng.standard_normal(keys - 1)]), v_tail


def rescale_fraction(rng, keys, block, growth, rows=16, trials=10):
    """The share of a warp's key blocks after the first on which some row's maximum moves (random scores)."""
    moves = blocks = 0
    for _ in range(trials):
        s = rng.standard_normal((rows, keys))
        m = np.full(rows, -np.inf)
        for j in range(0, keys, block):
            block_max = s[:, j:j + block].max(axis=1)
            grows = ~(block_max <= m + growth / LOG2E)
            if j:
                moves, blocks = moves + grows.any(), blocks + 1
            m = np.where(grows, np.maximum(m, block_max), m)
    return moves / blocks


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=16384)
    parser.add_argument("--block", type=int, default=192)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--schemes", default="8:0,4:4,8:0.75", help="OFFSET:GROWTH pairs, comma-separated")
    args = parser.parse_args()
    schemes = [tuple(float(x) for x in item.split(":")) for item in args.schemes.split(",")]
    for offset, growth in schemes:
        if offset + growth >= np.log2(448.0):
            parser.error(f"scheme {offset:g}:{growth:g}: P reaches 2^{offset + growth:g}, past e4m3's 448")
    rng = np.random.default_rng(0)
    print(f"{args.keys} keys, {args.block}-key blocks; largest error / largest output, per OFFSET:GROWTH")
    print(f"{'scores':28s}" + "".join(f"{f'{o:g}:{g:g}':>10s}" for o, g in schemes))
    for name, scores, v in patterns(rng, args.keys, args.dim):
        w = np.exp(scores - scores.max())
        exact = (w / w.sum()) @ v.astype(np.float64)
        errors = [np.abs(blocked_softmax(scores, v, o, g, args.block) - exact).max() / np.abs(exact).max()
                  for o, g in schemes]
        print(f"{name:28s}" + "".join(f"{e:10.4f}" for e in errors))
    print(f"{'O rescaled (share of blocks)':28s}" +
          "".join(f"{rescale_fraction(rng, args.keys, args.block, g):10.3f}" for _, g in schemes))


if __name__ == "__main__":
    main()
