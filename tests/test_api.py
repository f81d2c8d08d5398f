"""API contract: clear errors for bad inputs and configs, the custom call in the HLO, the registry."""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash import KernelConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent


def qkv(shape_q=(2, 16, 4, 64), shape_k=None, dtype=jnp.float16):
    shape_k = shape_k or shape_q
    return jnp.ones(shape_q, dtype), jnp.ones(shape_k, dtype), jnp.ones(shape_k, dtype)


@pytest.mark.parametrize("shape_q,shape_k,message", [
    ((2, 16, 4), None, "q has shape (2, 16, 4) (rank 3); expected rank 4"),
    ((2, 16, 4, 64), (3, 16, 4, 64), "k has batch 3 but q has batch 2"),
    ((2, 16, 4, 64), (2, 16, 4, 32), "k has head_dim 32 but q has head_dim 64"),
    ((2, 16, 6, 64), (2, 16, 4, 64), "k has 4 heads but q has 6; q heads must be a multiple of k heads"),
])
def test_bad_shapes(shape_q, shape_k, message):
    q, k, v = qkv(shape_q, shape_k)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        jax_flash.attention(q, k, v)


def test_k_v_mismatch():
    q, k, _ = qkv()
    with pytest.raises(ValueError, match=r"k has shape \(2, 16, 4, 64\) but v has shape \(2, 8, 4, 64\)"):
        jax_flash.attention(q, k, jnp.ones((2, 8, 4, 64), jnp.float16))


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float64 if jax.config.jax_enable_x64 else jnp.int8, jnp.bool_])
def test_bad_dtypes(dtype):
    q, k, v = qkv(dtype=dtype)
    with pytest.raises(TypeError, match="supported dtypes are float16 and bfloat16"):
        jax_flash.attention(q, k, v)


def test_mixed_dtypes():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="q, k and v must share one dtype"):
        jax_flash.attention(q, k.astype(jnp.bfloat16), v)


def test_not_an_array():
    _, k, v = qkv()
    with pytest.raises(TypeError, match="q must be a jax or numpy array, got list"):
        jax_flash.attention([[1.0]], k, v)


@pytest.mark.parametrize("kwargs,error,message", [
    ({"block_q": 96}, ValueError, r"KernelConfig.block_q=96 is not allowed; choose one of \(16, 32, 64, 128\)"),
    ({"block_kv": 48}, ValueError, r"KernelConfig.block_kv=48 is not allowed; choose one of \(32, 64, 128\)"),
    ({"num_warps": 2}, ValueError, r"KernelConfig.num_warps=2 is not allowed; choose one of \(1, 4, 8\)"),
    ({"block_q": 16, "num_warps": 8, "block_kv": 64}, ValueError,
     "splits each key block between 8 warps; block_kv=64 gives 8 keys per warp"),
    ({"block_q": 32, "num_warps": 4, "block_kv": 64, "v_mma_load_k_fragments": 4}, ValueError,
     "v_mma_load_k_fragments=4 must be 0 or divide keys per warp/16=2"),
    ({"async_copy": False}, ValueError, "eager_load_blocks=True needs async_copy=True"),
    ({"swizzled": 1}, TypeError, "KernelConfig.swizzled must be a bool, got 1"),
    ({"block_q": 128.0}, TypeError, "KernelConfig.block_q must be an int"),
    ({"block_kv": 64, "v_mma_load_k_fragments": 3}, ValueError, "v_mma_load_k_fragments=3 must be 0 or divide block_kv/16=4"),
    ({"q_mma_load_k_fragments": -1}, ValueError, "q_mma_load_k_fragments=-1 must be >= 0"),
])
def test_config_validation(kwargs, error, message):
    with pytest.raises(error, match=message):
        KernelConfig(**kwargs)


