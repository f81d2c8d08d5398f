"""Differentiation of attention by JAX's own rules, no custom_vjp:

- attention_p's JVP runs the forward (with the lse, which the backward needs) and gives the tangents of (out, lse) as
  attention_lin_p, a primitive linear in (q_dot, k_dot, v_dot) whose other operands are the saved q, k, v, out, lse;
- attention_lin_p evaluates in plain jnp (forward mode: jax.jvp; O(Sq Sk) memory) and transposes to
  attention_bwd_p, the backward custom call ("jax_flash_attention_bwd") returning (dq, dk, dv) in O(S) memory.

With the scaled (soft-capped) scores s, P = exp(s - lse) on visible keys, and ds = d(s) in the tangents:
  lse_dot = rowsum(P o ds),  out_dot = (P o (ds - lse_dot)) v + P v_dot;
the transpose, given the cotangents dO and dlse, is the FlashAttention backward (csrc/cpu/attention_bwd_cpu.cc):
  dV = P^T dO,  dS = P o (dO V^T - D),  D = rowsum(dO o O) - dlse,  dQ = dS' K,  dK = dS'^T Q  (dS' = dS o ds/d(q.k)).
Lengths and page tables get no gradient; paged K/V get theirs from the backward of the contiguous K/V the
pages stand for, added back into the pages (gather_pages' transpose).
The forward's out and lse carry checkpoint names (CHECKPOINT_NAMES) for jax.checkpoint policies.
Second order: attention_bwd_p's JVP is jax.jvp of those formulas in jnp (_dense_backward), beside the custom call;
attention_lin_p's is jax.jvp of its own jnp.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import PartitionSpec

from jax_flash import native
from jax_flash._primitive import (_attrs, attention_p, fold_tensor, has_tensors, no_extras, result_aval,
                                 ring_extras, xla_fallback_warning)
from jax_flash._ring import ring_backward, zigzag_order
from jax_flash._sharding import make_partitioned_backward, register_partitioned_lowering
from jax_flash.reference import alibi_bias, gather_pages, visibility_mask
from jax_flash.selection import CPU_BASE, CPU_TILES

try:
    from jax.core import ShapedArray
except ImportError:  # moved out of the public jax.core in newer releases
    from jax._src.core import ShapedArray

# Operands: q_dot, k_dot, v_dot, bias_dot (linear), then q, k, v, out, lse, q_lengths, kv_lengths, page_table,
# q_segment_ids, kv_segment_ids, bias, mask (attention_p's operands and results), less the zero-size ones from
# q_lengths on (bound by _bind_lin); params: attention_p's and `absent`. Results: out_dot, lse_dot.
attention_lin_p = Primitive("jax_flash_attention_lin")
attention_lin_p.multiple_results = True
# Operands: q, k, v, out, lse, d_out, d_lse, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids ((B, 0) each
# without segments), bias, mask ((0, 0, 0, 0) without); params: attention_p's. Results: dq, dk, dv.
attention_bwd_p = Primitive("jax_flash_attention_bwd")
attention_bwd_p.multiple_results = True
attention_bwd_local_p = Primitive("jax_flash_attention_bwd_local")
attention_bwd_local_p.multiple_results = True

_PAGED = ("differentiate a call on contiguous k and v instead (gather_pages in jax_flash.reference turns pages into "
          "them)")


# ---- the JVP of attention_p ----------------------------------------------------------------------------------------
# The names of the forward's out and lse (jax.ad_checkpoint.checkpoint_name), the residuals the backward reads: a
# jax.checkpoint policy that saves them (jax.checkpoint_policies.save_only_these_names(*CHECKPOINT_NAMES)) keeps the
# backward from running the forward again.
CHECKPOINT_NAMES = ("jax_flash_attention_out", "jax_flash_attention_lse")


def _jvp(primals, tangents, **params):
    fwd_params = dict(params, return_lse=True)  # the backward reads the lse even when the caller does not
    out, lse = (checkpoint_name(x, name) for x, name in zip(attention_p.bind(*primals, **fwd_params),
                                                            CHECKPOINT_NAMES))
    q_dot, k_dot, v_dot, bias_dot = (ad.instantiate_zeros(t) for t in (*tangents[:3], tangents[8]))
    out_dot, lse_dot = _bind_lin(q_dot, k_dot, v_dot, bias_dot, *primals[:3], out, lse, *primals[3:], **params)
    return (out, lse), (out_dot, lse_dot)


ad.primitive_jvps[attention_p] = _jvp


# attention_lin_p's operands from _OPTIONAL on (lengths, page table, segment ids, bias, mask) are zero-size
# placeholders when absent. Bound as operands, they would be residuals of the derivative, and inside shard_map jax
# 0.11's Shardy import crashes compiling a backward that reads a zero-size residual (a segmentation fault). So
# attention_lin_p is bound without them, their (position, shape, dtype) in the parameter `absent`, and each rule
# recreates them: a zero-size array is its shape and dtype.
_OPTIONAL = 9


def _bind_lin(*operands, **params):
    absent = tuple((i, tuple(x.shape), np.dtype(x.dtype)) for i, x in enumerate(operands)
                   if i >= _OPTIONAL and math.prod(x.shape) == 0)
    skipped = {i for i, _, _ in absent}
    return attention_lin_p.bind(*(x for i, x in enumerate(operands) if i not in skipped), absent=absent, **params)


def _with_absent(items, absent, fill=jnp.zeros):
    """items (operands, or their tangents or batch dims) with fill(shape, dtype) put back where _bind_lin left out a
    zero-size placeholder."""
    full = list(items)
    for i, shape, dtype in absent:  # (ascending positions)
        full.insert(i, fill(shape, dtype))
    return full


# ---- attention_lin_p: forward mode in jnp, transposed to the backward custom call --------------------------------
def _lin_abstract_eval(q_dot, k_dot, v_dot, bias_dot, q, k, v, out, lse, *rest, **params):
    return result_aval(out, out.shape, out.dtype), result_aval(lse, lse.shape, lse.dtype)


def _scores(q, k, params):
    """(s, ds/d(q.k)) in float32, (B, Hq, Sq, Sk): the scaled and soft-capped scores and their slope."""
    group = q.shape[2] // k.shape[2] if k.shape[2] else 1
    qk = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), jnp.repeat(k, group, axis=2).astype(jnp.float32))
    scale, cap = params["softmax_scale"], params["softcap"]
    if not cap:
        return scale * qk, jnp.full((), scale, jnp.float32)
    t = jnp.tanh(qk * (scale / cap))
    return cap * t, scale * (1 - t * t)


def _rows(q, block):
    """(Sq of the call, visibility_mask's rows): block (first, Sq) when q holds the call's query rows first .. first
    + q.shape[1] - 1, None for all of them."""
    return (q.shape[1], None) if block is None else (block[1], (block[0], q.shape[1]))


def _visible(q, k, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, mask, params, block=None):
    """(B, 1 | Hq, Sq, Sk) bool: which keys each row sees (jax_flash.reference.visibility_mask and the mask tensor)."""
    window = (params["window_left"], params["window_right"])
    seq_q, rows = _rows(q, block)
    visible = visibility_mask(q.shape[0], seq_q, k.shape[1], causal=params["causal"], window=window,
                              q_lengths=q_lengths if params["has_q_lengths"] else None,
                              kv_lengths=kv_lengths if params["has_kv_lengths"] else None,
                              q_segment_ids=q_segment_ids if params["segments"] else None,
                              kv_segment_ids=kv_segment_ids, rows=rows)
    return visible & mask if params["has_mask"] else visible


def _probabilities(q, k, lse, bias, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, mask, params, block=None):
    """(P, ds/d(q.k)) in float32, P (B, Hq, Sq, Sk) = exp(s - lse) on the keys a row sees, 0 on the others and on rows
    that see none (lse -inf). The exp takes -inf where hidden instead of a select after it: a hidden score far above
    the lse would overflow, and the select's derivative would multiply that inf by a zero. block: as _rows takes it
    (q, lse, the query segment ids, bias and mask hold those rows)."""
    visible = _visible(q, k, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, mask, params, block)
    s, slope = _scores(q, k, params)
    if params["has_bias"]:
        s = s + _bias_of(bias, s.shape, q_lengths, kv_lengths, params, _rows(q, block))
    lse_b = lse[..., None]
    finite = jnp.isfinite(lse_b)
    return jnp.exp(jnp.where(visible & finite, s - jnp.where(finite, lse_b, 0.0), -jnp.inf)), slope


def _lin_impl(q_dot, k_dot, v_dot, bias_dot, q, k, v, out, lse, q_lengths, kv_lengths, page_table, q_segment_ids,
              kv_segment_ids, bias, mask, **params):
    if params["ring"] is not None:  # (ring_attention inside shard_map: q, k, v are this device's shards)
        return _ring_lin(q_dot, k_dot, v_dot, bias_dot, q, k, v, out, lse, q_lengths, kv_lengths, q_segment_ids,
                         kv_segment_ids, bias, mask, params)
    if params["paged"]:
        k, v, k_dot, v_dot = (gather_pages(x, page_table) for x in (k, v, k_dot, v_dot))
    k, v, k_dot, v_dot, kv_segment_ids = (_every_key(x) for x in (k, v, k_dot, v_dot, kv_segment_ids))
    return _dense_lin(q_dot, k_dot, v_dot, bias_dot, q, k, v, out, lse, q_lengths, kv_lengths, q_segment_ids,
                      kv_segment_ids, bias, mask, params)


def _dense_lin(q_dot, k_dot, v_dot, bias_dot, q, k, v, out, lse, q_lengths, kv_lengths, q_segment_ids,
               kv_segment_ids, bias, mask, params, block=None):
    """(out_dot, lse_dot) by the module docstring's formulas with the dense scores; block: as _rows takes it."""
    heads_q = q.shape[2]
    group = heads_q // k.shape[2] if k.shape[2] else 1
    p, slope = _probabilities(q, k, lse, bias, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, mask, params,
                              block)
    f32 = jnp.float32
    qk_dot = (jnp.einsum("bqhd,bkhd->bhqk", q_dot.astype(f32), jnp.repeat(k, group, axis=2).astype(f32)) +
              jnp.einsum("bqhd,bkhd->bhqk", q.astype(f32), jnp.repeat(k_dot, group, axis=2).astype(f32)))
    ds = qk_dot * slope
    if params["has_bias"]:
        ds = ds + _bias_of(bias_dot, p.shape, q_lengths, kv_lengths, params, _rows(q, block))
    lse_dot = jnp.sum(p * ds, axis=-1)
    out_dot = (jnp.einsum("bhqk,bkhd->bqhd", p * (ds - lse_dot[..., None]), jnp.repeat(v, group, axis=2).astype(f32)) +
               jnp.einsum("bhqk,bkhd->bqhd", p, jnp.repeat(v_dot, group, axis=2).astype(f32)))
    return out_dot.astype(out.dtype), lse_dot.astype(lse.dtype)


# ---- ring attention's dense forms (forward mode, second order): this device's rows against every key --------------
# ring_attention inside shard_map binds the primitive on this device's shards with params["ring"] = (mesh axes,
# devices n, layout). Its forward-mode and second-order rules gather K and V (and their tangents) whole, as every
# forward-mode rule here holds dense scores (O(Sq Sk) memory: the local rows x every key), and send the key
# gradients' tangents back to their shards with a reduce-scatter.
def _zigzag_order(params, seq: int):
    """The global key order the layout's shards hold, concatenated (None: the sequence's own)."""
    _, size, layout = params["ring"]
    return zigzag_order(seq, size) if layout == "zigzag" else None


def _every_key_of_ring(params, x):
    """x (B, local keys, ...), this device's shard along the keys, whole and in global key order."""
    whole = jax.lax.all_gather(x, params["ring"][0], axis=1, tiled=True)
    order = _zigzag_order(params, whole.shape[1])
    return whole if order is None else jnp.take(whole, jnp.asarray(np.argsort(order)), axis=1)


def _own_keys_of_ring(params, x):
    """x (B, every key, ...) in global key order, summed over the devices: this device's shard of the sum."""
    order = _zigzag_order(params, x.shape[1])
    x = x if order is None else jnp.take(x, jnp.asarray(order), axis=1)
    return jax.lax.psum_scatter(x, params["ring"][0], scatter_dimension=1, tiled=True)


def _ring_keys(params, k, v, kv_segment_ids):
    """K, V and the keys' segment ids (where the call has them) whole, in global key order."""
    kv_ids = _every_key_of_ring(params, kv_segment_ids) if params["segments"] else kv_segment_ids
    return _every_key_of_ring(params, k), _every_key_of_ring(params, v), kv_ids


def _ring_row_blocks(params, local_rows: int):
    """(cut, block) for each block of this device's rows that holds consecutive global positions: one (contiguous:
    device r holds r S .. (r + 1) S - 1, S local rows) or two (zigzag: halves r and 2n - 1 - r of the sequence cut
    into 2n halves). cut(x) the block's rows of a q-shaped x, cut(x, 2) of an lse-shaped one, cut(x, "tensor") of a
    bias or mask that holds rows (others pass as they are); block as _rows takes it. Ring attention's bias and mask
    hold this device's rows and every key (no ALiBi: ring_refusal)."""
    axes, size, layout = params["ring"]
    r = jax.lax.axis_index(axes)
    half = local_rows // 2
    blocks = (((0, half, r * half), (half, half, (2 * size - 1 - r) * half)) if layout == "zigzag"
              else ((0, local_rows, r * local_rows),))
    seq_q = local_rows * size
    for start, count, first in blocks:
        def cut(x, axis=1, start=start, count=count):
            if axis == "tensor":
                if x.ndim != 4 or x.shape[2] != local_rows:
                    return x
                axis = 2
            return jax.lax.slice_in_dim(x, start, start + count, axis=axis)

        yield cut, (first, seq_q)


def _ring_lin(q_dot, k_dot, v_dot, bias_dot, q, k, v, out, lse, q_lengths, kv_lengths, q_segment_ids,
              kv_segment_ids, bias, mask, params):
    """_dense_lin of this device's rows against every key."""
    k, v, kv_ids = _ring_keys(params, k, v, kv_segment_ids)
    k_dot, v_dot = _every_key_of_ring(params, k_dot), _every_key_of_ring(params, v_dot)
    parts = []
    for cut, block in _ring_row_blocks(params, q.shape[1]):
        q_ids = cut(q_segment_ids) if params["segments"] else q_segment_ids
        parts.append(_dense_lin(cut(q_dot), k_dot, v_dot, cut(bias_dot, "tensor"), cut(q), k, v, cut(out),
                                cut(lse, 2), q_lengths, kv_lengths, q_ids, kv_ids, cut(bias, "tensor"),
                                cut(mask, "tensor"), params, block))
    return (jnp.concatenate([o for o, _ in parts], axis=1), jnp.concatenate([lse_dot for _, lse_dot in parts], axis=2))


def _bias_of(bias, scores_shape, q_lengths, kv_lengths, params, rows=None):
    """The bias the bias operand adds to scores of shape (B, Hq, Sq, Sk): itself, or with alibi ALiBi's bias from the
    slopes it holds (B|1, Hq, 1, 1), which is linear in them (so also for their tangents). rows: _rows's (Sq of the
    call, rows) where the scores are a block of the call's rows."""
    if not params["alibi"]:
        return bias
    seq_q, block_rows = (scores_shape[2], None) if rows is None else rows
    return alibi_bias(bias[:, :, 0, 0], seq_q, scores_shape[3],
                      q_lengths=q_lengths if params["has_q_lengths"] else None,
                      kv_lengths=kv_lengths if params["has_kv_lengths"] else None, rows=block_rows)


def _score_gradient(p, v, out, d_out, d_lse, group):
    """P o (dO V^T - D), D = rowsum(dO o O) - dlse: the loss's gradient by the scores after any softcap (by the bias),
    float32 (B, Hq, Sq, Sk); a softcap's slope multiplies it for the gradient by q.k."""
    f32 = jnp.float32
    dp = jnp.einsum("bqhd,bkhd->bhqk", d_out.astype(f32), jnp.repeat(v, group, axis=2).astype(f32))
    d = jnp.einsum("bqhd,bqhd->bhq", d_out.astype(f32), out.astype(f32)) - d_lse
    return p * (dp - d[..., None])


def _explicit_sharding(x):
    """x's sharding where explicit mesh axes split its key axis (as _every_key undoes), else None."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    return sharding if spec and len(spec) >= 2 and spec[1] is not None else None


def _every_key(x):
    """x (B, Sk, ...) whole along its key axis where an explicit mesh axis splits it (a sequence-sharded call): dense
    scores of the local query rows need every key, and a product of two operands split by the same axis has no legal
    sharding. Under automatic axes the partitioner gathers the keys by itself; there x is returned as it is."""
    sharding = _explicit_sharding(x)
    if sharding is None:
        return x
    spec = sharding.spec
    return jax.sharding.reshard(x, sharding.update(spec=PartitionSpec(spec[0], None, *spec[2:])))


def _bias_gradient(q, k, v, out, lse, ct_out, ct_lse, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, bias,
                   mask, params):
    """d(loss)/d(bias) = dS = P o (dO V^T - D), D = rowsum(dO o O) - dlse, summed over the bias's broadcast
    dimensions: by XLA, O(Sq x Sk) per (batch, head). ALiBi slopes: dS o -|i + kv_len - q_len - j| summed the same
    way (the bias is slope times that). All rows at once, in plain ops that GSPMD partitions as q is (a loop over the
    batch rows made it gather the batch-sharded q, out and lse onto every device)."""
    group = q.shape[2] // k.shape[2] if k.shape[2] else 1
    if params["ring"] is not None:  # (ring_attention inside shard_map: no ALiBi)
        ds = _ring_score_gradient(q, k, v, out, lse, ct_out, ct_lse, q_lengths, kv_lengths, q_segment_ids,
                                  kv_segment_ids, bias, mask, params, group)
    else:
        k, v, kv_segment_ids = (_every_key(x) for x in (k, v, kv_segment_ids))
        p, _ = _probabilities(q, k, lse, bias, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, mask, params)
        ds = _score_gradient(p, v, out, ct_out, ct_lse, group)
        if params["alibi"]:
            ds = ds * _bias_of(jnp.ones_like(bias), p.shape, q_lengths, kv_lengths, params)
    axes = tuple(i for i, n in enumerate(bias.shape) if n == 1 and ds.shape[i] != 1)
    grad = jnp.sum(ds, axis=axes, keepdims=True)
    if params["ring"] is not None:
        # A bias every device holds alike (not varying over the ring's axes: one row for all) gets every device's
        # part. (Without varying-axes types, one row stands for that.)
        vma, ring_axes = getattr(jax.typeof(bias), "vma", None), params["ring"][0]
        shared = bias.shape[2] == 1 if vma is None else not set(ring_axes) & set(vma)
        if shared:
            grad = jax.lax.psum(grad, ring_axes)
    return grad.astype(bias.dtype)


def _ring_score_gradient(q, k, v, out, lse, ct_out, ct_lse, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids,
                         bias, mask, params, group):
    """_score_gradient's dS of ring attention's shards: this device's rows against every key, (B, Hq, local rows,
    every key); the bias and mask hold this device's query rows (or one row for all) and every key."""
    k, v, kv_ids = _ring_keys(params, k, v, kv_segment_ids)
    parts = []
    for cut, block in _ring_row_blocks(params, q.shape[1]):
        q_ids = cut(q_segment_ids) if params["segments"] else q_segment_ids
        p, _ = _probabilities(cut(q), k, cut(lse, 2), cut(bias, "tensor"), q_lengths, kv_lengths, q_ids, kv_ids,
                              cut(mask, "tensor"), params, block)
        parts.append(_score_gradient(p, v, cut(out), cut(ct_out), cut(ct_lse, 2), group))
    return jnp.concatenate(parts, axis=2)


