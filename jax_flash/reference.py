"""A plain fp32 attention with jax_flash's semantics, for tests, the benchmark and users checking their shapes.

O(Sq * Sk) memory: use it on small problems. Inputs are upcast to float32 (float64 stays float64).
"""

from __future__ import annotations

import math

import jax.numpy as jnp


def visibility_mask(batch, seq_q, seq_k, *, causal=False, window=None, q_lengths=None, kv_lengths=None,
                    q_segment_ids=None, kv_segment_ids=None, rows=None):
    """(B, 1, Sq, Sk) bool: query row i sees key j (docs/DESIGN.md "Semantics"): j < kv_len, i < q_len and
    i + (kv_len - q_len) - left <= j <= i + (kv_len - q_len) + right, with causal meaning right <= 0 and -1 unbounded;
    with segment ids also q_segment_ids[b, i] == kv_segment_ids[b, j]. rows=(first, count): only query rows first ..
    first + count - 1 (first may be traced; q_segment_ids then holds those rows), (B, 1, count, Sk)."""
    q_len = jnp.full((batch,), seq_q, jnp.int32) if q_lengths is None else jnp.clip(q_lengths, 0, seq_q)
    kv_len = jnp.full((batch,), seq_k, jnp.int32) if kv_lengths is None else jnp.clip(kv_lengths, 0, seq_k)
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    first, count = (0, seq_q) if rows is None else rows
    i = (first + jnp.arange(count))[None, :, None]
    j = jnp.arange(seq_k)[None, None, :]
    offset = (kv_len - q_len)[:, None, None]
    mask = (j < kv_len[:, None, None]) & (i < q_len[:, None, None])
    if left >= 0:
        mask &= j >= i + offset - left
    if right >= 0:
        mask &= j <= i + offset + right
    if q_segment_ids is not None:
        mask &= q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    return mask[:, None]


def alibi_bias(slopes, seq_q, seq_k, *, q_lengths=None, kv_lengths=None, rows=None):
    """float32 (B or 1, Hq, Sq, Sk): ALiBi's bias -slopes[b, h] * |i + kv_len - q_len - j| from (Hq,) or (B|1, Hq)
    slopes (csrc/common/alibi.h): zero on the bottom-right diagonal that causal masking uses, with the lengths.
    rows=(first, count): only those query rows, as visibility_mask takes them."""
    slopes = jnp.asarray(slopes, jnp.float32)
    slopes = slopes.reshape((1, -1)) if slopes.ndim == 1 else slopes
    offset = jnp.asarray(seq_k - seq_q, jnp.int32).reshape((1,))
    if q_lengths is not None or kv_lengths is not None:
        batch = (q_lengths if q_lengths is not None else kv_lengths).shape[0]
        q_len = jnp.full((batch,), seq_q, jnp.int32) if q_lengths is None else jnp.clip(q_lengths, 0, seq_q)
        kv_len = jnp.full((batch,), seq_k, jnp.int32) if kv_lengths is None else jnp.clip(kv_lengths, 0, seq_k)
        offset = kv_len - q_len
    first, count = (0, seq_q) if rows is None else rows
    diagonal = (first + jnp.arange(count))[None, :, None] + offset[:, None, None]  # (B|1, Sq, 1)
    distance = jnp.abs(diagonal - jnp.arange(seq_k)[None, None, :]).astype(jnp.float32)
    return -slopes[:, :, None, None] * distance[:, None]


