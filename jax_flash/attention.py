"""The public attention function: validates inputs with clear errors, then binds the primitive."""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash._primitive import attention_p
from jax_flash.config import KernelConfig

_INPUT_DTYPES = ("float16", "bfloat16", "float32")


def attention(q, k, v, cfg: KernelConfig | None = None, *, causal: bool = False, softmax_scale: float | None = None,
              window: tuple[int, int] | None = None, softcap: float | None = None, q_lengths=None, kv_lengths=None,
              return_lse: bool = False):
    """FlashAttention forward: softmax(scale * q k^T, masked) v, computed blockwise without the (Sq, Sk) matrix.

    Args:
      q: (batch, seq_q, heads_q, head_dim), float16 or bfloat16 (float32 also on CPU).
      k, v: (batch, seq_k, heads_k, head_dim), q's dtype; heads_q must be a multiple of heads_k (GQA/MQA: query head
        h reads kv head h // (heads_q // heads_k)). Any seq_q, seq_k >= 0.
      cfg: a KernelConfig compiled into this build (see supported_configs()), or None for the default of the
        device, dtype and head dim (jax_flash/defaults.py).
      causal: query row i sees key j only when j <= i + (seq_k - seq_q): aligned to the bottom-right corner
        (FlashAttention's convention; equals jax.nn's is_causal when seq_q == seq_k).
      softmax_scale: multiplies q.k; default 1 / sqrt(head_dim).
      window: (left, right) local window measured from that same diagonal, -1 = unbounded on that side; combines
        with causal (which caps right at 0).
      softcap: scores become softcap * tanh(scores / softcap) before masking and softmax.
      q_lengths, kv_lengths: int32 (batch,) actual lengths (traced: changing them does not recompile). Keys at or
        past kv_lengths[b] are invisible; query rows at or past q_lengths[b] give zeros; causal and window
        alignment use these lengths. Values are clamped to [0, seq].
      return_lse: also return the float32 (batch, heads_q, seq_q) natural log-sum-exp of the scaled scores.

    Returns:
      out (batch, seq_q, heads_q, head_dim) in q's dtype, or (out, lse) with return_lse. A row that sees no key
      gives zeros and lse -inf. Works eagerly and under jax.jit/vmap; forward-only.
    """
    q, k, v = (_as_array(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} has shape {tuple(x.shape)} (rank {x.ndim}); expected rank 4: "
                             f"(batch, seq, heads, head_dim)")
        if jnp.dtype(x.dtype).name not in _INPUT_DTYPES:
            raise TypeError(f"{name} has dtype {jnp.dtype(x.dtype).name}; supported dtypes are float16 and bfloat16 "
                            f"(float32 on CPU)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k has shape {tuple(k.shape)} but v has shape {tuple(v.shape)}; they must be equal")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k has batch {k.shape[0]} but q has batch {q.shape[0]}; they must be equal")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"k has head_dim {k.shape[3]} but q has head_dim {q.shape[3]}; they must be equal")
    heads_q, heads_k = q.shape[2], k.shape[2]
    if (heads_k == 0 and heads_q != 0) or (heads_k and heads_q % heads_k):
        raise ValueError(f"k has {heads_k} heads but q has {heads_q}; q heads must be a multiple of k heads")
    if cfg is not None and not isinstance(cfg, KernelConfig):
        raise TypeError(f"cfg must be a jax_flash.KernelConfig or None, got {type(cfg).__name__}: {cfg!r}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    head_dim = q.shape[3]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    elif not _is_real(softmax_scale) or not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be a finite number, got {softmax_scale!r}")
    # The kernels keep each row's running maximum of the raw scores q.k and exponentiate scale * (s - max), which
    # is <= 0 only for scale > 0 (and 0 * -inf, a masked score, is NaN). Both rewrites below are exact:
    if softmax_scale < 0:  # scale * (q.k) = (-scale) * (q.(-k))
        k, softmax_scale = -k, -softmax_scale
    elif softmax_scale == 0:  # every visible score is 0: the same as q = 0 with any scale (lse = log(#visible))
        q, softmax_scale = jnp.zeros_like(q), 1.0
    window_left, window_right = _check_window(window)
    if softcap is not None and (not _is_real(softcap) or not math.isfinite(softcap) or softcap <= 0):
        raise ValueError(f"softcap must be a finite number > 0 (or None for no softcap), got {softcap!r}")
    batch = q.shape[0]
    lengths = [_check_lengths(x, name, batch) for x, name in ((q_lengths, "q_lengths"), (kv_lengths, "kv_lengths"))]
    q_len_arr = lengths[0] if lengths[0] is not None else jnp.full((batch,), q.shape[1], jnp.int32)
    kv_len_arr = lengths[1] if lengths[1] is not None else jnp.full((batch,), k.shape[1], jnp.int32)
    out, lse = attention_p.bind(
        q, k, v, q_len_arr, kv_len_arr, cfg=cfg, softmax_scale=float(softmax_scale), causal=bool(causal),
        window_left=window_left, window_right=window_right, softcap=float(softcap or 0.0),
        has_q_lengths=lengths[0] is not None, has_kv_lengths=lengths[1] is not None, return_lse=bool(return_lse))
    return (out, lse) if return_lse else out


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_window(window) -> tuple[int, int]:
    if window is None:
        return -1, -1
    if (not isinstance(window, (tuple, list)) or len(window) != 2 or
            not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window)):
        raise ValueError(f"window must be a pair of ints (left, right), -1 = unbounded; got {window!r}")
    left, right = int(window[0]), int(window[1])
    if left < -1 or right < -1:
        raise ValueError(f"window sizes must be >= -1 (-1 = unbounded), got {window!r}")
    return left, right


def _check_lengths(lengths, name, batch):
    if lengths is None:
        return None
    lengths = _as_array(lengths, name)
    if lengths.shape != (batch,) or jnp.dtype(lengths.dtype) != jnp.int32:
        raise ValueError(f"{name} must be an int32 array of shape (batch,) = ({batch},); got "
                         f"{jnp.dtype(lengths.dtype).name}{tuple(lengths.shape)}")
    return lengths


def _as_array(x, name):
    if isinstance(x, (jax.Array, np.ndarray)) or hasattr(x, "aval"):
        return x
    raise TypeError(f"{name} must be a jax or numpy array, got {type(x).__name__}")
