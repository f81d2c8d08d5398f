"""The public attention function: validates inputs with clear errors, then binds the primitive."""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import fp8
from jax_flash._fp8_primitive import attention_fp8_p
from jax_flash._primitive import attention_p, no_lengths, no_segments, no_tensor
from jax_flash._ring import FP8_RING_DEFAULTS, ring_refusal
from jax_flash.config import KernelConfig

_INPUT_DTYPES = ("float16", "bfloat16", "float32")
_MAX_DIM = 2**31 - 1  # the kernels' size fields are int32
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32
_LOG2E = 1.4426950408889634
try:
    _Tracer = jax.core.Tracer
except AttributeError:  # moved out of the public jax.core in newer releases
    from jax._src.core import Tracer as _Tracer


def attention(q, k, v, cfg: KernelConfig | None = None, *, causal: bool = False, softmax_scale: float | None = None,
              window: tuple[int, int] | None = None, softcap: float | None = None, q_lengths=None, kv_lengths=None,
              page_table=None, q_segment_ids=None, kv_segment_ids=None, bias=None, mask=None, alibi_slopes=None,
              return_lse: bool = False, deterministic: bool = False, q_descale=None, k_descale=None, v_descale=None,
              out_dtype=None):
    """FlashAttention forward: softmax(scale * q k^T, masked) v, computed blockwise without the (Sq, Sk) matrix.

    Args:
      q: (batch, seq_q, heads_q, head_dim), float16 or bfloat16 (float32 and float8_e4m3fn also on CPU).
      k, v: (batch, seq_k, heads_k, head_dim), q's dtype; heads_q must be a multiple of heads_k (GQA/MQA: query head
        h reads kv head h // (heads_q // heads_k)). Any seq_q, seq_k >= 0. With page_table: a paged KV cache,
        (num_pages, page_size, heads_k, head_dim), page_size a multiple of 8.
      cfg: a KernelConfig compiled into this build (see supported_configs()), or None for the default of the
        device, dtype and head dim (jax_flash/selection.py).
      causal: query row i sees key j only when j <= i + (seq_k - seq_q): aligned to the bottom-right corner
        (FlashAttention's convention; equals jax.nn's is_causal when seq_q == seq_k).
      softmax_scale: multiplies q.k; default 1 / sqrt(head_dim). Any real number whose magnitude times log2(e) fits
        float32.
      window: (left, right) local window measured from that same diagonal, -1 (or 2^31 and more) = unbounded on that
        side; combines with causal (which caps right at 0).
      softcap: scores become softcap * tanh(scores / softcap) before masking and softmax; a float32 normal number.
      causal, softmax_scale, window, softcap, return_lse, deterministic and cfg are static: each new value compiles a new kernel call
        (mark them static_argnames when you jit attention itself). Numpy scalars and concrete 0-d jax arrays are
        accepted.
      q_lengths, kv_lengths: int32 (batch,) actual lengths (traced: changing them does not recompile). Keys at or
        past kv_lengths[b] are invisible; query rows at or past q_lengths[b] give zeros; causal and window
        alignment use these lengths. Values are clamped to [0, seq].
      page_table: int32 (batch, pages_per_seq) (traced): logical key j of batch row b is row j % page_size of page
        page_table[b, j // page_size] of k and v; seq_k = pages_per_seq * page_size. Entries of keys at or past
        kv_lengths[b] are never read and may hold anything (-1 included). A page id outside [0, num_pages) for a key
        some row sees raises on CPU and reads as zeros on GPU.
      q_segment_ids, kv_segment_ids: int32 (batch, seq_q) and (batch, seq_k), given together (traced): packed
        sequences. Query i sees key j only when q_segment_ids[b, i] == kv_segment_ids[b, j], on top of every other
        mask; causal and window keep measuring positions in the row. Ids need not be sorted or contiguous. Key
        tiles whose ids cannot meet a query tile's are skipped (the CPU path and both GPU families).
      return_lse: also return the float32 (batch, heads_q, seq_q) natural log-sum-exp of the scaled scores.
      deterministic: the GPU backward adds each query block's dQ shares in key-block order instead of with float
        atomics, so gradients repeat bit for bit (slower; the CPU backward always does). Static.
      bias, mask: rank-4 tensors broadcastable to (batch, heads_q, seq_q, seq_k) (each dimension full or 1, as
        jax.nn.dot_product_attention takes them; traced). The bias (any float dtype, used in float32) is added to the
        scaled, soft-capped scores; a False (zero) mask entry hides the key, on top of every other mask. Broadcast
        dimensions are never materialised; key tiles the mask hides entirely are skipped (the CPU path and the sm80
        family; on Hopper the sm90 family skips the key blocks outside the first to last with a visible entry). The
        bias gets a gradient (computed by XLA, O(Sq x Sk) per batch row and head).
      alibi_slopes: float (heads_q,) or (batch, heads_q) (traced): ALiBi, FlashAttention's alibi_slopes. Adds
        -alibi_slopes[b, h] * |i + kv_len - q_len - j| to the scaled, soft-capped scores: zero on the diagonal that
        causal uses (bottom-right, with the lengths), falling linearly with the distance on both sides. The kernels
        compute it per score instead of reading a (1, heads_q, Sq, Sk) bias tensor. Not combined with bias (build
        jax_flash.reference.alibi_bias into the bias instead). The slopes get a gradient (computed by XLA, O(Sq x Sk)
        per batch row and head, as the bias's).
      q_descale, k_descale, v_descale: float8_e4m3fn inputs only: float32 (batch, heads_k) factors (None: 1); the
        call computes attention of q * q_descale, k * k_descale, v * v_descale, each kv head's factor applying to
        its group's query heads; positive (jax_flash/fp8.py). On Hopper at head dims 128 and 256 the FP8 kernel runs
        the call (forward only); other GPU calls run the 16-bit kernels on inputs dequantised to bfloat16.
      out_dtype: float8_e4m3fn inputs only: the output's dtype, bfloat16 (default), float16 or float32.

    Returns:
      out (batch, seq_q, heads_q, head_dim) in q's dtype (out_dtype for FP8), or (out, lse) with return_lse. A row
      that sees no key gives zeros and lse -inf. Works eagerly and under jax.jit/vmap; differentiable (jax.grad,
      jax.jvp, on CPU and GPU: jax_flash/_autodiff.py).
    """
    kwargs = dict(causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap, q_lengths=q_lengths,
                  kv_lengths=kv_lengths, page_table=page_table, q_segment_ids=q_segment_ids,
                  kv_segment_ids=kv_segment_ids, bias=bias, mask=mask, alibi_slopes=alibi_slopes,
                  deterministic=deterministic, ring=None)
    descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    return dispatch(q, k, v, cfg, descales, out_dtype, return_lse, kwargs)