def attention_reference(q, k, v, *, causal=False, softmax_scale=None, window=None, softcap=None, q_lengths=None,
                        kv_lengths=None, q_segment_ids=None, kv_segment_ids=None, bias=None, mask=None,
                        alibi_slopes=None, return_lse=False, compute_dtype=None, q_descale=None, k_descale=None,
                        v_descale=None):
    """jax_flash.attention's semantics in plain jnp: q (B, Sq, Hq, D), k and v (B, Sk, Hk, D), Hq % Hk == 0.

    bias (added to the soft-capped scores) and mask (False hides the key) broadcast to (B, Hq, Sq, Sk);
    alibi_slopes (Hq,) or (B, Hq) add alibi_bias's bias the same way.
    Returns (B, Sq, Hq, D) in `compute_dtype` (default float32), and with return_lse the float32 (B, Hq, Sq) natural
    log-sum-exp of the scores over visible keys. Rows that see no key give zeros and lse -inf.
    Passing the input dtype as compute_dtype gives the plain low-precision attention of the tests' tolerance rule.
    q_descale, k_descale, v_descale: (B, Hk) factors of FP8 inputs (jax_flash/fp8.py), each multiplying its input
    after the conversion, a kv head's factor every query head of its group.
    """
    compute = compute_dtype or (jnp.float64 if q.dtype == jnp.float64 else jnp.float32)
    q, k, v = (jnp.asarray(x).astype(compute) for x in (q, k, v))
    batch, seq_q, heads_q, head_dim = q.shape
    seq_k, heads_k = k.shape[1], k.shape[2]
    if q_descale is not None:
        q = q * jnp.repeat(jnp.asarray(q_descale, compute), heads_q // heads_k, axis=1)[:, None, :, None]
    if k_descale is not None:
        k = k * jnp.asarray(k_descale, compute)[:, None, :, None]
    if v_descale is not None:
        v = v * jnp.asarray(v_descale, compute)[:, None, :, None]
    scale = (1.0 / math.sqrt(head_dim) if head_dim else 1.0) if softmax_scale is None else softmax_scale
    group = heads_q // heads_k if heads_k else 1
    k = jnp.repeat(k, group, axis=2)  # (B, Sk, Hq, D)
    v = jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * jnp.asarray(scale, compute)  # (B, Hq, Sq, Sk)
    if softcap:
        scores = softcap * jnp.tanh(scores / softcap)
    if bias is not None:
        scores = scores + jnp.asarray(bias).astype(compute)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, seq_q, seq_k, q_lengths=q_lengths,
                                     kv_lengths=kv_lengths).astype(compute)
    visible = visibility_mask(batch, seq_q, seq_k, causal=causal, window=window, q_lengths=q_lengths,
                              kv_lengths=kv_lengths, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
    if mask is not None:
        visible = visible & jnp.asarray(mask, bool)
    scores = jnp.where(visible, scores, -jnp.inf)
    row_max = scores.max(axis=-1, keepdims=True, initial=-jnp.inf)
    safe_max = jnp.where(jnp.isfinite(row_max), row_max, 0)
    probs = jnp.exp(scores - safe_max)
    row_sum = probs.sum(axis=-1, keepdims=True)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs / jnp.where(row_sum > 0, row_sum, 1), v)
    if not return_lse:
        return out
    lse = jnp.where(row_sum[..., 0] > 0, safe_max[..., 0].astype(jnp.float32) +
                    jnp.log(row_sum[..., 0].astype(jnp.float32)), -jnp.inf)
    return out, lse


def gather_pages(pages, page_table):
    """Paged K or V, (num_pages, page_size, heads, head_dim) with an int32 (batch, pages_per_seq) page table, as the
    contiguous (batch, pages_per_seq * page_size, heads, head_dim) tensor it stands for. Ids outside
    [0, num_pages) give zeros (the GPU kernels' reading of them)."""
    num_pages, page_size = pages.shape[0], pages.shape[1]
    valid = (page_table >= 0) & (page_table < num_pages)
    gathered = jnp.take(pages, jnp.where(valid, page_table, 0), axis=0)  # (B, P, page_size, H, D)
    gathered = jnp.where(valid[:, :, None, None, None], gathered, 0)
    batch, pages_per_seq = page_table.shape
    return gathered.reshape((batch, pages_per_seq * page_size, *pages.shape[2:]))
