"""Device timing of attention implementations: many calls inside one jitted loop, median over repetitions.

Each iteration feeds its output back as the next q, so XLA can neither hoist nor merge the calls, and host dispatch
is paid once per loop rather than once per call (it would otherwise dominate short sequences). loop="unrolled" (the
default) issues the calls back to back in straight-line code; loop="while" keeps XLA's while loop, whose condition
is evaluated and read back every iteration: on the H200 that added 60-90 us per call (S = 512, D = 128: cuDNN 297
TFLOP/s in a while loop, 478 unrolled), which flattered every ratio at short sequences.
"""

from __future__ import annotations

import math
import statistics
import time

import jax
from jax import lax

from jax_flash.attention import attention


def _check_loop(loop: str) -> None:
    if loop not in ("while", "unrolled"):
        raise ValueError(f"loop={loop!r} is not allowed; choose 'while' or 'unrolled'")


def check_counts(**counts) -> None:
    """Each of iters / reps / ... must be a positive int (a timing over no call has no median)."""
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is not allowed: {name} must be a positive int")


def timed_loop(fn, *, iters: int = 10, loop: str = "unrolled"):
    """The jitted (q, k, v) -> q' of `iters` chained fn calls that time_loop_ms times."""
    _check_loop(loop)
    check_counts(iters=iters)
    unroll = loop == "unrolled"
    return jax.jit(lambda q, k, v: lax.fori_loop(0, iters, lambda _, x: fn(x, k, v), q, unroll=unroll))


def calls_per_rep(call_ms: float, min_rep_ms: float, max_calls: int = 1000) -> int:
    """How many back-to-back calls of a `call_ms` loop make one repetition of at least `min_rep_ms` (1 when
    min_rep_ms <= 0; at most max_calls)."""
    if min_rep_ms <= 0:
        return 1
    return max(1, min(max_calls, math.ceil(min_rep_ms / max(call_ms, 1e-6))))


class _Repetitions:
    """One implementation made ready to time: its loop compiled and warmed, the calls per repetition calibrated
    (calls_per_rep); each sample_ms() is one repetition, in milliseconds per fn call."""

    def __init__(self, fn, q, k, v, *, iters: int, loop: str, min_rep_ms: float):
        self.chained, self.inputs, self.iters = timed_loop(fn, iters=iters, loop=loop), (q, k, v), iters
        jax.block_until_ready(self.chained(q, k, v))  # compile + warm-up (q, k, v may be pytrees of arrays)
        start = time.perf_counter()
        jax.block_until_ready(self.chained(q, k, v))
        self.calls = calls_per_rep((time.perf_counter() - start) * 1e3, min_rep_ms)

    def sample_ms(self) -> float:
        start = time.perf_counter()
        for _ in range(self.calls):  # one device stream: the last call's completion implies the earlier ones'
            out = self.chained(*self.inputs)
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / (self.iters * self.calls) * 1e3


def time_loop_ms(fn, q, k, v, *, iters: int = 10, reps: int = 5, loop: str = "unrolled",
                 min_rep_ms: float = 0.0) -> float:
    """Median milliseconds of one fn(q, k, v) call (fn must return q's shape and dtype); compiled and warmed first.

    min_rep_ms > 0: each repetition dispatches the jitted loop as many times as make it last at least that long
    (calibrated on the warm-up), back to back on the device queue with one synchronisation at the end. At 512-1024
    keys one loop of 10 calls lasts 1-3 ms, and the per-repetition synchronisation and clock ramp then moved cuDNN
    by up to 30% between runs on the H200."""
    check_counts(iters=iters, reps=reps)
    timed = _Repetitions(fn, q, k, v, iters=iters, loop=loop, min_rep_ms=min_rep_ms)
    return statistics.median(timed.sample_ms() for _ in range(reps))


def time_interleaved_ms(fns: dict, q, k, v, *, iters: int = 10, reps: int = 5, loop: str = "unrolled",
                        min_rep_ms: float = 0.0) -> tuple[dict, dict]:
    """({name: median ms per call}, {name: exception}) for several implementations timed in rounds: each round takes
    one repetition of every implementation (time_loop_ms's repetition), the first one rotating from round to round,
    so a drift of the device's clock or temperature during the run reaches all of them alike instead of the ones
    timed last (one after the other, as time_loop_ms does, a ratio takes whatever changed between them). An
    implementation that fails to compile or run is reported in the second dict and left out of later rounds.

    Each timed repetition follows an untimed one of the same implementation, so every implementation is timed in its
    own steady state, as in time_loop_ms, and never right after another one. Without it a rotation keeps each
    implementation's predecessor (the cyclic order does not change), and under a power cap the predecessor decides
    the clock: on the H200 (700 W cap reached at D = 128) cuDNN timed right after the slower sm80 kernel read 676
    TFLOP/s at D = 128, 16384 keys, against 603-611 timed after itself."""
    _check_loop(loop)  # (raised, not recorded as every implementation's failure)
    check_counts(iters=iters, reps=reps)
    ready, failures = {}, {}
    for name, fn in fns.items():
        try:
            ready[name] = _Repetitions(fn, q, k, v, iters=iters, loop=loop, min_rep_ms=min_rep_ms)
        except Exception as error:  # reported to the caller, who names it
            failures[name] = error
    samples = {name: [] for name in ready}
    for round_index in range(reps):
        names = [name for name in ready if name not in failures]
        shift = round_index % max(1, len(names))
        for name in names[shift:] + names[:shift]:
            try:
                ready[name].sample_ms()  # untimed: the device settles into this implementation's own load
                samples[name].append(ready[name].sample_ms())
            except Exception as error:
                failures[name] = error
    return {name: statistics.median(s) for name, s in samples.items() if name not in failures and s}, failures


def time_attention(q, k, v, cfg=None, *, iters: int = 10, reps: int = 5):
    """(output, milliseconds): jax_flash.attention's result and its median time per call after warm-up (the seed's
    forward_timed). Runs where q lives."""
    check_counts(iters=iters, reps=reps)
    out = jax.jit(attention, static_argnames="cfg")(q, k, v, cfg=cfg)
    ms = time_loop_ms(lambda q, k, v: attention(q, k, v, cfg=cfg), q, k, v, iters=iters, reps=reps)
    return out, ms
