"""FP8 (float8_e4m3fn) inputs: the descale factors' checks and the call on the dequantised values.

Semantics: those of attention on q * q_descale, k * k_descale and v * v_descale, each descale a float32 (batch,
heads_k) array (1 where None) applied to every query head of its kv head's group, as FlashAttention-3 takes them.
The CPU path computes it in float32 with the scales folded where they cost nothing: q_descale * k_descale multiplies
q (the scores are linear in both), v_descale multiplies the output (linear in v), so k and v are only widened, never
rescaled (a paged pool's page may belong to any sequence). The GPU kernels take float16 and bfloat16 only: FP8
calls there are refused with a clear error.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_DTYPES = ("float8_e4m3fn",)
OUT_DTYPES = ("bfloat16", "float16", "float32")


def is_fp8(x) -> bool:
    return jnp.dtype(x.dtype).name in FP8_DTYPES


def check_descale(descale, name: str, batch: int, heads_k: int):
    """A float32 (batch, heads_k) descale array, or None (no scaling)."""
    if descale is None:
        return None
    descale = jnp.asarray(descale)
    if jnp.dtype(descale.dtype) != jnp.float32 or descale.shape != (batch, heads_k):
        raise ValueError(f"{name} must be a float32 array of shape (batch, heads_k) = ({batch}, {heads_k}); got "
                         f"{jnp.dtype(descale.dtype).name}{tuple(descale.shape)}")
    return descale


def per_query_head(descale, heads_q: int):
    """(batch, heads_k) -> (batch, 1, heads_q, 1): each kv head's factor for every query head of its group."""
    group = heads_q // descale.shape[1] if descale.shape[1] else 1
    return jnp.repeat(descale, group, axis=1)[:, None, :, None]


def check_out_dtype(out_dtype, fp8: bool):
    """The output dtype of an FP8 call (bfloat16 by default); out_dtype on other calls is an error."""
    if out_dtype is None:
        return jnp.bfloat16 if fp8 else None
    if not fp8:
        raise ValueError(f"out_dtype={out_dtype!r} applies to float8_e4m3fn inputs only; other calls return q's dtype")
    name = jnp.dtype(out_dtype).name
    if name not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES} for float8_e4m3fn inputs, got {name}")
    return jnp.dtype(out_dtype)


def _default_platform() -> str:
    """Where an uncommitted or traced computation runs: jax.default_device's platform, else the default backend."""
    device = getattr(jax.config, "jax_default_device", None)
    if device is not None:
        return device if isinstance(device, str) else device.platform
    return jax.default_backend()


def refuse_on_gpu(q, traced: bool) -> None:
    """FP8 inputs run on the CPU path only: a clear error where they would reach the GPU kernels (q's devices where
    it is a committed array, else the default device's platform)."""
    devices = None if traced else q.devices()
    committed = devices and getattr(q, "committed", True)
    platforms = {d.platform for d in devices} if committed else {_default_platform()}
    if platforms - {"cpu"}:
        raise NotImplementedError(
            f"float8_e4m3fn q, k and v run on the CPU path only; the GPU kernels take float16 and bfloat16 (no FP8 "
            f"GPU kernel yet). Dequantise to bfloat16 (x.astype(jnp.bfloat16) * descale) for {sorted(platforms)}, "
            f"or put the inputs on jax.devices('cpu')")


def dequantised_inputs(q, k, v, q_descale, k_descale, v_descale):
    """(q, k, v, v_scale) in float32 with q_descale * k_descale folded into q; v_scale multiplies the output (None:
    1). The descales were checked (check_descale)."""
    heads_q = q.shape[2]
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    qk = None
    for descale in (q_descale, k_descale):
        if descale is not None:
            qk = descale if qk is None else qk * descale
    if qk is not None:
        q32 = q32 * per_query_head(qk, heads_q)
    v_scale = per_query_head(v_descale, heads_q) if v_descale is not None else None
    return q32, k32, v32, v_scale
