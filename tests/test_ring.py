"""Ring attention over a sharded sequence (jax_flash/_ring.py): under jax.jit with sequence-sharded inputs and through
jax_flash.ring_attention inside shard_map, on 4 and 8 devices (virtual CPU devices from conftest.py; GPUs when the
machine has that many). Every case equals one device's call, the compiled HLO moves K/V by collective-permutes and
never all-gathers, and the output keeps the sequence sharding.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash
from jax_flash import _ring, _sharding, fp8
from jax_flash.attention import _fp8_kernel_call as fp8_kernel_call
from jax_flash.reference import visibility_mask
from conftest import GPU_DEVICES, random_qkv

try:
    from jax import shard_map
except ImportError:  # older jax
    from jax.experimental.shard_map import shard_map


def _devices(platform, n):
    devices = jax.devices("cpu") if platform == "cpu" else GPU_DEVICES
    if len(devices) < n:
        if platform == "cpu":
            pytest.fail(f"conftest.py should have made 8 virtual CPU devices, found {len(devices)}")
        pytest.skip(f"ring attention on {n} GPUs needs {n}; {len(devices)} visible")
    return devices[:n]


@pytest.fixture(autouse=True)
def cpu_default_off_gpu_meshes(request):
    """jax's default device is the CPU for every test but those on GPU meshes: the CPU tests make float32 inputs
    uncommitted and compute their one-device results eagerly, which would otherwise run on a GPU where it is the
    default device (and float32 runs on the CPU path only)."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("devices", ("cpu",))[0] == "gpu":
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture(params=[("cpu", 4), ("cpu", 8), ("gpu", 2), ("gpu", 4)], ids=lambda p: f"{p[0]}{p[1]}")
def devices(request):
    return _devices(*request.param)


def _inputs(devices, batch=2, seq_q=64, seq_k=64, heads_q=4, heads_k=2, head_dim=64, seed=0):
    dtype = jnp.float32 if devices[0].platform == "cpu" else jnp.bfloat16
    return random_qkv(seed, batch, seq_q, seq_k, heads_q, heads_k, head_dim, dtype)


def _tolerance(devices, scale=1.0):
    """float32 on CPU; bf16 on GPUs, where a ring adds each pair's gradient rounded to bf16 (atol scales with the
    largest expected value)."""
    return dict(rtol=2e-5, atol=2e-5) if devices[0].platform == "cpu" else dict(rtol=2e-2, atol=2e-2 * max(scale, 1))


def _one_device(devices, fn, *args):
    return jax.jit(fn)(*(jax.device_put(x, devices[0]) for x in args))


def _collectives(hlo: str) -> set[str]:
    return set(re.findall(r"\b(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)\b", hlo))


def _gathers_of_qkv(hlo: str) -> list[str]:
    """All-gathers or all-to-alls of rank-4 (batch, seq, heads, head_dim) arrays: of q, k, v, out or a gradient."""
    return [line for line in hlo.splitlines()
            if re.search(r"= \w+\[\d+,\d+,\d+,\d+\]\S* (all-gather|all-to-all)(-start)?\(", line)]


def _close(actual, expected, devices):
    actual, expected = (np.asarray(jnp.asarray(x, jnp.float32)) for x in (actual, expected))
    np.testing.assert_allclose(actual, expected, **_tolerance(devices, float(np.abs(expected).max(initial=0))))


def _close_lse(actual, expected, devices):
    actual, expected = np.asarray(actual), np.asarray(expected)
    np.testing.assert_array_equal(np.isinf(actual), np.isinf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(actual[finite], expected[finite], **_tolerance(devices))


FEATURES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "causal-window": dict(causal=True, window=(10, -1)),
    "window": dict(window=(5, 7)),
    "window-right": dict(window=(-1, 20)),
    "window-wide": dict(window=(20, 3)),
    "softcap-causal": dict(causal=True, softcap=3.0, softmax_scale=0.3),
    "lengths": dict(lengths=True),
    "causal-lengths": dict(causal=True, lengths="same"),  # padded self-attention: one array for both
    "causal-window-lengths": dict(causal=True, window=(12, -1), lengths="same"),
}


def _lengths(kind, q_lengths, kv_lengths):
    """(q_lengths, kv_lengths) for a FEATURES entry: none, two arrays, or one array passed as both."""
    if kind == "same":
        return q_lengths, q_lengths
    return (q_lengths, kv_lengths) if kind else (None, None)


