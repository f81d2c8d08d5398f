#!/usr/bin/env python3
"""Digest of an Nsight Compute source-page CSV (SOURCE=1 bash tools/profile/ncu.sh, or tools/ab/run.sh with SOURCE):
per-instruction execution count, samples and top stall reasons; totals by opcode and by stall reason.

    python3 tools/profile/sass_digest.py FILE.csv[.gz] [--listing] [--min-exec N]
"""
import collections, csv, gzip, sys

rows = list(csv.reader((gzip.open if sys.argv[1].endswith(".gz") else open)(sys.argv[1], "rt")))
hdr = rows[1]
col = {h: i for i, h in enumerate(hdr)}
stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
min_exec = int(sys.argv[sys.argv.index("--min-exec") + 1]) if "--min-exec" in sys.argv else 0
by_op, by_stall = collections.Counter(), collections.Counter()
samples_op = collections.Counter()
total_exec = total_samples = 0
for i, r in enumerate(rows[2:]):
    src = r[1].strip()
    ex = int(r[col["Instructions Executed"]] or 0)
    sm = int(r[col["Warp Stall Sampling (All Samples)"]] or 0)
    op = src.split()[0] if src else ""
    if op.startswith("@"):
        op = src.split()[1]
    op = op.split(".")[0]
    by_op[op] += ex
    samples_op[op] += sm
    total_exec += ex
    total_samples += sm
    st = {s: int(r[col[s]] or 0) for s in stalls}
    for s, v in st.items():
        by_stall[s] += v
    if "--listing" in sys.argv and ex >= min_exec:
        top = ", ".join(f"{s[6:]}:{v}" for s, v in sorted(st.items(), key=lambda x: -x[1])[:2] if v)
        print(f"{i:5d} {ex:9d} {sm:6d}  {src[:90]:90s} {top}")
print(f"instructions executed {total_exec}, samples {total_samples}")
print("by opcode (executed, share of samples):")
for op, n in by_op.most_common(25):
    print(f"  {op:10s} {n:10d} {100*n/total_exec:5.1f}%  samples {100*samples_op[op]/total_samples:5.1f}%")
print("by stall reason:")
for s, n in by_stall.most_common(12):
    print(f"  {s:24s} {100*n/total_samples:5.1f}%")
