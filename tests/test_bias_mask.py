"""Bias and mask tensors: jax_flash.attention(bias=, mask=) against attention_reference for broadcast shapes, with
the other masks, their gradients (the bias's too), vmap, sharding and clear errors. CPU always; on a GPU the same
checks run on the kernels cfg=None picks (the sm90 family on Hopper for calls of more than 64 rows), and every
shipped sm90 config is checked on Hopper."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jax_flash
from jax_flash.reference import attention_reference
from conftest import assert_flash_close, assert_grads_close, attention_calls, random_qkv
from test_decode import SM90_CASES, SM90_IDS, paged_cache, requires_hopper

B, S, HQ, HK, D = 2, 96, 4, 2, 64


def _dtype(device):
    return jnp.float32 if device.platform == "cpu" else jnp.float16  # (GPUs take 16-bit inputs)


def _bias(shape, seed=1):
    return 2.0 * jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


def _mask(shape, seed=2, p=0.7):
    return jax.random.bernoulli(jax.random.PRNGKey(seed), p, shape)


SHAPES = {"full": (B, HQ, S, S), "heads": (1, HQ, S, S), "keys": (B, 1, 1, S), "rows": (1, 1, S, 1)}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_bias_shapes(device, shape, causal):
    q, k, v = random_qkv(3, B, S, S, HQ, HK, D, _dtype(device), device)
    bias = _bias(SHAPES[shape])
    out, lse = jax.jit(lambda q, k, v, b: jax_flash.attention(q, k, v, bias=b, causal=causal, return_lse=True))(
        q, k, v, bias)
    assert_flash_close(out, q, k, v, bias=bias, causal=causal)
    _, ref_lse = jax_flash.attention_reference(q, k, v, bias=bias, causal=causal, return_lse=True)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=2e-2, rtol=1e-3)


@pytest.mark.parametrize("shape", SHAPES)
def test_mask_shapes_with_every_other_mask(device, shape):
    q, k, v = random_qkv(4, B, S, S, HQ, HK, D, _dtype(device), device)
    mask = _mask(SHAPES[shape])
    ids = jnp.cumsum(jax.random.bernoulli(jax.random.PRNGKey(7), 0.05, (B, S)).astype(jnp.int32), axis=1)
    kwargs = dict(mask=mask, causal=True, window=(40, -1), softcap=15.0, kv_lengths=jnp.array([S, 61], jnp.int32),
                  q_segment_ids=ids, kv_segment_ids=ids, bias=_bias((1, HQ, S, S)))
    assert_flash_close(jax_flash.attention(q, k, v, **kwargs), q, k, v, **kwargs)


def test_a_dense_causal_mask_equals_causal(device):
    q, k, v = random_qkv(5, B, S, S, HQ, HK, D, _dtype(device), device)
    dense = jnp.tril(jnp.ones((S, S), bool))[None, None]
    out, lse = jax_flash.attention(q, k, v, mask=dense, return_lse=True)
    ref, ref_lse = jax_flash.attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32)), atol=2e-3)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-4)


def test_rows_the_mask_hides_entirely(device):
    """Rows whose every key is masked (or biased to -inf) give zeros and lse -inf, never NaN."""
    q, k, v = random_qkv(6, 1, 8, 16, 2, 2, 64, _dtype(device), device)
    mask = jnp.ones((1, 1, 8, 16), bool).at[0, 0, 3].set(False)
    bias = jnp.zeros((1, 1, 8, 16), jnp.float32).at[0, 0, 5].set(-jnp.inf)
    out, lse = jax_flash.attention(q, k, v, mask=mask, bias=bias, return_lse=True)
    out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
    assert (out[0, [3, 5]] == 0).all() and np.isneginf(lse[0, :, [3, 5]]).all()
    assert np.isfinite(out).all() and np.isfinite(np.delete(lse, [3, 5], axis=2)).all()


def _block_sparse_mask(shape, seed, cell=16, p=0.3):
    """A mask that is constant on cells of cell x cell entries, each visible with probability p: every tile size
    the kernels use (multiples of 16) sees whole tiles of zeros, and some query rows see no key at all."""
    cells = jax.random.bernoulli(jax.random.PRNGKey(seed), p, (*shape[:2], -(-shape[2] // cell), -(-shape[3] // cell)))
    cells = cells.at[:, :, 1::7].set(False)  # rows of cells that see nothing
    return jnp.repeat(jnp.repeat(cells, cell, axis=2), cell, axis=3)[:, :, :shape[2], :shape[3]]


@pytest.mark.parametrize("shape", ["full", "heads", "rows", "decode", "decode_shared"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_masks_with_tiles_of_zeros(device, shape, head_dim):
    """Masks whose tiles are all zeros (the GPU kernels skip those key blocks: common/mask_blocks.cuh) give the
    reference result and lse, alone and under causal, kv_lengths and segment ids, including rows that see no key.
    decode_shared: a mask shared by the heads on a decode-sized call, whose packed GQA tiles skip its tiles too."""
    seq_q, seq_k = (8, 600) if shape.startswith("decode") else (520, 600)
    mask_shape = {"full": (B, HQ, seq_q, seq_k), "heads": (1, HQ, seq_q, seq_k), "rows": (B, 1, seq_q, seq_k),
                  "decode": (B, HQ, seq_q, seq_k), "decode_shared": (B, 1, seq_q, seq_k)}[shape]
    mask = _block_sparse_mask(mask_shape, seed=head_dim)
    if shape == "decode_shared":  # (one row of cells for all heads: its last keys kept, which the last segment sees)
        mask = mask.at[..., -32:].set(True)
    q, k, v = random_qkv(8, B, seq_q, seq_k, HQ, HK, head_dim, _dtype(device), device)
    ids = jnp.cumsum(jax.random.bernoulli(jax.random.PRNGKey(9), 0.01, (B, seq_k)).astype(jnp.int32), axis=1)
    for kwargs in (dict(mask=mask), dict(mask=mask, causal=True, kv_lengths=jnp.array([seq_k, 333], jnp.int32),
                                         q_segment_ids=ids[:, seq_k - seq_q:], kv_segment_ids=ids)):
        out, lse = jax_flash.attention(q, k, v, return_lse=True, **kwargs)
        assert_flash_close(out, q, k, v, **kwargs)
        _, ref_lse = jax_flash.attention_reference(q, k, v, return_lse=True, **kwargs)
        lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
        assert (np.isneginf(lse) == np.isneginf(ref_lse)).all()
        seen = np.isfinite(ref_lse)
        assert seen.any() and (shape.startswith("decode") or not seen.all())  # (some rows see no key)
        np.testing.assert_allclose(lse[seen], ref_lse[seen], atol=2e-2, rtol=1e-3)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("shape", ["full", "heads", "keys"])
def test_gradients_with_bias_and_mask(device, shape, deterministic):
    """Gradients to q, k, v and the bias (summed over its broadcast dimensions) against the reference's; with
    deterministic=True a GPU computes them in XLA, over blocks of query rows."""
    dtype = _dtype(device)
    q, k, v = random_qkv(8, B, 64, 64, HQ, HK, D, dtype, device)
    bias = _bias(SHAPES[shape][:2] + (64, 64) if shape != "keys" else (B, 1, 1, 64))
    mask = _mask((B, 1, 1, 64), p=0.8)
    weights = jax.random.normal(jax.random.PRNGKey(9), q.shape, jnp.float32)

    def loss(attention, q, k, v, b, **kw):
        if attention is jax_flash.attention:
            kw = dict(kw, deterministic=deterministic)
        out, lse = attention(q, k, v, bias=b, mask=mask, causal=True, return_lse=True, **kw)
        return (out.astype(jnp.float32) * weights).sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()

    assert_grads_close(loss, (q, k, v, bias), ("dq", "dk", "dv", "dbias"))


@pytest.mark.parametrize("shape", ["heads", "keys", "slopes"])
def test_bias_gradient_keeps_the_batch_sharded(shape):
    """The bias's gradient (XLA's) of a batch-sharded jit call, for a (1, N, T, S) bias shared by the batch, a
    (B, 1, 1, S) one and ALiBi slopes: the reference's values, and no all-gather in the compiled program (each device
    keeps its rows of q, out and lse; a shared bias's gradient is summed across devices)."""
    batch, seq_q, seq_k = 4, 40, 56
    cpu = jax.devices("cpu")[:4]  # (float32: the CPU path; conftest gives 8 devices)
    mesh = Mesh(np.array(cpu), ("batch",))
    rows = NamedSharding(mesh, PartitionSpec("batch"))
    q, k, v = (jax.device_put(x, rows) for x in random_qkv(5, batch, seq_q, seq_k, HQ, HK, D, jnp.float32))
    bias_shape = {"heads": (1, HQ, seq_q, seq_k), "keys": (batch, 1, 1, seq_k), "slopes": (batch, HQ)}[shape]
    slopes = jnp.tile(2.0 ** -jnp.arange(1.0, HQ + 1.0), (batch, 1))
    bias = jax.device_put(slopes if shape == "slopes" else _bias(bias_shape), NamedSharding(mesh, PartitionSpec()))
    name = "alibi_slopes" if shape == "slopes" else "bias"
    weights = jax.random.normal(jax.random.PRNGKey(9), q.shape, jnp.float32)

    def loss(attention, q, k, v, b):
        return (attention(q, k, v, causal=True, **{name: b}).astype(jnp.float32) * weights).sum()

    grad = jax.jit(jax.grad(functools.partial(loss, jax_flash.attention), argnums=3))
    assert "all-gather" not in grad.lower(q, k, v, bias).compile().as_text()
    expected = jax.grad(functools.partial(loss, attention_reference), argnums=3)(q, k, v, bias)
    np.testing.assert_allclose(np.asarray(grad(q, k, v, bias)), np.asarray(expected), atol=1e-5, rtol=1e-4)


