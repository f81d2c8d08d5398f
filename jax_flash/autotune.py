"""Autotuner: times the candidate configs on the current device and remembers the winner in a JSON cache.

The cache file is $JAX_FLASH_AUTOTUNE_CACHE, or ~/.cache/jax_flash/autotune.json. Entries are keyed by device name,
shape bucket (sequence lengths rounded up to powers of two), dtype, head dim and flags. `cfg=None` consults the
cache before the built-in table (jax_flash/defaults.py). On a GPU the candidates are the compiled configs for the
dtype and head dim; on CPU a few tile sizes of the CPU handler.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys

import jax
import jax.numpy as jnp

from jax_flash import _ffi
from jax_flash.config import KernelConfig
from jax_flash.timing import time_loop_ms

CPU_CANDIDATES = (KernelConfig(block_q=64, block_kv=64, num_warps=4), KernelConfig(block_q=128, block_kv=64),
                  KernelConfig(block_q=64, block_kv=128, num_warps=4), KernelConfig(block_q=128, block_kv=128,
                                                                                     num_warps=8))
_memory: dict[str, dict] | None = None


def cache_path() -> pathlib.Path:
    env = os.environ.get("JAX_FLASH_AUTOTUNE_CACHE")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "jax_flash" / "autotune.json"


def _bucket(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cache_key(device_kind: str, seq_q: int, seq_k: int, dtype, head_dim: int, *, causal: bool = False,
              window=None, softcap=None) -> str:
    flags = f"causal={bool(causal)},window={tuple(window) if window else None},softcap={bool(softcap)}"
    return (f"{device_kind}|q{_bucket(seq_q)}|k{_bucket(seq_k)}|{jnp.dtype(dtype).name}|d{head_dim}|{flags}")


def _entries() -> dict[str, dict]:
    global _memory
    if _memory is None:
        path = cache_path()
        try:
            _memory = json.loads(path.read_text()) if path.exists() else {}
        except (OSError, ValueError) as error:
            print(f"jax_flash: ignoring unreadable autotune cache {path}: {error}", file=sys.stderr)
            _memory = {}
    return _memory


def reload_cache() -> None:
    """Forget the in-memory copy (the next lookup re-reads the file, e.g. after changing the environment)."""
    global _memory
    _memory = None


def lookup(key: str) -> KernelConfig | None:
    entry = _entries().get(key)
    if entry is None:
        return None
    try:
        return KernelConfig(**entry["config"])
    except (TypeError, ValueError, KeyError):
        return None  # written by another version: ignore


def autotune(q_shape, kv_shape, dtype, causal: bool = False, *, window=None, softcap=None, configs=None,
             device=None, iters: int = 5, reps: int = 3, progress: bool = True) -> KernelConfig:
    """Times every candidate config for these shapes on `device`, stores and returns the fastest.

    q_shape (B, Sq, Hq, D), kv_shape (B, Sk, Hk, D). `configs` overrides the candidates (default: the compiled
    configs for dtype and head dim on a GPU, CPU_CANDIDATES on CPU). `device` defaults to jax.devices()[0].
    """
    device = device or jax.devices()[0]
    head_dim = q_shape[3]
    dtype_name = jnp.dtype(dtype).name
    if configs is None:
        if device.platform == "gpu":
            arch = _ffi.device_arch(device)  # the sm90 family runs on sm_90 only
            configs = [c for c in _ffi.compiled_configs_for(dtype_name, head_dim) if c.fits(head_dim, arch) is None]
            if not configs:
                raise ValueError(f"no compiled GPU kernel for {dtype_name} head_dim={head_dim}; compiled head dims: "
                                 f"{_ffi.gpu_head_dims(dtype_name)}")
        else:
            configs = CPU_CANDIDATES
    from jax_flash.attention import attention  # the public function (imported late: it imports this module)

    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.device_put(jax.random.normal(key, shape, jnp.float32).astype(dtype), device)
               for key, shape in ((kq, q_shape), (kk, kv_shape), (kv, kv_shape)))
    timings = {}
    for index, cfg in enumerate(configs, 1):
        ms = time_loop_ms(lambda q, k, v, cfg=cfg: attention(q, k, v, cfg=cfg, causal=causal, window=window,
                                                             softcap=softcap), q, k, v, iters=iters, reps=reps)
        timings[cfg] = ms
        if progress:
            done = int(30 * index / len(configs))
            print(f"\rautotune [{'#' * done}{'.' * (30 - done)}] {index}/{len(configs)} {cfg.short_name()} "
                  f"{ms:.3f} ms", end="" if index < len(configs) else "\n", file=sys.stderr, flush=True)
    best = min(timings, key=timings.get)
    key = cache_key(device.device_kind, q_shape[1], kv_shape[1], dtype, head_dim, causal=causal, window=window,
                    softcap=softcap)
    entries = _entries()
    entries[key] = {"config": dataclasses.asdict(best), "ms": timings[best],
                    "timings_ms": {c.short_name(): t for c, t in timings.items()}}
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
    tmp.replace(path)  # atomic: a concurrent reader sees the old or the new file, never half of one
    return best
