"""The JAX plumbing of attention: a primitive with abstract evaluation and a batching rule that folds vmapped axes into
the batch; it lowers through custom_partitioning (jax_flash/_sharding.py) to a per-device primitive whose cpu and
cuda lowerings emit the FFI custom call. Its differentiation rules live in jax_flash/_autodiff.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.sharding import PartitionSpec

try:
    from jax.core import ShapedArray
except ImportError:  # moved out of the public jax.core in newer releases
    from jax._src.core import ShapedArray

from jax_flash import autotune_cache, native
from jax_flash._ring import ring_forward
from jax_flash._sharding import _warn_once, make_partitioned, register_partitioned_lowering
from jax_flash.config import CALL_ATTRIBUTES, KernelConfig
from jax_flash.selection import CPU_BASE, CPU_TILES, CallShape, resolve_cpu_pack, resolve_gpu_config

# Operands: q (B, Sq, Hq, D), k, v (B, Sk, Hk, D) or, paged, (num_pages, page_size, Hk, D), q_lengths, kv_lengths
# int32 (B) ((0,) when not given), page_table int32 (B, pages_per_seq) ((B, 0) when not paged), q_segment_ids int32
# (B, Sq) and kv_segment_ids int32 (B, Sk) (both (B, 0) without segments), bias float32 and mask bool of rank 4,
# each dimension of (B, Hq, Sq, Sk) or 1 ((0, 0, 0, 0) without).
# Results: out (B, Sq, Hq, D), lse float32 (B, Hq, Sq) (written only when return_lse; dropped otherwise).
# Params: cfg (KernelConfig or None) and the call's attributes (jax_flash.config.CALL_ATTRIBUTES: softmax_scale,
# causal, window_left, window_right, softcap (0 = off), has_q_lengths, has_kv_lengths, return_lse, paged); they become
# the FFI attributes of the generated ffi/attention_attrs.h; ring, None or (mesh axes, devices, layout): the call is
# one device's part of ring attention over those axes (jax_flash/_ring.py); same_lengths: q_lengths and kv_lengths
# are one array (padded self-attention), which lets the ring combine them with causal masks; segments, has_bias,
# has_mask: those operands are given; alibi: the bias operand holds ALiBi slopes, (B|1, Hq, 1, 1).
attention_p = Primitive("jax_flash_attention")
attention_p.multiple_results = True
# The same call on one device's shard: what the FFI custom call computes. attention_p lowers to it through
# custom_partitioning, so sharded inputs are split, not gathered.
attention_local_p = Primitive("jax_flash_attention_local")
attention_local_p.multiple_results = True


def result_aval(template, shape, dtype):
    """ShapedArray(shape, dtype) that, inside shard_map, varies over the same manual mesh axes as `template` (the
    operand it is computed from): shard_map's check_vma compares a gradient's type with its primal's."""
    mat = getattr(template, "manual_axis_type", None)  # newer jax
    varying = getattr(mat, "varying", None) if mat is not None else getattr(template, "vma", None)
    if not varying:
        return ShapedArray(shape, dtype)
    return template.update(shape=shape, dtype=dtype, weak_type=False,
                           sharding=template.sharding.update(spec=PartitionSpec(*(None,) * len(shape))))


def _abstract_eval(q, *rest, **params):
    del rest, params
    batch, seq_q, heads_q, _ = q.shape
    return result_aval(q, q.shape, q.dtype), result_aval(q, (batch, heads_q, seq_q), np.float32)


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


def _static_dims(*avals) -> bool:
    """Whether every dimension is a concrete int (jax.export with symbolic shapes lowers with symbolic ones)."""
    return all(isinstance(n, int) for aval in avals for n in aval.shape)


def _seq_k(k_aval, page_table_aval, params):
    """The logical key length: seq_k, or pages_per_seq x page_size when paged."""
    return page_table_aval.shape[1] * k_aval.shape[1] if params["paged"] else k_aval.shape[1]


def _tuned(platform: str, q_aval, seq_k, params) -> KernelConfig | None:
    """The autotune cache's winner for this call (jax_flash/autotune_cache.py), or None (also for symbolic shapes,
    which have no shape bucket, and for paged calls)."""
    if not _static_dims(q_aval) or not isinstance(seq_k, int) or params["paged"]:
        return None
    try:
        device_kind = jax.devices(platform)[0].device_kind
    except RuntimeError:  # lowering for a platform this process has no device of
        return None
    window = (params["window_left"], params["window_right"])
    key = autotune_cache.cache_key(device_kind, q_aval.shape[1], seq_k, q_aval.dtype, q_aval.shape[3],
                                   causal=params["causal"], window=None if window == (-1, -1) else window,
                                   softcap=params["softcap"] or None)
    return autotune_cache.lookup(key)