def test_bias_gradient_exports_with_a_symbolic_batch():
    """jax.export of the bias's gradient with a symbolic batch, run at two batch sizes."""
    cpu = jax.devices("cpu")[0]
    (b,) = jax.export.symbolic_shape("b")
    q_spec = jax.ShapeDtypeStruct((b, 24, 4, 16), jnp.float32)
    kv_spec = jax.ShapeDtypeStruct((b, 24, 2, 16), jnp.float32)
    bias_spec = jax.ShapeDtypeStruct((1, 4, 24, 24), jnp.float32)

    def loss(q, k, v, b):
        return jax_flash.attention(q, k, v, bias=b, causal=True).sum()

    grad = jax.jit(jax.grad(loss, argnums=3))
    checks = [jax.export.DisabledSafetyCheck.custom_call(name)
              for name in ("jax_flash_attention", "jax_flash_attention_bwd")]
    exported = jax.export.export(grad, disabled_checks=checks, platforms=["cpu"])(q_spec, kv_spec, kv_spec, bias_spec)
    bias = jax.device_put(_bias((1, 4, 24, 24)), cpu)
    for batch in (1, 3):
        q, k, v = random_qkv(batch, batch, 24, 24, 4, 2, 16, jnp.float32, cpu)
        np.testing.assert_allclose(np.asarray(exported.call(q, k, v, bias)), np.asarray(grad(q, k, v, bias)),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["tensors_segments", "alibi_softcap_lengths"])