def _lin_transpose(cts, q_dot, k_dot, v_dot, bias_dot, q, k, v, out, lse, q_lengths, kv_lengths, page_table,
                   q_segment_ids, kv_segment_ids, bias, mask, **params):
    ct_out, ct_lse = cts
    residuals = [None] * 12
    if type(ct_out) is ad.Zero and type(ct_lse) is ad.Zero:  # no cotangent reaches attention: no gradient
        return [None, None, None, None, *residuals]
    ct_out = jnp.zeros(out.shape, out.dtype) if type(ct_out) is ad.Zero else ct_out.astype(out.dtype)
    ct_lse = jnp.zeros(lse.shape, lse.dtype) if type(ct_lse) is ad.Zero else ct_lse.astype(lse.dtype)
    pull_pages = None
    if params["paged"]:
        # The backward of the contiguous K / V the pages stand for (gather_pages: ids outside the pool read zeros),
        # whose dK / dV its transpose adds back into the pages (a page two sequences share gets both sums).
        (k, v), pull_pages = jax.vjp(lambda *pools: tuple(gather_pages(x, page_table) for x in pools), k, v)
        params = dict(params, paged=False)
    lengths_and_masks = (q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, bias, mask)
    dq, dk, dv = attention_bwd_p.bind(q, k, v, out, lse, ct_out, ct_lse, *lengths_and_masks, **params)
    if pull_pages is not None:
        dk, dv = pull_pages((dk, dv))
    grads = [dq if ad.is_undefined_primal(q_dot) else None, dk if ad.is_undefined_primal(k_dot) else None,
             dv if ad.is_undefined_primal(v_dot) else None, None]
    if ad.is_undefined_primal(bias_dot) and params["has_bias"]:
        grads[3] = _bias_gradient(q, k, v, out, lse, ct_out, ct_lse, *lengths_and_masks, params)
    return [*grads, *residuals]


