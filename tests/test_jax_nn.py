"""jax_flash.dot_product_attention against jax.nn.dot_product_attention, argument by argument, and
jax_flash.flax.attention_fn against Flax's default attention in nnx and Linen (CPU, float32)."""

from __future__ import annotations

import inspect
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from conftest import GPU_DEVICES, random_qkv, requires_gpu

CPU = jax.devices("cpu")[0]
LENGTHS_Q = jnp.array([20, 0, 7], jnp.int32)
LENGTHS_K = jnp.array([5, 33, 0], jnp.int32)


def _qkv(seq_q=24, seq_k=24, heads_q=4, heads_k=2, head_dim=32, seed=0):
    return random_qkv(seed, 3, seq_q, seq_k, heads_q, heads_k, head_dim, jnp.float32, CPU)


def _both(q, k, v, *args, **kwargs):
    """(jax_flash's result, jax.nn's result, the HLO of jax_flash's call)."""
    mine = jax.jit(lambda q, k, v, *a: jax_flash.dot_product_attention(q, k, v, *a, **kwargs))
    theirs = jax.nn.dot_product_attention(q, k, v, *args, **{n: x for n, x in kwargs.items()
                                                            if n != "implementation"})
    return mine(q, k, v, *args), theirs, mine.lower(q, k, v, *args).as_text()


def _close(actual, expected, rtol=2e-5, atol=2e-5):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(e, np.float32), rtol=rtol, atol=atol)


def _on_kernels(hlo: str) -> bool:
    return re.search(r"custom_call @jax_flash_attention\(", hlo) is not None


KERNEL_CASES = {
    "plain": dict(),
    "scale": dict(scale=0.3),
    "causal": dict(is_causal=True),
    "window-int": dict(local_window_size=3),
    "window-pair": dict(local_window_size=(5, 2)),
    "causal-window": dict(is_causal=True, local_window_size=(4, 9)),
    "q-lengths": dict(query_seq_lengths=LENGTHS_Q),
    "kv-lengths": dict(key_value_seq_lengths=LENGTHS_K),
    "both-lengths": dict(query_seq_lengths=LENGTHS_Q, key_value_seq_lengths=LENGTHS_K),
    "causal-q-lengths": dict(is_causal=True, query_seq_lengths=LENGTHS_Q),
    "causal-kv-lengths": dict(is_causal=True, key_value_seq_lengths=LENGTHS_K),
    "implementation-xla": dict(implementation="xla"),
    "implementation-cudnn": dict(implementation="cudnn"),
    "residual": dict(return_residual=True, is_causal=True),
    "residual-lengths": dict(return_residual=True, query_seq_lengths=LENGTHS_Q, key_value_seq_lengths=LENGTHS_K),
    "window-kv-lengths": dict(is_causal=True, local_window_size=(4, 0), key_value_seq_lengths=LENGTHS_K,
                              return_residual=True),
}


@pytest.mark.parametrize("shape", [(24, 24), (16, 40), (40, 16)], ids=["square", "fewer-queries", "more-queries"])
@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_matches_jax_nn_on_the_kernels(case, shape):
    q, k, v = _qkv(*shape)
    mine, theirs, hlo = _both(q, k, v, **KERNEL_CASES[case])
    _close(mine, theirs)
    assert _on_kernels(hlo), "the call should run jax_flash's kernel, not XLA's attention"


def test_one_lengths_array_with_causal_runs_on_the_kernels():
    q, k, v = _qkv()
    lengths = jnp.array([24, 9, 0], jnp.int32)
    for kwargs in (dict(is_causal=True), dict(local_window_size=(3, 2)), dict(is_causal=True, return_residual=True)):
        mine, theirs, hlo = _both(q, k, v, query_seq_lengths=lengths, key_value_seq_lengths=lengths, **kwargs)
        _close(mine, theirs)
        assert _on_kernels(hlo)


