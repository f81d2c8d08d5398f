"""The sm90 FP8 kernel on a Hopper GPU (jax_flash/_fp8_primitive.py, csrc/sm90/launch_fp8.cuh): float8_e4m3fn q, k,
v with (B, Hk) descales against attention_reference on the dequantised inputs, with the forward's tolerance rule:
twice the error of a plain FP8 implementation (the same scores in float32, P rounded to e4m3 at 2^8 times the row
maximum, as the kernel rounds it) plus the bfloat16 output's rounding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash.reference import visibility_mask
from conftest import GPU_DEVICES

HOPPER = [d for d in GPU_DEVICES if str(getattr(d, "compute_capability", "")).startswith("9.")]
requires_hopper = pytest.mark.skipif(not HOPPER, reason="no Hopper GPU (compute capability 9.x) visible to jax")


def _inputs(seed, batch, seq_q, seq_k, heads_q, heads_k, head_dim=128):
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    q, k, v = ((2.0 * jax.random.normal(key, (batch, seq, heads, head_dim))).astype(jnp.float8_e4m3fn)
               for key, seq, heads in ((keys[0], seq_q, heads_q), (keys[1], seq_k, heads_k),
                                       (keys[2], seq_k, heads_k)))
    descales = [jax.random.uniform(key, (batch, heads_k), jnp.float32, 0.05, 0.5) for key in keys[3:]]
    return [jax.device_put(x, HOPPER[0]) for x in (q, k, v, *descales)]


def _dequantised(q, k, v, qd, kd, vd):
    group = q.shape[2] // k.shape[2]
    per_head = lambda d: jnp.repeat(d, group, axis=1)[:, None, :, None]
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    return q32 * per_head(qd * kd), jnp.repeat(k32, group, axis=2), jnp.repeat(v32 * vd[:, None, :, None], group,
                                                                               axis=2)


def _plain_fp8(q, k, v, qd, kd, vd, **mask):
    """Attention of the dequantised inputs in float32 with P rounded to e4m3 at 2^8 times each row's maximum."""
    q32, k32, v32 = _dequantised(q, k, v, qd, kd, vd)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q32, k32) / np.sqrt(q.shape[3])
    visible = visibility_mask(q.shape[0], q.shape[1], k.shape[1], **mask)
    scores = jnp.where(visible, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.where(visible, jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0)) * 256.0, 0.0)
    rounded = p.astype(jnp.float8_e4m3fn).astype(jnp.float32)
    total = jnp.sum(p, axis=-1, keepdims=True)
    return jnp.einsum("bhqk,bkhd->bqhd", rounded / jnp.where(total > 0, total, 1.0), v32)


def _check(q, k, v, qd, kd, vd, cfg=None, **mask):
    out, lse = jax_flash.attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True, cfg=cfg,
                                   **mask)
    assert out.dtype == jnp.bfloat16
    ref, ref_lse = jax_flash.attention_reference(*_dequantised(q, k, v, qd, kd, vd), return_lse=True, **mask)
    plain = _plain_fp8(q, k, v, qd, kd, vd, **mask)
    out, ref, plain = (np.asarray(x, np.float32) for x in (out, ref, plain))
    bound = 2 * np.abs(plain - ref).max() + 2.0**-8 * np.abs(ref).max() + 1e-3
    err = np.abs(out - ref).max()
    assert err <= bound, f"max error {err:.4g} above {bound:.4g} (plain FP8: {np.abs(plain - ref).max():.4g})"
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    seen = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[seen], ref_lse[seen], atol=2e-3, rtol=1e-4)


