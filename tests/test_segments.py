"""Segment ids (packed sequences): q_segment_ids / kv_segment_ids against attention_reference's segment mask, alone and
with every other mask, their gradients, vmap, sharding, and clear errors. CPU always; on a GPU the same checks run
(cfg=None: the sm90 family's forward on Hopper, else the sm80 family's; the sm80 family's backward), and every
shipped sm90 config on Hopper."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jax_flash
from conftest import assert_flash_close, attention_calls, random_qkv
from test_backward import assert_grads_close
from test_decode import SM90_CASES, SM90_IDS, requires_hopper


def packed_ids(seed, batch, seq, mean_length):
    """int32 (batch, seq): documents of random lengths (mean about mean_length), numbered from 0 in each row."""
    starts = jax.random.bernoulli(jax.random.PRNGKey(seed), 1.0 / mean_length, (batch, seq))
    return jnp.cumsum(starts.astype(jnp.int32), axis=1)


def _both(ids):
    return dict(q_segment_ids=ids, kv_segment_ids=ids)


def _dtype(device):
    return jnp.float32 if device.platform == "cpu" else jnp.float16  # (GPUs take 16-bit inputs)


LAYOUTS = {
    "random": lambda b, s: packed_ids(3, b, s, 40),
    "one_segment": lambda b, s: jnp.zeros((b, s), jnp.int32),
    "every_token_own": lambda b, s: jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)),
    "unsorted": lambda b, s: jax.random.randint(jax.random.PRNGKey(5), (b, s), 0, 3, jnp.int32),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_segment_layouts(device, layout, causal):
    q, k, v = random_qkv(7, 2, 200, 200, 4, 2, 64, jnp.bfloat16, device)
    ids = LAYOUTS[layout](2, 200)
    out, lse = jax.jit(lambda q, k, v, ids: jax_flash.attention(q, k, v, causal=causal, return_lse=True, **_both(ids)))(
        q, k, v, ids)
    assert_flash_close(out, q, k, v, causal=causal, **_both(ids))
    _, ref_lse = jax_flash.attention_reference(q, k, v, causal=causal, return_lse=True, **_both(ids))
    ref_lse = np.asarray(ref_lse)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], ref_lse[finite], atol=2e-2, rtol=0)
    # One segment per row is the call without segments, bit for bit on CPU (on a GPU the call with segments may run
    # another kernel variant: equal within the tolerance above).
    if layout == "one_segment" and device.platform == "cpu":
        plain = jax_flash.attention(q, k, v, causal=causal)
        np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), np.asarray(plain.astype(jnp.float32)))


FEATURES = {
    "window_softcap": dict(causal=True, window=(30, -1), softcap=20.0),
    "lengths": dict(causal=True, q_lengths=np.array([150, 61], np.int32), kv_lengths=np.array([200, 99], np.int32)),
    "gqa_scale": dict(softmax_scale=0.2),
}


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("heads_q,heads_k", [(4, 4), (8, 2), (4, 1)])
def test_segments_with_every_mask(device, feature, heads_q, heads_k):
    seq_q, seq_k = (150, 200) if feature == "lengths" else (200, 200)
    q, k, v = random_qkv(heads_q + heads_k, 2, seq_q, seq_k, heads_q, heads_k, 64, jnp.float16, device)
    kwargs = {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in FEATURES[feature].items()}
    kwargs.update(q_segment_ids=packed_ids(1, 2, seq_q, 30), kv_segment_ids=packed_ids(1, 2, seq_k, 30))
    assert_flash_close(jax_flash.attention(q, k, v, **kwargs), q, k, v, **kwargs)


def test_query_without_a_key_of_its_segment(device):
    """Queries whose segment has no key (cross-attention ids that never meet, and causal rows whose segment starts
    after them) give zeros and lse -inf, never NaN."""
    q, k, v = random_qkv(2, 1, 6, 8, 2, 2, 64, _dtype(device), device)
    q_ids = jnp.array([[0, 0, 5, 5, 1, 1]], jnp.int32)
    kv_ids = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1]], jnp.int32)
    out, lse = jax_flash.attention(q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids, return_lse=True)
    out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
    assert (out[0, 2:4] == 0).all() and np.isneginf(lse[0, :, 2:4]).all()
    assert np.isfinite(out).all() and np.isfinite(lse[0, :, [0, 1, 4, 5]]).all()
    assert_flash_close(out, q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids)


@pytest.mark.parametrize("feature", ["plain", "causal_lse", "lengths_gqa", "softcap_window_d128"])
def test_segment_gradients(device, feature):
    heads_k = 1 if feature == "lengths_gqa" else 2
    head_dim = 128 if feature.endswith("d128") else 64
    q, k, v = random_qkv(9, 2, 120, 120, 4, heads_k, head_dim, _dtype(device), device)
    ids = packed_ids(4, 2, 120, 25)
    kwargs = _both(ids)
    if feature == "causal_lse":
        kwargs.update(causal=True, lse=True)
    if feature == "lengths_gqa":
        kwargs.update(causal=True, kv_lengths=jnp.array([120, 70], jnp.int32))
    if feature == "softcap_window_d128":
        kwargs.update(causal=True, softcap=20.0, window=(40, -1))
    assert_grads_close(q, k, v, **kwargs)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("layout", ["sorted_causal", "shuffled_documents"])
def test_segment_gradients_skip_blocks(device, head_dim, layout):
    """Rows long enough that the GPU backward skips the tiles between documents (common/backward_blocks.cuh) and runs
    no per-score test inside one: gradients against the reference's, for documents in order (causal) and for
    documents whose ids are out of order (each tile's id range then meets other documents' too)."""
    seq = 700
    q, k, v = random_qkv(head_dim, 2, seq, seq, 4, 2, head_dim, _dtype(device), device)
    if layout == "sorted_causal":
        kwargs = dict(causal=True, **_both(packed_ids(6, 2, seq, 150)))
    else:  # documents of 100 tokens numbered 3, 0, 5, 1, 6, 2, 4
        kwargs = _both(jnp.broadcast_to(jnp.array([3, 0, 5, 1, 6, 2, 4], jnp.int32).repeat(100), (2, seq)))
    assert_grads_close(q, k, v, **kwargs)


def test_new_ids_do_not_recompile_and_vmap(device):
    q, k, v = random_qkv(4, 3, 64, 64, 2, 2, 64, _dtype(device), device)
    traces = []

    @jax.jit
    def attend(q, k, v, ids):
        traces.append(1)
        return jax_flash.attention(q, k, v, causal=True, **_both(ids))

    for seed in range(3):
        ids = packed_ids(seed, 3, 64, 10)
        assert_flash_close(attend(q, k, v, ids), q, k, v, causal=True, **_both(ids))
    assert len(traces) == 1
    ids = packed_ids(8, 3, 64, 10)
    mapped = jax.vmap(lambda q, k, v, ids: jax_flash.attention(q[None], k[None], v[None], **_both(ids[None]))[0])(
        q, k, v, ids)
    assert_flash_close(mapped, q, k, v, **_both(ids))


def test_sharded_over_batch_and_heads_and_sequence():
    """Batch / head sharding runs shard-local (no all-gather in the HLO); a sequence-sharded call with segment ids runs
    ring attention (the keys' ids travel with their K/V: only collective-permutes, no warning); all equal one device
    (tests/test_ring.py has the ring's feature grid)."""
    devices = jax.devices("cpu")[:4]
    mesh = Mesh(np.array(devices).reshape(2, 2), ("b", "h"))
    with jax.default_device(devices[0]):  # (float32: the CPU path, also where a GPU is the default device)
        q, k, v = random_qkv(6, 4, 96, 96, 4, 2, 64, jnp.float32)
        ids = packed_ids(6, 4, 96, 20)
        expected = jax_flash.attention(q, k, v, causal=True, **_both(ids))
    spec = NamedSharding(mesh, PartitionSpec("b", None, "h", None))
    ids_spec = NamedSharding(mesh, PartitionSpec("b", None))
    args = [jax.device_put(x, spec) for x in (q, k, v)] + [jax.device_put(ids, ids_spec)]
    attend = jax.jit(lambda q, k, v, ids: jax_flash.attention(q, k, v, causal=True, **_both(ids)))
    assert "all-gather" not in attend.lower(*args).compile().as_text()
    np.testing.assert_allclose(np.asarray(attend(*args)), np.asarray(expected), atol=1e-6)

    seq_mesh = Mesh(np.array(devices), ("s",))
    seq_spec = NamedSharding(seq_mesh, PartitionSpec(None, "s", None, None))
    args = [jax.device_put(x, seq_spec) for x in (q, k, v)] + [jax.device_put(ids, NamedSharding(seq_mesh,
                                                                                                PartitionSpec(None, "s")))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = attend(*args)
    hlo = attend.lower(*args).compile().as_text()
    assert "all-gather" not in hlo and "collective-permute" in hlo
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=1e-5)


def test_segment_id_errors():
    q, k, v = random_qkv(1, 2, 16, 24, 2, 2, 64, jnp.float32)
    ids_q, ids_k = jnp.zeros((2, 16), jnp.int32), jnp.zeros((2, 24), jnp.int32)
    with pytest.raises(ValueError, match="q_segment_ids was given without kv_segment_ids"):
        jax_flash.attention(q, k, v, q_segment_ids=ids_q)
    with pytest.raises(ValueError, match="kv_segment_ids was given without q_segment_ids"):
        jax_flash.attention(q, k, v, kv_segment_ids=ids_k)
    bad = {
        "float dtype": (ids_q.astype(jnp.float32), ids_k, r"q_segment_ids must be an int32 array of shape \(batch, "
                        r"seq_q\) = \(2, 16\); got float32\(2, 16\)"),
        "rank": (ids_q[0], ids_k, r"q_segment_ids .* got int32\(16,\)"),
        "length": (ids_q, ids_q, r"kv_segment_ids must be an int32 array of shape \(batch, seq_k\) = \(2, 24\); "
                   r"got int32\(2, 16\)"),
        "batch": (ids_q[:1], ids_k, r"q_segment_ids .* \(2, 16\); got int32\(1, 16\)"),
    }
    for name, (qs, ks, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            jax_flash.attention(q, k, v, q_segment_ids=qs, kv_segment_ids=ks)


@pytest.mark.skipif(not jax_flash.native.BUILT_WITH_CUDA, reason="module built without CUDA")
def test_cuda_lowering_with_and_without_segment_ids():
    """Lowered for a GPU: the forward and the backward are our custom calls with the segment ids among their operands,
    the forward of 64 rows on the sm80 family's decode tile; deterministic=True's backward is XLA's, after a warning
    (the deterministic kernels do not take segment ids)."""
    q, k, v = random_qkv(2, 1, 64, 64, 2, 2, 64, jnp.float16)
    ids = packed_ids(2, 1, 64, 16)

    def lowered(fn, *args):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    def loss(deterministic):
        return lambda q, k, v, ids: jax_flash.attention(q, k, v, deterministic=deterministic,
                                                        **_both(ids)).astype(jnp.float32).sum()

    text = lowered(jax.grad(loss(False)), q, k, v, ids)
    forward, backward = attention_calls(text)
    assert "family = 80" in forward
    for call in (forward, backward):
        assert "tensor<1x64xi32>, tensor<1x64xi32>" in call
    with pytest.warns(UserWarning, match="deterministic GPU backward does not take segment ids"):
        import jax_flash._sharding as sharding
        sharding._warned.discard("xla on gpu")
        text = lowered(jax.grad(loss(True)), q, k, v, ids)
    assert "@jax_flash_attention(" in text and "jax_flash_attention_bwd" not in text


def test_segments_with_a_paged_cache(device):
    """Packed prompts against a paged cache: kv_segment_ids index the logical keys."""
    from test_decode import paged_cache

    q, k, v = random_qkv(11, 2, 8, 208, 4, 2, 64, jnp.bfloat16, device)
    k_pages, v_pages, table = paged_cache(k, v, 16, seed=3)
    kv_ids = packed_ids(5, 2, 208, 50)
    q_ids = kv_ids[:, -8:]  # the last 8 tokens of each row are its queries
    kwargs = dict(causal=True, q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    out = jax.jit(lambda q, kp, vp, t: jax_flash.attention(q, kp, vp, page_table=t, **kwargs))(
        q, k_pages, v_pages, table)
    assert_flash_close(out, q, k, v, **kwargs)


@requires_hopper
@pytest.mark.parametrize("head_dim,cfg", SM90_CASES, ids=SM90_IDS)
@pytest.mark.parametrize("layout", ["random", "unsorted"])
def test_sm90_segments(head_dim, cfg, layout):
    """Every shipped sm90 config with segment ids (documents of about 150 tokens, or unsorted ids), causal with a
    window, softcap and both lengths, split and unsplit, contiguous and paged: against the reference (out and lse);
    packing the GQA heads with segment ids is a clear error there."""
    from test_decode import paged_cache

    gpu = jax.devices("gpu")[0]
    q, k, v = random_qkv(head_dim, 2, 700, 700, 4, 2, head_dim, jnp.bfloat16, gpu)
    ids = packed_ids(head_dim, 2, 700, 150) if layout == "random" else LAYOUTS["unsorted"](2, 700)
    kwargs = dict(causal=True, window=(400, -1), softcap=20.0, q_lengths=jnp.array([700, 500], jnp.int32),
                  kv_lengths=jnp.array([700, 650], jnp.int32), **_both(ids))
    _, ref_lse = jax_flash.attention_reference(q, k, v, return_lse=True, **kwargs)
    ref_lse = np.asarray(ref_lse)
    k_pages, v_pages, table = paged_cache(k, v, 64, seed=head_dim)
    logical = table.shape[1] * 64  # the paged call's key length: the ids padded to whole pages
    paged_kwargs = dict(kwargs, page_table=table, kv_segment_ids=jnp.pad(ids, ((0, 0), (0, logical - 700)),
                                                                        constant_values=-1))
    for splits, paged in ((1, False), (3, False), (0, True)):
        run = dataclasses.replace(cfg, num_splits=splits)
        out, lse = jax_flash.attention(q, k_pages if paged else k, v_pages if paged else v, run, return_lse=True,
                                       **(paged_kwargs if paged else kwargs))
        assert_flash_close(out, q, k, v, **kwargs)
        lse = np.asarray(lse)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
        finite = np.isfinite(ref_lse)
        np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=2e-2, rtol=0)
    plain = jax_flash.attention(q, k, v, cfg, **_both(ids))
    assert_flash_close(plain, q, k, v, **_both(ids))
    with pytest.raises(ValueError, match="pack_gqa=True with segment ids runs on family='sm80'"):
        jax_flash.attention(q, k, v, dataclasses.replace(cfg, pack_gqa=True), **_both(ids))


@requires_hopper
@pytest.mark.parametrize("head_dim,cfg", SM90_CASES, ids=SM90_IDS)
def test_sm90_document_tiles(head_dim, cfg):
    """Every shipped sm90 config with rows of sorted ids, equal for queries and keys, which run document tiles
    (csrc/sm90/segment_tiles.cuh: tiles and key blocks that start at a document's first token, rows stored up to
    the document's end), beside rows that run query-block tiles in the same call (unsorted ids; documents of 4
    tokens, whose tiles would not fit the slots): causal, non-causal, a window and softcap, against the reference
    (out and lse)."""
    gpu = jax.devices("gpu")[0]
    seq = 900  # (not a multiple of any block)
    q, k, v = random_qkv(head_dim + 1, 3, seq, seq, 4, 2, head_dim, jnp.bfloat16, gpu)
    ids = jnp.concatenate([packed_ids(head_dim, 1, seq, 170), LAYOUTS["unsorted"](1, seq),
                           (jnp.arange(seq, dtype=jnp.int32) // 4)[None]])
    for kwargs in (dict(causal=True), dict(causal=False), dict(causal=True, window=(300, -1), softcap=20.0)):
        kwargs = dict(kwargs, **_both(ids))
        out, lse = jax_flash.attention(q, k, v, cfg, return_lse=True, **kwargs)
        assert_flash_close(out, q, k, v, **kwargs)
        _, ref_lse = jax_flash.attention_reference(q, k, v, return_lse=True, **kwargs)
        ref_lse = np.asarray(ref_lse)
        np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(ref_lse))
        finite = np.isfinite(ref_lse)
        np.testing.assert_allclose(np.asarray(lse)[finite], ref_lse[finite], atol=2e-2, rtol=0)


@requires_hopper
def test_sm90_document_tiles_of_long_rows():
    """cfg=None on Hopper over rows of 9300 tokens, ten pre-pass chunks of 1024 positions whose documents cross
    chunk boundaries (csrc/sm90/segment_tiles.cuh): short and long documents, a document over the whole row, and a
    row of one-token documents but the last 300 tokens (more tiles than slots: query-block tiles); causal, out and
    lse against the reference."""
    gpu = jax.devices("gpu")[0]
    seq = 9300
    q, k, v = random_qkv(7, 4, seq, seq, 2, 1, 128, jnp.bfloat16, gpu)
    ones = jnp.minimum(jnp.arange(seq, dtype=jnp.int32), seq - 300)[None]
    ids = jnp.concatenate([packed_ids(7, 1, seq, 90), packed_ids(8, 1, seq, 2500), jnp.zeros((1, seq), jnp.int32),
                           ones]) + 5
    out, lse = jax_flash.attention(q, k, v, causal=True, return_lse=True, **_both(ids))
    assert_flash_close(out, q, k, v, causal=True, **_both(ids))
    _, ref_lse = jax_flash.attention_reference(q, k, v, causal=True, return_lse=True, **_both(ids))
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=2e-2, rtol=0)


def test_segment_routing():
    """cfg=None on a GPU (jax_flash/selection.py): segment ids take the default path on sm_90 (the sm90 family; head
    dim 128 on the pingpong tile, causal too) and the sm80 family's tuned tile below it."""
    from jax_flash import config, selection

    compiled = list(config.TUNED_CONFIGS[128]) + list(config.DECODE_CONFIGS[128]) + list(config.SM90_CONFIGS[128])
    shape = selection.CallShape(seq_q=1024, seq_k=1024, segments=True)
    assert selection.decode_gpu_config(128, shape, compiled, 90) is None
    assert selection.decode_gpu_config(128, shape, compiled, 80).family == "sm80"
    pingpong, plain = config.SM90_CONFIGS[128][:2]
    assert pingpong.pingpong and not plain.pingpong
    for right_bounded in (False, True):
        assert selection.default_gpu_config(90, "bfloat16", 128, compiled, right_bounded, 1024, segments=True) == pingpong
    assert selection.default_gpu_config(90, "bfloat16", 128, compiled, True, 1024) == plain
    compiled64 = list(config.SM90_CONFIGS[64])
    assert (selection.default_gpu_config(90, "bfloat16", 64, compiled64, True, 1024, segments=True)
            == selection.SM90_BY_SHAPE[(64, True)][0][1])


@requires_hopper
def test_sm90_takes_segment_ids():
    """cfg=None on Hopper lowers a prefill-sized call with segment ids to the sm90 family."""
    q, k, v = random_qkv(4, 1, 1024, 1024, 4, 4, 128, jnp.bfloat16, jax.devices("gpu")[0])
    ids = packed_ids(4, 1, 1024, 200)
    text = jax.jit(lambda q, k, v, ids: jax_flash.attention(q, k, v, causal=True, **_both(ids))).lower(
        q, k, v, ids).as_text()
    assert "family = 90" in text, text[-2000:]