def test_rows_that_see_no_key_give_jax_nns_mean_of_v():
    """jax.nn gives a fully masked row the mean of V over all keys (and the masked score as residual)."""
    q, k, v = _qkv(40, 16)
    for kwargs in (dict(local_window_size=(0, 2)),           # rows 16.. have no key within the window
                   dict(is_causal=True, local_window_size=(0, 0)),
                   dict(key_value_seq_lengths=jnp.array([0, 3, 16], jnp.int32))):  # batch row 0 has no key
        mine, theirs, hlo = _both(q, k, v, return_residual=True, **kwargs)
        _close(mine, theirs)
        assert _on_kernels(hlo)
    mean_v = np.asarray(jnp.mean(v[0], axis=0)).repeat(2, axis=0)  # (heads_q, head_dim): GQA group of 2
    np.testing.assert_allclose(np.asarray(mine[0][0]), np.broadcast_to(mean_v, mine[0][0].shape), atol=1e-5)


@pytest.mark.parametrize("bias_shape,mask_shape", [((3, 4, 16, 40), None), ((1, 4, 16, 40), None),
                                                   ((3, 1, 16, 40), (3, 1, 1, 40)), (None, (1, 1, 16, 40)),
                                                   (None, (3, 4, 16, 40)), ((16, 40), (1, 40))])
@pytest.mark.parametrize("band", [dict(is_causal=True), dict(local_window_size=(5, 3)), {}],
                         ids=["causal", "window", "none"])
def test_bias_and_mask_tensors_give_jax_nns_result(bias_shape, mask_shape, band):
    """On the kernels (sliced with the top-left band, which lies off the kernel's diagonal for T < S), including
    jax.nn's rank-2 and rank-3 tensors and its fully masked rows."""
    q, k, v = _qkv(seq_q=16, seq_k=40)
    rng = np.random.default_rng(0)
    bias = None if bias_shape is None else jnp.asarray(rng.standard_normal(bias_shape), jnp.float32)
    mask = None if mask_shape is None else jnp.asarray(rng.random(mask_shape) > 0.3)
    call = jax.jit(lambda q, k, v, b, m: jax_flash.dot_product_attention(q, k, v, b, m, **band))
    assert "jax_flash_attention" in call.lower(q, k, v, bias, mask).as_text()
    _close(call(q, k, v, bias, mask), jax.nn.dot_product_attention(q, k, v, bias, mask, **band))


@pytest.mark.parametrize("shape", [(24, 24), (16, 40), (40, 16)], ids=["square", "fewer-queries", "more-queries"])
def test_tensors_with_causal_and_key_lengths_run_on_the_kernels(shape):
    """Bias and mask tensors with is_causal and key lengths: the key lengths as segment ids, the band in place."""
    q, k, v = _qkv(*shape)
    rng = np.random.default_rng(1)
    bias = jnp.asarray(rng.standard_normal((1, 4, *shape)), jnp.float32)
    mask = jnp.asarray(rng.random((3, 1, 1, shape[1])) > 0.2)
    for kv_lengths in (LENGTHS_K, jnp.array([shape[1], 1, 100], jnp.int32)):
        for tensors in ((bias, None), (None, mask), (bias, mask)):
            mine, theirs, hlo = _both(q, k, v, *tensors, is_causal=True, query_seq_lengths=LENGTHS_Q,
                                      key_value_seq_lengths=kv_lengths, return_residual=True)
            _close(mine, theirs)
            assert _on_kernels(hlo)


@pytest.mark.parametrize("shape", [(24, 24), (16, 40), (40, 16)], ids=["square", "fewer-queries", "more-queries"])
@pytest.mark.parametrize("q_lengths", [None, LENGTHS_Q], ids=["keys", "both"])
def test_causal_with_key_lengths_runs_on_the_kernels(shape, q_lengths):
    """Top-left causal with key lengths (jax.nn's common padding call): two kernel calls, rows past the key length
    seeing every valid key; lengths past the sequence, 0 and in between."""
    q, k, v = _qkv(*shape)
    for kv_lengths in (LENGTHS_K, jnp.array([shape[1], 1, 100], jnp.int32)):
        mine, theirs, hlo = _both(q, k, v, is_causal=True, query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
                                  return_residual=True)
        _close(mine, theirs)
        assert _on_kernels(hlo)