def _lower_cpu(ctx, *args, cfg, **params):
    if native.OPENBLAS_CORE is None:
        raise RuntimeError(f"jax_flash's CPU path needs OpenBLAS from the scipy-openblas32 package (a dependency: "
                           f"`pip install scipy-openblas32`), and it could not be loaded: {native.OPENBLAS_ERROR}")
    q_aval, k_aval = ctx.avals_in[0], ctx.avals_in[1]
    if cfg is None:
        cfg = _tuned("cpu", q_aval, _seq_k(k_aval, ctx.avals_in[5], params), params)
    group = q_aval.shape[2] // k_aval.shape[2] if k_aval.shape[2] else 1
    if cfg is not None:
        attrs = _attrs(resolve_cpu_pack(cfg, q_aval.shape[1], group, cfg.block_q), params)
    else:
        base = resolve_cpu_pack(CPU_BASE, q_aval.shape[1], group, CPU_TILES["block_q"])
        attrs = {**_attrs(base, params), **{k: np.int64(v) for k, v in CPU_TILES.items()}}
    return jax.ffi.ffi_lowering(native.TARGET_NAME)(ctx, *args, **attrs)


def has_tensors(params) -> bool:
    """Whether the call has segment ids or a bias / mask tensor."""
    return params["segments"] or params["has_bias"] or params["has_mask"]


def has_bias_or_mask(params) -> bool:
    """Whether the call has a bias or mask tensor (the sm90 family takes segment ids, not these)."""
    return params["has_bias"] or params["has_mask"]


def xla_fallback_warning(what: str) -> None:
    _warn_once("xla on gpu", f"jax_flash: the deterministic GPU backward does not take segment ids or bias / mask "
                             f"tensors; {what} runs in XLA on the GPU. The default backward and the CPU path use "
                             f"the kernels")


def _lower_cuda(ctx, *args, cfg, **params):
    q_aval, k_aval = ctx.avals_in[0], ctx.avals_in[1]
    seq_k = _seq_k(k_aval, ctx.avals_in[5], params)
    tuned = _tuned("cuda", q_aval, seq_k, params) if cfg is None else None
    right_bounded = bool(params["causal"]) or params["window_right"] >= 0
    batch, heads_k, head_dim = q_aval.shape[0], k_aval.shape[2], q_aval.shape[3]
    shape = CallShape(seq_q=q_aval.shape[1] if _static_dims(q_aval) else None,
                      seq_k=seq_k if isinstance(seq_k, int) else 0,
                      group=q_aval.shape[2] // heads_k if heads_k else 1,
                      tensors=has_bias_or_mask(params), segments=params["segments"],
                      alibi=params["alibi"] and not params["has_mask"],
                      kv_bytes=2 * batch * seq_k * heads_k * head_dim * q_aval.dtype.itemsize
                      if isinstance(batch, int) and isinstance(seq_k, int) else 0,
                      page_size=k_aval.shape[1] if params["paged"] and isinstance(k_aval.shape[1], int) else 0)
    cfg = resolve_gpu_config(cfg, q_aval.dtype, q_aval.shape[3], tuned, right_bounded, shape)
    return jax.ffi.ffi_lowering(native.TARGET_NAME)(ctx, *args, **_attrs(cfg, params))


mlir.register_lowering(attention_local_p, _lower_cpu, platform="cpu")
mlir.register_lowering(attention_local_p, _lower_cuda, platform="cuda")


def no_segments(batch):
    """The segment id operands of a call without segments: int32 (batch, 0) twice."""
    empty = jnp.zeros((batch, 0), jnp.int32)
    return empty, empty


def no_lengths():
    """The q_lengths or kv_lengths operand of a call without them: int32 (0,). A (batch,) array of full lengths
    would be a broadcast kernel of its own on every call (two cost 3-5 us beside a 20 us decode call on an H100)."""
    return jnp.zeros((0,), jnp.int32)


def no_tensor(dtype):
    """The bias or mask operand of a call without one: (0, 0, 0, 0)."""
    return jnp.zeros((0, 0, 0, 0), dtype)


def no_extras(batch, segment_ids=None, tensors=None):
    """(q_segment_ids, kv_segment_ids, bias, mask) of a call (a ring step's): segment_ids (a (q, kv) pair) or none,
    tensors (bias, mask) or none."""
    return (*(no_segments(batch) if segment_ids is None else segment_ids),
            *((no_tensor(jnp.float32), no_tensor(jnp.bool_)) if tensors is None else tensors))


def _bind_kernel(q, k, v, q_lengths, kv_lengths, page_table, params: dict, extra=None):
    """The per-device primitive; `extra`: (q_segment_ids, kv_segment_ids, bias, mask), or None for none of them."""
    extra = no_extras(q.shape[0]) if extra is None else extra
    return tuple(attention_local_p.bind(q, k, v, q_lengths, kv_lengths, page_table, *extra, **params))


