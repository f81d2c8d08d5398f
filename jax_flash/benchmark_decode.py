"""Decode benchmark: a few query rows per sequence against a long KV cache, contiguous and paged, beside cuDNN.

    python -m jax_flash.benchmark --suite decode                       # bf16, D 128, every heads / Sq / (B, Sk)
    python -m jax_flash.benchmark --suite decode --dtypes bf16,fp16 --head-dims 64,128 --page-sizes 16,64,256

Each row times jax_flash.attention on a contiguous cache and on paged caches (shuffled pages of each --page-sizes),
and jax.nn.dot_product_attention(implementation="cudnn") on the contiguous one, as chained calls in one jitted
function (jax_flash.timing). Columns: microseconds per call, K/V GB/s (the K and V bytes each call must read, once),
percent of the device's copy bandwidth measured in the same run (an elementwise float32 pass over 1 GiB: its bytes
read and written per second), ratio to cuDNN. Sq > 1 rows are causal (speculative decoding: the new rows at the end
of the cache); jax.nn's causal mask is top-left, so cuDNN runs them unmasked (the mask hides a few keys of
thousands).
"""

from __future__ import annotations

import datetime
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash._plotting import pyplot
from jax_flash.timing import time_interleaved_ms, time_loop_ms

HEADS = ((32, 8), (32, 32), (32, 1))
SEQ_Q = (1, 4, 8)
BATCH_KEYS = ((1, 4096), (1, 32768), (1, 131072), (8, 16384), (64, 4096), (128, 1024))
_TARGET_TOKENS = 32768  # rows with B x Sk at least this must reach 85% of the copy bandwidth


def copy_bandwidth_gbs(dtype=jnp.float32, *, gib: float = 1.0, reps: int = 5) -> float:
    """GB/s of an elementwise pass x + 1 over `gib` GiB (bytes read plus bytes written per second). float32 by
    default: XLA's bfloat16 pass is not bound by memory on an H200 (3264 GB/s over 1 GiB, float32 4140, a float32
    sum 4296)."""
    n = int(gib * 2**30) // jnp.dtype(dtype).itemsize
    x = jnp.zeros((n,), dtype)
    # (one pass per jitted call: chained passes in one function would fuse into one)
    ms = time_loop_ms(lambda q, k, v: q + 1, x, x[:1], x[:1], iters=1, reps=reps, min_rep_ms=25.0)
    return 2 * n * jnp.dtype(dtype).itemsize / (ms * 1e-3) / 1e9


def shuffled_pages(x, page_size: int, seed: int):
    """x (B, S, H, D) as (B * S / page_size, page_size, H, D) pages in a random order, with its page table."""
    batch, seq = x.shape[0], x.shape[1]
    per_seq = seq // page_size
    order = np.random.RandomState(seed).permutation(batch * per_seq)
    table = np.empty(batch * per_seq, np.int32)
    table[order] = np.arange(batch * per_seq, dtype=np.int32)  # page of block i: where block i was moved to
    pool = x.reshape((batch * per_seq, page_size, *x.shape[2:]))[jnp.asarray(order)]
    return pool, jnp.asarray(table.reshape(batch, per_seq))


def _implementations(k, v, causal: bool, page_sizes, seed: int):
    """(name -> fn(q, ks, vs), ks, vs): fn of the contiguous cache, of each paged one and of cuDNN, each reading its
    own cache from the dicts ks and vs, so that all are timed interleaved on the same arguments."""
    ks, vs = {"contiguous": k}, {"contiguous": v}
    impls = {"jax_flash": lambda q, ks, vs: jax_flash.attention(q, ks["contiguous"], vs["contiguous"], causal=causal)}
    for page_size in page_sizes:
        if k.shape[1] % page_size:
            continue
        name = f"paged{page_size}"
        ks[name], table = shuffled_pages(k, page_size, seed)
        vs[name], _ = shuffled_pages(v, page_size, seed)
        impls[name] = (lambda q, ks, vs, name=name, table=table:
                       jax_flash.attention(q, ks[name], vs[name], causal=causal, page_table=table))
    impls["cudnn"] = lambda q, ks, vs: jax.nn.dot_product_attention(q, ks["contiguous"], vs["contiguous"],
                                                                    implementation="cudnn")
    return impls, ks, vs