def test_config_fits_reports_reason():
    assert KernelConfig().fits(128) is None
    assert "registers" in KernelConfig(block_q=128, block_kv=64, num_warps=4, q_mma_load_k_fragments=0,
                                       k_mma_load_k_fragments=0, v_mma_load_k_fragments=0).fits(128)
    assert "must be 0 or divide head_dim/16=4" in KernelConfig(k_mma_load_k_fragments=8).fits(64)
    # Warps that split key blocks merge through the K / V buffers: three of the eight warps on 32 rows per row group
    # hold 52224 bytes at head dim 128, more than two 64-key blocks (32768); on four warps, 17408 fit.
    wide = KernelConfig(block_q=32, num_warps=8, block_kv=64)
    assert (wide.key_warps(), wide.rows_per_warp(), wide.warp_keys()) == (4, 16, 16)
    assert "merges 52224 bytes of softmax state through the K / V buffers, which hold 32768" in wide.fits(128)
    assert KernelConfig(block_q=32, num_warps=4, block_kv=64).fits(128) is None


def test_cfg_must_be_kernel_config():
    with pytest.raises(TypeError, match="cfg must be a jax_flash.KernelConfig or None, got dict"):
        jax_flash.attention(*qkv(), cfg={"block_q": 64})


def test_hlo_contains_custom_call():
    text = jax.jit(jax_flash.attention).lower(*qkv()).as_text()
    assert "stablehlo.custom_call @jax_flash_attention" in text


def test_config_travels_as_ffi_attributes():
    cfg = KernelConfig(block_q=64, block_kv=32, num_warps=4)
    traced = jax.jit(jax_flash.attention, static_argnames="cfg").trace(*qkv(), cfg=cfg)
    text = traced.lower(lowering_platforms=("cpu",)).as_text()  # the CPU handler accepts any valid config
    assert "block_q = 64 : i64" in text and "block_kv = 32 : i64" in text and "num_warps = 4 : i64" in text


def test_gpu_grad_lowers_to_the_backward_custom_call():
    if not jax_flash.native.BUILT_WITH_CUDA:
        pytest.skip("CPU-only build: there is no GPU lowering")
    q, k, v = qkv(dtype=jnp.bfloat16)
    traced = jax.jit(jax.grad(lambda q, k, v: jax_flash.attention(q, k, v).astype(jnp.float32).sum())).trace(q, k, v)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "jax_flash_attention_bwd" in text and "jax_flash_attention" in text


# ---- the CUDA lowering, checked without a GPU by lowering for the cuda platform ---------------------------------
def lower_for_cuda(q, k, v, cfg=None):
    traced = jax.jit(jax_flash.attention, static_argnames="cfg").trace(q, k, v, cfg=cfg)
    return traced.lower(lowering_platforms=("cuda",)).as_text()


needs_cuda_build = pytest.mark.skipif(not jax_flash.native.BUILT_WITH_CUDA, reason="module built without CUDA")


@needs_cuda_build
def test_cuda_lowering_uses_default_config():
    text = lower_for_cuda(*qkv((2, 512, 4, 64), dtype=jnp.bfloat16))
    assert "stablehlo.custom_call @jax_flash_attention" in text
    # (cross-lowering assumes sm_90: head dim 64 takes the three-consumer sm90 config, 192-row tiles, except for
    # 65-128 and 193-256 rows without a right bound: as many 128-row tiles)
    assert "block_q = 192 : i64" in text and "consumer_warpgroups = 3 : i64" in text
    for seq in (128, 197):
        text = lower_for_cuda(*qkv((2, seq, 4, 64), dtype=jnp.bfloat16))
        assert "block_q = 128 : i64" in text and "consumer_warpgroups = 2 : i64" in text
    text = lower_for_cuda(*qkv((2, 256, 4, 128), dtype=jnp.bfloat16))
    assert "block_q = 128 : i64" in text and "consumer_warpgroups = 2 : i64" in text
    # decode shapes (at most 64 rows per kv head, the group's heads packed) take the sm80 family's decode tiles
    text = lower_for_cuda(*qkv((2, 1, 32, 64), (2, 4096, 8, 64), dtype=jnp.bfloat16))
    assert "block_q = 16 : i64" in text and "family = 80 : i64" in text and "pack_gqa = 1 : i64" in text
    text = lower_for_cuda(*qkv((2, 1, 32, 128), (2, 4096, 8, 128), dtype=jnp.bfloat16))  # (no 16-row tile at D 128)
    assert "block_q = 32 : i64" in text and "family = 80 : i64" in text and "pack_gqa = 1 : i64" in text
    text = lower_for_cuda(*qkv((2, 8, 32, 128), (2, 4096, 8, 128), dtype=jnp.bfloat16))
    assert "block_q = 32 : i64" in text and "block_kv = 128 : i64" in text and "num_warps = 4 : i64" in text
    assert "pack_gqa = 1 : i64" in text
    text = lower_for_cuda(*qkv((2, 16, 32, 128), (2, 4096, 8, 128), dtype=jnp.bfloat16))
    assert "block_q = 64 : i64" in text and "num_warps = 4 : i64" in text and "pack_gqa = 1 : i64" in text


