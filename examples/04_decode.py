"""Greedy decoding with a KV cache: a small flax.nnx decoder generates tokens in one jitted loop whose cache buffers
are donated, with jax_flash.attention over a contiguous cache and over a paged one.

    pip install '.[examples]' && python examples/04_decode.py

The prompt runs as one prefill step (causal over its own rows), then each step appends the new token's keys and
values to the cache and attends its one query row to the cache's first `length` keys (kv_lengths). The same
parameters run with Flax's default attention (an explicit mask over the whole cache), and the greedy tokens must be
identical. On a GPU it prints tokens per second beside cuDNN attention (jax.nn.dot_product_attention), and the cost
of one cache append.

Appending: a contiguous cache (layers, B, max_len, Hk, D) takes the new rows with a dynamic_update_slice at the
current position; a paged cache (layers, num_pages, page_size, Hk, D) with a scatter into row pos % page_size of page
page_table[b, pos // page_size]. Inside the jitted loop (or with the cache donated to a jitted step) XLA updates the
buffer in place: no copy of the cache per token.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_flash

_List = getattr(nnx, "List", list)  # newer flax wants nnx.List for lists of submodules


class Cache(NamedTuple):
    """Keys and values of every layer: contiguous (layers, B, max_len, Hk, D), or paged (layers, num_pages,
    page_size, Hk, D) with page_table (B, max_len / page_size) int32 (None when contiguous)."""

    k: jax.Array
    v: jax.Array
    page_table: jax.Array | None


def append(cache_k, cache_v, page_table, k_new, v_new, pos):
    """Writes k_new, v_new (B, T, Hk, D) at positions pos .. pos + T - 1 of one layer's cache (in place under jit)."""
    if page_table is None:
        return (jax.lax.dynamic_update_slice_in_dim(cache_k, k_new.astype(cache_k.dtype), pos, axis=1),
                jax.lax.dynamic_update_slice_in_dim(cache_v, v_new.astype(cache_v.dtype), pos, axis=1))
    page_size = cache_k.shape[1]
    positions = pos + jnp.arange(k_new.shape[1])                  # (T,)
    pages = page_table[:, positions // page_size]                  # (B, T)
    rows = jnp.broadcast_to(positions % page_size, pages.shape)    # (B, T)
    return (cache_k.at[pages, rows].set(k_new.astype(cache_k.dtype)),
            cache_v.at[pages, rows].set(v_new.astype(cache_v.dtype)))


class Attention(nnx.Module):
    """GQA attention over a KV cache. impl: "jax_flash", "flax" (Flax's default attention, an explicit mask over the
    whole cache) or "cudnn" (jax.nn.dot_product_attention on cuDNN, kv lengths)."""

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, *, rngs: nnx.Rngs):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, d_model // num_heads
        self.q_proj = nnx.Linear(d_model, d_model, use_bias=False, rngs=rngs)
        self.k_proj = nnx.Linear(d_model, num_kv_heads * self.head_dim, use_bias=False, rngs=rngs)
        self.v_proj = nnx.Linear(d_model, num_kv_heads * self.head_dim, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(d_model, d_model, use_bias=False, rngs=rngs)
        self.impl = "jax_flash"

    def __call__(self, x, cache_k, cache_v, page_table, pos):
        """x (B, T, d_model) at positions pos .. pos + T - 1 -> (output, updated cache_k, cache_v)."""
        batch, steps, _ = x.shape
        dtype = cache_k.dtype
        q = self.q_proj(x).reshape(batch, steps, self.num_heads, self.head_dim).astype(dtype)
        k = self.k_proj(x).reshape(batch, steps, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(batch, steps, self.num_kv_heads, self.head_dim)
        cache_k, cache_v = append(cache_k, cache_v, page_table, k, v, pos)
        length = jnp.full((batch,), pos + steps, jnp.int32)  # keys written so far
        if self.impl == "jax_flash":  # causal, bottom-right: row t sees keys <= pos + t
            out = jax_flash.attention(q, cache_k, cache_v, causal=True, kv_lengths=length, page_table=page_table)
        else:
            k_all, v_all = cache_k, cache_v
            if page_table is not None:  # the reference paths read the pages back as a contiguous cache
                k_all, v_all = (jax_flash.reference.gather_pages(c, page_table) for c in (cache_k, cache_v))
            group = self.num_heads // self.num_kv_heads
            if self.impl == "cudnn":
                out = jax.nn.dot_product_attention(q, k_all, v_all, key_value_seq_lengths=length,
                                                   is_causal=steps > 1, implementation="cudnn")
            else:
                key_pos = jnp.arange(k_all.shape[1])[None, :]
                mask = key_pos <= pos + jnp.arange(steps)[:, None]  # (T, max_len): causal, and only written keys
                k_all, v_all = jnp.repeat(k_all, group, axis=2), jnp.repeat(v_all, group, axis=2)
                out = nnx.dot_product_attention(q, k_all, v_all, mask=mask[None, None])
        return self.o_proj(out.reshape(batch, steps, -1).astype(x.dtype)), cache_k, cache_v


class Block(nnx.Module):
    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, *, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(d_model, rngs=rngs)
        self.attn = Attention(d_model, num_heads, num_kv_heads, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(d_model, rngs=rngs)
        self.up = nnx.Linear(d_model, 4 * d_model, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(4 * d_model, d_model, use_bias=False, rngs=rngs)

    def __call__(self, x, cache_k, cache_v, page_table, pos):
        h, cache_k, cache_v = self.attn(self.attn_norm(x), cache_k, cache_v, page_table, pos)
        x = x + h
        return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x)))), cache_k, cache_v


