"""Decoding against a KV cache: split-KV (forced and planned split counts, merged by the log-sum-exp), packed GQA
heads and paged K/V, against the fp32 reference, on CPU always and on the GPU when one is visible."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from conftest import GPU_DEVICES, assert_flash_close, random_qkv, requires_gpu
from jax_flash.reference import gather_pages

KernelConfig = jax_flash.KernelConfig


def _hopper():
    return bool(GPU_DEVICES) and str(getattr(GPU_DEVICES[0], "compute_capability", "")).startswith("9")


requires_hopper = pytest.mark.skipif(not _hopper(), reason="the sm90 family needs an sm_90 GPU (H100/H200)")


def _decode_cfg(device, head_dim, **launch):
    """The launch fields on the device's decode tile: the CPU path's 64 x 64 tiles, or the sm80 family's smallest
    decode tile for head_dim."""
    if device.platform == "cpu":
        return KernelConfig(block_q=64, block_kv=64, **launch)
    tile = min(jax_flash.config.DECODE_CONFIGS[head_dim], key=lambda c: c.block_q)
    return dataclasses.replace(tile, **launch)


def paged_cache(k, v, page_size, seed, spare_pages=3):
    """k, v (B, S, Hk, D) as shuffled pages (num_pages, page_size, Hk, D) and an int32 (B, ceil(S / page_size))
    page table; the pages past the data hold NaN, unused entries -1 never appear (every page is used)."""
    batch, seq = k.shape[0], k.shape[1]
    per_seq = -(-seq // page_size)
    pad = ((0, 0), (0, per_seq * page_size - seq), (0, 0), (0, 0))
    rng = np.random.RandomState(seed)
    num_pages = batch * per_seq + spare_pages
    table = rng.permutation(num_pages)[:batch * per_seq].reshape(batch, per_seq).astype(np.int32)

    def pages(x):
        blocks = jnp.pad(x, pad).reshape((batch * per_seq, page_size, *x.shape[2:]))
        pool = jnp.full((num_pages, page_size, *x.shape[2:]), jnp.nan, x.dtype)
        return pool.at[table.reshape(-1)].set(blocks)

    return pages(k), pages(v), jnp.asarray(table)


# ---- split-KV and packed GQA ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("seq_q", [1, 2, 7, 8, 16])
@pytest.mark.parametrize("heads_q,heads_k", [(4, 4), (8, 2), (8, 1), (32, 4)])
def test_decode_grid(device, seq_q, heads_q, heads_k):
    """Planned splits and packing (cfg=None), causal (speculative decoding's few rows at the end of the cache)."""
    if device.platform == "cpu" and seq_q in (2, 8):
        pytest.skip("the CPU path's tiles do not depend on Sq below 16: Sq 1, 7 and 16 cover it (the GPU runs all)")
    seq_k = 1000 if device.platform == "cpu" else 4097
    q, k, v = random_qkv(seq_q * 13 + heads_k, 2, seq_q, seq_k, heads_q, heads_k, 64, jnp.bfloat16, device)
    lengths = jnp.array([seq_k, seq_k // 3], jnp.int32)
    out, lse = jax.jit(lambda q, k, v, n: jax_flash.attention(q, k, v, causal=True, kv_lengths=n, return_lse=True))(
        q, k, v, lengths)
    assert_flash_close(out, q, k, v, causal=True, kv_lengths=lengths)
    _, ref_lse = jax_flash.attention_reference(q, k, v, causal=True, kv_lengths=lengths, return_lse=True)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=2e-2, rtol=0)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 16, 256])
@pytest.mark.parametrize("pack_gqa", [False, True])
def test_every_split_count_gives_the_unsplit_result(device, num_splits, pack_gqa):
    """Forced split counts, packed or not, with causal, a window, softcap and both lengths: equal within tolerance,
    and the merged lse equals the unsplit lse."""
    q, k, v = random_qkv(num_splits, 2, 5, 777, 8, 2, 128, jnp.float16, device)
    kwargs = dict(causal=True, window=(500, -1), softcap=30.0, q_lengths=jnp.array([5, 3], jnp.int32),
                  kv_lengths=jnp.array([777, 400], jnp.int32))
    cfg = _decode_cfg(device, 128, num_splits=num_splits, pack_gqa=pack_gqa)
    out, lse = jax_flash.attention(q, k, v, cfg, return_lse=True, **kwargs)
    assert_flash_close(out, q, k, v, **kwargs)
    _, lse_one = jax_flash.attention(q, k, v, _decode_cfg(device, 128, num_splits=1), return_lse=True, **kwargs)
    lse, lse_one = np.asarray(lse), np.asarray(lse_one)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_one))  # padded rows: -inf in both
    finite = np.isfinite(lse_one)
    np.testing.assert_allclose(lse[finite], lse_one[finite], atol=1e-3, rtol=0)


