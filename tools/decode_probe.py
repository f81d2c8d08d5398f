"""Decode tiles and split counts, forced, timed interleaved beside cfg=None and cuDNN on chosen decode rows.

    python tools/decode_probe.py --rows bf16:128:32/1:1:128x1024,fp16:64:32/8:8:1x32768 \
        [--tiles q32k128w4,q64k64w4,sm90] [--splits 0,1,2] [--page-size 64] [--rounds 2]

A row is dtype:head_dim:heads_q/heads_k:seq_q:batch x seq_k (seq_q > 1: causal; cuDNN runs unmasked, as the decode
suite times it). Each row times cfg=None, cuDNN and every chosen `DECODE_CONFIGS` tile of its head dim (`sm90`: the
sm90 family's first `SM90_CONFIGS` entry, the tile cfg=None packs MQA / GQA calls of more than 64 rows per kv head
into; an empty --tiles: none) at every split count (0: the plan's count), packed where heads_k < heads_q;
--page-size adds cfg=None and the tiles over shuffled pages of that size. One line per round: microseconds per call (chained calls, jax_flash.timing), the
largest difference of any output from cfg=None's, and the implementations that failed.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp

import jax_flash
from jax_flash.benchmark_decode import shuffled_pages
from jax_flash.config import DECODE_CONFIGS, SM90_CONFIGS, KernelConfig
from jax_flash.timing import time_interleaved_ms

DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class Row:
    dtype: str
    head_dim: int
    heads_q: int
    heads_k: int
    seq_q: int
    batch: int
    seq_k: int

    @classmethod
    def parse(cls, text: str) -> "Row":
        try:
            dtype, head_dim, heads, seq_q, cache = text.split(":")
            heads_q, heads_k = heads.split("/")
            batch, seq_k = cache.split("x")
            row = cls(dtype, int(head_dim), int(heads_q), int(heads_k), int(seq_q), int(batch), int(seq_k))
        except ValueError:
            raise SystemExit(f"--rows: {text!r} is not dtype:head_dim:heads_q/heads_k:seq_q:batchxseq_k "
                             "(e.g. bf16:128:32/8:1:8x16384)") from None
        if dtype not in DTYPES:
            raise SystemExit(f"--rows: dtype {dtype!r} is not one of {sorted(DTYPES)}")
        return row

    def __str__(self) -> str:
        return (f"{self.dtype} D{self.head_dim} {self.heads_q}/{self.heads_k} Sq{self.seq_q} "
                f"{self.batch}x{self.seq_k}")


def tile_name(cfg: KernelConfig) -> str:
    return f"q{cfg.block_q}k{cfg.block_kv}w{cfg.num_warps}"


def tiles_of(head_dim: int) -> dict[str, KernelConfig]:
    """The tiles --tiles can name for a head dim: its decode tiles by qBkKwW name, and `sm90`."""
    tiles = {tile_name(c): c for c in DECODE_CONFIGS.get(head_dim, ())}
    if head_dim in SM90_CONFIGS:
        tiles["sm90"] = SM90_CONFIGS[head_dim][0]
    return tiles


def implementations(row: Row, tiles: dict[str, KernelConfig], splits: list[int], page_size: int, seed: int = 0):
    """(name -> fn(q, ks, vs), q, ks, vs) for one row: cfg=None, cuDNN, each named tile at each split count, and over
    shuffled pages of page_size keys when page_size > 0."""
    dtype = DTYPES[row.dtype]
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(kq, (row.batch, row.seq_q, row.heads_q, row.head_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (row.batch, row.seq_k, row.heads_k, row.head_dim), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (row.batch, row.seq_k, row.heads_k, row.head_dim), jnp.float32).astype(dtype)
    causal = row.seq_q > 1
    ks, vs, tables = {"": k}, {"": v}, {"": None}
    if page_size > 0:
        ks["p"], tables["p"] = shuffled_pages(k, page_size, seed)
        vs["p"], _ = shuffled_pages(v, page_size, seed)

    def call(cache: str, cfg: KernelConfig | None):
        return lambda q, ks, vs: jax_flash.attention(q, ks[cache], vs[cache], cfg, causal=causal,
                                                     page_table=tables[cache])

    fns = {"none": call("", None),
           "cudnn": lambda q, ks, vs: jax.nn.dot_product_attention(q, ks[""], vs[""], implementation="cudnn")}
    if page_size > 0:
        fns[f"none_p{page_size}"] = call("p", None)
    for name, tile in tiles.items():
        for count in splits:
            cfg = dataclasses.replace(tile, pack_gqa=row.heads_k < row.heads_q, num_splits=count)
            fns[f"{name}s{count}"] = call("", cfg)
            if page_size > 0:
                fns[f"{name}s{count}_p{page_size}"] = call("p", cfg)
    return fns, q, ks, vs


def probe(row: Row, tiles: dict[str, KernelConfig], splits: list[int], page_size: int, rounds: int, iters: int,
          reps: int, min_rep_ms: float) -> list[str]:
    """One printed line per round for the row (also returned)."""
    fns, q, ks, vs = implementations(row, tiles, splits, page_size)
    outputs = {}
    for name, fn in fns.items():
        if name == "cudnn":
            continue
        try:
            outputs[name] = jnp.asarray(fn(q, ks, vs), jnp.float32)
        except Exception:  # reported by the timing below, which runs it again
            pass
    diff = float("nan")  # (cfg=None failed: nothing to compare with)
    if "none" in outputs:
        diff = max(float(jnp.max(jnp.abs(out - outputs["none"]))) for out in outputs.values())
    lines = []
    for r in range(rounds):
        times, failures = time_interleaved_ms(fns, q, ks, vs, iters=iters, reps=reps, min_rep_ms=min_rep_ms)
        line = f"{row} r{r} maxdiff {diff:.4f}: " + " ".join(f"{n}={ms * 1e3:.1f}" for n, ms in times.items())
        if failures:
            line += "  failed: " + ", ".join(f"{n} ({type(e).__name__})" for n, e in failures.items())
        print(line, flush=True)
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", required=True, help="comma-separated dtype:head_dim:heads_q/heads_k:seq_q:BxSk")
    parser.add_argument("--tiles", default="all",
                        help="comma-separated qBkKwW names of DECODE_CONFIGS and sm90, all (the decode tiles), or ''")
    parser.add_argument("--splits", default="0", help="comma-separated forced split counts (0: the plan's)")
    parser.add_argument("--page-size", type=int, default=0, help="also time over shuffled pages of this size")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--min-rep-ms", type=float, default=10.0)
    args = parser.parse_args(argv)
    rows = [Row.parse(text) for text in args.rows.split(",")]
    splits = [int(s) for s in args.splits.split(",")]
    if args.tiles == "" and splits != [0]:
        raise SystemExit(f"--splits {args.splits} forces counts on the chosen tiles, and --tiles '' chooses none; "
                         "name the tiles (all, or qBkKwW names and sm90)")
    print("device", jax.devices()[0].device_kind, flush=True)
    lines = []
    for row in rows:
        available = tiles_of(row.head_dim)
        decode_tiles = [n for n in available if n != "sm90"]
        names = decode_tiles if args.tiles == "all" else [n for n in args.tiles.split(",") if n]
        unknown = [n for n in names if n not in available]
        if unknown:
            raise SystemExit(f"--tiles: {unknown} are not decode tiles of head dim {row.head_dim}; "
                             f"choose from {sorted(available)}")
        lines += probe(row, {n: available[n] for n in names}, splits, args.page_size, args.rounds, args.iters,
                       args.reps, args.min_rep_ms)
    return lines


if __name__ == "__main__":
    main()
