#!/usr/bin/env python3
"""Writes the README's benchmark tables from benchmarks/results/<device>.json (one current file per device).

    python3 tools/readme_table.py            # rewrite the block between the README's benchmark markers
    python3 tools/readme_table.py --check    # exit 1 if the README's tables differ from the results files

A results file is `python -m jax_flash.benchmark --json` output (device, date, jax, timing, rows); each GPU table cell
is jax_flash's TFLOP/s and, in brackets, its ratio to cuDNN in the same run; each CPU table cell (platform "cpu") its
GFLOP/s and its speed-up over XLA:CPU in the same run; a decode file (suite "decode") gives microseconds, the percent
of the device's copy bandwidth and the ratio to cuDNN, contiguous and paged; a ring file (suite "ring")
milliseconds and speed-ups over one device of ring attention, the gather and a batch split; a short file (suite
"short") TFLOP/s per model shape beside cuDNN; a softcap file (`--softcap`) the soft-capped call beside the same call
without it and cuDNN without it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BEGIN, END = "<!-- benchmark tables: tools/readme_table.py -->", "<!-- end of benchmark tables -->"
SEQS = (512, 1024, 2048, 4096, 8192, 16384)
CPU_SEQS = (256, 512, 1024, 2048, 4096, 8192, 16384)


def _cell(row: dict | None, name: str = "jax_flash", ratio: bool = True) -> str:
    if row is None or name not in row["results"]:
        return "-"
    tflops = row["results"][name]["tflops"]
    ref = row["results"].get("cudnn", {}).get("tflops")
    return f"{tflops:.0f}" + (f" ({tflops / ref:.2f}x)" if ratio and ref else "")


def render_device(results: dict) -> str:
    rows = results["rows"]
    groups = sorted({(r["dtype"], r["head_dim"], r["causal"]) for r in rows})
    # forward: the other GPU family at 16384 keys; backward / both: the deterministic backward there
    other = "jax_flash_deterministic" if results.get("pass", "forward") != "forward" else "jax_flash_sm80"
    other_head = "deterministic 16384" if other == "jax_flash_deterministic" else "sm80 16384"
    what = {"forward": "", "backward": "'s backward", "both": "'s forward + backward"}[results.get("pass", "forward")]
    head = ["dtype", "D", "causal"] + [f"S={s}" for s in SEQS] + ["cuDNN 16384", other_head]
    lines = [f"**{results['device']}**, {results['date']}, jax {results['jax']}: TFLOP/s of `jax_flash.attention`"
             f"{what} (cfg=None), ratio to cuDNN in the same run in brackets; cuDNN and "
             f"{'deterministic=True' if other == 'jax_flash_deterministic' else 'the sm80 family'} at 16384 keys." +
             (f" {results['note']}." if results.get("note") else ""),
             "", "| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for dtype, head_dim, causal in groups:
        by_seq = {r["seq"]: r for r in rows if (r["dtype"], r["head_dim"], r["causal"]) == (dtype, head_dim, causal)}
        last = by_seq.get(SEQS[-1])
        cells = [dtype, str(head_dim), "yes" if causal else "no"] + [_cell(by_seq.get(s)) for s in SEQS]
        cells += [_cell(last, "cudnn", ratio=False), _cell(last, other, ratio=False)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cpu_cell(row: dict | None) -> str:
    if row is None or "jax_flash" not in row["results"]:
        return "-"
    mine = row["results"]["jax_flash"]
    xla = row["results"].get("xla")
    return f"{mine['tflops'] * 1e3:.0f}" + (f" ({xla['ms'] / mine['ms']:.1f}x)" if xla else "")


def render_cpu(results: dict) -> str:
    rows = results["rows"]
    groups = sorted({(r["dtype"], r["head_dim"], r["causal"]) for r in rows})
    head = ["dtype", "D", "causal"] + [f"S={s}" for s in CPU_SEQS]
    xla_max = max((r["seq"] for r in rows if "xla" in r["results"]), default=0)
    lines = [f"**{results['device']}**, {results['date']}, jax {results['jax']}: GFLOP/s of `jax_flash.attention` "
             f"(cfg=None) on CPU, speed-up over XLA:CPU (`jax.nn.dot_product_attention`) in the same run in brackets "
             f"(XLA up to {xla_max} keys); the machine's fp32 matmul (numpy): {results['matmul_gflops']:.0f} GFLOP/s.",
             "", "| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for dtype, head_dim, causal in groups:
        by_seq = {r["seq"]: r for r in rows if (r["dtype"], r["head_dim"], r["causal"]) == (dtype, head_dim, causal)}
        cells = [dtype, str(head_dim), "yes" if causal else "no"] + [_cpu_cell(by_seq.get(s)) for s in CPU_SEQS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_decode(results: dict) -> str:
    rows = results["rows"]
    pages = sorted({int(n[5:]) for r in rows for n in r["results"] if n.startswith("paged")})
    head = (["dtype", "D", "heads", "Sq", "B", "Sk", "us", "% copy", "vs cuDNN"] + [f"paged {p} us" for p in pages] +
            ["cuDNN us"])
    lines = [f"**{results['device']}**, {results['date']}, jax {results['jax']}, decode: microseconds per call of "
             f"`jax_flash.attention` (cfg=None) on a contiguous cache, its K/V read rate as a percent of the device's "
             f"copy bandwidth in the same run ({results['copy_gbs']:.0f} GB/s), its speed-up over cuDNN, and on paged "
             f"caches (shuffled pages)." + (f" {results['note']}." if results.get("note") else ""),
             "", "| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for r in rows:
        mine, cudnn = r["results"].get("jax_flash"), r["results"].get("cudnn")
        cells = [r["dtype"], str(r["head_dim"]), f"{r['heads_q']}/{r['heads_k']}", str(r["seq_q"]), str(r["batch"]),
                 str(r["seq_k"]), f"{mine['us']:.0f}" if mine else "-", f"{mine['copy_pct']:.0f}%" if mine else "-",
                 f"{cudnn['us'] / mine['us']:.2f}x" if mine and cudnn else "-"]
        cells += [f"{r['results'][f'paged{p}']['us']:.0f}" if f"paged{p}" in r["results"] else "-" for p in pages]
        cells.append(f"{cudnn['us']:.0f}" if cudnn else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_ring(results: dict) -> str:
    rows = results["rows"]
    counts = sorted({r["devices"] for r in rows if r["devices"] > 1})
    head = ["rows", "causal", "B x S", "1 device ms"]
    for n in counts:
        head += [f"{n} GPUs: ring", f"{n} GPUs: gather"] if any(r["kind"] == "sequence" for r in rows) else []
    head += [f"{n} GPUs: batch split" for n in counts]
    first = rows[0]
    lines = [f"**{results['device_count']} x {results['device']}**, {results['date']}, jax {results['jax']}, "
             f"{first['dtype']}, {first['heads']} heads, D = {first['head_dim']}: milliseconds per call of the global "
             f"`jax_flash.attention` call and, in brackets, the speed-up over one device: the sequence sharded over n "
             f"GPUs (ring attention), the same inputs all-gathered first (the fallback), and a global batch split over "
             f"n GPUs." + (f" {results['note']}" if results.get("note") else ""), "", "| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]

    def cell(match):
        r = next((r for r in rows if all(r[k] == v for k, v in match.items())), None)
        return "-" if r is None else f"{r['ms']:.1f}" + (f" ({r['speedup']:.2f}x)" if r["speedup"] else "")

    for kind, batch, seq, causal in sorted({(r["kind"], r["batch"], r["seq"], r["causal"]) for r in rows},
                                           key=lambda x: (x[0] != "sequence", x[1], x[2], x[3])):
        base = dict(kind=kind, batch=batch, seq=seq, causal=causal)
        cells = ["sequence" if kind == "sequence" else "batch", "yes" if causal else "no", f"{batch} x {seq}",
                 cell(dict(base, devices=1))]
        for n in counts:
            if any(r["kind"] == "sequence" for r in rows):
                cells += [cell(dict(base, devices=n, impl="ring")), cell(dict(base, devices=n, impl="gather"))]
        cells += [cell(dict(base, devices=n, impl="batch")) for n in counts]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_fp8(results: dict) -> str:
    """FP8 rows (--dtypes fp8): jax_flash on float8_e4m3fn inputs beside jax_flash and cuDNN on the same values in
    bfloat16."""
    fp8_cudnn = any("cudnn_fp8" in r["results"] for r in results["rows"])
    head = ["D", "causal", "S", "B x H", "FP8 TFLOP/s (vs cuDNN bf16)", "vs jax_flash bf16", "jax_flash bf16",
            "cuDNN bf16"] + (["cuDNN FP8"] if fp8_cudnn else [])
    lines = [f"**{results['device']}**, {results['date']}, jax {results['jax']}, FP8: TFLOP/s of `jax_flash.attention`"
             f" on float8_e4m3fn q, k, v (cfg=None) beside `jax_flash.attention` and cuDNN on the same values in "
             f"bfloat16" + (" and cuDNN's FP8 attention (ours over it in brackets)" if fp8_cudnn else "") +
             ", in the same run." + (f" {results['note']}" if results.get("note") else ""),
             "", "| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for r in sorted(results["rows"], key=lambda r: (r["head_dim"], r["causal"], r["seq"])):
        res = r["results"]
        ours, bf16, cudnn = (res.get(n, {}).get("tflops") for n in ("jax_flash", "jax_flash_bf16", "cudnn_bf16"))
        cells = [str(r["head_dim"]), "yes" if r["causal"] else "no", str(r["seq"]), f"{r['batch']} x {r['heads']}",
                 "-" if ours is None else f"{ours:.0f}" + (f" ({ours / cudnn:.2f}x)" if cudnn else ""),
                 f"{ours / bf16:.2f}x" if ours and bf16 else "-",
                 "-" if bf16 is None else f"{bf16:.0f}", "-" if cudnn is None else f"{cudnn:.0f}"]
        if fp8_cudnn:
            cudnn_fp8 = res.get("cudnn_fp8", {}).get("tflops")
            cells.append("-" if cudnn_fp8 is None else f"{cudnn_fp8:.0f} ({ours / cudnn_fp8:.2f}x)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_softcap(results: dict) -> str:
    """--softcap rows: jax_flash with the softcap beside jax_flash and cuDNN without it (jax.nn takes no softcap)."""
    head = ["dtype", "D", "causal", "S", "B x H", "softcap TFLOP/s (vs cuDNN)", "over no softcap", "no softcap",
            "cuDNN"]
    lines = [f"**{results['device']}**, {results['date']}, jax {results['jax']}, softcap {results['softcap']:g}: "
             f"TFLOP/s of `jax_flash.attention` (cfg=None) with the softcap, beside the same call without it and cuDNN "
             f"without it, in the same run." + (f" {results['note']}" if results.get("note") else ""),
             "", "| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for r in sorted(results["rows"], key=lambda r: (r["dtype"], r["head_dim"], r["causal"], r["seq"])):
        res = r["results"]
        capped, plain, cudnn = (res.get(n, {}).get("tflops") for n in ("jax_flash_softcap", "jax_flash", "cudnn"))
        cells = [r["dtype"], str(r["head_dim"]), "yes" if r["causal"] else "no", str(r["seq"]),
                 f"{r['batch']} x {r['heads']}",
                 "-" if capped is None else f"{capped:.0f}" + (f" ({capped / cudnn:.2f}x)" if cudnn else ""),
                 f"{capped / plain:.2f}x" if capped and plain else "-",
                 "-" if plain is None else f"{plain:.0f}", "-" if cudnn is None else f"{cudnn:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_short(results: dict) -> str:
    rows = results["rows"]
    head = ["model", "dtype", "B x S x H x D", "causal", "jax_flash TFLOP/s (vs cuDNN)", "cuDNN TFLOP/s"]
    lines = [f"**{results['device']}**, {results['date']}, jax {results['jax']}, short sequences: TFLOP/s of "
             f"`jax_flash.attention` (cfg=None), ratio to cuDNN in the same run in brackets.",
             "", "| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for r in rows:
        cells = [r.get("model", "-"), r["dtype"], f"{r['batch']} x {r['seq']} x {r['heads']} x {r['head_dim']}",
                 "yes" if r["causal"] else "no", _cell(r), _cell(r, "cudnn", ratio=False)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_packed(results: dict) -> str:
    rows = results["rows"]
    names = [n for n in ("packed", "unpacked", "cudnn", "xla", "pallas") if any(n in r["results"] for r in rows)]
    head = ["dtype", "tokens", "mean document", "documents"] + names
    first = rows[0]
    dense = " / ".join(n for n, shown in (("cuDNN", "cudnn" in names), ("XLA", "xla" in names)) if shown)
    lines = [f"**{results['device']}**, {results['date']}, jax {results['jax']}, packed causal rows, {first['heads']} "
             f"heads, D = {first['head_dim']}, {first.get('pass', 'forward')}: TFLOP/s over visible pairs of "
             f"documents packed by segment ids, the same documents unpacked, " +
             ("" if "pallas" in names else "and ") + f"{dense} given the equivalent dense mask" +
             (", and Pallas's Triton attention given the segment ids" if "pallas" in names else "") +
             "; packed / unpacked in brackets.", "", "| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for r in rows:
        res, unpacked = r["results"], r["results"].get("unpacked", {}).get("tflops")
        cells = [r["dtype"], str(r["tokens"]), str(r["mean"]), str(r["documents"])]
        for n in names:
            v = res.get(n)
            ratio = f" ({v['tflops'] / unpacked:.2f}x)" if v and unpacked and n == "packed" else ""
            cells.append("-" if v is None else f"{v['tflops']:.0f}{ratio}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_tensors(results: dict) -> str:
    rows = results["rows"]
    head = ["dtype", "B x S", "tensor", "jax_flash (vs cuDNN)", "jax_flash without it", "cuDNN"]
    first = rows[0]
    pass_ = first.get("pass", "forward")
    lines = [f"**{results['device']}**, {results['date']}, jax {results['jax']}, bias and mask tensors, "
             f"{first['heads']} heads, D = {first['head_dim']}, {pass_}: TFLOP/s over the visible pairs of "
             f"`jax_flash.attention` given the tensor, the same call without it (`causal=True` for the causal mask, "
             f"`kv_lengths` for the padding mask), and cuDNN given the same tensor (for `alibi_slopes`, the bias tensor "
             f"they stand for).", "", "| " + " | ".join(head) + " |",
             "| " + " | ".join("---" for _ in head) + " |"]
    for r in rows:
        res = r["results"]
        ours, cudnn = res.get("jax_flash"), res.get("cudnn")
        without = next((v for n, v in res.items() if n not in ("jax_flash", "cudnn")), None)
        ratio = f" ({ours['tflops'] / cudnn['tflops']:.2f}x)" if ours and cudnn else ""
        cells = [r["dtype"], f"{r['batch']} x {r['seq']}", r["case"],
                 "-" if ours is None else f"{ours['tflops']:.0f}{ratio}",
                 "-" if without is None else f"{without['tflops']:.0f}",
                 "-" if cudnn is None else f"{cudnn['tflops']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render() -> str:
    files = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
    results = [json.loads(f.read_text()) for f in files]
    renderers = {"cpu": render_cpu, "decode": render_decode, "ring": render_ring, "short": render_short,
                 "packed": render_packed, "tensors": render_tensors}
    suites = ("decode", "ring", "short", "packed", "tensors")
    def renderer(r):
        if r["rows"] and all(row["dtype"] == "fp8" for row in r["rows"]):
            return render_fp8
        if r.get("softcap"):
            return render_softcap
        return renderers.get(r["suite"] if r.get("suite") in suites else r.get("platform"), render_device)
    return "\n".join(renderer(r)(r) for r in results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    text = README.read_text()
    if BEGIN not in text or END not in text:
        print(f"README.md has no benchmark markers ({BEGIN} ... {END})")
        return 1
    before, rest = text.split(BEGIN, 1)
    _, after = rest.split(END, 1)
    new = before + BEGIN + "\n" + render() + END + after
    if args.check:
        if new != text:
            print("README.md's benchmark tables differ from benchmarks/results/: run tools/readme_table.py")
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
