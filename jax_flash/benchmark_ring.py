"""Multi-device benchmark: ring attention against the gather it replaces, and scaling over devices.

    python -m jax_flash.benchmark --suite ring                        # bf16, D 128, 16 heads, 32k / 64k / 128k tokens
    python -m jax_flash.benchmark --suite ring --ring-seqs 32768 --devices 1,2
    python -m jax_flash.benchmark --suite ring --dtypes fp8          # float8_e4m3fn inputs, bfloat16 output

For each global sequence length, causal or not, and device count n (a mesh of n devices over the sequence axis),
three implementations of the same global call, timed as chained calls in one jitted function (jax_flash.timing):
  ring     q, k, v sharded over the sequence: jax_flash.attention runs ring attention;
  gather   the same sharded inputs all-gathered first (what a sequence-sharded call did before ring attention and
           what it still does for calls the ring cannot run): every device computes the whole output;
  batch    (scaling rows) a fixed global batch split over the devices: shard-local calls, no communication.
Columns: milliseconds per call and TFLOP/s of the global problem (4 B H S^2 D, halved when causal), and the speedup
over the one-device time of the same call. FP8 calls (unit descales) return their q with one element replaced by
the output's, as the prefill suite's FP8 rows do, so that the timing loop can chain them.
"""

from __future__ import annotations

import datetime
import sys

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_flash
from jax_flash.timing import time_interleaved_ms

SEQS = (32768, 65536, 131072)
HEADS, HEAD_DIM = 16, 128
SCALING_BATCH = 8  # the batch-scaling rows: 8 sequences of half the shortest length (8 x 16384 by default)


def _flops(batch, seq, causal):
    return 4 * batch * HEADS * seq * seq * HEAD_DIM / (2 if causal else 1)


def _attend(causal: bool, fp8: bool):
    """(q, k, v) -> what the timing loop chains: the output, or for FP8 inputs q with one element of the output."""
    if not fp8:
        return lambda q, k, v: jax_flash.attention(q, k, v, causal=causal)

    def attend_fp8(q, k, v):
        out = jax_flash.attention(q, k, v, causal=causal)
        return q.at[0, 0, 0, 0].set(out[0, 0, 0, 0].astype(q.dtype))

    return attend_fp8


def _implementations(mesh, causal, kind, fp8):
    """name -> (q, k, v) -> out over `mesh`, with the inputs' sharding for that implementation."""
    attend = _attend(causal, fp8)
    if kind == "batch":
        return {"batch": (attend, NamedSharding(mesh, P("dev")))}
    seq_sharded = NamedSharding(mesh, P(None, "dev"))
    replicated = NamedSharding(mesh, P())

    def gather(q, k, v):
        whole = [jax.lax.with_sharding_constraint(x, replicated) for x in (q, k, v)]
        return jax.lax.with_sharding_constraint(attend(*whole), seq_sharded)

    return {"ring": (attend, seq_sharded), "gather": (gather, seq_sharded)}


def run(args) -> list[dict]:
    devices = jax.devices()
    counts = [n for n in args.devices if n <= len(devices)]
    fp8 = "fp8" in args.dtypes
    dtype = jnp.float8_e4m3fn if fp8 else jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    cases = [(seq, causal, "sequence") for seq in args.ring_seqs for causal in args.causal_list]
    cases += [(min(args.ring_seqs) // 2, causal, "batch") for causal in args.causal_list]
    rows = []
    for seq, causal, kind in cases:
        batch = 1 if kind == "sequence" else SCALING_BATCH
        key = jax.random.split(jax.random.PRNGKey(0), 3)
        q, k, v = (jax.random.normal(key[i], (batch, seq, HEADS, HEAD_DIM)).astype(dtype) for i in range(3))
        one_ms = None
        for n in counts:
            mesh = jax.make_mesh((n,), ("dev",), devices=devices[:n], axis_types=(AxisType.Auto,))
            if n == 1:
                impls = {"one device": (_attend(causal, fp8), NamedSharding(mesh, P()))}
            else:
                impls = _implementations(mesh, causal, kind, fp8)
            fns = {name: fn for name, (fn, _) in impls.items()}
            sharding = next(iter(impls.values()))[1]
            inputs = [jax.device_put(x, sharding) for x in (q, k, v)]
            print(f"{kind} B={batch} S={seq} causal={causal} n={n}: {', '.join(fns)}", file=sys.stderr, flush=True)
            times, failures = time_interleaved_ms(fns, *inputs, iters=args.iters, reps=args.reps,
                                                  min_rep_ms=args.min_rep_ms)
            for name, error in failures.items():
                print(f"#   {name} failed: {type(error).__name__}: {str(error)[:300]}", file=sys.stderr)
            if n == 1 and "one device" in times:
                one_ms = times["one device"]
            for name, ms in times.items():
                rows.append(dict(kind=kind, batch=batch, seq=seq, causal=causal, devices=n, impl=name, ms=ms,
                                 tflops=_flops(batch, seq, causal) / (ms * 1e-3) / 1e12,
                                 speedup=(one_ms / ms) if one_ms else None, dtype=jnp.dtype(dtype).name,
                                 heads=HEADS, head_dim=HEAD_DIM, device=devices[0].device_kind))
            del inputs
    return rows


def print_table(rows: list[dict]) -> None:
    if not rows:
        print("no rows")
        return
    print(f"\nRing attention on {rows[0]['device']} ({datetime.date.today()}), {rows[0]['dtype']}, {HEADS} heads, "
          f"D = {HEAD_DIM}: ms per call | TFLOP/s of the global call | speedup over one device")
    print("kind | B | S | causal | devices | implementation | ms | TFLOP/s | speedup")
    for r in rows:
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        print(f"{r['kind']} | {r['batch']} | {r['seq']} | {'yes' if r['causal'] else 'no'} | {r['devices']} | "
              f"{r['impl']} | {r['ms']:.2f} | {r['tflops']:.1f} | {speedup}")
