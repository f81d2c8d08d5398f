"""FP8 attention: bfloat16 q, k, v quantized to float8_e4m3fn with one descale per (batch, kv head), then
jax_flash.attention on them (on Hopper the FP8 kernel, elsewhere the same math on dequantised inputs), against the
bfloat16 call.

    pip install . && python examples/07_fp8.py
"""

import jax
import jax.numpy as jnp

import jax_flash


def run(small: bool = False) -> dict:
    on_gpu = jax.default_backend() == "gpu"
    batch, seq, heads_q, heads_k, head_dim = (2, 4096, 16, 4, 128) if on_gpu and not small else (2, 256, 8, 2, 128)
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(kq, (batch, seq, heads_q, head_dim), jnp.bfloat16)
    k = jax.random.normal(kk, (batch, seq, heads_k, head_dim), jnp.bfloat16)
    v = jax.random.normal(kv, (batch, seq, heads_k, head_dim), jnp.bfloat16)

    q8, q_descale = jax_flash.quantize_fp8(q, heads_k)  # (B, S, Hq, D) e4m3, (B, Hk) float32
    k8, k_descale = jax_flash.quantize_fp8(k)
    v8, v_descale = jax_flash.quantize_fp8(v)
    fp8_call = jax.jit(lambda *a: jax_flash.attention(*a[:3], causal=True, q_descale=a[3], k_descale=a[4],
                                                      v_descale=a[5]))
    out8 = fp8_call(q8, k8, v8, q_descale, k_descale, v_descale)  # bfloat16
    out16 = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, causal=True))(q, k, v)
    error = float(jnp.max(jnp.abs(out8.astype(jnp.float32) - out16.astype(jnp.float32))))
    scale = float(jnp.max(jnp.abs(out16.astype(jnp.float32))))
    return {"shape": q.shape, "dtype": out8.dtype, "max_error": error, "max_abs": scale}


if __name__ == "__main__":
    result = run()
    print(f"device: {jax.devices()[0].device_kind}  q {result['shape']}  output {jnp.dtype(result['dtype']).name}")
    print(f"max |FP8 - bfloat16| = {result['max_error']:.3e} (outputs up to {result['max_abs']:.3f})")
    assert result["max_error"] < 0.1 * result["max_abs"], "the FP8 call strays from the bfloat16 one"
