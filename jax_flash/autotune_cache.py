"""The autotune cache: the fastest config measured per (device, shape bucket, dtype, head dim, flags), in a JSON file.

The file is $JAX_FLASH_AUTOTUNE_CACHE, or ~/.cache/jax_flash/autotune.json. Lowering consults it for cfg=None
(jax_flash/_primitive.py) before the built-in table; jax_flash.autotune writes it. Sequence lengths are bucketed to
the next power of two.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys

import jax.numpy as jnp

from jax_flash.config import KernelConfig

_memory: dict[str, dict] | None = None


def cache_path() -> pathlib.Path:
    env = os.environ.get("JAX_FLASH_AUTOTUNE_CACHE")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "jax_flash" / "autotune.json"


def bucket(n: int) -> int:
    """The power of two a sequence length is cached under (the smallest >= n; 1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cache_key(device_kind: str, seq_q: int, seq_k: int, dtype, head_dim: int, *, causal: bool = False,
              window=None, softcap=None) -> str:
    flags = f"causal={bool(causal)},window={tuple(window) if window else None},softcap={bool(softcap)}"
    return f"{device_kind}|q{bucket(seq_q)}|k{bucket(seq_k)}|{jnp.dtype(dtype).name}|d{head_dim}|{flags}"


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


def store(key: str, best: KernelConfig, timings_ms: dict[KernelConfig, float]) -> None:
    """Records `best` and every candidate's time under `key`, and rewrites the file atomically (a concurrent reader
    sees the old or the new file, never half of one)."""
    entries = _entries()
    entries[key] = {"config": dataclasses.asdict(best), "ms": timings_ms[best],
                    "timings_ms": {c.short_name(): t for c, t in timings_ms.items()}}
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
    tmp.replace(path)