def _lin_jvp(primals, tangents, **params):
    """attention_lin_p is jnp: its JVP (a second forward-mode derivative, or reverse over forward) is jax.jvp of
    _lin_impl over the floating operands (tangents, q, k, v, out, lse, bias)."""
    floating = (0, 1, 2, 3, 4, 5, 6, 7, 8, 14)

    def lin(*xs):
        operands = list(primals)
        for i, x in zip(floating, xs):
            operands[i] = x
        return _lin_impl(*operands, **params)

    return jax.jvp(lin, tuple(primals[i] for i in floating),
                   tuple(ad.instantiate_zeros(tangents[i]) for i in floating))


def _lin_batch_rule(args, dims, **params):
    if params["paged"]:
        raise NotImplementedError("jax.vmap of a forward-mode derivative of paged attention is not supported; "
                                  + _PAGED)
    folded, size, batch = _fold(args, dims, tensors=(3, 14, 15))
    out_dot, lse_dot = _bind_lin(*folded, **params)
    return (_unfold(out_dot, size, batch), _unfold(lse_dot, size, batch)), (0, 0)


def _restored_impl(*operands, absent, **params):
    return _lin_impl(*_with_absent(operands, absent), **params)


def _restored_transpose(cts, *operands, absent, **params):
    skipped = {i for i, _, _ in absent}
    cts_in = _lin_transpose(cts, *_with_absent(operands, absent), **params)
    return [ct for i, ct in enumerate(cts_in) if i not in skipped]


