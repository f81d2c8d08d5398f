"""Reliability checklist (docs/RELIABILITY.md): equivalences, determinism, extreme inputs, NaN containment,
handler-side errors, and edge shapes. CPU always; GPU when visible. The row numbers refer to the checklist."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash._primitive import attention_p
from conftest import GPU_DEVICES, assert_flash_close, random_qkv, requires_gpu


def bits(x):
    return np.asarray(x).view(np.uint16 if np.dtype(x.dtype).itemsize == 2 else np.uint32)


def test_eager_jit_donated_scan_are_bitwise_equal(device):  # row 17
    q, k, v = random_qkv(1, 2, 77, 131, 4, 2, 64, jnp.bfloat16, device)
    kwargs = dict(causal=True, softcap=20.0)
    eager = jax_flash.attention(q, k, v, **kwargs)
    jitted = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, **kwargs))(q, k, v)
    donated = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, **kwargs), donate_argnums=(0, 1, 2))(
        *(jnp.copy(x) for x in (q, k, v)))

    def body(carry, qkv):
        return carry, jax_flash.attention(*qkv, **kwargs)

    _, scanned = jax.lax.scan(body, 0, (q[None], k[None], v[None]))
    for other in (jitted, donated, scanned[0]):
        np.testing.assert_array_equal(bits(eager), bits(other))


def test_100_repeats_are_bitwise_equal(device):  # row 16
    q, k, v = random_qkv(2, 1, 129, 200, 2, 1, 128, jnp.float16, device)
    fn = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, return_lse=True))
    out0, lse0 = fn(q, k, v)
    for _ in range(100):
        out, lse = fn(q, k, v)
        np.testing.assert_array_equal(bits(out), bits(out0))
        np.testing.assert_array_equal(bits(lse), bits(lse0))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_extreme_logits(device, dtype):  # row 12
    q, k, v = random_qkv(3, 1, 96, 160, 2, 2, 64, dtype, device)
    q50 = (q.astype(jnp.float32) * 50).astype(dtype)  # scores ~ 50x larger: softmax close to one-hot
    out = jax_flash.attention(q50, k, v)
    assert_flash_close(out, q50, k, v)
    k_equal = jnp.broadcast_to(k[:, :1], k.shape)  # every key identical: all logits of a row equal
    out = jax_flash.attention(q, k_equal, v)
    expected = jnp.broadcast_to(v.astype(jnp.float32).mean(axis=1, keepdims=True), q.shape)
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), np.asarray(expected), atol=2e-2, rtol=0)


def test_nan_stays_in_the_rows_that_see_it(device):  # row 13
    q, k, v = random_qkv(4, 2, 64, 64, 4, 2, 64, jnp.float16, device)
    k = k.at[0, 40, 0, 3].set(jnp.nan)  # batch 0, key 40, kv head 0 (read by query heads 0 and 1)
    out = np.asarray(jax_flash.attention(q, k, v, causal=True).astype(jnp.float32))
    assert np.isnan(out[0, 40:, :2]).all(axis=-1).all()      # rows that see key 40 in heads 0-1
    assert np.isfinite(out[0, :40, :2]).all()                 # rows before it (causal) do not see it
    assert np.isfinite(out[0, :, 2:]).all() and np.isfinite(out[1]).all()  # other kv head, other batch


def test_handler_errors_reach_python_and_the_next_call_works(device):  # rows 1 (handler side), 25
    q, k, v = random_qkv(5, 1, 16, 16, 2, 2, 64, jnp.float16, device)
    lengths = jax.device_put(jnp.full((1,), 16, jnp.int32), device)
    table = jax.device_put(jnp.zeros((1, 0), jnp.int32), device)
    bad = dict(cfg=None, softmax_scale=0.125, causal=False, window_left=-7, window_right=-1, softcap=0.0,
               has_q_lengths=False, has_kv_lengths=False, return_lse=False, paged=False,
               deterministic=False, ring=None, same_lengths=False, segments=False, has_bias=False, has_mask=False,
               alibi=False)
    no_bias, no_mask = jnp.zeros((0, 0, 0, 0), jnp.float32), jnp.zeros((0, 0, 0, 0), bool)
    with pytest.raises(Exception, match=r"jax_flash: window sizes must be >= -1 \(-1 = unbounded\), got \(-7, -1\)"):
        jax.block_until_ready(jax.jit(lambda *a: attention_p.bind(*a, **bad))(q, k, v, lengths, lengths, table,
                                                                             table, table, no_bias, no_mask))
    assert_flash_close(jax_flash.attention(q, k, v), q, k, v)


def test_decode_and_tiny_shapes(device):  # rows 1, 2
    for seq_q, seq_k in [(1, 4099), (2, 3), (3, 2), (97, 1)]:
        q, k, v = random_qkv(seq_q + seq_k, 1, seq_q, seq_k, 4, 1, 64, jnp.bfloat16, device)
        assert_flash_close(jax_flash.attention(q, k, v), q, k, v)
        assert_flash_close(jax_flash.attention(q, k, v, causal=True), q, k, v, causal=True)


# ---- GPU edge shapes (rows 2, 10, 11) ------------------------------------------------------------------------------
@requires_gpu
def test_gpu_batch_70000_and_many_heads():
    device = GPU_DEVICES[0]
    q, k, v = random_qkv(6, 70000, 16, 16, 1, 1, 64, jnp.float16, device)  # 70000 blocks, far past 65535 per axis
    out = jax_flash.attention(q, k, v)
    assert_flash_close(out[-64:], q[-64:], k[-64:], v[-64:])
    assert_flash_close(out[:64], q[:64], k[:64], v[:64])
    q, k, v = random_qkv(7, 1100, 16, 16, 64, 8, 64, jnp.bfloat16, device)  # batch * heads = 70400 > 65535
    out = jax_flash.attention(q, k, v, causal=True)
    assert_flash_close(out[-16:], q[-16:], k[-16:], v[-16:], causal=True)


@requires_gpu
def test_gpu_decode_128k_keys():
    q, k, v = random_qkv(8, 1, 1, 131072, 8, 1, 128, jnp.bfloat16, GPU_DEVICES[0])
    assert_flash_close(jax_flash.attention(q, k, v), q, k, v)


@requires_gpu
def test_gpu_tensor_above_2_31_elements():
    # q and the output have 33 * 8192 * 64 * 128 = 2.2e9 > 2^31 elements (4.4 GB in bf16): the last rows need
    # 64-bit offsets.
    batch, seq, heads, head_dim = 33, 8192, 64, 128
    device = GPU_DEVICES[0]
    assert batch * seq * heads * head_dim > 2**31
    q, k, v = random_qkv(9, batch, seq, seq, heads, 2, head_dim, jnp.bfloat16, device)  # q: 2.2e9 elements
    out = jax_flash.attention(q, k, v, causal=True)
    tail = slice(seq - 40, seq)
    got = out[-1:, tail]
    expected_q, expected_k, expected_v = q[-1:], k[-1:], v[-1:]
    full = jax_flash.attention_reference(*(jax.device_put(x, jax.devices("cpu")[0])
                                           for x in (expected_q[:, tail], expected_k, expected_v)),
                                         causal=True)  # the last 40 rows against all keys, bottom-right aligned
    np.testing.assert_allclose(np.asarray(jax.device_put(got, jax.devices("cpu")[0]).astype(jnp.float32)),
                               np.asarray(full), atol=2e-2, rtol=0)
