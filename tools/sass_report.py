#!/usr/bin/env python3
"""Per-kernel SASS summary of the built module: matrix instructions, shared-memory loads, local memory (spills).

    cuobjdump -sass path/to/_jax_flash*.so | python3 tools/sass_report.py
A kernel on the intended path shows HMMA (sm80 family) or HGMMA (sm90 family); LDL/STL inside the KV loop
(between the first and the last matrix instruction) are spills on the hot path.
"""

import re
import sys

text = sys.stdin.read()
rows = []
for block in re.split(r"\n\s+Function : ", text)[1:]:
    name = block.split("\n", 1)[0].strip()
    arch = re.search(r"arch = (sm_\d+a?)", text[:text.find(name)][-400:] or "")
    lines = [line for line in block.split("\n") if re.search(r"/\*[0-9a-f]{4,}\*/", line)]
    mma = [i for i, line in enumerate(lines) if re.search(r"\bH(G)?MMA\b", line)]
    local = [i for i, line in enumerate(lines) if re.search(r"\b(LDL|STL)\b", line)]
    in_loop = [i for i in local if mma and mma[0] <= i <= mma[-1]]
    short = re.sub(r"_ZN9jax_flash4(sm[89]0)16attention_kernelINS0_6TraitsIXtlNS_9KernelKeyE", r"\1:", name)[:70]
    rows.append((short, len(lines), sum("HMMA" in x for x in lines), sum("HGMMA" in x for x in lines),
                 sum("LDSM" in x for x in lines), len(local), len(in_loop)))
print(f"{'kernel (mangled KernelKey, variant)':72} instr  HMMA HGMMA LDSM LDL/STL in-loop")
for r in rows:
    print(f"{r[0]:72} {r[1]:5} {r[2]:5} {r[3]:5} {r[4]:4} {r[5]:7} {r[6]:7}")
