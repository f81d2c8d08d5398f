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

from jax_flash import _ffi, autotune_cache
from jax_flash._sharding import make_partitioned
from jax_flash.config import CALL_ATTRIBUTES, KernelConfig
from jax_flash.selection import CPU_DEFAULT, resolve_gpu_config

# Operands: q (B, Sq, Hq, D), k, v (B, Sk, Hk, D), q_lengths, kv_lengths int32 (B).
# Results: out (B, Sq, Hq, D), lse float32 (B, Hq, Sq) (written only when return_lse; dropped otherwise).
# Params: cfg (KernelConfig or None) and the call's attributes (jax_flash.config.CALL_ATTRIBUTES: softmax_scale,
# causal, window_left, window_right, softcap (0 = off), has_q_lengths, has_kv_lengths, return_lse); they become the
# FFI attributes of the generated ffi/attention_attrs.h.
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
    for name, kind, _ in CALL_ATTRIBUTES:
        attrs[name] = np.float32(params[name]) if kind == "float" else np.int64(params[name])
    return attrs


def _tuned(platform: str, q_aval, k_aval, params) -> KernelConfig | None:
    """The autotune cache's winner for this call (jax_flash/autotune_cache.py), or None."""
    try:
        device_kind = jax.devices(platform)[0].device_kind
    except RuntimeError:  # lowering for a platform this process has no device of
        return None
    window = (params["window_left"], params["window_right"])
    key = autotune_cache.cache_key(device_kind, q_aval.shape[1], k_aval.shape[1], q_aval.dtype, q_aval.shape[3],
                                   causal=params["causal"], window=None if window == (-1, -1) else window,
                                   softcap=params["softcap"] or None)
    return autotune_cache.lookup(key)


def _lower_cpu(ctx, *args, cfg, **params):
    if cfg is None:
        cfg = _tuned("cpu", ctx.avals_in[0], ctx.avals_in[1], params) or CPU_DEFAULT
    return jax.ffi.ffi_lowering(_ffi.TARGET_NAME)(ctx, *args, **_attrs(cfg, params))


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
