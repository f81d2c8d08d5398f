"""jax_flash.dot_product_attention: jax.nn.dot_product_attention's signature and results, on jax_flash's kernels.

jax.nn's conventions differ from jax_flash.attention's in three places, each mapped here:
- is_causal and local_window_size are aligned to the top-left corner (row i sees key j <= i), whatever the lengths;
  jax_flash.attention aligns to the bottom-right corner of the actual lengths. A top-left band lo <= j - i <= hi is
  a row and key slice of the call whose own bottom-right diagonal reproduces it (jax_flash._ring.pair_plan).
- A row that sees no key gets the mean of V over all keys (every score is the same large negative number), and its
  residual that number; jax_flash gives zeros and lse -inf.
- return_residual is the lse in (B, T, N) and the input dtype.
Key lengths with is_causal are two kernel calls (_causal_with_key_lengths). Bias and mask tensors go to the kernels'
own (sliced with the band). Where key lengths would move the kernel's diagonal off jax.nn's band (windows, unless
one array is passed as both query_seq_lengths and key_value_seq_lengths and the band lies on a square; is_causal
with bias or mask tensors), they become segment ids instead: key j of row b gets id 0 below the length and 1 past
it, every query id 0, so the keys past the length are hidden with the diagonal where the band put it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash._ring import pair_plan
from jax_flash.attention import attention

_IMPLEMENTATIONS = (None, "xla", "cudnn")
_CAUSAL = (None, 0)  # the band of is_causal without a window


def _large_negative() -> float:
    """jax.nn's masked score: -0.7 x the float32 maximum (its softmax runs in float32)."""
    return -0.7 * float(np.finfo(np.float32).max)


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale: float | None = None,
                          is_causal: bool = False, query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size: int | tuple[int, int] | None = None, implementation: str | None = None,
                          return_residual: bool = False):
    """A drop-in for jax.nn.dot_product_attention (same arguments, same results) that runs jax_flash's kernels.

    query (B, T, N, H) or (T, N, H); key, value (B, S, K, H) or (S, K, H), N % K == 0. `implementation` is checked
    (None, "xla" or "cudnn", as jax.nn allows) and otherwise ignored: the call runs jax_flash. Use this where code
    was written for jax.nn (Flax's attention_fn: jax_flash.flax.attention_fn); use jax_flash.attention for
    FlashAttention's conventions (bottom-right causal, lse output, paged caches, configs).
    """
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {_IMPLEMENTATIONS} (accepted as jax.nn does and otherwise "
                         f"ignored: jax_flash runs the call), got {implementation!r}")
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    squeeze = query.ndim == 3
    if squeeze:
        query, key, value = query[None], key[None], value[None]
    # (jax.nn takes bias and mask of rank 2 to 4, leading dimensions added)
    bias, mask = (None if x is None else jnp.reshape(jnp.asarray(x), (1,) * (4 - jnp.ndim(x)) + jnp.shape(x))
                  for x in (bias, mask))
    _check_arguments(query, is_causal, scale, local_window_size, query_seq_lengths, key_value_seq_lengths)
    if isinstance(local_window_size, int):
        local_window_size = (local_window_size, local_window_size)
    band = _band(bool(is_causal), local_window_size)
    plan = pair_plan(query.shape[1], key.shape[1], *band) if band != (None, None) else \
        (0, query.shape[1], 0, key.shape[1], -1, -1)
    result = _on_kernels(query, key, value, scale, band, plan, query_seq_lengths, key_value_seq_lengths,
                         return_residual, bias, mask)
    if squeeze:
        return tuple(x[0] for x in result) if return_residual else result[0]
    return result


def _check_arguments(query, is_causal, scale, window, q_lengths, kv_lengths) -> None:
    """jax.nn's arguments checked under jax.nn's names (jax_flash.attention's own checks name its arguments)."""
    # (jax.nn takes the truth value of a Python int too)
    if not isinstance(is_causal, (bool, np.bool_, int, np.integer)):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r} of type {type(is_causal).__name__}")
    if scale is not None and (isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.number))):
        raise TypeError(f"scale must be a real number or None, got {scale!r} of type {type(scale).__name__}")
    pair = (window, window) if isinstance(window, (int, np.integer)) and not isinstance(window, bool) else window
    if pair is not None and (not isinstance(pair, (tuple, list)) or len(pair) != 2 or
                             not all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) for w in pair)):
        raise ValueError(f"local_window_size must be an int or a pair of ints (left, right), got {window!r}")
    for name, lengths in (("query_seq_lengths", q_lengths), ("key_value_seq_lengths", kv_lengths)):
        if lengths is None:
            continue
        shape, dtype = np.shape(lengths), jnp.dtype(getattr(lengths, "dtype", np.asarray(lengths).dtype))
        if shape != (query.shape[0],) or dtype != jnp.int32:
            raise ValueError(f"{name} must be an int32 array of shape (batch,) = ({query.shape[0]},), got "
                             f"{dtype.name}{shape}")


def _band(is_causal, window):
    """(lo, hi): row i sees key j when lo <= j - i <= hi (None: unbounded), jax.nn's top-left masks."""
    lo = None if window is None else -int(window[0])
    hi = None if window is None else int(window[1])
    if is_causal:
        hi = 0 if hi is None else min(hi, 0)
    return lo, hi


