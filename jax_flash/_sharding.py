"""Multi-device sharding of the attention custom call (jax.experimental.custom_partitioning).

The public primitive (jax_flash/_primitive.py) lowers through `partitioned_attention`, a custom_partitioning function
around the per-device primitive. Under jax.jit with sharded inputs, XLA's partitioner asks `_partition` how to split
the call; each device then runs the FFI kernel on its own shard:

  q (B, Sq, Hq, D), k/v (B, Sk, Hk, D), q_lengths/kv_lengths (B) ((0,) when not given), page_table (B, P), segment
  ids (B, Sq) and (B, Sk)  ->  out (B, Sq, Hq, D), lse (B, Hq, Sq)

- batch: split freely (every operand and result carries it);
- heads: q heads and kv heads split by the same mesh axes (GQA-consistent: query head h reads kv head h // group,
  so device i's query heads read exactly device i's kv heads when Hk divides by the split). MQA (Hk = 1) splits q
  heads only and gives every device the one kv head;
- sequence: a sequence-sharded call runs ring attention over those mesh axes (jax_flash/_ring.py): q, k, v, out
  and lse keep their sequence sharding and only K/V shards move, by collective-permutes (with segment ids, the
  keys' ids beside them; the ids keep the sequence sharding of q and k). What the ring cannot run
  (jax_flash._ring.ring_refusal: paged K/V, ALiBi slopes, causal or window masks with lengths or unequal local
  lengths, a length that does not divide by the devices) is gathered (replicated along the sequence) with a
  one-time warning.
- head_dim: never split. An operand sharded along it is gathered first, with a one-time warning, because every
  score needs the whole head_dim.
- paged K/V, (num_pages, page_size, Hk, D): the pages are shared by the whole batch, so they are split over heads
  only (replicated along the batch axes); the page table splits with the batch (and is whole along its pages).
- bias and mask tensors split with the batch, the query heads and (in a ring) the query rows where those dimensions
  are full (not broadcast), and are whole along the keys: each ring step takes the visiting shard's columns.

The FP8 kernel's call (jax_flash/_fp8_primitive.py; make_partitioned_fp8) splits the same way, its descales (B, Hk)
with the kv heads (whole along the sequence: every K/V shard of a batch row and kv head shares them).

Inside shard_map (all mesh axes manual) the call lowers straight to the per-device kernel: shard_map already handed
it local shards. On one device custom_partitioning is a no-op.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec

from jax._src import dispatch as _dispatch  # no public spelling of prim_requires_devices_during_lowering

from jax_flash._ring import FP8_RING_DEFAULTS, ring_refusal

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=2)


def register_partitioned_lowering(primitive, partitioned) -> None:
    """primitive lowers through `partitioned(*operands, params)`, a custom_partitioning function whose last argument
    is the primitive's parameters as a sorted tuple (static, hashable)."""

    def lower(ctx, *args, **params):
        return mlir.lower_fun(lambda *xs: partitioned(*xs, tuple(sorted(params.items()))),
                              multiple_results=True)(ctx, *args)

    mlir.register_lowering(primitive, lower)
    # custom_partitioning needs the device assignment while lowering; jit provides it only for primitives on this
    # list (custom_partitioning's own primitive is on it, but it appears only inside our lowering, where jit cannot
    # see it).
    _dispatch.prim_requires_devices_during_lowering.add(primitive)


def _partitioned(local_call, params_index: int, decide, sharding_rule):
    """custom_partitioning around `local_call(*operands, params)`, params (a hashable tuple of the primitive's
    parameters) static at params_index: `decide(mesh, arg_shapes, params)` gives the Decision (operand and result
    shardings, and the ring the per-device call runs, if any)."""

    def call(*args_and_params):
        return local_call(*args_and_params)

    call = custom_partitioning(call, static_argnums=(params_index,))

    def partition(params, mesh, arg_shapes, result_shape):
        decision = decide(mesh, arg_shapes, params)
        local_params = _with_ring(params, decision.ring)

        def lower_fn(*args):
            return local_call(*args, local_params)

        return mesh, lower_fn, decision.outs, decision.args

    def infer_sharding_from_operands(params, mesh, arg_shapes, result_shape):  # GSPMD (non-Shardy) propagation
        return decide(mesh, arg_shapes, params).outs

    call.def_partition(partition=partition, infer_sharding_from_operands=infer_sharding_from_operands,
                       sharding_rule=sharding_rule)
    return call