@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (4, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_jit_over_a_sequence_sharded_mesh_runs_a_ring(devices, feature, heads):
    n = len(devices)
    kwargs = dict(FEATURES[feature])
    q, k, v = _inputs(devices, heads_q=heads[0], heads_k=heads[1])
    same = kwargs.get("lengths") == "same"
    lengths = _lengths(kwargs.pop("lengths", None), jnp.array([61, 9], jnp.int32), jnp.array([23, 64], jnp.int32))

    def fn(q, k, v, q_lengths, kv_lengths):
        kv_lengths = q_lengths if same else kv_lengths  # (the same traced array)
        return jax_flash.attention(q, k, v, return_lse=True, q_lengths=q_lengths, kv_lengths=kv_lengths, **kwargs)

    expected_out, expected_lse = _one_device(devices, fn, q, k, v, *lengths)
    mesh = jax.make_mesh((n,), ("seq",), devices=devices)
    spec = NamedSharding(mesh, P(None, "seq"))
    args = [jax.device_put(x, spec) for x in (q, k, v)] + list(lengths)
    jitted = jax.jit(fn)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no gather warning
        out, lse = jitted(*args)
    _close(out, expected_out, devices)
    _close_lse(lse, expected_lse, devices)
    assert out.sharding.is_equivalent_to(spec, 4), out.sharding
    assert lse.sharding.is_equivalent_to(NamedSharding(mesh, P(None, None, "seq")), 3), lse.sharding
    collectives = _collectives(jitted.lower(*args).compile().as_text())
    assert collectives == {"collective-permute"}, collectives


@pytest.mark.parametrize("feature", ["causal", "causal-window", "window-wide", "lengths", "softcap-causal",
                                     "causal-lengths", "causal-window-lengths"])
def test_gradients_of_a_sequence_sharded_call_equal_one_device(devices, feature):
    n = len(devices)
    kwargs = dict(FEATURES[feature])
    q, k, v = _inputs(devices, seed=1)
    same = kwargs.get("lengths") == "same"
    lengths = _lengths(kwargs.pop("lengths", None), jnp.array([50, 3], jnp.int32), jnp.array([64, 30], jnp.int32))
    weights = jnp.cos(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.shape)

    def loss(q, k, v, weights, q_lengths, kv_lengths):
        kv_lengths = q_lengths if same else kv_lengths
        out, lse = jax_flash.attention(q, k, v, return_lse=True, q_lengths=q_lengths, kv_lengths=kv_lengths,
                                       **kwargs)
        return jnp.sum(out.astype(jnp.float32) * weights) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    expected = _one_device(devices, grad, q, k, v, weights, *lengths)
    mesh = jax.make_mesh((n,), ("seq",), devices=devices)
    spec = NamedSharding(mesh, P(None, "seq"))
    args = [jax.device_put(x, spec) for x in (q, k, v, weights)] + list(lengths)
    jitted = jax.jit(grad)
    grads = jitted(*args)
    for name, actual, want in zip("qkv", grads, expected):
        _close(actual, want, devices)
        assert actual.sharding.is_equivalent_to(spec, 4), (name, actual.sharding)
    hlo = jitted.lower(*args).compile().as_text()
    assert "collective-permute" in _collectives(hlo) and not _gathers_of_qkv(hlo), _gathers_of_qkv(hlo)
    assert 'custom_call_target="jax_flash_attention_bwd"' in hlo


def _documents(seed, batch, seq, p=0.08):
    """int32 (batch, seq) segment ids of packed documents (runs of equal ids), which cross shard boundaries."""
    starts = jax.random.bernoulli(jax.random.PRNGKey(seed), p, (batch, seq)).astype(jnp.int32)
    return jnp.cumsum(starts, axis=1)


@pytest.mark.parametrize("feature", ["plain", "causal", "causal-window", "window-wide", "causal-lengths", "cross"])
def test_segment_ids_of_a_sequence_sharded_call_run_a_ring(devices, feature):
    """Packed documents over a sequence-sharded mesh: the ids shard with the sequence and the keys' travel with their
    K/V; out, lse and gradients equal one device's, with only collective-permutes. "cross": other query and key ids
    and lengths (32 queries, 64 keys)."""
    n = len(devices)
    kwargs = dict(FEATURES.get(feature, {}))
    seq_q = 32 if feature == "cross" else 64
    q, k, v = _inputs(devices, seq_q=seq_q, seed=2)
    q_ids, kv_ids = _documents(3, 2, seq_q), _documents(3 if feature != "cross" else 4, 2, 64)
    same = kwargs.get("lengths") == "same"
    lengths = _lengths(kwargs.pop("lengths", None) or (feature == "cross"), jnp.array([29, 5], jnp.int32),
                       jnp.array([64, 37], jnp.int32))
    weights = jnp.cos(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.shape)

    def fn(q, k, v, q_ids, kv_ids, q_lengths, kv_lengths):
        kv_lengths = q_lengths if same else kv_lengths
        return jax_flash.attention(q, k, v, return_lse=True, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                                   q_lengths=q_lengths, kv_lengths=kv_lengths, **kwargs)

    def loss(q, k, v, *rest):
        out, lse = fn(q, k, v, *rest)
        return jnp.sum(out.astype(jnp.float32) * weights) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    expected_out, expected_lse = _one_device(devices, fn, q, k, v, q_ids, kv_ids, *lengths)
    expected_grads = _one_device(devices, grad, q, k, v, q_ids, kv_ids, *lengths)
    mesh = jax.make_mesh((n,), ("seq",), devices=devices)
    spec = NamedSharding(mesh, P(None, "seq"))
    args = [jax.device_put(x, spec) for x in (q, k, v, q_ids, kv_ids)] + list(lengths)
    grads = _matches_one_device(devices, fn, grad, args, spec, expected_out, expected_lse, expected_grads)
    for name, actual in zip("qkv", grads):
        assert actual.sharding.is_equivalent_to(spec, 4), (name, actual.sharding)
    hlo = jax.jit(grad).lower(*args).compile().as_text()
    assert "collective-permute" in _collectives(hlo) and not _gathers_of_qkv(hlo), _gathers_of_qkv(hlo)


def _tensors(kind, batch, heads, seq):
    """(bias, mask) of a TENSOR_CASES entry, each None or a rank-4 array broadcastable to (B, H, S, S)."""
    keys = jax.random.split(jax.random.PRNGKey(7), 2)
    full_bias = jax.random.normal(keys[0], (batch, heads, seq, seq), jnp.float32)
    random_mask = jax.random.bernoulli(keys[1], 0.8, (batch, 1, seq, seq))
    prefix = jnp.arange(seq)[None, :] <= jnp.maximum(jnp.arange(seq)[:, None], seq // 4)  # prefix-LM
    return {"bias": (full_bias, None),
            "key-bias": (full_bias[:1, :, :1], None),  # (1, H, 1, S)
            "mask": (None, random_mask),
            "shared-mask": (None, prefix[None, None]),  # (1, 1, S, S)
            "both": (full_bias[:1], jnp.arange(seq)[None, None, None, :] < jnp.array([seq, seq - 21])[:, None, None,
                                                                                                       None])}[kind]


TENSOR_CASES = ["bias", "key-bias", "mask", "shared-mask", "both"]


@pytest.mark.parametrize("feature", ["plain", "causal", "window-wide"])
@pytest.mark.parametrize("tensors", TENSOR_CASES)
def test_bias_and_mask_tensors_of_a_sequence_sharded_call_run_a_ring(devices, tensors, feature):
    """Bias / mask tensors over a sequence-sharded mesh: their query rows split with q (where full), every key whole
    on each device, and each ring step takes the visiting shard's columns. Out, lse and the gradients of q, k, v and
    the bias equal one device's; the forward moves only K/V (collective-permutes)."""
    _check_ring_with_tensors(devices, tensors, feature, AxisType.Explicit)


@pytest.mark.parametrize("tensors,feature", [("bias", "causal"), ("both", "plain")])
def test_bias_and_mask_tensors_of_a_sequence_sharded_call_under_automatic_axes(devices, tensors, feature):
    """The same under automatic mesh axes, where the partitioner, not the bias gradient, gathers the keys."""
    _check_ring_with_tensors(devices, tensors, feature, AxisType.Auto)


def _check_ring_with_tensors(devices, tensors, feature, axis_types):
    n = len(devices)
    kwargs = dict(FEATURES[feature])
    q, k, v = _inputs(devices, seed=3)
    bias, mask = _tensors(tensors, 2, 4, 64)
    weights = jnp.sin(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.shape)

    def fn(q, k, v, bias, mask):
        return jax_flash.attention(q, k, v, bias=bias, mask=mask, return_lse=True, **kwargs)

    def loss(q, k, v, bias, mask):
        out, lse = fn(q, k, v, bias, mask)
        return jnp.sum(out.astype(jnp.float32) * weights) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    grad = jax.grad(loss, argnums=(0, 1, 2) + ((3,) if bias is not None else ()))
    expected_out, expected_lse = _one_device(devices, fn, q, k, v, bias, mask)
    expected_grads = _one_device(devices, grad, q, k, v, bias, mask)
    mesh = jax.make_mesh((n,), ("seq",), devices=devices, axis_types=(axis_types,))
    spec = NamedSharding(mesh, P(None, "seq"))
    rows = NamedSharding(mesh, P(None, None, "seq"))  # the tensors' query rows with q where full, else whole
    args = [jax.device_put(x, spec) for x in (q, k, v)] + [
        None if t is None else jax.device_put(t, rows if t.shape[2] == 64 else NamedSharding(mesh, P()))
        for t in (bias, mask)]
    _matches_one_device(devices, fn, grad, args, spec, expected_out, expected_lse, expected_grads)


def _matches_one_device(devices, fn, grad, args, spec, expected_out, expected_lse, expected_grads):
    """fn's (out, lse) and grad's gradients on the sequence-sharded args equal one device's, with no gather warning,
    the output keeping the sequence sharding and the forward moving only K/V; returns the gradients."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no gather warning
        out, lse = jax.jit(fn)(*args)
        grads = jax.jit(grad)(*args)
    _close(out, expected_out, devices)
    _close_lse(lse, expected_lse, devices)
    assert out.sharding.is_equivalent_to(spec, 4), out.sharding
    assert _collectives(jax.jit(fn).lower(*args).compile().as_text()) == {"collective-permute"}
    for actual, want in zip(grads, expected_grads):
        _close(actual, want, devices)
    return grads


def _fp8_inputs(devices, seq_q=64, seq_k=64, heads_q=4, heads_k=2):
    """q, k, v as float8_e4m3fn (head dim 128, the FP8 kernel's) and their (batch, heads_k) descales."""
    if devices[0].platform != "cpu" and not fp8._on_hopper():
        pytest.skip("the FP8 kernel runs on Hopper GPUs only")
    q, k, v = random_qkv(4, 2, seq_q, seq_k, heads_q, heads_k, 128, jnp.float32)
    (q8, qd), (k8, kd), (v8, vd) = (jax_flash.quantize_fp8(q, heads_k), jax_flash.quantize_fp8(k),
                                    jax_flash.quantize_fp8(v))
    return q8, k8, v8, qd, kd, vd


def _fp8_kernel(q, k, v, q_descale, k_descale, v_descale, q_lengths=None, kv_lengths=None, ring=None, **kwargs):
    """The FP8 kernel's primitive, as jax_flash.attention binds it for float8_e4m3fn inputs on Hopper (on the CPU
    its lowering there computes the CPU path on the dequantised inputs): (out bfloat16, lse)."""
    call = {**dict(causal=False, window=None, softmax_scale=None), **kwargs, "q_lengths": q_lengths,
            "kv_lengths": kv_lengths, "ring": ring}
    descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    return fp8_kernel_call(q, k, v, None, descales, jnp.bfloat16, True, call)


def _fp8_reference(inputs, **kwargs):
    """attention_reference of FP8 inputs with their descales, in float32 on the CPU."""
    cpu = jax.devices("cpu")[0]
    q, k, v, qd, kd, vd, *lengths = (None if x is None else jax.device_put(x, cpu) for x in inputs)
    names = dict(zip(("q_lengths", "kv_lengths"), lengths))
    return jax.jit(lambda *a: jax_flash.attention_reference(*a[:3], q_descale=a[3], k_descale=a[4], v_descale=a[5],
                                                            **names, **kwargs))(q, k, v, qd, kd, vd)


def _close_fp8(actual, one_device, reference):
    """The ring about as close to the float32 reference as one device's call: each is an FP8 computation (on a GPU P
    is rounded to e4m3 against each pair's running maximum, so a ring rounds differently), and each step's output
    is rounded to bfloat16 before the merge."""
    actual, one_device, reference = (np.asarray(jnp.asarray(x, jnp.float32)) for x in (actual, one_device,
                                                                                       reference))
    error, one_error = np.abs(actual - reference).max(), np.abs(one_device - reference).max()
    bound = 2 * one_error + 2.0**-7 * np.abs(reference).max() + 1e-3
    assert error <= bound, f"ring error {error:.4g} above {bound:.4g} (one device: {one_error:.4g})"


@pytest.mark.parametrize("feature", ["plain", "causal", "causal-window", "window-wide", "lengths", "causal-lengths"])
def test_fp8_kernel_call_over_a_sequence_sharded_mesh_runs_a_ring(devices, feature):
    """The FP8 kernel's call on sequence-sharded float8_e4m3fn inputs runs the ring (its steps the FP8 kernel on a
    GPU), with only collective-permutes, and equals one device's call; the descales stay whole along the sequence."""
    n = len(devices)
    kwargs = dict(FEATURES[feature])
    same = kwargs.get("lengths") == "same"
    lengths = _lengths(kwargs.pop("lengths", None), jnp.array([61, 9], jnp.int32), jnp.array([23, 64], jnp.int32))
    inputs = _fp8_inputs(devices)

    def fn(q, k, v, qd, kd, vd, q_lengths, kv_lengths):
        return _fp8_kernel(q, k, v, qd, kd, vd, q_lengths, q_lengths if same else kv_lengths, **kwargs)

    expected_out, expected_lse = _one_device(devices, fn, *inputs, *lengths)
    mesh = jax.make_mesh((n,), ("seq",), devices=devices)
    spec = NamedSharding(mesh, P(None, "seq"))
    args = [jax.device_put(x, spec) for x in inputs[:3]] + list(inputs[3:]) + list(lengths)
    jitted = jax.jit(fn)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no gather warning
        out, lse = jitted(*args)
    assert out.dtype == jnp.bfloat16
    _close_fp8(out, expected_out, _fp8_reference((*inputs, *lengths), **kwargs))
    _close_lse(lse, expected_lse, devices)
    assert out.sharding.is_equivalent_to(spec, 4), out.sharding
    assert lse.sharding.is_equivalent_to(NamedSharding(mesh, P(None, None, "seq")), 3), lse.sharding
    hlo = jitted.lower(*args).compile().as_text()
    assert _collectives(hlo) == {"collective-permute"}, _collectives(hlo)
    if devices[0].platform != "cpu":
        assert 'custom_call_target="jax_flash_attention_fp8"' in hlo


def test_fp8_ring_attention_inside_shard_map(devices):
    """ring_attention on float8_e4m3fn shards with descales (zigzag, causal) equals jax_flash.attention on the whole
    sequence; on a CPU it runs the 16-bit ring on the dequantised inputs, on Hopper the FP8 kernel's."""
    n, seq = len(devices), 64
    q, k, v, qd, kd, vd = _fp8_inputs(devices, seq, seq)
    mesh = jax.make_mesh((n,), ("sp",), devices=devices)
    order = np.asarray(jax_flash.zigzag_indices(seq, n))
    undo = np.argsort(order)

    def local(q, k, v, qd, kd, vd):
        return jax_flash.ring_attention(q, k, v, axis_name="sp", layout="zigzag", causal=True, q_descale=qd,
                                        k_descale=kd, v_descale=vd, out_dtype=jnp.float32)

    ring = jax.jit(shard_map(local, mesh=mesh, in_specs=(P(None, "sp"),) * 3 + (P(),) * 3,
                             out_specs=P(None, "sp")))
    args = [jax.device_put(x[:, order], NamedSharding(mesh, P(None, "sp"))) for x in (q, k, v)] + [qd, kd, vd]
    out = ring(*args)
    assert out.dtype == jnp.float32
    expected = _one_device(devices, lambda q, k, v, qd, kd, vd: jax_flash.attention(
        q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd), q, k, v, qd, kd, vd)
    _close_fp8(np.asarray(out)[:, undo], expected, _fp8_reference((q, k, v, qd, kd, vd), causal=True))
    hlo = ring.lower(*args).compile().as_text()
    assert _collectives(hlo) == {"collective-permute"}, _collectives(hlo)
    if devices[0].platform != "cpu":
        assert 'custom_call_target="jax_flash_attention_fp8"' in hlo
    with pytest.raises(ValueError, match="ring_attention cannot run this call: causal or window masks with q_lengths"):
        jax.jit(shard_map(lambda q, k, v, qd, kd, vd: jax_flash.ring_attention(
            q, k, v, axis_name="sp", causal=True, kv_lengths=jnp.array([3, 4], jnp.int32), q_descale=qd,
            k_descale=kd, v_descale=vd), mesh=mesh, in_specs=(P(None, "sp"),) * 3 + (P(),) * 3,
            out_specs=P(None, "sp")))(*args)


@pytest.mark.parametrize("shape,axes", [((2, 2), ("seq", "model")), ((2, 4), ("seq", "model")),
                                        ((2, 2, 2), ("data", "seq", "model"))], ids=["2x2", "2x4", "2x2x2"])
def test_sequence_times_heads_meshes(shape, axes):
    devices = _devices("cpu", int(np.prod(shape)))
    q, k, v = _inputs(devices, heads_q=8, heads_k=4)
    causal = functools.partial(jax_flash.attention, causal=True)
    expected = _one_device(devices, causal, q, k, v)
    mesh = jax.make_mesh(shape, axes, devices=devices)
    spec = NamedSharding(mesh, P("data" if "data" in axes else None, "seq", "model"))
    args = [jax.device_put(x, spec) for x in (q, k, v)]
    jitted = jax.jit(causal)
    out = jitted(*args)
    _close(out, expected, devices)
    assert out.sharding.is_equivalent_to(spec, 4), out.sharding
    assert _collectives(jitted.lower(*args).compile().as_text()) == {"collective-permute"}
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(causal(*a) ** 2), argnums=(0, 1, 2)))(*args)
    expected_grads = _one_device(devices, jax.grad(lambda *a: jnp.sum(causal(*a) ** 2), argnums=(0, 1, 2)), q, k, v)
    for actual, want in zip(grads, expected_grads):
        _close(actual, want, devices)


def _kernel_calls(hlo: str, target="jax_flash_attention"):
    """(q shape, k shape) of each kernel custom call in an HLO text."""
    calls = []
    for line in hlo.splitlines():
        if f'custom_call_target="{target}"' in line:
            shapes = re.findall(r"f32\[([\d,]+)\]", line.split("custom-call(")[1])
            calls.append(tuple(tuple(int(d) for d in s.split(",")) for s in shapes[:2]))
    return calls


def test_causal_ring_is_balanced_zigzag_and_window_steps_are_skipped():
    n, seq = 4, 64
    devices = _devices("cpu", n)
    q, k, v = _inputs(devices, seq_q=seq, seq_k=seq)
    mesh = jax.make_mesh((n,), ("seq",), devices=devices)
    spec = NamedSharding(mesh, P(None, "seq"))
    args = [jax.device_put(x, spec) for x in (q, k, v)]
    chunk = seq // n

    # Causal: one diagonal call on the local chunk, then per step two branches of chunk x chunk / 2 pairs each
    # (zigzag: every device does the same work at every step).
    hlo = jax.jit(functools.partial(jax_flash.attention, causal=True)).lower(*args).compile().as_text()
    calls = _kernel_calls(hlo)
    pairs = sorted(qs[1] * ks[1] for qs, ks in calls)
    assert pairs == [chunk * chunk // 2] * (2 * (n - 1)) + [chunk * chunk], calls

    # A causal window of 10 < chunk keys: only the diagonal step and the step before it have visible keys; the
    # other n - 2 steps (and their permutes) are dropped.
    hlo = jax.jit(functools.partial(jax_flash.attention, causal=True, window=(10, -1))).lower(*args).compile()
    hlo = hlo.as_text()
    assert len(_kernel_calls(hlo)) == 2, _kernel_calls(hlo)
    assert len(re.findall(r"collective-permute(?:-start)?\(", hlo)) == 2  # K and V, one step each


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_attention_inside_shard_map(layout):
    n, seq = 4, 48
    devices = _devices("cpu", n)
    q, k, v = _inputs(devices, seq_q=seq, seq_k=seq)
    mesh = jax.make_mesh((n,), ("sp",), devices=devices)
    order = np.asarray(jax_flash.zigzag_indices(seq, n)) if layout == "zigzag" else np.arange(seq)
    undo = np.argsort(order)

    lengths = jnp.array([48, 29], jnp.int32)  # padded self-attention: one array for q_lengths and kv_lengths

    def local(q, k, v, lengths):
        return jax_flash.ring_attention(q, k, v, axis_name="sp", layout=layout, causal=True, return_lse=True,
                                        q_lengths=lengths, kv_lengths=lengths)

    ring = jax.jit(shard_map(local, mesh=mesh, in_specs=(P(None, "sp"),) * 3 + (P(),),
                             out_specs=(P(None, "sp"), P(None, None, "sp"))))
    args = [jax.device_put(x[:, order], NamedSharding(mesh, P(None, "sp"))) for x in (q, k, v)]
    out, lse = ring(*args, lengths)
    expected_out, expected_lse = jax_flash.attention(q, k, v, causal=True, return_lse=True, q_lengths=lengths,
                                                     kv_lengths=lengths)
    _close(np.asarray(out)[:, undo], expected_out, devices)
    _close_lse(np.asarray(lse)[:, :, undo], expected_lse, devices)
    assert _collectives(ring.lower(*args, lengths).compile().as_text()) == {"collective-permute"}

    weights = jnp.sin(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.shape)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(ring(*a, lengths)[0] * weights[:, order]), argnums=(0, 1, 2)))(*args)
    expected = jax.grad(lambda *a: jnp.sum(jax_flash.attention(*a, causal=True, q_lengths=lengths, kv_lengths=lengths)
                                           * weights), argnums=(0, 1, 2))(q, k, v)
    for actual, want in zip(grads, expected):
        _close(np.asarray(actual)[:, undo], want, devices)