def test_split_plan():
    """The CUDA handler's plan (common/split_plan.h). Decode tiles: four resident blocks per SM, never more blocks
    than fit at once, ranges of at least 4 key blocks (32 on tiles on half the SMs or more; 1 MiB of K / V where
    there are two), at most MAX_SPLITS, one block per SM for key blocks of 64 KiB; the 128-row tiles: least waves x
    (key blocks per range + 1)."""
    from jax_flash._jax_flash import split_plan

    sms = 132
    decode = lambda tiles, per_sm, key_blocks: split_plan(tiles, per_sm * sms, sms, key_blocks, True, 32 << 10)
    wide = lambda tiles, per_sm, key_blocks: split_plan(tiles, per_sm * sms, sms, key_blocks, True, 64 << 10)
    assert wide(1, 2, 1024) == sms             # one MQA tile of 131072 keys (128-key blocks at D = 128)
    assert wide(8, 2, 128) == 16               # 8 x 16384 keys: one block per SM, not two
    assert wide(64, 2, 32) == 2                # 64 x 4096 keys: two ranges of 1 MiB each
    assert wide(64, 2, 8) == 1                 # ... but not of 256 KiB
    assert wide(128, 2, 8) == 1 and wide(256, 2, 1024) == 1
    assert decode(8, 6, 2048) == 66            # 32/8 heads, 131072 keys: 528 one-warp blocks
    assert decode(64, 6, 256) == 8             # 32/8 heads, B = 8, 16384 keys
    assert decode(1024, 6, 16) == 1            # enough tiles already
    assert decode(64, 2, 256) == 4             # the masked four-warp tile: two per SM, 256 blocks, not 576
    assert decode(128, 2, 256) == 2            # two long ranges
    assert decode(128, 2, 16) == 1             # ... but not two short ones
    assert decode(128, 3, 16) == 1             # tiles on half the SMs or more: no range under 32 key blocks
    assert decode(128, 6, 256) == 4
    assert decode(64, 6, 64) == 8              # fewer tiles: ranges of 8 key blocks
    assert decode(1, 3, 2048) == jax_flash.config.MAX_SPLITS  # one MQA tile: as many as allowed
    assert decode(8, 3, 256) == 49             # 396 blocks fit
    assert decode(1, 2, 512) == 128            # ranges of at least 4 key blocks
    assert decode(8, 6, 7) == 1 and decode(0, 6, 100) == 1
    for tiles in (1, 3, 8, 50, 200, 600):
        for per_sm in (1, 2, 3, 6):
            for key_blocks in (1, 8, 100, 5000):
                n = decode(tiles, per_sm, key_blocks)
                assert 1 <= n <= jax_flash.config.MAX_SPLITS
                assert n == 1 or (tiles * n <= min(4, per_sm) * sms and key_blocks // n >= 4)
                assert n == 1 or 2 * tiles < sms or key_blocks // n >= 32
    wave = lambda tiles, slots, key_blocks: split_plan(tiles, slots, sms, key_blocks, False, 0)
    assert wave(8, 2 * sms, 1024) == 32        # least waves x (range + 1): one wave of 32 key blocks per range
    assert wave(16, sms, 128) == 8             # the sm90 packed MQA tile, 8 rows: 128 blocks, not FA3's 7 (112)
    assert wave(8, sms, 128) == 16             # ... 4 rows
    assert wave(32, sms, 1024) == 4            # chunked prefill, 8/8 heads x 512 x 131072 keys
    assert wave(128, sms, 1024) == 1           # 32/8 heads: one wave of 128 tiles already
    assert wave(4 * 2 * sms, 2 * sms, 1024) == 1 and wave(8, sms, 7) == 1
    for tiles in (1, 5, 16, 100, 300):
        for key_blocks in (4, 9, 128, 1000):
            n = wave(tiles, sms, key_blocks)
            assert 1 <= n <= jax_flash.config.MAX_SPLITS and (n == 1 or key_blocks // n >= 4)


def test_fixed_split_count_is_bitwise_deterministic(device):
    q, k, v = random_qkv(11, 3, 1, 3000, 16, 2, 64, jnp.bfloat16, device)
    fn = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, _decode_cfg(device, 64, num_splits=5), return_lse=True))
    first = [np.asarray(x) for x in fn(q, k, v)]
    for _ in range(3):
        again = [np.asarray(x) for x in fn(q, k, v)]
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("group", [1, 4, 8, 32])
def test_gqa_ratios_packed(device, group):
    heads_k = 2 if group < 32 else 1
    q, k, v = random_qkv(group, 2, 3, 513, group * heads_k, heads_k, 64, jnp.float16, device)
    for pack in (False, True):
        out = jax_flash.attention(q, k, v, _decode_cfg(device, 64, pack_gqa=pack), causal=True)
        assert_flash_close(out, q, k, v, causal=True)