def _lengths_keep_the_band(plan, q_lengths, kv_lengths) -> bool:
    """Whether the key lengths can reach the kernel as lengths: no band (the plan is the whole call), or one array for
    both on a square band at the origin (lengths and band share the origin and the diagonal)."""
    r0, r1, c0, c1, left, right = plan
    return (left, right) == (-1, -1) or (kv_lengths is q_lengths and r0 == c0 == 0 and r1 == c1)


def _sliced(x, r0, r1, c0, c1):
    """A bias or mask tensor (None, or rank 4 with broadcast dimensions of size 1) cut to rows r0:r1, keys c0:c1."""
    if x is None:
        return None
    rows = slice(r0, r1) if x.shape[2] != 1 else slice(None)
    keys = slice(c0, c1) if x.shape[3] != 1 else slice(None)
    return x[:, :, rows, keys]


def _banded(query, key, value, scale, plan, q_lengths, kv_lengths, bias=None, mask=None):
    """(out, lse) of jax.nn's band as the plan's slice; rows outside it see nothing."""
    batch, seq_q, heads, _ = query.shape
    if plan is None:  # no pair is visible: every row is jax.nn's fully masked row
        return jnp.zeros(query.shape, query.dtype), jnp.full((batch, heads, seq_q), -jnp.inf, jnp.float32)
    r0, r1, c0, c1, left, right = plan
    # Key lengths reach the kernel as lengths where they cannot move its diagonal (_lengths_keep_the_band), else as
    # segment ids (the module docstring); query lengths alone are applied by the caller.
    kv = {}
    if kv_lengths is not None and _lengths_keep_the_band(plan, q_lengths, kv_lengths):
        kv = dict(q_lengths=q_lengths, kv_lengths=kv_lengths)
    elif kv_lengths is not None:
        past = (jnp.arange(c0, c1)[None, :] >= kv_lengths[:, None]).astype(jnp.int32)  # (B, keys of the slice)
        kv = dict(q_segment_ids=jnp.zeros((batch, r1 - r0), jnp.int32), kv_segment_ids=past)
    out, lse = attention(query[:, r0:r1], key[:, c0:c1], value[:, c0:c1], softmax_scale=scale, window=(left, right),
                         bias=_sliced(bias, r0, r1, c0, c1), mask=_sliced(mask, r0, r1, c0, c1), return_lse=True,
                         **kv)
    out = jnp.pad(out, ((0, 0), (r0, seq_q - r1), (0, 0), (0, 0)))
    lse = jnp.pad(lse, ((0, 0), (0, 0), (r0, seq_q - r1)), constant_values=-jnp.inf)
    return out, lse


def _causal_with_key_lengths(query, key, value, scale, kv_lengths):
    """(out, lse) of top-left causal attention over the keys before kv_lengths (any query lengths apply later).
    Rows i < L = min(kv_len, S, T) see keys j <= i: the kernel's causal mask with both lengths L (offset 0). Rows
    i >= L see every valid key (then L = kv_len): a second call, unmasked, on the rows reversed so that they come
    first and q_lengths = T - L stops it there."""
    seq_q, seq_k = query.shape[1], key.shape[1]
    first = jnp.minimum(jnp.clip(kv_lengths, 0, seq_k), seq_q).astype(jnp.int32)  # (the kernel clamps to seq_k)
    out_a, lse_a = attention(query, key, value, softmax_scale=scale, causal=True, q_lengths=first, kv_lengths=first,
                             return_lse=True)
    out_b, lse_b = attention(query[:, ::-1], key, value, softmax_scale=scale, q_lengths=seq_q - first,
                             kv_lengths=kv_lengths, return_lse=True)
    late = jnp.arange(seq_q)[None, :] >= first[:, None]  # (B, T)
    out = jnp.where(late[:, :, None, None], out_b[:, ::-1], out_a)
    lse = jnp.where(late[:, None, :], lse_b[:, :, ::-1], lse_a)
    return out, lse


def _on_kernels(query, key, value, scale, band, plan, q_lengths, kv_lengths, return_residual, bias=None,
                mask=None):
    batch, seq_q, heads, head_dim = query.shape
    seq_k = key.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if band == _CAUSAL and kv_lengths is not None and bias is None and mask is None:
        out, lse = _causal_with_key_lengths(query, key, value, scale, kv_lengths)
    else:
        out, lse = _banded(query, key, value, scale, plan, q_lengths, kv_lengths, bias, mask)
    # jax.nn's fully masked rows: the mean of V over all keys, residual = the masked score (+ log S, lost in float32)
    empty = jnp.isneginf(lse)  # (B, N, T)
    group = heads // key.shape[2]
    mean_v = jnp.repeat(jnp.mean(value.astype(jnp.float32), axis=1), group, axis=1)  # (B, N, H)
    out = jnp.where(jnp.transpose(empty, (0, 2, 1))[..., None], mean_v[:, None].astype(out.dtype), out)
    if q_lengths is not None:  # rows past the query length: zeros (jax.nn multiplies them out)
        rows = jnp.arange(seq_q)[None, :] < q_lengths[:, None]
        out = jnp.where(rows[:, :, None, None], out, 0).astype(query.dtype)
        empty = empty | ~rows[:, None, :]
    if not return_residual:
        return out
    masked = jnp.float32(_large_negative()) + jnp.log(jnp.float32(seq_k))
    residual = jnp.where(empty, masked, lse).astype(key.dtype)
    return out, jnp.transpose(residual, (0, 2, 1))