def test_ring_attention_with_segment_ids_inside_shard_map():
    """ring_attention takes this device's shards of the segment ids, in the layout of q, k and v (here zigzag)."""
    n, seq = 4, 48
    devices = _devices("cpu", n)
    q, k, v = _inputs(devices, seq_q=seq, seq_k=seq)
    ids = _documents(5, 2, seq, p=0.1)
    mesh = jax.make_mesh((n,), ("sp",), devices=devices)
    order = np.asarray(jax_flash.zigzag_indices(seq, n))
    undo = np.argsort(order)

    def local(q, k, v, ids):
        return jax_flash.ring_attention(q, k, v, axis_name="sp", layout="zigzag", causal=True, q_segment_ids=ids,
                                        kv_segment_ids=ids)

    ring = jax.jit(shard_map(local, mesh=mesh, in_specs=(P(None, "sp"),) * 4, out_specs=P(None, "sp")))
    args = [jax.device_put(x[:, order], NamedSharding(mesh, P(None, "sp"))) for x in (q, k, v, ids)]
    expected = jax_flash.attention(q, k, v, causal=True, q_segment_ids=ids, kv_segment_ids=ids)
    _close(np.asarray(ring(*args))[:, undo], expected, devices)
    assert _collectives(ring.lower(*args).compile().as_text()) == {"collective-permute"}