def _restored_jvp(primals, tangents, *, absent, **params):
    def symbolic_zero(shape, dtype):  # (a placeholder's tangent)
        return ad.Zero(ShapedArray(shape, dtype if jnp.issubdtype(dtype, jnp.inexact) else jax.dtypes.float0))

    return _lin_jvp(_with_absent(primals, absent), _with_absent(tangents, absent, symbolic_zero), **params)


def _restored_batch_rule(args, dims, *, absent, **params):
    return _lin_batch_rule(_with_absent(args, absent), _with_absent(dims, absent, lambda shape, dtype: None),
                           **params)


attention_lin_p.def_abstract_eval(lambda *operands, absent, **params: _lin_abstract_eval(*operands, **params))
attention_lin_p.def_impl(_restored_impl)
mlir.register_lowering(attention_lin_p, mlir.lower_fun(_restored_impl, multiple_results=True))
ad.primitive_transposes[attention_lin_p] = _restored_transpose
ad.primitive_jvps[attention_lin_p] = _restored_jvp
batching.primitive_batchers[attention_lin_p] = _restored_batch_rule


# ---- attention_bwd_p: the backward custom call -------------------------------------------------------------------
def _bwd_abstract_eval(q, k, v, out, lse, d_out, d_lse, *rest, **params):
    return result_aval(q, q.shape, q.dtype), result_aval(k, k.shape, k.dtype), result_aval(v, v.shape, v.dtype)


