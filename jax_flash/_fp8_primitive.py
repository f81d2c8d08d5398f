"""The FP8 forward on Hopper: a primitive of its own, with abstract evaluation and a batching rule that folds vmapped
axes into the batch. It lowers through custom_partitioning (jax_flash/_sharding.py: split over batch and heads, and
ring attention over a sharded sequence) to a per-device primitive whose cuda lowering is the
"jax_flash_attention_fp8" custom call (ffi/cuda_fp8_handler.cc, csrc/sm90/launch_fp8.cuh) and whose lowering
elsewhere computes the same call on the dequantised inputs by the CPU path. jax_flash/fp8.py decides which FP8 calls
reach it; differentiating it raises a clear error.

attention_fp8_p: operands q (B, Sq, Hq, D), k and v (B, Sk, Hk, D) float8_e4m3fn, qk_descale and v_descale float32
(B, Hk), q_lengths and kv_lengths int32 (B,) or (0,). Results: out bfloat16 (B, Sq, Hq, D), lse float32 (B, Hq, Sq).
Params: cfg (an sm90 KernelConfig of a compiled FP8 kernel, or None: config.fp8_config), softmax_scale (> 0), causal,
window_left, window_right, has_q_lengths, has_kv_lengths, return_lse; ring (None, or (mesh axes, devices, layout):
one device's part of ring attention, jax_flash/_ring.py) and same_lengths (q_lengths and kv_lengths are one array),
as the 16-bit primitive has them.
attention_fp8_local_p, the kernel's call on one device: the same operands, neither ring nor same_lengths.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_flash import fp8, native
from jax_flash._primitive import attention_local_p, no_extras, result_aval
from jax_flash._ring import FP8_RING_DEFAULTS, ring_forward
from jax_flash._sharding import make_partitioned_fp8, register_partitioned_lowering
from jax_flash.config import CALL_ATTRIBUTES, fp8_config

attention_fp8_p = Primitive("jax_flash_attention_fp8")
attention_fp8_p.multiple_results = True
# The same call on one device's shard: what the FFI custom call computes.
attention_fp8_local_p = Primitive("jax_flash_attention_fp8_local")
attention_fp8_local_p.multiple_results = True


def _abstract_eval(q, *rest, **params):
    del rest, params
    batch, seq_q, heads_q, _ = q.shape
    return result_aval(q, q.shape, jnp.bfloat16), result_aval(q, (batch, heads_q, seq_q), np.float32)


attention_fp8_p.def_abstract_eval(_abstract_eval)
attention_fp8_local_p.def_abstract_eval(_abstract_eval)


@functools.cache
def _jitted_bind(params):
    return jax.jit(lambda *args: attention_fp8_p.bind(*args, **dict(params)))


attention_fp8_p.def_impl(lambda *args, **params: _jitted_bind(tuple(sorted(params.items())))(*args))


def _lower_cuda(ctx, *args, cfg, **params):
    """The custom call (V is transposed in shared memory by the kernel, csrc/sm90/v_transpose.cuh)."""
    k_aval = ctx.avals_in[1]  # (fp8.py sends only FP8_CONFIGS' head dims)
    cfg = fp8_config(k_aval.shape[3]) if cfg is None else cfg
    attrs = {name: np.int64(value) for name, value in cfg.to_attrs().items()}
    attrs.update(pack_gqa=np.int64(0), num_splits=np.int64(1))
    call = {"softcap": 0.0, "paged": False, "deterministic": False, "alibi": False, **params}
    for name, kind, _ in CALL_ATTRIBUTES:
        attrs[name] = np.float32(call[name]) if kind == "float" else np.int64(call[name])
    return jax.ffi.ffi_lowering(native.FP8_TARGET_NAME)(ctx, *args, **attrs)


mlir.register_lowering(attention_fp8_local_p, _lower_cuda, platform="cuda")


def _dequantised(q, k, v, qk_descale, v_descale, q_lengths, kv_lengths, *, cfg, softmax_scale, causal, window_left,
                 window_right, has_q_lengths, has_kv_lengths, return_lse):
    """The call on other platforms: the 16-bit primitive's CPU path on the dequantised float32 inputs (q times
    q_descale * k_descale, the output times v_descale), as jax_flash/fp8.py computes FP8 calls there."""
    del cfg  # (a GPU kernel's)
    batch, heads_q = q.shape[0], q.shape[2]
    q32 = q.astype(jnp.float32) * fp8.per_query_head(qk_descale, heads_q)
    params = dict(cfg=None, softmax_scale=softmax_scale, causal=causal, window_left=window_left,
                  window_right=window_right, softcap=0.0, has_q_lengths=has_q_lengths, has_kv_lengths=has_kv_lengths,
                  return_lse=return_lse, paged=False, deterministic=False, ring=None, segments=False, has_bias=False,
                  has_mask=False, alibi=False, same_lengths=False)
    out, lse = attention_local_p.bind(q32, k.astype(jnp.float32), v.astype(jnp.float32), q_lengths, kv_lengths,
                                      jnp.zeros((batch, 0), jnp.int32), *no_extras(batch), **params)
    return (out * fp8.per_query_head(v_descale, heads_q)).astype(jnp.bfloat16), lse


mlir.register_lowering(attention_fp8_local_p, mlir.lower_fun(_dequantised, multiple_results=True))


# The per-device kernel call's parameters (attention_fp8_local_p).
_KERNEL_PARAMS = ("cfg", "softmax_scale", "causal", "window_left", "window_right", "has_q_lengths", "has_kv_lengths",
                  "return_lse")


def _bind_kernel(q, k, v, qk_descale, v_descale, q_lengths, kv_lengths, params):
    """The FP8 kernel on one device's (or one ring step's) q, k and v."""
    local = {name: params[name] for name in _KERNEL_PARAMS}
    return tuple(attention_fp8_local_p.bind(q, k, v, qk_descale, v_descale, q_lengths, kv_lengths, **local))


def _bind_local(q, k, v, qk_descale, v_descale, q_lengths, kv_lengths, params):
    """One device's call: the kernel on its shards, or, with the `ring` parameter, the ring over the sequence axis
    (jax_flash/_ring.py) whose steps run the kernel; the descales (B, Hk) are the same for every K/V shard."""
    params = dict(params)
    if params["ring"] is None:
        return _bind_kernel(q, k, v, qk_descale, v_descale, q_lengths, kv_lengths, params)

    def step(q, k, v, q_lengths, kv_lengths, page_table, step_params, segment_ids, tensors):
        del page_table, segment_ids, tensors  # (FP8 calls have none of them)
        return _bind_kernel(q, k, v, qk_descale, v_descale, q_lengths, kv_lengths, step_params)

    return ring_forward(q, k, v, q_lengths, kv_lengths, {**FP8_RING_DEFAULTS, **params}, step,
                        out_dtype=jnp.bfloat16)


register_partitioned_lowering(attention_fp8_p, make_partitioned_fp8(_bind_local))


def _batch_rule(args, dims, **params):
    """vmap: every operand's mapped axis moved to the front (unmapped ones broadcast) and folded into the batch."""
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    q = args[0] if dims[0] is None else jnp.moveaxis(args[0], dims[0], 0)
    batch = q.shape[0] if dims[0] is None else q.shape[1]

    def fold(x, d):
        x = jnp.broadcast_to(x, (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)
        return x.reshape((size * x.shape[1], *x.shape[2:]))

    out, lse = attention_fp8_p.bind(*(fold(x, d) for x, d in zip(args, dims)), **params)
    return (out.reshape((size, batch, *out.shape[1:])), lse.reshape((size, batch, *lse.shape[1:]))), (0, 0)


batching.primitive_batchers[attention_fp8_p] = _batch_rule


def _no_jvp(primals, tangents, **params):
    del primals, tangents, params
    raise NotImplementedError(
        "the FP8 kernel (float8_e4m3fn inputs on Hopper) has no derivative: differentiate the call on bfloat16 "
        "inputs (x.astype(jnp.bfloat16) * descale), or on the CPU path")


ad.primitive_jvps[attention_fp8_p] = _no_jvp
