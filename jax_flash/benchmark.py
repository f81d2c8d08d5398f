"""Benchmark: jax_flash against cuDNN, XLA and (on Hopper) Pallas Mosaic GPU attention, in one process, same inputs.

    python -m jax_flash.benchmark                        # bf16+fp16, D 64/128, S 512..16384, non-causal
    python -m jax_flash.benchmark --configs progression  # replay the seed's optimisation steps (D=128)
    python -m jax_flash.benchmark --json out.json --plot out.png
    python -m jax_flash.benchmark --order sequential     # all repetitions of one implementation, then the next
    python -m jax_flash.benchmark --suite decode         # decoding against a KV cache (jax_flash/benchmark_decode.py)
    python -m jax_flash.benchmark --suite ring           # ring attention over several devices (benchmark_ring.py)
    python -m jax_flash.benchmark --suite short          # ViT / BERT shapes: short sequences, many small heads
    python -m jax_flash.benchmark --suite packed         # packed documents by segment ids (benchmark_packed.py)
    python -m jax_flash.benchmark --suite tensors        # a dense causal mask and an ALiBi bias (benchmark_tensors.py)

Sizes as in docs/PERFORMANCE.md: batch * seq = --tokens (16384), heads * head_dim = --hidden (2048).
FLOPs = 4 * B * H * S * S * D (halved for causal: --causal on|both). On a CPU-only machine it compares the CPU path
with XLA (fp32 and bf16, causal and not, 256-16384 keys over 2048 tokens x 256 hidden), prints milliseconds and
GFLOP/s, and the machine's fp32 matmul rate as the ceiling (jax_flash/benchmark_cpu.py; peak memory there too).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys

import jax
import jax.numpy as jnp

import jax_flash
from jax_flash._plotting import pyplot
from jax_flash import benchmark_cpu, benchmark_decode, benchmark_packed, benchmark_ring, benchmark_tensors
from jax_flash import config as config_module
from jax_flash.selection import cuda_arch, resolve_gpu_config
from jax_flash.timing import time_interleaved_ms, time_loop_ms

DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32, "fp8": jnp.float8_e4m3fn}
# the numpy / jax names name the same dtypes
_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float8_e4m3fn": "fp8"}


def _dtype_list(text: str) -> list[str]:
    """--dtypes: a comma list of bf16, fp16, fp32, fp8 (or bfloat16, float16, float32, float8_e4m3fn), as the short
    names."""
    names = [_DTYPE_ALIASES.get(x.strip(), x.strip()) for x in text.split(",")]
    for name in names:
        if name not in DTYPES:
            raise argparse.ArgumentTypeError(
                f"dtype {name!r} is not supported; choose from {', '.join(DTYPES)} (or {', '.join(_DTYPE_ALIASES)})")
    return names


def _other_families(dtype, head_dim: int) -> dict:
    """family -> its first compiled config for (dtype, head_dim), for families other than cfg=None's on this GPU."""
    try:
        default = resolve_gpu_config(None, dtype, head_dim)
    except (ValueError, TypeError, RuntimeError):
        return {}
    others = {}
    for kernel in jax_flash.supported_configs():
        cfg = kernel.config
        if (kernel.dtype == jnp.dtype(dtype).name and kernel.head_dim == head_dim and cfg.family != default.family
                and cfg.family not in others and cfg.fits(head_dim, cuda_arch()) is None):
            others[cfg.family] = cfg
    return others