def test_ring_attention_with_lengths_inside_shard_map():
    n = 4
    devices = _devices("cpu", n)
    q, k, v = _inputs(devices, seq_q=32, seq_k=64)
    q_lengths, kv_lengths = jnp.array([32, 5], jnp.int32), jnp.array([17, 0], jnp.int32)
    mesh = jax.make_mesh((n,), ("sp",), devices=devices)
    ring = jax.jit(shard_map(
        lambda q, k, v, ql, kl: jax_flash.ring_attention(q, k, v, axis_name="sp", q_lengths=ql, kv_lengths=kl,
                                                         softcap=2.0),
        mesh=mesh, in_specs=(P(None, "sp"),) * 3 + (P(), P()), out_specs=P(None, "sp")))
    args = [jax.device_put(x, NamedSharding(mesh, P(None, "sp"))) for x in (q, k, v)]
    out = ring(*args, q_lengths, kv_lengths)
    expected = jax_flash.attention(q, k, v, q_lengths=q_lengths, kv_lengths=kv_lengths, softcap=2.0)
    _close(out, expected, devices)
    assert not np.asarray(out)[1].any()  # batch row 1 sees no key


def test_causal_with_separate_lengths_arrays_is_gathered_and_correct():
    n = 4
    devices = _devices("cpu", n)
    mesh = jax.make_mesh((n,), ("seq",), devices=devices)
    spec = NamedSharding(mesh, P(None, "seq"))
    q, k, v = _inputs(devices, seq_q=64, seq_k=64)
    lengths = jnp.array([40, 64], jnp.int32)
    causal_lengths = functools.partial(jax_flash.attention, causal=True)
    expected = _one_device(devices, lambda q, k, v, l: causal_lengths(q, k, v, kv_lengths=l), q, k, v, lengths)
    _sharding._warned.clear()
    with pytest.warns(UserWarning, match="pass one array to both"):
        out = jax.jit(lambda q, k, v, l: causal_lengths(q, k, v, kv_lengths=l))(
            *(jax.device_put(x, spec) for x in (q, k, v)), lengths)
    _close(out, expected, devices)


