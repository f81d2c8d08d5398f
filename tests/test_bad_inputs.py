"""Edge cases a bad-input probe of the public API found: empty and zero-size inputs (under vmap too), extreme and
non-finite scalars, infinities and NaN in the data, static arguments under jit, symbolic shapes under jax.export,
sizes past the int32 limit, the CPU path's scratch memory, and a stopped gradient. CPU always; GPU when visible."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from conftest import GPU_DEVICES, random_qkv

CPU = jax.devices("cpu")[0]  # (the tests without a device parameter run on CPU, also where a GPU is the default)


def test_head_dim_zero_writes_every_lse():
    # every score is 0: a row's lse is the log of the number of keys it sees (causal: row i sees i + 1)
    q = jax.device_put(jnp.ones((1, 4, 1, 0), jnp.float32), CPU)
    for _ in range(3):  # (unwritten memory differs from call to call)
        out, lse = jax_flash.attention(q, q, q, return_lse=True)
        assert out.shape == (1, 4, 1, 0)
        np.testing.assert_allclose(np.asarray(lse), np.full((1, 1, 4), math.log(4)), rtol=1e-6)
    _, lse = jax_flash.attention(q, q, q, causal=True, return_lse=True)
    np.testing.assert_allclose(np.asarray(lse)[0, 0], np.log([1, 2, 3, 4]), rtol=1e-6)
    _, lse = jax_flash.attention(q, q[:, :0], q[:, :0], return_lse=True)  # no key at all: -inf
    assert np.all(np.isneginf(np.asarray(lse)))


@pytest.mark.parametrize("shape", [(0, 2, 20, 4, 16), (3, 2, 0, 4, 16), (3, 2, 20, 0, 16), (3, 2, 20, 4, 0)])
def test_vmap_over_zero_size_axes(shape):
    q = jax.device_put(jnp.zeros(shape, jnp.float32), CPU)
    k = jax.device_put(jnp.ones((2, 7, shape[3] if shape[3] else 1, shape[4]), jnp.float32), CPU)
    if shape[3] == 0:
        k = k[:, :, :0]
    out = jax.vmap(lambda q: jax_flash.attention(q, k, k))(q)
    assert out.shape == shape
    out, lse = jax.vmap(lambda q: jax_flash.attention(q, k, k, return_lse=True))(q)
    assert out.shape == shape and lse.shape == (shape[0], shape[1], shape[3], shape[2])


def test_softcap_and_scale_must_fit_float32():
    q, k, v = random_qkv(0, 1, 8, 8, 2, 2, 16, jnp.float32, CPU)
    with pytest.raises(ValueError, match=r"softcap must be a float32 normal number > 0 .* got 1e-39"):
        jax_flash.attention(q, k, v, softcap=1e-39)
    with pytest.raises(ValueError, match=r"softcap must be a float32 normal number > 0 .* got 1e\+39"):
        jax_flash.attention(q, k, v, softcap=1e39)
    with pytest.raises(ValueError, match=r"softmax_scale must be a finite number whose magnitude times log2\(e\) "
                                         r"fits float32 .* got 3.5e\+38"):
        jax_flash.attention(q, k, v, softmax_scale=3.5e38)
    with pytest.raises(ValueError, match="softmax_scale / softcap .* overflows float32"):
        jax_flash.attention(q, k, v, softmax_scale=1e30, softcap=1e-30)
    # the smallest normal softcap and the largest scale are accepted; large scales are exact (scores of order 1)
    assert np.isfinite(np.asarray(jax_flash.attention(q, k, v, softcap=float(np.finfo(np.float32).tiny)))).all()
    jax_flash.attention(q, k, v, softmax_scale=2.3e38)
    out = jax_flash.attention(q * 1e-30, k, v, softmax_scale=1e31)
    np.testing.assert_allclose(np.asarray(out), np.asarray(jax_flash.attention(q, k, v, softmax_scale=10.0)), atol=1e-4)


def test_scale_zero_keeps_nan_rows(device):
    q, k, v = random_qkv(1, 1, 6, 5, 2, 2, 64, jnp.bfloat16, device)
    q = q.at[0, 2, 1, 7].set(jnp.nan)
    out, lse = jax_flash.attention(q, k, v, softmax_scale=0.0, return_lse=True)
    out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
    nan_rows = np.isnan(out).any(axis=-1)  # (B, Sq, Hq)
    expected = np.zeros_like(nan_rows)
    expected[0, 2, 1] = True
    np.testing.assert_array_equal(nan_rows, expected)
    assert np.isnan(lse[0, 1, 2]) and np.isfinite(np.delete(lse.ravel(), 1 * 6 + 2)).all()
    # every other row: all scores 0, the mean of V, lse = log(5)
    mean_v = np.asarray(v.astype(jnp.float32)).mean(axis=1)  # (B, Hk, D)
    np.testing.assert_allclose(out[0, 0], mean_v[0], atol=2e-2)
    np.testing.assert_allclose(np.delete(lse.ravel(), 1 * 6 + 2), math.log(5), rtol=1e-5)


def test_infinite_score_lse_is_not_neg_inf(device):
    # +inf in q (and -inf in k) make +inf scores: the row is NaN, and its lse NaN or +inf, never the -inf of a row
    # that saw no key
    for which in ("q", "k"):
        q, k, v = random_qkv(2, 1, 4, 6, 1, 1, 64, jnp.float16, device)
        if which == "q":
            q = q.at[0, 1].set(jnp.inf)
        else:
            q, k = jnp.abs(q), k.at[0, 3].set(-jnp.inf)  # q.k = -inf * |q| -> every row sees a -inf score ...
            q = q.at[0, 1].multiply(-1)                   # ... but row 1 sees +inf
        out, lse = jax_flash.attention(q, k, v, return_lse=True)
        lse = np.asarray(lse)[0, 0]
        assert np.isnan(np.asarray(out.astype(jnp.float32))[0, 1]).all()
        assert not np.isneginf(lse[1]) and (np.isnan(lse[1]) or lse[1] == np.inf), lse


def test_static_arguments_under_jit_say_how():
    q, k, v = random_qkv(3, 1, 8, 8, 2, 2, 16, jnp.float32, CPU)
    for name, value in (("causal", True), ("return_lse", True), ("softmax_scale", 0.5), ("softcap", 5.0)):
        with pytest.raises(TypeError, match=rf"{name} must be known when the call is traced.*static_argnames"):
            jax.jit(jax_flash.attention)(q, k, v, **{name: value})
    with pytest.raises(TypeError, match="window must be known when the call is traced.*static_argnames"):
        jax.jit(lambda q, w: jax_flash.attention(q, k, v, window=(w, 0)))(q, 3)
    # marked static, they work
    out = jax.jit(jax_flash.attention, static_argnames=("causal", "softcap"))(q, k, v, causal=True, softcap=5.0)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax_flash.attention(q, k, v, causal=True, softcap=5.0)))


def test_concrete_jax_and_numpy_scalars_are_accepted():
    q, k, v = random_qkv(4, 1, 8, 8, 2, 2, 16, jnp.float32, CPU)
    expected = jax_flash.attention(q, k, v, softcap=5.0, softmax_scale=0.5, causal=True)
    for softcap, scale, causal in ((jnp.float32(5.0), jnp.float32(0.5), jnp.bool_(True)),
                                   (np.float64(5.0), np.float16(0.5), np.True_), (np.array(5.0), np.array(0.5), True)):
        out = jax_flash.attention(q, k, v, softcap=softcap, softmax_scale=scale, causal=causal)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))
    with pytest.raises(TypeError, match="softcap must be a real number"):
        jax_flash.attention(q, k, v, softcap=jnp.ones(2))
    with pytest.raises(TypeError, match="causal must be a bool"):
        jax_flash.attention(q, k, v, causal=jnp.float32(1.0))


def test_huge_window_is_unbounded():
    q, k, v = random_qkv(5, 1, 9, 12, 2, 1, 16, jnp.float32, CPU)
    expected = jax_flash.attention(q, k, v, window=(-1, 0))
    for window in ((2**63, 0), (2**31, 0), (np.int64(2**40), 0)):
        np.testing.assert_array_equal(np.asarray(jax_flash.attention(q, k, v, window=window)), np.asarray(expected))


def test_export_with_symbolic_sequence_length():
    q_shape = jax.export.symbolic_shape("b, s, 2, 16")
    spec = jax.ShapeDtypeStruct(q_shape, jnp.float32)
    exported = jax.export.export(jax.jit(jax_flash.attention),
                                 disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("jax_flash_attention")],
                                 platforms=["cpu"])(spec, spec, spec)
    q, k, v = random_qkv(6, 2, 33, 33, 2, 2, 16, jnp.float32, CPU)
    np.testing.assert_allclose(np.asarray(exported.call(q, k, v)), np.asarray(jax_flash.attention(q, k, v)),
                               rtol=1e-6, atol=1e-6)


def test_export_serialise_deserialise_run():  # the README's example
    q, k, v = random_qkv(7, 1, 40, 40, 4, 2, 32, jnp.float32, CPU)
    exported = jax.export.export(
        jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, causal=True)),
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("jax_flash_attention")], platforms=["cpu"])(q, k, v)
    restored = jax.export.deserialize(exported.serialize())
    np.testing.assert_array_equal(np.asarray(restored.call(q, k, v)),
                                  np.asarray(jax_flash.attention(q, k, v, causal=True)))


def test_export_of_a_gradient_allows_the_backward_call():
    q, k, v = random_qkv(9, 1, 24, 40, 2, 1, 16, jnp.float32, CPU)
    loss = lambda q, k, v: (jax_flash.attention(q, k, v, causal=True) ** 2).sum()  # noqa: E731
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    checks = [jax.export.DisabledSafetyCheck.custom_call(name)
              for name in ("jax_flash_attention", "jax_flash_attention_bwd")]
    with pytest.raises(ValueError, match="jax_flash_attention_bwd"):  # the README's advice: it must be allowed too
        jax.export.export(grad, disabled_checks=checks[:1], platforms=["cpu"])(q, k, v)
    restored = jax.export.deserialize(jax.export.export(grad, disabled_checks=checks, platforms=["cpu"])(q, k, v)
                                      .serialize())
    for a, b in zip(restored.call(q, k, v), grad(q, k, v)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_timing_and_autotune_arguments():
    q, k, v = random_qkv(8, 1, 8, 8, 2, 2, 16, jnp.float32, CPU)
    for kwargs, message in ((dict(iters=-1), "iters=-1"), (dict(iters=0), "iters=0"), (dict(reps=0), "reps=0")):
        with pytest.raises(ValueError, match=rf"{message} .* must be a positive int"):
            jax_flash.time_attention(q, k, v, **kwargs)
    with pytest.raises(ValueError, match=r"q_shape must be \(batch, seq_q, heads_q, head_dim\)"):
        jax_flash.autotune((8, 2, 16), (1, 8, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="configs is empty"):
        jax_flash.autotune((1, 8, 2, 16), (1, 8, 2, 16), jnp.float32, configs=[], device=CPU)
    with pytest.raises(ValueError, match="iters=0 .* must be a positive int"):
        jax_flash.autotune((1, 8, 2, 16), (1, 8, 2, 16), jnp.float32, iters=0, device=CPU)


def test_dimensions_past_int32_are_refused_at_trace_time():
    big = jax.ShapeDtypeStruct((1, 2**31, 1, 8), jnp.float16)
    small = jax.ShapeDtypeStruct((1, 16, 1, 8), jnp.float16)
    with pytest.raises(ValueError, match=r"q has shape \(1, 2147483648, 1, 8\); every dimension must be at most "
                                         r"2\^31 - 1"):
        jax.eval_shape(jax_flash.attention, big, small, small)
    with pytest.raises(ValueError, match=r"k has shape .*2147483648.*every dimension must be at most"):
        jax.eval_shape(jax_flash.attention, small, big, big)


def test_cpu_scratch_is_proportional_to_the_work():
    # one query row against one key at head dim 2^20 (12 MB of bf16 inputs) needs no 64-row fp32 tiles
    script = textwrap.dedent("""
        import resource, jax, jax.numpy as jnp, jax_flash
        x = jnp.ones((1, 1, 1, 16), jnp.bfloat16)
        jax_flash.attention(x, x, x).block_until_ready()
        big = jnp.ones((1, 1, 1, 2**20), jnp.bfloat16)
        big.block_until_ready()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        jax_flash.attention(big, big, big).block_until_ready()
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
    """)
    # (a clean environment, so no XLA flag of the parent's grows the process; PYTHONPATH kept for a package installed
    # with pip --target)
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd="/", env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    grown_mb = int(result.stdout.strip().splitlines()[-1])
    assert grown_mb < 200, f"peak RSS grew by {grown_mb} MB for 12 MB of inputs"


def test_a_stopped_output_needs_no_gradient(device):
    q, k, v = random_qkv(9, 1, 8, 8, 2, 2, 64, jnp.float16, device)

    def loss(q):
        return (jax.lax.stop_gradient(jax_flash.attention(q, k, v)).astype(jnp.float32) * q).sum()

    grad = jax.grad(loss)(q.astype(jnp.float32).astype(jnp.float16))
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(jax_flash.attention(q, k, v)))


@pytest.mark.parametrize("dtype", ["float8_e5m2", "complex64", "int8", "float64"])  # (float8_e4m3fn: test_fp8.py)
def test_unsupported_dtypes_are_refused(dtype):
    x = np.zeros((1, 4, 2, 16), jnp.dtype(dtype))  # (numpy: refused before any device sees it)
    with pytest.raises(TypeError, match=f"q has dtype {jnp.dtype(dtype).name}; supported dtypes are float16 and "
                                        f"bfloat16"):
        jax_flash.attention(x, x, x)


@pytest.mark.skipif(not GPU_DEVICES, reason="no CUDA device visible to jax")
def test_gpu_refuses_head_dim_zero():
    q = jax.device_put(jnp.ones((1, 4, 1, 0), jnp.float16), GPU_DEVICES[0])
    with pytest.raises(ValueError, match="head_dim=0 is not supported on GPU"):
        jax_flash.attention(q, q, q, return_lse=True)


def test_aot_compile_and_the_persistent_compilation_cache(tmp_path):
    """jit(...).lower().compile() runs; a second process loads the compiled call from jax's persistent cache (no
    new cache entry) and gets the same result."""
    q, k, v = random_qkv(10, 1, 40, 40, 2, 2, 16, jnp.float32, CPU)
    compiled = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, causal=True)).lower(q, k, v).compile()
    np.testing.assert_array_equal(np.asarray(compiled(q, k, v)), np.asarray(jax_flash.attention(q, k, v, causal=True)))

    script = textwrap.dedent(f"""
        import jax, jax.numpy as jnp, numpy as np
        jax.config.update("jax_compilation_cache_dir", {str(tmp_path / "cache")!r})
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        import jax_flash
        x = jnp.linspace(-1, 1, 40 * 2 * 16, dtype=jnp.float32).reshape(1, 40, 2, 16)
        out = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, causal=True, window=(7, -1)))(x, x * 0.5, x)
        import pathlib, sys
        entries = len(list(pathlib.Path({str(tmp_path / "cache")!r}).iterdir()))
        np.save({str(tmp_path)!r} + f"/out_{{sys.argv[1]}}_{{entries}}.npy", np.asarray(out))
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # (float32: the CPU path, also where a GPU is the default)
    for run in range(2):
        subprocess.run([sys.executable, "-c", script, str(run)], check=True, cwd=tmp_path, timeout=300, env=env)
    saved = sorted(p.name for p in tmp_path.glob("out_*.npy"))
    entries = [int(name[:-4].split("_")[2]) for name in saved]
    assert entries[0] >= 1, f"the first run wrote no persistent cache entry: {saved}"
    assert entries[1] == entries[0], f"the second run compiled again instead of loading the cache: {saved}"
    np.testing.assert_array_equal(*(np.load(tmp_path / name) for name in saved))