class Decoder(nnx.Module):
    def __init__(self, vocab: int, d_model: int, num_layers: int, num_heads: int, num_kv_heads: int, *,
                 rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d_model, rngs=rngs)
        self.blocks = _List([Block(d_model, num_heads, num_kv_heads, rngs=rngs) for _ in range(num_layers)])
        self.norm = nnx.RMSNorm(d_model, rngs=rngs)

    def __call__(self, tokens, cache: Cache, pos):
        """tokens (B, T) at positions pos .. -> (logits of the last position (B, vocab), updated cache)."""
        x = self.embed(tokens)
        ks, vs = [], []
        for layer, block in enumerate(self.blocks):
            x, k, v = block(x, cache.k[layer], cache.v[layer], cache.page_table, pos)
            ks.append(k)
            vs.append(v)
        logits = self.embed.attend(self.norm(x[:, -1]))
        return logits, Cache(jnp.stack(ks), jnp.stack(vs), cache.page_table)

    def use(self, impl: str) -> None:
        for block in self.blocks:
            block.attn.impl = impl


def empty_cache(model: Decoder, batch: int, max_len: int, dtype, page_size: int | None, seed: int = 0) -> Cache:
    """Zeros; paged: batch * max_len / page_size pages handed out in a shuffled order, as an allocator would."""
    attn = model.blocks[0].attn
    layers, heads, dim = len(model.blocks), attn.num_kv_heads, attn.head_dim
    if page_size is None:
        shape = (layers, batch, max_len, heads, dim)
        return Cache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), None)  # (two buffers: both are donated)
    per_seq = max_len // page_size
    table = np.random.RandomState(seed).permutation(batch * per_seq).reshape(batch, per_seq).astype(np.int32)
    shape = (layers, batch * per_seq, page_size, heads, dim)
    return Cache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.asarray(table))


