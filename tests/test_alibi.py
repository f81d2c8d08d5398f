"""ALiBi slopes: jax_flash.attention(alibi_slopes=) against attention_reference (which builds the dense bias,
reference.alibi_bias) with every other mask, decode shapes, gradients (the slopes' too), vmap, sharding, lowering
and clear errors. CPU always; on a GPU the kernels cfg=None picks, and every shipped sm90 config on Hopper."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jax_flash
from conftest import assert_flash_close, assert_grads_close, attention_calls, random_qkv
from jax_flash.reference import alibi_bias
from test_decode import SM90_CASES, SM90_IDS, paged_cache, requires_hopper

B, HQ, HK, D = 2, 4, 2, 64


def _dtype(device):
    return jnp.float32 if device.platform == "cpu" else jnp.bfloat16


def _slopes(shape, seed=0):
    """ALiBi's geometric slopes 2^(-8 h / H), scaled per batch row for (B, H) slopes."""
    base = 2.0 ** (-8.0 * (jnp.arange(HQ, dtype=jnp.float32) + 1) / HQ)
    if len(shape) == 1:
        return base
    return base * (1.0 + jax.random.uniform(jax.random.PRNGKey(seed), shape))


def _check(out, lse, q, k, v, **kwargs):
    assert_flash_close(out, q, k, v, **kwargs)
    _, ref_lse = jax_flash.attention_reference(q, k, v, return_lse=True, **kwargs)
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=2e-2, rtol=1e-3)


MASKS = {
    "none": {},
    "causal": dict(causal=True),
    "lengths": dict(causal=True, q_lengths=jnp.array([70, 0], jnp.int32), kv_lengths=jnp.array([90, 40], jnp.int32)),
    "window_softcap": dict(window=(24, 8), softcap=10.0, kv_lengths=jnp.array([130, 77], jnp.int32)),
}


@pytest.mark.parametrize("slopes_shape", [(HQ,), (B, HQ)], ids=["heads", "batch_heads"])
@pytest.mark.parametrize("masks", MASKS)
def test_alibi_against_reference(device, slopes_shape, masks):
    """Out and lse against the dense ALiBi bias, seq_q != seq_k (the bottom-right diagonal), GQA; a batch row with
    q_lengths 0 gives zeros and lse -inf."""
    q, k, v = random_qkv(1, B, 96, 130, HQ, HK, D, _dtype(device), device)
    slopes = _slopes(slopes_shape)
    kwargs = dict(MASKS[masks], alibi_slopes=slopes)
    out, lse = jax.jit(lambda q, k, v, s: jax_flash.attention(q, k, v, return_lse=True, **dict(kwargs, alibi_slopes=s)))(
        q, k, v, slopes)
    _check(out, lse, q, k, v, **kwargs)


def test_alibi_equals_the_bias_tensor(device):
    """alibi_slopes gives what the (1, H, Sq, Sk) bias alibi_bias builds gives through bias=."""
    q, k, v = random_qkv(2, B, 80, 80, HQ, HK, D, _dtype(device), device)
    slopes = _slopes((HQ,))
    for kwargs in (dict(causal=True), dict(kv_lengths=jnp.array([80, 33], jnp.int32))):
        lengths = dict(kv_lengths=kwargs.get("kv_lengths"))
        bias = alibi_bias(slopes, 80, 80, **lengths)
        fast = np.asarray(jax_flash.attention(q, k, v, alibi_slopes=slopes, **kwargs).astype(jnp.float32))
        dense = np.asarray(jax_flash.attention(q, k, v, bias=bias, **kwargs).astype(jnp.float32))
        np.testing.assert_allclose(fast, dense, atol=1e-6 if device.platform == "cpu" else 2e-2)


@pytest.mark.parametrize("seq_q", [1, 7])
@pytest.mark.parametrize("heads", [(32, 8), (8, 1)], ids=["gqa4", "mqa8"])
def test_alibi_decode(device, seq_q, heads):
    """Decode shapes (on a GPU the decode tiles, packed GQA and split key ranges) with per-sequence lengths,
    contiguous and paged (whole pages: the logical key length grows, the lengths keep the diagonal)."""
    heads_q, heads_k = heads
    seq_k = 1500
    q, k, v = random_qkv(3, B, seq_q, seq_k, heads_q, heads_k, 128, _dtype(device), device)
    slopes = 2.0 ** (-8.0 * (jnp.arange(heads_q, dtype=jnp.float32) + 1) / heads_q)
    kwargs = dict(alibi_slopes=slopes, causal=True, kv_lengths=jnp.array([seq_k, 701], jnp.int32))
    out, lse = jax_flash.attention(q, k, v, return_lse=True, **kwargs)
    _check(out, lse, q, k, v, **kwargs)
    k_pages, v_pages, table = paged_cache(k, v, 64, seed=seq_q)
    out, lse = jax_flash.attention(q, k_pages, v_pages, page_table=table, return_lse=True, **kwargs)
    _check(out, lse, q, k, v, **kwargs)


