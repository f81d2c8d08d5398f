"""Device timing of attention implementations: many calls inside one jitted loop, median over repetitions.

Each iteration feeds its output back as the next q, so XLA can neither hoist nor merge the calls, and host dispatch
is paid once per loop rather than once per call (it would otherwise dominate short sequences). loop="unrolled" (the
default) issues the calls back to back in straight-line code; loop="while" keeps XLA's while loop, whose condition
is evaluated and read back every iteration: on the H200 that added 60-90 us per call (S = 512, D = 128: cuDNN 297
TFLOP/s in a while loop, 478 unrolled), which flattered every ratio at short sequences (docs/NOTES.md).
"""

from __future__ import annotations

import statistics
import time

import jax
from jax import lax


def timed_loop(fn, *, iters: int = 10, loop: str = "unrolled"):
    """The jitted (q, k, v) -> q' of `iters` chained fn calls that time_loop_ms times."""
    if loop not in ("while", "unrolled"):
        raise ValueError(f"loop={loop!r} is not allowed; choose 'while' or 'unrolled'")
    unroll = loop == "unrolled"
    return jax.jit(lambda q, k, v: lax.fori_loop(0, iters, lambda _, x: fn(x, k, v), q, unroll=unroll))


def time_loop_ms(fn, q, k, v, *, iters: int = 10, reps: int = 5, loop: str = "unrolled") -> float:
    """Median milliseconds of one fn(q, k, v) call (fn must return q's shape and dtype); compiled and warmed first."""
    chained = timed_loop(fn, iters=iters, loop=loop)
    chained(q, k, v).block_until_ready()  # compile + warm-up
    chained(q, k, v).block_until_ready()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        chained(q, k, v).block_until_ready()
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples) * 1e3


def time_attention(q, k, v, cfg=None, *, iters: int = 10, reps: int = 5):
    """(output, milliseconds): jax_flash.attention's result and its median time per call after warm-up (the seed's
    forward_timed). Runs where q lives."""
    from jax_flash.attention import attention

    out = jax.jit(attention, static_argnames="cfg")(q, k, v, cfg=cfg)
    ms = time_loop_ms(lambda q, k, v: attention(q, k, v, cfg=cfg), q, k, v, iters=iters, reps=reps)
    return out, ms