def _bwd_attrs(cfg, params):
    # The backward's tiles are the handlers' own (CPU: CPU_TILES unless a cfg gives them; GPU: sm80/bwd_traits.cuh);
    # the config fields travel because the attribute struct is the forward's.
    attrs = _attrs(dataclasses.replace((cfg or CPU_BASE).kernel(), pack_gqa=False), params)
    if cfg is None:
        attrs.update({name: np.int64(value) for name, value in CPU_TILES.items()})
    return attrs


def _lower_bwd_cpu(ctx, *args, cfg, **params):
    if native.OPENBLAS_CORE is None:
        raise RuntimeError(f"jax_flash's CPU path needs OpenBLAS from the scipy-openblas32 package (a dependency: "
                           f"`pip install scipy-openblas32`), and it could not be loaded: {native.OPENBLAS_ERROR}")
    return jax.ffi.ffi_lowering(native.BACKWARD_TARGET_NAME)(ctx, *args, **_bwd_attrs(cfg, params))


# Query rows per block of the XLA backward: its float32 scores are (B, Hq, 256, Sk) at once (268 MB per batch row
# for 16 heads of 16384 keys), where a whole call's would be Sq / 256 times that.
XLA_BACKWARD_ROWS = 256


def _xla_backward(q, k, v, out, lse, d_out, d_lse, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, bias, mask,
                  *, params, rows=XLA_BACKWARD_ROWS):
    """(dq, dk, dv) by the backward's formulas in jnp over blocks of `rows` query rows: the GPU's path for
    deterministic=True with segment ids or bias / mask tensors (the deterministic kernels do not take them). Each
    block's dQ is its own; dK and dV add up block after block in float32, in one order (bitwise repeatable). The rows
    are padded to whole blocks (padded rows see no key: lse -inf)."""
    batch, seq_q, heads_q, _ = q.shape
    group = heads_q // k.shape[2] if k.shape[2] else 1
    rows = rows if isinstance(seq_q, int) else seq_q  # (a symbolic length: one block)
    blocks = -(-seq_q // rows) if isinstance(seq_q, int) and seq_q else 1
    padded = blocks * rows

    def pad(x, axis, value=0):
        if x.ndim <= axis or x.shape[axis] != seq_q or padded == seq_q:
            return x  # (absent, broadcast along the rows, or whole blocks already)
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, padded - seq_q)
        return jnp.pad(x, widths, constant_values=value)

    q_p, out_p, d_out_p = (pad(x, 1) for x in (q, out, d_out))
    lse_p, d_lse_p = pad(lse, 2, -jnp.inf), pad(d_lse, 2)
    q_ids = pad(q_segment_ids, 1) if params["segments"] else q_segment_ids
    rows_of = {name: params[flag] and x.ndim == 4 and x.shape[2] == seq_q and not params["alibi"]
               for name, x, flag in (("bias", bias, "has_bias"), ("mask", mask, "has_mask"))}
    bias_p = pad(bias, 2) if rows_of["bias"] else bias
    mask_p = pad(mask, 2, False) if rows_of["mask"] else mask
    f32 = jnp.float32
    k_heads = jnp.repeat(k, group, axis=2).astype(f32)

    def block(i, grads):
        dq, dk, dv = grads
        first = i * rows
        take = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, first, rows, axis)  # noqa: E731
        q_b, out_b, d_out_b = take(q_p, 1), take(out_p, 1), take(d_out_p, 1)
        p, slope = _probabilities(q_b, k, take(lse_p, 2), take(bias_p, 2) if rows_of["bias"] else bias_p,
                                  q_lengths, kv_lengths, take(q_ids, 1) if params["segments"] else q_ids,
                                  kv_segment_ids, take(mask_p, 2) if rows_of["mask"] else mask_p, params,
                                  block=(first, seq_q))
        ds = _score_gradient(p, v, out_b, d_out_b, take(d_lse_p, 2), group) * slope
        dq = jax.lax.dynamic_update_slice_in_dim(dq, jnp.einsum("bhqk,bkhd->bqhd", ds, k_heads), first, axis=1)
        dk = dk + jnp.einsum("bhqk,bqhd->bkhd", ds, q_b.astype(f32))
        dv = dv + jnp.einsum("bhqk,bqhd->bkhd", p, d_out_b.astype(f32))
        return dq, dk, dv

    zeros = (jnp.zeros((batch, padded, heads_q, q.shape[3]), f32),
             *(jnp.zeros((batch, k.shape[1], heads_q, x.shape[3]), f32) for x in (k, v)))
    dq, dk, dv = jax.lax.fori_loop(0, blocks, block, zeros)

    def per_kv_head(g):  # (B, Sk, Hq, D) -> (B, Sk, Hk, D): a group's query heads summed
        return g.reshape(*g.shape[:2], k.shape[2], group, g.shape[3]).sum(axis=3)

    return dq[:, :seq_q].astype(q.dtype), per_kv_head(dk).astype(k.dtype), per_kv_head(dv).astype(v.dtype)


