"""Multi-device sharding: batch- and head-sharded inputs run shard-local (no all-gather of q, k or v), keep their
sharding, and give the single-device result; sequence-sharded inputs the ring cannot run are gathered with a one-time
warning (tests/test_ring.py has the ring); the call works inside shard_map and under both partitioners (Shardy,
GSPMD).

On CPU the devices are the virtual ones conftest.py asks XLA for (--xla_force_host_platform_device_count=8); the
same tests run on GPUs when the machine has two or more.
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
from jax_flash import _sharding, fp8
from jax_flash.attention import _fp8_kernel_call as fp8_kernel_call
from conftest import GPU_DEVICES, random_qkv

try:
    from jax import shard_map
except ImportError:  # older jax
    from jax.experimental.shard_map import shard_map


def _platform_devices(platform):
    if platform == "cpu":
        devices = jax.devices("cpu")
        if len(devices) < 4:
            pytest.fail("conftest.py should have made 4 virtual CPU devices (XLA_FLAGS was set too late?)")
        return devices[:4]
    if len(GPU_DEVICES) < 2:
        pytest.skip(f"multi-GPU sharding needs 2 or more GPUs; {len(GPU_DEVICES)} visible")
    return GPU_DEVICES[:4] if len(GPU_DEVICES) >= 4 else GPU_DEVICES[:2]


@pytest.fixture(params=["cpu", "gpu"])
def devices(request):
    return _platform_devices(request.param)


def _mesh(devices, axis_types=AxisType.Auto, split="both"):
    """(data, model) mesh: "both" (2, n/2): (2, 2) on 4 devices, (2, 1) on 2; "heads" (1, n); "batch" (n, 1)."""
    n = len(devices)
    shape = {"both": (2, n // 2), "heads": (1, n), "batch": (n, 1)}[split]
    return jax.make_mesh(shape, ("data", "model"), axis_types=(axis_types,) * 2, devices=devices)


def _inputs(devices, heads_q=8, heads_k=2, batch=4, seq_q=80, seq_k=112, head_dim=64):
    dtype = jnp.float32 if devices[0].platform == "cpu" else jnp.bfloat16
    return random_qkv(0, batch, seq_q, seq_k, heads_q, heads_k, head_dim, dtype)


def _single_device(devices, fn, *args):
    return jax.jit(fn)(*(jax.device_put(x, devices[0]) for x in args))


def _collectives(hlo: str) -> list[str]:
    return sorted(set(re.findall(r"\b(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)\b", hlo)))


@pytest.mark.parametrize("heads_q,heads_k", [(8, 8), (16, 4), (8, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("axis_types", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("split", ["both", "heads"])
def test_batch_and_head_sharding_runs_shard_local(devices, heads_q, heads_k, axis_types, split):
    mesh = _mesh(devices, axis_types, split)
    q, k, v = _inputs(devices, heads_q, heads_k)
    lengths = jnp.array([80, 33, 0, 71], jnp.int32)

    def fn(q, k, v, kv_lengths):
        return jax_flash.attention(q, k, v, causal=True, window=(40, -1), kv_lengths=kv_lengths, return_lse=True)

    expected_out, expected_lse = _single_device(devices, fn, q, k, v, lengths)
    spec = NamedSharding(mesh, P("data", None, "model", None))
    kv_spec = spec if heads_k % mesh.shape["model"] == 0 else NamedSharding(mesh, P("data"))  # MQA: one kv head
    args = (jax.device_put(q, spec), *(jax.device_put(x, kv_spec) for x in (k, v)),
            jax.device_put(lengths, NamedSharding(mesh, P("data"))))
    jitted = jax.jit(fn)
    out, lse = jitted(*args)

    if heads_k == 1:  # a device's query heads pack differently over the one kv head: rounding may differ
        tol = dict(rtol=1e-5, atol=1e-6) if devices[0].platform == "cpu" else dict(rtol=1e-2, atol=1e-2)  # 1 bf16 ulp
        np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), np.asarray(expected_out.astype(jnp.float32)),
                                   **tol)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(expected_lse), **tol)
    else:
        np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)),
                                      np.asarray(expected_out.astype(jnp.float32)))
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(expected_lse))
    assert out.sharding.is_equivalent_to(spec, 4), f"output sharding {out.sharding} differs from the input's {spec}"
    assert lse.sharding.is_equivalent_to(NamedSharding(mesh, P("data", "model", None)), 3), lse.sharding

    hlo = jitted.lower(*args).compile().as_text()
    assert _collectives(hlo) == [], f"sharded attention should need no collectives, found {_collectives(hlo)}"
    # The kernel sees one device's shard: batch / data size, heads / model size (kv heads too unless MQA).
    n_data, n_model = mesh.shape["data"], mesh.shape["model"]
    local_q = f"[{4 // n_data},80,{heads_q // n_model},64]"
    local_k = f"[{4 // n_data},112,{heads_k // n_model if heads_k > 1 else 1},64]"
    call = next(line for line in hlo.splitlines() if 'custom_call_target="jax_flash_attention"' in line)
    assert local_q in call and local_k in call, call


def test_batch_only_mesh_and_lengths_sharded(devices):
    mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(AxisType.Auto,), devices=devices)
    q, k, v = _inputs(devices, heads_q=4, heads_k=4, batch=8, seq_q=64, seq_k=64)
    q_lengths = jnp.array([64, 1, 17, 0, 64, 40, 63, 2], jnp.int32)

    def fn(q, k, v, q_lengths):
        return jax_flash.attention(q, k, v, q_lengths=q_lengths, softcap=5.0)

    expected = _single_device(devices, fn, q, k, v, q_lengths)
    spec = NamedSharding(mesh, P("data"))
    jitted = jax.jit(fn)
    args = [jax.device_put(x, spec) for x in (q, k, v, q_lengths)]
    out = jitted(*args)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), np.asarray(expected.astype(jnp.float32)))
    assert out.sharding.is_equivalent_to(spec, 4), out.sharding
    assert _collectives(jitted.lower(*args).compile().as_text()) == []


def test_sequence_sharded_call_the_ring_cannot_run_is_gathered_with_one_warning(devices):
    """Causal with unequal query and key lengths has no static ring plan (tests/test_ring.py has the ring): gathered,
    with the reason in a warning given once per process."""
    mesh = _mesh(devices)
    q, k, v = _inputs(devices)  # seq_q 80, seq_k 112
    causal = functools.partial(jax_flash.attention, causal=True)
    expected = _single_device(devices, causal, q, k, v)
    seq_spec = NamedSharding(mesh, P(None, "data", None, None))  # "data" has size 2 on every mesh here
    args = [jax.device_put(x, seq_spec) for x in (q, k, v)]
    _sharding._warned.clear()
    with pytest.warns(UserWarning, match="gathered .* instead of running ring attention, because causal or window "
                                         "masks need equal local query and key lengths"):
        out = jax.jit(causal)(*args)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), np.asarray(expected.astype(jnp.float32)))
    # Once per process: a second, differently shaped call does not warn again.
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, window=(3, 3)))(*args)


def test_head_dim_sharded_input_is_gathered(devices):
    mesh = _mesh(devices)
    q, k, v = _inputs(devices)
    expected = _single_device(devices, jax_flash.attention, q, k, v)
    spec = NamedSharding(mesh, P(None, None, None, "data"))
    _sharding._warned.clear()
    with pytest.warns(UserWarning, match="head_dim"):
        out = jax.jit(jax_flash.attention)(*(jax.device_put(x, spec) for x in (q, k, v)))
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), np.asarray(expected.astype(jnp.float32)))


def test_heads_that_cannot_split_consistently_are_replicated(devices):
    mesh = _mesh(devices, split="heads")
    q, k, v = _inputs(devices, heads_q=12, heads_k=3)  # 3 kv heads over 2 or 4 devices: no consistent split
    expected = _single_device(devices, jax_flash.attention, q, k, v)
    spec = NamedSharding(mesh, P("data", None, "model", None))
    q_sharded = jax.device_put(q, spec)
    k_sharded, v_sharded = (jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (k, v))
    _sharding._warned.clear()
    with pytest.warns(UserWarning, match="cannot be split consistently"):
        out = jax.jit(jax_flash.attention)(q_sharded, k_sharded, v_sharded)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), np.asarray(expected.astype(jnp.float32)))


def test_inside_shard_map(devices):
    mesh = _mesh(devices)
    q, k, v = _inputs(devices)
    expected = _single_device(devices, lambda q, k, v: jax_flash.attention(q, k, v, causal=True), q, k, v)
    spec = P("data", None, "model", None)
    fn = jax.jit(shard_map(lambda q, k, v: jax_flash.attention(q, k, v, causal=True), mesh=mesh,
                           in_specs=(spec, spec, spec), out_specs=spec))
    args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
    out = fn(*args)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), np.asarray(expected.astype(jnp.float32)))
    assert _collectives(fn.lower(*args).compile().as_text()) == []


def test_gspmd_partitioner(devices):
    """The non-Shardy partitioner uses infer_sharding_from_operands instead of the Shardy rule."""
    mesh = _mesh(devices)
    q, k, v = _inputs(devices)
    expected = _single_device(devices, jax_flash.attention, q, k, v)
    spec = NamedSharding(mesh, P("data", None, "model", None))
    args = [jax.device_put(x, spec) for x in (q, k, v)]
    previous = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        jitted = jax.jit(jax_flash.attention)
        out = jitted(*args)
        hlo = jitted.lower(*args).compile().as_text()
    finally:
        jax.config.update("jax_use_shardy_partitioner", previous)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), np.asarray(expected.astype(jnp.float32)))
    assert out.sharding.is_equivalent_to(spec, 4), out.sharding
    assert _collectives(hlo) == [], _collectives(hlo)


def test_vmap_over_sharded_inputs(devices):
    """vmap folds into the batch before partitioning; the folded batch stays split."""
    mesh = _mesh(devices)
    q, k, v = _inputs(devices)
    stacked = [jnp.stack([x, x[::-1]]) for x in (q, k, v)]  # (2, B, S, H, D)
    spec = NamedSharding(mesh, P(None, "data", None, "model", None))
    out = jax.jit(jax.vmap(jax_flash.attention))(*(jax.device_put(x, spec) for x in stacked))
    for i in range(2):
        expected = _single_device(devices, jax_flash.attention, *(x[i] for x in stacked))
        np.testing.assert_array_equal(np.asarray(out[i].astype(jnp.float32)),
                                      np.asarray(expected.astype(jnp.float32)))


@pytest.mark.parametrize("split", ["both", "heads", "batch"])
def test_gradients_under_batch_and_head_sharding_equal_one_device(devices, split):
    """The backward custom call partitions like the forward: each device differentiates its shard, no gather."""
    mesh = _mesh(devices, split=split)
    q, k, v = _inputs(devices, heads_q=8, heads_k=4)
    lengths = jnp.array([80, 33, 0, 71], jnp.int32)

    def loss(q, k, v, kv_lengths):
        out = jax_flash.attention(q, k, v, causal=True, window=(40, -1), kv_lengths=kv_lengths)
        return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.shape[1]))[:, None, None])

    grad = jax.grad(loss, argnums=(0, 1, 2))
    expected = _single_device(devices, grad, q, k, v, lengths)
    spec = NamedSharding(mesh, P("data", None, "model", None))
    args = [jax.device_put(x, spec) for x in (q, k, v)] + [jax.device_put(lengths, NamedSharding(mesh, P("data")))]
    jitted = jax.jit(grad)
    tol = dict(rtol=1e-5, atol=1e-5) if devices[0].platform == "cpu" else dict(rtol=2e-2, atol=2e-2)
    for name, actual, want in zip("qkv", jitted(*args), expected):
        np.testing.assert_allclose(np.asarray(actual.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)),
                                   err_msg=name, **tol)
        assert actual.sharding.is_equivalent_to(spec, 4), (name, actual.sharding)
    hlo = jitted.lower(*args).compile().as_text()
    assert not {"all-gather", "all-to-all"} & set(_collectives(hlo)), _collectives(hlo)
    assert 'custom_call_target="jax_flash_attention_bwd"' in hlo


@pytest.mark.parametrize("extras", ["none", "kv_lengths", "mask"])
def test_gradients_inside_shard_map_equal_one_device(devices, extras):
    """jax.grad through the call inside shard_map: the absent operands' zero-size placeholders are no residuals of
    the derivative (a backward reading one crashed jax 0.11's Shardy import while compiling)."""
    mesh = _mesh(devices)
    q, k, v = _inputs(devices)
    lengths = jnp.array([80, 33, 0, 71], jnp.int32)
    mask = jax.random.bernoulli(jax.random.PRNGKey(3), 0.7, (4, 1, q.shape[1], k.shape[1]))

    def loss(q, k, v, lengths, mask):
        kwargs = {"none": {}, "kv_lengths": {"kv_lengths": lengths}, "mask": {"mask": mask}}[extras]
        out = jax_flash.attention(q, k, v, causal=True, **kwargs)
        return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.shape[1]))[:, None, None])

    spec = P("data", None, "model", None)
    local_loss = shard_map(lambda *a: jax.lax.psum(loss(*a), ("data", "model")), mesh=mesh,
                           in_specs=(spec, spec, spec, P("data"), P("data")), out_specs=P())
    grad = jax.grad(loss, argnums=(0, 1, 2))
    expected = _single_device(devices, grad, q, k, v, lengths, mask)
    args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)] + \
        [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (lengths, mask)]
    tol = dict(rtol=1e-5, atol=1e-5) if devices[0].platform == "cpu" else dict(rtol=2e-2, atol=2e-2)
    for name, actual, want in zip("qkv", jax.jit(jax.grad(local_loss, argnums=(0, 1, 2)))(*args), expected):
        np.testing.assert_allclose(np.asarray(actual.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)),
                                   err_msg=name, **tol)