@pytest.mark.skipif(tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 10),
                    reason="jax 0.9's custom_partitioning refuses uneven shardings itself (IndivisibleError)")
def test_a_sequence_that_does_not_divide_over_the_devices_is_gathered_and_correct():
    n = 4
    devices = _devices("cpu", n)
    causal_lengths = functools.partial(jax_flash.attention, causal=True)
    # 50 does not divide over 4 devices (uneven shards, which only a constraint inside jit makes): gathered, and the
    # warning says what to do
    q, k, v = _inputs(devices, seq_q=50, seq_k=50)
    expected = _one_device(devices, causal_lengths, q, k, v)
    auto = NamedSharding(jax.make_mesh((n,), ("seq",), devices=devices, axis_types=(AxisType.Auto,)), P(None, "seq"))
    _sharding._warned.clear()
    with pytest.warns(UserWarning, match="must both divide by the 4 devices .*pad the sequence at its end"):
        out = jax.jit(lambda *a: causal_lengths(*(jax.lax.with_sharding_constraint(x, auto) for x in a)))(q, k, v)
    _close(out, expected, devices)


def test_ring_attention_bad_uses_raise_clear_errors():
    devices = _devices("cpu", 4)
    q, k, v = _inputs(devices)
    mesh = jax.make_mesh((4,), ("sp",), devices=devices)
    args = [jax.device_put(x, NamedSharding(mesh, P(None, "sp"))) for x in (q, k, v)]

    def run(**kwargs):
        return jax.jit(shard_map(lambda q, k, v: jax_flash.ring_attention(q, k, v, axis_name="sp", **kwargs),
                                 mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp")))(*args)

    with pytest.raises(ValueError, match="axis_name 'nope' is not a mesh axis bound here"):
        jax_flash.ring_attention(q, k, v, axis_name="nope")
    with pytest.raises(ValueError, match=r"layout must be one of \('contiguous', 'zigzag'\), got 'striped'"):
        run(layout="striped")
    with pytest.raises(ValueError, match="ring_attention cannot run this call: the zigzag layout is for causal"):
        run(layout="zigzag")
    with pytest.raises(ValueError, match="ring_attention cannot run this call: causal or window masks with q_lengths"):
        run(causal=True, kv_lengths=jnp.array([3, 4], jnp.int32))


@pytest.mark.parametrize("kwargs", [dict(window=(5, 7)), dict(causal=True, window=(5, -1)),
                                    dict(window=(20, 3), softcap=2.0)], ids=["window", "causal-window", "softcap"])
def test_ring_attention_with_windows_inside_shard_map(kwargs):
    """A window leaves some steps without a pair on some devices (a lax.cond between the two sides of a step):
    inside shard_map both branches must vary over the ring's axis, as they do."""
    n, seq = 4, 48
    devices = _devices("cpu", n)
    q, k, v = _inputs(devices, seq_q=seq, seq_k=seq, seed=2)
    mesh = jax.make_mesh((n,), ("sp",), devices=devices)
    ring = jax.jit(shard_map(lambda q, k, v: jax_flash.ring_attention(q, k, v, axis_name="sp", return_lse=True,
                                                                      **kwargs),
                             mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=(P(None, "sp"), P(None, None, "sp"))))
    args = [jax.device_put(x, NamedSharding(mesh, P(None, "sp"))) for x in (q, k, v)]
    out, lse = ring(*args)
    expected_out, expected_lse = jax_flash.attention(q, k, v, return_lse=True, **kwargs)
    _close(out, expected_out, devices)
    _close_lse(lse, expected_lse, devices)
    weights = jnp.sin(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.shape)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(ring(*a)[0] * weights), argnums=(0, 1, 2)))(*args)
    expected = jax.grad(lambda *a: jnp.sum(jax_flash.attention(*a, **kwargs) * weights), argnums=(0, 1, 2))(q, k, v)
    for actual, want in zip(grads, expected):
        _close(actual, want, devices)


