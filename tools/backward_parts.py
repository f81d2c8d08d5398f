"""The parts of a training step's attention, timed beside cuDNN: the forward, the forward with its lse (the one a
step runs), the backward alone (the vjp of residuals saved once) and the benchmark's forward + backward step
(`jax_flash.benchmark._with_backward`), whose part after the forward is what `--pass backward` reports.

    python tools/backward_parts.py [--dtype bf16] [--head-dim 128] [--seqs 1024,4096] [--causal] [--impls ...]
    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum \
        python tools/backward_parts.py --kernels step --impls jax_flash --seqs 1024
    python tools/backward_parts.py --timeline step --seqs 1024

Shapes as the benchmark's: batch x seq = --tokens, heads x head_dim = --hidden. Timing: jax_flash.timing's
interleaved rounds of 10 chained calls. Per row: microseconds and TFLOP/s of each part, then the step less the
forward (the benchmark's backward) and what the step takes beyond its forward with lse and the backward alone.
--kernels PART runs that part (forward, forward_lse, backward, step) once more between cudaProfilerStart and
cudaProfilerStop, so that Nsight Compute lists exactly its kernels. --timeline PART records the benchmark's loop of
10 chained PART calls, dispatched back to back, with jax.profiler (CUPTI) and prints per call each kernel's time and
the gaps between kernels, from the last three quarters of the kernels (the first loop's start left out).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import ctypes.util
import glob
import statistics
import tempfile

import jax
import jax.numpy as jnp

import jax_flash
from jax_flash.benchmark import DTYPES, _with_backward
from jax_flash.timing import time_interleaved_ms, timed_loop

PART_FLOPS = {"forward": 1.0, "forward_lse": 1.0, "backward": 2.5, "step": 3.5}  # units of the forward's FLOPs


def _attention(impl: str, causal: bool, lse: bool = False):
    if impl == "cudnn":
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    if lse:
        return lambda q, k, v: jax_flash.attention(q, k, v, causal=causal, return_lse=True)[0]
    return lambda q, k, v: jax_flash.attention(q, k, v, causal=causal)


def parts(impl: str, causal: bool, q, k, v) -> dict:
    """{part: fn(q, k, v)} of one implementation; the backward alone takes its cotangent from q (chained calls)."""
    fn = _attention(impl, causal)
    _, pullback = jax.vjp(fn, q, k, v)
    out = {"forward": fn, "backward": lambda a, b, c: pullback(a)[0], "step": _with_backward(fn)}
    if impl != "cudnn":
        out["forward_lse"] = _attention(impl, causal, lse=True)
    return out


def _profiler():
    candidates = [ctypes.util.find_library("cudart"), *glob.glob("/usr/local/cuda*/lib64/libcudart.so*")]
    for path in filter(None, candidates):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise RuntimeError("libcudart not found: --kernels needs it for cudaProfilerStart / cudaProfilerStop")


def timeline(name: str, fn, q, k, v, loops: int = 10, iters: int = 10) -> None:
    """Per call of fn: each kernel's summed and median time and the gaps, from a CUPTI trace of `loops` back-to-back
    dispatches of the benchmark's loop of `iters` chained calls (the first quarter of the kernels left out)."""
    chained = timed_loop(fn, iters=iters)
    jax.block_until_ready(chained(q, k, v))
    trace_dir = tempfile.mkdtemp(prefix="jax_flash_timeline_")
    with jax.profiler.trace(trace_dir):
        for _ in range(loops):
            out = chained(q, k, v)
        jax.block_until_ready(out)
    (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    events = []
    for plane in jax.profiler.ProfileData.from_file(path).planes:
        if plane.name.startswith("/device:GPU:0"):
            events += [(e.start_ns, e.duration_ns, e.name) for line in plane.lines if line.name.startswith("Stream")
                       for e in line.events]
    if not events:
        raise RuntimeError(f"no GPU kernels in the trace {path}: --timeline reads the device's CUDA streams")
    events.sort()
    steady = events[len(events) // 4:]
    calls = loops * iters * len(steady) / max(1, len(events))
    span = steady[-1][0] + steady[-1][1] - steady[0][0]
    busy = sum(duration for _, duration, _ in steady)
    print(f"  {name}: per call {busy / calls / 1e3:.1f} us of kernels, {(span - busy) / calls / 1e3:.1f} us of gaps")
    by_name = collections.defaultdict(list)
    for _, duration, kernel in steady:
        by_name[kernel].append(duration / 1e3)
    for kernel, durations in sorted(by_name.items(), key=lambda item: -sum(item[1])):
        print(f"    {sum(durations) / calls:8.1f} us per call, median {statistics.median(durations):7.1f}, "
              f"{len(durations) / calls:.0f} per call  {kernel[:80]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seqs", default="1024,4096")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--impls", default="jax_flash,cudnn")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--kernels", choices=sorted(PART_FLOPS), help="run this part once under the profiler")
    parser.add_argument("--timeline", choices=sorted(PART_FLOPS), help="this part's kernels and gaps per call (CUPTI)")
    args = parser.parse_args()
    impls = args.impls.split(",")
    for seq in (int(s) for s in args.seqs.split(",")):
        batch, heads = max(1, args.tokens // seq), max(1, args.hidden // args.head_dim)
        keys = jax.random.split(jax.random.PRNGKey(seq), 3)
        q, k, v = (jax.random.normal(key, (batch, seq, heads, args.head_dim), jnp.float32).astype(DTYPES[args.dtype])
                   for key in keys)
        fns = {f"{impl} {part}": fn for impl in impls for part, fn in parts(impl, args.causal, q, k, v).items()}
        if args.timeline:
            print(f"{args.dtype} D={args.head_dim} S={seq} B={batch} H={heads} causal={args.causal}, {args.timeline}:")
            for name, fn in fns.items():
                if name.endswith(" " + args.timeline):
                    timeline(name, fn, q, k, v)
            continue
        if args.kernels:
            chosen = [jax.jit(fn) for name, fn in fns.items() if name.endswith(" " + args.kernels)]
            for fn in chosen:
                jax.block_until_ready(fn(q, k, v))  # compiled and warm before the profiled call
            profiler = _profiler()
            for fn in chosen:
                profiler.cudaProfilerStart()
                jax.block_until_ready(fn(q, k, v))
                profiler.cudaProfilerStop()
            continue
        times, failures = time_interleaved_ms(fns, q, k, v, reps=args.reps, min_rep_ms=10)
        flops = 4.0 * batch * heads * seq * seq * args.head_dim / (2 if args.causal else 1)
        print(f"{args.dtype} D={args.head_dim} S={seq} B={batch} H={heads} causal={args.causal}"
              + (f" failed: {sorted(failures)}" if failures else ""))
        for name, ms in times.items():
            print(f"  {name:22s} {ms * 1e3:9.1f} us {PART_FLOPS[name.split()[1]] * flops / ms / 1e9:8.1f} TFLOP/s")
        for impl in impls:
            t = {part: times.get(f"{impl} {part}") for part in PART_FLOPS}
            if t["step"] is None or t["forward"] is None or t["backward"] is None:
                continue
            forward = t["forward_lse"] if t["forward_lse"] is not None else t["forward"]
            print(f"  {impl}: step less forward {(t['step'] - t['forward']) * 1e3:.1f} us "
                  f"({2.5 * flops / (t['step'] - t['forward']) / 1e9:.1f} TFLOP/s); step beyond its forward and the "
                  f"backward alone {(t['step'] - forward - t['backward']) * 1e3:.1f} us")


if __name__ == "__main__":
    main()
