"""The kernel configuration: its schema, the validated KernelConfig, and the config lists the build ships.

The single source of truth for the config space. `csrc/generate.py` reads this file to write the C++ side: the
config fields (`csrc/common/config_fields.h`), the FFI attribute struct and its decoding (`ffi/attention_attrs.h`),
and the kernel instantiations with their registry (`csrc/instantiations/`); the compiled module reports back what it
holds (`supported_configs()`). It imports nothing from jax so the generator can load it on its own.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

# Element types the GPU kernels are built for; the integer is the C++ `DType` enum value (csrc/common/kernel_key.h).
GPU_DTYPES = {"float16": 0, "bfloat16": 1}
GPU_HEAD_DIMS = (64, 128, 256)

_BLOCK_Q = (16, 32, 64, 128)
_BLOCK_KV = (32, 64, 128)
_NUM_WARPS = (1, 4, 8)
_MMA_K = 16  # k extent of one mma.sync.m16n8k16 fragment
_MAX_REGISTERS = 255  # per thread, sm_80 and sm_90
_MAX_SMEM_BYTES = 227 * 1024  # opt-in dynamic shared memory per block on sm_90 (sm_80: 163 KB)
_SM80_MAX_SMEM_BYTES = 163 * 1024
# The kernel families; the integer is KernelKey::family (csrc/common/kernel_key.h).
FAMILIES = {"sm80": 80, "sm90": 90}
_SM90_HEAD_DIMS = (64, 128, 256)
_SM90_BLOCK_KV = (64, 80, 128, 160, 192, 208)
_SM90_STAGES = (2, 3)
_SM90_CONSUMERS = (2, 3)


_SM80, _SM90, _BOTH = ("sm80",), ("sm90",), ("sm80", "sm90")
# The most key ranges a tile's keys may be split into (KernelConfig.num_splits): the combine step reads one partial
# per split and keeps one weight per split in shared memory.
MAX_SPLITS = 256
# The sm80 family's key block that copies a block of two whole pages (page size block_kv / 2) as two strided half
# tiles (the four-warp decode tiles' 128-key blocks over 64-key pages); other blocks spanning pages go row by row.
# Every tile carrying the path cost the prefill tiles' masked variants up to 20 bytes of spill (sm_90 build).
TWO_PAGE_BLOCK_KV = 128


def _field(default, families: tuple[str, ...], *, launch: bool = False):
    """A KernelConfig field and the kernel families that read it (the others leave it at its default). A launch field
    is decided per call, not compiled: it travels as an FFI attribute but is no part of the kernel's identity
    (KernelKey, the registry, the instantiations)."""
    return dataclasses.field(default=default, metadata={"families": families, "launch": launch})


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tuning knobs of the FlashAttention-2-style kernel family (names of the seed project in brackets).

    block_q [B_r]: query rows per thread block.  block_kv [B_c]: keys per inner-loop step.
    num_warps [n_warps]: warps per block; each warp owns block_q / num_warps query rows, at least 16: below that
        (block_q < 16 x num_warps) the warps that share 16 rows split every key block between them and merge their
        softmax states at the end (decode tiles of 16 or 32 rows on four warps).
    async_copy: global->shared copies with cp.async (else plain 16-byte loads through registers).
    eager_load_blocks: prefetch the next K block while P V runs and the next V block while Q K^T runs.
    swizzled: XOR-swizzled shared memory so ldmatrix hits 8 different bank groups.
    q/k/v_mma_load_k_fragments: how many 16-wide k-fragments each shared->register load brings (0 = all at once;
        q = 0 keeps Q in registers for the whole kernel).
    mma_double_buffer_loads: load the next fragment chunk before the mma instructions of the current one.
    optimized_softmax: exp2 with scale*log2(e) folded into one FFMA per score.

    family: "sm80" (the knobs above; mma.sync, runs on compute capability 8.0+) or "sm90" (Hopper only: wgmma, TMA,
        a producer warpgroup and consumer warpgroups; csrc/sm90/). An sm90 config sets block_q = 64 *
        consumer_warpgroups, num_warps = 4 * (consumer_warpgroups + 1), block_kv in {64, 80, 128, 160, 192} and its own
        knobs:
    stages: depth of the K/V shared-memory pipeline the producer fills with TMA copies (sm90 only).
    consumer_warpgroups: math warpgroups of 64 query rows each (sm90 only): 2 (232 registers each), or 3 (160 each:
        192-row tiles; the soft-capped kernels pass P, the probabilities, to the P V product through shared memory).
    pingpong: the consumer warpgroups take turns (sm90 only): with overlap, on issuing their wgmma products, so one's
        softmax overlaps the other's matrix work; without it, on the softmax's exponentials (the MUFU section), so
        one's exponentials run while the other's products occupy the tensor cores.
    overlap: intra-warpgroup overlap (sm90 only): issue the next key block's Q K^T together with this block's P V and
        run the softmax under the product; False waits for each product at once (cuDNN's schedule).
    num_splits (launch, both families): how many key ranges each tile's keys are cut into, each run by its own thread
        block and merged by the log-sum-exp afterwards (split-KV, Flash-Decoding). 0 = chosen per call from the grid,
        the SM count and the key length (csrc/common/split_plan.h); n forces n (at most MAX_SPLITS). On CPU it forces
        the CPU path's key splits the same way.
    pack_gqa (launch; both families and the CPU path): pack the query heads that share a kv head into the rows of
        one tile, so each K/V block is read once per kv head (row r of a packed tile is query position r // group of
        head kv_head * group + r % group). None = decided per call by tile efficiency
        (jax_flash.selection.should_pack_gqa). The sm90 family packs groups of 2, 4, 8, 16, 32 or 64 heads (each
        consumer's 64 rows hold whole positions); True with another group is an error there.
    The sm80-only knobs stay at their defaults in an sm90 config, and the sm90-only knobs in an sm80 config.

    Data type and head dim come from the inputs. On CPU, block_q and block_kv are the tile sizes of the CPU path
    (cfg=None takes larger ones there: jax_flash.selection.CPU_TILES).
    """

    # Defaults: the best head-dim-128 config of the sm80 family's sweep on the H200 (docs/PERFORMANCE.md).
    block_q: int = _field(128, _BOTH)
    block_kv: int = _field(32, _BOTH)
    num_warps: int = _field(4, _BOTH)
    async_copy: bool = _field(True, _SM80)
    eager_load_blocks: bool = _field(True, _SM80)
    swizzled: bool = _field(True, _SM80)
    q_mma_load_k_fragments: int = _field(2, _SM80)
    k_mma_load_k_fragments: int = _field(1, _SM80)
    v_mma_load_k_fragments: int = _field(1, _SM80)
    mma_double_buffer_loads: bool = _field(True, _SM80)
    optimized_softmax: bool = _field(True, _SM80)
    family: str = _field("sm80", _BOTH)
    stages: int = _field(2, _SM90)
    consumer_warpgroups: int = _field(2, _SM90)
    pingpong: bool = _field(True, _SM90)
    overlap: bool = _field(True, _SM90)
    num_splits: int = _field(0, _BOTH, launch=True)
    pack_gqa: bool | None = _field(None, _BOTH, launch=True)

    def __post_init__(self):
        _require(self.family in FAMILIES, f"KernelConfig.family={self.family!r} is not allowed; choose one of "
                                          f"{tuple(FAMILIES)}")
        for f in dataclasses.fields(self):  # the types the schema declares (bool is not an int here)
            value = getattr(self, f.name)
            if f.type == "int" and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"KernelConfig.{f.name} must be an int, got {value!r} of type {type(value).__name__}")
            if f.type == "bool" and not isinstance(value, bool):
                raise TypeError(f"KernelConfig.{f.name} must be a bool, got {value!r} of type {type(value).__name__}")
            if f.type == "bool | None" and value is not None and not isinstance(value, bool):
                raise TypeError(f"KernelConfig.{f.name} must be True, False or None (decided per call), got {value!r} "
                                f"of type {type(value).__name__}")
        _require(0 <= self.num_splits <= MAX_SPLITS,
                 f"KernelConfig.num_splits={self.num_splits} is not allowed; choose 0 (decided per call) or 1 to "
                 f"{MAX_SPLITS}")
        self._require_defaults_outside(self.family)
        if self.family == "sm90":
            self._validate_sm90()
            return
        _require(self.block_q in _BLOCK_Q, f"KernelConfig.block_q={self.block_q} is not allowed; choose one of {_BLOCK_Q}")
        _require(self.block_kv in _BLOCK_KV,
                 f"KernelConfig.block_kv={self.block_kv} is not allowed; choose one of {_BLOCK_KV}")
        _require(self.num_warps in _NUM_WARPS,
                 f"KernelConfig.num_warps={self.num_warps} is not allowed; choose one of {_NUM_WARPS}")
        _require(self.block_kv % (16 * self.key_warps()) == 0,
                 f"KernelConfig.block_q={self.block_q} with num_warps={self.num_warps} splits each key block between "
                 f"{self.key_warps()} warps; block_kv={self.block_kv} gives {self.block_kv / self.key_warps():g} keys "
                 f"per warp, and each warp needs a multiple of 16 keys")
        _require(not self.eager_load_blocks or self.async_copy,
                 "KernelConfig.eager_load_blocks=True needs async_copy=True (a synchronous copy cannot overlap math)")
        # Fragment counts are checked against the head dims in fits(); here only the sign and the block_kv bound.
        for name in ("q_mma_load_k_fragments", "k_mma_load_k_fragments", "v_mma_load_k_fragments"):
            _require(getattr(self, name) >= 0, f"KernelConfig.{name}={getattr(self, name)} must be >= 0 (0 = all)")
        kv_steps = self.warp_keys() // _MMA_K
        _require(self.v_mma_load_k_fragments <= kv_steps and kv_steps % max(self.v_mma_load_k_fragments, 1) == 0,
                 f"KernelConfig.v_mma_load_k_fragments={self.v_mma_load_k_fragments} must be 0 or divide "
                 f"{'block_kv' if self.key_warps() == 1 else 'keys per warp'}/16={kv_steps}")

    def _validate_sm90(self) -> None:
        _require(self.consumer_warpgroups in _SM90_CONSUMERS,
                 f"KernelConfig.consumer_warpgroups={self.consumer_warpgroups} is not allowed for family='sm90'; "
                 f"choose one of {_SM90_CONSUMERS}")
        _require(self.stages in _SM90_STAGES,
                 f"KernelConfig.stages={self.stages} is not allowed; choose one of {_SM90_STAGES}")
        _require(self.block_q == 64 * self.consumer_warpgroups,
                 f"KernelConfig.block_q={self.block_q} must be 64 * consumer_warpgroups = "
                 f"{64 * self.consumer_warpgroups} for family='sm90' (each consumer warpgroup owns 64 rows)")
        _require(self.num_warps == 4 * (self.consumer_warpgroups + 1),
                 f"KernelConfig.num_warps={self.num_warps} must be 4 * (consumer_warpgroups + 1) = "
                 f"{4 * (self.consumer_warpgroups + 1)} for family='sm90' (a producer warpgroup + the consumers)")
        _require(self.block_kv in _SM90_BLOCK_KV,
                 f"KernelConfig.block_kv={self.block_kv} is not allowed for family='sm90'; choose one of "
                 f"{_SM90_BLOCK_KV}")

    def _require_defaults_outside(self, family: str) -> None:
        """The other family's knobs stay at their defaults (the kernels of `family` ignore them)."""
        for f in dataclasses.fields(self):
            if family not in f.metadata["families"]:
                owner = f.metadata["families"][0]
                _require(getattr(self, f.name) == f.default,
                         f"KernelConfig.{f.name}={getattr(self, f.name)!r} applies to family={owner!r} only; leave it "
                         f"at {f.default!r} for family={family!r}")

    @staticmethod
    def sm90(block_kv: int = 128, stages: int = 2, consumer_warpgroups: int = 2, pingpong: bool = True,
             overlap: bool = True) -> "KernelConfig":
        """An sm90-family config (block_q and num_warps follow from consumer_warpgroups)."""
        return KernelConfig(family="sm90", block_q=64 * consumer_warpgroups, block_kv=block_kv,
                            num_warps=4 * (consumer_warpgroups + 1), stages=stages,
                            consumer_warpgroups=consumer_warpgroups, pingpong=pingpong, overlap=overlap)

    def kernel(self) -> "KernelConfig":
        """The compiled kernel this config runs: the launch fields (num_splits, pack_gqa) at their defaults."""
        return dataclasses.replace(self, **{f.name: f.default for f in dataclasses.fields(self) if f.metadata["launch"]})

    # ---- derived numbers shared by the validator, the generator and the docs -------------------------------------
    def key_warps(self) -> int:
        """Warps that share each 16 query rows, splitting every key block between them: block_q below 16 x num_warps
        (decode tiles of few rows, which one warp per 16 rows would leave mostly idle); 1 otherwise."""
        return max(1, 16 * self.num_warps // self.block_q)

    def rows_per_warp(self) -> int:
        return self.block_q * self.key_warps() // self.num_warps

    def merge_scratch_bytes(self, head_dim: int) -> int:
        """Shared memory the key-splitting warps merge through (csrc/sm80/softmax.cuh, merge_key_warps): every warp
        but the first of each row group writes O (its rows x D) and two floats per row, fp32, per lane."""
        m_tiles = self.rows_per_warp() // 16
        row_groups = self.num_warps // self.key_warps()
        return (self.key_warps() - 1) * row_groups * (m_tiles * head_dim // 8 * 4 + 4 * m_tiles) * 32 * 4

    def warp_keys(self) -> int:
        """Keys of each key block one warp takes."""
        return self.block_kv // self.key_warps()

    def smem_bytes(self, head_dim: int, elem_bytes: int = 2) -> int:
        if self.family == "sm90":  # Q x 1-2 [+ O] + stages x (K + V) [+ P per consumer] + barriers + 2 tile slots + 1024
            q_buffers = self.sm90_q_buffers(head_dim, elem_bytes)
            o_buffer = not self.sm90_o_in_kv(head_dim, elem_bytes)
            return self._sm90_smem_bytes(head_dim, elem_bytes, q_buffers, o_buffer)
        # sQ (block_q, D) + sK (block_kv, D) + sV (block_kv, D), as csrc/sm80/traits.cuh (the registry reports the
        # compiled number; tests/test_api.py compares them)
        return (self.block_q + 2 * self.block_kv) * head_dim * elem_bytes

    def _sm90_smem_bytes(self, head_dim: int, elem_bytes: int, q_buffers: int, o_buffer: bool = True) -> int:
        # sizeof(SharedStorage) + the alignment slack of csrc/sm90/shared_storage.cuh (the registry reports the
        # compiled number; tests/test_api.py compares them).
        # P: per consumer 64 rows x whole 64-key panels (block_kv 160 fills 2.5 of 3), for the soft-capped kernels
        # with three consumers or, at head dim 64, more than 128 keys per block (traits.cuh, kPSmemIfSoftcap)
        p_in_smem = self.consumer_warpgroups == 3 or (self.block_kv > 128 and head_dim == 64)
        p_bytes = self.block_q * -(-self.block_kv // 64) * 64 * elem_bytes if p_in_smem else 0
        # the split tail's 32 bytes of state (head dim 128, two consumers, pingpong: traits.cuh, kSplitTail)
        split_bytes = 32 if head_dim == 128 and self.consumer_warpgroups == 2 and self.pingpong else 0
        # barriers, two 44-byte tile slots and the four tiles' key ranges, and the 1024-byte alignment slack
        return (((q_buffers + o_buffer) * self.block_q + 2 * self.stages * self.block_kv) * head_dim * elem_bytes + p_bytes +
                8 * (2 * q_buffers + 4 * self.stages + 4) + 2 * 44 + 16 + split_bytes + 1024)

    def sm90_q_buffers(self, head_dim: int, elem_bytes: int = 2) -> int:
        """Q buffers of an sm90 kernel: 2 (the next tile's Q loads during this one) where 227 KB allow, else 1."""
        return 2 if self._sm90_smem_bytes(head_dim, elem_bytes, 2) <= _MAX_SMEM_BYTES else 1

    def sm90_o_in_kv(self, head_dim: int, elem_bytes: int = 2) -> bool:
        """Whether an sm90 kernel stages O in the K / V stage of each tile's last key block because a separate O
        buffer does not fit beside one Q buffer (head dim 256; csrc/sm90/traits.cuh, kOInKV)."""
        return self._sm90_smem_bytes(head_dim, elem_bytes, 1) > _MAX_SMEM_BYTES

    def estimated_registers(self, head_dim: int) -> int:
        """Upper estimate of live 32-bit registers per thread at the busiest point of the loop.

        Accumulators: O is (rows_per_warp x D) fp32 over 32 lanes, S is (rows_per_warp x warp_keys). Fragments: an
        A fragment (16x16) is 4 registers per lane, a B fragment (16x8) 2. Q K^T and P V do not overlap, so the peak
        is O + the larger GEMM's live set + a fixed allowance for addresses, softmax state and loop counters.
        """
        m_tiles = self.rows_per_warp() // 16
        acc_o = m_tiles * (head_dim // 8) * 4
        acc_s = m_tiles * (self.warp_keys() // 8) * 4
        buffers = 2 if self.mma_double_buffer_loads else 1
        d_steps, kv_steps = head_dim // _MMA_K, self.warp_keys() // _MMA_K
        # A Q chunk is counted once: its double buffer overlaps the K fragments' (calibrated on ptxas).
        q_regs = m_tiles * d_steps * 4 if self.q_mma_load_k_fragments == 0 else \
            m_tiles * self.q_mma_load_k_fragments * 4
        k_chunk = self.k_mma_load_k_fragments or d_steps
        v_chunk = self.v_mma_load_k_fragments or kv_steps
        gemm_qk = acc_s + q_regs + k_chunk * (self.warp_keys() // 8) * 2 * min(buffers, d_steps // k_chunk)
        gemm_pv = acc_s // 2 + v_chunk * (head_dim // 8) * 2 * min(buffers, kv_steps // v_chunk)
        q_held = q_regs if self.q_mma_load_k_fragments == 0 else 0
        return acc_o + max(gemm_qk, gemm_pv + q_held) + 32

    def fits(self, head_dim: int, arch: int = 90) -> str | None:
        """None if this config can be built for `head_dim`, else the reason it cannot (the seed's should_autotune)."""
        if self.family == "sm90":
            return self._fits_sm90(head_dim, arch)
        d_steps = head_dim // _MMA_K
        for name in ("q_mma_load_k_fragments", "k_mma_load_k_fragments"):
            n = getattr(self, name)
            if n > d_steps or (n and d_steps % n):
                return f"{name}={n} must be 0 or divide head_dim/16={d_steps}"
        smem_limit = _SM80_MAX_SMEM_BYTES if arch < 90 else _MAX_SMEM_BYTES
        if self.smem_bytes(head_dim) > smem_limit:
            return f"needs {self.smem_bytes(head_dim)} bytes of shared memory, more than {smem_limit} on sm_{arch}"
        if self.merge_scratch_bytes(head_dim) > 2 * self.block_kv * head_dim * 2:
            return (f"block_q={self.block_q} on num_warps={self.num_warps} merges {self.merge_scratch_bytes(head_dim)} "
                    f"bytes of softmax state through the K / V buffers, which hold {4 * self.block_kv * head_dim}")
        regs = self.estimated_registers(head_dim)
        if regs > _MAX_REGISTERS:
            return (f"needs about {regs} registers per thread at head_dim={head_dim} (limit {_MAX_REGISTERS}); "
                    f"use more warps, a smaller block_q/block_kv or smaller fragment loads")
        return None

    def _fits_sm90(self, head_dim: int, arch: int) -> str | None:
        if arch < 90:
            return f"family='sm90' needs compute capability 9.0 (H100/H200), not sm_{arch}"
        if head_dim not in _SM90_HEAD_DIMS:
            return f"family='sm90' is built for head_dim in {_SM90_HEAD_DIMS}, not {head_dim}"
        if self.smem_bytes(head_dim) > _MAX_SMEM_BYTES:
            return f"needs {self.smem_bytes(head_dim)} bytes of shared memory, more than {_MAX_SMEM_BYTES} on sm_90"
        # Per consumer thread: O (64 x D fp32 over 128 threads) + S (64 x block_kv) + P (bf16 pairs) + about 40 for
        # softmax state and addresses (32 with three consumers, whose tile facts stay in shared memory: traits.cuh,
        # kHoldTileSlot), within what setmaxnreg gives each consumer (232 with two consumers, 160 with three).
        state = 32 if self.consumer_warpgroups == 3 else 40
        regs = head_dim // 2 + self.block_kv // 2 + self.block_kv // 4 + state
        limit = self.consumer_registers()
        if regs > limit:
            return f"needs about {regs} registers per consumer thread at head_dim={head_dim} (limit {limit})"
        return None

    def consumer_registers(self) -> int:
        """Registers per consumer thread after setmaxnreg (sm90): the block's launch allocation (64K registers over
        its threads, a multiple of 8) minus the producer's (40 with two consumers, 32 with three), split over the
        consumers, as csrc/sm90/traits.cuh (kConsumerRegs; the registry reports the compiled number and
        tests/test_api.py compares them)."""
        threads = 128 * (self.consumer_warpgroups + 1)
        launch = (65536 // threads) // 8 * 8
        producer = 32 if self.consumer_warpgroups == 3 else 40
        return (threads * launch // 128 - producer) // self.consumer_warpgroups // 8 * 8

    def short_name(self) -> str:
        """Compact name used in generated file names: q128_kv64_w8_a1e1s1_f0-2-1_d1o1 (sm80), sm90_q128_kv128_st2_wg2."""
        if self.family == "sm90":
            return (f"q{self.block_q}_kv{self.block_kv}_st{self.stages}_wg{self.consumer_warpgroups}"
                    f"_pp{int(self.pingpong)}" + ("" if self.overlap else "_ov0"))
        b = lambda x: int(x)  # noqa: E731
        return (f"q{self.block_q}_kv{self.block_kv}_w{self.num_warps}_a{b(self.async_copy)}e{b(self.eager_load_blocks)}"
                f"s{b(self.swizzled)}_f{self.q_mma_load_k_fragments}-{self.k_mma_load_k_fragments}-"
                f"{self.v_mma_load_k_fragments}_d{b(self.mma_double_buffer_loads)}o{b(self.optimized_softmax)}")

    def describe(self) -> str:
        """A name a person can read: 'sm80 128x64 tiles, 4 warps, ...' (short_name() is the file-name form)."""
        if self.family == "sm90":
            return (f"sm90 {self.block_q}x{self.block_kv} tiles, {self.stages} stages, {self.consumer_warpgroups} "
                    f"consumer warpgroups" + (", ping-pong" if self.pingpong else "") +
                    ("" if self.overlap else ", no softmax/wgmma overlap"))
        copies = "cp.async" + (" eager" if self.eager_load_blocks else "") if self.async_copy else "plain copies"
        fragments = (f"fragments q{self.q_mma_load_k_fragments}/k{self.k_mma_load_k_fragments}/"
                     f"v{self.v_mma_load_k_fragments}" + (" double-buffered" if self.mma_double_buffer_loads else ""))
        return (f"sm80 {self.block_q}x{self.block_kv} tiles, {self.num_warps} warps, {copies}, "
                f"{'swizzled' if self.swizzled else 'unswizzled'}, {fragments}, "
                f"{'exp2' if self.optimized_softmax else 'expf'} softmax")

    def to_attrs(self) -> dict[str, int]:
        """The FFI attributes (all int64) under the field names (ffi/attention_attrs.h, generated); family as
        FAMILIES' number, pack_gqa None / False / True as -1 / 0 / 1."""
        attrs = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        attrs["family"] = FAMILIES[self.family]
        attrs["pack_gqa"] = -1 if self.pack_gqa is None else int(self.pack_gqa)
        return {name: int(value) for name, value in attrs.items()}

    @classmethod
    def from_attrs(cls, attrs: dict) -> "KernelConfig":
        """The config whose to_attrs() is `attrs` (extra keys are ignored; absent launch fields take their
        defaults), as the compiled registry reports it."""
        values = {}
        for f in dataclasses.fields(cls):
            if f.metadata["launch"] and f.name not in attrs:
                continue
            value = attrs[f.name]
            if f.name == "family":
                value = {number: name for name, number in FAMILIES.items()}[int(value)]
            elif f.type == "bool":
                value = bool(value)
            elif f.type == "bool | None":
                value = None if int(value) < 0 else bool(value)
            else:
                value = int(value)
            values[f.name] = value
        return cls(**values)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def config_fields() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(KernelConfig))


# ---- the schema the C++ side is generated from (csrc/generate.py) ---------------------------------------------------
# The C++ type of each KernelConfig field in KernelKey, the families that read it; family is its FAMILIES number.
_CPP_TYPES = {"int": "int", "bool": "bool", "str": "int"}


def config_schema() -> list[tuple[str, str, tuple[str, ...]]]:
    """(name, C++ type, families) of every compiled KernelConfig field (the KernelKey), in declaration order."""
    return [(f.name, _CPP_TYPES[f.type], f.metadata["families"]) for f in dataclasses.fields(KernelConfig)
            if not f.metadata["launch"]]


def launch_schema() -> list[tuple[str, str]]:
    """(name, meaning) of the launch fields of KernelConfig: FFI attributes (int64) outside the KernelKey."""
    meanings = {"num_splits": "0 = chosen per call; n forces n key ranges per tile",
                "pack_gqa": "-1 = decided per call, 0 = off, 1 = the query heads of a kv head share a tile"}
    return [(f.name, meanings[f.name]) for f in dataclasses.fields(KernelConfig) if f.metadata["launch"]]


# The call's own FFI attributes beside the config (the primitive's parameters): name, type, meaning. float travels
# as float32, the others as int64.
CALL_ATTRIBUTES: tuple[tuple[str, str, str], ...] = (
    ("softmax_scale", "float", "s = softmax_scale * q.k"),
    ("causal", "bool", "bottom-right aligned"),
    ("window_left", "int", "-1 = unbounded"),
    ("window_right", "int", "-1 = unbounded"),
    ("softcap", "float", "0 = off"),
    ("has_q_lengths", "bool", "read the q_lengths operand (else every row is valid)"),
    ("has_kv_lengths", "bool", "read the kv_lengths operand (else every key is valid)"),
    ("return_lse", "bool", "write the lse result"),
    ("paged", "bool", "k and v are (num_pages, page_size, Hk, D) pages named by the page_table operand"),
    ("deterministic", "bool", "the GPU backward adds dQ in a fixed order (no float atomics): bitwise repeatable"),
    ("alibi", "bool", "the bias operand holds ALiBi slopes (B|1, Hq, 1, 1), not a bias tensor (common/alibi.h)"),
)


# ---- the config lists the build ships ---------------------------------------------------------------------------
# The seed's optimisation progression (../shared/seeds/README.md), replayable with the benchmark's --configs option:
# each step switches one more technique on. The last step is the tuned default.
PROGRESSION_CONFIGS: tuple[KernelConfig, ...] = (
    # 1. base: synchronous copies, unswizzled shared memory, all fragments per load, expf softmax
    KernelConfig(block_q=128, block_kv=64, num_warps=8, async_copy=False, eager_load_blocks=False, swizzled=False,
                 q_mma_load_k_fragments=0, k_mma_load_k_fragments=2, v_mma_load_k_fragments=1,
                 mma_double_buffer_loads=False, optimized_softmax=False),
    # 2. + swizzled shared memory (no ldmatrix bank conflicts)
    KernelConfig(block_q=128, block_kv=64, num_warps=8, async_copy=False, eager_load_blocks=False, swizzled=True,
                 q_mma_load_k_fragments=0, k_mma_load_k_fragments=2, v_mma_load_k_fragments=1,
                 mma_double_buffer_loads=False, optimized_softmax=False),
    # 3. + cp.async and eager K/V prefetch
    KernelConfig(block_q=128, block_kv=64, num_warps=8, async_copy=True, eager_load_blocks=True, swizzled=True,
                 q_mma_load_k_fragments=0, k_mma_load_k_fragments=2, v_mma_load_k_fragments=1,
                 mma_double_buffer_loads=False, optimized_softmax=False),
    # 4. + double-buffered fragment loads and the exp2/FMA softmax
    KernelConfig(block_q=128, block_kv=64, num_warps=8, async_copy=True, eager_load_blocks=True, swizzled=True,
                 q_mma_load_k_fragments=0, k_mma_load_k_fragments=2, v_mma_load_k_fragments=1,
                 mma_double_buffer_loads=True, optimized_softmax=True),
    # 5. retiled from the sweep: 4 warps x 32 rows, so each K/V fragment read from shared memory feeds two m16 tiles;
    #    Q re-read from shared memory in 2-fragment chunks to make room for the larger O accumulator (= the default)
    KernelConfig(),
)

# The sm80 family's tuned config per head dim (the winners of its tile sweeps on the H200, bf16; numbers in
# docs/PERFORMANCE.md); jax_flash/selection.py picks among the compiled configs.
TUNED_CONFIGS: dict[int, tuple[KernelConfig, ...]] = {
    64: (KernelConfig(block_q=128, block_kv=64, num_warps=4, q_mma_load_k_fragments=0, k_mma_load_k_fragments=1,
                      v_mma_load_k_fragments=1),),
    128: (KernelConfig(),),
    # O alone is 128 registers per thread at 16 rows per warp: Q and V come from shared memory one fragment at a time.
    256: (KernelConfig(block_q=64, block_kv=32, num_warps=4, q_mma_load_k_fragments=2, k_mma_load_k_fragments=1,
                       v_mma_load_k_fragments=1, mma_double_buffer_loads=False),),
}


# The sm80 family's decode tiles (few query rows per kv head: decoding against a KV cache, packed GQA heads), on
# every GPU: one warp of 16 rows (rows <= 16; head dims 64 and 256), four warps on 32 rows (head dims 64 and 128:
# two warps per 16 rows, each taking half of every key block) or on 64 (rows <= 64); 64-key blocks (32 at head dim
# 256, where O takes 128 registers). The 32-row tile takes 128-key blocks; at head dim 64 also 64, for pages of
# fewer than 64 keys (a 128-key block over such pages is copied row by row, which cost it 70% at D = 64, 5% at 128;
# over 64-key pages it is two strided tiles, TWO_PAGE_BLOCK_KV). Small tiles leave room for several thread blocks
# per SM, whose K/V copies keep HBM busy; the split-KV plan counts them (csrc/common/split_plan.h).
# jax_flash/selection.py picks them by rows per tile and page size.
# H100, MQA one row (32 rows per kv head), 128 x 1024 keys, us, 64-row tile / 32-row 128-key / 32-row 64-key:
# fp16 D = 64 17.7 / 12.4 / 14.4, in 64-key pages 21.0 / 21.0 / 18.3; bf16 D = 128 33.8 / 30.8 / 32.7, in 64-key
# pages 35.4 / 32.3 / 34.4. At head dim 128 the 32-row tile serves 1-16 rows too, faster than a one-warp 16-row
# tile of 64-key blocks (H100, bf16, one row, us, 32-row / one-warp: 32/32 heads 64 x 4096 keys 1433 / 1516, 128 x
# 1024 731 / 748, 1 x 32768 187 / 190; 32/8 heads 8 x 16384 186 / 191, 128 x 1024 193 / 200, 1 x 4096 16.5 /
# 17.3), which head dim 128 therefore does not build.
DECODE_CONFIGS: dict[int, tuple[KernelConfig, ...]] = {
    64: (KernelConfig(block_q=16, block_kv=64, num_warps=1, q_mma_load_k_fragments=0),
         KernelConfig(block_q=32, block_kv=128, num_warps=4, q_mma_load_k_fragments=0),
         KernelConfig(block_q=32, block_kv=64, num_warps=4, q_mma_load_k_fragments=0),
         KernelConfig(block_q=64, block_kv=64, num_warps=4, q_mma_load_k_fragments=0)),
    128: (KernelConfig(block_q=32, block_kv=128, num_warps=4, q_mma_load_k_fragments=0),
          KernelConfig(block_q=64, block_kv=64, num_warps=4, q_mma_load_k_fragments=0)),
    256: (KernelConfig(block_q=16, block_kv=32, num_warps=1, q_mma_load_k_fragments=2, mma_double_buffer_loads=False),
          KernelConfig(block_q=64, block_kv=32, num_warps=4, q_mma_load_k_fragments=2, k_mma_load_k_fragments=1,
                       v_mma_load_k_fragments=1, mma_double_buffer_loads=False)),
}


# The Hopper family (csrc/sm90/): built for every dtype at these head dims; cfg=None picks among them on sm_90
# (jax_flash/selection.py). Head dim 64: three consumer warpgroups (192 x 128 tiles; the two-consumer 128- and
# 192-key configs stay as alternatives). Head dims 128 and 256: pingpong without a right bound, none with one (it is
# also the pingpong ablation of `--configs compiled`). Head dim 256: 80-key blocks, the most that fit beside one Q
# buffer with no O buffer of its own (O staged in the last key block's K / V: csrc/sm90/traits.cuh, kOInKV; 64-key
# blocks were 4-8% slower).
SM90_CONFIGS: dict[int, tuple[KernelConfig, ...]] = {
    64: (KernelConfig.sm90(block_kv=128), KernelConfig.sm90(block_kv=192),
         KernelConfig.sm90(block_kv=128, consumer_warpgroups=3), KernelConfig.sm90(block_kv=208)),
    128: (KernelConfig.sm90(block_kv=128), KernelConfig.sm90(block_kv=128, pingpong=False)),
    256: (KernelConfig.sm90(block_kv=80), KernelConfig.sm90(block_kv=80, pingpong=False)),
}


def shipped_kernels() -> Iterator[tuple[str, int, KernelConfig]]:
    """(dtype, head_dim, config) for every kernel the default build compiles, without duplicates, in a fixed order."""
    seen = set()
    for dtype in GPU_DTYPES:
        for head_dim in GPU_HEAD_DIMS:
            candidates = list(TUNED_CONFIGS[head_dim]) + list(DECODE_CONFIGS[head_dim])
            if head_dim == 128 and dtype == "bfloat16":  # the progression exists to be benchmarked: one dtype
                candidates += list(PROGRESSION_CONFIGS)
            candidates += list(SM90_CONFIGS.get(head_dim, ()))
            for cfg in candidates:
                key = (dtype, head_dim, cfg)
                if key in seen:
                    continue
                reason = cfg.fits(head_dim)
                if reason is not None:
                    raise ValueError(f"shipped config {cfg} does not fit head_dim={head_dim}: {reason}")
                seen.add(key)
                yield key


# The sm90 FP8 forward (float8_e4m3fn q, k, v; csrc/sm90/launch_fp8.cuh): the C++ DType value of e4m3 and the
# config per head dim an FP8 call on Hopper runs with cfg=None (fp8_config); an sm90 cfg picks another compiled one
# (the candidates: build with -DJAX_FLASH_CONFIG_SET=sweep_fp8).
FP8_DTYPE, FP8_DTYPE_VALUE = "float8_e4m3fn", 2
# One config per head dim at every key length; O += P V runs in parts, each into a fresh fp32 accumulator
# (csrc/sm90/traits.cuh, kPvParts). Head dim 128: 128-key blocks with the intra-warpgroup overlap, P V whole, Q
# read from shared memory (8-16 bytes spilled). Head dim 256: 128-key blocks without the overlap (Q, two K stages,
# two V^T stages and two raw V buffers of 32 KB each, O staged in the last key block's K / V^T; 48 bytes spilled
# masked, none unmasked). H200, A/B harness, against 64-key blocks without the overlap, 512 / 1024 / 2048 / 4096 /
# 8192 / 16384 keys: non-causal +9 / +13 / +13 / +14 / +13 / +14%, causal +0 / +8 / +11 / +15 / +14 / +14%.
FP8_CONFIGS = {128: KernelConfig.sm90(block_kv=128, stages=2, consumer_warpgroups=2, pingpong=True),
               256: KernelConfig.sm90(block_kv=128, stages=2, consumer_warpgroups=2, pingpong=True, overlap=False)}
# (Not among them: 192-key blocks at head dim 128 with the overlap spill 316 bytes and ran at 0.72-0.81x the
# 128-key ones; without it they gain up to 6% causal and lose up to 3% non-causal. Without the overlap, whole
# 128-column parts at head dim 128 run at 0.96-1.02x FP8 v9's kernel once Q is read into registers per key block
# (held across the key loop, ptxas gives P the live Q fragments' registers: docs/PERFORMANCE.md, FP8 v9).)
FP8_SWEEP_CONFIGS: dict[int, tuple[KernelConfig, ...]] = {
    128: (KernelConfig.sm90(block_kv=192, overlap=False), KernelConfig.sm90(block_kv=128, stages=3)),
    256: (KernelConfig.sm90(block_kv=64, overlap=False),),
}


def fp8_config(head_dim: int) -> KernelConfig:
    """The config an FP8 call of this head dim (a key of FP8_CONFIGS) runs with cfg=None."""
    return FP8_CONFIGS[head_dim]


def fp8_kernels(name: str) -> list[tuple[int, KernelConfig]]:
    """(head_dim, config) of the FP8 kernels of kernel set `name`: FP8_CONFIGS, plus FP8_SWEEP_CONFIGS for
    "sweep_fp8"."""
    kernels = list(FP8_CONFIGS.items())
    if name == "sweep_fp8":
        kernels += [(hd, cfg) for hd, cfgs in FP8_SWEEP_CONFIGS.items() for cfg in cfgs]
    return kernels


def _sweep(block_q, block_kv, num_warps, q, k, v, double_buffer=True) -> KernelConfig:
    return KernelConfig(block_q=block_q, block_kv=block_kv, num_warps=num_warps, q_mma_load_k_fragments=q,
                        k_mma_load_k_fragments=k, v_mma_load_k_fragments=v, mma_double_buffer_loads=double_buffer)


# Candidates the tuning sweep times (build with -DJAX_FLASH_CONFIG_SET=sweep, then
# `python -m jax_flash.benchmark --configs compiled`): tile shapes x where Q lives x fragment chunking.
SWEEP_CONFIGS: dict[int, tuple[KernelConfig, ...]] = {
    # around the 4-warp x 32-row winner of the first sweep, spill-free ones only
    128: (_sweep(128, 32, 4, 2, 1, 1), _sweep(128, 32, 4, 1, 1, 1), _sweep(128, 32, 4, 2, 2, 1),
          _sweep(128, 32, 4, 4, 1, 1), _sweep(128, 32, 4, 2, 1, 2), _sweep(64, 32, 4, 2, 2, 1),
          _sweep(64, 64, 4, 2, 2, 1), _sweep(128, 64, 8, 2, 1, 1), _sweep(128, 64, 8, 0, 2, 1)),
    64: (_sweep(128, 32, 4, 0, 0, 0), _sweep(128, 64, 4, 0, 1, 1), _sweep(128, 64, 4, 0, 2, 1, False),
         _sweep(128, 32, 4, 2, 1, 1), _sweep(64, 128, 4, 0, 1, 1), _sweep(64, 64, 4, 0, 0, 0),
         _sweep(128, 64, 4, 1, 1, 1), _sweep(128, 32, 4, 0, 2, 2)),
}


# The sm90 family's candidates (build with -DJAX_FLASH_CONFIG_SET=sweep_sm90): the schedule without intra-warpgroup
# overlap (pingpong on the exponentials), three consumer warpgroups (192-row tiles) with and without pingpong;
# 64-key blocks at head dim 256. (Earlier sweeps' block_kv 160 / 192, pingpong off and 3 stages: docs/PERFORMANCE.md.)
SM90_SWEEP_CONFIGS: dict[int, tuple[KernelConfig, ...]] = {
    128: (KernelConfig.sm90(block_kv=128, overlap=False), KernelConfig.sm90(block_kv=128, pingpong=False, overlap=False),
          KernelConfig.sm90(block_kv=64, consumer_warpgroups=3, pingpong=False),
          KernelConfig.sm90(block_kv=64, consumer_warpgroups=3)),
    64: (KernelConfig.sm90(block_kv=128, overlap=False), KernelConfig.sm90(block_kv=192, overlap=False),
         KernelConfig.sm90(block_kv=128, consumer_warpgroups=3, pingpong=False),
         KernelConfig.sm90(block_kv=128, consumer_warpgroups=3)),
    256: (KernelConfig.sm90(block_kv=64), KernelConfig.sm90(block_kv=64, pingpong=False)),
}


def kernel_set(name: str) -> list[tuple[str, int, KernelConfig]]:
    """(dtype, head_dim, config) of a build's kernel set: "shipped" (default), "sweep" (shipped + SWEEP_CONFIGS for
    bfloat16), "sweep_sm90" (shipped + SM90_SWEEP_CONFIGS for bfloat16), "sweep_fp8" (shipped; its FP8 kernels:
    fp8_kernels) or "all" (every sm80 config of
    tuning_space() that fits)."""
    kernels = list(shipped_kernels())
    if name == "sweep":
        kernels += [("bfloat16", hd, cfg) for hd, cfgs in SWEEP_CONFIGS.items() for cfg in cfgs]
    elif name == "sweep_sm90":
        kernels += [("bfloat16", hd, cfg) for hd, cfgs in SM90_SWEEP_CONFIGS.items() for cfg in cfgs]
    elif name == "all":
        kernels = [(dtype, hd, cfg) for dtype in GPU_DTYPES for hd in GPU_HEAD_DIMS for cfg in tuning_space()
                   if cfg.fits(hd) is None]
    elif name not in ("shipped", "sweep_fp8"):
        raise ValueError(f"unknown kernel set {name!r}; choose shipped, sweep, sweep_sm90, sweep_fp8 or all")
    unique = []
    for kernel in kernels:
        if kernel[2].fits(kernel[1]) is not None:
            raise ValueError(f"{kernel} does not fit: {kernel[2].fits(kernel[1])}")
        if kernel not in unique:
            unique.append(kernel)
    return unique


def tuning_space() -> Iterator[KernelConfig]:
    """Every valid combination of the knobs (the opt-in JAX_FLASH_CONFIG_SET=all build); filtered per head dim by fits()."""
    frags = (0, 1, 2, 4)
    for bq in _BLOCK_Q:
        for bkv in _BLOCK_KV:
            for warps in _NUM_WARPS:
                for qf in frags:
                    for kf in frags:
                        for vf in frags:
                            for db in (False, True):
                                try:
                                    yield KernelConfig(block_q=bq, block_kv=bkv, num_warps=warps,
                                                       q_mma_load_k_fragments=qf, k_mma_load_k_fragments=kf,
                                                       v_mma_load_k_fragments=vf, mma_double_buffer_loads=db)
                                except ValueError:
                                    continue
