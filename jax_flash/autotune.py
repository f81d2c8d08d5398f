"""Autotuner: times the candidate configs on the current device and stores the winner in the autotune cache
(jax_flash/autotune_cache.py), which cfg=None consults before the built-in table. On a GPU the candidates are the
compiled configs for the dtype and head dim that the device can run. On CPU, cfg=None already takes the CPU path's
measured tiles (selection.CPU_TILES), larger than any KernelConfig allows; explicit `configs` are still timed there
(their block sizes are the CPU tiles).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from jax_flash import autotune_cache, native
from jax_flash.attention import attention
from jax_flash.config import KernelConfig
from jax_flash.selection import CPU_TILES
from jax_flash.timing import check_counts, time_loop_ms


def _progress_bar(total: int):
    """A tqdm bar on stderr when it is a terminal; None (one plain line per config) when it is piped or logged, or
    without tqdm."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="autotune", unit="config", file=sys.stderr, dynamic_ncols=True)


def autotune(q_shape, kv_shape, dtype, causal: bool = False, *, window=None, softcap=None, configs=None,
             device=None, iters: int = 5, reps: int = 3, progress: bool = True) -> KernelConfig:
    """Times every candidate config for these shapes on `device`, stores and returns the fastest.

    q_shape (B, Sq, Hq, D), kv_shape (B, Sk, Hk, D). `configs` overrides the candidates (default: the compiled
    configs for dtype and head dim on a GPU; on CPU there is no default list). `device` defaults to
    jax.devices()[0].
    """
    for name, shape in (("q_shape", q_shape), ("kv_shape", kv_shape)):
        if (not isinstance(shape, (tuple, list)) or len(shape) != 4 or
                not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)):
            raise ValueError(f"{name} must be (batch, seq_{name[0]}, heads_{name[0]}, head_dim) of 4 ints >= 0, "
                             f"got {shape!r}")
    check_counts(iters=iters, reps=reps)
    if configs is not None and len(configs) == 0:
        raise ValueError("configs is empty: pass None for the default candidates, or at least one KernelConfig")
    device = device or jax.devices()[0]
    head_dim = q_shape[3]
    dtype_name = jnp.dtype(dtype).name
    if configs is None:
        if device.platform == "gpu":
            arch = native.device_arch(device)  # the sm90 family runs on sm_90 only
            configs = [c for c in native.compiled_configs_for(dtype_name, head_dim) if c.fits(head_dim, arch) is None]
            if not configs:
                raise ValueError(f"no compiled GPU kernel for {dtype_name} head_dim={head_dim}; compiled head dims: "
                                 f"{native.gpu_head_dims(dtype_name)}")
        else:
            tiles = f"{CPU_TILES['block_q']} x {CPU_TILES['block_kv']}"
            raise ValueError(f"autotune on {device.platform}: pass configs= to compare; without them there is nothing "
                             f"to tune (cfg=None already uses the CPU path's measured tiles, {tiles} query rows x "
                             f"keys, beyond KernelConfig's GPU block sizes)")
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.device_put(jax.random.normal(key, shape, jnp.float32).astype(dtype), device)
               for key, shape in ((kq, q_shape), (kk, kv_shape), (kv, kv_shape)))
    timings = {}
    bar = _progress_bar(len(configs)) if progress else None
    for index, cfg in enumerate(configs, 1):
        ms = time_loop_ms(lambda q, k, v, cfg=cfg: attention(q, k, v, cfg=cfg, causal=causal, window=window,
                                                             softcap=softcap), q, k, v, iters=iters, reps=reps)
        timings[cfg] = ms
        if bar is not None:
            bar.set_postfix_str(f"{cfg.describe()}: {ms:.3f} ms")
            bar.update()
        elif progress:  # one line per config: a log or pipe keeps each on its own line
            print(f"autotune {index}/{len(configs)} {cfg.describe()}: {ms:.3f} ms", file=sys.stderr, flush=True)
    if bar is not None:
        bar.close()
    best = min(timings, key=timings.get)
    key = autotune_cache.cache_key(device.device_kind, q_shape[1], kv_shape[1], dtype, head_dim, causal=causal,
                                   window=window, softcap=softcap)
    autotune_cache.store(key, best, timings)
    return best