def _forward_mode_and_second_order(fn, expected_fn, args, inputs, undo, devices):
    """jax.jvp of fn (out, lse) at args and the gradient of |d loss / dk|^2 (grad of grad) against expected_fn's at
    inputs, the one-device arrays (undo: their order from the layout's)."""
    tangents = [jnp.cos(3.0 * x) for x in args]
    (out, lse), (out_dot, lse_dot) = jax.jit(lambda a, t: jax.jvp(fn, a, t))(tuple(args), tuple(tangents))
    inverse = np.argsort(undo)
    (_, _), (want_out_dot, want_lse_dot) = jax.jvp(expected_fn, tuple(inputs),
                                                   tuple(jnp.asarray(np.asarray(t)[:, undo]) for t in tangents))
    _close(np.asarray(out_dot)[:, undo], want_out_dot, devices)
    _close_lse(np.asarray(lse_dot)[:, :, undo], want_lse_dot, devices)

    def second_order(f, weights):
        loss = lambda *a: jnp.sum(f(*a)[0] * weights)  # noqa: E731
        return jax.grad(lambda *a: jnp.sum(jax.grad(loss, argnums=1)(*a) ** 2), argnums=(0, 1, 2))

    weights = jnp.sin(jnp.arange(inputs[0].size, dtype=jnp.float32)).reshape(inputs[0].shape)
    actual = jax.jit(second_order(fn, jnp.asarray(np.asarray(weights)[:, inverse])))(*args)
    for got, want in zip(actual, second_order(expected_fn, weights)(*inputs)):
        _close(np.asarray(got)[:, undo], want, devices)


@pytest.mark.parametrize("layout,feature", [("contiguous", "causal-lengths"), ("zigzag", "causal-segments"),
                                            ("contiguous", "window-softcap")])
def test_forward_mode_and_second_order_of_ring_attention_inside_shard_map(layout, feature):
    """jax.jvp and grad of grad of ring_attention gather K and V whole on each device (dense scores of its rows) and
    equal one device's."""
    n, seq = 4, 48
    devices = _devices("cpu", n)
    q, k, v = _inputs(devices, seq_q=seq, seq_k=seq, seed=3)
    order = np.asarray(jax_flash.zigzag_indices(seq, n)) if layout == "zigzag" else np.arange(seq)
    undo = np.argsort(order)
    lengths = jnp.array([48, 29], jnp.int32)
    ids = _documents(6, 2, seq, p=0.1)
    kwargs = {"causal-lengths": dict(causal=True, q_lengths=lengths, kv_lengths=lengths),
              "causal-segments": dict(causal=True),
              "window-softcap": dict(window=(9, 4), softcap=2.0)}[feature]
    segments = feature == "causal-segments"
    mesh = jax.make_mesh((n,), ("sp",), devices=devices)

    def local(q, k, v, ids):
        extra = dict(q_segment_ids=ids, kv_segment_ids=ids) if segments else {}
        return jax_flash.ring_attention(q, k, v, axis_name="sp", layout=layout, return_lse=True, **kwargs, **extra)

    ring = shard_map(local, mesh=mesh, in_specs=(P(None, "sp"),) * 4, out_specs=(P(None, "sp"), P(None, None, "sp")))
    ids_local = jax.device_put(ids[:, order], NamedSharding(mesh, P(None, "sp")))
    args = [jax.device_put(x[:, order], NamedSharding(mesh, P(None, "sp"))) for x in (q, k, v)]
    extra = dict(q_segment_ids=ids, kv_segment_ids=ids) if segments else {}
    _forward_mode_and_second_order(lambda *a: ring(*a, ids_local),
                                   lambda *a: jax_flash.attention(*a, return_lse=True, **kwargs, **extra),
                                   args, (q, k, v), undo, devices)


