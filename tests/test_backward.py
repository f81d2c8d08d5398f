"""The backward pass: jax.grad, jax.vjp, jax.jvp and friends through jax_flash.attention against the same
derivatives of attention_reference, by the tolerance rule of the forward (twice the error of a plain low-precision
implementation, plus atol). CPU, and on a GPU the backward kernels of the device's family (sm80 or sm90)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jax_flash
from jax_flash.reference import gather_pages
from conftest import GPU_DEVICES, random_qkv, requires_gpu

CPU = jax.devices("cpu")[0]
GRAD_ATOL = {jnp.dtype(jnp.float32): 1e-4, jnp.dtype(jnp.float16): 2e-3, jnp.dtype(jnp.bfloat16): 2e-2}


def _loss(attention, weights, **kwargs):
    """A weighted sum of the output (and of the finite lse entries, with lse=True): every gradient path is used."""
    lse_weight = kwargs.pop("lse_weight", None)

    def loss(q, k, v):
        if lse_weight is None:
            return (attention(q, k, v, **kwargs).astype(jnp.float32) * weights).sum()
        out, lse = attention(q, k, v, return_lse=True, **kwargs)
        return (out.astype(jnp.float32) * weights).sum() + jnp.where(jnp.isfinite(lse), lse * lse_weight, 0).sum()

    return loss


def assert_grads_close(q, k, v, seed=0, lse=False, **kwargs):
    """jax.grad of a weighted sum through jax_flash.attention against the fp32 reference's, by the tolerance rule."""
    weights = jax.random.normal(jax.random.PRNGKey(seed), q.shape, jnp.float32)
    if lse:
        kwargs["lse_weight"] = jax.random.normal(jax.random.PRNGKey(seed + 1), (q.shape[0], q.shape[2], q.shape[1]))
    grads = jax.jit(jax.grad(_loss(jax_flash.attention, weights, **dict(kwargs)), argnums=(0, 1, 2)))(q, k, v)
    kwargs.pop("deterministic", None)  # (the reference has one order of summation anyway)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref = jax.grad(_loss(jax_flash.attention_reference, weights, **dict(kwargs)), argnums=(0, 1, 2))(*f32)
    lowp = jax.grad(_loss(lambda *a, **kw: jax_flash.attention_reference(*a, compute_dtype=q.dtype, **kw), weights,
                          **dict(kwargs)), argnums=(0, 1, 2))(q, k, v)
    for name, g, r, l, x in zip("qkv", grads, ref, lowp, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        g, r, l = (np.asarray(a.astype(jnp.float32)) for a in (g, r, l))
        assert np.isfinite(g).all(), f"d{name} has non-finite values"
        err = np.abs(g - r).max(initial=0.0)
        bound = 2 * np.abs(l - r).max(initial=0.0) + GRAD_ATOL[jnp.dtype(q.dtype)] * max(1.0, np.abs(r).max(initial=0))
        assert err <= bound, f"d{name}: max error {err:.3g} exceeds 2 x low-precision error + atol = {bound:.3g}"


FEATURES = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(causal=True, window=(37, -1)),
    "softcap": dict(softcap=7.0, softmax_scale=0.3),
    "lengths": dict(causal=True, q_lengths=np.array([50, 17], np.int32), kv_lengths=np.array([90, 33], np.int32)),
    "lse": dict(causal=True, lse=True),
}


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("heads_q,heads_k", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_grad_matches_reference(feature, heads_q, heads_k, dtype):
    kwargs = {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in FEATURES[feature].items()}
    q, k, v = random_qkv(heads_k, 2, 50, 90, heads_q, heads_k, 64, dtype, CPU)
    assert_grads_close(q, k, v, **kwargs)


@pytest.mark.parametrize("head_dim,dtype", [(128, jnp.float16), (256, jnp.bfloat16), (48, jnp.float32)],
                         ids=["d128-fp16", "d256-bf16", "d48-fp32"])
def test_grad_head_dims_and_dtypes(head_dim, dtype):
    q, k, v = random_qkv(head_dim, 1, 33, 70, 2, 1, head_dim, dtype, CPU)
    assert_grads_close(q, k, v, causal=True)


@pytest.mark.parametrize("seq_q,seq_k", [(1, 1), (1, 300), (300, 1), (129, 257), (0, 5), (5, 0)])
def test_grad_odd_and_empty_lengths(seq_q, seq_k):
    q, k, v = random_qkv(seq_q + seq_k, 2, seq_q, seq_k, 2, 2, 32, jnp.float32, CPU)
    assert_grads_close(q, k, v, causal=True)


def test_rows_that_see_no_key_have_zero_gradients():
    """Causal Sq > Sk leaves the first rows with no key; kv_lengths 0 hides every key: zeros, never NaN."""
    q, k, v = random_qkv(3, 2, 40, 16, 2, 1, 32, jnp.float32, CPU)
    lengths = jnp.array([0, 16], jnp.int32)
    dq, dk, dv = jax.grad(lambda q, k, v: jax_flash.attention(q, k, v, causal=True, kv_lengths=lengths).sum(),
                          argnums=(0, 1, 2))(q, k, v)
    assert np.isfinite(np.asarray(dq)).all() and np.isfinite(np.asarray(dk)).all()
    assert (np.asarray(dq)[0] == 0).all() and (np.asarray(dk)[0] == 0).all() and (np.asarray(dv)[0] == 0).all()
    assert (np.asarray(dq)[1, :24] == 0).all()  # rows 0..23 see no key (bottom-right: row i sees keys <= i - 24)


@pytest.fixture
def cpu_default():
    """jax's default device set to the CPU for the test: its jits without arguments and the float32 arrays made
    inside it (tangents, jax.test_util's perturbations) run the CPU path, also where a GPU is the default device."""
    with jax.default_device(CPU):
        yield


@pytest.mark.usefixtures("cpu_default")
def test_check_grads_fp32():
    """jax.test_util.check_grads: forward and reverse mode against finite differences, first and second order
    forward (jvp of the jnp linearisation)."""
    q, k, v = random_qkv(1, 1, 7, 9, 2, 1, 8, jnp.float32, CPU)
    f = lambda q, k, v: jax_flash.attention(q, k, v, causal=True, softcap=3.0)  # noqa: E731
    jax.test_util.check_grads(f, (q, k, v), order=1, modes=("fwd", "rev"), atol=2e-2, rtol=2e-2, eps=1e-2)


SECOND_ORDER = {
    "causal_gqa": dict(causal=True),
    "window_softcap": dict(causal=True, window=(5, 2), softcap=3.0, softmax_scale=0.3),
    "lengths_lse": dict(causal=True, q_lengths=np.array([9, 13], np.int32), kv_lengths=np.array([15, 4], np.int32),
                        lse=True),
    "bias_mask": dict(bias="bias", mask="mask"),
    "alibi_segments": dict(alibi_slopes=np.array([0.5, 0.25, 0.1, 0.05], np.float32),
                           q_segment_ids=np.array([[0] * 6 + [1] * 7] * 2, np.int32),
                           kv_segment_ids=np.array([[0] * 8 + [1] * 9] * 2, np.int32)),
}


@pytest.mark.usefixtures("cpu_default")
@pytest.mark.parametrize("feature", SECOND_ORDER)
def test_second_order_matches_reference(feature):
    """Hessian-vector products (jax.jvp of jax.grad) and grad of grad against attention_reference's, fp32: the
    backward's JVP (its formulas in jnp) with the custom calls for the primal values."""
    kwargs = dict(SECOND_ORDER[feature])
    q, k, v = random_qkv(2, 2, 13, 17, 4, 2, 16, jnp.float32, CPU)
    keys = jax.random.split(jax.random.PRNGKey(3), 6)
    if kwargs.get("bias") == "bias":
        kwargs["bias"] = jax.random.normal(keys[4], (2, 1, 13, 17))
        kwargs["mask"] = jax.random.bernoulli(keys[5], 0.7, (2, 4, 13, 17))
    weights = jax.random.normal(keys[0], q.shape)
    if kwargs.pop("lse", False):
        kwargs["lse_weight"] = jax.random.normal(keys[1], (2, 4, 13))
    tangents = tuple(jax.random.normal(key, x.shape) for key, x in zip(keys[1:4], (q, k, v)))

    def squashed(attention):  # tanh of the output: the backward's cotangent then depends on q, k and v too
        def run(*args, **kw):
            result = attention(*args, **kw)
            return (jnp.tanh(result[0]), result[1]) if isinstance(result, tuple) else jnp.tanh(result)
        return run

    def hvp_and_grad_of_grad(attention):
        loss = _loss(squashed(attention), weights, **dict(kwargs))
        grad = jax.grad(loss, argnums=(0, 1, 2))
        hvp = jax.jvp(grad, (q, k, v), tangents)[1]
        squares = jax.grad(lambda *a: sum((g ** 2).sum() for g in grad(*a)), argnums=(0, 1, 2))(q, k, v)
        return (*hvp, *squares)

    ours = jax.jit(lambda: hvp_and_grad_of_grad(jax_flash.attention))()
    reference = hvp_and_grad_of_grad(jax_flash.attention_reference)
    for name, a, r in zip(("hvp q", "hvp k", "hvp v", "gg q", "gg k", "gg v"), ours, reference):
        assert a.shape == r.shape and np.isfinite(np.asarray(a)).all(), name
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=2e-5 * float(np.abs(r).max()), err_msg=name)