def test_second_order_inside_shard_map_equals_one_device():
    """Grad of grad through the call inside shard_map (the backward's JVP, its placeholders recreated), CPU float32."""
    devices = _platform_devices("cpu")
    mesh = _mesh(devices, split="batch")
    q, k, v = (x[:, :16, :, :32] for x in _inputs(devices, heads_q=4, heads_k=2))
    lengths = jnp.array([16, 9, 0, 12], jnp.int32)

    def loss(q, k, v, lengths):
        return jnp.sum(jnp.sin(jax_flash.attention(q, k, v, causal=True, kv_lengths=lengths)))

    def grad_norm(loss):
        return lambda *a: jnp.sum(jax.grad(loss)(*a) ** 2)

    spec = P("data")
    local_loss = shard_map(lambda *a: jax.lax.psum(loss(*a), "data"), mesh=mesh, in_specs=(spec,) * 4,
                           out_specs=P())
    expected = _single_device(devices, jax.grad(grad_norm(loss)), q, k, v, lengths)
    args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v, lengths)]
    actual = jax.jit(jax.grad(grad_norm(local_loss)))(*args)
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=1e-5, atol=1e-5)


def _fp8_inputs(devices, heads_q, heads_k):
    """q, k, v as float8_e4m3fn with their (batch, heads_k) descales (head dim 128: the FP8 kernel's)."""
    if devices[0].platform != "cpu" and not fp8._on_hopper():
        pytest.skip("the FP8 kernel runs on Hopper GPUs only")
    q, k, v = random_qkv(1, 4, 80, 112, heads_q, heads_k, 128, jnp.float32, devices[0])
    (q8, qd), (k8, kd), (v8, vd) = jax_flash.quantize_fp8(q, heads_k), jax_flash.quantize_fp8(k), \
        jax_flash.quantize_fp8(v)
    return q8, k8, v8, qd, kd, vd