def test_xla_backward_over_query_blocks(case):
    """The GPU's XLA backward (deterministic=True with segment ids or tensors), over blocks of query rows (here 16 of
    a call's 40: the last block padded), equals the gradient of the reference: a bias shared by the batch, a per-row
    mask and segment ids under a causal mask; ALiBi slopes with a softcap, a window and both lengths (run here on
    the CPU)."""
    from jax_flash._autodiff import _xla_backward
    from jax_flash._primitive import no_lengths, no_segments, no_tensor

    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        batch, seq = 3, 40
        q, k, v = random_qkv(11, batch, seq, seq, HQ, HK, D, jnp.float32)
        params = dict(softmax_scale=D ** -0.5, causal=True, window_left=-1, window_right=0, softcap=0.0,
                      has_q_lengths=False, has_kv_lengths=False, paged=False, segments=False, has_bias=False,
                      has_mask=False, alibi=False)
        ids, bias, mask = no_segments(batch)[0], no_tensor(jnp.float32), no_tensor(jnp.bool_)
        q_lengths = kv_lengths = no_lengths()
        if case == "tensors_segments":
            bias = _bias((1, HQ, seq, seq))
            mask = _mask((batch, 1, 1, seq), p=0.8)
            ids = jnp.cumsum(jax.random.bernoulli(jax.random.PRNGKey(3), 0.1, (batch, seq)).astype(jnp.int32), axis=1)
            kwargs = dict(causal=True, bias=bias, mask=mask, q_segment_ids=ids, kv_segment_ids=ids)
            params.update(segments=True, has_bias=True, has_mask=True)
        else:
            slopes = jax.random.uniform(jax.random.PRNGKey(5), (batch, HQ), jnp.float32, 0.01, 0.5)
            q_lengths, kv_lengths = jnp.array([40, 17, 33], jnp.int32), jnp.array([40, 30, 9], jnp.int32)
            kwargs = dict(window=(12, 3), softcap=4.0, alibi_slopes=slopes, q_lengths=q_lengths,
                          kv_lengths=kv_lengths)
            bias = slopes[:, :, None, None]
            params.update(causal=False, window_left=12, window_right=3, softcap=4.0, has_q_lengths=True,
                          has_kv_lengths=True, has_bias=True, alibi=True)
        (out, lse), pullback = jax.vjp(lambda q, k, v: attention_reference(q, k, v, return_lse=True, **kwargs),
                                       q, k, v)
        d_out = jax.random.normal(jax.random.PRNGKey(4), out.shape, jnp.float32)
        d_lse = jax.random.normal(jax.random.PRNGKey(6), lse.shape, jnp.float32)
        d_lse = jnp.where(jnp.isfinite(lse), d_lse, 0.0)
        grads = _xla_backward(q, k, v, out, lse, d_out, d_lse, q_lengths, kv_lengths, ids, ids, bias, mask,
                              params=params, rows=16)
        for name, got, want in zip("qkv", grads, pullback((d_out, d_lse))):
            assert got.shape == want.shape, (name, got.shape)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("case", ["cells", "cells_segments", "dense_causal", "padding"])
