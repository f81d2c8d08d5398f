"""FP8 (float8_e4m3fn) inputs with descale factors on the CPU path: the semantics of the dequantised inputs (against
attention_reference given the same descales), with every mask, paged caches, jit and vmap, and clear errors; the
routing of GPU calls (lowered for CUDA here: the FP8 kernel on Hopper, else the 16-bit kernels). The FP8 kernel
itself (its V^T written in shared memory included): tests/test_fp8_gpu.py."""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import fp8
from test_decode import paged_cache

CPU = jax.devices("cpu")[0]


@pytest.fixture(autouse=True)
def on_cpu():
    """FP8 runs on the CPU path: these tests put it there also where a GPU is the default device."""
    with jax.default_device(CPU):
        yield
# The output's rounding (bfloat16: 2^-8 relative) over outputs of magnitude up to a few units, and float32's
TOLERANCE = {jnp.bfloat16: 3e-2, jnp.float16: 4e-3, jnp.float32: 1e-4}


def _fp8_inputs(seed, batch=2, seq_q=70, seq_k=90, heads_q=4, heads_k=2, head_dim=64):
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    with jax.default_device(CPU):
        q, k, v = (
            (2.0 * jax.random.normal(key, (batch, seq, heads, head_dim))).astype(jnp.float8_e4m3fn)
            for key, seq, heads in ((keys[0], seq_q, heads_q), (keys[1], seq_k, heads_k), (keys[2], seq_k, heads_k)))
        descales = [jax.random.uniform(key, (batch, heads_k), jnp.float32, 0.05, 2.0) for key in keys[3:]]
    return q, k, v, descales


def _check(out, lse, q, k, v, out_dtype, **kwargs):
    ref, ref_lse = jax_flash.attention_reference(q, k, v, return_lse=True, **kwargs)
    assert out.dtype == out_dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=TOLERANCE[out_dtype],
                               rtol=TOLERANCE[out_dtype])
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    seen = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[seen], ref_lse[seen], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("scaled", [True, False], ids=["descales", "none"])
def test_fp8_equals_the_dequantised_reference(out_dtype, heads, scaled):
    q, k, v, descales = _fp8_inputs(1, heads_q=heads[0], heads_k=heads[1])
    names = dict(zip(("q_descale", "k_descale", "v_descale"), descales)) if scaled else {}
    out, lse = jax_flash.attention(q, k, v, causal=True, return_lse=True,
                                   out_dtype=None if out_dtype == jnp.bfloat16 else out_dtype, **names)
    _check(out, lse, q, k, v, out_dtype, causal=True, **names)


def test_fp8_with_every_mask_and_a_paged_cache():
    """Window, softcap, both lengths and segment ids, and the same call over a shuffled paged pool (the descales
    stay per sequence: the pool's pages are only widened)."""
    q, k, v, descales = _fp8_inputs(2, seq_q=50, seq_k=130)
    names = dict(zip(("q_descale", "k_descale", "v_descale"), descales))
    ids = jnp.cumsum(jax.random.bernoulli(jax.random.PRNGKey(3), 0.05, (2, 130)).astype(jnp.int32), axis=1)
    kwargs = dict(causal=True, window=(60, -1), softcap=10.0, q_lengths=jnp.array([50, 31], jnp.int32),
                  kv_lengths=jnp.array([130, 100], jnp.int32))
    out, lse = jax_flash.attention(q, k, v, return_lse=True, q_segment_ids=ids[:, 80:], kv_segment_ids=ids,
                                   **kwargs, **names)
    _check(out, lse, q, k, v, jnp.bfloat16, q_segment_ids=ids[:, 80:], kv_segment_ids=ids, **kwargs, **names)
    k_pages, v_pages, table = paged_cache(k.astype(jnp.float32), v.astype(jnp.float32), 16, seed=4)
    k_pages, v_pages = k_pages.astype(jnp.float8_e4m3fn), v_pages.astype(jnp.float8_e4m3fn)
    paged, paged_lse = jax_flash.attention(q, k_pages, v_pages, page_table=table, return_lse=True, **kwargs,
                                           **names)
    plain, plain_lse = jax_flash.attention(q, k, v, return_lse=True, **kwargs, **names)
    np.testing.assert_allclose(np.asarray(paged, np.float32), np.asarray(plain, np.float32), atol=1e-2)
    np.testing.assert_allclose(np.asarray(paged_lse), np.asarray(plain_lse), atol=1e-5)


def test_fp8_under_jit_and_vmap():
    q, k, v, (qd, kd, vd) = _fp8_inputs(5)
    call = lambda q, k, v, qd, kd, vd: jax_flash.attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
    eager = call(q, k, v, qd, kd, vd)
    np.testing.assert_array_equal(np.asarray(jax.jit(call)(q, k, v, qd, kd, vd), np.float32),
                                  np.asarray(eager, np.float32))
    stacked = [jnp.stack([x, x]) for x in (q, k, v, qd, kd, vd)]
    mapped = jax.vmap(call)(*stacked)
    np.testing.assert_allclose(np.asarray(mapped[1], np.float32), np.asarray(eager, np.float32), atol=1e-2)