@pytest.mark.usefixtures("cpu_default")
@pytest.mark.parametrize("order", ["rev_rev", "fwd_rev", "rev_fwd", "fwd_fwd"])
def test_hessian_in_every_mode_order(order):
    """jax.hessian (forward over reverse) and the other three nestings: the JVP of the backward primitive and of the
    linearised attention_lin_p."""
    q, k, v = random_qkv(1, 1, 3, 5, 2, 1, 4, jnp.float32, CPU)
    outer, inner = ({"rev": jax.jacrev, "fwd": jax.jacfwd}[mode] for mode in order.split("_"))

    def hessian(attention):
        return outer(inner(lambda q: jnp.sin(attention(q, k, v, causal=True, softcap=3.0)).sum()))(q)

    ours, expected = jax.jit(lambda: hessian(jax_flash.attention))(), hessian(jax_flash.attention_reference)
    assert ours.shape == q.shape * 2
    np.testing.assert_allclose(np.asarray(ours), np.asarray(expected), atol=1e-5)


@pytest.mark.usefixtures("cpu_default")
def test_check_grads_second_order():
    q, k, v = random_qkv(1, 1, 3, 5, 1, 1, 4, jnp.float32, CPU)
    f = lambda q, k, v: jax_flash.attention(q, k, v, causal=True, softcap=3.0)  # noqa: E731
    jax.test_util.check_grads(f, (q, k, v), order=2, modes=("rev",), atol=2e-2, rtol=2e-2, eps=1e-2)