def _lower_bwd_cuda(ctx, *args, cfg, **params):
    if has_tensors(params) and params["deterministic"]:
        xla_fallback_warning(f"the deterministic backward, over blocks of {XLA_BACKWARD_ROWS} query rows (float32 "
                             f"scores of those rows x every key at once),")
        return mlir.lower_fun(functools.partial(_xla_backward, params=params), multiple_results=True)(ctx, *args)
    if not native.BUILT_WITH_CUDA:
        raise RuntimeError("jax_flash was built without its CUDA kernels (no CUDA compiler at install time), so its "
                           "backward cannot run on a GPU; reinstall on a machine with nvcc (README: Building on a GPU "
                           "machine)")
    return jax.ffi.ffi_lowering(native.BACKWARD_TARGET_NAME)(ctx, *args, **_bwd_attrs(cfg, params))


def _bind_bwd_kernel(*args_and_params):
    *args, params = args_and_params
    return tuple(attention_bwd_local_p.bind(*args, **params))


def _bind_bwd_ring_step(*args_and_params):
    """A ring step's backward call: (q, k, v, out, lse, d_out, d_lse, q_lengths, kv_lengths, params, segment_ids,
    tensors), segment_ids the pair's (q, kv) ids or None, tensors its (bias, mask) or None."""
    *args, params, segment_ids, tensors = args_and_params
    return _bind_bwd_kernel(*args, *no_extras(args[0].shape[0], segment_ids, tensors), params)