def run(args) -> tuple[list[dict], float]:
    device = jax.devices()[0]
    copy_gbs = copy_bandwidth_gbs()
    print(f"# copy bandwidth: {copy_gbs:.0f} GB/s ({device.device_kind})", file=sys.stderr, flush=True)
    from jax_flash.benchmark import DTYPES

    cases = [(d, h, heads, sq, bk) for d in args.dtypes for h in args.head_dims for heads in args.decode_heads
             for sq in args.decode_seq_q for bk in args.decode_cache]
    rows = []
    for index, (dtype_name, head_dim, (heads_q, heads_k), seq_q, (batch, seq_k)) in enumerate(cases, 1):
        dtype = DTYPES[dtype_name]
        keys = jax.random.split(jax.random.PRNGKey(index), 3)
        q = jax.random.normal(keys[0], (batch, seq_q, heads_q, head_dim), jnp.float32).astype(dtype)
        k = jax.random.normal(keys[1], (batch, seq_k, heads_k, head_dim), jnp.float32).astype(dtype)
        v = jax.random.normal(keys[2], (batch, seq_k, heads_k, head_dim), jnp.float32).astype(dtype)
        kv_bytes = 2 * k.size * k.dtype.itemsize
        causal = seq_q > 1
        print(f"[{index}/{len(cases)}] {dtype_name} D={head_dim} H={heads_q}/{heads_k} Sq={seq_q} B={batch} "
              f"Sk={seq_k}", file=sys.stderr, flush=True)
        impls, ks, vs = _implementations(k, v, causal, args.page_sizes, index)
        times, failures = time_interleaved_ms(impls, q, ks, vs, iters=args.iters, reps=args.reps,
                                              min_rep_ms=args.min_rep_ms)
        results = {}
        for name in impls:
            if name in times:
                us = times[name] * 1e3
                gbs = kv_bytes / (us * 1e-6) / 1e9
                results[name] = {"us": us, "gbs": gbs, "copy_pct": 100 * gbs / copy_gbs}
            elif name in failures:
                error = failures[name]
                print(f"#   {name} failed: {type(error).__name__}: {str(error)[:200]}", file=sys.stderr)
        del impls, ks, vs
        rows.append({"dtype": dtype_name, "head_dim": head_dim, "heads_q": heads_q, "heads_k": heads_k,
                     "seq_q": seq_q, "batch": batch, "seq_k": seq_k, "causal": causal, "kv_bytes": kv_bytes,
                     "device": device.device_kind, "results": results})
    return rows, copy_gbs


def print_table(rows: list[dict], copy_gbs: float) -> None:
    names = []
    for row in rows:
        names += [n for n in row["results"] if n not in names]
    print(f"\nDecode on {rows[0]['device'] if rows else '?'} ({datetime.date.today()}): us | K/V GB/s | % of copy "
          f"bandwidth ({copy_gbs:.0f} GB/s); ratio to cudnn in brackets")
    print(" | ".join(["dtype", "D", "heads", "Sq", "B", "Sk"] + names))
    for row in rows:
        ref = row["results"].get("cudnn", {}).get("us")
        cells = []
        for name in names:
            r = row["results"].get(name)
            ratio = f" ({ref / r['us']:.2f}x)" if r and ref and name != "cudnn" else ""
            cells.append("-" if r is None else f"{r['us']:.0f} | {r['gbs']:.0f} | {r['copy_pct']:.0f}%{ratio}")
        print(" | ".join([row["dtype"], str(row["head_dim"]), f"{row['heads_q']}/{row['heads_k']}",
                          str(row["seq_q"]), str(row["batch"]), str(row["seq_k"])] + cells))
    summarize(rows)


def summarize(rows: list[dict]) -> None:
    """The targets: 85% of copy bandwidth from B x Sk = 32768, >= 1.0x cuDNN, paged within 5% from page size 64."""
    big = [r for r in rows if r["batch"] * r["seq_k"] >= _TARGET_TOKENS and "jax_flash" in r["results"]]
    if big:
        worst = min(big, key=lambda r: r["results"]["jax_flash"]["copy_pct"])
        print(f"# lowest % of copy bandwidth (B x Sk >= {_TARGET_TOKENS}): {worst['results']['jax_flash']['copy_pct']:.0f}% "
              f"({worst['dtype']} D={worst['head_dim']} {worst['heads_q']}/{worst['heads_k']} Sq={worst['seq_q']} "
              f"B={worst['batch']} Sk={worst['seq_k']}); below 85%: "
              f"{sum(r['results']['jax_flash']['copy_pct'] < 85 for r in big)} of {len(big)}")
    ratios = [(r["results"]["cudnn"]["us"] / r["results"]["jax_flash"]["us"], r) for r in rows
              if "cudnn" in r["results"] and "jax_flash" in r["results"]]
    if ratios:
        low, r = min(ratios, key=lambda x: x[0])
        print(f"# ratio to cudnn: lowest {low:.2f}x ({r['heads_q']}/{r['heads_k']} Sq={r['seq_q']} B={r['batch']} "
              f"Sk={r['seq_k']}); below 1.0x: {sum(x < 1.0 for x, _ in ratios)} of {len(ratios)}")
    for name in sorted({n for r in rows for n in r["results"] if n.startswith("paged")}):
        slow = [r["results"][name]["us"] / r["results"]["jax_flash"]["us"] for r in rows
                if name in r["results"] and "jax_flash" in r["results"]]
        if slow:
            print(f"# {name} / contiguous time: median {float(np.median(slow)):.3f}, worst {max(slow):.3f}")


def plot(rows: list[dict], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    groups = sorted({(r["dtype"], r["head_dim"], r["heads_q"], r["heads_k"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4), squeeze=False)
    for ax, (dtype, head_dim, hq, hk) in zip(axes[0], groups):
        sel = [r for r in rows if (r["dtype"], r["head_dim"], r["heads_q"], r["heads_k"]) == (dtype, head_dim, hq, hk)]
        labels = [f"Sq{r['seq_q']} B{r['batch']} S{r['seq_k']}" for r in sel]
        for name in sorted({n for r in sel for n in r["results"]}):
            ax.plot(range(len(sel)), [r["results"].get(name, {}).get("copy_pct", np.nan) for r in sel], marker="o",
                    label=name)
        ax.set_xticks(range(len(sel)), labels, rotation=90, fontsize=6)
        ax.set_ylabel("% of copy bandwidth")
        ax.set_title(f"{dtype} D={head_dim} heads {hq}/{hk}")
        ax.legend(fontsize=7)
    fig.suptitle(f"decode, {rows[0]['device']} {datetime.date.today()}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