def test_fp8_errors():
    q, k, v, (qd, kd, vd) = _fp8_inputs(6)
    with pytest.raises(ValueError, match=r"k_descale must be a float32 array of shape \(batch, heads_k\) = \(2, 2\)"):
        jax_flash.attention(q, k, v, k_descale=kd[:, :1])
    with pytest.raises(ValueError, match="q_descale must be a float32 array"):
        jax_flash.attention(q, k, v, q_descale=qd.astype(jnp.float16))
    with pytest.raises(ValueError, match="out_dtype must be one of"):
        jax_flash.attention(q, k, v, out_dtype=jnp.int8)
    with pytest.raises(TypeError, match="q, k and v must share one dtype"):
        jax_flash.attention(q, k.astype(jnp.bfloat16), v)
    plain = q.astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="v_descale applies to float8_e4m3fn inputs only"):
        jax_flash.attention(plain, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), v_descale=vd)
    with pytest.raises(ValueError, match="out_dtype=.* applies to float8_e4m3fn inputs only"):
        jax_flash.attention(plain, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), out_dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"v_descale must be finite and > 0 \(a quantisation scale\); "
                                         r"v_descale\[1, 0\] = -1.0"):
        jax_flash.attention(q, k, v, v_descale=vd.at[1, 0].set(-1.0))
    with pytest.raises(ValueError, match="q_descale must be finite and > 0"):
        jax_flash.attention(q, k, v, q_descale=qd.at[0, 1].set(jnp.nan))
    with pytest.raises(TypeError, match="float8_e5m2; supported dtypes are float16 and bfloat16"):
        e5m2 = [x.astype(jnp.float32).astype(jnp.float8_e5m2) for x in (q, k, v)]
        jax_flash.attention(*e5m2)


def _as_on_gpu(monkeypatch, hopper=True):
    """The default device reported as a (Hopper) GPU."""
    monkeypatch.setattr(fp8, "_default_platform", lambda: "gpu")
    monkeypatch.setattr(fp8, "_on_hopper", lambda: hopper)


def test_fp8_on_hopper_lowers_to_the_fp8_kernel(monkeypatch):
    q, k, v, (qd, kd, vd) = _fp8_inputs(7, head_dim=128)
    lengths = jnp.array([70, 20], jnp.int32)
    _as_on_gpu(monkeypatch)
    call = lambda *a: jax_flash.attention(*a, causal=True, kv_lengths=lengths, q_descale=qd, k_descale=kd,
                                          v_descale=vd)
    hlo = jax.jit(call).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.custom_call @jax_flash_attention_fp8(" in hlo
    assert "@jax_flash_attention(" not in hlo
    mapped = jax.make_jaxpr(jax.vmap(lambda q, k, v: jax_flash.attention(q, k, v)))(*(jnp.stack([x, x])
                                                                                       for x in (q, k, v)))
    assert "jax_flash_attention_fp8" in str(mapped)


def test_fp8_kernel_config_comes_from_cfg(monkeypatch):
    """cfg=None lowers FP8_CONFIGS' config of the head dim at any key length; an sm90 cfg its own (the handler finds
    it among the compiled FP8 kernels or says which are); an sm80 cfg runs the 16-bit kernels."""
    q, k, v, _ = _fp8_inputs(10, head_dim=128)
    _as_on_gpu(monkeypatch)
    lower = lambda cfg, *qkv: jax.jit(lambda *a: jax_flash.attention(*a, cfg=cfg)).trace(*(qkv or (q, k, v))).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "stages = 2 : i64" in lower(None) and "stages = 3 : i64" in lower(jax_flash.KernelConfig.sm90(stages=3))
    for head_dim in (128, 256):
        q_d = jax.ShapeDtypeStruct((2, 64, 4, head_dim), jnp.float8_e4m3fn)
        for seq_k in (1000, 20000):
            kv = jax.ShapeDtypeStruct((2, seq_k, 2, head_dim), jnp.float8_e4m3fn)
            text = lower(None, q_d, kv, kv)
            assert "block_kv = 128 : i64" in text
            assert f"overlap = {int(head_dim == 128)} : i64" in text
    jaxpr = jax.make_jaxpr(lambda *a: jax_flash.attention(*a, cfg=jax_flash.KernelConfig()))(q, k, v)
    assert [e.primitive.name for e in jaxpr.eqns if e.primitive.name.startswith("jax_flash")] == ["jax_flash_attention"]


@pytest.mark.parametrize("case", ["head_dim_64", "softcap", "not_hopper"])
def test_fp8_calls_the_kernel_does_not_take_run_the_16_bit_kernels(monkeypatch, case):
    q, k, v, _ = _fp8_inputs(8, head_dim=64 if case == "head_dim_64" else 128)
    kwargs = {"softcap": 20.0} if case == "softcap" else {}
    _as_on_gpu(monkeypatch, hopper=case != "not_hopper")
    jaxpr = jax.make_jaxpr(lambda *a: jax_flash.attention(*a, **kwargs))(q, k, v)
    calls = [e for e in jaxpr.eqns if e.primitive.name.startswith("jax_flash_attention")]
    assert [e.primitive.name for e in calls] == ["jax_flash_attention"]
    assert all(x.aval.dtype == jnp.bfloat16 for x in calls[0].invars[:3])


def test_fp8_kernel_call_refuses_differentiation_clearly(monkeypatch):
    q, k, v, _ = _fp8_inputs(12, head_dim=128)
    _as_on_gpu(monkeypatch)
    loss = lambda q: jax_flash.attention(q.astype(jnp.float8_e4m3fn), k, v).astype(jnp.float32).sum()
    with pytest.raises(NotImplementedError, match="the FP8 kernel .* has no derivative"):
        jax.make_jaxpr(jax.grad(loss))(q.astype(jnp.float32))


def test_fp8_kernel_call_lowered_for_cpu_computes_the_cpu_path(monkeypatch):
    """The FP8 kernel's primitive lowered for the CPU (a call traced for a GPU and run on the CPU; each shard in the
    CPU sharding tests) computes what the CPU path computes: the call on the dequantised inputs."""
    q, k, v, (qd, kd, vd) = _fp8_inputs(13, head_dim=128)
    lengths = jnp.array([70, 20], jnp.int32)
    kwargs = dict(causal=True, kv_lengths=lengths, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True)
    expected_out, expected_lse = jax.jit(lambda *a: jax_flash.attention(*a, **kwargs))(q, k, v)
    _as_on_gpu(monkeypatch)
    routed = lambda *a: jax_flash.attention(*a, **kwargs)
    assert "jax_flash_attention_fp8" in str(jax.make_jaxpr(routed)(q, k, v))
    out, lse = jax.jit(routed)(q, k, v)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(expected_lse))