def _bind_bwd_local(*args_and_params):
    *args, params = args_and_params
    params = dict(params)
    if params["ring"] is not None:
        return ring_backward(*args[:9], params, _bind_bwd_ring_step, **ring_extras(params, *args[9:13]))
    return _bind_bwd_kernel(*args, params)


@functools.cache
def _jitted_bwd(params):
    return jax.jit(lambda *args: attention_bwd_p.bind(*args, **dict(params)))


def _bwd_batch_rule(args, dims, **params):
    folded, size, batch = _fold(args, dims, tensors=(11, 12))
    grads = attention_bwd_p.bind(*folded, **params)
    return tuple(_unfold(g, size, batch) for g in grads), (0, 0, 0)


# ---- second order: the JVP of attention_bwd_p, in jnp --------------------------------------------------------------
def _dense_backward(q, k, v, out, lse, d_out, d_lse, bias, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids,
                    mask, params):
    """The backward's formulas (module docstring) in plain jnp, all rows at once with the dense (B, Hq, Sq, Sk)
    scores: (dq, dk, dv) as a function of every floating operand, out and lse among them, so that jax.jvp of it is
    attention_bwd_p's own JVP (grad of grad, Hessian-vector products, jax.hessian)."""
    f32 = jnp.float32
    group = q.shape[2] // k.shape[2] if k.shape[2] else 1
    # Under explicit mesh axes that split the sequence: every key beside the local rows, and dk, dv (sums over the
    # split rows) sharded as k and v are.
    key_sharding = _explicit_sharding(k)
    k, v, kv_segment_ids = (_every_key(x) for x in (k, v, kv_segment_ids))
    p, slope = _probabilities(q, k, lse, bias, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, mask, params)
    ds = _score_gradient(p, v, out, d_out, d_lse, group) * slope
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, jnp.repeat(k, group, axis=2).astype(f32))
    dk = jnp.einsum("bhqk,bqhd->bkhd", ds, q.astype(f32), out_sharding=key_sharding)
    dv = jnp.einsum("bhqk,bqhd->bkhd", p, d_out.astype(f32), out_sharding=key_sharding)

    def per_kv_head(g):  # (B, Sk, Hq, D) -> (B, Sk, Hk, D): a group's query heads summed
        return g.reshape(*g.shape[:2], k.shape[2], group, g.shape[3]).sum(axis=3)

    return dq.astype(q.dtype), per_kv_head(dk).astype(k.dtype), per_kv_head(dv).astype(v.dtype)