def test_gradients_skip_tiles_of_zeros(device, head_dim, case):
    """The GPU backward skips the tiles whose mask or segment ids hide every score and tests no score of the tiles
    that hide none (common/backward_blocks.cuh): gradients against the reference's for masks constant on 64 x 64
    cells (whole backward tiles of zeros, of ones and mixed; broadcast over heads, or over the batch with causal and
    segment ids), a dense causal mask, and a (B, 1, 1, Sk) padding mask (broadcast over heads and queries)."""
    seq_q, seq_k = 520, 600
    q, k, v = random_qkv(head_dim + 1, B, seq_q, seq_k, HQ, HK, head_dim, _dtype(device), device)
    if case == "dense_causal":
        kwargs = dict(mask=jnp.tril(jnp.ones((seq_q, seq_k), bool), k=seq_k - seq_q)[None, None])
    elif case == "padding":
        kwargs = dict(mask=(jnp.arange(seq_k)[None, :] < jnp.array([[seq_k], [333]]))[:, None, None, :])
    elif case == "cells":
        kwargs = dict(mask=_block_sparse_mask((B, 1, seq_q, seq_k), seed=head_dim, cell=64, p=0.5))
    else:
        ids = jnp.cumsum(jax.random.bernoulli(jax.random.PRNGKey(4), 0.006, (B, seq_k)).astype(jnp.int32), axis=1)
        kwargs = dict(mask=_block_sparse_mask((1, HQ, seq_q, seq_k), seed=head_dim, cell=64, p=0.7), causal=True,
                      q_segment_ids=ids[:, seq_k - seq_q:], kv_segment_ids=ids)
    weights = jax.random.normal(jax.random.PRNGKey(9), q.shape, jnp.float32)

    def loss(attention, q, k, v, **kw):
        return (attention(q, k, v, **kwargs, **kw).astype(jnp.float32) * weights).sum()

    assert_grads_close(loss, (q, k, v), ("dq", "dk", "dv"))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("tensors", ["bias_mask", "alibi_segments"])