@pytest.mark.parametrize("slopes_shape", [(HQ,), (B, HQ)], ids=["heads", "batch_heads"])
def test_alibi_gradients(device, slopes_shape):
    """Gradients to q, k, v and the slopes (summed over what they broadcast over) against the reference's."""
    dtype = _dtype(device)
    q, k, v = random_qkv(4, B, 64, 64, HQ, HK, D, dtype, device)
    slopes = _slopes(slopes_shape)
    lengths = jnp.array([64, 41], jnp.int32)
    weights = jax.random.normal(jax.random.PRNGKey(9), q.shape, jnp.float32)

    def loss(attention, q, k, v, s, **kw):
        out, lse = attention(q, k, v, alibi_slopes=s, causal=True, kv_lengths=lengths, return_lse=True, **kw)
        return (out.astype(jnp.float32) * weights).sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()

    assert_grads_close(loss, (q, k, v, slopes), ("dq", "dk", "dv", "dslopes"))


def test_alibi_jvp_and_vmap():
    """Forward mode (the slopes' tangent too) and vmap over mapped and shared slopes, on the CPU path."""
    with jax.default_device(jax.devices("cpu")[0]):  # (float32: the CPU path, also where a GPU is the default)
        q, k, v = random_qkv(5, B, 40, 56, HQ, HK, D, jnp.float32)
        slopes = _slopes((HQ,))
        fn = lambda q, s: jax_flash.attention(q, k, v, alibi_slopes=s, causal=True)
        ref = lambda q, s: jax_flash.attention_reference(q, k, v, alibi_slopes=s, causal=True)
        tangents = (jax.random.normal(jax.random.PRNGKey(1), q.shape), slopes * 0.5)
        _, got = jax.jvp(fn, (q, slopes), tangents)
        _, want = jax.jvp(ref, (q, slopes), tangents)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
        stacked = jnp.stack([slopes, 2 * slopes, slopes / 4])
        mapped = jax.vmap(lambda s: fn(q, s))(stacked)
        shared = jax.vmap(lambda q: fn(q, slopes))(jnp.stack([q, -q]))
        for i in range(3):
            np.testing.assert_allclose(np.asarray(mapped[i]), np.asarray(ref(q, stacked[i])), atol=1e-5)
        np.testing.assert_allclose(np.asarray(shared[1]), np.asarray(ref(-q, slopes)), atol=1e-5)


def test_alibi_sharded_over_batch_and_heads():
    """(B, H) slopes split with the batch and the query heads: no all-gather, one device's result."""
    devices = jax.devices("cpu")[:4]
    mesh = Mesh(np.array(devices).reshape(2, 2), ("b", "h"))
    with jax.default_device(devices[0]):
        q, k, v = random_qkv(6, 4, 64, 64, HQ, HK, D, jnp.float32)
        slopes = _slopes((4, HQ))
        expected = jax_flash.attention(q, k, v, alibi_slopes=slopes, causal=True)
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, PartitionSpec(*spec)))
    args = (put(q, "b", None, "h", None), put(k, "b", None, "h", None), put(v, "b", None, "h", None),
            put(slopes, "b", "h"))
    attend = jax.jit(lambda q, k, v, s: jax_flash.attention(q, k, v, alibi_slopes=s, causal=True))
    assert "all-gather" not in attend.lower(*args).compile().as_text()
    np.testing.assert_allclose(np.asarray(attend(*args)), np.asarray(expected), atol=1e-6)


