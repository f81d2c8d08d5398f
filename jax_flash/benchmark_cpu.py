"""What the benchmark measures on a CPU-only machine besides the attention rows: the machine's fp32 matrix-product rate
(the ceiling of the CPU path, which spends its time in OpenBLAS products) and the peak memory of one long call.

    python -m jax_flash.benchmark_cpu --memory 65536     # peak RSS of jax_flash and of XLA at B=1, H=4, D=64, fp32

Each peak-memory measurement runs in a fresh Python process (the peak resident set size of a process only grows).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

_CHILD = """
import json, resource, sys
import jax, jax.numpy as jnp
import jax_flash
impl, batch, seq, heads, head_dim = sys.argv[1], *map(int, sys.argv[2:6])
shape = (batch, seq, heads, head_dim)
q, k, v = (jax.random.normal(jax.random.PRNGKey(i), shape, jnp.float32) for i in range(3))
jax.block_until_ready((q, k, v))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
fn = {"jax_flash": lambda q, k, v: jax_flash.attention(q, k, v, causal=True),
      "xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla", is_causal=True)}[impl]
try:
    jax.block_until_ready(jax.jit(fn)(q, k, v))
    error = None
except Exception as e:  # XLA's (S, S) buffer may not fit
    error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"inputs_peak_mb": before / 1024, "peak_mb": after / 1024, "error": error}))
"""


def machine_name() -> str:
    """The processor's model name and the cores this process may use, e.g. 'AMD EPYC (2 cores)'."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return f"{model} ({cores} cores)"


def matmul_gflops(n: int = 2048, reps: int = 5) -> float:
    """Best-of-reps fp32 (n x n) @ (n x n) rate of numpy (its OpenBLAS, every core): the ceiling of the CPU path."""
    import numpy as np

    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    a @ a
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - start)
    return 2.0 * n ** 3 / best / 1e9


def peak_memory_mb(impl: str, seq: int, batch: int = 1, heads: int = 4, head_dim: int = 64,
                   timeout_s: float = 1800) -> dict:
    """{"inputs_peak_mb", "peak_mb", "error"} of one causal fp32 call of `impl` ("jax_flash" or "xla") in a fresh
    process: the peak resident set size before the call (inputs and runtime) and after it."""
    cmd = [sys.executable, "-c", _CHILD, impl, str(batch), str(seq), str(heads), str(head_dim)]
    # Run from the folder that holds this jax_flash, so that the child imports the same package (a `-c` child puts
    # its working directory first on sys.path, where a source tree would shadow the installed one).
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=package_parent,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        reason = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1][:200]
        return {"inputs_peak_mb": None, "peak_mb": None, "error": f"the process failed: {reason}"}
    return json.loads(lines[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memory", type=int, default=65536, help="keys (= queries) of the causal call")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args(argv)
    print(f"# {machine_name()}; fp32 matmul {matmul_gflops():.0f} GFLOP/s")
    for impl in ("jax_flash", "xla"):
        r = peak_memory_mb(impl, args.memory, heads=args.heads, head_dim=args.head_dim)
        peak = "-" if r["peak_mb"] is None else f"{r['peak_mb']:.0f} MB"
        before = "-" if r["inputs_peak_mb"] is None else f"{r['inputs_peak_mb']:.0f} MB"
        print(f"{impl}: B=1 S={args.memory} H={args.heads} D={args.head_dim} fp32 causal: peak RSS {peak} "
              f"(before the call {before})" + (f"; failed: {r['error']}" if r["error"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
