"""The semantics grid (causal, windows, softcap, GQA/MQA, any lengths, padding lengths, log-sum-exp, head dims):
jax_flash.attention against the fp32 reference (jax_flash.reference) and, where the semantics coincide, against
jax.nn.dot_product_attention. Runs on CPU always and on the GPU when one is visible."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash.config import SM90_CONFIGS, KernelConfig
from conftest import GPU_DEVICES, assert_flash_close, random_qkv

DTYPES = [jnp.float16, jnp.bfloat16]
HEAD_DIMS = [64, 128, 256]
SEQ_PAIRS = [(1, 1), (17, 17), (113, 203), (203, 113), (127, 129), (1, 1025), (1025, 1023)]
FEATURES = {  # name -> attention keyword arguments ("lengths" draws padding lengths per batch row)
    "plain": {},
    "causal": {"causal": True},
    "window": {"window": (7, 3)},
    "causal_window": {"causal": True, "window": (16, -1)},
    "right_window": {"window": (-1, 5)},
    "softcap": {"softcap": 5.0},
    "causal_softcap_lengths": {"causal": True, "softcap": 3.0, "lengths": True},
    "lengths": {"lengths": True},
    "diagonal_lengths": {"window": (0, 0), "lengths": True},
}
HEADS = [(2, 2), (4, 2), (4, 1)]  # MHA, GQA, MQA: cycled over the grid so each appears with every feature


def run_case(device, dtype, head_dim, seq_q, seq_k, feature, heads, return_lse, cfg=None):
    kwargs = dict(FEATURES[feature])
    batch = 2
    q, k, v = random_qkv(seq_q * 31 + seq_k + head_dim, batch, seq_q, seq_k, *heads, head_dim, dtype, device)
    if kwargs.pop("lengths", False):
        kwargs["q_lengths"] = jax.device_put(jnp.asarray([seq_q, max(seq_q // 2, 1)], jnp.int32), device)
        kwargs["kv_lengths"] = jax.device_put(jnp.asarray([max(seq_k - 3, 0), seq_k // 3], jnp.int32), device)
    result = jax.jit(lambda q, k, v, ql, kl: jax_flash.attention(
        q, k, v, cfg, return_lse=return_lse, q_lengths=ql, kv_lengths=kl,
        **{n: x for n, x in kwargs.items() if n not in ("q_lengths", "kv_lengths")}))(
        q, k, v, kwargs.get("q_lengths"), kwargs.get("kv_lengths"))
    out, lse = result if return_lse else (result, None)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_flash_close(out, q, k, v, **kwargs)
    if return_lse:
        cpu = jax.devices("cpu")[0]
        _, lse_ref = jax_flash.attention_reference(*(jax.device_put(x, cpu) for x in (q, k, v)), return_lse=True,
                                                   **{n: jax.device_put(x, cpu) if hasattr(x, "shape") else x
                                                      for n, x in kwargs.items()})
        lse, lse_ref = np.asarray(jax.device_put(lse, cpu)), np.asarray(lse_ref)
        assert lse.shape == (batch, heads[0], seq_q) and lse.dtype == np.float32
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))  # rows that see nothing: -inf
        finite = np.isfinite(lse_ref)
        assert np.isfinite(lse[finite]).all()
        np.testing.assert_allclose(lse[finite], lse_ref[finite], atol=2e-3, rtol=1e-3)


GRID = [(dtype, hd, sq, sk, feature, HEADS[i % 3], i % 2 == 0)
        for i, (dtype, hd, (sq, sk), feature) in enumerate(itertools.product(DTYPES, HEAD_DIMS, SEQ_PAIRS, FEATURES))]


@pytest.mark.parametrize("dtype,head_dim,seq_q,seq_k,feature,heads,return_lse", GRID,
                         ids=[f"{jnp.dtype(g[0]).name}-d{g[1]}-{g[2]}x{g[3]}-{g[4]}-h{g[5][0]}.{g[5][1]}"
                              f"{'-lse' if g[6] else ''}" for g in GRID])
def test_semantics_grid(device, dtype, head_dim, seq_q, seq_k, feature, heads, return_lse):
    run_case(device, dtype, head_dim, seq_q, seq_k, feature, heads, return_lse)


def _hopper():
    return bool(GPU_DEVICES) and str(getattr(GPU_DEVICES[0], "compute_capability", "")).startswith("9")


SM90_GRID = [g for g in GRID if g[1] in SM90_CONFIGS]  # head dims 64, 128 and 256


@pytest.mark.skipif(not _hopper(), reason="the sm90 family needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("dtype,head_dim,seq_q,seq_k,feature,heads,return_lse", SM90_GRID,
                         ids=[f"{jnp.dtype(g[0]).name}-d{g[1]}-{g[2]}x{g[3]}-{g[4]}-h{g[5][0]}.{g[5][1]}"
                              f"{'-lse' if g[6] else ''}" for g in SM90_GRID])
def test_semantics_grid_sm90(dtype, head_dim, seq_q, seq_k, feature, heads, return_lse):
    """The same grid on the Hopper family (csrc/sm90/), cycling over every sm90 config this build compiled for the
    dtype and head dim (the shipped ones, plus the candidates of a sweep build)."""
    compiled = sorted({k.config for k in jax_flash.supported_configs()
                       if k.family == "sm90" and k.dtype == jnp.dtype(dtype).name and k.head_dim == head_dim},
                      key=lambda c: c.short_name())
    assert set(SM90_CONFIGS[head_dim]) <= set(compiled)
    cfg = compiled[GRID.index((dtype, head_dim, seq_q, seq_k, feature, heads, return_lse)) % len(compiled)]
    run_case(GPU_DEVICES[0], dtype, head_dim, seq_q, seq_k, feature, heads, return_lse, cfg=cfg)


# Three consumer warpgroups (192-row tiles) with a right bound align their query blocks to the end of the rows from
# 1024 query rows (csrc/sm90/launch.cuh, q_block_shift): block 0 holds 64 rows at 1023 and 1216, 128 at 1030, and no
# shift at 1152 (a multiple of 192) or 1100 (52 short: less than a consumer's 64 rows).
SHIFT_CASES = [(sq, sk, feature) for sq, sk in [(1023, 1023), (1030, 1030), (1216, 1216), (1152, 1152), (1100, 1100),
                                                (1030, 1500), (1216, 1030)]
               for feature in ("causal", "right_window", "causal_softcap_lengths")]


@pytest.mark.skipif(not _hopper(), reason="the sm90 family needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("seq_q,seq_k,feature", SHIFT_CASES, ids=[f"{a}x{b}-{f}" for a, b, f in SHIFT_CASES])
def test_sm90_three_consumers_short_first_query_block(seq_q, seq_k, feature):
    cfg = KernelConfig.sm90(block_kv=128, consumer_warpgroups=3)
    run_case(GPU_DEVICES[0], jnp.bfloat16, 64, seq_q, seq_k, feature, (4, 2), True, cfg=cfg)


# The split tail (csrc/sm90/split_tail.cuh): equal-cost tiles (no mask beyond the key length) of the head-dim-
# 128 non-causal config, more of them than SMs and not a multiple (2 x 17 x 9 = 306, 2 x 17 x 5 = 170 and 2 x 16 x 16
# = 512 tiles over the 132 SMs of an H100 / H200), >= 16 key blocks: the last tiles are cut between thread blocks and
# merged from partials. Unmasked, soft-capped, masked and soft-capped (2000 keys), MQA; lse too. (The masked kernel
# without softcap, 1100 x 2000 in fp16, takes Q from registers and does not split: the same shape unsplit.)
SPLIT_CASES = [(jnp.bfloat16, 1152, 2048, "plain", (17, 17)), (jnp.float16, 1152, 2048, "plain", (17, 17)),
               (jnp.bfloat16, 640, 2048, "softcap", (17, 1)), (jnp.bfloat16, 1100, 2000, "softcap", (17, 17)),
               (jnp.float16, 1100, 2000, "plain", (17, 17)), (jnp.bfloat16, 2048, 4096, "plain", (16, 16))]


@pytest.mark.skipif(not _hopper(), reason="the sm90 family needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("dtype,seq_q,seq_k,feature,heads", SPLIT_CASES,
                         ids=[f"{jnp.dtype(c[0]).name}-{c[1]}x{c[2]}-{c[3]}-h{c[4][0]}.{c[4][1]}" for c in SPLIT_CASES])
def test_sm90_split_tail(dtype, seq_q, seq_k, feature, heads):
    run_case(GPU_DEVICES[0], dtype, 128, seq_q, seq_k, feature, heads, True)


@pytest.mark.skipif(not _hopper(), reason="the sm90 family needs an sm_90 GPU (H100/H200)")
def test_sm90_back_to_back_launches_agree():
    """The sm90 kernels draw their tiles from a counter in XLA's scratch memory, zeroed on the stream before each
    launch, or walk a static stride (csrc/sm90/launch.cuh): launches of different tile counts (more tiles than SMs,
    so blocks take several, and fewer) and masks, interleaved on one stream, must each compute every tile,
    identically every time."""
    gpu = GPU_DEVICES[0]
    # (3 x 12 = 36 causal (batch, head) pairs: heaviest-first sections of at most 16 pairs, the last one partial)
    cases = [(2, 2048, 8, 128, True), (1, 256, 2, 64, False), (2, 2048, 8, 128, False), (1, 1000, 3, 256, True),
             (3, 640, 12, 128, True)]
    inputs = [random_qkv(7 + i, b, s, s, h, h, d, jnp.bfloat16, gpu) for i, (b, s, h, d, _) in enumerate(cases)]
    fns = [jax.jit(lambda q, k, v, c=c: jax_flash.attention(q, k, v, causal=c[4])) for c in cases]
    first = [np.asarray(f(*x).astype(jnp.float32)) for f, x in zip(fns, inputs)]
    for (b, s, h, d, causal), (q, k, v), out in zip(cases, inputs, first):
        assert_flash_close(jnp.asarray(out, jnp.bfloat16), q, k, v, causal=causal)
    for _ in range(3):
        for f, x, out in zip(fns, inputs, first):
            np.testing.assert_array_equal(np.asarray(f(*x).astype(jnp.float32)), out)


def test_rows_that_see_nothing_are_zero_with_lse_neg_inf(device):
    # causal with Sq > Sk: the first Sq - Sk rows see no key; a (0, 0) window with kv_lengths 0 sees nothing at all.
    q, k, v = random_qkv(1, 1, 40, 10, 2, 2, 64, jnp.float16, device)
    out, lse = jax_flash.attention(q, k, v, causal=True, return_lse=True)
    out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
    assert (out[:, :30] == 0).all() and np.isneginf(lse[:, :, :30]).all()
    assert np.isfinite(out).all() and np.isfinite(lse[:, :, 30:]).all()
    out, lse = jax_flash.attention(q, k, v, kv_lengths=jnp.zeros((1,), jnp.int32), return_lse=True)
    assert (np.asarray(out.astype(jnp.float32)) == 0).all() and np.isneginf(np.asarray(lse)).all()


def test_matches_jax_nn_where_semantics_coincide(device):
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    q, k, v = random_qkv(2, 2, 96, 96, 4, 2, 64, jnp.bfloat16, device)
    cases = [
        ({"causal": True}, {"is_causal": True}),
        ({"window": (9, 4)}, {"local_window_size": (9, 4)}),
        ({"causal": True, "window": (9, -1)}, {"is_causal": True, "local_window_size": (9, 0)}),
    ]
    for ours, theirs in cases:
        expected = jax.nn.dot_product_attention(f32(q), f32(k), f32(v), **theirs)
        got = jax_flash.attention(q, k, v, **ours)
        np.testing.assert_allclose(np.asarray(f32(got)), np.asarray(expected), atol=3e-2, rtol=0, err_msg=str(ours))
    # padding lengths: compare the rows both define (jax.nn gives padded query rows no fixed value)
    ql, kl = jnp.asarray([96, 50], jnp.int32), jnp.asarray([70, 96], jnp.int32)
    expected = jax.nn.dot_product_attention(f32(q), f32(k), f32(v), query_seq_lengths=ql, key_value_seq_lengths=kl)
    got = f32(jax_flash.attention(q, k, v, q_lengths=jax.device_put(ql, device),
                                  kv_lengths=jax.device_put(kl, device)))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(expected[0]), atol=3e-2, rtol=0)
    np.testing.assert_allclose(np.asarray(got[1, :50]), np.asarray(expected[1, :50]), atol=3e-2, rtol=0)
    assert (np.asarray(got[1, 50:]) == 0).all()
    # bottom-right causal with Sq != Sk equals jax.nn with the explicit mask
    q, k, v = random_qkv(3, 1, 30, 80, 2, 2, 64, jnp.float16, device)
    mask = jnp.arange(80)[None, :] <= jnp.arange(30)[:, None] + 50
    expected = jax.nn.dot_product_attention(f32(q), f32(k), f32(v), mask=mask[None, None])
    got = jax_flash.attention(q, k, v, causal=True)
    np.testing.assert_allclose(np.asarray(f32(got)), np.asarray(expected), atol=1e-2, rtol=0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("scale", [0.3, 2.0, 0.0, -2.0])
def test_softmax_scale(device, scale, dtype):
    # Any finite scale, as in jax.nn.dot_product_attention. A negative one turns each row's largest raw score into
    # its smallest scaled one (exp(scale * (s - max s)) would reach 2^46 here and overflow fp16); 0 averages V.
    # 200 keys: several key blocks, so the running maximum and the O rescale are exercised.
    q, k, v = random_qkv(4, 1, 200, 200, 2, 2, 64, dtype, device)
    out, lse = jax_flash.attention(q, k, v, softmax_scale=scale, return_lse=True)
    assert_flash_close(out, q, k, v, softmax_scale=scale)
    _, lse_ref = jax_flash.attention_reference(*(jax.device_put(x, jax.devices("cpu")[0]) for x in (q, k, v)),
                                               softmax_scale=scale, return_lse=True)
    np.testing.assert_allclose(np.asarray(jax.device_put(lse, jax.devices("cpu")[0])), np.asarray(lse_ref),
                               atol=2e-2, rtol=1e-3)


def test_lengths_are_traced_and_do_not_recompile(device):
    q, k, v = random_qkv(5, 2, 64, 64, 2, 2, 64, jnp.float16, device)
    traces = []

    @jax.jit
    def fn(q, k, v, kl):
        traces.append(1)  # (runs once per trace: a new trace would compile again)
        return jax_flash.attention(q, k, v, kv_lengths=kl, causal=True)

    for lengths in ([64, 10], [3, 64], [0, 1]):
        kl = jax.device_put(jnp.asarray(lengths, jnp.int32), device)
        assert_flash_close(fn(q, k, v, kl), q, k, v, kv_lengths=kl, causal=True)
    assert len(traces) == 1


@pytest.mark.parametrize("kwargs,error,message", [
    ({"window": (3,)}, ValueError, r"window must be a pair of ints \(left, right\)"),
    ({"window": (-2, 0)}, ValueError, r"window sizes must be >= -1"),
    ({"softcap": 0.0}, ValueError, "softcap must be a float32 normal number > 0 .* got 0.0"),
    ({"softcap": float("nan")}, ValueError, "softcap must be a float32 normal number > 0 .* got nan"),
    ({"softmax_scale": float("inf")}, ValueError, "softmax_scale must be a finite number"),
    ({"causal": 1}, TypeError, "causal must be a bool"),
    ({"q_lengths": jnp.ones((3,), jnp.int32)}, ValueError, r"q_lengths must be an int32 array of shape \(batch,\)"),
    ({"kv_lengths": jnp.ones((2,), jnp.float32)}, ValueError, "kv_lengths must be an int32 array"),
])
def test_bad_feature_arguments(kwargs, error, message):
    q, k, v = random_qkv(0, 2, 8, 8, 2, 2, 64, jnp.float16)
    with pytest.raises(error, match=message):
        jax_flash.attention(q, k, v, **kwargs)
