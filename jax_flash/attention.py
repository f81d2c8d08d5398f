"""The public attention function: validates inputs with clear errors, then binds the primitive."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash._primitive import attention_p
from jax_flash.config import KernelConfig

_INPUT_DTYPES = ("float16", "bfloat16", "float32")


def attention(q, k, v, cfg: KernelConfig | None = None):
    """FlashAttention forward: softmax(q k^T / sqrt(D)) v, computed blockwise without the (Sq, Sk) matrix.

    Args:
      q: (batch, seq_q, heads_q, head_dim), float16 or bfloat16 (float32 also on CPU).
      k, v: (batch, seq_k, heads_k, head_dim), q's dtype; heads_q must be a multiple of heads_k (GQA/MQA:
        query head h reads kv head h // (heads_q // heads_k)).
      cfg: a KernelConfig compiled into this build (see supported_configs()), or None for the default of the
        device, dtype and head dim (jax_flash/defaults.py).

    Returns:
      (batch, seq_q, heads_q, head_dim) in q's dtype. Works eagerly and under jax.jit/vmap; forward-only.
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
    head_dim = q.shape[3]
    softmax_scale = 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    return attention_p.bind(q, k, v, cfg=cfg, softmax_scale=float(softmax_scale))


def _as_array(x, name):
    if isinstance(x, (jax.Array, np.ndarray)) or hasattr(x, "aval"):
        return x
    raise TypeError(f"{name} must be a jax or numpy array, got {type(x).__name__}")