@requires_hopper
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("seq_q,seq_k", [(128, 128), (300, 1000), (1000, 300), (1, 4100), (129, 77)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_fp8_kernel_matches_the_dequantised_reference(heads, seq_q, seq_k, causal, head_dim):
    q, k, v, qd, kd, vd = _inputs(seq_q + seq_k + heads[1], 2, seq_q, seq_k, *heads, head_dim=head_dim)
    _check(q, k, v, qd, kd, vd, causal=causal)


@requires_hopper
@pytest.mark.parametrize("head_dim", [128, 256])
def test_gpu_fp8_kernel_with_lengths_and_a_window(head_dim):
    q, k, v, qd, kd, vd = _inputs(5, 3, 200, 700, 4, 2, head_dim=head_dim)
    mask = dict(causal=True, window=(150, -1), q_lengths=jnp.array([200, 17, 0], jnp.int32),
                kv_lengths=jnp.array([700, 300, 5], jnp.int32))
    _check(q, k, v, qd, kd, vd, **mask)


FP8_SHIPPED = list(jax_flash.config.FP8_CONFIGS.items())


@requires_hopper
@pytest.mark.parametrize("head_dim,cfg", FP8_SHIPPED, ids=[f"d{d}_kv{c.block_kv}" for d, c in FP8_SHIPPED])
def test_gpu_fp8_each_shipped_config_with_lengths_and_a_window(head_dim, cfg):
    """Every FP8 config cfg=None picks by head dim (FP8_CONFIGS: head dim 128 on 128-key blocks with the
    intra-warpgroup overlap, head dim 256 on 128-key blocks without it; P V in 64-column parts), forced on lengths
    that end inside a key block, with and without masks."""
    q, k, v, qd, kd, vd = _inputs(11, 3, 200, 1000, 4, 2, head_dim=head_dim)
    _check(q, k, v, qd, kd, vd, cfg=cfg)
    _check(q, k, v, qd, kd, vd, cfg=cfg, causal=True, window=(300, -1), q_lengths=jnp.array([200, 33, 0], jnp.int32),
           kv_lengths=jnp.array([1000, 577, 191], jnp.int32))
    # a multiple of the block: the unmasked variant
    q, k, v, qd, kd, vd = _inputs(12, 1, 130, 3 * cfg.block_kv, 2, 1, head_dim=head_dim)
    _check(q, k, v, qd, kd, vd, cfg=cfg)


@requires_hopper
@pytest.mark.parametrize("seq_k", [4096, 3072], ids=["masked", "unmasked"])
def test_gpu_fp8_split_tail_of_a_partial_last_wave(seq_k):
    """5 heads x 33 query blocks = 165 equal-cost tiles of 16-22 key blocks of 192 keys, a partial last wave on any
    Hopper: their key blocks are cut into equal shares, one per thread block, and a tile cut between two blocks
    merges the other's partial at the tile's own descaled softmax scale (csrc/sm90/split_tail.cuh); a key length
    inside a block (the masked variant) and a multiple of it."""
    _check(*_inputs(13, 1, 4224, seq_k, 5, 5))


@requires_hopper
@pytest.mark.parametrize("seq_k,causal", [(4100, False), (3072, True)], ids=["masked", "causal"])
def test_gpu_fp8_head_dim_256_many_tiles_per_block(seq_k, causal):
    """Head dim 256 (64-key blocks, Q read into registers once per tile, one Q buffer): 3 heads x 66 query blocks =
    198 tiles, more than the SMs of any Hopper, so thread blocks run several tiles each and the next tile's Q lands
    in the buffer the last one left, over up to 48 (causal) or 65 key blocks."""
    _check(*_inputs(14, 1, 8448, seq_k, 3, 3, head_dim=256), causal=causal)


@requires_hopper
@pytest.mark.parametrize("head_dim", [128, 256])
def test_gpu_fp8_kernel_long_rows_and_vmap(head_dim):
    """Many key blocks per row (the online rescale over 16384 keys), and vmap folding into the batch."""
    q, k, v, qd, kd, vd = _inputs(6, 1, 256, 16384, 2, 1, head_dim=head_dim)
    _check(q, k, v, qd, kd, vd, causal=True)
    small = _inputs(7, 2, 64, 96, 2, 2, head_dim=head_dim)
    call = lambda q, k, v, qd, kd, vd: jax_flash.attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
    mapped = jax.jit(jax.vmap(call))(*(jnp.stack([x, x]) for x in small))
    np.testing.assert_array_equal(np.asarray(mapped[1], np.float32), np.asarray(call(*small), np.float32))
    hlo = jax.jit(call).lower(*small).as_text()
    assert "jax_flash_attention_fp8" in hlo


def _sink_inputs(device, head_dim, sink_at, seq_k=16384, gap=10.0):
    """Four query rows that see one key (sink_at) about `gap` nats above the other keys, whose scores lie within
    0.2 nats of 0 (an attention sink over a long context: the flat tail holds about 45% of the mass at 10 nats), the
    tail's values near 1 and the sink's -3, so the output shows how much of the tail survives P's rounding. Unit
    descales."""
    keys = jax.random.split(jax.random.PRNGKey(sink_at + head_dim), 3)
    q = jnp.zeros((1, 4, 2, head_dim), jnp.float32).at[..., 0].set(16.0)
    k = jax.random.normal(keys[0], (1, seq_k, 2, head_dim))
    k = k.at[..., 0].multiply(0.1).at[:, sink_at, :, 0].set(gap * np.sqrt(head_dim) / 16.0)
    v = (1.0 + 0.5 * jax.random.normal(keys[1], (1, seq_k, 2, head_dim))).at[:, sink_at].set(-3.0)
    ones = jnp.ones((1, 2), jnp.float32)
    return [jax.device_put(x, device) for x in (*(t.astype(jnp.float8_e4m3fn) for t in (q, k, v)), ones, ones, ones)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("hopper", marks=requires_hopper)])
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("sink_at", [0, 8197], ids=["first", "middle"])
def test_fp8_keeps_the_tail_behind_an_attention_sink(device, head_dim, sink_at):
    """The tail's probabilities, about 2^-14 of the sink's each, are not lost to e4m3's range: P is rounded at 2^8
    times the running maximum, and the running maximum is the row's own once the sink has been seen (moving it
    lazily, with P's scale lowered to make room, flushes such tails: tools/fp8_p_rounding.py's model of the kernel
    puts these outputs 0.18-0.43 off, 20-70x the bound). The CPU path computes FP8 in float32 (no P rounding), so
    there it checks the inputs' construction against the same bound."""
    where = jax.devices("cpu")[0] if device == "cpu" else HOPPER[0]
    _check(*_sink_inputs(where, head_dim, sink_at))


def _flat_inputs(device, head_dim, seq_k):
    """Four query rows whose scores lie within about 0.4 nats of each other over `seq_k` keys, values 1 + N(0, 0.5^2):
    every product P V of a row is about the same size and sign, so its O grows about seq_k times above each one."""
    keys = jax.random.split(jax.random.PRNGKey(seq_k + head_dim), 2)
    q = jnp.zeros((1, 4, 2, head_dim), jnp.float32).at[..., 0].set(16.0)
    k = jax.random.normal(keys[0], (1, seq_k, 2, head_dim)).at[..., 0].multiply(0.1)
    v = 1.0 + 0.5 * jax.random.normal(keys[1], (1, seq_k, 2, head_dim))
    ones = jnp.ones((1, 2), jnp.float32)
    return [jax.device_put(x, device) for x in (*(t.astype(jnp.float8_e4m3fn) for t in (q, k, v)), ones, ones, ones)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("hopper", marks=requires_hopper)])
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("seq_k", [1000, 16384])
def test_fp8_long_flat_rows_keep_their_sum(device, head_dim, seq_k):
    """A long row of like products: the FP8 wgmma's accumulator keeps about 13-14 bits aligned to its largest
    term, so O summed there over every key block loses the products once O is far above them (28% of O at 16384
    keys, H200). The kernel sums each key block's P V apart and adds the blocks in fp32 (csrc/sm90/mainloop.cuh,
    fold_pv)."""
    where = jax.devices("cpu")[0] if device == "cpu" else HOPPER[0]
    _check(*_flat_inputs(where, head_dim, seq_k))


@requires_hopper
def test_gpu_fp8_calls_the_kernel_does_not_take():
    """Head dim 64 and a softcap run the 16-bit kernels on the dequantised inputs; the result is the same
    attention."""
    q, k, v, qd, kd, vd = _inputs(8, 2, 100, 150, 4, 2, head_dim=64)
    out = jax_flash.attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, causal=True)
    ref = jax_flash.attention_reference(*_dequantised(q, k, v, qd, kd, vd), causal=True)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=3e-2, rtol=3e-2)