def test_short_and_long_sequences_in_one_batch(device):
    """Lengths 1 and 131072 (GPU; 32768 on CPU) in one batch, and a zero-length sequence: zeros and lse -inf."""
    seq_k = 131072 if device.platform == "gpu" else 32768
    q, k, v = random_qkv(5, 3, 1, seq_k, 8, 1, 64, jnp.bfloat16, device)
    lengths = jnp.array([1, seq_k, 0], jnp.int32)
    out, lse = jax.jit(lambda q, k, v, n: jax_flash.attention(q, k, v, kv_lengths=n, return_lse=True))(q, k, v, lengths)
    out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
    assert (out[2] == 0).all() and np.isneginf(lse[2]).all()
    assert_flash_close(out[:2], q[:2], k[:2], v[:2], kv_lengths=lengths[:2])
    ref = np.asarray(jax.device_get(v[0, 0]).astype(np.float32))  # one key: the output is that key's value
    np.testing.assert_allclose(out[0, 0], np.broadcast_to(ref, out[0, 0].shape), atol=1e-2)


def test_split_merge_keeps_nan_and_infinite_rows(device):
    """A NaN in one range's keys makes its rows NaN after the merge (never a silently finite row)."""
    q, k, v = random_qkv(2, 1, 1, 2048, 4, 1, 64, jnp.float16, device)
    k = k.at[0, 1500, 0, 3].set(jnp.nan)
    out, lse = jax_flash.attention(q, k, v, _decode_cfg(device, 64, num_splits=4), return_lse=True)
    assert np.isnan(np.asarray(out.astype(jnp.float32))).all() and np.isnan(np.asarray(lse)).all()


# ---- paged KV cache -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [8, 16, 24, 64, 256])
def test_paged_equals_contiguous(device, page_size):
    """Shuffled pages (the unused ones NaN), table entries past each length set to -1, every feature at once."""
    q, k, v = random_qkv(page_size, 3, 4, 600, 8, 2, 64, jnp.bfloat16, device)
    k_pages, v_pages, table = paged_cache(k, v, page_size, seed=page_size)
    lengths = jnp.array([600, 333, 1], jnp.int32)
    needed = -(-lengths // page_size)
    table = jnp.where(jnp.arange(table.shape[1])[None, :] < needed[:, None], table, -1)
    kwargs = dict(causal=True, window=(300, -1), softcap=20.0, kv_lengths=lengths, q_lengths=jnp.array([4, 2, 1],
                                                                                                        jnp.int32))
    out, lse = jax.jit(lambda *a: jax_flash.attention(a[0], a[1], a[2], page_table=a[3], return_lse=True, **kwargs))(
        q, k_pages, v_pages, table)
    k_flat, v_flat = (x[:, :600] for x in (gather_pages(k_pages, table), gather_pages(v_pages, table)))
    expected, expected_lse = jax_flash.attention(q, k_flat, v_flat, return_lse=True, **kwargs)
    assert_flash_close(out, q, k, v, **kwargs)
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), np.asarray(expected.astype(jnp.float32)),
                               atol=2e-2, rtol=0)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(expected_lse), atol=1e-3, rtol=0)


@pytest.mark.parametrize("num_splits,pack_gqa", [(1, False), (3, True), (8, True)])
def test_paged_with_splits_and_packing(device, num_splits, pack_gqa):
    q, k, v = random_qkv(num_splits, 2, 2, 1000, 16, 4, 128, jnp.float16, device)
    k_pages, v_pages, table = paged_cache(k, v, 64, seed=num_splits)
    cfg = _decode_cfg(device, 128, num_splits=num_splits, pack_gqa=pack_gqa)
    lengths = jnp.array([1000, 999], jnp.int32)
    out = jax_flash.attention(q, k_pages, v_pages, cfg, page_table=table, kv_lengths=lengths)
    assert_flash_close(out, q, k, v, kv_lengths=lengths)


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("page_size", [16, 40, 128])
@pytest.mark.parametrize("seq_q", [1, 8])
def test_paged_tiles_and_page_sizes(device, head_dim, page_size, seq_q):
    """Pages smaller than a key block, not dividing it, and holding whole blocks, on the decode tiles of 1 row x 4
    heads and 8 x 4 (D = 128: the 32-row tile both; D = 256: the one-warp and the 64-row tile); a page id past the
    pool for a visible key reads as zeros on the GPU and raises on CPU."""
    q, k, v = random_qkv(head_dim + page_size + seq_q, 2, seq_q, 700, 8, 2, head_dim, jnp.bfloat16, device)
    k_pages, v_pages, table = paged_cache(k, v, page_size, seed=page_size)
    lengths = jnp.array([700, 450], jnp.int32)
    attend = jax.jit(lambda *a: jax_flash.attention(a[0], a[1], a[2], page_table=a[3], kv_lengths=a[4], causal=True))
    out = attend(q, k_pages, v_pages, table, lengths)
    assert_flash_close(out, q, k, v, kv_lengths=lengths, causal=True)
    bad_table = table.at[1, 0].set(k_pages.shape[0])  # sequence 1's first page: out of range
    if device.platform == "cpu":
        with pytest.raises(Exception, match="page"):
            jax.block_until_ready(attend(q, k_pages, v_pages, bad_table, lengths))
        return
    zeroed = jnp.arange(700) >= page_size  # what the GPU reads for sequence 1: its first page as zeros
    k1, v1 = (jnp.where(zeroed[None, :, None, None], x, 0) for x in (k, v))
    out_bad = attend(q, k_pages, v_pages, bad_table, lengths)
    np.testing.assert_array_equal(np.asarray(out_bad[0]), np.asarray(out[0]))
    assert_flash_close(out_bad[1:], q[1:], k1[1:], v1[1:], kv_lengths=lengths[1:], causal=True)