def _ring_dense_backward(q, k, v, out, lse, d_out, d_lse, bias, q_lengths, kv_lengths, q_segment_ids,
                         kv_segment_ids, mask, params):
    """_dense_backward of ring attention's shards: this device's rows against every key; dk and dv summed over the
    devices into this device's shards."""
    f32 = jnp.float32
    group = q.shape[2] // k.shape[2] if k.shape[2] else 1
    k, v, kv_ids = _ring_keys(params, k, v, kv_segment_ids)
    dq_parts, dk, dv = [], 0.0, 0.0
    for cut, block in _ring_row_blocks(params, q.shape[1]):
        q_ids = cut(q_segment_ids) if params["segments"] else q_segment_ids
        q_b, d_out_b = cut(q), cut(d_out)
        p, slope = _probabilities(q_b, k, cut(lse, 2), cut(bias, "tensor"), q_lengths, kv_lengths, q_ids, kv_ids,
                                  cut(mask, "tensor"), params, block)
        ds = _score_gradient(p, v, cut(out), d_out_b, cut(d_lse, 2), group) * slope
        dq_parts.append(jnp.einsum("bhqk,bkhd->bqhd", ds, jnp.repeat(k, group, axis=2).astype(f32)))
        dk = dk + jnp.einsum("bhqk,bqhd->bkhd", ds, q_b.astype(f32))
        dv = dv + jnp.einsum("bhqk,bqhd->bkhd", p, d_out_b.astype(f32))

    def own_per_kv_head(g):  # (B, Sk, Hq, D) -> this device's (B, Sk / n, Hk, D), a group's query heads summed
        return _own_keys_of_ring(params, g.reshape(*g.shape[:2], k.shape[2], group, g.shape[3]).sum(axis=3))

    return (jnp.concatenate(dq_parts, axis=1).astype(q.dtype), own_per_kv_head(dk).astype(k.dtype),
            own_per_kv_head(dv).astype(v.dtype))


def _bwd_jvp(primals, tangents, **params):
    grads = attention_bwd_p.bind(*primals, **params)
    q, k, v, out, lse, d_out, d_lse, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, bias, mask = primals
    floats = (q, k, v, out, lse, d_out, d_lse, bias)
    dots = tuple(ad.instantiate_zeros(t) for t in (*tangents[:7], tangents[11]))

    def backward(q, k, v, out, lse, d_out, d_lse, bias):
        if params["ring"] is not None:  # (ring_attention inside shard_map: this device's shards)
            return _ring_dense_backward(q, k, v, out, lse, d_out, d_lse, bias, q_lengths, kv_lengths, q_segment_ids,
                                        kv_segment_ids, mask, params)
        return _dense_backward(q, k, v, out, lse, d_out, d_lse, bias, q_lengths, kv_lengths, q_segment_ids,
                               kv_segment_ids, mask, params)

    _, grads_dot = jax.jvp(backward, floats, dots)
    return grads, grads_dot


attention_bwd_p.def_abstract_eval(_bwd_abstract_eval)
attention_bwd_local_p.def_abstract_eval(_bwd_abstract_eval)
attention_bwd_p.def_impl(lambda *args, **params: _jitted_bwd(tuple(sorted(params.items())))(*args))
register_partitioned_lowering(attention_bwd_p, make_partitioned_backward(_bind_bwd_local))
mlir.register_lowering(attention_bwd_local_p, _lower_bwd_cpu, platform="cpu")
mlir.register_lowering(attention_bwd_local_p, _lower_bwd_cuda, platform="cuda")
batching.primitive_batchers[attention_bwd_p] = _bwd_batch_rule
ad.primitive_jvps[attention_bwd_p] = _bwd_jvp


# ---- vmap: every operand's axis 0 is the batch (contiguous K/V) -------------------------------------------------
def _fold(args, dims, tensors: tuple[int, ...]):
    """The operands with the mapped axis folded into their batch axis: (folded, mapped size, batch). The operands at
    `tensors` are bias / mask tensors (or their tangents), whose batch dimension may be broadcast (fold_tensor)."""
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    batch = next((x.shape[0] if d is None else jnp.moveaxis(x, d, 0).shape[1]) for x, d in zip(args, dims))
    folded = []
    for i, (x, d) in enumerate(zip(args, dims)):
        if i in tensors:
            folded.append(fold_tensor(x, d, size, batch))
            continue
        x = jnp.broadcast_to(x, (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)
        folded.append(x.reshape((size * x.shape[1], *x.shape[2:])))
    return folded, size, batch


def _unfold(x, size, batch):
    return x.reshape((size, batch, *x.shape[1:]))
