"""jax_flash.autotune: times candidates, writes the JSON cache at $JAX_FLASH_AUTOTUNE_CACHE, and cfg=None then uses
the winner (checked through the FFI attributes of the lowered custom call). Runs on CPU (a config's block sizes are
the CPU tiles) and with the GPU's compiled configs when a GPU is visible."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash import autotune_cache
from jax_flash.config import KernelConfig


@pytest.fixture
def cache_file(tmp_path, monkeypatch):
    path = tmp_path / "tune" / "autotune.json"
    monkeypatch.setenv("JAX_FLASH_AUTOTUNE_CACHE", str(path))
    autotune_cache.reload_cache()
    yield path
    autotune_cache.reload_cache()


def test_autotune_writes_cache_and_cfg_none_uses_it(cache_file):
    candidates = [KernelConfig(block_q=64, block_kv=32, num_warps=4), KernelConfig(block_q=128, block_kv=128)]
    q_shape, kv_shape = (1, 200, 2, 64), (1, 300, 1, 64)
    cpu = jax.devices("cpu")[0]
    best = jax_flash.autotune(q_shape, kv_shape, jnp.float32, causal=True, configs=candidates, device=cpu, iters=1,
                              reps=1, progress=False)
    assert best in candidates
    entries = json.loads(cache_file.read_text())
    (key, entry), = entries.items()
    assert "|q256|k512|float32|d64|causal=True" in key and set(entry["timings_ms"]) == {c.short_name()
                                                                                       for c in candidates}
    q, k, v = (jnp.ones(s, jnp.float32) for s in (q_shape, kv_shape, kv_shape))

    def lowered_for_cpu(**kwargs):
        traced = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, **kwargs)).trace(q, k, v)
        return traced.lower(lowering_platforms=("cpu",)).as_text()

    text = lowered_for_cpu(causal=True)
    assert f"block_q = {best.block_q} : i64" in text and f"block_kv = {best.block_kv} : i64" in text
    # a different flag set is a different entry: the CPU path's own tiles apply
    text = lowered_for_cpu()
    assert "block_q = 256 : i64" in text and "block_kv = 512 : i64" in text


def test_autotune_on_cpu_needs_configs(cache_file):
    with pytest.raises(ValueError, match="autotune on cpu: pass configs= to compare"):
        jax_flash.autotune((1, 64, 1, 64), (1, 64, 1, 64), jnp.float32, device=jax.devices("cpu")[0])
    assert not cache_file.exists()


def test_unreadable_cache_is_ignored(cache_file, capsys):
    cache_file.parent.mkdir(parents=True)
    cache_file.write_text("{not json")
    assert autotune_cache.lookup("anything") is None
    assert "ignoring unreadable autotune cache" in capsys.readouterr().err


@pytest.mark.skipif(not jax_flash.native.BUILT_WITH_CUDA or jax.default_backend() != "gpu",
                    reason="no CUDA device visible to jax")
def test_autotune_on_gpu_picks_a_compiled_config(cache_file):
    q_shape = kv_shape = (2, 1024, 8, 128)
    best = jax_flash.autotune(q_shape, kv_shape, jnp.bfloat16, iters=2, reps=2, progress=True)
    compiled = [k.config for k in jax_flash.supported_configs() if k.dtype == "bfloat16" and k.head_dim == 128]
    assert best in compiled
    entry, = json.loads(cache_file.read_text()).values()
    assert len(entry["timings_ms"]) == len(compiled)
    q = jnp.ones(q_shape, jnp.bfloat16)
    text = jax.jit(jax_flash.attention).lower(q, q, q).as_text()
    assert f"block_q = {best.block_q} : i64" in text and f"num_warps = {best.num_warps} : i64" in text
    assert f"q_mma_load_k_fragments = {best.q_mma_load_k_fragments} : i64" in text


def test_progress_names_configs_readably_and_never_rewrites_a_line(cache_file, capsys):
    """Piped or logged stderr (as under pytest) gets one line per config, never a bar redrawn with carriage returns
    (a terminal gets tqdm's bar); each config is named by describe()."""
    candidates = [KernelConfig(block_q=64, block_kv=32, num_warps=4), KernelConfig(block_q=128, block_kv=128)]
    jax_flash.autotune((1, 64, 1, 32), (1, 64, 1, 32), jnp.float32, configs=candidates,
                       device=jax.devices("cpu")[0], iters=1, reps=1)
    err = capsys.readouterr().err
    assert "\r" not in err and len(err.strip().splitlines()) == 2
    assert err.strip().splitlines()[1].startswith(f"autotune 2/2 {candidates[1].describe()}: ")


def test_describe_is_readable():
    assert KernelConfig(block_q=64, block_kv=32, num_warps=4).describe().startswith("sm80 64x32 tiles, 4 warps, ")
    assert KernelConfig.sm90(pingpong=False).describe() == "sm90 128x128 tiles, 2 stages, 2 consumer warpgroups"