def test_new_page_table_does_not_recompile(device):
    q, k, v = random_qkv(3, 2, 1, 256, 4, 2, 64, jnp.float16, device)
    k_pages, v_pages, table = paged_cache(k, v, 32, seed=0)
    traces = []

    @jax.jit
    def step(q, k_pages, v_pages, table, lengths):
        traces.append(1)
        return jax_flash.attention(q, k_pages, v_pages, page_table=table, kv_lengths=lengths)

    for i in range(3):
        rolled = jnp.roll(table, i, axis=0)
        out = step(q, k_pages, v_pages, rolled, jnp.array([256, 100 + i], jnp.int32))
        assert_flash_close(out, q, gather_pages(k_pages, rolled)[:, :256], gather_pages(v_pages, rolled)[:, :256],
                           kv_lengths=jnp.array([256, 100 + i], jnp.int32))
    assert len(traces) == 1


def test_vmap_over_paged_calls(device):
    q, k, v = random_qkv(9, 2, 1, 96, 4, 2, 64, jnp.float16, device)
    k_pages, v_pages, table = paged_cache(k, v, 16, seed=1)
    qs = jnp.stack([q, q * 0.5])
    shared = jax.vmap(lambda q: jax_flash.attention(q, k_pages, v_pages, page_table=table))(qs)
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(shared[i]),
                                      np.asarray(jax_flash.attention(qs[i], k_pages, v_pages, page_table=table)))
    pools = (jnp.stack([k_pages, -k_pages]), jnp.stack([v_pages, v_pages * 2]))
    mapped = jax.vmap(lambda k, v: jax_flash.attention(q, k, v, page_table=table))(*pools)
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(mapped[i]), np.asarray(
            jax_flash.attention(q, pools[0][i], pools[1][i], page_table=table)))


def test_out_of_range_page_id_is_a_clear_error_on_cpu():
    q, k, v = random_qkv(4, 2, 1, 64, 2, 1, 64, jnp.float32, jax.devices("cpu")[0])
    k_pages, v_pages, table = paged_cache(k, v, 16, seed=2)
    with pytest.raises(Exception, match=r"page_table\[1, 2\] = 99 names no page"):
        jax_flash.attention(q, k_pages, v_pages, page_table=table.at[1, 2].set(99)).block_until_ready()
    # ... but an entry past the sequence's length is never read
    out = jax_flash.attention(q, k_pages, v_pages, page_table=table.at[1, 2:].set(99),
                              kv_lengths=jnp.array([64, 32], jnp.int32))
    assert np.isfinite(np.asarray(out)).all()


# (seed, page seed, seq_q, seq_k, head_dim, page_size, bad table entry, cfg): the sm80 decode tile (cfg=None, one
# row; a block spanning pages, and a 128-key block of two 64-key pages whose second is bad) and the sm90 kernel
# (128 rows; Hopper only)
OUT_OF_RANGE_CASES = {"decode-tile": (4, 2, 1, 64, 64, 16, (0, 1), None),
                      "two-page-block": (5, 3, 1, 512, 128, 64, (0, 3), None),
                      "sm90": (6, 6, 128, 512, 128, 64, (0, 3), KernelConfig.sm90())}


@requires_gpu
@pytest.mark.parametrize("case", list(OUT_OF_RANGE_CASES))
def test_out_of_range_page_id_reads_zeros_on_gpu(case):
    seed, page_seed, seq_q, seq_k, head_dim, page_size, entry, cfg = OUT_OF_RANGE_CASES[case]
    if cfg is not None and not _hopper():
        pytest.skip("the sm90 family needs an sm_90 GPU (H100/H200)")
    q, k, v = random_qkv(seed, 1, seq_q, seq_k, 2, 1, head_dim, jnp.float16, GPU_DEVICES[0])
    k_pages, v_pages, table = paged_cache(k, v, page_size, seed=page_seed)
    bad = table.at[entry].set(12345)
    out = jax_flash.attention(q, k_pages, v_pages, cfg, page_table=bad)
    assert_flash_close(out, q, gather_pages(k_pages, bad), gather_pages(v_pages, bad))


@pytest.mark.parametrize("table,message", [
    (np.zeros((2, 4), np.int64), "int32 array of shape"),
    (np.zeros((2, 4, 1), np.int32), "int32 array of shape"),
    (np.zeros((3, 4), np.int32), "batch = 2"),
    ([[0, 1]], "must be a jax or numpy array"),
])
def test_bad_page_tables(table, message):
    q, k, v = random_qkv(1, 2, 1, 64, 2, 1, 64, jnp.float32)
    with pytest.raises((ValueError, TypeError), match=message):
        jax_flash.attention(q, k, v, page_table=table)


