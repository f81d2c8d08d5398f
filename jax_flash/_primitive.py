"""The JAX plumbing of attention: a primitive with abstract evaluation, a batching rule that folds vmapped axes into
the batch and a clear error under differentiation; it lowers through custom_partitioning (jax_flash/_sharding.py)
to a per-device primitive whose cpu and cuda lowerings emit the FFI custom call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax._src import dispatch as _dispatch  # no public spelling of prim_requires_devices_during_lowering

try:
    from jax.core import ShapedArray
except ImportError:  # moved out of the public jax.core in newer releases
    from jax._src.core import ShapedArray

from jax_flash import _ffi
from jax_flash._sharding import make_partitioned
from jax_flash.autotune import cache_key as _cache_key
from jax_flash.autotune import lookup as _lookup_tuned
from jax_flash.config import KernelConfig
from jax_flash.defaults import CPU_DEFAULT, default_gpu_config

# Operands: q (B, Sq, Hq, D), k, v (B, Sk, Hk, D), q_lengths, kv_lengths int32 (B).
# Results: out (B, Sq, Hq, D), lse float32 (B, Hq, Sq) (written only when return_lse; dropped otherwise).
# Params: cfg (KernelConfig or None), softmax_scale, causal, window_left, window_right, softcap (0 = off),
# has_q_lengths, has_kv_lengths, return_lse; they become the FFI attributes of ffi/attention_attrs.h.
attention_p = Primitive("jax_flash_attention")
attention_p.multiple_results = True
# The same call on one device's shard: what the FFI custom call computes. attention_p lowers to it through
# custom_partitioning, so sharded inputs are split, not gathered.
attention_local_p = Primitive("jax_flash_attention_local")
attention_local_p.multiple_results = True


def _abstract_eval(q, k, v, q_lengths, kv_lengths, **params):
    del k, v, q_lengths, kv_lengths, params
    batch, seq_q, heads_q, _ = q.shape
    return ShapedArray(q.shape, q.dtype), ShapedArray((batch, heads_q, seq_q), np.float32)


attention_p.def_abstract_eval(_abstract_eval)
attention_local_p.def_abstract_eval(_abstract_eval)


def _eager_impl(*args, **params):
    # Eager calls run the same custom call through a cached jit.
    return _jitted_bind(tuple(sorted(params.items())))(*args)


@functools.cache
def _jitted_bind(params):
    return jax.jit(lambda *args: attention_p.bind(*args, **dict(params)))


attention_p.def_impl(_eager_impl)


# ---- lowering ----------------------------------------------------------------------------------------------------
def _attrs(cfg: KernelConfig, params: dict) -> dict:
    attrs = {name: np.int64(value) for name, value in cfg.to_attrs().items()}
    attrs["softmax_scale"] = np.float32(params["softmax_scale"])
    attrs["softcap"] = np.float32(params["softcap"])
    for name in ("causal", "window_left", "window_right", "has_q_lengths", "has_kv_lengths", "return_lse"):
        attrs[name] = np.int64(params[name])
    return attrs


def _tuned(platform: str, q_aval, k_aval, params) -> KernelConfig | None:
    """The autotune cache's winner for this call (jax_flash/autotune.py), or None."""
    try:
        device_kind = jax.devices(platform)[0].device_kind
    except RuntimeError:  # lowering for a platform this process has no device of
        return None
    window = (params["window_left"], params["window_right"])
    key = _cache_key(device_kind, q_aval.shape[1], k_aval.shape[1], q_aval.dtype, q_aval.shape[3],
                             causal=params["causal"], window=None if window == (-1, -1) else window,
                             softcap=params["softcap"] or None)
    return _lookup_tuned(key)


def _lower_cpu(ctx, *args, cfg, **params):
    if cfg is None:
        cfg = _tuned("cpu", ctx.avals_in[0], ctx.avals_in[1], params) or CPU_DEFAULT
    return jax.ffi.ffi_lowering(_ffi.TARGET_NAME)(ctx, *args, **_attrs(cfg, params))


@functools.cache
def _cuda_arch() -> int:
    """Compute capability of the first CUDA device as 80, 90, ...; 90 when none is visible (cross-lowering)."""
    try:
        device = jax.devices("cuda")[0]
    except (RuntimeError, IndexError):
        return 90
    return _ffi.device_arch(device)


