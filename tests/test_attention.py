"""Correctness grid: jax_flash.attention against jax.nn.dot_product_attention and the fp32 reference, on CPU always
and on the GPU when one is visible."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from conftest import GPU_DEVICES, assert_flash_close, random_qkv, requires_gpu

DTYPES = [jnp.float16, jnp.bfloat16]
HEAD_DIMS = [64, 128]
SEQ_PAIRS = [(1, 1), (17, 17), (128, 128), (129, 129), (113, 203), (203, 113), (1, 1025), (1023, 1025)]
HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("seq_q,seq_k", SEQ_PAIRS)
@pytest.mark.parametrize("heads_q,heads_k", HEADS)
def test_matches_reference(device, dtype, head_dim, seq_q, seq_k, heads_q, heads_k):
    q, k, v = random_qkv(seq_q * 7 + seq_k, 2, seq_q, seq_k, heads_q, heads_k, head_dim, dtype, device)
    out = jax.jit(jax_flash.attention)(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert out.devices() == {device}
    assert_flash_close(out, q, k, v)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("seq", [17, 256])
def test_matches_jax_nn(device, dtype, seq):
    q, k, v = random_qkv(3, 2, seq, seq, 8, 2, 64, dtype, device)
    out = jax.jit(jax_flash.attention)(q, k, v).astype(jnp.float32)
    expected = jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
    tol = 2e-2 if dtype == jnp.bfloat16 else 4e-3
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=tol, rtol=0)


def test_cpu_float32_any_head_dim():
    for head_dim in (1, 8, 48, 80, 200):
        q, k, v = random_qkv(head_dim, 1, 33, 70, 2, 1, head_dim, jnp.float32, jax.devices("cpu")[0])
        assert_flash_close(jax_flash.attention(q, k, v), q, k, v)


def test_eager_equals_jit(device):
    q, k, v = random_qkv(5, 1, 100, 130, 4, 4, 64, jnp.bfloat16, device)
    np.testing.assert_array_equal(np.asarray(jax_flash.attention(q, k, v)),
                                  np.asarray(jax.jit(jax_flash.attention)(q, k, v)))


def test_vmap_over_q_and_over_qkv(device):
    q, k, v = random_qkv(7, 3, 40, 50, 4, 2, 64, jnp.float16, device)
    qs = jnp.stack([q, q * 0.5])
    out_q = jax.jit(jax.vmap(jax_flash.attention, in_axes=(0, None, None)))(qs, k, v)
    loop_q = jnp.stack([jax_flash.attention(qs[i], k, v) for i in range(2)])
    np.testing.assert_array_equal(np.asarray(out_q), np.asarray(loop_q))
    ks, vs = jnp.stack([k, -k]), jnp.stack([v, v * 2])
    out_all = jax.vmap(jax_flash.attention, in_axes=(1, 1, 1), out_axes=1)(
        jnp.moveaxis(qs, 0, 1), jnp.moveaxis(ks, 0, 1), jnp.moveaxis(vs, 0, 1))
    loop_all = jnp.stack([jax_flash.attention(qs[i], ks[i], vs[i]) for i in range(2)], axis=1)
    np.testing.assert_array_equal(np.asarray(out_all), np.asarray(loop_all))


def test_zero_size_inputs(device):
    for shape_q, shape_k in [((0, 16, 2, 64), (0, 16, 2, 64)), ((2, 0, 2, 64), (2, 16, 2, 64)),
                             ((2, 16, 0, 64), (2, 16, 0, 64))]:
        q = jax.device_put(jnp.ones(shape_q, jnp.float16), device)
        k = jax.device_put(jnp.ones(shape_k, jnp.float16), device)
        out = jax.jit(jax_flash.attention)(q, k, k)
        assert out.shape == shape_q
    q = jax.device_put(jnp.ones((2, 5, 2, 64), jnp.float16), device)
    kv = jax.device_put(jnp.ones((2, 0, 2, 64), jnp.float16), device)
    np.testing.assert_array_equal(np.asarray(jax_flash.attention(q, kv, kv)), 0)  # no keys: zeros


@requires_gpu
def test_every_compiled_config_is_correct():
    device = GPU_DEVICES[0]
    for kernel in jax_flash.supported_configs():
        dtype = jnp.dtype(kernel.dtype)
        q, k, v = random_qkv(kernel.head_dim, 2, 257, 301, 4, 2, kernel.head_dim, dtype, device)
        fn = jax.jit(jax_flash.attention, static_argnames=("cfg", "causal", "window", "softcap", "return_lse"))
        assert_flash_close(fn(q, k, v, cfg=kernel.config), q, k, v)
        # the plain variant (no block masking: the key count is a multiple of every block_kv), with a NaN key that
        # must reach the rows that see it
        q2, k2, v2 = random_qkv(kernel.head_dim + 1, 1, 1920, 1920, 2, 2, kernel.head_dim, dtype, device)
        assert_flash_close(fn(q2, k2, v2, cfg=kernel.config), q2, k2, v2)
        out = np.asarray(fn(q2, k2.at[0, 1000, 1, 5].set(jnp.nan), v2, cfg=kernel.config).astype(jnp.float32))
        assert np.isnan(out[0, :, 1]).all() and np.isfinite(out[0, :, 0]).all(), kernel
        # the masked + softcap variant, with padding lengths
        lengths = dict(q_lengths=jax.device_put(jnp.asarray([257, 100], jnp.int32), device),
                       kv_lengths=jax.device_put(jnp.asarray([290, 301], jnp.int32), device))
        out = fn(q, k, v, cfg=kernel.config, causal=True, window=(77, -1), softcap=10.0, **lengths)
        assert_flash_close(out, q, k, v, causal=True, window=(77, -1), softcap=10.0, **lengths)


@requires_gpu
@pytest.mark.parametrize("seq_k", [80, 81, 160, 241])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dim_256_many_short_tiles(seq_k, causal):
    """Head dim 256 on Hopper stages each tile's O in the K / V stage of its last key block and releases that stage
    once O is stored (csrc/sm90/traits.cuh, kOInKV): about four tiles per thread block, of 1-4 key blocks of 80
    keys each, so that stage alternates between tiles and each tile's next Q lands while O is stored; causal and
    not (the two tiles cfg=None takes), and kv lengths that cut tiles short or leave rows no key. Without a right
    bound a last block of at most 48 visible keys (81 and 241 keys, and many of the lengths) is computed narrow and
    first (kNarrowKeys), and O then goes to the stage of the tile's first block."""
    device = GPU_DEVICES[0]
    q, k, v = random_qkv(seq_k + causal, 32, 200, seq_k, 8, 8, 256, jnp.bfloat16, device)
    fn = jax.jit(jax_flash.attention, static_argnames=("causal",))
    assert_flash_close(fn(q, k, v, causal=causal), q, k, v, causal=causal)
    lengths = jnp.asarray(np.arange(32) * 7 % (seq_k + 1), jnp.int32)  # 0 .. seq_k
    out = fn(q, k, v, causal=causal, kv_lengths=jax.device_put(lengths, device))
    assert_flash_close(out, q, k, v, causal=causal, kv_lengths=lengths)


@requires_gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_split_tail_of_a_partial_last_wave(dtype):
    """Equal-cost head-dim-128 tiles whose last wave is partial (5 heads x 33 query blocks = 165 tiles over at most
    132 SMs, 16 key blocks each): on Hopper their key blocks are cut into equal shares, one per thread block, and a
    tile cut between two blocks is merged from the other's partial (csrc/sm90/split_tail.cuh)."""
    q, k, v = random_qkv(5, 1, 4224, 2048, 5, 5, 128, dtype, GPU_DEVICES[0])
    assert_flash_close(jax.jit(jax_flash.attention)(q, k, v), q, k, v)


@requires_gpu
def test_gpu_agrees_with_cpu():
    q, k, v = random_qkv(11, 2, 300, 300, 4, 4, 128, jnp.bfloat16)
    cpu_out = jax_flash.attention(*(jax.device_put(x, jax.devices("cpu")[0]) for x in (q, k, v)))
    gpu_out = jax_flash.attention(*(jax.device_put(x, GPU_DEVICES[0]) for x in (q, k, v)))
    np.testing.assert_allclose(np.asarray(gpu_out.astype(jnp.float32)), np.asarray(cpu_out.astype(jnp.float32)),
                               atol=2e-2, rtol=0)
