"""Packed-sequence benchmark: causal rows of --packed-tokens tokens holding documents of random lengths, masked by
segment ids, against the same tokens as a batch of unpacked documents of the mean length, against cuDNN and XLA
given the equivalent dense mask, and on a GPU against Pallas's Triton attention given the same segment ids
(`jax.experimental.pallas.ops.gpu.attention.mha`; splash attention, which skips blocks by segment, runs on TPUs only).

    python -m jax_flash.benchmark --suite packed                    # bf16, D = 128, 16 heads, means 512 / 2048 / 4096
    python -m jax_flash.benchmark --suite packed --packed-means 512 --dtypes bf16,fp16
    python -m jax_flash.benchmark --suite packed --pass backward    # their backward (forward + backward - forward)

TFLOP/s count the visible (query, key) pairs only, 4 * heads * head_dim per pair (2.5x that for the backward, 3.5x
for --pass both), so a packed row that skips the blocks between documents scores as the unpacked batch does. The
backward leaves out XLA's dense-mask attention (its (T, T) probabilities per head would be kept for the gradient). The ratio packed / unpacked is the target's (at least
0.85 at the mean document length). Each implementation is timed interleaved as chained calls in one jitted function
(jax_flash.timing).
"""

from __future__ import annotations

import datetime
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash.timing import time_interleaved_ms

MEANS = (512, 2048, 4096)


def document_ids(tokens: int, mean: int, seed: int) -> np.ndarray:
    """int32 (tokens,): documents of geometric lengths with the given mean, numbered 0, 1, ... in order."""
    rng = np.random.RandomState(seed)
    starts = rng.random_sample(tokens) < 1.0 / mean
    starts[0] = False
    return np.cumsum(starts).astype(np.int32)


def visible_pairs(ids: np.ndarray) -> int:
    """Causal (query, key) pairs of one row whose ids are equal: sum over documents of L (L + 1) / 2."""
    lengths = np.bincount(ids)
    return int((lengths * (lengths + 1) // 2).sum())


def _implementations(ids: np.ndarray, mean: int, on_gpu: bool, pass_: str = "forward"):
    tokens = ids.shape[0]
    seg = jnp.asarray(ids)[None]
    mask = (seg[:, :, None] == seg[:, None, :]) & jnp.tril(jnp.ones((tokens, tokens), bool))[None]

    def unpacked(q, k, v):  # the same tokens as tokens / mean documents of the mean length (the rest passed on)
        used = tokens // mean * mean
        cut = lambda x: x[:, :used].reshape((tokens // mean, mean, *x.shape[2:]))
        out = jax_flash.attention(cut(q), cut(k), cut(v), causal=True)
        return jnp.concatenate([out.reshape((1, used, *q.shape[2:])), q[:, used:]], axis=1)

    impls = {"packed": lambda q, k, v: jax_flash.attention(q, k, v, causal=True, q_segment_ids=seg,
                                                           kv_segment_ids=seg),
             "unpacked": unpacked}
    if on_gpu:
        impls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask[:, None],
                                                                      implementation="cudnn")
        try:
            from jax.experimental.pallas.ops.gpu import attention as pallas_attention
        except ImportError as error:  # (a jax without Pallas's GPU ops: the row goes without it)
            print(f"# Pallas GPU attention unavailable: {error}", file=sys.stderr)
        else:
            impls["pallas"] = lambda q, k, v: pallas_attention.mha(q, k, v, seg, sm_scale=q.shape[-1] ** -0.5,
                                                                   causal=True)
    if pass_ == "forward":
        impls["xla"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask[:, None],
                                                                    implementation="xla")
    return impls


def run(args) -> list[dict]:
    from jax_flash.benchmark import _PASS_FLOPS, DTYPES, _device_name, _pass_ms, _with_backward

    on_gpu = jax.default_backend() == "gpu"
    tokens = args.packed_tokens or (16384 if on_gpu else 4096)
    heads, head_dim = (16, 128) if on_gpu else (4, 64)
    rows = []
    for dtype_name in args.dtypes:
        for mean in args.packed_means or (MEANS if on_gpu else (256, 1024)):
            ids = document_ids(tokens, mean, seed=mean)
            pairs = visible_pairs(ids)
            keys = jax.random.split(jax.random.PRNGKey(mean), 3)
            q, k, v = (jax.random.normal(key, (1, tokens, heads, head_dim), jnp.float32).astype(DTYPES[dtype_name])
                       for key in keys)
            print(f"[{dtype_name} mean {mean}] {int(ids[-1]) + 1} documents in {tokens} tokens", file=sys.stderr,
                  flush=True)
            impls = _implementations(ids, mean, on_gpu, args.pass_)
            timed = dict(impls) if args.pass_ != "both" else {}
            if args.pass_ != "forward":
                timed.update({f"{name}+bwd": _with_backward(fn) for name, fn in impls.items()})
            times, failures = time_interleaved_ms(timed, q, k, v, iters=args.iters, reps=args.reps,
                                                  min_rep_ms=args.min_rep_ms)
            docs = tokens // mean
            unpacked_pairs = docs * mean * (mean + 1) // 2
            results = {}
            for name in impls:
                ms = _pass_ms(args.pass_, times.get(name), times.get(f"{name}+bwd"))
                if ms is None or ms <= 0:
                    continue
                counted = unpacked_pairs if name == "unpacked" else pairs
                flops = 4 * heads * head_dim * counted * _PASS_FLOPS[args.pass_]
                results[name] = {"ms": ms, "tflops": flops / ms / 1e9}
            for name, error in failures.items():
                print(f"#   {name} failed: {type(error).__name__}: {str(error)[:200]}", file=sys.stderr)
            rows.append({"dtype": dtype_name, "head_dim": head_dim, "heads": heads, "tokens": tokens, "mean": mean,
                         "documents": int(ids[-1]) + 1, "visible_pairs": pairs, "pass": args.pass_,
                         "device": _device_name(jax.devices()[0]), "results": results})
    return rows


def print_table(rows: list[dict]) -> None:
    names = []
    for row in rows:
        names += [n for n in row["results"] if n not in names]
    unit, scale = ("TFLOP/s", 1.0) if jax.default_backend() == "gpu" else ("GFLOP/s", 1e3)
    pass_ = rows[0].get("pass", "forward") if rows else "forward"
    print(f"\nPacked causal rows on {rows[0]['device'] if rows else '?'} ({datetime.date.today()}), {pass_}: {unit} over "
          f"visible pairs; packed / unpacked in brackets (target >= 0.85)")
    print(" | ".join(["dtype", "D x H", "tokens", "mean", "documents"] + names))
    for row in rows:
        unpacked = row["results"].get("unpacked", {}).get("tflops")
        cells = []
        for name in names:
            r = row["results"].get(name)
            ratio = f" ({r['tflops'] / unpacked:.2f}x)" if r and unpacked and name == "packed" else ""
            cells.append("-" if r is None else f"{r['tflops'] * scale:.1f}{ratio}")
        print(" | ".join([row["dtype"], f"{row['head_dim']} x {row['heads']}", str(row["tokens"]), str(row["mean"]),
                          str(row["documents"])] + cells))
