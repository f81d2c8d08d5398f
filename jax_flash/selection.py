"""Which compiled config a call runs: the defaults table per (GPU architecture, dtype, head dim), its refinement by
mask on Hopper, the decode tiles, packed GQA, and the checks that turn an impossible request into a clear error.

Rule (cfg=None): a decode-shaped call (at most 64 rows per kv head once the group's query heads are packed) runs
the sm80 family's decode tiles on every GPU; a call of more rows that fills 128-row tiles better packed runs the sm90
family packed on sm_90 (groups dividing 64, 16 MiB of K/V or more, no tensors or segment ids), else the sm80 family's
tuned tile; below sm_90, a call with a bias or mask tensor or segment ids the sm80 family's tuned tile; otherwise the
autotune cache's entry for the call if it is compiled; on sm_90 SM90_TENSOR_CONFIGS for a call with tensors,
SM90_SEGMENT_CONFIGS for one with segment ids, the
128-row tile for head dim 64 and SM90_SHORT_ROWS query rows without a right bound (208-key blocks for
SM90_ONE_BLOCK_KEYS keys), else the SM90_BY_SHAPE entry for
(head dim, right bound); else DEFAULTS for (arch, dtype, head dim), falling back to the nearest older architecture in
the table; else the first compiled config for (dtype, head dim) in registry order. pack_gqa=None becomes
should_pack_gqa's answer for the chosen tile (never with tensors or segment ids on the sm90 family). On CPU cfg=None
uses the CPU path's own tiles, CPU_TILES; a given cfg's block_q and block_kv are the CPU tiles. The measurements behind
each entry: docs/PERFORMANCE.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_flash import native
from jax_flash.config import DECODE_CONFIGS, SM90_CONFIGS, TUNED_CONFIGS, TWO_PAGE_BLOCK_KV, KernelConfig

# cfg=None on CPU: 256 query rows x 512 keys per OpenBLAS product (the fastest of 64-256 x 64-1024 on AVX2, up to 25%
# over 64 x 64; a 512 KiB score tile per worker). Larger than any GPU block, so these are FFI attribute values, not a
# KernelConfig: the other attributes come from CPU_BASE, whose other fields the CPU handler does not read.
CPU_TILES = {"block_q": 256, "block_kv": 512}
CPU_BASE = KernelConfig()

# (arch, dtype, head_dim) -> config. sm_80: the sm80 family's tuned config (its sweep winners on the H200; sm_80 itself
# has not been measured, and the seed's A100 numbers favour the same 4-warp tiles). sm_90: the Hopper family, faster
# than the sm80 family at every measured shape (1.4-2.6x).
DEFAULTS: dict[tuple[int, str, int], KernelConfig] = {
    (arch, dtype, head_dim): (SM90_CONFIGS[head_dim][0] if arch == 90 else TUNED_CONFIGS[head_dim][0])
    for arch in (80, 90)
    for dtype in ("float16", "bfloat16")
    for head_dim in (64, 128, 256)
}

# sm_90 by mask: (head_dim, right_bounded) -> ((min_seq_k, config), ...) ascending; the last entry whose
# min_seq_k <= seq_k wins. right_bounded = causal or a window with a right bound.
#   head dim 128: pingpong without a right bound (+1-3% over none at 1024-16384 keys), none with one (+3% over
#     pingpong causal);
#   head dim 64: three consumer warpgroups (192 x 128 tiles) at every length, causal too (+9-13% over two consumers
#     non-causal, +3-9% causal);
#   head dim 256: 80-key blocks; pingpong without a right bound, none with one (+0-2.4% over pingpong causal).
SM90_BY_SHAPE: dict[tuple[int, bool], tuple[tuple[int, KernelConfig], ...]] = {
    (128, False): ((0, SM90_CONFIGS[128][0]),),
    (128, True): ((0, SM90_CONFIGS[128][1]),),
    (64, False): ((0, SM90_CONFIGS[64][2]),),
    (64, True): ((0, SM90_CONFIGS[64][2]),),
    (256, False): ((0, SM90_CONFIGS[256][0]),),
    (256, True): ((0, SM90_CONFIGS[256][1]),),
}
# sm_90 with a bias or mask tensor, where it differs from SM90_BY_SHAPE (H100, bf16, 16 heads, 8 x 2048 and 4 x 4096
# tokens): head dim 64 on two consumer warpgroups (the three-consumer tile's tensor variant spills 312 bytes; a dense
# causal mask 253 against 193 TFLOP/s, a (B, 1, 1, S) padding mask 382 against 343, an ALiBi bias 168 against 167);
# head dim 128 without pingpong, whose consumers' per-score loads wait at the same time instead of in turns (ALiBi
# 251-255 against 187-188, causal mask 397-428 against 350-398, padding mask 493-524 against 447-501). Head dim 256
# keeps pingpong (masks 1-2% faster with it, the bias equal).
SM90_TENSOR_CONFIGS: dict[int, KernelConfig] = {64: SM90_CONFIGS[64][0], 128: SM90_CONFIGS[128][1]}
# sm_90 with ALiBi slopes alone (computed per score, nothing read), where it differs from SM90_TENSOR_CONFIGS: head
# dim 64 on the three-consumer tile, which SM90_BY_SHAPE runs without them (H100, bf16, 16 heads, 4 x 4096 tokens:
# 367 against 333 TFLOP/s on the two-consumer tile).
SM90_ALIBI_CONFIGS: dict[int, KernelConfig] = {64: SM90_CONFIGS[64][2]}
# sm_90 with segment ids, where it differs from SM90_BY_SHAPE: head dim 128 on the pingpong tile causal too (H200,
# bf16, 16 heads, one row of 16384 tokens holding documents of geometric lengths with mean 512 / 2048 / 4096: 1-4%,
# 0-2% and -1-3% faster than the causal tile without pingpong, timed interleaved).
SM90_SEGMENT_CONFIGS: dict[int, KernelConfig] = {128: SM90_CONFIGS[128][0]}
# sm_90, head dim 64 without a right bound: the 128-row tile for these ranges of query rows, where it runs as many
# query tiles as the 192-row tile and both its consumers hold rows. 193-256 rows (ViT-B/16 at 224 px: 197 tokens),
# H100, bf16, 12 heads, batch 64 / 256: 152 / 178 TFLOP/s against 136 / 160 on the 192-row tile (cuDNN 160 / 181).
# 65-128 rows (BERT: 128 tokens), H200, 256 x 12 pairs of 128 rows: 223-225 bf16 and 224-226 fp16 against 202-205
# and 197-200 (cuDNN 221-232 and 216-218; on an H100 the two tiles tied); the lengths below 128 run the same single
# query tile, not timed apart. At 64 rows (one consumer's worth) the 192-row tile wins (H100, 8192 x 12 pairs: 80
# against 62), and from 385 rows it needs fewer tiles and wins (577 tokens 320 against 289, 512 385 against 354).
SM90_SHORT_ROWS = ((65, 128), (193, 256))
# ... and of those, calls of SM90_ONE_BLOCK_KEYS keys take 208-key blocks, so one key block covers every key (ViT's
# 197: the 128-key blocks computed 256 key columns, the 192-key ones 384). H200, bf16, 12 heads: batch 64 / 256 x
# 197 tokens 175 / 201-204 TFLOP/s against 153 / 174 on 128-key blocks (cuDNN 157 / 178), 128 x 198 and x 200
# tokens 194-200 against 168-172 (cuDNN 171-174).
SM90_ONE_BLOCK_KEYS = (193, 208)


@dataclasses.dataclass(frozen=True)
class CallShape:
    """What of a call's shape picks its tile: seq_q (None: symbolic), the logical key length, the GQA group
    (heads_q // heads_k), whether it has segment ids or a bias / mask tensor."""

    seq_q: int | None = None
    seq_k: int = 0
    group: int = 1
    tensors: bool = False  # a bias or mask tensor
    segments: bool = False  # segment ids
    alibi: bool = False  # the bias operand holds ALiBi slopes and no mask tensor comes with them: no per-score reads
    kv_bytes: int = 0  # K and V bytes the call reads (logical, paged or not); 0: not known (symbolic shapes)
    page_size: int = 0  # keys per page of a paged call; 0: contiguous K / V


_MAX_ROWS = 2**31 - 1  # the kernels number a unit's rows (seq_q x group when packed) in 32 bits
# Groups the sm90 family packs: each consumer's 64 rows hold whole query positions (sm90/launch.cuh); 1 packs nothing.
SM90_PACK_GROUPS = (1, 2, 4, 8, 16, 32, 64)
# cfg=None packs on the sm90 family from this many K/V bytes: below, its fixed cost (about 22-26 us against 17-21 for
# the sm80 tile, H100) outweighs its faster products; MQA 4 and 8 rows, D 128, 1 x 32768 keys (16 MiB): 1.19-1.32x.
SM90_PACK_MIN_KV_BYTES = 16 * 2**20


def should_pack_gqa(seq_q: int | None, group: int, block_q: int) -> bool:
    """Whether packing the group's query heads into one tile's rows fills the tiles better: FlashAttention-3's rule
    (hopper/heuristics.h, should_pack_gqa), pack when the unpacked tiles are less than 90% as full as packed ones."""
    if group <= 1 or seq_q is None or seq_q * group > _MAX_ROWS:
        return False

    def fill(rows: int) -> float:
        return rows / (-(-rows // block_q) * block_q) if rows else 1.0

    return fill(seq_q) < 0.9 * fill(seq_q * group)


def resolve_cpu_pack(cfg: KernelConfig, seq_q: int | None, group: int, block_q: int) -> KernelConfig:
    """cfg with pack_gqa decided for the CPU path: packed when a tile of block_q rows holds more than one query
    position's worth of the group, so the group's heads share each converted K/V tile (pack_gqa=None), or as given."""
    if cfg.pack_gqa is not None:
        if cfg.pack_gqa and seq_q is not None and seq_q * group > _MAX_ROWS:
            raise ValueError(f"pack_gqa=True packs seq_q x group = {seq_q * group} rows per kv head, more than 2^31 - 1")
        return cfg
    return dataclasses.replace(cfg, pack_gqa=group > 1 and seq_q is not None and seq_q < block_q
                               and seq_q * group <= _MAX_ROWS)


def decode_gpu_config(head_dim: int, shape: CallShape, compiled: list[KernelConfig],
                      arch: int = 80) -> KernelConfig | None:
    """The sm80 family's tile for a decode-shaped or packed call (cfg=None); None for other calls. Rows per kv
    head: seq_q x group packed, else seq_q. At most 64: the smallest decode tile that holds them; more,
    where packing fills 128-row tiles better than one head's rows do (MQA with a few rows per sequence), or with
    bias / mask tensors or segment ids below sm_90: the tuned prefill tile (on sm_90, sm90_packed_config comes
    first, and tensors and segment ids take the default path). Paged
    calls of more rows take the default path, like contiguous ones (chunked prefill over 64-key pages on an H100: the
    sm90 family 1.3-1.7x faster than the tuned sm80 tile at head dims 64, 128 and 256)."""
    sm80_only = (shape.tensors or shape.segments) and arch != 90  # what the sm90 family does not take
    if shape.seq_q is None:
        if not sm80_only:
            return None
        choice = next((c for c in TUNED_CONFIGS.get(head_dim, ()) if c in compiled), None)
        return dataclasses.replace(choice, pack_gqa=False) if choice is not None else None
    rows = shape.seq_q * shape.group
    packs_better = should_pack_gqa(shape.seq_q, shape.group, 128)
    if rows <= 64:
        # The smallest tile that holds the rows; among equal ones the largest key block copied as strided tiles
        # (contiguous, pages a multiple of the block, or TWO_PAGE_BLOCK_KV keys of two whole pages), else the
        # smallest (a block spanning pages is copied row by row).
        candidates = [c for c in DECODE_CONFIGS.get(head_dim, ()) if c.block_q >= min(rows, 64) and c in compiled]
        strided = lambda c: (shape.page_size % c.block_kv == 0  # noqa: E731  (0 % n == 0: contiguous)
                             or 2 * shape.page_size == c.block_kv == TWO_PAGE_BLOCK_KV)
        choice = min(candidates, key=lambda c: (c.block_q, -c.block_kv if strided(c) else c.block_kv)) \
            if candidates else None
        if choice is not None:
            return dataclasses.replace(choice, pack_gqa=shape.group > 1)
    if not (packs_better or sm80_only):
        return None
    choice = next((c for c in TUNED_CONFIGS.get(head_dim, ()) if c in compiled), None)
    if choice is None:
        return None
    return dataclasses.replace(choice, pack_gqa=should_pack_gqa(shape.seq_q, shape.group, choice.block_q))


def sm90_packed_config(arch: int, dtype: str, head_dim: int, shape: CallShape, compiled: list[KernelConfig],
                       right_bounded: bool) -> KernelConfig | None:
    """On sm_90, the sm90 family packed (cfg=None) for a call of more than 64 rows per kv head once packed that fills
    128-row tiles better packed (MQA or GQA with a few rows per sequence) and reads at least SM90_PACK_MIN_KV_BYTES;
    None for other calls. The tile: the first SM90_CONFIGS entry (128 rows, pingpong) with or without a right bound;
    packed MQA on an H100 ran 1.0-1.2x faster on it than on the 192-row tile (head dim 64) or without pingpong (head
    dim 128, causal). The measurements: docs/PERFORMANCE.md (packed GQA on the sm90 family)."""
    if arch != 90 or shape.tensors or shape.segments or shape.seq_q is None:
        return None
    if shape.group not in SM90_PACK_GROUPS[1:]:
        return None
    if shape.seq_q * shape.group <= 64 or not should_pack_gqa(shape.seq_q, shape.group, 128):
        return None
    if shape.kv_bytes < SM90_PACK_MIN_KV_BYTES:
        return None
    cfg = SM90_CONFIGS[head_dim][0] if head_dim in SM90_CONFIGS else None
    return dataclasses.replace(cfg, pack_gqa=True) if cfg in compiled else None


def default_gpu_config(arch: int, dtype: str, head_dim: int, compiled: list[KernelConfig], right_bounded: bool = False,
                       seq_k: int = 0, tensors: bool = False, seq_q: int | None = None,
                       alibi: bool = False, segments: bool = False) -> KernelConfig | None:
    """The config cfg=None runs on a GPU of compute capability `arch` (e.g. 90); None when nothing is compiled.
    `compiled` holds only configs this GPU can run (the caller drops the sm90 family below sm_90); `tensors`: the call
    has a bias or mask tensor (`alibi`: ALiBi slopes alone); seq_q: its query rows (None: symbolic); `segments`: it
    has segment ids."""
    if arch == 90 and (tensors or segments):
        tables = (SM90_ALIBI_CONFIGS if alibi else {}, SM90_TENSOR_CONFIGS) if tensors else (SM90_SEGMENT_CONFIGS,)
        for table in tables:
            if table.get(head_dim) in compiled:
                return table[head_dim]
    short = seq_q is not None and any(lo <= seq_q <= hi for lo, hi in SM90_SHORT_ROWS) and not right_bounded
    if arch == 90 and head_dim == 64 and short:
        one_block = SM90_ONE_BLOCK_KEYS[0] <= seq_k <= SM90_ONE_BLOCK_KEYS[1]
        if one_block and SM90_CONFIGS[64][3] in compiled:
            return SM90_CONFIGS[64][3]
        if SM90_CONFIGS[64][0] in compiled:
            return SM90_CONFIGS[64][0]
    if arch == 90:
        choice = [cfg for min_seq_k, cfg in SM90_BY_SHAPE.get((head_dim, right_bounded), ()) if min_seq_k <= seq_k]
        if choice and choice[-1] in compiled:
            return choice[-1]
    for table_arch in sorted({a for a, _, _ in DEFAULTS if a <= arch}, reverse=True):
        cfg = DEFAULTS.get((table_arch, dtype, head_dim))
        if cfg is not None and cfg in compiled:
            return cfg
    return compiled[0] if compiled else None


@functools.cache
def cuda_arch() -> int:
    """Compute capability of the first CUDA device as 80, 90, ...; 90 when none is visible (cross-lowering)."""
    try:
        device = jax.devices("cuda")[0]
    except (RuntimeError, IndexError):
        return 90
    return native.device_arch(device)


def resolve_gpu_config(cfg: KernelConfig | None, dtype, head_dim: int, tuned: KernelConfig | None = None,
                       right_bounded: bool = False, shape: CallShape = CallShape()) -> KernelConfig:
    """The compiled kernel config a GPU call runs, with pack_gqa decided, or a clear error saying what is compiled.
    `tuned`: the autotune cache's entry for the call (jax_flash/autotune_cache.py); right_bounded (causal, or a window
    with a right bound) and the call's shape refine cfg=None's choice."""
    dtype_name = jnp.dtype(dtype).name
    if not native.BUILT_WITH_CUDA:
        raise RuntimeError("jax_flash was built without CUDA (no CUDA compiler at build time), so it cannot run on a "
                           "GPU; rebuild on a machine with the CUDA toolkit (see README, 'Building on a GPU machine')")
    if dtype_name not in ("float16", "bfloat16"):
        raise TypeError(f"q, k and v have dtype {dtype_name}; the GPU kernels support float16 and bfloat16 "
                        f"(float32 is accepted on CPU only)")
    head_dims = native.gpu_head_dims(dtype_name)
    if head_dim not in head_dims:
        raise ValueError(f"head_dim={head_dim} is not supported on GPU; supported head dims: {head_dims}")
    arch = cuda_arch()
    # The sm90 family runs on sm_90 only; elsewhere it is neither a default nor a valid choice.
    compiled = [c for c in native.compiled_configs_for(dtype_name, head_dim) if c.family != "sm90" or arch == 90]
    if cfg is not None and cfg.family == "sm90" and arch != 90:
        raise ValueError(f"cfg={cfg!r} is a family='sm90' (Hopper: wgmma, TMA) config; this GPU is sm_{arch}. "
                         f"Use a family='sm80' config or cfg=None")
    if cfg is None:
        decode = (sm90_packed_config(arch, dtype_name, head_dim, shape, compiled, right_bounded)
                  or decode_gpu_config(head_dim, shape, compiled, arch))
        if decode is not None:
            return decode
        if tuned is not None and tuned.kernel() in compiled:  # the autotune cache first, then the table
            cfg = tuned
        else:
            cfg = default_gpu_config(arch, dtype_name, head_dim, compiled, right_bounded, shape.seq_k, shape.tensors,
                                     shape.seq_q, shape.alibi, shape.segments)
    elif cfg.kernel() not in compiled:
        listing = "\n  ".join(repr(c) for c in compiled)
        raise ValueError(f"cfg={cfg!r} is not compiled into this build for {dtype_name} head_dim={head_dim}. "
                         f"Compiled configs:\n  {listing}\n(build with -DJAX_FLASH_CONFIG_SET=all for the whole "
                         f"tuning space; num_splits and pack_gqa are chosen per call and need no build)")
    if cfg.family == "sm90":
        if (shape.segments or shape.tensors) and cfg.pack_gqa and shape.group > 1:
            what = "segment ids" if shape.segments else "bias / mask tensors"
            raise ValueError(f"cfg={cfg!r}: pack_gqa=True with {what} runs on family='sm80' configs; the sm90 "
                             f"family packs calls without segment ids or tensors only")
        if cfg.pack_gqa and shape.group not in SM90_PACK_GROUPS:
            raise ValueError(f"cfg={cfg!r}: the sm90 family packs groups of {SM90_PACK_GROUPS[1:]} query heads per kv "
                             f"head; this call has {shape.group} (use pack_gqa=False or a family='sm80' config)")
        if cfg.pack_gqa is None:
            return dataclasses.replace(cfg, pack_gqa=shape.group in SM90_PACK_GROUPS[1:] and not shape.segments
                                       and not shape.tensors
                                       and should_pack_gqa(shape.seq_q, shape.group, cfg.block_q))
    if cfg.pack_gqa is None:
        return dataclasses.replace(cfg, pack_gqa=should_pack_gqa(shape.seq_q, shape.group, cfg.block_q))
    if cfg.pack_gqa and shape.seq_q is not None and shape.seq_q * shape.group > _MAX_ROWS:
        raise ValueError(f"pack_gqa=True packs seq_q x group = {shape.seq_q * shape.group} rows per kv head, more "
                         f"than 2^31 - 1")
    return cfg
