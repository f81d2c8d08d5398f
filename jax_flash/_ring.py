"""Ring attention: the sequence axis stays sharded over a ring of n devices, K/V shards rotate around it, and each
device merges the partial (out, lse) of its local queries against every visiting K/V shard.

It runs as the lowering of the per-device primitives when their `ring` parameter is set: (axis names, n, layout).
The partitioning rule (jax_flash/_sharding.py) sets it for a sequence-sharded jit call; `jax_flash.ring_attention`
sets it inside shard_map. The forward and backward are written out here, step by step, from the same static plan:

  step t (0 <= t < n): device r holds the K/V shard of device s = (r - t) mod n; the shard of the next needed step
  is sent by one collective-permute issued before this step's kernel, so XLA may overlap the two.
  Which query rows and keys of the (local q, visiting K/V) pair can see each other depends only on t and on whether
  s < r (r >= t), so both cases are static plans and a lax.cond on r >= t picks one; a plan may be "nothing visible"
  (the kernel is skipped) and a step whose both plans are empty is dropped with its permute.

Layouts (the global positions a device's shard holds, c = local length, h = c / 2):
  contiguous: device r holds positions [r c, (r + 1) c);
  zigzag: device r holds the halves r and 2n - 1 - r of 2n halves. Causal work is then equal on every device
    (each step is half a block of work everywhere), where the contiguous ring leaves device r idle for n - 1 - r
    steps. A causal call on contiguous shards is permuted to zigzag and back (collective-permutes of q, k, v and
    out: one shard each).

Masks that depend on the query-key offset (causal, window) need every device's chunks of equal length. The kernels
align them to the bottom-right corner of each batch row's actual lengths, a per-row shift the static plans cannot
follow, except in padded self-attention: causal masks with q_lengths and kv_lengths given as one array (the shift
is 0; `_Lengths` says which pair gets which lengths). `ring_refusal` names what cannot run as a ring; the
partitioning rule then gathers.

The backward walks the same steps: dQ accumulates on its device; dK/dV accumulate in float32 beside the K/V shard
they belong to, travel with it, and go home by one final permute. Segment ids: the queries' stay, the keys' travel
with their K/V shard (and take the zigzag permutation with them); each pair's kernel call gets both, cut to its plan.
Bias / mask tensors do not travel: each device holds its query rows of them and every key (_Extras).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

RING_LAYOUTS = ("contiguous", "zigzag")
# The features the FP8 kernel's call (jax_flash/_fp8_primitive.py) does not have, as the ring reads its parameters.
FP8_RING_DEFAULTS = dict(paged=False, alibi=False, has_bias=False, has_mask=False, segments=False)


# ---- what can run as a ring ----------------------------------------------------------------------------------------
def _offset_masked(params) -> bool:
    return bool(params["causal"]) or params["window_left"] >= 0 or params["window_right"] >= 0


def ring_refusal(params, seq_q: int, seq_k: int, size: int, layout: str) -> str | None:
    """Why this call cannot run as a ring of `size` devices with local lengths seq_q, seq_k (None: it can)."""
    if params["paged"]:
        return "paged K/V (page_table) are shared pages, not a sequence to shard"
    if params["alibi"]:
        return "ALiBi slopes measure distances between global positions, which the ring's steps do not pass yet"
    if layout == "zigzag" and not (params["causal"] and params["window_left"] < 0):
        return "the zigzag layout is for causal attention without a left window"
    if layout == "zigzag" and (seq_q != seq_k or seq_q % 2):
        return f"the zigzag layout needs equal, even local lengths (local seq_q {seq_q}, seq_k {seq_k})"
    if _offset_masked(params) and seq_q != seq_k:
        return f"causal or window masks need equal local query and key lengths (got {seq_q} and {seq_k})"
    if _offset_masked(params) and (params["has_q_lengths"] or params["has_kv_lengths"]):
        if not params["causal"]:
            return ("a window that is not causal, with q_lengths / kv_lengths, needs key masks per batch row in every "
                    "step (the kernels align windows to each row's actual lengths)")
        if not params["same_lengths"]:
            return ("causal or window masks with q_lengths / kv_lengths align to each batch row's actual lengths, a "
                    "shift per row the ring's static plans cannot follow; padded self-attention runs as a ring when "
                    "q_lengths and kv_lengths are the same array (pass one array to both)")
    return None


def _uses_zigzag(params, seq: int, size: int) -> bool:
    """Causal calls without a left window run zigzag: balanced, and every step is half a block."""
    return size > 1 and params["causal"] and params["window_left"] < 0 and seq % 2 == 0


def _positions(r, seq: int, size: int, zigzag: bool):
    """(seq,) int32: the global positions of this device's local rows (or keys) in its layout."""
    local = jnp.arange(seq, dtype=jnp.int32)
    if not zigzag:
        return r * seq + local
    half = seq // 2
    return jnp.where(local < half, r * half + local, (2 * size - 1 - r) * half + local - half)