def test_page_size_must_be_a_multiple_of_8():
    q = jnp.ones((1, 1, 2, 64), jnp.float32)
    pages = jnp.ones((4, 12, 1, 64), jnp.float32)
    with pytest.raises(ValueError, match="page_size .* must be a positive multiple of 8.* got 12"):
        jax_flash.attention(q, pages, pages, page_table=jnp.zeros((1, 2), jnp.int32))


def test_launch_fields_are_checked():
    with pytest.raises(ValueError, match="num_splits=257 is not allowed"):
        KernelConfig(num_splits=257)
    with pytest.raises(TypeError, match="pack_gqa must be True, False or None"):
        KernelConfig(pack_gqa=1)
    assert KernelConfig(num_splits=4, pack_gqa=True).kernel() == KernelConfig()


def test_paged_prefill_routing():
    """cfg=None on a GPU (jax_flash/selection.py): a paged call of many rows per kv head takes the default path (the
    sm90 family on Hopper) at every head dim; decode rows stay on the decode tiles."""
    from jax_flash import config, selection

    def compiled(head_dim):
        return list(config.TUNED_CONFIGS[head_dim]) + list(config.DECODE_CONFIGS[head_dim]) + list(
            config.SM90_CONFIGS[head_dim])

    chunk = selection.CallShape(seq_q=512, seq_k=16384, group=4)
    for head_dim in (64, 128, 256):
        assert selection.decode_gpu_config(head_dim, chunk, compiled(head_dim)) is None
        choice = selection.default_gpu_config(90, "bfloat16", head_dim, compiled(head_dim), True, 16384)
        assert choice.family == "sm90", choice
    decode = selection.decode_gpu_config(128, dataclasses.replace(chunk, seq_q=1), compiled(128))
    assert decode.block_q == 32 and decode.block_kv == 128 and decode.pack_gqa


def test_decode_tile_routing():
    """cfg=None on a GPU, rows per kv head -> decode tile: up to 16 the one-warp tile (head dim 64; 128 has none),
    up to 32 the four-warp 32-row tile (128-key blocks, 64 at head dim 64 for pages of fewer than 64 keys), up to 64
    the 64-row tile."""
    from jax_flash import config, selection

    def pick(head_dim, seq_q, group, page_size=0):
        compiled = list(config.TUNED_CONFIGS[head_dim]) + list(config.DECODE_CONFIGS[head_dim])
        shape = selection.CallShape(seq_q=seq_q, seq_k=4096, group=group, page_size=page_size)
        choice = selection.decode_gpu_config(head_dim, shape, compiled)
        assert choice.pack_gqa == (group > 1)
        return choice.block_q, choice.block_kv, choice.num_warps

    assert pick(64, 1, 8) == pick(64, 16, 1) == (16, 64, 1)
    assert pick(128, 1, 8) == pick(128, 16, 1) == pick(128, 1, 1, 64) == (32, 128, 4)
    for head_dim in (64, 128):
        assert pick(head_dim, 1, 32) == pick(head_dim, 8, 4) == pick(head_dim, 1, 32, 256) == (32, 128, 4)
        assert pick(head_dim, 2, 32) == (64, 64, 4)
    assert pick(64, 1, 32, 64) == pick(64, 1, 32, 128) == (32, 128, 4)  # (64-key pages: two per block)
    assert pick(64, 1, 32, 32) == pick(64, 1, 32, 16) == pick(64, 1, 32, 24) == (32, 64, 4)
    assert pick(128, 1, 32, 64) == pick(128, 1, 32, 16) == (32, 128, 4)


def test_short_sequence_routing():
    """cfg=None on sm_90, head dim 64: 65-128 and 193-256 query rows without a right bound take the 128-row sm90 tile
    (BERT's 128 tokens, ViT's 197), with 208-key blocks for 193-208 keys (one block covers them), other lengths and
    causal calls the 192-row one."""
    from jax_flash import config, selection

    compiled = list(config.TUNED_CONFIGS[64]) + list(config.SM90_CONFIGS[64])
    pick = lambda seq, causal=False, seq_k=None: selection.default_gpu_config(
        90, "bfloat16", 64, compiled, causal, seq if seq_k is None else seq_k, False, seq)
    one_block = config.SM90_CONFIGS[64][3]
    assert one_block.block_kv == 208 and one_block.block_q == 128
    assert pick(193) == pick(197) == pick(208) == pick(256, seq_k=200) == pick(100, seq_k=197) == one_block
    assert pick(65) == pick(128) == pick(209) == pick(256) == pick(197, seq_k=256) == config.SM90_CONFIGS[64][0]
    assert pick(64) == pick(129) == pick(192) == pick(257) == pick(577) == pick(128, causal=True) == \
        pick(197, causal=True) == pick(300, seq_k=197) == config.SM90_CONFIGS[64][2]
    without = [cfg for cfg in compiled if cfg != one_block]  # a build without it: the 128-key blocks
    assert selection.default_gpu_config(90, "bfloat16", 64, without, False, 197, False, 197) == config.SM90_CONFIGS[64][0]