def test_vjp_value_and_grad_checkpoint_and_vmap_agree():
    q, k, v = random_qkv(4, 2, 20, 30, 4, 2, 32, jnp.float32, CPU)
    loss = lambda q, k, v: (jax_flash.attention(q, k, v, causal=True) ** 2).sum()  # noqa: E731
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    value, again = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert np.isclose(float(value), float(loss(q, k, v)))
    remat = jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2))(q, k, v)
    out, vjp = jax.vjp(lambda q, k, v: jax_flash.attention(q, k, v, causal=True), q, k, v)
    via_vjp = vjp(2 * out)
    for a, b, c, d in zip(grads, again, remat, via_vjp):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
        np.testing.assert_allclose(np.asarray(a), np.asarray(d), atol=1e-5)
    batched = jax.vmap(jax.grad(loss), in_axes=(0, None, None))(jnp.stack([q, 2 * q]), k, v)
    np.testing.assert_allclose(np.asarray(batched[0]), np.asarray(grads[0]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(batched[1]), np.asarray(jax.grad(loss)(2 * q, k, v)), atol=1e-5)


def test_backward_is_bitwise_deterministic():
    q, k, v = random_qkv(5, 1, 300, 700, 8, 1, 64, jnp.bfloat16, CPU)  # few items: the keys are split and merged
    grad = jax.jit(jax.grad(lambda q, k, v: jax_flash.attention(q, k, v).astype(jnp.float32).sum(),
                            argnums=(0, 1, 2)))
    first = [np.asarray(x) for x in grad(q, k, v)]
    for _ in range(3):
        for a, b in zip(first, grad(q, k, v)):
            np.testing.assert_array_equal(a, np.asarray(b))


def test_hlo_has_the_backward_custom_call_and_no_score_matrix():
    q, k, v = random_qkv(6, 2, 384, 512, 4, 2, 64, jnp.float32, CPU)
    text = jax.jit(jax.grad(lambda q, k, v: jax_flash.attention(q, k, v, causal=True).sum(), argnums=(0, 1, 2))
                   ).lower(q, k, v).compile().as_text()
    assert "jax_flash_attention_bwd" in text and "jax_flash_attention" in text
    assert not re.search(r"\[2,4,384,512\]|\[8,384,512\]", text), "a (Sq, Sk) buffer in the gradient's HLO"


def test_grad_under_sharding_equals_one_device():
    devices = jax.devices("cpu")
    if len(devices) < 4:
        pytest.skip("needs 4 virtual CPU devices (tests/conftest.py sets them)")
    q, k, v = random_qkv(7, 4, 24, 40, 4, 2, 32, jnp.float32, CPU)
    loss = lambda q, k, v: (jax_flash.attention(q, k, v, causal=True) ** 2).sum()  # noqa: E731
    expected = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    mesh = Mesh(np.array(devices[:4]).reshape(2, 2), ("b", "h"))
    for spec in (PartitionSpec("b", None, "h", None), PartitionSpec("b", None, None, None)):
        placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
        got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*placed)
        for a, b in zip(got, expected):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_paged_gradient_equals_the_contiguous_one():
    """Shuffled pages, one page shared by both sequences, ids past a sequence's length -1 (or out of the pool):
    the gradients of q and of the page pools equal those through gather_pages and a contiguous call; unused pages
    get zeros."""
    q, _, _ = random_qkv(8, 2, 5, 48, 4, 2, 32, jnp.float32, CPU)
    k_pages, v_pages = (jax.random.normal(jax.random.PRNGKey(s), (7, 16, 2, 32)) for s in (1, 2))
    table = jnp.array([[3, 0, 5], [5, 6, -1]], jnp.int32)  # page 5 in both; row 1 reads 32 keys
    kv_lengths = jnp.array([48, 29], jnp.int32)
    weights = jnp.cos(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.shape)
    kwargs = dict(causal=True, softcap=5.0, kv_lengths=kv_lengths, return_lse=True)

    def loss(q, k, v, paged):
        if paged:
            out, lse = jax_flash.attention(q, k, v, page_table=table, **kwargs)
        else:
            out, lse = jax_flash.attention(q, gather_pages(k, table), gather_pages(v, table), **kwargs)
        return jnp.sum(out * weights) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(q, k_pages, v_pages, True)
    want = jax.grad(loss, argnums=(0, 1, 2))(q, k_pages, v_pages, False)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(got[1])[5]).max() > 0  # the shared page
    for unused in (1, 2, 4):
        assert not np.asarray(got[1])[unused].any() and not np.asarray(got[2])[unused].any()
    second = lambda paged: jax.grad(  # noqa: E731  (grad of grad: the contiguous call's second order)
        lambda *a: jnp.sum(jax.grad(loss, argnums=1)(*a, paged) ** 2), argnums=(0, 1, 2))(q, k_pages, v_pages)
    for a, b in zip(second(True), second(False)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


# ---- the GPU backward -------------------------------------------------------------------------------------------
GPU_DTYPES = [jnp.bfloat16, jnp.float16]


@requires_gpu
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("heads_q,heads_k", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_gpu_grad_matches_reference(feature, heads_q, heads_k, dtype):
    kwargs = {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in FEATURES[feature].items()}
    if feature == "lengths":  # lengths that cut the 64-row query blocks and the 128-key blocks inside
        kwargs.update(q_lengths=jnp.array([150, 17], jnp.int32), kv_lengths=jnp.array([290, 33], jnp.int32))
    q, k, v = random_qkv(heads_k + 10, 2, 200, 300, heads_q, heads_k, 64, dtype, GPU_DEVICES[0])
    assert_grads_close(q, k, v, **kwargs)


@requires_gpu
@pytest.mark.parametrize("feature", [*FEATURES, "bias_mask"])
@pytest.mark.parametrize("heads_q,heads_k", [(4, 4), (4, 1)])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_gpu_grad_head_dim_256_features(feature, heads_q, heads_k, dtype):
    """Head dim 256, whose sm90 backward has both warpgroups on one 64-key block, each with half of the gradient's
    columns (sm90/bwd_kernel.cuh, kSplitD): every feature, and bias / mask tensors (its tensor variant)."""
    q, k, v = random_qkv(heads_k + 20, 2, 200, 300, heads_q, heads_k, 256, dtype, GPU_DEVICES[0])
    if feature == "bias_mask":
        keys = jax.random.split(jax.random.PRNGKey(5), 2)
        kwargs = dict(causal=True, bias=jax.random.normal(keys[0], (2, heads_q, 200, 300), jnp.float32),
                      mask=jax.random.bernoulli(keys[1], 0.8, (2, 1, 1, 300)))
    else:
        kwargs = {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in FEATURES[feature].items()}
    if feature == "lengths":  # lengths that cut the 64-row query blocks and the 64-key blocks inside
        kwargs.update(q_lengths=jnp.array([150, 17], jnp.int32), kv_lengths=jnp.array([290, 33], jnp.int32))
    assert_grads_close(q, k, v, **kwargs)


@requires_gpu
@pytest.mark.parametrize("feature", [*FEATURES, "left_window", "lengths_no_causal", "softcap_causal"])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_gpu_grad_head_dim_128_features(feature, dtype):
    """Head dim 128, whose sm90 backward walks 80-row items and computes dQ transposed (sm90/bwd_kernel.cuh,
    kSwapDQ), soft-capped or not: 200 rows are two whole items and one of 40, the lengths cut items inside; MQA, so
    each key block walks the four query heads' items."""
    extra = {"left_window": dict(window=(37, -1)), "softcap_causal": dict(causal=True, softcap=5.0),
             "lengths_no_causal": dict(q_lengths=np.array([150, 17], np.int32),
                                       kv_lengths=np.array([290, 33], np.int32))}
    kwargs = {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x
              for n, x in (FEATURES | extra)[feature].items()}
    if feature == "lengths":
        kwargs.update(q_lengths=jnp.array([150, 17], jnp.int32), kv_lengths=jnp.array([290, 33], jnp.int32))
    q, k, v = random_qkv(30, 2, 200, 300, 4, 1, 128, dtype, GPU_DEVICES[0])
    assert_grads_close(q, k, v, **kwargs)


@requires_gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("seq_q,seq_k,causal", [(384, 384, True), (130, 1000, False), (1000, 130, True)])
def test_gpu_grad_head_dims(head_dim, dtype, seq_q, seq_k, causal):
    q, k, v = random_qkv(head_dim + seq_q, 1, seq_q, seq_k, 4, 2, head_dim, dtype, GPU_DEVICES[0])
    assert_grads_close(q, k, v, causal=causal)


@requires_gpu
@pytest.mark.parametrize("seq_q,seq_k", [(1, 1), (1, 300), (300, 1), (129, 257), (0, 5), (5, 0)])
def test_gpu_grad_odd_and_empty_lengths(seq_q, seq_k):
    q, k, v = random_qkv(seq_q + seq_k, 2, seq_q, seq_k, 2, 2, 64, jnp.bfloat16, GPU_DEVICES[0])
    assert_grads_close(q, k, v, causal=True)


@requires_gpu
@pytest.mark.parametrize("head_dim,causal,softcap", [(128, True, None), (128, False, None), (128, False, 30.0),
                                                     (256, True, None)])
def test_gpu_grad_long_sequence(head_dim, causal, softcap):
    """Many key blocks adding into one dQ row (TMA reduce-adds from each warpgroup's stage: one buffer of an 80-row
    item's dQ^T share at head dim 128, the item's own dO and Q panels at 256) and every query block of a long
    mask or none (4096 rows: 51 whole 80-row items and one of 16 at head dim 128; the soft-capped case runs the
    variant without a mask test)."""
    q, k, v = random_qkv(11, 1, 4096, 4096, 4, 4, head_dim, jnp.bfloat16, GPU_DEVICES[0])
    assert_grads_close(q, k, v, causal=causal, **({} if softcap is None else dict(softcap=softcap)))


@requires_gpu
def test_gpu_grad_causal_longest_first_order():
    """A causal grid of 16 key blocks x 48 (batch, kv head) pairs runs its longest key blocks first, over a full
    section of 32 pairs (their Q, dO and dQ accumulator fit in 40 MB of L2) and a partial one of 16
    (common/backward_order.cuh): every key block's dK / dV and every dQ row still come out once."""
    q, k, v = random_qkv(13, 3, 2048, 2048, 16, 16, 64, jnp.bfloat16, GPU_DEVICES[0])
    assert_grads_close(q, k, v, causal=True)


@requires_gpu
def test_gpu_rows_that_see_no_key_have_zero_gradients():
    q, k, v = random_qkv(3, 2, 40, 16, 2, 1, 64, jnp.bfloat16, GPU_DEVICES[0])
    lengths = jnp.array([0, 16], jnp.int32)
    dq, dk, dv = (np.asarray(g.astype(jnp.float32)) for g in jax.grad(
        lambda q, k, v: jax_flash.attention(q, k, v, causal=True, kv_lengths=lengths).astype(jnp.float32).sum(),
        argnums=(0, 1, 2))(q, k, v))
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    assert (dq[0] == 0).all() and (dk[0] == 0).all() and (dv[0] == 0).all()
    assert (dq[1, :24] == 0).all()


@requires_gpu
def test_gpu_hlo_has_the_backward_custom_call():
    q, k, v = random_qkv(6, 2, 384, 512, 4, 2, 64, jnp.bfloat16, GPU_DEVICES[0])
    text = jax.jit(jax.grad(lambda q, k, v: jax_flash.attention(q, k, v, causal=True).astype(jnp.float32).sum(),
                            argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
    assert "jax_flash_attention_bwd" in text
    assert not re.search(r"\[2,4,384,512\]|\[8,384,512\]", text), "a (Sq, Sk) buffer in the gradient's HLO"


@requires_gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_deterministic_grads_repeat_bitwise(head_dim):
    """deterministic=True: dQ shares added in key-block order, the same bits on every run, and still correct."""
    q, k, v = random_qkv(12, 2, 700, 900, 8, 2, head_dim, jnp.bfloat16, GPU_DEVICES[0])
    kwargs = dict(causal=True, kv_lengths=jnp.array([900, 610], jnp.int32))
    grad = jax.jit(jax.grad(lambda q, k, v: jax_flash.attention(q, k, v, deterministic=True, **kwargs)
                            .astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    first = [np.asarray(x) for x in grad(q, k, v)]
    for _ in range(3):
        for a, b in zip(first, grad(q, k, v)):
            np.testing.assert_array_equal(a, np.asarray(b))
    assert_grads_close(q, k, v, deterministic=True, **kwargs)


def test_deterministic_is_accepted_on_cpu():
    q, k, v = random_qkv(13, 1, 20, 30, 2, 1, 32, jnp.float32, CPU)
    assert_grads_close(q, k, v, causal=True, deterministic=True)


@pytest.mark.parametrize("policy", [None, "names"])
def test_checkpoint_policy_saving_the_named_out_and_lse_skips_the_forward_in_the_backward(policy):
    """A scanned stack of rematerialised layers runs each layer's forward again in the backward loop; a policy that
    saves jax_flash.CHECKPOINT_NAMES (the forward's out and lse, the backward's residuals) runs it once, with the
    same gradients."""
    q, k, v = random_qkv(6, 2, 48, 48, 4, 2, 32, jnp.float32, CPU)
    saving = jax.checkpoint_policies.save_only_these_names(*jax_flash.CHECKPOINT_NAMES)

    def loss(q, k, v, policy):
        def layer(x, _):
            step = jax.checkpoint(lambda x: x + jax_flash.attention(x, k, v, causal=True), policy=policy)
            return step(x), None

        x, _ = jax.lax.scan(layer, q, None, length=3)
        return (x ** 2).sum()

    grad = jax.jit(jax.grad(functools.partial(loss, policy=saving if policy else None), argnums=(0, 1, 2)))
    hlo = grad.lower(q, k, v).compile().as_text()
    assert hlo.count('custom_call_target="jax_flash_attention"') == (1 if policy else 2), hlo.count(
        'custom_call_target="jax_flash_attention"')
    assert hlo.count('custom_call_target="jax_flash_attention_bwd"') == 1
    plain = jax.grad(functools.partial(loss, policy=None), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(grad(q, k, v), plain):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