def make_partitioned(local_attention):
    """custom_partitioning around `local_attention(q, k, v, q_lengths, kv_lengths, page_table, q_segment_ids,
    kv_segment_ids, bias, mask, params)`."""
    return _partitioned(local_attention, 10, _decide, _shardy_rule)


def make_partitioned_backward(local_backward):
    """custom_partitioning around `local_backward(q, k, v, out, lse, d_out, d_lse, q_lengths, kv_lengths,
    q_segment_ids, kv_segment_ids, bias, mask, params)` -> (dq, dk, dv): split like the forward (batch, and heads where
    the kv heads split with the query heads); MQA's one kv head is not split, so its gradient sums over every query
    head on one device."""

    def decide(mesh, arg_shapes, params) -> Decision:
        # (the forward's decision on q, k, v, the lengths, segment ids and tensors; its page table has no part here)
        decision = _decide(mesh, arg_shapes[:3] + arg_shapes[7:9] + arg_shapes[7:8] + arg_shapes[9:13], params,
                           split_shared_kv=False)
        (q_s, kv_s, _, q_len_s, kv_len_s, _, q_seg_s, kv_seg_s, bias_s, mask_s), (_, lse_s) = (decision.args,
                                                                                              decision.outs)
        return Decision((q_s, kv_s, kv_s, q_s, lse_s, q_s, lse_s, q_len_s, kv_len_s, q_seg_s, kv_seg_s, bias_s,
                         mask_s), (q_s, kv_s, kv_s), decision.ring)

    def shardy_rule(params, mesh, value_types, result_types):
        h, hk, extra = _head_factors(value_types[0].shape[2], value_types[1].shape[2], {})
        q, kv, lse = f"b sq {h} d", f"b sk {hk} d", f"b {h} sq"
        lengths, extra = _length_factors(value_types[7:9], extra)
        segments, extra = _segment_factors(params, extra)
        tensors, extra = _tensor_factors(value_types[11:13], value_types[0].shape, value_types[1].shape[1], h,
                                         extra)
        return _in_rule_order(f"{q}, {kv}, {kv}, {q}, {lse}, {q}, {lse}, {lengths}, {segments}, {tensors} -> {q}, "
                              f"{kv}, {kv}", extra)

    return _partitioned(local_backward, 13, decide, shardy_rule)


def make_partitioned_fp8(local_fp8):
    """custom_partitioning around `local_fp8(q, k, v, qk_descale, v_descale, q_lengths, kv_lengths, params)`, the
    FP8 kernel's call (jax_flash/_fp8_primitive.py): split over batch and heads, and run as ring attention over a
    sharded sequence, as the 16-bit call is (head_dim is never split)."""

    def shardy_rule(params, mesh, value_types, result_types):
        h, hk, extra = _head_factors(value_types[0].shape[2], value_types[1].shape[2], {})
        lengths, extra = _length_factors(value_types[5:7], extra)
        return _in_rule_order(f"b sq {h} d, b sk {hk} d, b sk {hk} d, b {hk}, b {hk}, {lengths} -> b sq {h} d, "
                              f"b {h} sq", extra)

    return _partitioned(local_fp8, 7, _decide_fp8, shardy_rule)


def _decide_fp8(mesh, arg_shapes, params) -> Decision:
    """The shardings of the FP8 kernel's call (q (B, Sq, Hq, D), k and v (B, Sk, Hk, D), the descales (B, Hk), the
    lengths (B,) or (0,)) and whether it runs as a ring: _decide's rules for a call without pages or tensors."""
    b, h, s, hk, ring = _plan_axes(mesh, arg_shapes, {**FP8_RING_DEFAULTS, **dict(params)}, True, "float8_e4m3fn ")
    q_sharding = NamedSharding(mesh, PartitionSpec(b, s, h, None))
    kv_sharding = NamedSharding(mesh, PartitionSpec(b, s, hk, None))
    descale_sharding = NamedSharding(mesh, PartitionSpec(b, hk))
    lengths_shardings = tuple(NamedSharding(mesh, PartitionSpec(b if lengths.shape[0] else None))  # (0,): absent
                              for lengths in arg_shapes[5:7])
    args = (q_sharding, kv_sharding, kv_sharding, descale_sharding, descale_sharding, *lengths_shardings)
    return Decision(args, (q_sharding, NamedSharding(mesh, PartitionSpec(b, h, s))), ring)


