#!/usr/bin/env python3
"""A numpy model of the FP8 wgmma's accumulation, for choosing how the sm90 FP8 kernel sums O without a GPU.

    python3 tools/fp8_wgmma_sum.py [--keys 1024,2048,16384] [--block 192] [--folds 0,1,4] [--bits 14]

One wgmma k32 step adds 32 products to its accumulator D the way DeepSeek-V3's report describes Hopper's FP8 tensor
cores: every term (D and the products) aligned to the largest exponent among them and cut to BITS bits below it,
toward zero, then summed. A row of keys with nearly equal scores over values 1 + N(0, 0.25), P at 2^8 rounded to
e4m3 as the kernel rounds it: O summed in one accumulator over the row (FOLD 0, FP8 v7), or in a fresh one every
FOLD key blocks that is then added into a float32 sum (FP8 v8: 1). Prints each row length's largest error and mean
ratio to the float64 output. On an H200 FP8 v7 gave 0.72 for 1.00 at 16384 keys (this model: 0.73) and v8 errors
of 0.002-0.006 (bfloat16's rounding included).
"""

import argparse

import ml_dtypes
import numpy as np


def e4m3(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def wgmma_step(acc, products, bits):
    """acc (D,) plus products (32, D), each term cut to `bits` bits below the largest term's exponent."""
    terms = np.concatenate([acc[None], products])
    largest = np.abs(terms).max(axis=0)
    exponent = np.floor(np.log2(np.where(largest > 0, largest, 1.0)))
    quantum = np.ldexp(1.0, (exponent + 1 - bits).astype(int))
    return (np.trunc(terms / quantum) * quantum).sum(axis=0)


def row_error(rng, keys, block, fold, bits, dim=128):
    """(largest |O - O_exact|, mean O / O_exact) of one flat row; fold 0: one accumulator for the whole row."""
    scores = e4m3(16.0 * e4m3(0.1 * rng.standard_normal(keys))) / np.sqrt(dim)
    v = e4m3(1.0 + 0.5 * rng.standard_normal((keys, dim)))
    p = np.exp(scores - scores.max()) * 256.0
    exact = p @ v / p.sum()
    p_e4m3 = e4m3(p)
    span = keys if fold == 0 else fold * block
    total = np.zeros(dim)
    for start in range(0, keys, span):
        acc = np.zeros(dim)
        for k in range(start, min(start + span, keys), 32):
            acc = wgmma_step(acc, p_e4m3[k:k + 32, None] * v[k:k + 32], bits)
        total += acc
    out = total / p.sum()
    return np.abs(out - exact).max(), (out / exact).mean()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", default="1024,2048,16384")
    parser.add_argument("--block", type=int, default=192)
    parser.add_argument("--folds", default="0,1,4")
    parser.add_argument("--bits", type=int, default=14)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    for keys in (int(k) for k in args.keys.split(",")):
        cells = []
        for fold in (int(f) for f in args.folds.split(",")):
            err, ratio = row_error(rng, keys, args.block, fold, args.bits)
            cells.append(f"fold {fold}: {err:.4f} ({ratio:.4f})")
        print(f"{keys:6d} keys  " + "   ".join(cells))


if __name__ == "__main__":
    main()