def resolve_gpu_config(cfg: KernelConfig | None, dtype, head_dim: int, tuned: KernelConfig | None = None,
                       right_bounded: bool = False, seq_k: int = 0) -> KernelConfig:
    """The compiled kernel config a GPU call runs, or a clear error saying what is compiled. right_bounded
    (causal, or a window with a right bound) and seq_k refine cfg=None's choice on sm_90 (jax_flash/defaults.py)."""
    dtype_name = jnp.dtype(dtype).name
    if not _ffi.BUILT_WITH_CUDA:
        raise RuntimeError("jax_flash was built without CUDA (no CUDA compiler at build time), so it cannot run on a "
                           "GPU; rebuild on a machine with the CUDA toolkit (see README, 'Building on a GPU machine')")
    if dtype_name not in ("float16", "bfloat16"):
        raise TypeError(f"q, k and v have dtype {dtype_name}; the GPU kernels support float16 and bfloat16 "
                        f"(float32 is accepted on CPU only)")
    head_dims = _ffi.gpu_head_dims(dtype_name)
    if head_dim not in head_dims:
        raise ValueError(f"head_dim={head_dim} is not supported on GPU; supported head dims: {head_dims}")
    arch = _cuda_arch()
    # The sm90 family runs on sm_90 only; elsewhere it is neither a default nor a valid choice.
    compiled = [c for c in _ffi.compiled_configs_for(dtype_name, head_dim) if c.family != "sm90" or arch == 90]
    if cfg is not None and cfg.family == "sm90" and arch != 90:
        raise ValueError(f"cfg={cfg!r} is a family='sm90' (Hopper: wgmma, TMA) config; this GPU is sm_{arch}. "
                         f"Use a family='sm80' config or cfg=None")
    if cfg is None:
        if tuned is not None and tuned in compiled:  # the autotune cache first, then the table
            return tuned
        return default_gpu_config(arch, dtype_name, head_dim, compiled, right_bounded, seq_k)
    if cfg not in compiled:
        listing = "\n  ".join(repr(c) for c in compiled)
        raise ValueError(f"cfg={cfg!r} is not compiled into this build for {dtype_name} head_dim={head_dim}. "
                         f"Compiled configs:\n  {listing}\n(build with -DJAX_FLASH_CONFIG_SET=all for the whole "
                         f"tuning space)")
    return cfg


def _lower_cuda(ctx, *args, cfg, **params):
    q_aval = ctx.avals_in[0]
    tuned = _tuned("cuda", q_aval, ctx.avals_in[1], params) if cfg is None else None
    right_bounded = bool(params["causal"]) or params["window_right"] >= 0
    cfg = resolve_gpu_config(cfg, q_aval.dtype, q_aval.shape[3], tuned, right_bounded, ctx.avals_in[1].shape[1])
    return jax.ffi.ffi_lowering(_ffi.TARGET_NAME)(ctx, *args, **_attrs(cfg, params))


mlir.register_lowering(attention_local_p, _lower_cpu, platform="cpu")
mlir.register_lowering(attention_local_p, _lower_cuda, platform="cuda")


def _bind_local(q, k, v, q_lengths, kv_lengths, params):
    return tuple(attention_local_p.bind(q, k, v, q_lengths, kv_lengths, **dict(params)))


_partitioned_attention = make_partitioned(_bind_local)


def _lower_partitioned(ctx, *args, **params):
    return mlir.lower_fun(lambda *xs: _partitioned_attention(*xs, tuple(sorted(params.items()))),
                          multiple_results=True)(ctx, *args)


mlir.register_lowering(attention_p, _lower_partitioned)
# custom_partitioning needs the device assignment while lowering; jit provides it only for primitives on this list
# (custom_partitioning's own primitive is on it, but it appears only inside our lowering, so jit cannot see it).
_dispatch.prim_requires_devices_during_lowering.add(attention_p)


# ---- vmap: fold the mapped axis into the batch axis ---------------------------------------------------------------
def _batch_rule(args, dims, **params):
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)

    def fold(x, d):
        x = jnp.broadcast_to(x, (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)
        return x.reshape((size * x.shape[1], *x.shape[2:]))  # (size * B, ...): the mapped axis joins the batch

    out, lse = attention_p.bind(*(fold(x, d) for x, d in zip(args, dims)), **params)
    return (out.reshape((size, -1, *out.shape[1:])), lse.reshape((size, -1, *lse.shape[1:]))), (0, 0)


batching.primitive_batchers[attention_p] = _batch_rule


# ---- differentiation: forward-only ---------------------------------------------------------------------------------
def _no_jvp(primals, tangents, **params):
    raise NotImplementedError(
        "jax_flash.attention is forward-only: it has no gradient (no JVP/VJP rule). Use it for inference, or "
        "differentiate through jax.nn.dot_product_attention instead.")


ad.primitive_jvps[attention_p] = _no_jvp