@pytest.mark.parametrize("shape", [(24, 24), (16, 40), (40, 16)], ids=["square", "fewer-queries", "more-queries"])
def test_windows_with_key_lengths_run_on_the_kernels(shape):
    """Windows with key lengths that are not one array on a square band: the key lengths as segment ids."""
    q, k, v = _qkv(*shape)
    for kwargs in (dict(is_causal=True, local_window_size=(4, 0)), dict(local_window_size=(3, 5)),
                   dict(local_window_size=2, query_seq_lengths=LENGTHS_Q)):
        mine, theirs, hlo = _both(q, k, v, key_value_seq_lengths=LENGTHS_K, return_residual=True, **kwargs)
        _close(mine, theirs)
        assert _on_kernels(hlo)


def test_unbatched_gqa_and_gradients():
    q, k, v = _qkv(heads_q=6, heads_k=3)
    for kwargs in (dict(is_causal=True), dict(local_window_size=(4, 1), query_seq_lengths=LENGTHS_Q),
                   dict(is_causal=True, key_value_seq_lengths=LENGTHS_K)):
        unbatched = {n: x[:1] if n.endswith("seq_lengths") else x for n, x in kwargs.items()}
        mine, theirs, _ = _both(q[0], k[0], v[0], **unbatched)  # (T, N, H): no batch axis
        _close(mine, theirs)
        weights = jnp.cos(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.shape)
        grads = [jax.grad(lambda *a: jnp.sum(fn(*a, **kwargs) * weights), argnums=(0, 1, 2))(q, k, v)
                 for fn in (jax_flash.dot_product_attention, jax.nn.dot_product_attention)]
        _close(grads[0], grads[1], rtol=1e-4, atol=1e-5)