def _fp8_kernel_call(q, k, v, q_descale, k_descale, v_descale, kv_lengths):
    """The FP8 kernel's primitive (the sm90 kernel on a Hopper GPU; on the CPU its lowering there, the CPU path on
    the dequantised inputs), as jax_flash.attention calls it for float8_e4m3fn inputs on Hopper."""
    kwargs = dict(causal=True, window=(40, -1), softmax_scale=None, q_lengths=None, kv_lengths=kv_lengths)
    descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    return fp8_kernel_call(q, k, v, None, descales, jnp.bfloat16, True, kwargs)


@pytest.mark.parametrize("heads_q,heads_k", [(8, 8), (16, 4), (8, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("split", ["both", "heads"])
def test_fp8_kernel_call_under_batch_and_head_sharding_runs_shard_local(devices, heads_q, heads_k, split):
    mesh = _mesh(devices, split=split)
    inputs = _fp8_inputs(devices, heads_q, heads_k)
    lengths = jnp.array([80, 33, 0, 71], jnp.int32)
    expected_out, expected_lse = _single_device(devices, _fp8_kernel_call, *inputs, lengths)
    split_kv = heads_k % mesh.shape["model"] == 0  # MQA: every device reads the one kv head
    spec = NamedSharding(mesh, P("data", None, "model", None))
    kv_spec = spec if split_kv else NamedSharding(mesh, P("data"))
    descale_spec = NamedSharding(mesh, P("data", "model" if split_kv else None))
    args = (jax.device_put(inputs[0], spec), *(jax.device_put(x, kv_spec) for x in inputs[1:3]),
            *(jax.device_put(x, descale_spec) for x in inputs[3:]),
            jax.device_put(lengths, NamedSharding(mesh, P("data"))))
    jitted = jax.jit(_fp8_kernel_call)
    out, lse = jitted(*args)

    # (on the CPU a device's query heads pack differently over MQA's one kv head: rounding may differ)
    tol = dict(rtol=1e-2, atol=1e-2) if heads_k == 1 and devices[0].platform == "cpu" else dict(rtol=0, atol=0)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected_out, np.float32), **tol)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(expected_lse), **tol)
    assert out.sharding.is_equivalent_to(spec, 4), f"output sharding {out.sharding} differs from the input's {spec}"
    assert lse.sharding.is_equivalent_to(NamedSharding(mesh, P("data", "model", None)), 3), lse.sharding

    hlo = jitted.lower(*args).compile().as_text()
    assert _collectives(hlo) == [], f"sharded FP8 attention should need no collectives, found {_collectives(hlo)}"
    target = "jax_flash_attention" if devices[0].platform == "cpu" else "jax_flash_attention_fp8"
    call = next(line for line in hlo.splitlines() if f'custom_call_target="{target}"' in line)
    n_data, n_model = mesh.shape["data"], mesh.shape["model"]
    assert f"[{4 // n_data},80,{heads_q // n_model},128]" in call, call  # one device's q shard


def test_fp8_kernel_call_the_ring_cannot_run_is_gathered_with_one_warning(devices):
    mesh = _mesh(devices)
    inputs = _fp8_inputs(devices, 8, 2)
    lengths = jnp.array([80, 33, 0, 71], jnp.int32)
    expected_out, _ = _single_device(devices, _fp8_kernel_call, *inputs, lengths)
    seq_spec = NamedSharding(mesh, P(None, "data", None, None))
    args = ([jax.device_put(x, seq_spec) for x in inputs[:3]]
            + [jax.device_put(x, NamedSharding(mesh, P())) for x in (*inputs[3:], lengths)])
    _sharding._warned.clear()
    with pytest.warns(UserWarning, match="float8_e4m3fn q, k, v sharded along the sequence .* instead of running "
                                         "ring attention, because causal or window masks need equal local"):
        out, _ = jax.jit(_fp8_kernel_call)(*args)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected_out, np.float32))
