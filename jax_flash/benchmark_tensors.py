"""Bias and mask tensor benchmark: causal attention given as a dense (1, 1, T, S) boolean mask, attention with a
(1, N, T, S) additive bias (ALiBi's, as a tensor), ALiBi from its (N,) slopes (alibi_slopes=, computed in the
kernels) and a (B, 1, 1, S) padding mask, each beside the same call without the tensor (causal=True, no bias,
kv_lengths) and beside cuDNN given the same tensors (jax.nn.dot_product_attention; for the slopes, the bias tensor
they stand for).

    python -m jax_flash.benchmark --suite tensors                   # bf16, D = 128, 16 heads, 2048 and 4096 tokens
    python -m jax_flash.benchmark --suite tensors --tensor-seqs 1024,4096 --dtypes bf16,fp16
    python -m jax_flash.benchmark --suite tensors --pass backward    # their backward (forward + backward - forward)

TFLOP/s count the visible pairs (half for the causal mask, 7/8 for the padding), 4 * heads * head_dim each (2.5x that
for the backward, 3.5x for --pass both);
batch x seq = --tokens. The bias is float32 for jax_flash (its kernels add it in float32) and the input dtype for
cuDNN, which takes no other.
"""

from __future__ import annotations

import datetime
import sys

import jax
import jax.numpy as jnp

import jax_flash
from jax_flash.reference import alibi_bias
from jax_flash.timing import time_interleaved_ms

SEQS = (2048, 4096)
HEADS, HEAD_DIM = 16, 128


def alibi_slopes(heads: int) -> jnp.ndarray:
    """float32 (heads,): ALiBi's slopes 2^(-8 h / heads), h = 1 .. heads."""
    return 2.0 ** (-8.0 * (jnp.arange(heads, dtype=jnp.float32) + 1) / heads)


def _cases(seq: int, batch: int, on_gpu: bool):
    """(case name, the fraction of (query, key) pairs visible, {implementation: fn(q, k, v)})."""
    causal = jnp.tril(jnp.ones((seq, seq), bool))[None, None]
    # padding: every other sequence holds 3/4 of its keys (a BERT-style batch), the same as kv_lengths
    lengths = jnp.array([seq if b % 2 == 0 else seq * 3 // 4 for b in range(batch)], jnp.int32)
    padding = (jnp.arange(seq)[None, :] < lengths[:, None])[:, None, None, :]
    slopes = alibi_slopes(HEADS)
    bias = alibi_bias(slopes, seq, seq)  # (1, N, T, T): -slope_h |i - j|
    mask_impls = {"jax_flash": lambda q, k, v: jax_flash.attention(q, k, v, mask=causal),
                  "jax_flash causal=True": lambda q, k, v: jax_flash.attention(q, k, v, causal=True)}
    bias_impls = {"jax_flash": lambda q, k, v: jax_flash.attention(q, k, v, bias=bias),
                  "jax_flash no bias": lambda q, k, v: jax_flash.attention(q, k, v)}
    slope_impls = {"jax_flash": lambda q, k, v: jax_flash.attention(q, k, v, alibi_slopes=slopes),
                   "jax_flash no bias": lambda q, k, v: jax_flash.attention(q, k, v)}
    pad_impls = {"jax_flash": lambda q, k, v: jax_flash.attention(q, k, v, mask=padding),
                 "jax_flash kv_lengths": lambda q, k, v: jax_flash.attention(q, k, v, kv_lengths=lengths)}
    if on_gpu:
        pad_impls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=padding,
                                                                          implementation="cudnn")
        mask_impls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=causal,
                                                                           implementation="cudnn")
        bias_impls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, bias=bias.astype(q.dtype),
                                                                           implementation="cudnn")
        slope_impls["cudnn"] = bias_impls["cudnn"]
    visible = float(jnp.mean(lengths)) / seq
    return [("causal mask (1, 1, T, S)", 0.5, mask_impls), ("ALiBi bias (1, N, T, S)", 1.0, bias_impls),
            ("ALiBi alibi_slopes (N,)", 1.0, slope_impls), ("padding mask (B, 1, 1, S)", visible, pad_impls)]


def run(args) -> list[dict]:
    from jax_flash.benchmark import _PASS_FLOPS, DTYPES, _device_name, _pass_ms, _with_backward

    on_gpu = jax.default_backend() == "gpu"
    rows = []
    for dtype_name in args.dtypes:
        for seq in args.tensor_seqs or (SEQS if on_gpu else (512, 1024)):
            batch = max(1, args.tokens // seq)
            keys = jax.random.split(jax.random.PRNGKey(seq), 3)
            q, k, v = (jax.random.normal(key, (batch, seq, HEADS, HEAD_DIM), jnp.float32).astype(DTYPES[dtype_name])
                       for key in keys)
            for case, visible, impls in _cases(seq, batch, on_gpu):
                print(f"[{dtype_name} {case} {batch} x {seq}]", file=sys.stderr, flush=True)
                # --pass backward / both: each implementation's forward + backward too (the tensors closed over, so
                # the gradients are dq, dk and dv: the kernels', without the bias's XLA gradient)
                timed = dict(impls) if args.pass_ != "both" else {}
                if args.pass_ != "forward":
                    timed.update({f"{name}+bwd": _with_backward(fn) for name, fn in impls.items()})
                times, failures = time_interleaved_ms(timed, q, k, v, iters=args.iters, reps=args.reps,
                                                      min_rep_ms=args.min_rep_ms)
                for name, error in failures.items():
                    print(f"#   {name} failed: {type(error).__name__}: {str(error)[:200]}", file=sys.stderr)
                flops = 4 * batch * HEADS * HEAD_DIM * seq * seq * visible * _PASS_FLOPS[args.pass_]
                results = {}
                for name in impls:
                    ms = _pass_ms(args.pass_, times.get(name), times.get(f"{name}+bwd"))
                    if ms is not None and ms > 0:
                        results[name] = {"ms": ms, "tflops": flops / ms / 1e9}
                rows.append({"dtype": dtype_name, "head_dim": HEAD_DIM, "heads": HEADS, "batch": batch, "seq": seq,
                             "case": case, "pass": args.pass_, "device": _device_name(jax.devices()[0]),
                             "results": results})
    return rows


def print_table(rows: list[dict]) -> None:
    unit, scale = ("TFLOP/s", 1.0) if jax.default_backend() == "gpu" else ("GFLOP/s", 1e3)
    pass_ = rows[0].get("pass", "forward") if rows else "forward"
    print(f"\nBias and mask tensors on {rows[0]['device'] if rows else '?'} ({datetime.date.today()}), {pass_}: "
          f"{unit}; jax_flash / cuDNN in brackets")
    for row in rows:
        r = row["results"]
        ratio = (f" ({r['jax_flash']['tflops'] / r['cudnn']['tflops']:.2f}x)"
                 if "jax_flash" in r and "cudnn" in r else "")
        cells = [f"{name} {v['tflops'] * scale:.1f}" + (ratio if name == "jax_flash" else "") for name, v in r.items()]
        print(f"{row['dtype']} D={row['head_dim']} {row['batch']} x {row['seq']} {row['case']}: " + " | ".join(cells))