def test_tensor_gradients_on_each_backward_tile(device, head_dim, tensors):
    """Odd lengths, GQA and causal on each head dim's backward tile (on Hopper the sm90 family's):
    dq, dk, dv (and the bias's or slopes' gradient) with a bias and a padding mask, or with ALiBi slopes and segment
    ids, against the reference's."""
    seq_q, seq_k = 150, 333
    q, k, v = random_qkv(head_dim, B, seq_q, seq_k, HQ, HK, head_dim, _dtype(device), device)
    ids = jnp.cumsum(jax.random.bernoulli(jax.random.PRNGKey(3), 0.02, (B, seq_k)).astype(jnp.int32), axis=1)
    if tensors == "bias_mask":
        extra, name = _bias((1, HQ, seq_q, seq_k)), "dbias"
        fixed = dict(mask=_mask((B, 1, 1, seq_k), p=0.8))
        call = lambda attention, x, **kw: attention(bias=x, **kw)
    else:
        extra, name = 2.0 ** -jnp.arange(1, HQ + 1, dtype=jnp.float32), "dslopes"
        fixed = dict(q_segment_ids=ids[:, seq_k - seq_q:], kv_segment_ids=ids)
        call = lambda attention, x, **kw: attention(alibi_slopes=x, **kw)
    weights = jax.random.normal(jax.random.PRNGKey(9), q.shape, jnp.float32)

    def loss(attention, q, k, v, x, **kw):
        out = call(lambda **a: attention(q, k, v, causal=True, **fixed, **a), x, **kw)
        return (out.astype(jnp.float32) * weights).sum()

    assert_grads_close(loss, (q, k, v, extra), ("dq", "dk", "dv", name))


def test_vmap_over_bias_mapped_and_shared(device):
    q, k, v = random_qkv(10, B, 48, 48, HQ, HK, D, _dtype(device), device)
    biases = _bias((3, 1, HQ, 48, 48))
    stack = lambda x: jnp.broadcast_to(x, (3, *x.shape))
    mapped = jax.vmap(lambda q, k, v, b: jax_flash.attention(q, k, v, bias=b))(stack(q), stack(k), stack(v), biases)
    for i in range(3):
        assert_flash_close(mapped[i], q, k, v, bias=biases[i])
    mask = _mask((B, 1, 1, 48))
    shared = jax.vmap(lambda q: jax_flash.attention(q, k, v, mask=mask, bias=biases[0]))(stack(q))
    assert_flash_close(shared[2], q, k, v, mask=mask, bias=biases[0])


def test_sharded_over_batch_and_heads():
    """A heads-shaped bias splits with the query heads and a keys-shaped mask with the batch: no all-gather."""
    devices = jax.devices("cpu")[:4]
    mesh = Mesh(np.array(devices).reshape(2, 2), ("b", "h"))
    with jax.default_device(devices[0]):  # (float32: the CPU path, also where a GPU is the default device)
        q, k, v = random_qkv(11, 4, 64, 64, HQ, HK, D, jnp.float32)
        bias, mask = _bias((1, HQ, 64, 64)), _mask((4, 1, 1, 64))
        expected = jax_flash.attention(q, k, v, bias=bias, mask=mask, causal=True)
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, PartitionSpec(*spec)))
    args = (put(q, "b", None, "h", None), put(k, "b", None, "h", None), put(v, "b", None, "h", None),
            put(bias, None, "h", None, None), put(mask, "b", None, None, None))
    attend = jax.jit(lambda q, k, v, b, m: jax_flash.attention(q, k, v, bias=b, mask=m, causal=True))
    assert "all-gather" not in attend.lower(*args).compile().as_text()
    np.testing.assert_allclose(np.asarray(attend(*args)), np.asarray(expected), atol=1e-6)