def test_sm90_packed_routing():
    """cfg=None on a GPU: on sm_90, more than 64 rows per kv head once packed that fill 128-row tiles better packed
    (MQA with a few rows per sequence) take the sm90 family packed, for groups dividing 64; not on other GPUs, not
    with tensors, not for decode rows (the decode tiles) nor for rows that fill tiles unpacked."""
    from jax_flash import config, selection

    compiled = list(config.TUNED_CONFIGS[128]) + list(config.DECODE_CONFIGS[128]) + list(config.SM90_CONFIGS[128])
    mqa = selection.CallShape(seq_q=8, seq_k=32768, group=32, kv_bytes=2 * 32768 * 128 * 2)  # 16 MiB
    choice = selection.sm90_packed_config(90, "bfloat16", 128, mqa, compiled, True)
    assert choice == dataclasses.replace(config.SM90_CONFIGS[128][0], pack_gqa=True)
    assert selection.sm90_packed_config(80, "bfloat16", 128, mqa, compiled, True) is None
    for shape in (dataclasses.replace(mqa, tensors=True), dataclasses.replace(mqa, segments=True),
                  dataclasses.replace(mqa, seq_q=1),  # 32 rows
                  dataclasses.replace(mqa, group=12), dataclasses.replace(mqa, seq_q=512, group=4),  # 12; full tiles
                  dataclasses.replace(mqa, seq_q=None), dataclasses.replace(mqa, kv_bytes=2**24 - 1)):
        assert selection.sm90_packed_config(90, "bfloat16", 128, shape, compiled, True) is None, shape


@requires_gpu
def test_gpu_decode_routes_to_the_packed_decode_tile():
    """cfg=None on a decode shape lowers to the sm80 family's 32-row decode tile with pack_gqa (in the FFI
    attributes)."""
    q, k, v = random_qkv(1, 2, 1, 1024, 32, 8, 128, jnp.bfloat16, GPU_DEVICES[0])
    text = jax.jit(jax_flash.attention).lower(q, k, v).as_text()
    assert "block_q = 32" in text and "block_kv = 128" in text and "pack_gqa = 1" in text, text[-2000:]


DECODE_CASES = [(head_dim, cfg) for head_dim in (64, 128) for cfg in jax_flash.config.DECODE_CONFIGS[head_dim]]


@requires_gpu
@pytest.mark.parametrize("head_dim,cfg", DECODE_CASES, ids=[f"d{d}-{c.short_name()}" for d, c in DECODE_CASES])
@pytest.mark.parametrize("num_splits,page_size,tensors", [(1, None, False), (3, 16, False), (2, 64, False),
                                                          (1, None, True)])
def test_every_decode_tile(head_dim, cfg, num_splits, page_size, tensors):
    """Every sm80 decode tile, the ones whose warps split each key block included (merged per row group): packed
    24 rows per kv head (a 16-row tile's second tile half full), causal with a window, softcap, both lengths, split
    ranges, 16- and 64-key pages, or a mask tensor and segment ids."""
    q, k, v = random_qkv(head_dim + num_splits, 2, 3, 1000, 32, 4, head_dim, jnp.float16, GPU_DEVICES[0])
    kwargs = dict(causal=True, window=(700, -1), softcap=25.0, q_lengths=jnp.array([3, 2], jnp.int32),
                  kv_lengths=jnp.array([1000, 517], jnp.int32))
    if tensors:
        keep = jax.random.bernoulli(jax.random.PRNGKey(7), 0.8, (2, 1, 3, 1000))
        segments = (jnp.arange(1000) // 300).astype(jnp.int32)
        kwargs.update(mask=keep, q_segment_ids=jnp.full((2, 3), 3, jnp.int32),
                      kv_segment_ids=jnp.broadcast_to(segments, (2, 1000)))
    call = dataclasses.replace(cfg, num_splits=num_splits, pack_gqa=True)
    if page_size is None:
        out, lse = jax_flash.attention(q, k, v, call, return_lse=True, **kwargs)
    else:
        k_pages, v_pages, table = paged_cache(k, v, page_size, seed=page_size)
        out, lse = jax_flash.attention(q, k_pages, v_pages, call, page_table=table, return_lse=True, **kwargs)
    assert_flash_close(out, q, k, v, **kwargs)
    _, ref_lse = jax_flash.attention_reference(q, k, v, return_lse=True, **kwargs)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=2e-2, rtol=0)


# ---- the sm90 family: split key ranges and paged K/V (Hopper) -------------------------------------------------------
SM90_CASES = [(head_dim, cfg) for head_dim, cfgs in jax_flash.config.SM90_CONFIGS.items() for cfg in cfgs]
SM90_IDS = [f"d{d}-{c.short_name()}" for d, c in SM90_CASES]


