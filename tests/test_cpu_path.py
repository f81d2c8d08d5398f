"""The CPU path's own machinery: key splits merged by the log-sum-exp (few units), element conversions exact for every
fp16 value and every normal bf16 value, concurrent calls, the OpenBLAS it needs, and the benchmark's CPU numbers."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from conftest import random_qkv
from jax_flash import _primitive, benchmark_cpu, native
from jax_flash.config import KernelConfig
from jax_flash.reference import attention_reference

CPU = jax.devices("cpu")[0]


def _compare(out, ref, lse=None, ref_lse=None, atol=2e-5):
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=atol, rtol=atol)
    if lse is not None:
        lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
        finite = np.isfinite(ref_lse)
        np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=atol, rtol=atol)


@pytest.mark.parametrize("cfg", [None, KernelConfig(block_q=64, block_kv=32, num_warps=4)])
@pytest.mark.parametrize("features", [{}, {"causal": True}, {"window": (40, 7)}, {"softcap": 3.0},
                                      {"causal": True, "lengths": True}])
def test_few_units_split_their_keys(cfg, features):
    # one query block per (batch, head) and far more keys than one tile: the keys are split across the workers and
    # merged; causal rows, a window and short lengths leave some splits without a visible key
    features = dict(features)
    lengths = features.pop("lengths", False)
    q, k, v = random_qkv(3, 2, 5, 1500, 2, 1, 64, jnp.float32, CPU)
    extra = {"q_lengths": jnp.array([5, 2], jnp.int32), "kv_lengths": jnp.array([1500, 37], jnp.int32)} \
        if lengths else {}
    out, lse = jax_flash.attention(q, k, v, cfg, return_lse=True, **features, **extra)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, **features, **extra)
    _compare(out, ref, lse, ref_lse)


def test_many_units_in_order_of_work():
    # causal with lengths: units differ in work and are handed out longest first; each lands in its own place
    q, k, v = random_qkv(4, 3, 700, 900, 4, 2, 32, jnp.float32, CPU)
    lengths = {"q_lengths": jnp.array([700, 3, 450], jnp.int32), "kv_lengths": jnp.array([900, 600, 1], jnp.int32)}
    cfg = KernelConfig(block_q=64, block_kv=64, num_warps=4)
    out, lse = jax_flash.attention(q, k, v, cfg, causal=True, return_lse=True, **lengths)
    ref, ref_lse = attention_reference(q, k, v, causal=True, return_lse=True, **lengths)
    _compare(out, ref, lse, ref_lse)


def _identity_call(v):
    """attention with one query and one key of score 0: out = v exactly, whatever the dtype's bits."""
    q = jnp.zeros((1, 1, 1, v.shape[-1]), v.dtype)
    return jax_flash.attention(jax.device_put(q, CPU), jax.device_put(q, CPU), jax.device_put(v, CPU))


def test_every_fp16_value_round_trips():
    bits = np.arange(1 << 16, dtype=np.uint16)
    v = bits.view(np.float16).reshape(1, 1, 1, -1)  # every fp16: zeros, subnormals, normals, infinities, NaNs
    out = np.asarray(_identity_call(jnp.asarray(v))).reshape(-1)
    nan = np.isnan(v.reshape(-1))
    np.testing.assert_array_equal(np.isnan(out), nan)
    np.testing.assert_array_equal(out[~nan], v.reshape(-1)[~nan])  # (-0 comes back as +0: 0 + 1 * -0 = +0)


def test_every_normal_bf16_value_round_trips():
    bits = np.arange(1 << 16, dtype=np.uint32)
    values = (bits << 16).astype(np.uint32).view(np.float32)
    # bf16 subnormals are float32 subnormals, which XLA's CPU threads flush to zero; every other value is exact
    keep = (np.abs(values) >= np.finfo(np.float32).tiny) | (values == 0) | ~np.isfinite(values)
    v = jnp.asarray(values[keep]).astype(jnp.bfloat16).reshape(1, 1, 1, -1)  # exact: the values are bf16
    out = np.asarray(_identity_call(v).astype(jnp.float32)).reshape(-1)
    expected = values[keep]
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(out), nan)
    np.testing.assert_array_equal(out[~nan], expected[~nan])


@pytest.mark.parametrize("magnitude", [60000.0, 1e-4])  # normal results; subnormal fp16 results
def test_fp16_rounding_of_the_output(magnitude):
    # three keys of score 0: out = (v0 + v1 + v2) * fp32(1/3), exact sums, rounded to fp16 to nearest even (numpy's
    # cast) on the normal path and on the subnormal one
    values = np.linspace(-magnitude, magnitude, 3000).astype(np.float16).reshape(1, 3, 1, 1000)
    q = jax.device_put(jnp.zeros((1, 1, 1, 1000), jnp.float16), CPU)
    out = np.asarray(jax_flash.attention(q, jnp.zeros((1, 3, 1, 1000), jnp.float16), jnp.asarray(values)))
    total = values.astype(np.float32).sum(axis=1, keepdims=True, dtype=np.float32)
    expected = (total * (np.float32(1) / np.float32(3))).astype(np.float16)
    np.testing.assert_array_equal(out.view(np.uint16), expected.view(np.uint16))


def test_concurrent_calls_agree():
    q, k, v = random_qkv(5, 2, 300, 700, 4, 2, 64, jnp.bfloat16, CPU)
    expected = np.asarray(jax_flash.attention(q, k, v, causal=True).astype(jnp.float32))
    results, errors = [None] * 6, []

    def call(i):
        try:
            results[i] = np.asarray(jax_flash.attention(q, k, v, causal=True).astype(jnp.float32))
        except Exception as error:  # (collected: a thread's exception would be lost)
            errors.append(error)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and not any(t.is_alive() for t in threads)
    for r in results:
        np.testing.assert_array_equal(r, expected)


def test_missing_openblas_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(native, "OPENBLAS_CORE", None)
    monkeypatch.setattr(native, "OPENBLAS_ERROR", "the scipy-openblas32 package is not installed (simulated)")
    q, k, v = random_qkv(6, 1, 8, 8, 1, 1, 16, jnp.float32, CPU)
    with pytest.raises(RuntimeError, match=r"needs OpenBLAS from the scipy-openblas32 package .*\(simulated\)"):
        jax.jit(lambda q, k, v: jax_flash.attention(q, k, v)).lower(q, k, v)
    assert _primitive  # the lowering rule that raised


def test_openblas_is_loaded_and_named():
    assert native.OPENBLAS_CORE, native.OPENBLAS_ERROR
    assert native.OPENBLAS_ERROR is None


def test_benchmark_cpu_ceiling_and_peak_memory():
    assert benchmark_cpu.matmul_gflops(n=256, reps=2) > 0
    assert "cores)" in benchmark_cpu.machine_name()
    for impl in ("jax_flash", "xla"):
        r = benchmark_cpu.peak_memory_mb(impl, 256, heads=2, head_dim=32)
        assert r["error"] is None, r
        assert r["peak_mb"] >= r["inputs_peak_mb"] > 0
