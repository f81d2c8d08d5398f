#!/usr/bin/env python3
"""One attention call of the benchmark's shapes, for `ncu` (tools/profile/ncu.sh): compiles and runs it twice (the
profiler skips the first launch), nothing else on the GPU.

    python3 tools/profile/ncu_case.py IMPL DTYPE HEAD_DIM SEQ [causal] [backward]
backward: jax.grad of the output's sum instead (the forward, then the backward's kernels).
IMPL: sm80 (the sm80 family's tuned config), sm90 (cfg=None on Hopper), cudnn, or a compiled sm90 config by its
short name: sm90_q128_kv128_st2_wg2_pp1_ov0 (KernelConfig.short_name()).
Sizes as in `python -m jax_flash.benchmark`: batch x seq = 16384 tokens, heads x head_dim = 2048.
"""

import sys

import jax
import jax.numpy as jnp

import jax_flash
from jax_flash.config import TUNED_CONFIGS

impl, dtype, head_dim, seq = sys.argv[1], jnp.dtype(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
causal, backward = "causal" in sys.argv[5:], "backward" in sys.argv[5:]
batch, heads = max(1, 16384 // seq), 2048 // head_dim
q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (batch, seq, heads, head_dim), jnp.float32).astype(dtype)
           for i in range(3))
if impl == "cudnn":
    fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn", is_causal=causal))
else:
    if impl.startswith("sm90_"):
        matches = [k.config for k in jax_flash.supported_configs() if k.config.family == "sm90" and
                   k.dtype == dtype.name and k.head_dim == head_dim and k.config.short_name() == impl[5:]]
        if not matches:
            sys.exit(f"no compiled sm90 config {impl[5:]} for {dtype.name} D={head_dim}")
        cfg = matches[0]
    else:
        cfg = TUNED_CONFIGS[head_dim][0] if impl == "sm80" else None
    fn = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, cfg=cfg, causal=causal))
if backward:
    fn = jax.jit(jax.grad(lambda q, k, v, f=fn: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
for _ in range(2):
    jax.block_until_ready(fn(q, k, v))
print(f"{impl} {dtype.name} D={head_dim} S={seq} B={batch} H={heads} causal={causal} backward={backward}: done")