def test_bias_and_mask_errors():
    q, k, v = random_qkv(1, 2, 16, 24, 2, 2, 64, jnp.float32)
    with pytest.raises(ValueError, match=r"bias must be a floating-point array of rank 4 whose dimensions each equal "
                                         r"\(batch, heads_q, seq_q, seq_k\) = \(2, 2, 16, 24\) or 1 \(broadcast\); "
                                         r"got float32\(2, 2, 16\)"):
        jax_flash.attention(q, k, v, bias=jnp.zeros((2, 2, 16)))
    with pytest.raises(ValueError, match=r"bias .* got float32\(2, 2, 16, 16\)"):
        jax_flash.attention(q, k, v, bias=jnp.zeros((2, 2, 16, 16)))
    with pytest.raises(ValueError, match=r"bias .* got int32\(1, 1, 1, 1\)"):
        jax_flash.attention(q, k, v, bias=jnp.zeros((1, 1, 1, 1), jnp.int32))
    with pytest.raises(ValueError, match=r"mask must be a bool or numeric array .* got bool\(3, 1, 16, 24\)"):
        jax_flash.attention(q, k, v, mask=jnp.ones((3, 1, 16, 24), bool))
    # numeric masks (Flax's are float): nonzero entries are visible
    ones = jnp.ones((1, 1, 16, 24))
    q, k, v = (x.astype(_dtype(jax.devices()[0])) for x in (q, k, v))
    np.testing.assert_array_equal(np.asarray(jax_flash.attention(q, k, v, mask=ones.at[..., 5].set(0))),
                                  np.asarray(jax_flash.attention(q, k, v, mask=(ones.at[..., 5].set(0) != 0))))


@pytest.mark.skipif(not jax_flash.native.BUILT_WITH_CUDA, reason="module built without CUDA")
def test_cuda_lowering_of_bias_and_mask():
    """The forward and the backward are our custom calls with the bias and mask among their operands, the forward on
    an sm80-family config; the bias's gradient is XLA's (it has the bias's full size)."""
    q, k, v = random_qkv(2, 1, 32, 32, 2, 2, 64, jnp.float16)
    mask = jnp.ones((1, 1, 1, 32), bool)
    loss = lambda q, k, v, b: jax_flash.attention(q, k, v, bias=b, mask=mask).astype(jnp.float32).sum()
    text = jax.jit(jax.grad(loss, argnums=(0, 3))).trace(q, k, v, _bias((1, 2, 32, 32))).lower(
        lowering_platforms=("cuda",)).as_text()
    forward, backward = attention_calls(text)
    assert "family = 80" in forward
    for call in (forward, backward):
        assert "tensor<1x2x32x32xf32>, tensor<1x1x1x32xi1>" in call


SM90_TENSOR_SHAPES = {"full": lambda b, h, sq, sk: (b, h, sq, sk), "heads": lambda b, h, sq, sk: (1, h, sq, sk),
                      "keys": lambda b, h, sq, sk: (b, 1, 1, sk), "rows": lambda b, h, sq, sk: (1, 1, sq, 1)}