def _implementations(platform: str, dtype, head_dim: int, configs: str, causal: bool, family: str = "all",
                     pass_: str = "forward", softcap: float | None = None):
    """name -> fn(q, k, v) for everything that can run here (`family` filters `configs="compiled"`; `softcap` adds
    jax_flash with it beside the same call without, which the other columns compute)."""
    impls = {}
    if configs == "default":
        impls["jax_flash"] = lambda q, k, v: jax_flash.attention(q, k, v, causal=causal)
        if softcap:
            impls["jax_flash_softcap"] = lambda q, k, v: jax_flash.attention(q, k, v, causal=causal, softcap=softcap)
        if platform == "gpu" and pass_ != "forward":  # the backward's other variant: dQ without float atomics
            impls["jax_flash_deterministic"] = lambda q, k, v: jax_flash.attention(q, k, v, causal=causal,
                                                                                 deterministic=True)
        elif platform == "gpu":  # the other family's best compiled config beside the default, where it can run
            for other, cfg in _other_families(dtype, head_dim).items():
                impls[f"jax_flash_{other}"] = lambda q, k, v, cfg=cfg: jax_flash.attention(q, k, v, cfg=cfg,
                                                                                             causal=causal)
    else:
        chosen = (config_module.PROGRESSION_CONFIGS if configs == "progression"
                  else [kc.config for kc in jax_flash.supported_configs()
                        if kc.dtype == jnp.dtype(dtype).name and kc.head_dim == head_dim
                        and family in ("all", kc.config.family)])
        for i, cfg in enumerate(chosen):
            impls[f"jax_flash[{i}:{cfg.short_name()}]"] = (
                lambda q, k, v, cfg=cfg: jax_flash.attention(q, k, v, cfg=cfg, causal=causal))
    if platform == "gpu":
        impls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn",
                                                                      is_causal=causal)
    impls["xla"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla", is_causal=causal)
    if platform == "gpu" and jnp.dtype(dtype) == jnp.float16:
        try:
            from jax.experimental.pallas.ops.gpu import attention_mgpu

            fields = {f.name for f in dataclasses.fields(attention_mgpu.TuningConfig)}
            if not causal or "causal" in fields:  # causal is a TuningConfig field in the jax versions that have it
                mosaic_cfg = attention_mgpu.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2,
                                                         **({"causal": causal} if "causal" in fields else {}))
                impls["mosaic"] = lambda q, k, v: attention_mgpu.attention(q, k, v, mosaic_cfg)
        except Exception as error:  # not importable on this jax / not Hopper
            print(f"# Pallas Mosaic GPU attention unavailable: {error}", file=sys.stderr)
    return impls


def _fp8_implementations(platform: str, causal: bool) -> dict:
    """FP8 rows: jax_flash on float8_e4m3fn inputs (bfloat16 output) beside cuDNN's FP8 attention (through jax's
    cuDNN binding, where it runs) and jax_flash and cuDNN on the same values in bfloat16. Each fn takes (FP8, bfloat16) pairs of q, k and v and returns
    the q pair with its own element replaced by its output (the timing loop chains it); the FP8 call's bfloat16
    output reaches its e4m3 q through one element (an in-place update: rounding the whole output to e4m3 would add
    a pass over it that the bfloat16 calls do not make)."""
    def fp8_call(q, k, v):
        out = jax_flash.attention(q[0], k[0], v[0], causal=causal)
        return q[0].at[0, 0, 0, 0].set(out[0, 0, 0, 0].astype(q[0].dtype)), q[1]

    def on_bf16(fn):
        return lambda q, k, v: (q[0], fn(q[1], k[1], v[1]))

    impls = {"jax_flash": fp8_call,
             "jax_flash_bf16": on_bf16(lambda q, k, v: jax_flash.attention(q, k, v, causal=causal))}
    if platform == "gpu":
        impls["cudnn_bf16"] = on_bf16(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, implementation="cudnn", is_causal=causal))
        try:  # cuDNN's FP8 attention: jax's own cuDNN binding (no public spelling), FP8 output, unit scales
            from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

            params = {name: jnp.ones((1, 1, 1, 1), jnp.float32) for name in cudnn_attention.fp8_params_keys}
            mask_type = cudnn_attention.MaskType.CAUSAL if causal else cudnn_attention.MaskType.NO_MASK

            def cudnn_fp8(q, k, v):
                out = cudnn_attention.dot_product_attention(q[0], k[0], v[0], fp8_params=params,
                                                            scale=q[0].shape[3] ** -0.5, mask_type=mask_type,
                                                            use_fp8=True)[0]
                return out, q[1]
            impls["cudnn_fp8"] = cudnn_fp8
        except Exception as error:  # not in this jax
            print(f"# cuDNN FP8 attention unavailable: {error}", file=sys.stderr)
    return impls


