"""A flax.nnx attention module backed by jax_flash, in a small decoder-only transformer.

    pip install '.[examples]' && python examples/02_flax_module.py

The model runs a jitted, batched prefill (causal, GQA, optional sliding window) twice: once with jax_flash.attention
and once with Flax's default attention (nnx.dot_product_attention with an explicit mask), on the same parameters.
It checks that the logits agree and prints both timings.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from flax import nnx

import jax_flash

_List = getattr(nnx, "List", list)  # newer flax wants nnx.List for lists of submodules


def causal_window_mask(seq: int, window: tuple[int, int] | None):
    """(1, 1, S, S) bool: causal, and within `window` = (left, right) of the diagonal when given (-1 = unbounded)."""
    i, j = jnp.arange(seq)[:, None], jnp.arange(seq)[None, :]
    mask = j <= i
    if window is not None and window[0] >= 0:
        mask &= j >= i - window[0]
    return mask[None, None]


class FlashAttention(nnx.Module):
    """Multi-head attention with grouped KV heads (GQA), causal, optional sliding window.

    use_flash=True runs jax_flash.attention; False runs Flax's default attention on the same projections, so one
    parameter set can be checked against the other.
    """

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, *, window: tuple[int, int] | None = None,
                 use_flash: bool = True, dtype=jnp.bfloat16, rngs: nnx.Rngs):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = d_model // num_heads
        self.window, self.use_flash, self.dtype = window, use_flash, dtype
        self.q_proj = nnx.Linear(d_model, num_heads * self.head_dim, use_bias=False, rngs=rngs)
        self.k_proj = nnx.Linear(d_model, num_kv_heads * self.head_dim, use_bias=False, rngs=rngs)
        self.v_proj = nnx.Linear(d_model, num_kv_heads * self.head_dim, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(num_heads * self.head_dim, d_model, use_bias=False, rngs=rngs)

    def __call__(self, x):  # x (B, S, d_model)
        batch, seq, _ = x.shape
        q = self.q_proj(x).reshape(batch, seq, self.num_heads, self.head_dim).astype(self.dtype)
        k = self.k_proj(x).reshape(batch, seq, self.num_kv_heads, self.head_dim).astype(self.dtype)
        v = self.v_proj(x).reshape(batch, seq, self.num_kv_heads, self.head_dim).astype(self.dtype)
        if self.use_flash:
            window = None if self.window is None else (self.window[0], -1)
            out = jax_flash.attention(q, k, v, causal=True, window=window)  # (B, S, H, D)
        else:
            group = self.num_heads // self.num_kv_heads
            k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
            out = nnx.dot_product_attention(q, k, v, mask=causal_window_mask(seq, self.window))
        return self.o_proj(out.reshape(batch, seq, -1).astype(x.dtype))


class Block(nnx.Module):
    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, window, *, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(d_model, rngs=rngs)
        self.attn = FlashAttention(d_model, num_heads, num_kv_heads, window=window, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(d_model, rngs=rngs)
        self.up = nnx.Linear(d_model, 4 * d_model, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(4 * d_model, d_model, use_bias=False, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))


class Decoder(nnx.Module):
    """A decoder-only transformer: embedding, pre-norm blocks, tied output projection."""

    def __init__(self, vocab: int, d_model: int, num_layers: int, num_heads: int, num_kv_heads: int,
                 window=None, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d_model, rngs=rngs)
        self.blocks = _List([Block(d_model, num_heads, num_kv_heads, window, rngs=rngs) for _ in range(num_layers)])
        self.norm = nnx.RMSNorm(d_model, rngs=rngs)

    def __call__(self, tokens):  # tokens (B, S) int32 -> logits (B, S, vocab)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.norm(x))

    def use_flash(self, flag: bool) -> None:
        for block in self.blocks:
            block.attn.use_flash = flag


@nnx.jit
def prefill(model: Decoder, tokens):
    return model(tokens)


def run(*, small: bool) -> dict:
    """Builds the model, runs the jitted prefill with both attentions, returns the comparison and timings."""
    if small:
        vocab, d_model, layers, heads, kv_heads, batch, seq, window = 97, 128, 2, 4, 2, 2, 96, (32, 0)
    else:
        vocab, d_model, layers, heads, kv_heads, batch, seq, window = 32000, 2048, 8, 16, 4, 4, 4096, (1024, 0)
    model = Decoder(vocab, d_model, layers, heads, kv_heads, window, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, seq), 0, vocab)
    results = {}
    for name, flag in (("jax_flash", True), ("flax default", False)):
        model.use_flash(flag)
        logits = prefill(model, tokens).block_until_ready()  # compile + run
        start = time.perf_counter()
        for _ in range(3):
            logits = prefill(model, tokens)
        logits.block_until_ready()
        results[name] = (logits.astype(jnp.float32), (time.perf_counter() - start) / 3 * 1e3)
    a, b = results["jax_flash"][0], results["flax default"][0]
    rel = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
    return {"relative_max_diff": rel, "ms": {k: v[1] for k, v in results.items()}, "shape": (batch, seq, vocab)}


def main() -> None:
    small = jax.default_backend() == "cpu"
    result = run(small=small)
    print(f"device: {jax.devices()[0].device_kind}  prefill logits {result['shape']}")
    print(f"max |logits(jax_flash) - logits(flax default)| / max |logits| = {result['relative_max_diff']:.2e}")
    for name, ms in result["ms"].items():
        print(f"{name:>13}: {ms:.2f} ms per jitted prefill")
    assert result["relative_max_diff"] < 3e-2, "jax_flash and Flax's default attention disagree"


if __name__ == "__main__":
    main()