def dispatch(q, k, v, cfg, descales, out_dtype, return_lse, kwargs):
    """attention's call (ring_attention's too, with kwargs["ring"] set): FP8 inputs to their checks and kernel, the
    others to the 16-bit primitive."""
    q, k, v = (_as_array(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    if any(fp8.is_fp8(x) for x in (q, k, v)):
        return _fp8_call(q, k, v, cfg, descales, out_dtype, return_lse, kwargs)
    for name, descale in descales.items():
        if descale is not None:
            raise ValueError(f"{name} applies to float8_e4m3fn inputs only; q has dtype {jnp.dtype(q.dtype).name}")
    fp8.check_out_dtype(out_dtype, fp8=False)
    return _validated_call(q, k, v, cfg, return_lse=return_lse, **kwargs)


def _fp8_call(q, k, v, cfg, descales, out_dtype, return_lse, kwargs):
    """attention of float8_e4m3fn inputs: checked, widened to float32 with the descales folded in (jax_flash/fp8.py),
    computed on the CPU path, the output scaled by v_descale and cast to out_dtype."""
    if not all(fp8.is_fp8(x) for x in (q, k, v)):
        raise TypeError(f"q, k and v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    for name, x in (("q", q), ("k", k)):
        if x.ndim != 4:
            raise ValueError(f"{name} has shape {tuple(x.shape)} (rank {x.ndim}); expected rank 4: "
                             f"(batch, seq, heads, head_dim)")
    out_dtype = fp8.check_out_dtype(out_dtype, fp8=True)
    checked = {name: fp8.check_descale(x, name, q.shape[0], k.shape[2]) for name, x in descales.items()}
    if fp8.on_gpu(q, traced=isinstance(q, _Tracer)):
        # Checked as the same call on bfloat16 inputs would be; then the FP8 kernel, or the 16-bit kernels on the
        # dequantised inputs for what it does not take (fp8.kernel_refusal)
        specs = [jax.ShapeDtypeStruct(x.shape, jnp.bfloat16) for x in (q, k, v)]
        jax.eval_shape(lambda *xs: _validated_call(*xs, cfg, return_lse=return_lse, **kwargs), *specs)
        if fp8.kernel_refusal(q, k, cfg, kwargs) is None:
            return _fp8_kernel_call(q, k, v, cfg, checked, out_dtype, return_lse, kwargs)
        q32, k32, v32, v_scale = fp8.dequantised_inputs(q, k, v, *checked.values(), dtype=jnp.bfloat16)
    else:
        q32, k32, v32, v_scale = fp8.dequantised_inputs(q, k, v, *checked.values())
    result = _validated_call(q32, k32, v32, cfg, return_lse=return_lse, **kwargs)
    out, lse = result if return_lse else (result, None)
    if v_scale is not None:
        out = out * v_scale
    out = out.astype(out_dtype)
    return (out, lse) if return_lse else out


def _fp8_kernel_call(q, k, v, cfg, descales, out_dtype, return_lse, kwargs):
    """The sm90 FP8 kernel's call (jax_flash/_fp8_primitive.py) of checked inputs that it takes."""
    batch, heads_k = q.shape[0], k.shape[2]
    scale = kwargs["softmax_scale"]
    softmax_scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else _static_real(scale, "softmax_scale")
    window_left, window_right = _check_window(kwargs["window"])
    lengths = [_check_lengths(kwargs[name], name, batch) for name in ("q_lengths", "kv_lengths")]
    ones = jnp.ones((batch, heads_k), jnp.float32)
    qk = fp8.scores_descale(descales["q_descale"], descales["k_descale"])
    qk_descale = ones if qk is None else qk
    v_descale = ones if descales["v_descale"] is None else descales["v_descale"]
    params = dict(cfg=None if cfg is None else cfg.kernel(), softmax_scale=float(softmax_scale),
                  causal=_static_bool(kwargs["causal"], "causal"), window_left=window_left, window_right=window_right,
                  has_q_lengths=lengths[0] is not None, has_kv_lengths=lengths[1] is not None,
                  return_lse=bool(return_lse), ring=kwargs.get("ring"),
                  same_lengths=lengths[0] is not None and lengths[0] is lengths[1])
    if params["ring"] is not None:
        reason = ring_refusal({**FP8_RING_DEFAULTS, **params}, q.shape[1], k.shape[1], *params["ring"][1:])
        if reason:
            raise ValueError(f"ring_attention cannot run this call: {reason}")
    out, lse = attention_fp8_p.bind(q, k, v, qk_descale, v_descale,
                                    *(no_lengths() if x is None else x for x in lengths), **params)
    out = out.astype(out_dtype)
    return (out, lse) if return_lse else out


def _validated_call(q, k, v, cfg, *, causal, softmax_scale, window, softcap, q_lengths, kv_lengths, page_table,
                    return_lse, deterministic, ring, q_segment_ids=None, kv_segment_ids=None, bias=None,
                    mask=None, alibi_slopes=None):
    """attention's checks and its primitive's bind; ring (axis names, devices, layout) or None (ring.py)."""
    q, k, v = (_as_array(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} has shape {tuple(x.shape)} (rank {x.ndim}); expected rank 4: "
                             f"(batch, seq, heads, head_dim)")
        if jnp.dtype(x.dtype).name not in _INPUT_DTYPES:
            raise TypeError(f"{name} has dtype {jnp.dtype(x.dtype).name}; supported dtypes are float16 and bfloat16 "
                            f"(float32 and float8_e4m3fn on CPU)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k has shape {tuple(k.shape)} but v has shape {tuple(v.shape)}; they must be equal")
    paged = page_table is not None
    if paged:
        page_table = _check_page_table(page_table, q.shape[0], k.shape)
    elif k.shape[0] != q.shape[0]:
        raise ValueError(f"k has batch {k.shape[0]} but q has batch {q.shape[0]}; they must be equal")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"k has head_dim {k.shape[3]} but q has head_dim {q.shape[3]}; they must be equal")
    heads_q, heads_k = q.shape[2], k.shape[2]
    if (heads_k == 0 and heads_q != 0) or (heads_k and heads_q % heads_k):
        raise ValueError(f"k has {heads_k} heads but q has {heads_q}; q heads must be a multiple of k heads")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if any(isinstance(n, int) and n > _MAX_DIM for n in x.shape):
            raise ValueError(f"{name} has shape {tuple(x.shape)}; every dimension must be at most 2^31 - 1 = "
                             f"{_MAX_DIM} (the kernels' size fields are int32; strides are int64)")
    if cfg is not None and not isinstance(cfg, KernelConfig):
        raise TypeError(f"cfg must be a jax_flash.KernelConfig or None, got {type(cfg).__name__}: {cfg!r}")
    causal = _static_bool(causal, "causal")
    return_lse = _static_bool(return_lse, "return_lse")
    deterministic = _static_bool(deterministic, "deterministic")
    head_dim = q.shape[3]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim) if isinstance(head_dim, int) and head_dim > 0 else 1.0
    else:
        softmax_scale = _static_real(softmax_scale, "softmax_scale")
        if not math.isfinite(softmax_scale) or abs(softmax_scale) * _LOG2E > _FLOAT32_MAX:
            raise ValueError(f"softmax_scale must be a finite number whose magnitude times log2(e) fits float32 "
                             f"(|softmax_scale| <= {_FLOAT32_MAX / _LOG2E:.4g}), got {softmax_scale!r}")
    if softcap is not None:
        softcap = _static_real(softcap, "softcap")
        if not (_FLOAT32_TINY <= softcap <= _FLOAT32_MAX):
            raise ValueError(f"softcap must be a float32 normal number > 0 (from {_FLOAT32_TINY:.8g} to "
                             f"{_FLOAT32_MAX:.8g}), or None for no softcap; got {softcap!r}")
        if 2 * _LOG2E * abs(softmax_scale) / softcap > _FLOAT32_MAX:
            raise ValueError(f"softmax_scale / softcap = {softmax_scale!r} / {softcap!r} overflows float32 (the "
                             f"kernels compute scores as q.k * softmax_scale / softcap)")
    # The kernels keep each row's running maximum of the raw scores q.k and exponentiate scale * (s - max), which
    # is <= 0 only for scale > 0 (and 0 * -inf, a masked score, is NaN). Both rewrites below are exact:
    if softmax_scale < 0:  # scale * (q.k) = (-scale) * (q.(-k))
        k, softmax_scale = -k, -softmax_scale
    elif np.float32(softmax_scale) == 0:  # every visible score is 0 * q.k: q * 0 with any scale (lse = log(#visible));
        q, softmax_scale = q * 0, 1.0    # a NaN or inf in q stays NaN in its row, as the reference gives
    window_left, window_right = _check_window(window)
    batch = q.shape[0]
    lengths = [_check_lengths(x, name, batch) for x, name in ((q_lengths, "q_lengths"), (kv_lengths, "kv_lengths"))]
    q_len_arr, kv_len_arr = (x if x is not None else no_lengths() for x in lengths)
    seq_k = page_table.shape[1] * k.shape[1] if paged else k.shape[1]
    if not paged:
        page_table = jnp.zeros((batch, 0), jnp.int32)
    segments = _check_segment_ids(q_segment_ids, kv_segment_ids, batch, q.shape[1], seq_k)
    segment_ids = segments if segments is not None else no_segments(batch)
    # (ring_attention: this device's query rows, and every device's keys)
    full = (batch, heads_q, q.shape[1], seq_k * (ring[1] if ring is not None else 1))
    alibi = _check_alibi_slopes(alibi_slopes, bias, batch, heads_q)
    bias = alibi if alibi is not None else _check_tensor(bias, "bias", full, jnp.float32)
    mask = _check_tensor(mask, "mask", full, jnp.bool_)
    tensors = (no_tensor(jnp.float32) if bias is None else bias, no_tensor(jnp.bool_) if mask is None else mask)
    params = dict(cfg=cfg, softmax_scale=float(softmax_scale), causal=bool(causal), window_left=window_left,
                  window_right=window_right, softcap=float(softcap or 0.0), has_q_lengths=lengths[0] is not None,
                  has_kv_lengths=lengths[1] is not None, return_lse=bool(return_lse), paged=paged,
                  deterministic=bool(deterministic), ring=ring, segments=segments is not None,
                  has_bias=bias is not None, has_mask=mask is not None, alibi=alibi is not None,
                  same_lengths=lengths[0] is not None and lengths[0] is lengths[1])
    if ring is not None:
        reason = ring_refusal(params, q.shape[1], seq_k, ring[1], ring[2])
        if reason:
            raise ValueError(f"ring_attention cannot run this call: {reason}")
    out, lse = attention_p.bind(q, k, v, q_len_arr, kv_len_arr, page_table, *segment_ids, *tensors, **params)
    return (out, lse) if return_lse else out


def _check_tensor(x, name, full, dtype):
    """A bias or mask tensor as a rank-4 `dtype` array whose dimensions each equal `full`'s or 1, or None."""
    if x is None:
        return None
    x = _as_array(x, name)
    # (masks: bool, or numbers whose nonzero entries are visible, as Flax's float masks)
    kind_ok = jnp.issubdtype(x.dtype, jnp.floating) or (dtype == jnp.bool_ and (
        jnp.dtype(x.dtype) == jnp.bool_ or jnp.issubdtype(x.dtype, jnp.integer)))
    if not kind_ok or x.ndim != 4 or any(n not in (1, f) for n, f in zip(x.shape, full)):
        kind = "a floating-point" if dtype == jnp.float32 else "a bool or numeric"
        raise ValueError(f"{name} must be {kind} array of rank 4 whose dimensions each equal (batch, heads_q, seq_q, "
                         f"seq_k) = {full} or 1 (broadcast); got {jnp.dtype(x.dtype).name}{tuple(x.shape)}")
    return x.astype(dtype) if dtype == jnp.float32 else (x if x.dtype == jnp.bool_ else x != 0)


def _check_alibi_slopes(slopes, bias, batch, heads_q):
    """ALiBi slopes as the float32 (batch or 1, heads_q, 1, 1) bias operand of an alibi=True call, or None."""
    if slopes is None:
        return None
    if bias is not None:
        raise ValueError("alibi_slopes and bias cannot be combined: add the ALiBi term to the bias tensor "
                         "(jax_flash.reference.alibi_bias builds it) or pass the bias alone")
    x = _as_array(slopes, "alibi_slopes")
    if (not jnp.issubdtype(x.dtype, jnp.floating) or x.ndim not in (1, 2) or x.shape[-1] != heads_q
            or (x.ndim == 2 and x.shape[0] != batch)):
        raise ValueError(f"alibi_slopes must be a floating-point array of shape (heads_q,) = ({heads_q},) or (batch, "
                         f"heads_q) = ({batch}, {heads_q}); got {jnp.dtype(x.dtype).name}{tuple(x.shape)}")
    return x.astype(jnp.float32).reshape((1 if x.ndim == 1 else batch, heads_q, 1, 1))


def _check_segment_ids(q_segment_ids, kv_segment_ids, batch, seq_q, seq_k):
    """(q_segment_ids, kv_segment_ids) as int32 (batch, seq_q) and (batch, seq_k) arrays, or None for neither."""
    if q_segment_ids is None and kv_segment_ids is None:
        return None
    if q_segment_ids is None or kv_segment_ids is None:
        given, missing = (("q_segment_ids", "kv_segment_ids") if kv_segment_ids is None
                          else ("kv_segment_ids", "q_segment_ids"))
        raise ValueError(f"{given} was given without {missing}: pass both (for self-attention, the same array "
                         f"twice)")
    checked = []
    for x, name, seq in ((q_segment_ids, "q_segment_ids", seq_q), (kv_segment_ids, "kv_segment_ids", seq_k)):
        x = _as_array(x, name)
        if jnp.dtype(x.dtype) != jnp.int32 or x.ndim != 2 or x.shape[0] != batch or x.shape[1] != seq:
            raise ValueError(f"{name} must be an int32 array of shape (batch, {'seq_q' if name[0] == 'q' else 'seq_k'})"
                             f" = ({batch}, {seq}); got {jnp.dtype(x.dtype).name}{tuple(x.shape)}")
        checked.append(x)
    return tuple(checked)


def _check_page_table(page_table, batch, kv_shape):
    """page_table int32 (batch, pages_per_seq) over pages (num_pages, page_size, heads_k, head_dim), page_size a
    multiple of 8: 8 rows are the period of the 128-byte shared-memory swizzle, so a TMA kernel can copy a K/V block
    as boxes of gcd(page_size, block_kv) rows."""
    page_table = _as_array(page_table, "page_table")
    if page_table.ndim != 2 or jnp.dtype(page_table.dtype) != jnp.int32 or page_table.shape[0] != batch:
        raise ValueError(f"page_table must be an int32 array of shape (batch, pages_per_seq) with batch = {batch}; "
                         f"got {jnp.dtype(page_table.dtype).name}{tuple(page_table.shape)}")
    page_size = kv_shape[1]
    if isinstance(page_size, int) and (page_size <= 0 or page_size % 8):
        raise ValueError(f"with page_table, k and v are (num_pages, page_size, heads_k, head_dim) pages; page_size "
                         f"(k.shape[1]) must be a positive multiple of 8 (16, 32, 64, 128, 256, ...), got {page_size}")
    pages = page_table.shape[1]
    if isinstance(pages, int) and isinstance(page_size, int) and pages * page_size > _MAX_DIM:
        raise ValueError(f"page_table has {pages} pages per sequence of {page_size} keys: {pages * page_size} keys "
                         f"exceed 2^31 - 1")
    return page_table


def _static_hint(name: str) -> str:
    return (f"{name} is a static argument: mark it static when you jit (jax.jit(jax_flash.attention, "
            f"static_argnames=({name!r},)), or jax.jit(f, static_argnums=...) for a wrapper) or close over a Python "
            f"value")


def _concrete_scalar(x, name: str):
    """A 0-d numpy or concrete jax array as a numpy scalar; a traced one raises with the hint to mark it static."""
    if isinstance(x, _Tracer):
        raise TypeError(f"{name} must be known when the call is traced, got a traced value {x}; " + _static_hint(name))
    return np.asarray(x)[()]


def _static_bool(x, name: str) -> bool:
    if isinstance(x, (jax.Array, np.ndarray)) and np.shape(x) == ():
        x = _concrete_scalar(x, name)
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    raise TypeError(f"{name} must be a bool, got {x!r} of type {type(x).__name__}")


def _static_real(x, name: str) -> float:
    """Python and numpy real scalars, and 0-d numpy or concrete jax arrays of a real dtype, as a Python float."""
    if isinstance(x, (jax.Array, np.ndarray)) and np.shape(x) == ():
        x = _concrete_scalar(x, name)
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (numbers.Real, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number (a Python float, a numpy scalar or a 0-d array), got {x!r} "
                        f"of type {type(x).__name__}")
    return float(x)


def _check_window(window) -> tuple[int, int]:
    """(left, right) as int64 attributes: -1 unbounded; a side of 2^31 or more bounds no key either (sequences are
    shorter), so it is unbounded too."""
    if window is None:
        return -1, -1
    if isinstance(window, _Tracer) or (isinstance(window, (tuple, list)) and
                                                any(isinstance(w, _Tracer) for w in window)):
        raise TypeError(f"window must be known when the call is traced, got a traced value; " + _static_hint("window"))
    if (not isinstance(window, (tuple, list)) or len(window) != 2 or
            not all(isinstance(w, (numbers.Integral, np.integer)) and not isinstance(w, (bool, np.bool_))
                    for w in window)):
        raise ValueError(f"window must be a pair of ints (left, right), -1 = unbounded; got {window!r}")
    left, right = int(window[0]), int(window[1])
    if left < -1 or right < -1:
        raise ValueError(f"window sizes must be >= -1 (-1 = unbounded), got {window!r}")
    return tuple(-1 if w > _MAX_DIM else w for w in (left, right))


def _check_lengths(lengths, name, batch):
    if lengths is None:
        return None
    lengths = _as_array(lengths, name)
    if lengths.shape != (batch,) or jnp.dtype(lengths.dtype) != jnp.int32:
        raise ValueError(f"{name} must be an int32 array of shape (batch,) = ({batch},); got "
                         f"{jnp.dtype(lengths.dtype).name}{tuple(lengths.shape)}")
    return lengths


def _as_array(x, name):
    if isinstance(x, (jax.Array, np.ndarray)) or hasattr(x, "aval"):
        return x
    raise TypeError(f"{name} must be a jax or numpy array, got {type(x).__name__}")
