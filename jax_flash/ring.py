"""Ring attention for code already inside shard_map: each device holds a shard of the sequence of q, k and v, and
the K/V shards rotate around the mesh axis (jax_flash/_ring.py). A jit call on sequence-sharded inputs runs the
same ring through attention's partitioning rule; this function is for shard_map users."""

from __future__ import annotations

from jax import lax

from jax_flash._ring import RING_LAYOUTS, zigzag_indices
from jax_flash.attention import dispatch
from jax_flash.config import KernelConfig

__all__ = ["ring_attention", "zigzag_indices"]


def ring_attention(q, k, v, cfg: KernelConfig | None = None, *, axis_name, layout: str = "contiguous",
                   causal: bool = False, softmax_scale: float | None = None, window: tuple[int, int] | None = None,
                   softcap: float | None = None, q_lengths=None, kv_lengths=None, q_segment_ids=None,
                   kv_segment_ids=None, bias=None, mask=None, return_lse: bool = False, deterministic: bool = False,
                   q_descale=None, k_descale=None, v_descale=None, out_dtype=None):
    """jax_flash.attention over a sequence sharded along the mesh axis (or axes) `axis_name`, called inside
    shard_map on the local shards: q (batch, seq_q / n, heads_q, head_dim), k and v (batch, seq_k / n, heads_k,
    head_dim). Returns this device's rows of the output (and of the lse), as attention on the whole sequence would.

    layout says which global positions the shards hold (n devices along axis_name, device r = its axis index):
      "contiguous": device r holds positions [r seq / n, (r + 1) seq / n). Causal calls are permuted to zigzag and
        back inside (collective-permutes of one shard of q, k, v and out) so that every device does the same work;
      "zigzag": causal only; device r holds the halves r and 2n - 1 - r of the sequence cut into 2n halves: the
        order `x[:, zigzag_indices(seq, n)]` makes, which saves those permutes.
    Masks are those of the whole sequence. Causal or window masks need equal local query and key lengths; with
    them, q_lengths / kv_lengths (global, replicated) must be one array passed as both, with causal=True (padded
    self-attention: the kernels align causal masks to each row's actual lengths). Without those masks any lengths
    work. q_segment_ids, kv_segment_ids: this device's shards (batch, seq_q / n) and (batch, seq_k / n) of packed
    sequences' ids, in the same layout; the keys' travel with their K/V shard. bias, mask: as attention takes them,
    with this device's query rows (in the layout's order) and every key in the sequence's own order, (B|1, Hq|1,
    seq_q / n | 1, seq_k | 1): shard their rows as q is (or pass one row for all); each step reads the columns of the
    visiting keys. float8_e4m3fn q, k, v take their (batch, heads_k) descales (the same on every device of the ring)
    and out_dtype; on Hopper each step runs the FP8 kernel (forward only). Other arguments and derivatives: as
    jax_flash.attention (the backward ring moves dK/dV with their K/V shards; forward-mode and second derivatives
    gather K and V whole on every device).
    """
    if layout not in RING_LAYOUTS:
        raise ValueError(f"layout must be one of {RING_LAYOUTS}, got {layout!r}")
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    try:
        size = int(lax.psum(1, axes))
    except NameError as error:
        raise ValueError(f"ring_attention: axis_name {axis_name!r} is not a mesh axis bound here; call it inside "
                         f"jax.shard_map over that axis ({error})") from None
    kwargs = dict(causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap, q_lengths=q_lengths,
                  kv_lengths=kv_lengths, page_table=None, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                  bias=bias, mask=mask, alibi_slopes=None, deterministic=deterministic, ring=(axes, size, layout))
    descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    return dispatch(q, k, v, cfg, descales, out_dtype, return_lse, kwargs)