@needs_cuda_build
def test_cuda_rejects_float32_and_unsupported_head_dim():
    with pytest.raises(TypeError, match="the GPU kernels support float16 and bfloat16"):
        lower_for_cuda(*qkv(dtype=jnp.float32))
    with pytest.raises(ValueError, match=r"head_dim=48 is not supported on GPU; supported head dims: \[64, 128, 256\]"):
        lower_for_cuda(*qkv((1, 8, 2, 48), dtype=jnp.float16))


@needs_cuda_build
def test_cuda_unknown_config_lists_compiled_ones():
    cfg = KernelConfig(block_q=64, block_kv=32, num_warps=4)
    with pytest.raises(ValueError, match="is not compiled into this build for float16 head_dim=64. Compiled configs"):
        lower_for_cuda(*qkv(), cfg=cfg)


@needs_cuda_build
def test_supported_configs_come_from_the_registry():
    kernels = jax_flash.supported_configs()
    expected = {(d, h, c) for d, h, c in jax_flash.config.kernel_set(jax_flash.native.KERNEL_SET)}
    assert {(k.dtype, k.head_dim, k.config) for k in kernels} == expected
    for k in kernels:  # Python's mirror of the C++ traits (shared memory, registers) against what was compiled
        assert k.family == k.config.family
        assert k.smem_bytes == k.config.smem_bytes(k.head_dim)
        assert k.consumer_registers == (k.config.consumer_registers() if k.family == "sm90" else 0)
    assert {k.family for k in kernels} == {"sm80", "sm90"}  # both families ship