def _device_name(device) -> str:
    if device.platform == "cpu":
        return f"{benchmark_cpu.machine_name()}, OpenBLAS {jax_flash.native.OPENBLAS_CORE} kernels"
    return device.device_kind


# FLOPs of each pass in units of the forward's: the backward recomputes S and does four more products (dV, dP, dQ,
# dK) against the forward's two: 2.5x (FlashAttention's convention); forward + backward 3.5x.
_PASS_FLOPS = {"forward": 1.0, "backward": 2.5, "both": 3.5}


def _with_backward(fn):
    """fn's forward and backward as one q-shaped call: the gradient in q of sum(fn(q, k, v) * q), which runs the
    forward and the backward of everything fn computes (its dk and dv too: q, k and v are all differentiated)."""

    def step(q, k, v):
        def loss(q, k, v):
            return (fn(q, k, v).astype(jnp.float32) * jax.lax.stop_gradient(q).astype(jnp.float32)).sum()

        dq, dk, dv = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        # (dk and dv folded in through one element each, so that XLA keeps their computation; scaled to leave q's
        # magnitude. Their means took 42 us of XLA reductions per step of 16384 tokens on an H200; an in-place
        # update of dq's first element instead of this add gave cuDNN's step a copy of dq.)
        touch = 1e-3 * (dk[0, 0, 0, 0].astype(jnp.float32) + dv[0, 0, 0, 0].astype(jnp.float32))
        return (dq + touch).astype(q.dtype)

    return step


def _pass_ms(pass_: str, forward_ms: float | None, both_ms: float | None) -> float | None:
    if pass_ == "forward":
        return forward_ms
    if pass_ == "both":
        return both_ms
    return None if forward_ms is None or both_ms is None else both_ms - forward_ms


# --suite short: (name, batch, seq, heads, head_dim) of models with short sequences and many small heads, where tile
# quantisation and per-call costs decide; the last has more (batch, head) pairs than a grid axis's 65535.
SHORT_SHAPES = (("vit-b/16 224px", 64, 197, 12, 64), ("vit-b/16 224px", 256, 197, 12, 64),
                ("vit-b/16 384px", 64, 577, 12, 64), ("bert-base 128", 256, 128, 12, 64),
                ("bert-base 512", 32, 512, 12, 64), ("bert-base 512", 128, 512, 12, 64),
                ("many heads", 8192, 64, 12, 64))


