"""A plain fp32 attention with jax_flash's semantics, for tests, the benchmark and users checking their shapes.

O(Sq * Sk) memory: use it on small problems. Inputs are upcast to float32 (or kept in float64 when jax x64 is on).
"""

from __future__ import annotations

import math

import jax.numpy as jnp


def attention_reference(q, k, v, *, softmax_scale: float | None = None, compute_dtype=None):
    """q (B, Sq, Hq, D), k and v (B, Sk, Hk, D) with Hq % Hk == 0 -> (B, Sq, Hq, D) in `compute_dtype`.

    softmax(scale * q k^T) v per head; query head h reads kv head h // (Hq // Hk); rows that see no key are zero.
    compute_dtype defaults to float32 (float64 for float64 inputs); passing the input dtype gives the plain
    low-precision attention that the tolerance rule of the tests compares against.
    """
    compute = compute_dtype or (jnp.float64 if q.dtype == jnp.float64 else jnp.float32)
    q, k, v = (jnp.asarray(x).astype(compute) for x in (q, k, v))
    batch, seq_q, heads_q, head_dim = q.shape
    heads_k = k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    group = heads_q // heads_k
    k = jnp.repeat(k, group, axis=2)  # (B, Sk, Hq, D)
    v = jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale  # (B, Hq, Sq, Sk)
    if k.shape[1] == 0:
        return jnp.zeros(q.shape, compute)
    probs = jnp.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = probs / probs.sum(axis=-1, keepdims=True)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)
