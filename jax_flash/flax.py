"""jax_flash.flax.attention_fn: Flax's attention_fn signature, for nnx.MultiHeadAttention and Linen's
MultiHeadDotProductAttention (`attention_fn=jax_flash.flax.attention_fn`).

It computes what Flax's default attention computes without dropout (which is jax.nn.dot_product_attention), through
jax_flash.dot_product_attention: the module's mask is honoured, as a mask tensor of the kernels (nnx's
`is_causal=True` as their causal mask). Dropout on the attention weights and sown weights need the weights, which a
FlashAttention kernel never forms: they raise.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jax_flash.jax_nn import dot_product_attention


def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None,
                 dropout_rate: float = 0.0, deterministic: bool = False, dtype=None, precision=None, module=None,
                 is_causal: bool = False, force_fp32_for_softmax: bool = False, qk_attn_weights_einsum=None,
                 attn_weights_value_einsum=None):
    """query (batch..., q_length, num_heads, head_dim), key and value (batch..., kv_length, num_kv_heads, head_dim);
    bias and mask broadcastable to (batch..., num_heads, q_length, kv_length), mask True where attention is allowed.
    Returns (batch..., q_length, num_heads, head_dim). Softmax runs in float32 whatever force_fp32_for_softmax says;
    precision is the kernels' own."""
    del broadcast_dropout, dropout_rng, precision, force_fp32_for_softmax
    if dropout_rate > 0 and not deterministic:
        raise ValueError(f"jax_flash.flax.attention_fn has no attention dropout (dropout_rate={dropout_rate!r} with "
                         f"deterministic=False): the kernels never form the attention weights it drops. Use "
                         f"dropout_rate=0.0, or deterministic=True at inference")
    if module is not None:
        raise ValueError("jax_flash.flax.attention_fn cannot sow attention weights (sow_weights=True): the kernels "
                         "never form them")
    if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
        raise ValueError("jax_flash.flax.attention_fn takes no custom attention-weight einsums: the kernels compute "
                         "both products themselves")
    dtype = dtype or jnp.result_type(query, key, value)
    query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    batch_shape = query.shape[:-3]
    if len(batch_shape) != 1:  # jax.nn takes one batch axis: fold the others into it (or add one)
        flat = math.prod(batch_shape)

        def fold(x, rank):
            if x is None:
                return None
            x = jnp.broadcast_to(x, (*batch_shape, *x.shape[len(x.shape) - rank:])) if x.ndim > rank else x
            return x.reshape((flat, *x.shape[len(batch_shape):])) if x.ndim > rank else x[None]

        query, key, value = (fold(x, 3) for x in (query, key, value))
        bias, mask = fold(bias, 3), fold(mask, 3)
    if mask is not None:
        mask = jnp.asarray(mask).astype(jnp.bool_)
    out = dot_product_attention(query, key, value, bias, mask, is_causal=is_causal)
    return out.reshape((*batch_shape, *out.shape[1:]))