def _cases(args, causal_flags) -> list[tuple]:
    """(dtype name, head_dim, causal, seq, batch, heads, model name) of every row."""
    if args.suite == "short":
        return [(d, dim, c, seq, batch, heads, name) for d in args.dtypes for c in causal_flags
                for name, batch, seq, heads, dim in SHORT_SHAPES]
    return [(d, h, c, s, max(1, args.tokens // s), max(1, args.hidden // h), None)
            for d in args.dtypes for h in args.head_dims for c in causal_flags for s in args.seqs]


def run(args) -> list[dict]:
    platform = jax.default_backend()
    device = jax.devices()[0]
    rows = []
    causal_flags = {"off": [False], "on": [True], "both": [False, True]}[args.causal]
    cases = _cases(args, causal_flags)
    for index, (dtype_name, head_dim, causal, seq, batch, heads, model) in enumerate(cases, 1):
        dtype = DTYPES[dtype_name]
        kq, kk, kv = jax.random.split(jax.random.PRNGKey(index), 3)
        q, k, v = (jax.random.normal(key, (batch, seq, heads, head_dim), jnp.float32).astype(dtype)
                   for key in (kq, kk, kv))
        if dtype_name == "fp8":  # (FP8, bfloat16) pairs of the same values (_fp8_implementations)
            q, k, v = ((x, x.astype(jnp.bfloat16)) for x in (q, k, v))
        flops = 4.0 * batch * heads * seq * seq * head_dim / (2 if causal else 1)  # the forward's
        print(f"[{index}/{len(cases)}] {dtype_name} D={head_dim} S={seq} B={batch} H={heads} causal={causal}",
              file=sys.stderr, flush=True)
        results = {}
        candidates = (_fp8_implementations(platform, causal) if dtype_name == "fp8" else
                      _implementations(platform, dtype, head_dim, args.configs, causal, args.family, args.pass_,
                                       args.softcap))
        impls = {name: fn for name, fn in candidates.items()
                 # (XLA materialises (S, S) scores: too slow and too large at long sequences)
                 if not (name == "xla" and seq > args.xla_max_seq)}
        timed = {}
        if args.pass_ in ("forward", "backward"):
            timed.update(impls)
        if args.pass_ in ("both", "backward"):
            timed.update({f"{name}+bwd": _with_backward(fn) for name, fn in impls.items()})
        timing_args = dict(iters=args.iters, reps=args.reps, loop=args.loop, min_rep_ms=args.min_rep_ms)
        if args.order == "interleaved":
            times, failures = time_interleaved_ms(timed, q, k, v, **timing_args)
        else:
            times, failures = {}, {}
            for name, fn in timed.items():
                try:
                    times[name] = time_loop_ms(fn, q, k, v, **timing_args)
                except Exception as error:
                    failures[name] = error
        for name in impls:
            ms = _pass_ms(args.pass_, times.get(name), times.get(f"{name}+bwd"))
            if ms is not None:
                results[name] = {"ms": ms, "tflops": _PASS_FLOPS[args.pass_] * flops / ms / 1e9}
            for failed in (name, f"{name}+bwd"):
                if failed in failures:
                    error = failures[failed]
                    print(f"#   {failed} failed: {type(error).__name__}: {str(error)[:200]}", file=sys.stderr)
        rows.append({"dtype": dtype_name, "head_dim": head_dim, "seq": seq, "batch": batch, "heads": heads,
                     "causal": causal, "device": _device_name(device), "results": results,
                     **({"model": model} if model else {})})
        # each row as it is measured, so a run cut short (a time limit) still reports the rows it finished
        print("    " + ", ".join(f"{name} {r['tflops']:.4g} TFLOP/s {r['ms']:.4g} ms" for name, r in results.items()),
              file=sys.stderr, flush=True)
    return rows


def print_cpu_table(rows: list[dict], matmul_gflops: float) -> None:
    names = []
    for row in rows:
        names += [n for n in row["results"] if n not in names]
    print(f"\nms and GFLOP/s on {rows[0]['device'] if rows else '?'} ({datetime.date.today()}); ceiling: fp32 matmul "
          f"{matmul_gflops:.0f} GFLOP/s; speed-up over xla in brackets")
    print(" | ".join(["dtype", "D", "causal", "S"] + [f"{n} ms | GFLOP/s" for n in names]))
    for row in rows:
        ref = row["results"].get("xla", {}).get("ms")
        cells = []
        for name in names:
            r = row["results"].get(name)
            ratio = f" ({ref / r['ms']:.2f}x)" if r and ref and name != "xla" else ""
            cells.append("- | -" if r is None else f"{r['ms']:.2f} | {r['tflops'] * 1e3:.1f}{ratio}")
        print(" | ".join([row["dtype"], str(row["head_dim"]), "yes" if row["causal"] else "no", str(row["seq"])]
                         + cells))


def print_table(rows: list[dict]) -> None:
    names = []
    for row in rows:
        names += [n for n in row["results"] if n not in names]
    base = next((n for n in ("cudnn", "cudnn_bf16") if any(n in r["results"] for r in rows)), "xla")
    print(f"\nTFLOP/s on {rows[0]['device'] if rows else '?'} ({datetime.date.today()}); ratio to {base} in brackets")
    print(" | ".join(["dtype", "D", "causal", "S", "B x H"] + names))
    for row in rows:
        ref = row["results"].get(base, {}).get("tflops")
        cells = []
        for name in names:
            r = row["results"].get(name)
            cells.append("-" if r is None else f"{r['tflops']:.0f}" + (f" ({r['tflops'] / ref:.2f}x)" if ref else ""))
        print(" | ".join([row["dtype"], str(row["head_dim"]), "yes" if row["causal"] else "no", str(row["seq"]),
                          f"{row['batch']} x {row['heads']}"] + cells))


def plot(rows: list[dict], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    groups = sorted({(r["dtype"], r["head_dim"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, (dtype, head_dim, causal) in zip(axes[0], groups):
        sel = [r for r in rows if r["dtype"] == dtype and r["head_dim"] == head_dim and r["causal"] == causal]
        names = sorted({n for r in sel for n in r["results"]})
        for name in names:
            pts = [(r["seq"], r["results"][name]["tflops"]) for r in sel if name in r["results"]]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{dtype} D={head_dim} {'causal' if causal else 'non-causal'}")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.legend(fontsize=7)
    fig.suptitle(f"{rows[0]['device']} {datetime.date.today()}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    on_gpu = jax.default_backend() == "gpu"
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=["prefill", "short", "decode", "ring", "packed", "tensors"],
                        default="prefill",
                        help="prefill: the standard grid (TFLOP/s); short: ViT and BERT shapes and more (batch, "
                             "head) pairs than 65535 (TFLOP/s); decode: a few query rows against a KV cache, "
                             "contiguous and paged (us, K/V GB/s, %% of copy bandwidth); ring: ring attention "
                             "against the gather, and scaling over 1, 2, 4, ... devices; packed: documents packed "
                             "into rows by segment ids against the same documents unpacked (TFLOP/s of visible "
                             "pairs); tensors: a dense causal mask and an ALiBi bias beside cuDNN given them")
    parser.add_argument("--tensor-seqs", type=lambda s: [int(x) for x in s.split(",")], default=[],
                        help="--suite tensors: sequence lengths (default: 2048,4096 on a GPU, 512,1024 on CPU)")
    parser.add_argument("--packed-tokens", type=int, default=0,
                        help="--suite packed: tokens per packed row (0: 16384 on a GPU, 4096 on CPU)")
    parser.add_argument("--packed-means", type=lambda s: [int(x) for x in s.split(",")], default=[],
                        help="--suite packed: mean document lengths (default: 512,2048,4096 on a GPU, 256,1024 on "
                             "CPU)")
    parser.add_argument("--ring-seqs", type=lambda s: [int(x) for x in s.split(",")],
                        default=list(benchmark_ring.SEQS), help="--suite ring: global sequence lengths")
    parser.add_argument("--devices", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8],
                        help="--suite ring: device counts (those the machine has)")
    parser.add_argument("--page-sizes", type=lambda s: [int(x) for x in s.split(",") if x], default=[16, 64, 256],
                        help="--suite decode: the paged caches timed beside the contiguous one")
    parser.add_argument("--decode-heads", type=lambda s: [tuple(int(n) for n in x.split("/")) for x in s.split(",")],
                        default=list(benchmark_decode.HEADS), help="--suite decode: query/kv heads, e.g. 32/8,32/1")
    parser.add_argument("--decode-seq-q", type=lambda s: [int(x) for x in s.split(",")],
                        default=list(benchmark_decode.SEQ_Q), help="--suite decode: query rows per sequence")
    parser.add_argument("--decode-cache", type=lambda s: [tuple(int(n) for n in x.split("x")) for x in s.split(",")],
                        default=list(benchmark_decode.BATCH_KEYS),
                        help="--suite decode: batch x cache length, e.g. 1x131072,8x16384")
    parser.add_argument("--dtypes", type=_dtype_list, default=["bf16", "fp16"] if on_gpu else ["fp32", "bf16"])
    parser.add_argument("--head-dims", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128])
    parser.add_argument("--seqs", type=lambda s: [int(x) for x in s.split(",")],
                        default=[512, 1024, 2048, 4096, 8192, 16384] if on_gpu else
                        [256, 512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--tokens", type=int, default=16384 if on_gpu else 2048)
    parser.add_argument("--hidden", type=int, default=2048 if on_gpu else 256)
    parser.add_argument("--configs", choices=["default", "progression", "compiled"], default="default")
    parser.add_argument("--causal", choices=["off", "on", "both"], default="off" if on_gpu else "both")
    parser.add_argument("--pass", dest="pass_", choices=["forward", "backward", "both"], default="forward",
                        help="time the forward, the backward (forward + backward minus forward, 2.5x the forward's "
                             "FLOPs) or both (3.5x)")
    parser.add_argument("--family", choices=["all", "sm80", "sm90"], default="all",
                        help="with --configs compiled: time only this family's configs")
    parser.add_argument("--iters", type=int, default=10 if on_gpu else 2)
    parser.add_argument("--reps", type=int, default=5 if on_gpu else 3)
    parser.add_argument("--loop", choices=["while", "unrolled"], default="unrolled",
                        help="the timed calls inside XLA's while loop or unrolled back to back (jax_flash.timing)")
    parser.add_argument("--min-rep-ms", type=float, default=25.0 if on_gpu else 0.0,
                        help="each repetition repeats the timed loop until it lasts this long (jax_flash.timing)")
    parser.add_argument("--order", choices=["sequential", "interleaved"], default="interleaved",
                        help="rounds of one repetition of each implementation, every one after an untimed one of "
                             "its own (jax_flash.timing.time_interleaved_ms; the default and the README tables' "
                             "method), or all repetitions of one implementation, then the next")
    parser.add_argument("--xla-max-seq", type=int, default=4096 if on_gpu else 8192)
    parser.add_argument("--softcap", type=float, default=None,
                        help="also time jax_flash with this softcap (column jax_flash_softcap) beside the call "
                             "without it; the other columns have none (jax.nn takes no softcap)")
    parser.add_argument("--json", help="write the rows as JSON here")
    parser.add_argument("--plot", help="write a PNG of TFLOP/s against sequence length here")
    args = parser.parse_args(argv)
    if "fp8" in args.dtypes and (args.pass_ != "forward" or args.suite not in ("prefill", "ring")
                                 or args.configs != "default"):
        parser.error("--dtypes fp8 times the forward of the prefill and ring suites with the default configs only")
    if args.suite == "decode":
        return _main_decode(args)
    if args.suite == "ring":
        return _main_ring(args)
    if args.suite == "packed":
        return _main_packed(args)
    if args.suite == "tensors":
        return _main_tensors(args)
    matmul = None if on_gpu else benchmark_cpu.matmul_gflops()
    rows = run(args)
    _write_json(args, args.suite, rows, {"loop": args.loop, "order": args.order}, matmul_gflops=matmul,
                **{"pass": args.pass_}, **({"softcap": args.softcap} if args.softcap else {}))
    if args.plot and rows:
        plot(rows, args.plot)
    if on_gpu:
        print_table(rows)
    else:
        print_cpu_table(rows, matmul)
    return 0


def _write_json(args, suite: str, rows: list, timing: dict | None = None, **fields) -> None:
    """The suite's rows as JSON at --json (when given), after the facts every results file carries, `fields`, and
    the timing options (`timing`: more of them)."""
    if not args.json:
        return
    with open(args.json, "w") as f:
        json.dump({"suite": suite, "date": str(datetime.date.today()), "jax": jax.__version__,
                   "platform": jax.default_backend(), "device": _device_name(jax.devices()[0]), **fields,
                   "timing": {"iters": args.iters, "reps": args.reps, "min_rep_ms": args.min_rep_ms, **(timing or {})},
                   "rows": rows}, f, indent=1)


def _main_decode(args) -> int:
    rows, copy_gbs = benchmark_decode.run(args)
    _write_json(args, "decode", rows, copy_gbs=copy_gbs)
    if args.plot and rows:
        benchmark_decode.plot(rows, args.plot)
    benchmark_decode.print_table(rows, copy_gbs)
    return 0


def _main_packed(args) -> int:
    rows = benchmark_packed.run(args)
    _write_json(args, "packed", rows)
    benchmark_packed.print_table(rows)
    return 0


def _main_tensors(args) -> int:
    rows = benchmark_tensors.run(args)
    _write_json(args, "tensors", rows)
    benchmark_tensors.print_table(rows)
    return 0


def _main_ring(args) -> int:
    args.causal_list = {"off": [False], "on": [True], "both": [False, True]}[args.causal]
    rows = benchmark_ring.run(args)
    _write_json(args, "ring", rows, device_count=len(jax.devices()))
    benchmark_ring.print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
