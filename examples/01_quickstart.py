"""Quick start: jax_flash.attention under jax.jit on the default device, checked against jax.nn.dot_product_attention.

    pip install . && python examples/01_quickstart.py
"""


import jax
import jax.numpy as jnp

import jax_flash

on_gpu = jax.default_backend() == "gpu"
batch, seq, heads, head_dim = (4, 2048, 16, 128) if on_gpu else (2, 512, 8, 64)
dtype = jnp.bfloat16
kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
q = jax.random.normal(kq, (batch, seq, heads, head_dim), dtype)  # (B, S, H, D)
k = jax.random.normal(kk, (batch, seq, heads, head_dim), dtype)
v = jax.random.normal(kv, (batch, seq, heads, head_dim), dtype)

flash = jax.jit(jax_flash.attention)
out = flash(q, k, v).block_until_ready()
expected = jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
error = float(jnp.max(jnp.abs(out.astype(jnp.float32) - expected)))

_, ms = jax_flash.time_attention(q, k, v)
gflops = 4 * batch * heads * seq * seq * head_dim / ms / 1e6
print(f"device: {jax.devices()[0].device_kind}  shape (B, S, H, D) = {q.shape}  dtype {jnp.dtype(dtype).name}")
print(f"max |jax_flash - jax.nn.dot_product_attention(fp32)| = {error:.2e}")
rate = f"{gflops / 1e3:.1f} TFLOP/s" if on_gpu else f"{gflops:.1f} GFLOP/s"
print(f"jax_flash.attention: {ms:.3f} ms per call ({rate})")
assert error < 5e-2, "jax_flash disagrees with jax.nn.dot_product_attention"
