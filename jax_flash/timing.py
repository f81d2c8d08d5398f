"""Device timing of attention implementations: many calls inside one jitted loop, median over repetitions.

Each iteration feeds its output back as the next q, so XLA can neither hoist nor merge the calls, and host dispatch
is paid once per loop rather than once per call (it would otherwise dominate short sequences). loop="while" keeps
XLA's while loop (its condition is evaluated and read back every iteration), loop="unrolled" issues the calls back to
back in straight-line code.
"""

from __future__ import annotations

import statistics
import time

import jax
from jax import lax


def time_loop_ms(fn, q, k, v, *, iters: int = 10, reps: int = 5, loop: str = "while") -> float:
    """Median milliseconds of one fn(q, k, v) call (fn must return q's shape and dtype); compiled and warmed first."""
    if loop not in ("while", "unrolled"):
        raise ValueError(f"loop={loop!r} is not allowed; choose 'while' or 'unrolled'")
    unroll = loop == "unrolled"
    loop = jax.jit(lambda q, k, v: lax.fori_loop(0, iters, lambda _, x: fn(x, k, v), q, unroll=unroll))
    loop(q, k, v).block_until_ready()  # compile + warm-up
    loop(q, k, v).block_until_ready()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        loop(q, k, v).block_until_ready()
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples) * 1e3


def time_attention(q, k, v, cfg=None, *, iters: int = 10, reps: int = 5):
    """(output, milliseconds): jax_flash.attention's result and its median time per call after warm-up (the seed's
    forward_timed). Runs where q lives."""
    from jax_flash.attention import attention

    out = jax.jit(attention, static_argnames="cfg")(q, k, v, cfg=cfg)
    ms = time_loop_ms(lambda q, k, v: attention(q, k, v, cfg=cfg), q, k, v, iters=iters, reps=reps)
    return out, ms