@pytest.mark.parametrize("layout,causal", [("contiguous", True), ("zigzag", True), ("contiguous", False)])
@pytest.mark.parametrize("tensors", ["bias", "key-bias", "mask"])
def test_ring_attention_with_bias_and_mask_tensors_inside_shard_map(layout, causal, tensors):
    """ring_attention takes a bias or mask with this device's query rows (in the layout's order, sharded as q) and
    every key, or one row for all (replicated): out, lse, the gradients of q, k, v and the bias, and the tangents of
    out and lse equal one device's."""
    n, seq = 4, 48
    devices = _devices("cpu", n)
    q, k, v = _inputs(devices, seq_q=seq, seq_k=seq, seed=7)
    order = np.asarray(jax_flash.zigzag_indices(seq, n)) if layout == "zigzag" else np.arange(seq)
    undo = np.argsort(order)
    key = jax.random.PRNGKey(8)
    tensor = {"bias": jax.random.normal(key, (2, 1, seq, seq)), "key-bias": jax.random.normal(key, (1, 4, 1, seq)),
              "mask": jax.random.bernoulli(key, 0.7, (2, 1, seq, seq))}[tensors]
    name = "mask" if tensors == "mask" else "bias"
    has_rows = tensor.shape[2] == seq
    tensor_spec = P(None, None, "sp") if has_rows else P()
    mesh = jax.make_mesh((n,), ("sp",), devices=devices)
    window = None if causal else (9, 4)

    def local(q, k, v, t):
        return jax_flash.ring_attention(q, k, v, axis_name="sp", layout=layout, causal=causal, window=window,
                                        return_lse=True, **{name: t})

    ring = shard_map(local, mesh=mesh, in_specs=(P(None, "sp"),) * 3 + (tensor_spec,),
                     out_specs=(P(None, "sp"), P(None, None, "sp")))
    one = lambda q, k, v, t: jax_flash.attention(q, k, v, causal=causal, window=window, return_lse=True,  # noqa: E731
                                                 **{name: t})
    args = [jax.device_put(x[:, order], NamedSharding(mesh, P(None, "sp"))) for x in (q, k, v)]
    local_tensor = jax.device_put(tensor[:, :, order] if has_rows else tensor, NamedSharding(mesh, tensor_spec))
    out, lse = jax.jit(ring)(*args, local_tensor)
    expected_out, expected_lse = one(q, k, v, tensor)
    _close(np.asarray(out)[:, undo], expected_out, devices)
    _close_lse(np.asarray(lse)[:, :, undo], expected_lse, devices)

    weights = jnp.sin(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.shape)
    argnums = (0, 1, 2, 3) if name == "bias" else (0, 1, 2)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(ring(*a)[0] * weights[:, order]), argnums=argnums))(*args,
                                                                                                   local_tensor)
    expected = jax.grad(lambda *a: jnp.sum(one(*a)[0] * weights), argnums=argnums)(q, k, v, tensor)
    for actual, want in zip(grads[:3], expected[:3]):
        _close(np.asarray(actual)[:, undo], want, devices)
    if name == "bias":
        _close(np.asarray(grads[3])[:, :, undo] if has_rows else grads[3], expected[3], devices)

    tangents = [jnp.cos(3.0 * x) for x in (q, k, v)]
    (_, _), (out_dot, lse_dot) = jax.jit(lambda a, t: jax.jvp(lambda *x: ring(*x, local_tensor), a, t))(
        tuple(args), tuple(jax.device_put(t[:, order], NamedSharding(mesh, P(None, "sp"))) for t in tangents))
    (_, _), (want_out_dot, want_lse_dot) = jax.jvp(lambda *x: one(*x, tensor), (q, k, v), tuple(tangents))
    _close(np.asarray(out_dot)[:, undo], want_out_dot, devices)
    _close_lse(np.asarray(lse_dot)[:, :, undo], want_lse_dot, devices)


def test_forward_mode_and_second_order_of_a_sequence_sharded_call():
    """Under explicit mesh axes the dense forms take K and V whole along the keys, and dk, dv come back sharded as k
    and v are (a product of two operands split by the same axis has no legal sharding otherwise)."""
    devices = _devices("cpu", 4)
    q, k, v = _inputs(devices, seed=4)
    mesh = jax.make_mesh((4,), ("seq",), devices=devices, axis_types=(AxisType.Explicit,))
    args = [jax.device_put(x, NamedSharding(mesh, P(None, "seq"))) for x in (q, k, v)]
    fn = functools.partial(jax_flash.attention, causal=True, window=(20, -1), return_lse=True)
    _forward_mode_and_second_order(fn, fn, args, (q, k, v), np.arange(q.shape[1]), devices)


@pytest.mark.parametrize("kwargs", [dict(causal=True), dict(causal=True, window=(5, -1)), dict(window=(3, 4))])
def test_odd_shards_run_the_contiguous_ring(kwargs):
    """36 tokens over 4 devices: shards of 9 cannot be halved for zigzag, so causal runs the contiguous ring."""
    devices = _devices("cpu", 4)
    q, k, v = _inputs(devices, seq_q=36, seq_k=36)
    lengths = jnp.array([36, 20], jnp.int32)
    fn = functools.partial(jax_flash.attention, q_lengths=lengths, kv_lengths=lengths, **kwargs) \
        if kwargs.get("causal") else functools.partial(jax_flash.attention, **kwargs)
    expected = _one_device(devices, fn, q, k, v)
    mesh = jax.make_mesh((4,), ("seq",), devices=devices)
    args = [jax.device_put(x, NamedSharding(mesh, P(None, "seq"))) for x in (q, k, v)]
    jitted = jax.jit(fn)
    _close(jitted(*args), expected, devices)
    assert _collectives(jitted.lower(*args).compile().as_text()) == {"collective-permute"}
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2)))(*args)
    for actual, want in zip(grads, _one_device(devices, jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2)),
                                               q, k, v)):
        _close(actual, want, devices)