def _in_rule_order(rule: str, extra: dict) -> tuple[str, dict]:
    """(rule, extra) with the never-split factors listed in the order they first appear in the rule, as Shardy
    requires."""
    factors = rule.replace("(", " ").replace(")", " ").replace(",", " ").split()
    replicated = sorted(extra.get("need_replication_factors", ()), key=factors.index)
    return rule, {**extra, "need_replication_factors": tuple(replicated)} if replicated else extra


def _length_factors(types, extra: dict) -> tuple[str, dict]:
    """The Shardy factors of the q_lengths and kv_lengths operands: b, or, where one is absent ((0,)), a never-split
    factor of its own."""
    specs, replicated = [], list(extra.get("need_replication_factors", ()))
    for t, name in zip(types, ("zql", "zkl")):
        specs.append("b" if t.shape[0] else name)
        replicated += [] if t.shape[0] else [name]
    return ", ".join(specs), {**extra, "need_replication_factors": tuple(replicated)}


def _segment_factors(params, extra: dict) -> tuple[str, dict]:
    """The Shardy factors of the two segment id operands: (b sq, b sk), or, without segments, the (B, 0) operands'
    own never-split factors."""
    if dict(params)["segments"]:
        return "b sq, b sk", extra
    replicated = tuple(extra.get("need_replication_factors", ())) + ("zq", "zk")
    return "b zq, b zk", {**extra, "need_replication_factors": replicated}


def _tensor_factors(types, q_shape, seq_k, heads: str, extra: dict) -> tuple[str, dict]:
    """The Shardy factors of the bias and mask operands: b, the query heads' factor, sq and sk where a dimension is
    full, and a never-split factor of its own where it is broadcast, or the operand absent, or the keys are paged
    (seq_k None: the rule has no sk factor)."""
    batch, seq_q, heads_q, _ = q_shape
    full = (batch, heads_q, seq_q, seq_k)
    specs, replicated = [], list(extra.get("need_replication_factors", ()))
    for t, name in zip(types, ("bias", "mask")):
        factors = []
        for i, (n, shared) in enumerate(zip(t.shape, ("b", heads, "sq", "sk"))):
            if n == full[i] and t.shape[0] != 0:
                factors.append(shared)
            else:
                factors.append(f"{name}{i}")
                replicated.append(f"{name}{i}")
        specs.append(" ".join(factors))
    return ", ".join(specs), {**extra, "need_replication_factors": tuple(replicated)}


