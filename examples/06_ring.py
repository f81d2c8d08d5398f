"""Long context across devices: the sequence sharded over a mesh axis, attention as a ring of K/V shards.

    python examples/06_ring.py            # on the GPUs of this machine, or on 4 virtual CPU devices without them

1. Under jax.jit, q, k and v sharded along the sequence run ring attention by themselves: each device keeps its
   queries, the K/V shards travel around the mesh axis by collective-permutes, and nothing is all-gathered.
2. Inside shard_map, jax_flash.ring_attention does the same on local shards.
3. jax.grad runs the ring backwards (dK/dV travel with their K/V).
Each result is checked against the same call on one device, and the compiled HLO's collectives are printed.
"""

from __future__ import annotations

import os
import re

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # CPU: 4 virtual devices
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_flash

try:
    from jax import shard_map
except ImportError:  # older jax
    from jax.experimental.shard_map import shard_map


def collectives(jitted, *args) -> list[str]:
    hlo = jitted.lower(*args).compile().as_text()
    return sorted(set(re.findall(r"\b(all-gather|all-to-all|collective-permute|all-reduce)\b", hlo)))


def run(seq: int = 4096, heads: int = 8, head_dim: int = 64, devices=None) -> dict:
    devices = devices or (jax.devices()[:4] if len(jax.devices()) >= 4 else jax.devices())
    n = len(devices)
    dtype = jnp.bfloat16 if devices[0].platform == "gpu" else jnp.float32
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (1, seq, heads, head_dim), dtype) for key in keys)
    lengths = jnp.array([seq - 100], jnp.int32)  # padded self-attention: one array for both lengths

    def attend(q, k, v, lengths):
        return jax_flash.attention(q, k, v, causal=True, q_lengths=lengths, kv_lengths=lengths)

    expected = jax.jit(attend)(q, k, v, lengths)
    mesh = jax.make_mesh((n,), ("sp",), devices=devices)
    sharded = [jax.device_put(x, NamedSharding(mesh, P(None, "sp"))) for x in (q, k, v)]

    # 1. jit over sequence-sharded inputs
    ring = jax.jit(attend)
    out = ring(*sharded, lengths)
    results = {"jit": (float(jnp.max(jnp.abs(out.astype(jnp.float32) - expected.astype(jnp.float32)))),
                       collectives(ring, *sharded, lengths), str(out.sharding.spec))}

    # 2. ring_attention inside shard_map
    local = shard_map(lambda q, k, v, lengths: jax_flash.ring_attention(
        q, k, v, axis_name="sp", causal=True, q_lengths=lengths, kv_lengths=lengths),
        mesh=mesh, in_specs=(P(None, "sp"),) * 3 + (P(),), out_specs=P(None, "sp"))
    out = jax.jit(local)(*sharded, lengths)
    results["shard_map"] = (float(jnp.max(jnp.abs(out.astype(jnp.float32) - expected.astype(jnp.float32)))),
                            collectives(jax.jit(local), *sharded, lengths), str(out.sharding.spec))

    # 3. the gradient, ring backwards
    loss = lambda q, k, v: jnp.sum(attend(q, k, v, lengths).astype(jnp.float32) ** 2)  # noqa: E731
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    want = grad(q, k, v)
    got = grad(*sharded)
    results["grad"] = (max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                           for a, b in zip(got, want)), collectives(grad, *sharded), str(got[1].sharding.spec))
    return {"devices": f"{n} x {devices[0].device_kind}", **results}


def main() -> None:
    results = run()
    print(f"ring attention over {results.pop('devices')}, causal, 4096 tokens:")
    for name, (error, found, spec) in results.items():
        print(f"  {name:10s} max |difference| from one device {error:.2e}; collectives {found}; output sharding {spec}")


if __name__ == "__main__":
    main()