def test_sm90_config_validation():
    cfg = KernelConfig.sm90(block_kv=64, stages=3)
    assert (cfg.family, cfg.block_q, cfg.num_warps, cfg.block_kv, cfg.stages) == ("sm90", 128, 12, 64, 3)
    assert cfg.to_attrs()["family"] == 90 and KernelConfig().to_attrs()["family"] == 80
    assert cfg.fits(128) is None
    assert "head_dim in (64, 128, 256)" in cfg.fits(96)
    # head dim 256: O is staged in the last key block's K / V (no room for its own), 80-key blocks fit, 128-key not
    assert KernelConfig.sm90(block_kv=80).sm90_o_in_kv(256) and not KernelConfig.sm90().sm90_o_in_kv(128)
    assert KernelConfig.sm90(block_kv=80).fits(256) is None
    assert KernelConfig.sm90(block_kv=80).smem_bytes(256) == 64 * 1024 + 4 * 80 * 512 + 8 * 14 + 2 * 44 + 16 + 1024
    assert "bytes of shared memory" in KernelConfig.sm90(block_kv=128).fits(256)
    assert "needs compute capability 9.0" in cfg.fits(128, arch=80)
    with pytest.raises(ValueError, match="family='gfx90' is not allowed"):
        KernelConfig(family="gfx90")
    with pytest.raises(ValueError, match="num_warps=4 must be 4 \\* \\(consumer_warpgroups \\+ 1\\) = 12"):
        KernelConfig(family="sm90", block_q=128, block_kv=128)
    with pytest.raises(ValueError, match="block_kv=32 is not allowed for family='sm90'"):
        KernelConfig.sm90(block_kv=32)
    with pytest.raises(ValueError, match="stages=5 is not allowed"):
        KernelConfig.sm90(stages=5)
    with pytest.raises(ValueError, match="swizzled=False applies to family='sm80' only"):
        KernelConfig(family="sm90", block_q=128, block_kv=128, num_warps=12, swizzled=False)
    with pytest.raises(ValueError, match="stages=3 applies to family='sm90' only"):
        KernelConfig(stages=3)
    with pytest.raises(ValueError, match="pingpong=False applies to family='sm90' only"):
        KernelConfig(pingpong=False)
    assert KernelConfig.sm90(pingpong=False).short_name() == "q128_kv128_st2_wg2_pp0"
    # overlap (intra-warpgroup overlap, sm90 only): named in the short name only when off, passed to the kernel
    assert KernelConfig.sm90(overlap=False).short_name() == "q128_kv128_st2_wg2_pp1_ov0"
    assert KernelConfig.sm90(overlap=False).to_attrs()["overlap"] == 0 and KernelConfig.sm90().to_attrs()["overlap"] == 1
    with pytest.raises(ValueError, match="overlap=False applies to family='sm90' only"):
        KernelConfig(overlap=False)
    with pytest.raises(TypeError, match="KernelConfig.overlap must be a bool"):
        KernelConfig.sm90(overlap=1)
    with pytest.raises(TypeError, match="KernelConfig.stages must be an int"):
        KernelConfig.sm90(stages=2.0)


def test_sm90_wide_key_blocks_validation():
    assert KernelConfig.sm90(block_kv=192).fits(64) is None and KernelConfig.sm90(block_kv=160).fits(128) is None
    # 128 x 192 at head dim 128: the K/V ring (2 x 2 x 48 KB) with Q and O (64 KB) exceeds 227 KB of shared memory,
    # so O would be staged in the K / V stages; but S (96) + P (48) + O (64) + state is over a consumer's 232
    # registers
    wide = KernelConfig.sm90(block_kv=192)
    # (+ 32 bytes: the split tail's state, head dim 128 with two pingpong consumers)
    assert wide.sm90_o_in_kv(128) and wide.smem_bytes(128) == 32768 + 4 * 49152 + 8 * 14 + 2 * 44 + 16 + 32 + 1024
    assert "needs about 248 registers per consumer thread at head_dim=128 (limit 232)" in wide.fits(128)
    assert KernelConfig.sm90(block_kv=160).smem_bytes(128) == 230608 + 8 + 32
    # Q is double-buffered where 227 KB allow: 128 x 128 at head dim 128 fits (2 Q + O + 4 x 32 KB + barriers),
    # 128 x 160 keeps one Q buffer
    assert KernelConfig.sm90().sm90_q_buffers(128) == 2 and KernelConfig.sm90(block_kv=160).sm90_q_buffers(128) == 1
    assert KernelConfig.sm90().smem_bytes(128) == 3 * 32768 + 4 * 32768 + 8 * 16 + 2 * 44 + 16 + 32 + 1024
    # head dim 64 with 192-key blocks: P of each consumer (3 panels of 8 KB) for the soft-capped kernels
    assert KernelConfig.sm90(block_kv=192).smem_bytes(64) == 3 * 16384 + 4 * 24576 + 2 * 24576 + 8 * 16 + 2 * 44 + 16 + 1024
    assert KernelConfig.sm90().consumer_registers() == 232
    with pytest.raises(ValueError, match="block_kv=256 is not allowed for family='sm90'"):
        KernelConfig.sm90(block_kv=256)