def _head_factors(heads_q: int, heads_k: int, extra: dict) -> tuple[str, str, dict]:
    """(query heads' factor, kv heads' factor, extra): the query heads are the compound factor (hk g) of the kv heads
    hk and the group g = Hq // Hk, so that Shardy propagates a head split to q, k, v and the results together."""
    if heads_k == heads_q:  # MHA: one head factor (Shardy forbids size-1 parts of a compound factor)
        return "h", "h", extra
    if heads_k <= 1 or heads_q % heads_k:  # MQA (the one kv head cannot split) or empty heads
        return "hq", "hk", extra
    return "(hk g)", "hk", {"g": heads_q // heads_k, **extra}


def _shardy_rule(params, mesh, value_types, result_types):
    """The Shardy rule: batch `b` everywhere; the query heads are the compound factor (hk g) of the kv heads hk and
    the group g = Hq // Hk, so Shardy propagates a head split to q, k, v, out and lse together. Paged K/V's page
    axes (p, r) and the table's pages (t) are never split."""
    heads_q = value_types[0].shape[2]
    heads_k = value_types[1].shape[2]
    paged = dict(params)["paged"]
    kv = "p r" if paged else "b sk"
    extra = {"need_replication_factors": ("p", "r", "t")} if paged else {"need_replication_factors": ("t",)}
    lengths, extra = _length_factors(value_types[3:5], extra)
    segments, extra = _segment_factors(params, extra)
    h, hk, extra = _head_factors(heads_q, heads_k, extra)
    seq_k = None if paged else value_types[1].shape[1]
    tensors, extra = _tensor_factors(value_types[8:10], value_types[0].shape, seq_k, h, extra)
    return _in_rule_order(f"b sq {h} d, {kv} {hk} d, {kv} {hk} d, {lengths}, b t, {segments}, {tensors} -> "
                          f"b sq {h} d, b {h} sq", extra)


def _spec(sharding, ndim: int) -> tuple:
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    return spec + (None,) * (ndim - len(spec))


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _split(mesh, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


class Decision(NamedTuple):
    args: tuple  # operand shardings
    outs: tuple  # (out, lse) shardings
    ring: tuple | None  # (sequence mesh axes, devices on them, "contiguous"): run as ring attention


def _with_ring(params, ring):
    """The primitive's parameters for one device; a call already inside a ring (shard_map) keeps its own."""
    if ring is None or dict(params)["ring"] is not None:
        return params
    return tuple(sorted({**dict(params), "ring": ring}.items()))


def _batch_and_head_axes(mesh, batch, heads_q, heads_k, q_spec, k_spec, paged, split_shared_kv):
    """(batch mesh axes, head mesh axes, whether the kv heads split too) of a call whose q and k have those specs."""
    # Batch axes come from q (else from k, unless k is a page pool); dropped when they do not divide the batch evenly.
    batch_axes = _axes(q_spec[0]) or (() if paged else _axes(k_spec[0]))
    if batch_axes and batch % _split(mesh, batch_axes):
        _warn_once("batch", f"jax_flash.attention: batch {batch} does not divide evenly over mesh axes {batch_axes} "
                            f"(size {_split(mesh, batch_axes)}); the batch is replicated, which repeats the work on "
                            f"every device")
        batch_axes = ()

    # Head axes from q (else k), never reusing a batch axis; q and kv heads are split by the same axes.
    head_axes = tuple(a for a in (_axes(q_spec[2]) or _axes(k_spec[2])) if a not in batch_axes)
    shard_kv_heads = True
    if head_axes:
        n = _split(mesh, head_axes)
        if heads_q % n == 0 and heads_k % n == 0:
            pass
        elif heads_q % n == 0 and heads_k == 1 and split_shared_kv:  # MQA: every device reads the one kv head
            shard_kv_heads = False
        elif heads_q % n == 0 and heads_k == 1:  # MQA backward: the heads stay whole (no partial dk, dv)
            head_axes = ()
        else:
            _warn_once("heads", f"jax_flash.attention: {heads_q} query heads and {heads_k} kv heads cannot be split "
                                f"consistently over mesh axes {head_axes} (size {n}; both must divide by it, or "
                                f"heads_k must be 1); heads are replicated, which repeats the work on every device")
            head_axes = ()
    return batch_axes, head_axes, shard_kv_heads


class _Axes(NamedTuple):
    batch: object  # PartitionSpec entries: the batch's, the heads' and the sequence's mesh axes (None: whole)
    heads: object
    sequence: object
    kv_heads: object  # the heads' entry where the kv heads split with the query heads, else None (MQA)
    ring: tuple | None


def _plan_axes(mesh, arg_shapes, params, split_shared_kv: bool, what: str) -> _Axes:
    """The mesh axes q (B, Sq, Hq, D), k and v (arg_shapes[:3]) are split over, and the ring over the sequence's;
    what the kernel cannot split is gathered, with a one-time warning that names `what` (the call's kind)."""
    paged = params["paged"]
    q, k = arg_shapes[0], arg_shapes[1]
    q_spec, k_spec, v_spec = (_spec(a.sharding, 4) for a in arg_shapes[:3])
    batch_axes, head_axes, shard_kv_heads = _batch_and_head_axes(mesh, q.shape[0], q.shape[2], k.shape[2], q_spec,
                                                                 k_spec, paged, split_shared_kv)
    used = set(batch_axes) | set(head_axes)
    seq_axes, ring, not_ring = _sequence_plan(mesh, params, q.shape[1], k.shape[1], q_spec, k_spec, used)
    used |= set(seq_axes)
    gathered = [name for name, spec in (("q", q_spec), ("k", k_spec), ("v", v_spec))
                if any(a not in used for entry in (spec[1], spec[3]) for a in _axes(entry))]
    if paged:  # the page axes (0 and 1) are replicated: every batch row may read any page
        gathered += [name for name, spec in (("k", k_spec), ("v", v_spec))
                     if _axes(spec[0]) and name not in gathered]
    if gathered:
        _warn_once(what, f"jax_flash.attention: {what}{', '.join(gathered)} sharded along the sequence or head_dim "
                         f"axis; it is gathered (replicated along that axis) before the kernel runs"
                         f"{not_ring or ', because every score needs all of head_dim'}. "
                         f"This costs an all-gather per call and memory for the whole sequence on each device")
    h = _entry(head_axes)
    return _Axes(_entry(batch_axes), h, _entry(seq_axes), h if shard_kv_heads else None, ring)


def _decide(mesh, arg_shapes, params, split_shared_kv: bool = True) -> Decision:
    """The shardings the per-device kernel runs on, and whether it runs as a ring over the sequence axes.
    split_shared_kv=False keeps MQA's query heads whole rather than splitting them over one shared kv head (the
    backward, whose dk and dv would otherwise be partial sums per device)."""
    params = dict(params)
    paged = params["paged"]
    q = arg_shapes[0]
    batch, _, heads_q, _ = q.shape
    b, h, s, hk, ring = _plan_axes(mesh, arg_shapes, params, split_shared_kv, "")
    q_sharding = NamedSharding(mesh, PartitionSpec(b, s, h, None))
    kv_sharding = NamedSharding(mesh, PartitionSpec(None if paged else b, s, hk, None))
    lengths_shardings = tuple(NamedSharding(mesh, PartitionSpec(b if lengths.shape[0] else None))  # (0,): absent
                              for lengths in arg_shapes[3:5])
    table_sharding = NamedSharding(mesh, PartitionSpec(b, None))
    segment_shardings = tuple(NamedSharding(mesh, PartitionSpec(b, s if ids.shape[1] else None))  # (B, 0): absent
                              for ids in arg_shapes[6:8])
    lse_sharding = NamedSharding(mesh, PartitionSpec(b, h, s))
    # bias, mask: batch, heads and query rows (the ring's) split as q is where full; every key on each device (a ring
    # step takes the visiting shard's columns)
    tensor_shardings = tuple(
        NamedSharding(mesh, PartitionSpec(b if t.shape[0] == batch and t.shape[0] else None,
                                          h if t.shape[1] == heads_q and t.shape[1] else None,
                                          s if t.shape[2] == q.shape[1] and t.shape[0] else None, None))
        for t in arg_shapes[8:10])
    arg_shardings = (q_sharding, kv_sharding, kv_sharding, *lengths_shardings, table_sharding, *segment_shardings,
                     *tensor_shardings)
    return Decision(arg_shardings, (q_sharding, lse_sharding), ring)


def _sequence_axes(q_spec, k_spec, used) -> tuple[str, ...]:
    """The mesh axes of q's sequence (else k's), less those batch and heads use."""
    return tuple(a for a in (_axes(q_spec[1]) or _axes(k_spec[1])) if a not in used)


def _sequence_plan(mesh, params, seq_q, seq_k, q_spec, k_spec, used):
    """(sequence axes kept split, ring parameter, why not a ring): ring attention over the sequence's mesh axes, or
    nothing to split (a size-1 axis: the axes stay and no ring is needed), or ((), None, the reason it is gathered;
    "" when the sequence is not split)."""
    axes = _sequence_axes(q_spec, k_spec, used)
    if not axes or params["ring"] is not None:
        return (), None, ""
    n = _split(mesh, axes)
    if n == 1:
        return axes, None, ""
    if seq_q % n or seq_k % n:
        return (), None, (f" instead of running ring attention, because seq_q {seq_q} and seq_k {seq_k} must both "
                          f"divide by the {n} devices of mesh axes {axes} (pad the sequence at its end: causal "
                          f"self-attention's rows never see keys padded after them; otherwise mask them with "
                          f"kv_lengths)")
    refusal = ring_refusal(params, seq_q // n, seq_k // n, n, "contiguous")
    if refusal:
        return (), None, f" instead of running ring attention, because {refusal}"
    return axes, (axes, n, "contiguous"), ""