def _bind_ring_step(q, k, v, q_lengths, kv_lengths, page_table, params: dict, segment_ids, tensors):
    """A ring step's kernel call: segment_ids, the pair's (q, kv) ids or None; tensors, its (bias, mask) or None."""
    return _bind_kernel(q, k, v, q_lengths, kv_lengths, page_table, params,
                        no_extras(q.shape[0], segment_ids, tensors))


def ring_extras(params, q_segment_ids, kv_segment_ids, bias, mask) -> dict:
    """ring_forward's / ring_backward's keyword arguments for the call's segment ids and bias / mask tensors."""
    ids = (q_segment_ids, kv_segment_ids) if params["segments"] else (None, None)
    return dict(q_ids=ids[0], kv_ids=ids[1], tensors=(bias, mask) if has_bias_or_mask(params) else None)


def _bind_local(q, k, v, q_lengths, kv_lengths, page_table, q_segment_ids, kv_segment_ids, bias, mask, params):
    """One device's call: the kernel on its shards, or, with the `ring` parameter, the ring over the sequence axis
    (jax_flash/_ring.py) whose steps run the kernel."""
    params = dict(params)
    if params["ring"] is not None:
        return ring_forward(q, k, v, q_lengths, kv_lengths, params, _bind_ring_step,
                            **ring_extras(params, q_segment_ids, kv_segment_ids, bias, mask))
    return _bind_kernel(q, k, v, q_lengths, kv_lengths, page_table, params,
                        (q_segment_ids, kv_segment_ids, bias, mask))


register_partitioned_lowering(attention_p, make_partitioned(_bind_local))


# ---- vmap: fold the mapped axis into the batch axis ---------------------------------------------------------------
def _batch_rule(args, dims, **params):
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)

    def moved(x, d):
        return jnp.broadcast_to(x, (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)

    def fold(x):
        return x.reshape((size * x.shape[1], *x.shape[2:]))  # (size * B, ...): the mapped axis joins the batch

    q, k, v, q_lengths, kv_lengths, page_table, q_segment_ids, kv_segment_ids, bias, mask = args
    q_dim, k_dim, v_dim, *rest_dims = dims
    batch = q.shape[0] if q_dim is None else jnp.moveaxis(q, q_dim, 0).shape[1]
    batch_like = [fold(moved(x, d)) for x, d in zip((q, q_lengths, kv_lengths, page_table), (q_dim, *rest_dims[:3]))]
    segment_ids = [fold(moved(x, d)) for x, d in zip((q_segment_ids, kv_segment_ids), rest_dims[3:5])]
    tensors = [fold_tensor(x, d, size, batch) for x, d in zip((bias, mask), rest_dims[5:])]
    if not params["paged"]:
        k, v = fold(moved(k, k_dim)), fold(moved(v, v_dim))
    elif k_dim is not None or v_dim is not None:
        # Pages of each mapped instance: instance i's pages follow the i - 1 before it, and its table entries move
        # with them (ids outside [0, num_pages) stay outside, as -1).
        k, v = moved(k, k_dim), moved(v, v_dim)
        num_pages = k.shape[1]
        pages_per_seq = batch_like[3].shape[1]
        table = batch_like[3].reshape((size, batch, pages_per_seq))
        offset = (jnp.arange(size, dtype=jnp.int32) * num_pages)[:, None, None]
        table = jnp.where((table >= 0) & (table < num_pages), table + offset, -1)
        batch_like[3] = table.reshape((size * batch, pages_per_seq))
        k, v = fold(k), fold(v)
    q, q_lengths, kv_lengths, page_table = batch_like
    out, lse = attention_p.bind(q, k, v, q_lengths, kv_lengths, page_table, *segment_ids, *tensors, **params)
    # (explicit shapes, not -1: a zero-size mapped axis or batch leaves -1 undetermined)
    return (out.reshape((size, batch, *out.shape[1:])), lse.reshape((size, batch, *lse.shape[1:]))), (0, 0)


batching.primitive_batchers[attention_p] = _batch_rule


def fold_tensor(x, d, size, batch):
    """A bias or mask operand for the folded batch (size x batch): an unmapped one broadcast over the batch stays as
    it is; otherwise its batch dimension is made full (batch) before the mapped axis joins it."""
    if x.shape[0] == 0 or (d is None and x.shape[0] == 1):
        return x
    x = jnp.broadcast_to(x, (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)
    x = jnp.broadcast_to(x, (size, batch, *x.shape[2:]))
    return x.reshape((size * batch, *x.shape[2:]))
