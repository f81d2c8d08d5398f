"""Training a small flax.nnx decoder with jax_flash.attention: jax.grad goes through the attention primitive's own
differentiation rules (its backward custom call), no custom_vjp.

    pip install '.[examples]' && python examples/05_train.py

A next-token task on synthetic sequences (each sequence counts up from a random start, modulo the vocabulary), with
causal GQA attention. The same model, from the same initial parameters, trains twice: with jax_flash.attention and
with Flax's default attention; the loss curves must agree. On a GPU it also times a training step beside cuDNN
(jax.nn.dot_product_attention).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_flash

_List = getattr(nnx, "List", list)  # newer flax wants nnx.List for lists of submodules


class Attention(nnx.Module):
    """Causal GQA self-attention; impl "jax_flash", "flax" (Flax's default attention with a causal mask) or "cudnn"."""

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, *, rngs: nnx.Rngs):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, d_model // num_heads
        self.q_proj = nnx.Linear(d_model, d_model, use_bias=False, rngs=rngs)
        self.kv_proj = nnx.Linear(d_model, 2 * num_kv_heads * self.head_dim, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(d_model, d_model, use_bias=False, rngs=rngs)
        self.impl = "jax_flash"

    def __call__(self, x, dtype):
        batch, seq, _ = x.shape
        q = self.q_proj(x).reshape(batch, seq, self.num_heads, self.head_dim).astype(dtype)
        k, v = jnp.split(self.kv_proj(x).reshape(batch, seq, 2 * self.num_kv_heads, self.head_dim).astype(dtype), 2,
                         axis=2)
        if self.impl == "jax_flash":
            out = jax_flash.attention(q, k, v, causal=True)
        elif self.impl == "cudnn":
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        else:
            group = self.num_heads // self.num_kv_heads
            mask = jnp.tril(jnp.ones((seq, seq), bool))[None, None]
            out = nnx.dot_product_attention(q, jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2), mask=mask)
        return self.o_proj(out.reshape(batch, seq, -1).astype(x.dtype))


class Decoder(nnx.Module):
    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, kv_heads: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d_model, rngs=rngs)
        self.norms = _List([nnx.RMSNorm(d_model, rngs=rngs) for _ in range(2 * layers)])
        self.attns = _List([Attention(d_model, heads, kv_heads, rngs=rngs) for _ in range(layers)])
        self.ups = _List([nnx.Linear(d_model, 4 * d_model, rngs=rngs) for _ in range(layers)])
        self.downs = _List([nnx.Linear(4 * d_model, d_model, rngs=rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(d_model, rngs=rngs)

    def __call__(self, tokens, dtype):
        x = self.embed(tokens)
        for i, attn in enumerate(self.attns):
            x = x + attn(self.norms[2 * i](x), dtype)
            x = x + self.downs[i](jax.nn.gelu(self.ups[i](self.norms[2 * i + 1](x))))
        return self.embed.attend(self.norm(x))

    def use(self, impl: str) -> None:
        for attn in self.attns:
            attn.impl = impl


def batches(vocab: int, batch: int, seq: int, seed: int = 0):
    """Endless (inputs, targets): sequences counting up from a random start, modulo vocab."""
    rng = np.random.RandomState(seed)
    while True:
        start = rng.randint(0, vocab, (batch, 1))
        tokens = (start + np.arange(seq + 1)[None, :]) % vocab
        yield jnp.asarray(tokens[:, :-1], jnp.int32), jnp.asarray(tokens[:, 1:], jnp.int32)


def train(impl: str, *, small: bool, steps: int) -> dict:
    """Loss per step and seconds per step (after the first) of one attention implementation, from seed 0."""
    if small:
        vocab, d_model, layers, heads, kv_heads, batch, seq, dtype = 61, 64, 2, 4, 2, 8, 32, jnp.float32
    else:
        vocab, d_model, layers, heads, kv_heads, batch, seq, dtype = 32000, 1024, 4, 8, 2, 8, 2048, jnp.bfloat16
    model = Decoder(vocab, d_model, layers, heads, kv_heads, rngs=nnx.Rngs(0))
    model.use(impl)
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, inputs, targets):
        def loss_fn(model):
            logits = model(inputs, dtype)
            return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    losses, start = [], None
    for i, (inputs, targets) in zip(range(steps), batches(vocab, batch, seq)):
        losses.append(float(step(model, optimizer, inputs, targets)))
        if i == 0:
            start = time.perf_counter()
    seconds = (time.perf_counter() - start) / max(1, steps - 1)
    return {"losses": np.array(losses), "step_s": seconds}


def main() -> None:
    on_gpu = jax.default_backend() == "gpu"
    steps = 50 if on_gpu else 300
    print(f"device: {jax.devices()[0].device_kind}")
    impls = ("jax_flash", "cudnn") if on_gpu else ("jax_flash", "flax")
    results = {}
    for impl in impls:
        results[impl] = r = train(impl, small=not on_gpu, steps=steps)
        print(f"{impl:>10}: loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f} over {steps} steps, "
              f"{r['step_s'] * 1e3:.1f} ms per step")
    if "flax" in results:
        gap = np.abs(results["jax_flash"]["losses"] - results["flax"]["losses"]).max()
        print(f"largest difference of the two loss curves: {gap:.2e}")
        assert gap < 1e-2, "jax_flash and Flax's default attention trained differently"


if __name__ == "__main__":
    main()