def test_alibi_errors():
    q, k, v = random_qkv(7, 2, 16, 24, 4, 2, 64, jnp.float32)
    with pytest.raises(ValueError, match=r"alibi_slopes must be a floating-point array of shape \(heads_q,\) = "
                                         r"\(4,\) or \(batch, heads_q\) = \(2, 4\); got float32\(3,\)"):
        jax_flash.attention(q, k, v, alibi_slopes=jnp.ones((3,)))
    with pytest.raises(ValueError, match=r"alibi_slopes .* got float32\(1, 4\)"):
        jax_flash.attention(q, k, v, alibi_slopes=jnp.ones((1, 4)))
    with pytest.raises(ValueError, match=r"alibi_slopes .* got int32\(4,\)"):
        jax_flash.attention(q, k, v, alibi_slopes=jnp.ones((4,), jnp.int32))
    with pytest.raises(ValueError, match="alibi_slopes and bias cannot be combined"):
        jax_flash.attention(q, k, v, alibi_slopes=jnp.ones((4,)), bias=jnp.zeros((1, 4, 16, 24)))


@pytest.mark.skipif(not jax_flash.native.BUILT_WITH_CUDA, reason="module built without CUDA")
def test_cuda_lowering_of_alibi():
    """The forward and the backward custom calls carry alibi = 1 and the (1, H, 1, 1) slopes as their bias operand:
    no dense bias is built."""
    q, k, v = random_qkv(8, 1, 32, 32, 4, 2, 64, jnp.float16)
    loss = lambda q, s: jax_flash.attention(q, k, v, alibi_slopes=s).astype(jnp.float32).sum()
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(q, _slopes((4,))).lower(
        lowering_platforms=("cuda",)).as_text()
    forward, backward = attention_calls(text)
    for call in (forward, backward):
        assert "alibi = 1" in call and "tensor<1x4x1x1xf32>" in call
    assert "tensor<1x4x32x32xf32>" not in forward


@requires_hopper
@pytest.mark.parametrize("head_dim,cfg", SM90_CASES, ids=SM90_IDS)
def test_sm90_alibi(head_dim, cfg):
    """Every shipped sm90 config: alone; with causal, a window, softcap and both lengths, split and paged."""
    gpu = jax.devices("gpu")[0]
    batch, heads, seq_q, seq_k = 2, 4, 450, 700
    q, k, v = random_qkv(head_dim, batch, seq_q, seq_k, heads, 2, head_dim, jnp.bfloat16, gpu)
    slopes = _slopes((batch, heads), seed=head_dim)
    k_pages, v_pages, table = paged_cache(k, v, 64, seed=head_dim)
    masked = dict(causal=True, window=(300, -1), softcap=20.0, q_lengths=jnp.array([seq_q, 400], jnp.int32),
                  kv_lengths=jnp.array([seq_k, 650], jnp.int32))
    for extra, splits, paged in (({}, 1, False), (masked, 3, False), (masked, 0, True)):
        kwargs = dict(extra, alibi_slopes=slopes)
        run = dataclasses.replace(cfg, num_splits=splits)
        keys = (k_pages, v_pages) if paged else (k, v)
        out, lse = jax_flash.attention(q, *keys, run, return_lse=True, **(dict(kwargs, page_table=table) if paged
                                                                           else kwargs))
        _check(out, lse, q, k, v, **kwargs)


def test_handler_refuses_slopes_of_another_shape():
    """A call bound with alibi=True whose bias operand is not (B|1, Hq, 1, 1) slopes gets the handler's clear error."""
    from jax_flash._primitive import attention_p, no_lengths, no_segments, no_tensor

    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        q, k, v = random_qkv(9, 1, 8, 8, 4, 2, 64, jnp.float32)
        params = dict(cfg=None, softmax_scale=0.125, causal=False, window_left=-1, window_right=-1, softcap=0.0,
                      has_q_lengths=False, has_kv_lengths=False, return_lse=False, paged=False, deterministic=False,
                      ring=None, same_lengths=False, segments=False, has_bias=True, has_mask=False, alibi=True)
        args = (q, k, v, no_lengths(), no_lengths(), jnp.zeros((1, 0), jnp.int32), *no_segments(1))
        with pytest.raises(Exception, match=r"alibi: the ALiBi slopes must be float32 of shape \(batch or 1, heads_q "
                                            r"or 1, 1, 1\) with \(batch, heads_q\) = \(1, 4\); got \(1, 4, 8, 1\)"):
            jax.block_until_ready(jax.jit(lambda *a: attention_p.bind(*a, **params))(
                *args, jnp.zeros((1, 4, 8, 1), jnp.float32), no_tensor(jnp.bool_)))