def make_generate(model: Decoder, steps: int):
    """jit(prompt (B, P), cache) -> (tokens (B, steps), cache): the prefill, then `steps` greedy tokens in a
    fori_loop; the cache is donated, so every append happens in place."""
    graph, state = nnx.split(model)

    def generate(state, prompt, cache):
        model = nnx.merge(graph, state)
        logits, cache = model(prompt, cache, 0)
        first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        tokens = jnp.zeros((prompt.shape[0], steps), jnp.int32).at[:, 0].set(first)

        def step(i, carry):
            tokens, cache = carry
            logits, cache = model(jax.lax.dynamic_slice_in_dim(tokens, i - 1, 1, axis=1), cache,
                                  prompt.shape[1] + i - 1)
            return tokens.at[:, i].set(jnp.argmax(logits, axis=-1).astype(jnp.int32)), cache

        return jax.lax.fori_loop(1, steps, step, (tokens, cache))

    jitted = jax.jit(generate, donate_argnums=(2,))
    return lambda prompt, cache: jitted(state, prompt, cache)


def time_append(cache: Cache, reps: int = 20) -> float:
    """Microseconds of one token's append to one layer's cache (jitted, donated, chained)."""
    k_new = jnp.ones((cache.k.shape[1] if cache.page_table is None else cache.page_table.shape[0], 1,
                      *cache.k.shape[-2:]), cache.k.dtype)
    step = jax.jit(lambda k, v, pos: append(k, v, cache.page_table, k_new, k_new, pos), donate_argnums=(0, 1))
    k, v = jnp.copy(cache.k[0]), jnp.copy(cache.v[0])
    k, v = step(k, v, 0)
    jax.block_until_ready(k)
    start = time.perf_counter()
    for i in range(reps):
        k, v = step(k, v, i + 1)
    jax.block_until_ready(k)
    return (time.perf_counter() - start) / reps * 1e6


def run(*, small: bool, impls=("jax_flash", "flax"), page_size: int | None = None) -> dict:
    """Greedy tokens and tokens per second of each attention implementation on one parameter set."""
    if small:
        vocab, d_model, layers, heads, kv_heads, batch, prompt_len, steps, max_len, dtype = (
            97, 128, 2, 8, 2, 2, 12, 20, 64, jnp.float32)
    else:
        vocab, d_model, layers, heads, kv_heads, batch, prompt_len, steps, max_len, dtype = (
            32000, 2048, 8, 16, 4, 8, 1024, 256, 4096, jnp.bfloat16)
    model = Decoder(vocab, d_model, layers, heads, kv_heads, rngs=nnx.Rngs(0))
    prompt = jax.random.randint(jax.random.PRNGKey(1), (batch, prompt_len), 0, vocab)
    results = {}
    for impl in impls:
        model.use(impl)
        generate = make_generate(model, steps)
        tokens, _ = generate(prompt, empty_cache(model, batch, max_len, dtype, page_size))  # compile + run
        cache = empty_cache(model, batch, max_len, dtype, page_size)
        jax.block_until_ready(cache)
        start = time.perf_counter()
        tokens, cache = generate(prompt, cache)
        tokens = np.asarray(tokens)
        seconds = time.perf_counter() - start
        results[impl] = {"tokens": tokens, "tokens_per_s": batch * steps / seconds}
    results["append_us"] = time_append(empty_cache(model, batch, max_len, dtype, page_size))
    return results


def main() -> None:
    on_gpu = jax.default_backend() == "gpu"
    impls = ("jax_flash", "flax", "cudnn") if on_gpu else ("jax_flash", "flax")
    print(f"device: {jax.devices()[0].device_kind}")
    for page_size in (None, 64):
        layout = "contiguous cache" if page_size is None else f"paged cache, {page_size} keys per page"
        result = run(small=not on_gpu, impls=impls, page_size=page_size)
        for impl in impls:
            print(f"{layout:>32} {impl:>9}: {result[impl]['tokens_per_s']:9.0f} tokens/s")
            same = np.array_equal(result[impl]["tokens"], result["jax_flash"]["tokens"])
            if impl != "jax_flash":
                print(f"{'':>32} greedy tokens identical to jax_flash's: {same}")
        print(f"{'':>32} append of one token's keys and values to one layer: {result['append_us']:.0f} us")


if __name__ == "__main__":
    main()