# ---- static plans --------------------------------------------------------------------------------------------------
def pair_plan(rows: int, keys: int, lo, hi):
    """For a block of `rows` queries and `keys` keys in which row i sees key j when lo <= j - i <= hi (None:
    unbounded), None when no pair is visible, else (r0, r1, c0, c1, window_left, window_right): rows [r0, r1) and
    keys [c0, c1) hold every visible pair, and the kernel's window about the slice's own bottom-right diagonal
    (offset (c1 - c0) - (r1 - r0)) reproduces the band, -1 meaning unbounded."""
    if rows == 0 or keys == 0:
        return None
    if (lo is not None and lo > keys - 1) or (hi is not None and hi < -(rows - 1)) or \
            (lo is not None and hi is not None and lo > hi):
        return None
    r0 = 0 if hi is None else max(0, -hi)
    r1 = rows if lo is None else min(rows, keys - lo)
    c0 = 0 if lo is None else max(0, lo)
    c1 = keys if hi is None else min(keys, rows + hi)
    diagonal = (c1 - c0) - (r1 - r0)
    left = -1 if lo is None else diagonal - (lo - c0 + r0)
    right = -1 if hi is None else (hi - c0 + r0) - diagonal
    return r0, r1, c0, c1, left, right


def step_plans(params, t: int, size: int, seq_q: int, seq_k: int, zigzag: bool):
    """(plan when r >= t, plan when r < t) of step t; at t = 0 both are the diagonal pair."""
    if zigzag:
        half = seq_q // 2
        if t == 0:
            return (pair_plan(seq_q, seq_k, None, 0),) * 2  # the local halves keep their order: plain causal
        # s < r: every local query sees the visiting first half; s > r: the local second half sees both halves
        return (0, seq_q, 0, half, -1, -1), (half, seq_q, 0, seq_k, -1, -1)
    if not _offset_masked(params):
        return ((0, seq_q, 0, seq_k, -1, -1),) * 2
    lo = -params["window_left"] if params["window_left"] >= 0 else None
    hi = 0 if params["causal"] else (params["window_right"] if params["window_right"] >= 0 else None)

    def shifted(chunks):  # the visiting keys start `chunks` chunks after the local queries
        d = chunks * seq_k
        return pair_plan(seq_q, seq_k, None if lo is None else lo - d, None if hi is None else hi - d)

    return shifted(-t), shifted(size - t) if t else shifted(0)


def _steps(params, size, seq_q, seq_k, zigzag):
    plans = [step_plans(params, t, size, seq_q, seq_k, zigzag) for t in range(size)]
    return [(t, a, b) for t, (a, b) in enumerate(plans) if a is not None or b is not None]


def _visits(steps, shards, axis, size: int):
    """Yields (t, plan when r >= t, plan when r < t, the visiting shards, the next needed step or None) for every
    needed step; shards: K, V and, with segment ids, the keys' ids. The next step's shards are permuted before this
    step's work is traced, so XLA may overlap the two."""
    for index, (t, plan_ge, plan_lt) in enumerate(steps):
        following = steps[index + 1][0] if index + 1 < len(steps) else None
        if following is not None:
            following_shards = tuple(_shift(x, axis, size, following - t) for x in shards)
        yield t, plan_ge, plan_lt, shards, following
        if following is not None:
            shards = following_shards


