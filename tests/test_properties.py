"""Property-based tests (hypothesis) over shapes and flags: jax_flash.attention equals the reference by the tolerance
rule on every drawn case; on CPU also edge cases drawn together (head dims 0-300, zero sizes, windows, lengths,
softcap, any scale, a NaN in q, k or v). Profiles: "ci" (default: 25 fixed-seed examples per test), "gpu" (150) and
"large" (1000), chosen with JAX_FLASH_HYPOTHESIS_PROFILE."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_flash
from conftest import GPU_DEVICES, assert_flash_close, random_qkv

settings.register_profile("ci", max_examples=25, derandomize=True, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("gpu", max_examples=150, derandomize=False, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("large", max_examples=1000, derandomize=False, deadline=None,
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


@st.composite
def edge_cases(draw):
    heads_k = draw(st.integers(0, 2))
    case = {
        "batch": draw(st.integers(0, 2)),
        "seq_q": draw(st.integers(0, 70)),
        "seq_k": draw(st.integers(0, 70)),
        "heads_q": heads_k * draw(st.integers(1, 2)),
        "heads_k": heads_k,
        "head_dim": draw(st.one_of(st.integers(0, 8), st.integers(9, 300))),
        "dtype": draw(st.sampled_from([jnp.float32, jnp.float16, jnp.bfloat16])),
        "causal": draw(st.booleans()),
        "window": draw(st.one_of(st.none(), st.tuples(st.integers(-1, 80), st.integers(-1, 80)))),
        "softcap": draw(st.one_of(st.none(), st.floats(0.5, 100.0))),
        "softmax_scale": draw(st.one_of(st.none(), st.just(0.0), st.floats(-2.0, 2.0), st.floats(-1e-30, 1e-30))),
        "lengths": draw(st.booleans()),
        "nan_in": draw(st.sampled_from([None, "q", "k", "v"])),
        "seed": draw(st.integers(0, 2**16)),
    }
    if case["lengths"]:
        case["q_lengths"] = draw(st.lists(st.integers(-3, case["seq_q"] + 3), min_size=case["batch"],
                                          max_size=case["batch"]))
        case["kv_lengths"] = draw(st.lists(st.integers(-3, case["seq_k"] + 3), min_size=case["batch"],
                                           max_size=case["batch"]))
    if case["nan_in"] is not None:
        case["nan_at"] = draw(st.floats(0.0, 1.0))  # where, as a fraction of the tensor's elements
    return case


def _with_nan(x, fraction):
    flat = x.reshape(-1)
    if flat.size == 0:
        return x, None
    index = min(int(fraction * flat.size), flat.size - 1)
    return flat.at[index].set(jnp.nan).reshape(x.shape), np.unravel_index(index, x.shape)


@given(edge_cases())
def test_edge_properties_cpu(case):
    """Finite entries equal the reference by the tolerance rule, and exactly the entries a NaN can reach are NaN: a NaN
    in q fills its row when the row sees a key; in k, the rows that see that key; in v, that column of those rows.
    A row that sees no key is zeros with lse -inf; otherwise lse is finite unless a NaN reaches the row."""
    cpu = jax.devices("cpu")[0]
    q, k, v = random_qkv(case["seed"], case["batch"], case["seq_q"], case["seq_k"], case["heads_q"], case["heads_k"],
                         case["head_dim"], case["dtype"], cpu)
    kwargs = {name: case[name] for name in ("causal", "window", "softcap", "softmax_scale")}
    if case["lengths"]:
        kwargs["q_lengths"] = jnp.asarray(case["q_lengths"], jnp.int32)
        kwargs["kv_lengths"] = jnp.asarray(case["kv_lengths"], jnp.int32)
    nan_at = None
    if case["nan_in"] is not None:
        tensors = {"q": q, "k": k, "v": v}
        tensors[case["nan_in"]], nan_at = _with_nan(tensors[case["nan_in"]], case["nan_at"])
        clean = (q, k, v)
        q, k, v = tensors["q"], tensors["k"], tensors["v"]
    else:
        clean = (q, k, v)
    out, lse = jax_flash.attention(q, k, v, return_lse=True, **kwargs)
    assert out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)

    # What a NaN can reach: (B, Sq, Hq, D) mask from the visibility of each (row, key).
    seen = np.asarray(jax_flash.reference.visibility_mask(
        case["batch"], case["seq_q"], case["seq_k"], causal=case["causal"], window=case["window"],
        q_lengths=kwargs.get("q_lengths"), kv_lengths=kwargs.get("kv_lengths")))[:, 0]  # (B, Sq, Sk)
    group = case["heads_q"] // case["heads_k"] if case["heads_k"] else 1
    expect_nan = np.zeros(out.shape, bool)
    if nan_at is not None:
        b, pos, h, d = (int(i) for i in nan_at)
        if case["nan_in"] == "q":
            expect_nan[b, pos, h, :] = seen[b, pos].any()
        else:
            heads = slice(h * group, (h + 1) * group)
            rows = seen[b, :, pos]  # (Sq,) rows that see key pos
            if case["nan_in"] == "k":
                expect_nan[b, rows, heads, :] = True
            else:
                expect_nan[b, rows, heads, d] = True
    np.testing.assert_array_equal(np.isnan(out), expect_nan)
    lse_rows = np.transpose(lse, (0, 2, 1))  # (B, Sq, Hq)
    sees_any = np.broadcast_to(seen.any(axis=-1)[:, :, None], lse_rows.shape)
    assert np.isneginf(lse_rows[~sees_any]).all(), "a row that sees no key has lse -inf"
    assert (out[~sees_any] == 0).all(), "a row that sees no key is zeros"
    # lse: NaN exactly where a NaN in q or k reaches the row (whose scores it enters), finite elsewhere
    lse_nan = np.zeros(lse_rows.shape, bool)
    if nan_at is not None and case["nan_in"] in ("q", "k"):
        b, pos, h, _ = (int(i) for i in nan_at)
        if case["nan_in"] == "q":
            lse_nan[b, pos, h] = seen[b, pos].any()
        else:
            lse_nan[b, seen[b, :, pos], h * group:(h + 1) * group] = True
    np.testing.assert_array_equal(np.isnan(lse_rows), lse_nan)
    assert np.isfinite(lse_rows[sees_any & ~lse_nan]).all()
    ref = np.asarray(jax_flash.attention_reference(*clean, **kwargs))
    atol = {jnp.dtype(jnp.float32): 1e-4, jnp.dtype(jnp.float16): 2e-2, jnp.dtype(jnp.bfloat16): 6e-2}
    np.testing.assert_allclose(out[~expect_nan], ref[~expect_nan], atol=atol[jnp.dtype(case["dtype"])], rtol=0)