@requires_hopper
@pytest.mark.parametrize("head_dim,cfg", SM90_CASES, ids=SM90_IDS)
@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_sm90_split_counts_give_the_unsplit_result(head_dim, cfg, num_splits):
    """Every shipped sm90 config, forced split counts, with causal, a window, softcap and both lengths (tiles whose
    ranges see nothing, ragged last key blocks): equal within tolerance, and the merged lse equals the unsplit lse."""
    gpu = GPU_DEVICES[0]
    q, k, v = random_qkv(num_splits + head_dim, 2, 300, 1500, 4, 2, head_dim, jnp.bfloat16, gpu)
    kwargs = dict(causal=True, window=(900, -1), softcap=30.0, q_lengths=jnp.array([300, 170], jnp.int32),
                  kv_lengths=jnp.array([1500, 777], jnp.int32))
    out, lse = jax_flash.attention(q, k, v, dataclasses.replace(cfg, num_splits=num_splits), return_lse=True, **kwargs)
    assert_flash_close(out, q, k, v, **kwargs)
    _, lse_one = jax_flash.attention(q, k, v, cfg, return_lse=True, **kwargs)
    lse, lse_one = np.asarray(lse), np.asarray(lse_one)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_one))
    finite = np.isfinite(lse_one)
    np.testing.assert_allclose(lse[finite], lse_one[finite], atol=1e-3, rtol=0)
    plain = jax_flash.attention(q, k, v, dataclasses.replace(cfg, num_splits=num_splits))  # unmasked, no softcap
    assert_flash_close(plain, q, k, v)


@requires_hopper
def test_sm90_planned_splits_fill_the_gpu_and_are_deterministic():
    """Few tiles and long keys (1 x 2 heads x 256 rows x 32768 keys: 4 tiles on 132 SMs): the plan splits them, and
    the same call gives the same bits every time."""
    gpu = GPU_DEVICES[0]
    q, k, v = random_qkv(3, 1, 256, 32768, 2, 1, 128, jnp.float16, gpu)
    fn = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, KernelConfig.sm90(), return_lse=True))
    first = [np.asarray(x) for x in fn(q, k, v)]
    assert_flash_close(jnp.asarray(first[0]), q, k, v)
    for _ in range(2):
        for a, b in zip(first, (np.asarray(x) for x in fn(q, k, v))):
            np.testing.assert_array_equal(a, b)


@requires_hopper
@pytest.mark.parametrize("head_dim,cfg", SM90_CASES, ids=SM90_IDS)
@pytest.mark.parametrize("page_size", [8, 16, 40, 64, 256])
def test_sm90_paged_equals_contiguous(head_dim, cfg, page_size):
    """Shuffled pages (the unused ones NaN), table entries past each length -1, causal with a window, softcap and
    both lengths, split and unsplit, on every shipped sm90 config: equal to the contiguous call. (8-key pages: a
    block of more boxes than warp 0 has lanes at head dim 256.)"""
    gpu = GPU_DEVICES[0]
    q, k, v = random_qkv(page_size + head_dim, 3, 200, 1000, 4, 2, head_dim, jnp.bfloat16, gpu)
    k_pages, v_pages, table = paged_cache(k, v, page_size, seed=page_size)
    lengths = jnp.array([1000, 555, 1], jnp.int32)
    needed = -(-lengths // page_size)
    table = jnp.where(jnp.arange(table.shape[1])[None, :] < needed[:, None], table, -1)
    kwargs = dict(causal=True, window=(600, -1), softcap=20.0, kv_lengths=lengths,
                  q_lengths=jnp.array([200, 120, 1], jnp.int32))
    for splits in (1, 3):
        run = dataclasses.replace(cfg, num_splits=splits)
        out, lse = jax.jit(lambda *a: jax_flash.attention(a[0], a[1], a[2], run, page_table=a[3], return_lse=True,
                                                          **kwargs))(q, k_pages, v_pages, table)
        expected, expected_lse = jax_flash.attention(q, k, v, run, return_lse=True, **kwargs)
        assert_flash_close(out, q, k, v, **kwargs)
        np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), np.asarray(expected.astype(jnp.float32)),
                                   atol=2e-2, rtol=0)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(expected_lse), atol=1e-3, rtol=0)


@requires_hopper
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_sm90_runs_paged_prefill(head_dim):
    """cfg=None sends a paged call of many rows to the sm90 family on Hopper; pack_gqa=True with a group that does
    not divide 64 is a clear error there."""
    q, k, v = random_qkv(1, 1, 512, 2048, 8, 2, head_dim, jnp.bfloat16, GPU_DEVICES[0])
    k_pages, v_pages, table = paged_cache(k, v, 64, seed=1)
    text = jax.jit(lambda *a: jax_flash.attention(a[0], a[1], a[2], page_table=a[3], causal=True)).lower(
        q, k_pages, v_pages, table).as_text()
    assert "family = 90" in text, text[-2000:]
    q12 = jnp.concatenate([q, q[:, :, :4]], axis=2)  # 12 query heads over 2 kv heads: a group of 6
    with pytest.raises(ValueError, match="packs groups of"):
        jax_flash.attention(q12, k, v, dataclasses.replace(jax_flash.config.SM90_CONFIGS[head_dim][0], pack_gqa=True))