def _by_side(r, t, plan_ge, plan_lt, pair, *args):
    """pair(plan, *args) for this device's side of step t: one call where both sides share the plan."""
    if plan_ge == plan_lt:
        return pair(plan_ge, *args)
    return lax.cond(r >= t, lambda *a: pair(plan_ge, *a), lambda *a: pair(plan_lt, *a), *args)


def _layout(params, seq_q: int, size: int, layout: str):
    """(whether the steps see zigzag shards, whether contiguous shards are permuted there and back)."""
    zigzag = layout == "zigzag" or _uses_zigzag(params, seq_q, size)
    return zigzag, zigzag and layout == "contiguous"


# ---- collectives ---------------------------------------------------------------------------------------------------
def _shift(x, axis, size: int, shift: int):
    """Device r receives device (r - shift) mod size's x."""
    if shift % size == 0:
        return x
    return lax.ppermute(x, axis, [(i, (i + shift) % size) for i in range(size)])


def _owner(half: int, size: int) -> int:
    """The device that holds global half `half` (of 2 size) in the zigzag layout."""
    return half if half < size else 2 * size - 1 - half


def to_zigzag(x, seq_dim: int, axis, size: int):
    """Contiguous shards (device r: halves 2r, 2r + 1) to zigzag shards (device r: halves r, 2 size - 1 - r)."""
    first, second = jnp.split(x, 2, axis=seq_dim)
    got_even = lax.ppermute(first, axis, [(r, _owner(2 * r, size)) for r in range(size)])
    got_odd = lax.ppermute(second, axis, [(r, _owner(2 * r + 1, size)) for r in range(size)])
    even_device = lax.axis_index(axis) % 2 == 0  # device d's first half d is even exactly when d is
    return jnp.where(even_device, jnp.concatenate([got_even, got_odd], seq_dim),
                     jnp.concatenate([got_odd, got_even], seq_dim))