@requires_hopper
@pytest.mark.parametrize("head_dim,cfg", SM90_CASES, ids=SM90_IDS)
@pytest.mark.parametrize("shape", SM90_TENSOR_SHAPES)
def test_sm90_bias_and_mask(head_dim, cfg, shape):
    """Every shipped sm90 config with a bias and a block-sparse mask of each broadcast shape (the mask pre-pass's
    key-block ranges and per-tile tests: common/mask_blocks.cuh): alone; with causal, a window, softcap and both
    lengths, split and paged; with segment ids: against the reference (out and lse)."""
    gpu = jax.devices("gpu")[0]
    batch, heads, seq_q, seq_k = 2, 4, 450, 700
    q, k, v = random_qkv(head_dim, batch, seq_q, seq_k, heads, 2, head_dim, jnp.bfloat16, gpu)
    dims = SM90_TENSOR_SHAPES[shape](batch, heads, seq_q, seq_k)
    bias, mask = _bias(dims, seed=head_dim), _block_sparse_mask(dims, seed=head_dim, cell=16, p=0.6)
    if dims[2] > 1:
        mask = mask.at[:, :, 200:400].set(False)  # query tiles that see no key at all (an empty key-block range)
    ids = jnp.cumsum(jax.random.bernoulli(jax.random.PRNGKey(9), 0.004, (batch, seq_k)).astype(jnp.int32), axis=1)
    k_pages, v_pages, table = paged_cache(k, v, 64, seed=head_dim)
    pad = table.shape[1] * 64 - seq_k  # the paged call's key length: whole pages
    padded = dict(bias=jnp.pad(bias, ((0, 0),) * 3 + ((0, pad if dims[3] > 1 else 0),)),
                  mask=jnp.pad(mask, ((0, 0),) * 3 + ((0, pad if dims[3] > 1 else 0),)))
    plain = dict(bias=bias, mask=mask)
    masked = dict(causal=True, window=(300, -1), softcap=20.0, q_lengths=jnp.array([seq_q, 400], jnp.int32),
                  kv_lengths=jnp.array([seq_k, 650], jnp.int32))
    segments = dict(q_segment_ids=ids[:, seq_k - seq_q:], kv_segment_ids=ids)
    refs = {}
    for name, extra, splits, paged in (("plain", {}, 1, False), ("masked", masked, 3, False),
                                       ("masked", masked, 0, True), ("segments", segments, 1, False)):
        kwargs = dict(plain, **extra)
        if name not in refs:
            refs[name] = np.asarray(jax_flash.attention_reference(q, k, v, return_lse=True, **kwargs)[1])
        ref_lse = refs[name]
        run = dataclasses.replace(cfg, num_splits=splits)
        call = dict(extra, page_table=table, **padded) if paged else kwargs
        out, lse = jax_flash.attention(q, k_pages if paged else k, v_pages if paged else v, run, return_lse=True,
                                       **call)
        assert_flash_close(out, q, k, v, **kwargs)
        lse = np.asarray(lse)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
        finite = np.isfinite(ref_lse)
        assert finite.any()
        np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=2e-2, rtol=0)
    with pytest.raises(ValueError, match="pack_gqa=True with bias / mask tensors runs on family='sm80'"):
        jax_flash.attention(q, k, v, dataclasses.replace(cfg, pack_gqa=True), mask=mask)


def test_tensor_routing():
    """cfg=None on a GPU (jax_flash/selection.py): bias / mask tensors take the default path on sm_90 (the sm90
    family, unpacked; ALiBi slopes alone at head dim 64 the three-consumer tile) and the sm80 family's tuned tile
    below it; decode-sized calls keep the decode tiles."""
    from jax_flash import config, selection

    compiled = list(config.TUNED_CONFIGS[128]) + list(config.DECODE_CONFIGS[128]) + list(config.SM90_CONFIGS[128])
    shape = selection.CallShape(seq_q=1024, seq_k=1024, group=4, tensors=True)
    assert selection.decode_gpu_config(128, shape, compiled, 90) is None
    assert selection.sm90_packed_config(90, "bfloat16", 128, shape, compiled, False) is None
    assert selection.decode_gpu_config(128, shape, compiled, 80).family == "sm80"
    assert selection.default_gpu_config(90, "bfloat16", 64, list(config.SM90_CONFIGS[64]), False, 1024,
                                        True) == config.SM90_CONFIGS[64][0]
    no_pingpong = selection.default_gpu_config(90, "bfloat16", 128, compiled, False, 1024, True)
    assert no_pingpong == config.SM90_CONFIGS[128][1] and not no_pingpong.pingpong
    for right_bounded in (False, True):  # ALiBi slopes alone: head dim 64 on the three-consumer tile
        alibi = selection.default_gpu_config(90, "bfloat16", 64, list(config.SM90_CONFIGS[64]), right_bounded, 1024,
                                             True, 1024, alibi=True)
        assert alibi == config.SM90_CONFIGS[64][2] and alibi.consumer_warpgroups == 3
        assert selection.default_gpu_config(90, "bfloat16", 128, compiled, right_bounded, 1024, True, 1024,
                                            alibi=True) == config.SM90_CONFIGS[128][1]
    decode = dataclasses.replace(shape, seq_q=1, group=1)
    assert selection.decode_gpu_config(128, decode, compiled, 90).kernel() in config.DECODE_CONFIGS[128]
