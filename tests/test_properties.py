"""Property-based tests (hypothesis) over shapes and flags: jax_flash.attention equals the reference by the tolerance
rule on every drawn case. Profiles: "ci" (default: 40 fixed-seed examples per device) and "gpu" (150 examples),
chosen with JAX_FLASH_HYPOTHESIS_PROFILE=gpu."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_flash
from conftest import GPU_DEVICES, assert_flash_close, random_qkv

settings.register_profile("ci", max_examples=40, derandomize=True, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("gpu", max_examples=150, derandomize=False, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("JAX_FLASH_HYPOTHESIS_PROFILE", "ci"))


@st.composite
def cases(draw, gpu: bool):
    heads_k = draw(st.integers(1, 3))
    case = {
        "batch": draw(st.integers(1, 3)),
        "seq_q": draw(st.integers(0, 300)),
        "seq_k": draw(st.integers(0, 300)),
        "heads_q": heads_k * draw(st.integers(1, 3)),
        "heads_k": heads_k,
        "head_dim": draw(st.sampled_from([64, 128, 256] if gpu else [8, 24, 64, 80, 128])),
        "dtype": draw(st.sampled_from([jnp.float16, jnp.bfloat16])),
        "causal": draw(st.booleans()),
        "window": draw(st.one_of(st.none(), st.tuples(st.integers(-1, 40), st.integers(-1, 40)))),
        "softcap": draw(st.one_of(st.none(), st.floats(1.0, 50.0))),
        "lengths": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }
    if case["lengths"]:
        case["q_lengths"] = draw(st.lists(st.integers(0, case["seq_q"]), min_size=case["batch"],
                                          max_size=case["batch"]))
        case["kv_lengths"] = draw(st.lists(st.integers(0, case["seq_k"]), min_size=case["batch"],
                                           max_size=case["batch"]))
    return case


def check(case, device):
    q, k, v = random_qkv(case["seed"], case["batch"], case["seq_q"], case["seq_k"], case["heads_q"], case["heads_k"],
                         case["head_dim"], case["dtype"], device)
    kwargs = {name: case[name] for name in ("causal", "window", "softcap")}
    if case["lengths"]:
        kwargs["q_lengths"] = jax.device_put(jnp.asarray(case["q_lengths"], jnp.int32), device)
        kwargs["kv_lengths"] = jax.device_put(jnp.asarray(case["kv_lengths"], jnp.int32), device)
    out = jax_flash.attention(q, k, v, **kwargs)
    assert out.shape == q.shape
    if out.size:
        assert_flash_close(out, q, k, v, **kwargs)


@given(cases(gpu=False))
def test_properties_cpu(case):
    check(case, jax.devices("cpu")[0])


@pytest.mark.skipif(not GPU_DEVICES, reason="no CUDA device visible to jax")
@given(cases(gpu=True))
def test_properties_gpu(case):
    check(case, GPU_DEVICES[0])