def from_zigzag(x, seq_dim: int, axis, size: int):
    """The inverse of to_zigzag."""
    first, second = jnp.split(x, 2, axis=seq_dim)
    even_device = lax.axis_index(axis) % 2 == 0
    even_half, odd_half = jnp.where(even_device, first, second), jnp.where(even_device, second, first)
    even_dest = [(d, (d if d % 2 == 0 else 2 * size - 1 - d) // 2) for d in range(size)]
    odd_dest = [(d, (2 * size - 1 - d if d % 2 == 0 else d) // 2) for d in range(size)]
    return jnp.concatenate([lax.ppermute(even_half, axis, even_dest), lax.ppermute(odd_half, axis, odd_dest)],
                           seq_dim)


def zigzag_indices(seq_len: int, size: int):
    """Global token order that makes a contiguous sharding over `size` devices hold the zigzag layout: x[:, idx]
    sharded contiguously puts halves r and 2 size - 1 - r of the original sequence on device r (undo with
    jnp.argsort(idx)). seq_len must divide by 2 size."""
    return jnp.asarray(zigzag_order(seq_len, size))


def zigzag_order(seq_len: int, size: int) -> np.ndarray:
    """zigzag_indices as a NumPy array (a constant while tracing)."""
    if size < 1 or seq_len % (2 * size):
        raise ValueError(f"zigzag_indices: seq_len {seq_len} must be a multiple of 2 * size = {2 * size}")
    half = seq_len // (2 * size)
    order = [h for r in range(size) for h in (r, 2 * size - 1 - r)]
    return np.concatenate([np.arange(h * half, (h + 1) * half) for h in order]).astype(np.int32)


# ---- the merge of partial results ----------------------------------------------------------------------------------
def merge_partials(out_a, lse_a, out_b, lse_b):
    """Attention over the union of two disjoint key sets from each set's (out (B, S, H, D) float32, lse (B, H, S)):
    out = (e^lse_a out_a + e^lse_b out_b) / (e^lse_a + e^lse_b), lse = log(e^lse_a + e^lse_b); -inf stays -inf and
    gives out 0, with finite gradients."""
    m = lax.stop_gradient(jnp.maximum(lse_a, lse_b))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w_a, w_b = jnp.exp(lse_a - m), jnp.exp(lse_b - m)
    total = w_a + w_b
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    lse = jnp.where(seen, m + jnp.log(safe), -jnp.inf)

    def rows(w):  # (B, H, S) -> (B, S, H, 1)
        return jnp.transpose(w / safe, (0, 2, 1))[..., None]

    return out_a * rows(w_a) + out_b * rows(w_b), lse


# ---- forward -------------------------------------------------------------------------------------------------------
class _Lengths:
    """The lengths a pair's kernel call gets.

    Without offset masks each block gets its own valid rows and keys (contiguous layout: a block's positions are
    consecutive). With causal masks and one lengths array L (padded self-attention), only the diagonal step gets
    lengths, both the count of its valid local positions (a prefix of the local rows in either layout), so its
    diagonal stays at offset 0; every other visible pair has only valid keys for the rows that matter (a valid
    query's earlier keys are valid), and rows past L are zeroed after the merge."""

    def __init__(self, params, q_len, kv_len, positions):
        self.params, self.q_len, self.kv_len = params, q_len, kv_len
        self.by_diagonal = _offset_masked(params) and params["has_q_lengths"]
        self.diagonal = jnp.sum(self.valid_rows(positions), axis=1, dtype=jnp.int32)

    def valid_rows(self, positions):
        """(B, local rows) bool: the local rows (at these global positions) before each batch row's length."""
        return positions[None, :] < self.q_len[:, None]

    def pair(self, t, q_start, kv_start, rows, keys, plan_offsets):
        """(q_lengths, kv_lengths, has_q, has_kv) of a block of `rows` x `keys` (sliced at plan_offsets)."""
        full_q = full_k = jnp.zeros((0,), jnp.int32)  # lengths not given (has_q / has_kv False: none read)
        if self.by_diagonal:
            if t != 0:
                return full_q, full_k, False, False
            return self.diagonal, self.diagonal, True, True  # (the diagonal plan never slices: t = 0, lo <= 0 <= hi)
        r0, c0 = plan_offsets
        ql = jnp.clip(self.q_len - q_start - r0, 0, rows) if self.params["has_q_lengths"] else full_q
        kl = jnp.clip(self.kv_len - kv_start - c0, 0, keys) if self.params["has_kv_lengths"] else full_k
        return ql.astype(jnp.int32), kl.astype(jnp.int32), self.params["has_q_lengths"], self.params["has_kv_lengths"]


def _local_params(params, plan, has_q, has_kv):
    _, _, _, _, left, right = plan
    return dict(params, ring=None, causal=False, window_left=left, window_right=right, return_lse=True,
                has_q_lengths=has_q, has_kv_lengths=has_kv, same_lengths=False)


class _Extras:
    """What a pair's kernel call takes beside q, k and v, cut to its plan: segment ids (the queries' stay, the keys'
    travel with their K/V shard) and bias / mask tensors. A tensor's rows are this device's queries (where its query
    dimension is full; sharded as q is) and its keys the whole sequence (where full), so a pair takes the columns of
    the visiting shard's global key positions; broadcast dimensions stay 1 and an absent tensor (0, 0, 0, 0) stays
    absent."""

    def __init__(self, q_ids=None, tensors=None):
        self.q_ids, self.tensors = q_ids, tensors

    def reordered(self, axis, size: int, seq_q: int):
        """The same with the queries' rows in zigzag order (a causal call on contiguous shards)."""
        q_ids = None if self.q_ids is None else to_zigzag(self.q_ids, 1, axis, size)
        tensors = None if self.tensors is None else tuple(
            to_zigzag(x, 2, axis, size) if x.shape[2] == seq_q and x.shape[0] else x for x in self.tensors)
        return _Extras(q_ids, tensors)

    def cut(self, plan, kv_ids, key_positions):
        """(segment ids or None, (bias, mask) or None) of the pair; kv_ids: the visiting keys' ids; key_positions:
        their global positions."""
        r0, r1, c0, c1, _, _ = plan
        ids = None if self.q_ids is None else (self.q_ids[:, r0:r1], kv_ids[:, c0:c1])
        if self.tensors is None:
            return ids, None
        cut = []
        for x in self.tensors:
            if x.shape[0] and x.shape[3] != 1:
                x = jnp.take(x, key_positions[c0:c1], axis=3)
            if x.shape[0] and x.shape[2] != 1:
                x = x[:, :, r0:r1]
            cut.append(x)
        return ids, tuple(cut)


def _pair_forward(plan, t, q, k, v, lengths, q_start, kv_start, params, bind, extras, kv_ids, key_positions):
    """(out float32 (B, Sq, Hq, D), lse (B, Hq, Sq)) of the local queries against one visiting K/V shard (its keys'
    segment ids kv_ids or None, their global positions key_positions)."""
    seq_q = q.shape[1]
    if plan is None:  # (from q: inside shard_map a cond's branches must vary over the same mesh axes)
        return jnp.zeros_like(q, jnp.float32), jnp.full_like(jnp.swapaxes(q[..., 0], 1, 2), -jnp.inf, jnp.float32)
    r0, r1, c0, c1, _, _ = plan
    ql, kl, has_q, has_kv = lengths.pair(t, q_start, kv_start, r1 - r0, c1 - c0, (r0, c0))
    table = jnp.zeros((q.shape[0], 0), jnp.int32)
    out, lse = bind(q[:, r0:r1], k[:, c0:c1], v[:, c0:c1], ql, kl, table, _local_params(params, plan, has_q, has_kv),
                    *extras.cut(plan, kv_ids, key_positions))
    out = jnp.pad(out.astype(jnp.float32), ((0, 0), (r0, seq_q - r1), (0, 0), (0, 0)))
    lse = jnp.pad(lse, ((0, 0), (0, 0), (r0, seq_q - r1)), constant_values=-jnp.inf)
    return out, lse


def ring_forward(q, k, v, q_len, kv_len, params, bind, q_ids=None, kv_ids=None, out_dtype=None, tensors=None):
    """(out, lse) of this device's queries against every device's keys; `bind(q, k, v, q_lengths, kv_lengths,
    page_table, params, segment_ids, tensors)` runs the per-device kernel (segment_ids: the pair's (q, kv) ids or
    None; tensors: its (bias, mask) or None). q_ids, kv_ids: this device's segment ids, (B, Sq) and (B, Sk), when
    params["segments"]; the keys' travel with their K/V shard. tensors: (bias, mask) with this device's query rows and
    every key (_Extras), or None. out_dtype: the output's dtype (q's by default; the FP8 kernel's output is
    bfloat16)."""
    axis, size, layout = params["ring"]
    seq_q, seq_k = q.shape[1], k.shape[1]
    zigzag, reorder = _layout(params, seq_q, size, layout)
    extras = _Extras(q_ids, tensors)
    if reorder:
        q, k, v = (to_zigzag(x, 1, axis, size) for x in (q, k, v))
        kv_ids = None if kv_ids is None else to_zigzag(kv_ids, 1, axis, size)
        extras = extras.reordered(axis, size, seq_q)
    r = lax.axis_index(axis)
    positions = _positions(r, seq_q, size, zigzag)
    lengths = _Lengths(params, q_len, kv_len, positions)
    out = lse = None
    shards = (k, v) if kv_ids is None else (k, v, kv_ids)
    for t, plan_ge, plan_lt, visiting, _ in _visits(_steps(params, size, seq_q, seq_k, zigzag), shards, axis, size):
        def pair(plan, q, source, *visiting, t=t):
            return _pair_forward(plan, t, q, *visiting[:2], lengths, r * seq_q, source * seq_k, params, bind, extras,
                                 visiting[2] if len(visiting) > 2 else None, _positions(source, seq_k, size, zigzag))

        part = _by_side(r, t, plan_ge, plan_lt, pair, q, (r - t) % size, *visiting)
        out, lse = part if out is None else merge_partials(out, lse, *part)
    if lengths.by_diagonal:  # rows past the length: zeros and lse -inf, as the kernels give them
        valid = lengths.valid_rows(positions)
        out = jnp.where(valid[:, :, None, None], out, 0.0)
        lse = jnp.where(valid[:, None, :], lse, -jnp.inf)
    out = out.astype(q.dtype if out_dtype is None else out_dtype)
    if reorder:
        out, lse = from_zigzag(out, 1, axis, size), from_zigzag(lse, 2, axis, size)
    return out, lse


# ---- backward ------------------------------------------------------------------------------------------------------
def _pair_backward(plan, t, q, k, v, out, lse, d_out, d_lse, lengths, q_start, kv_start, params, bind_bwd, extras,
                   kv_ids, key_positions):
    """(dq, dk, dv) float32 of one (local queries, visiting K/V) pair, given the merged out and lse."""
    f32 = jnp.float32
    if plan is None:  # (zeros like the operands: see _pair_forward)
        return jnp.zeros_like(q, f32), jnp.zeros_like(k, f32), jnp.zeros_like(v, f32)
    r0, r1, c0, c1, _, _ = plan
    ql, kl, has_q, has_kv = lengths.pair(t, q_start, kv_start, r1 - r0, c1 - c0, (r0, c0))
    dq, dk, dv = bind_bwd(q[:, r0:r1], k[:, c0:c1], v[:, c0:c1], out[:, r0:r1], lse[:, :, r0:r1],
                          d_out[:, r0:r1], d_lse[:, :, r0:r1], ql, kl, _local_params(params, plan, has_q, has_kv),
                          *extras.cut(plan, kv_ids, key_positions))
    rows, keys = ((0, 0), (r0, q.shape[1] - r1), (0, 0), (0, 0)), ((0, 0), (c0, k.shape[1] - c1), (0, 0), (0, 0))
    return jnp.pad(dq.astype(f32), rows), jnp.pad(dk.astype(f32), keys), jnp.pad(dv.astype(f32), keys)


def ring_backward(q, k, v, out, lse, d_out, d_lse, q_len, kv_len, params, bind_bwd, q_ids=None, kv_ids=None,
                  tensors=None):
    """(dq, dk, dv) of ring_forward; `bind_bwd(q, k, v, out, lse, d_out, d_lse, q_lengths, kv_lengths, params,
    segment_ids, tensors)` runs the per-device backward kernel."""
    axis, size, layout = params["ring"]
    seq_q, seq_k = q.shape[1], k.shape[1]
    zigzag, reorder = _layout(params, seq_q, size, layout)
    extras = _Extras(q_ids, tensors)
    if reorder:
        q, k, v, out, d_out = (to_zigzag(x, 1, axis, size) for x in (q, k, v, out, d_out))
        lse, d_lse = (to_zigzag(x, 2, axis, size) for x in (lse, d_lse))
        kv_ids = None if kv_ids is None else to_zigzag(kv_ids, 1, axis, size)
        extras = extras.reordered(axis, size, seq_q)
    r = lax.axis_index(axis)
    positions = _positions(r, seq_q, size, zigzag)
    lengths = _Lengths(params, q_len, kv_len, positions)
    if lengths.by_diagonal:  # rows past the length have lse -inf (P = 0); their cotangents reach nothing
        valid = lengths.valid_rows(positions)
        d_out = jnp.where(valid[:, :, None, None], d_out, 0).astype(d_out.dtype)
        d_lse = jnp.where(valid[:, None, :], d_lse, 0.0)
    dq = jnp.zeros(q.shape, jnp.float32)
    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)
    held = 0  # the step whose K/V shard (and its dK/dV) this device holds
    shards = (k, v) if kv_ids is None else (k, v, kv_ids)
    for t, plan_ge, plan_lt, visiting, following in _visits(_steps(params, size, seq_q, seq_k, zigzag), shards, axis,
                                                            size):
        def pair(plan, source, *visiting, t=t):
            return _pair_backward(plan, t, q, *visiting[:2], out, lse, d_out, d_lse, lengths, r * seq_q,
                                  source * seq_k, params, bind_bwd, extras, visiting[2] if len(visiting) > 2 else None,
                                  _positions(source, seq_k, size, zigzag))

        parts = _by_side(r, t, plan_ge, plan_lt, pair, (r - t) % size, *visiting)
        dq, dk, dv = dq + parts[0], dk + parts[1], dv + parts[2]
        if following is not None:  # dK/dV travel with their K/V
            dk, dv = (_shift(x, axis, size, following - t) for x in (dk, dv))
            held = following
    dk, dv = (_shift(x, axis, size, -held) for x in (dk, dv))  # home: device s's shard sits on s + held
    dq, dk, dv = dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
    if reorder:
        dq, dk, dv = (from_zigzag(x, 1, axis, size) for x in (dq, dk, dv))
    return dq, dk, dv