@requires_hopper
@pytest.mark.parametrize("head_dim,cfg", SM90_CASES, ids=SM90_IDS)
@pytest.mark.parametrize("group,seq_q", [(2, 100), (4, 37), (8, 16), (32, 8), (64, 3), (32, 1), (32, 2)])
def test_sm90_packed_gqa(head_dim, cfg, group, seq_q):
    """Every shipped sm90 config packed (pack_gqa=True): causal with a window, softcap and both lengths (rows past
    q_lengths, a tile's last position split across tiles, tiles whose second consumer has no valid row: MQA with
    one or two rows), split and unsplit, contiguous and paged; the output and lse equal the unpacked call's, and
    plain (unmasked) packed attention is right too."""
    gpu = GPU_DEVICES[0]
    heads_k = 2 if group < 32 else 1
    q, k, v = random_qkv(group + seq_q + head_dim, 2, seq_q, 1000, group * heads_k, heads_k, head_dim, jnp.bfloat16,
                         gpu)
    kwargs = dict(causal=True, window=(600, -1), softcap=20.0, q_lengths=jnp.array([seq_q, seq_q // 2 + 1], jnp.int32),
                  kv_lengths=jnp.array([1000, 555], jnp.int32))
    _, lse_unpacked = jax_flash.attention(q, k, v, dataclasses.replace(cfg, pack_gqa=False), return_lse=True, **kwargs)
    lse_unpacked = np.asarray(lse_unpacked)
    finite = np.isfinite(lse_unpacked)
    k_pages, v_pages, table = paged_cache(k, v, 64, seed=group)
    for splits, paged in ((1, False), (3, False), (0, True)):
        run = dataclasses.replace(cfg, num_splits=splits, pack_gqa=True)
        pages = dict(page_table=table) if paged else {}
        out, lse = jax_flash.attention(q, k_pages if paged else k, v_pages if paged else v, run, return_lse=True,
                                       **pages, **kwargs)
        assert_flash_close(out, q, k, v, **kwargs)
        lse = np.asarray(lse)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_unpacked))
        np.testing.assert_allclose(lse[finite], lse_unpacked[finite], atol=1e-3, rtol=0)
    plain = jax_flash.attention(q, k, v, dataclasses.replace(cfg, pack_gqa=True))
    assert_flash_close(plain, q, k, v)


@requires_hopper
def test_sm90_packs_mqa_decode_rows():
    """cfg=None on Hopper lowers MQA with 8 rows per sequence (32 heads: 256 packed rows) to the sm90 family packed."""
    q, k, v = random_qkv(2, 2, 8, 16384, 32, 1, 128, jnp.bfloat16, GPU_DEVICES[0])  # 16 MiB of K/V
    text = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, causal=True)).lower(q, k, v).as_text()
    assert "family = 90" in text and "pack_gqa = 1" in text, text[-2000:]
    assert_flash_close(jax_flash.attention(q, k, v, causal=True), q, k, v, causal=True)


def test_decode_probe_tool(capsys):
    """tools/decode_probe.py times cfg=None, cuDNN and the forced tiles over contiguous and paged caches (on CPU:
    cuDNN reported as failed, every other implementation timed, all equal to cfg=None), and names a bad row."""
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).resolve().parent.parent / "tools" / "decode_probe.py"
    spec = importlib.util.spec_from_file_location("decode_probe", path)
    tool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tool  # (its dataclass resolves annotations through the module)
    spec.loader.exec_module(tool)
    timing = ["--rounds", "1", "--iters", "1", "--reps", "1", "--min-rep-ms", "0"]
    args = ["--rows", "fp32:64:4/1:2:1x128", "--tiles", "q32k128w4,sm90", "--splits", "0,2", "--page-size", "16"]
    lines = tool.main(args + timing) if jax.default_backend() == "cpu" else None
    if lines is not None:
        assert len(lines) == 1 and lines[0].startswith("fp32 D64 4/1 Sq2 1x128 r0")
        for name in ("none", "none_p16", "q32k128w4s0", "q32k128w4s2", "q32k128w4s0_p16", "q32k128w4s2_p16",
                     "sm90s0", "sm90s2", "sm90s2_p16"):
            assert f" {name}=" in lines[0], (name, lines[0])
        assert "failed: cudnn" in lines[0]
        assert float(lines[0].split("maxdiff ")[1].split(":")[0]) < 1e-5
        only_default = tool.main(["--rows", "fp32:64:4/1:2:1x128", "--tiles", ""] + timing)[0]
        assert " none=" in only_default and "q32k128w4" not in only_default and "sm90" not in only_default
    with pytest.raises(SystemExit, match="is not dtype:head_dim"):
        tool.main(["--rows", "bf16:128:32:1:1x4096"])
    with pytest.raises(SystemExit, match="not decode tiles of head dim 128"):
        tool.main(["--rows", "bf16:128:32/8:1:1x4096", "--tiles", "q16k64w1"])
    with pytest.raises(SystemExit, match="--tiles '' chooses none"):
        tool.main(["--rows", "bf16:128:32/8:1:1x4096", "--tiles", "", "--splits", "0,16"])