def test_sm90_three_consumers_validation():
    cfg = KernelConfig.sm90(block_kv=128, consumer_warpgroups=3)
    assert (cfg.block_q, cfg.num_warps, cfg.consumer_registers()) == (192, 16, 160)  # 512 threads: 32 + 3 x 160
    assert cfg.fits(64) is None and KernelConfig.sm90(block_kv=64, consumer_warpgroups=3).fits(128) is None
    # 2 Q + O (3 x 24 KB) + K/V ring (4 x 16 KB) + P for the soft-capped kernels (3 x 16 KB) + barriers, slots, slack
    assert cfg.smem_bytes(64) == 3 * 24576 + 4 * 16384 + 3 * 16384 + 8 * 16 + 2 * 44 + 16 + 1024
    # S (96) + P (48) + O (32) + state is over the 160 registers three consumers get (ptxas spilled ~600 bytes)
    assert "needs about 208 registers per consumer thread at head_dim=64 (limit 160)" in \
        KernelConfig.sm90(block_kv=192, consumer_warpgroups=3).fits(64)
    assert "needs about 192 registers per consumer thread at head_dim=128 (limit 160)" in cfg.fits(128)
    with pytest.raises(ValueError, match="consumer_warpgroups=4 is not allowed for family='sm90'"):
        KernelConfig.sm90(consumer_warpgroups=4)
    with pytest.raises(ValueError, match="block_q=128 must be 64 \\* consumer_warpgroups = 192"):
        KernelConfig(family="sm90", block_q=128, block_kv=128, num_warps=16, consumer_warpgroups=3)


def test_sm90_family_is_refused_below_sm90_at_lowering(monkeypatch):
    from jax_flash import selection

    monkeypatch.setattr(selection, "cuda_arch", lambda: 80)
    if not jax_flash.native.BUILT_WITH_CUDA:
        pytest.skip("CPU-only build: GPU lowering raises the no-CUDA error first")
    with pytest.raises(ValueError, match="is a family='sm90' .* config; this GPU is sm_80"):
        selection.resolve_gpu_config(KernelConfig.sm90(), jnp.float16, 128)
    assert selection.resolve_gpu_config(None, jnp.float16, 128).family == "sm80"
    monkeypatch.setattr(selection, "cuda_arch", lambda: 90)  # on Hopper cfg=None picks the sm90 family
    sm90 = jax_flash.config.SM90_CONFIGS

    def resolve(dtype, head_dim, right_bounded=False, seq_k=0):
        cfg = selection.resolve_gpu_config(None, dtype, head_dim, None, right_bounded, selection.CallShape(seq_k=seq_k))
        assert cfg.pack_gqa is False  # decided, never None
        return cfg.kernel()

    assert resolve(jnp.float16, 128) == sm90[128][0]
    assert resolve(jnp.float16, 128, right_bounded=True) == sm90[128][1]  # no pingpong
    # head dim 64: three consumer warpgroups, causal too
    assert resolve(jnp.float16, 64, seq_k=512) == sm90[64][2]
    assert resolve(jnp.float16, 64, seq_k=16384) == sm90[64][2]
    assert resolve(jnp.float16, 64, right_bounded=True, seq_k=512) == sm90[64][2]
    assert resolve(jnp.float16, 64, right_bounded=True, seq_k=2048) == sm90[64][2]
    assert resolve(jnp.bfloat16, 256) == sm90[256][0]
    assert resolve(jnp.bfloat16, 256, right_bounded=True) == sm90[256][1]


def test_generated_instantiations_are_fresh():
    result = subprocess.run([sys.executable, str(ROOT / "csrc" / "generate.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_wgmma_wrappers_are_fresh():
    result = subprocess.run([sys.executable, str(ROOT / "csrc" / "sm90" / "generate_wgmma.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_config_is_hashable_and_frozen():
    cfg = KernelConfig()
    assert hash(cfg) == hash(KernelConfig())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_q = 64