def test_bad_arguments_are_clear_errors_under_jax_nns_names():
    q, k, v = _qkv()
    cases = [
        (dict(implementation="pallas"), ValueError, re.escape("implementation must be one of (None, 'xla', 'cudnn')")),
        (dict(query_seq_lengths=jnp.array([3, 4], jnp.int32)), ValueError,
         re.escape("query_seq_lengths must be an int32 array of shape (batch,) = (3,), got int32(2,)")),
        (dict(key_value_seq_lengths=jnp.array([3, 4, 5], jnp.float32)), ValueError,
         re.escape("key_value_seq_lengths must be an int32 array of shape (batch,) = (3,), got float32(3,)")),
        (dict(local_window_size=(1, 2, 3)), ValueError, "local_window_size must be an int or a pair of ints"),
        (dict(scale="0.1"), TypeError, "scale must be a real number or None, got '0.1'"),
        (dict(is_causal="yes"), TypeError, "is_causal must be a bool, got 'yes'"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            jax_flash.dot_product_attention(q, k, v, **kwargs)


# ---- Flax --------------------------------------------------------------------------------------------------------
def _flax():
    """(linen, nnx), or the test is skipped where flax is not installed (it is a test extra)."""
    pytest.importorskip("flax")
    from flax import linen, nnx
    return linen, nnx


def _padding_mask(batch, seq, lengths):
    linen, _ = _flax()
    valid = jnp.arange(seq)[None, :] < lengths[:, None]  # (B, S)
    return linen.make_attention_mask(valid, valid)  # (B, 1, S, S)


@pytest.fixture
def float32_on_cpu():
    """Flax's modules default to float32, which only the CPU path takes: these tests run there also where a GPU is
    the default device."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.mark.parametrize("masking", ["causal", "padding", "none"])
def test_linen_attention_fn_equals_flax_default(masking, float32_on_cpu):
    linen, _ = _flax()
    x = jax.random.normal(jax.random.PRNGKey(1), (3, 24, 64), jnp.float32)
    mask = {"causal": linen.make_causal_mask(jnp.ones((3, 24))),
            "padding": _padding_mask(3, 24, jnp.array([24, 5, 13])), "none": None}[masking]
    default = linen.MultiHeadDotProductAttention(num_heads=4, qkv_features=64)
    ours = linen.MultiHeadDotProductAttention(num_heads=4, qkv_features=64, attention_fn=jax_flash.flax.attention_fn)
    params = default.init(jax.random.PRNGKey(0), x, mask=mask)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _close(ours.apply(params, x, mask=mask), default.apply(params, x, mask=mask), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("masking", ["causal-flag", "causal-mask", "padding"])
def test_nnx_attention_fn_equals_flax_default(masking, float32_on_cpu):
    _, nnx = _flax()
    if masking == "causal-flag" and "is_causal" not in inspect.signature(nnx.MultiHeadAttention.__call__).parameters:
        pytest.skip("this flax's nnx.MultiHeadAttention has no is_causal argument (flax 0.12.8 has)")
    x = jax.random.normal(jax.random.PRNGKey(2), (3, 24, 64), jnp.float32)
    kwargs = dict(num_heads=4, in_features=64, qkv_features=64, decode=False)
    default = nnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0))
    ours = nnx.MultiHeadAttention(**kwargs, attention_fn=jax_flash.flax.attention_fn, rngs=nnx.Rngs(0))
    call = {"causal-flag": dict(is_causal=True), "causal-mask": dict(mask=nnx.make_causal_mask(jnp.ones((3, 24)))),
            "padding": dict(mask=_padding_mask(3, 24, jnp.array([24, 5, 13])))}[masking]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _close(ours(x, **call), default(x, **call), rtol=1e-4, atol=1e-5)


def test_attention_given_to_linen_honours_its_mask(float32_on_cpu):
    """Linen passes `mask=` to an attention_fn that names it: jax_flash.attention applies it as a mask tensor (it
    once ignored it, giving unmasked attention)."""
    linen, _ = _flax()
    x = jax.random.normal(jax.random.PRNGKey(3), (2, 16, 64), jnp.float32)
    kwargs = dict(num_heads=4, qkv_features=64)
    ours = linen.MultiHeadDotProductAttention(**kwargs, attention_fn=jax_flash.attention)
    default = linen.MultiHeadDotProductAttention(**kwargs)
    params = default.init(jax.random.PRNGKey(0), x)
    mask = linen.make_causal_mask(jnp.ones((2, 16)))
    _close(ours.apply(params, x, mask=mask), default.apply(params, x, mask=mask), rtol=1e-4, atol=1e-5)
    unmasked = default.apply(params, x)
    assert not np.allclose(np.asarray(ours.apply(params, x, mask=mask)), np.asarray(unmasked), atol=1e-3)


def test_flax_dropout_and_sown_weights_are_refused():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="has no attention dropout"):
        jax_flash.flax.attention_fn(q, k, v, dropout_rate=0.1, deterministic=False)
    out = jax_flash.flax.attention_fn(q, k, v, dropout_rate=0.1, deterministic=True)  # inference: no dropout
    _close(out, jax.nn.dot_product_attention(q, k, v))
    with pytest.raises(ValueError, match="cannot sow attention weights"):
        jax_flash.flax.attention_fn(q, k, v, module=object())


@requires_gpu
@pytest.mark.parametrize("case", ["causal", "causal-window", "both-lengths", "causal-kv-lengths", "residual",
                                  "residual-lengths", "window-kv-lengths"])
def test_gpu_matches_jax_nn(case):
    gpu = GPU_DEVICES[0]
    q, k, v = random_qkv(3, 3, 200, 328, 8, 2, 128, jnp.bfloat16, gpu)
    mine = jax.jit(lambda *a: jax_flash.dot_product_attention(*a, **KERNEL_CASES[case]))
    theirs = jax.nn.dot_product_attention(q, k, v, **KERNEL_CASES[case])
    _close(mine(q, k, v), theirs, rtol=2e-2, atol=2e-2)
    assert _on_kernels(mine.lower(q, k, v).as_text())
