"""FP8 (float8_e4m3fn) inputs: the descale factors' checks and the call on the dequantised values.

Semantics: those of attention on q * q_descale, k * k_descale and v * v_descale, each descale a float32 (batch,
heads_k) array (1 where None) applied to every query head of its kv head's group, as FlashAttention-3 takes them.
The CPU path computes it in float32 with the scales folded where they cost nothing: q_descale * k_descale multiplies
q (the scores are linear in both), v_descale multiplies the output (linear in v), so k and v are only widened, never
rescaled (a paged pool's page may belong to any sequence).

On a GPU, the sm90 FP8 kernel (Hopper, head dims 128 and 256; jax_flash/_fp8_primitive.py) takes contiguous calls
with causal, window and length masks: e4m3 wgmma for both products, P rounded to e4m3, the descales folded into the
softmax's scale and the output, each V block transposed in shared memory. Every other FP8 call on a GPU (other head
dims or devices, paged K/V, segment ids, bias / mask tensors, softcap, a scale <= 0) runs the 16-bit kernels on
bfloat16 inputs dequantised by XLA (q * q_descale * k_descale, k; the output times v_descale).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash.config import FP8_CONFIGS

try:
    _Tracer = jax.core.Tracer
except AttributeError:  # moved out of the public jax.core in newer releases
    from jax._src.core import Tracer as _Tracer

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
    if not isinstance(descale, _Tracer):  # (traced values are checked nowhere: the kernel gives NaN)
        bad = ~(np.isfinite(np.asarray(descale)) & (np.asarray(descale) > 0))
        if bad.any():
            index = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"{name} must be finite and > 0 (a quantisation scale); {name}{list(index)} = "
                             f"{float(np.asarray(descale)[index])!r}")
    return descale


E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize_fp8(x, heads_k: int | None = None):
    """(x8, descale): x (batch, seq, heads, head_dim) as float8_e4m3fn with a float32 (batch, heads_k) descale per
    kv head group (heads_k: x's heads by default; pass k's heads for q), so that x8 * descale ~ x: each group's
    largest magnitude maps to e4m3's 448 (a group of zeros gets descale 1). The descales are what attention's
    q_descale, k_descale and v_descale take."""
    batch, seq, heads, head_dim = x.shape
    heads_k = heads if heads_k is None else heads_k
    if heads_k <= 0 or heads % heads_k:
        raise ValueError(f"heads_k={heads_k} must divide x's {heads} heads")
    grouped = x.astype(jnp.float32).reshape(batch, seq, heads_k, heads // heads_k, head_dim)
    amax = jnp.max(jnp.abs(grouped), axis=(1, 3, 4))
    descale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0).astype(jnp.float32)
    x8 = (grouped / descale[:, None, :, None, None]).astype(jnp.float8_e4m3fn)
    return x8.reshape(x.shape), descale


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


def on_gpu(q, traced: bool) -> bool:
    """Whether the call runs on a GPU: q's devices where it is a committed array, else the default device's
    platform."""
    devices = None if traced else q.devices()
    committed = devices and getattr(q, "committed", True)
    platforms = {d.platform for d in devices} if committed else {_default_platform()}
    return bool(platforms - {"cpu"})


def kernel_refusal(q, k, cfg, kwargs) -> str | None:
    """Why the sm90 FP8 kernel does not take this (checked) GPU call, or None when it does: a Hopper device, head
    dim 128 or 256, cfg None or an sm90 config, contiguous K / V, no segment ids, bias / mask tensors, ALiBi slopes
    or softcap, softmax_scale > 0."""
    if q.shape[3] not in FP8_CONFIGS:
        return f"head_dim {q.shape[3]} (the FP8 kernel has {sorted(FP8_CONFIGS)})"
    if cfg is not None and cfg.family != "sm90":
        return f"a family={cfg.family!r} config"
    for name in ("page_table", "q_segment_ids", "kv_segment_ids", "bias", "mask", "alibi_slopes", "softcap"):
        if kwargs.get(name) is not None:
            return name
    if kwargs.get("softmax_scale") is not None and not float(kwargs["softmax_scale"]) > 0:
        return "softmax_scale <= 0"
    if k.shape[1] == 0 or q.shape[0] == 0:
        return "an empty call"
    if not _on_hopper():
        return "not a Hopper GPU (compute capability 9.x)"
    return None


def _on_hopper() -> bool:
    """Whether every default-backend device is a Hopper GPU (compute capability 9.x)."""
    return all(str(getattr(d, "compute_capability", "")).startswith("9.") for d in jax.devices())


def scores_descale(q_descale, k_descale):
    """q_descale * k_descale, the factor of the scores (each None: 1; None when both are)."""
    given = [d for d in (q_descale, k_descale) if d is not None]
    return None if not given else given[0] if len(given) == 1 else given[0] * given[1]


def dequantised_inputs(q, k, v, q_descale, k_descale, v_descale, dtype=jnp.float32):
    """(q, k, v, v_scale) in `dtype` with q_descale * k_descale folded into q (in float32, then rounded); v_scale
    multiplies the output (None: 1). The descales were checked (check_descale)."""
    heads_q = q.shape[2]
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    qk = scores_descale(q_descale, k_descale)
    if qk is not None:
        q32 = q32 * per_query_head(qk, heads_q)
    v_scale = per_query_head(v_descale, heads_q) if v_descale is not None else None
    return q32.astype(dtype), k32.astype(dtype), v32.astype(dtype), v_scale
