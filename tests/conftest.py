"""Shared fixtures: the platforms to test on, random inputs, and the one tolerance rule every test uses."""

from __future__ import annotations

import collections
import os

# Eight virtual CPU devices for tests/test_sharding.py and tests/test_ring.py; XLA reads this when jax first starts a
# backend, so it must be set before anything below asks for devices.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

# pytest-xdist workers share a GPU: each takes memory as it needs it (JAX's default preallocates 75% of the device per
# process, which leaves the second worker none).
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash


def _gpu_devices():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


GPU_DEVICES = _gpu_devices()
requires_gpu = pytest.mark.skipif(not GPU_DEVICES, reason="no CUDA device visible to jax")


# The quick subset, `pytest -m "not slow" -n 2`: the first case of every test function (each parametrized grid's first
# combination, each file's every check), without the hypothesis searches and the two longest single tests (13 s and
# 7 s on 2 cores). `pytest` runs everything (CI does).
SLOW_FILES = {"test_properties.py"}
SLOW_TESTS = {"test_decode_and_tiny_shapes", "test_train_example_loss_curve_matches_flax_default"}
QUICK_CASES_PER_TEST = 1


def pytest_collection_modifyitems(config, items):
    cases = collections.Counter()
    for item in items:
        function = item.nodeid.split("[")[0]
        cases[function] += 1
        if (item.path.name in SLOW_FILES or item.originalname in SLOW_TESTS
                or cases[function] > QUICK_CASES_PER_TEST):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=requires_gpu)])
def device(request):
    return jax.devices("cpu")[0] if request.param == "cpu" else GPU_DEVICES[0]


def attention_calls(text: str) -> tuple[str, str]:
    """The lines of the forward and the backward custom calls in lowered StableHLO text."""
    calls = [line for line in text.splitlines() if "@jax_flash_attention" in line]
    forward = next(line for line in calls if "@jax_flash_attention(" in line)
    backward = next(line for line in calls if "@jax_flash_attention_bwd(" in line)
    return forward, backward


def assert_grads_close(loss, args, names):
    """jax.grad of loss(jax_flash.attention, *args) (jitted) against loss(jax_flash.attention_reference, ...)'s in
    float32, per argument: within twice the error of the reference computed in q's dtype (compute_dtype) plus atol
    times the largest reference gradient."""
    argnums = tuple(range(len(args)))
    dtype = args[0].dtype
    grads = jax.jit(jax.grad(lambda *a: loss(jax_flash.attention, *a), argnums=argnums))(*args)
    ref = jax.grad(lambda *a: loss(jax_flash.attention_reference, *a), argnums=argnums)(
        *(x.astype(jnp.float32) for x in args))
    low = jax.grad(lambda *a: loss(jax_flash.attention_reference, *a, compute_dtype=dtype), argnums=argnums)(*args)
    atol = 1e-4 if dtype == jnp.float32 else 2e-3
    for name, g, r, l in zip(names, grads, ref, low):
        g, r, l = (np.asarray(x.astype(jnp.float32)) for x in (g, r, l))
        assert g.shape == r.shape, name
        bound = 2 * np.abs(l - r).max() + atol * max(1.0, np.abs(r).max())
        assert np.abs(g - r).max() <= bound, f"{name}: {np.abs(g - r).max():.3g} > {bound:.3g}"


def random_qkv(seed, batch, seq_q, seq_k, heads_q, heads_k, head_dim, dtype, device=None):
    """Normal q, k, v (never zeros: they hide unwritten outputs), placed on `device`."""
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(kq, (batch, seq_q, heads_q, head_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (batch, seq_k, heads_k, head_dim), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (batch, seq_k, heads_k, head_dim), jnp.float32).astype(dtype)
    if device is not None:
        q, k, v = (jax.device_put(x, device) for x in (q, k, v))
    return q, k, v


ATOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.float16): 1e-4, jnp.dtype(jnp.bfloat16): 5e-4}


def assert_flash_close(out, q, k, v, **reference_kwargs):
    """The FlashAttention rule (docs/RELIABILITY.md): with inputs already rounded to their dtype,
    max|out - ref32| <= 2 * max|out_lowp - ref32| + atol, where ref32 is an fp32 reference and out_lowp a plain
    attention computed in the input dtype. NaN never passes."""
    cpu = jax.devices("cpu")[0]
    q, k, v = (jax.device_put(x, cpu) for x in (q, k, v))
    reference_kwargs = {n: jax.device_put(x, cpu) if isinstance(x, jax.Array) else x
                        for n, x in reference_kwargs.items()}
    out = np.asarray(jax.device_put(out, cpu).astype(jnp.float32))
    assert np.isfinite(out).all(), "output has non-finite values"
    ref32 = np.asarray(jax_flash.attention_reference(q, k, v, **reference_kwargs))
    lowp = np.asarray(jax_flash.attention_reference(q, k, v, compute_dtype=q.dtype, **reference_kwargs)
                      .astype(jnp.float32))
    err = np.abs(out - ref32).max(initial=0.0)
    bound = 2 * np.abs(lowp - ref32).max(initial=0.0) + ATOL[jnp.dtype(q.dtype)]
    assert err <= bound, f"max error {err:.3g} exceeds 2 x low-precision error + atol = {bound:.3g}"