def test_fp8_gpu_calls_are_checked_as_16_bit_ones(monkeypatch):
    q, k, v, _ = _fp8_inputs(9, head_dim=128)
    _as_on_gpu(monkeypatch)
    with pytest.raises(ValueError, match="window sizes must be >= -1"):
        jax.make_jaxpr(lambda *a: jax_flash.attention(*a, window=(-3, 0)))(q, k, v)
    with pytest.raises(ValueError, match="kv_lengths must be an int32 array"):
        jax.make_jaxpr(lambda *a: jax_flash.attention(*a, kv_lengths=jnp.zeros((3,), jnp.int32)))(q, k, v)


def test_quantize_fp8_round_trips_within_e4m3_rounding():
    x = jax.random.normal(jax.random.PRNGKey(11), (2, 50, 4, 64), jnp.float32).astype(jnp.bfloat16)
    x = x.at[1, :, 2:].set(0)  # batch 1's second kv head group: all zeros
    x8, descale = jax_flash.quantize_fp8(x, heads_k=2)
    assert x8.dtype == jnp.float8_e4m3fn and x8.shape == x.shape
    assert descale.dtype == jnp.float32 and descale.shape == (2, 2) and float(descale[1, 1]) == 1.0
    per_head = jnp.repeat(descale, 2, axis=1)[:, None, :, None]
    back, exact = np.asarray(x8.astype(jnp.float32) * per_head), np.asarray(x, np.float32)
    # e4m3: 3 mantissa bits (relative rounding 2^-4), subnormal step 2^-9 (times the descale)
    assert (np.abs(back - exact) <= 2.0**-4 * np.abs(exact) + 2.0**-9 * np.asarray(per_head)).all()
    groups = np.abs(np.asarray(x8.astype(jnp.float32))).reshape(2, 50, 2, 2, 64).max(axis=(1, 3, 4))
    np.testing.assert_array_equal(groups, [[448, 448], [448, 0]])  # each group's largest magnitude maps to 448
    with pytest.raises(ValueError, match="heads_k=3 must divide x's 4 heads"):
        jax_flash.quantize_fp8(x, heads_k=3)


def test_fp8_example_stays_near_the_bfloat16_call():
    """examples/07_fp8.py: quantize_fp8, then the FP8 call with its descales, against the bfloat16 call."""
    path = pathlib.Path(__file__).resolve().parent.parent / "examples" / "07_fp8.py"
    spec = importlib.util.spec_from_file_location("fp8_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.run(small=True)
    assert result["dtype"] == jnp.bfloat16 and 0 < result["max_error"] < 0.1 * result["max_abs"]