def test_gspmd_partitioner_runs_the_ring_too():
    """The 16-bit call and the FP8 kernel's call, sequence-sharded under GSPMD (Shardy off)."""
    devices = _devices("cpu", 4)
    q, k, v = _inputs(devices)
    causal = functools.partial(jax_flash.attention, causal=True)
    expected = _one_device(devices, causal, q, k, v)
    fp8_inputs = _fp8_inputs(devices)
    fp8_causal = functools.partial(_fp8_kernel, causal=True)
    fp8_expected, _ = _one_device(devices, fp8_causal, *fp8_inputs)
    mesh = jax.make_mesh((4,), ("seq",), devices=devices)
    spec = NamedSharding(mesh, P(None, "seq"))
    args = [jax.device_put(x, spec) for x in (q, k, v)]
    fp8_args = [jax.device_put(x, spec) for x in fp8_inputs[:3]] + list(fp8_inputs[3:])
    previous = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        jitted, fp8_jitted = jax.jit(causal), jax.jit(fp8_causal)
        out, (fp8_out, _) = jitted(*args), fp8_jitted(*fp8_args)
        hlos = [jitted.lower(*args).compile().as_text(), fp8_jitted.lower(*fp8_args).compile().as_text()]
    finally:
        jax.config.update("jax_use_shardy_partitioner", previous)
    _close(out, expected, devices)
    _close_fp8(fp8_out, fp8_expected, _fp8_reference(fp8_inputs, causal=True))
    for hlo in hlos:
        assert _collectives(hlo) == {"collective-permute"}, _collectives(hlo)


def test_vmap_and_checkpoint_of_a_sequence_sharded_call():
    devices = _devices("cpu", 4)
    q, k, v = (jnp.stack([x, -x]) for x in _inputs(devices))  # a leading vmapped axis
    mesh = jax.make_mesh((4,), ("seq",), devices=devices)
    args = [jax.device_put(x, NamedSharding(mesh, P(None, None, "seq"))) for x in (q, k, v)]
    fn = jax.vmap(functools.partial(jax_flash.attention, causal=True, window=(20, -1)))
    _close(jax.jit(fn)(*args), fn(q, k, v), devices)
    loss = lambda *a: jnp.sum(jax.checkpoint(fn)(*a) ** 2)  # noqa: E731
    jitted = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    for actual, want in zip(jitted(*args), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)):
        _close(actual, want, devices)
    assert not _gathers_of_qkv(jitted.lower(*args).compile().as_text())


# ---- the static plans and the merge, against brute force ----------------------------------------------------------
@pytest.mark.parametrize("rows,keys", [(8, 8), (5, 9), (9, 4), (1, 7)])
def test_pair_plan_reproduces_every_band(rows, keys):
    """For every band lo <= j - i <= hi over a (rows, keys) block, the plan's slice and kernel window see exactly
    the band's pairs (the kernel window as jax_flash.reference.visibility_mask defines it)."""
    bounds = [None] + list(range(-rows - 1, keys + 2))
    i, j = np.arange(rows)[:, None], np.arange(keys)[None, :]
    for lo in bounds:
        for hi in bounds:
            band = np.ones((rows, keys), bool)
            if lo is not None:
                band &= j - i >= lo
            if hi is not None:
                band &= j - i <= hi
            plan = _ring.pair_plan(rows, keys, lo, hi)
            if plan is None:
                assert not band.any(), (lo, hi)
                continue
            r0, r1, c0, c1, left, right = plan
            assert left >= -1 and right >= -1
            seen = np.zeros((rows, keys), bool)
            seen[r0:r1, c0:c1] = np.asarray(visibility_mask(1, r1 - r0, c1 - c0, window=(left, right)))[0, 0]
            np.testing.assert_array_equal(seen, band, err_msg=f"lo={lo} hi={hi} plan={plan}")


def test_merge_partials_equals_attention_over_the_union_and_has_finite_gradients():
    q, k, v = random_qkv(3, 2, 16, 32, 2, 2, 16, jnp.float32)
    lengths = jnp.array([32, 10], jnp.int32)  # row 1: the second half of the keys is invisible

    def merged(q, k, v):
        a = jax_flash.attention(q, k[:, :16], v[:, :16], kv_lengths=jnp.minimum(lengths, 16), return_lse=True)
        b = jax_flash.attention(q, k[:, 16:], v[:, 16:], kv_lengths=jnp.maximum(lengths - 16, 0), return_lse=True)
        return _ring.merge_partials(a[0], a[1], b[0], b[1])

    out, lse = merged(q, k, v)
    expected_out, expected_lse = jax_flash.attention(q, k, v, kv_lengths=lengths, return_lse=True)
    np.testing.assert_allclose(out, expected_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-5, atol=1e-6)
    empty = jnp.zeros_like(lse) - jnp.inf  # both parts empty: zeros, -inf, and zero (not NaN) gradients
    out, lse = _ring.merge_partials(jnp.zeros_like(out), empty, jnp.zeros_like(out), empty)
    assert not np.asarray(out).any() and np.isneginf(np.asarray(lse)).all()
    grads = jax.grad(lambda a, b: jnp.sum(_ring.merge_partials(a, empty, b, empty)[0]), argnums=(0, 1))(out, out)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


def test_alibi_over_a_sequence_sharded_mesh_is_gathered_and_correct():
    """ALiBi's distances are global positions, which the ring's steps do not carry: gathered, warned, and equal to
    one device's result."""
    n = 4
    devices = _devices("cpu", n)
    spec = NamedSharding(jax.make_mesh((n,), ("seq",), devices=devices), P(None, "seq"))
    q, k, v = _inputs(devices, seq_q=64, seq_k=64)
    slopes = 2.0 ** -jnp.arange(1, q.shape[2] + 1, dtype=jnp.float32)
    alibi = functools.partial(jax_flash.attention, causal=True, alibi_slopes=slopes)
    expected = _one_device(devices, alibi, q, k, v)
    _sharding._warned.clear()
    with pytest.warns(UserWarning, match="ALiBi slopes measure distances between global positions"):
        out = jax.jit(alibi)(*(jax.device_put(x, spec) for x in (q, k, v)))
    _close(out, expected, devices)
