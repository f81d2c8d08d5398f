"""Which compiled config `cfg=None` runs: one table per (GPU architecture, dtype, head dim), with the reason.

Rule: look up (sm major*10+minor, dtype, head_dim) in DEFAULTS; if absent, fall back to the same key for the
nearest older architecture in the table; if still absent (or not compiled in), the first compiled config for
(dtype, head_dim) in registry order. On CPU, cfg=None uses CPU_DEFAULT (only its block sizes matter there).
"""

from __future__ import annotations

from jax_flash.config import SM90_CONFIGS, TUNED_CONFIGS, KernelConfig

# The CPU handler tiles queries and keys by these block sizes; 64 x 64 fp32 tiles stay in L1/L2.
CPU_DEFAULT = KernelConfig(block_q=64, block_kv=64, num_warps=4)

# (arch, dtype, head_dim) -> config. Entries carry the measurement that put them there (benchmark, device, date).
# The numbers below were timed inside XLA's while loop (`--loop while`, the benchmark's method until session 3), which
# adds the same fixed cost per call to every config: the orderings that chose these entries stand, the absolute
# values at short S are low (docs/NOTES.md, "Timing method").
# H200 sweep, bf16, 2026-11-22 (docs/sweep_h200_1.json; `.ci/gpu.sh` with JAX_FLASH_CONFIG_SET=sweep and
# `--configs compiled --seqs 2048,16384`), TFLOP/s at S=2048 / S=16384 (cuDNN 525 / 594 at D=128, 400 / 451 at D=64):
#   D=128: q128_kv32_w4 f2-1-1 296 / 343 (best of 15); q64_kv64_w4 f0-2-1 288 / 319; q128_kv64_w8 f0-2-1 272 / 318.
#   D=64:  q128_kv32_w4 f0-0-0 239 / 292 (best at 16384); q64_kv128_w4 f0-1-1 257 / 287; q128_kv64_w8 200 / 235.
# Sweep 2 with the v5 kernel (docs/sweep_h200_2.json), S=2048 / 4096 / 16384:
#   D=64:  q128_kv64_w4 f0-1-1 297 / 314 / 332 (best: the default now); f0-2-1 no double buffer 296 / 311 / 333;
#          q128_kv32_w4 f0-0-0 (the old default) 240 / 265 / 292. cuDNN 398 / 428 / 449.
#   D=128: every 4-warp x 32-row kv32 variant within 2%: f1-1-1 311 / 328 / 344, f2-1-1 305 / 329 / 344,
#          f4-1-1 306 / 326 / 345; 8-warp and 64-row tiles 238-277. cuDNN 525 / 584 / 596.
# With the v5 kernel (docs/NOTES.md, docs/bench_h200_v5.json) the defaults give, bf16 non-causal, S=2048 / 16384:
#   D=128 310 / 349 (cuDNN 526 / 609), D=256 266 / 297 (cuDNN 555 / 658); D=64 (sweep-2 default, later run)
#   295 / 332 (cuDNN 394 / 448).
# D=256 (q64_kv32_w4 f2-1-1, no double buffer) is the only config of that head dim that fits: not swept.
# sm_80 has not been measured: it uses the same entries (the A100 numbers of the seed favour the same 4-warp tiles).
# sm_90 uses the Hopper family (csrc/sm90/) at head dims 64 and 128 (and 256 since session 10, below): its first
# version (TMA producer, two wgmma consumers, no overlap yet) already beat the sm80 family everywhere on the H200
# (bench run 1 of issue 7, 2026-11-22, S = 2048 / 8192, TFLOP/s, sm90 vs sm80 vs cuDNN):
#   bf16 D=128 non-causal 480 / 558 vs 310 / 339 (cuDNN 543 / 589); causal 335 / 529 vs 231 / 304 (381 / 548)
#   bf16 D=64  non-causal 345 / 403 vs 300 / 327 (cuDNN 391 / 442); causal 266 / 374 vs 239 / 306 (302 / 417)
#   fp16 D=128 non-causal 457 / 531 vs 316 / 333 (cuDNN 482 / 580); fp16 D=64 353 / 397 vs 301 / 320.
# The current sm90 numbers are in docs/NOTES.md and the README table.
DEFAULTS: dict[tuple[int, str, int], KernelConfig] = {
    (arch, dtype, head_dim): (SM90_CONFIGS[head_dim][0] if arch == 90 else TUNED_CONFIGS[head_dim][0])
    for arch in (80, 90)
    for dtype in ("float16", "bfloat16")
    for head_dim in (64, 128)
}
# Head dim 256 on sm_90: the Hopper family (session 10, 2026-11-22, H200, bf16, A/B harness, docs/ab_session10/run1;
# TFLOP/s at S = 512 / 1024 / 4096 / 16384): 80-key blocks with pingpong 484 / 609 / 708 / 769 against 64-key blocks
# 484 / 571 / 673 / 710 (sm80's default: 266 / 297 at 2048 / 16384); causal 1024 / 4096: 80-key blocks without
# pingpong 403 / 591, with 402 / 577, 64-key blocks 412 / 560.
DEFAULTS.update({(90, dtype, 256): SM90_CONFIGS[256][0] for dtype in ("float16", "bfloat16")})

# sm_90 refinements by mask and key length: (head_dim, right_bounded) -> ((min_seq_k, config), ...) ascending; the
# last entry whose min_seq_k <= seq_k wins, else DEFAULTS. right_bounded = causal or a window with a right bound.
# H200, bf16, 2026-11-22, `--configs compiled --family sm90` with JAX_FLASH_CONFIG_SET=sweep_sm90, the dynamic
# tile scheduler (docs/sweep_h200_sm90_2.json; run 1, docs/sweep_h200_sm90_1.json, agrees within 3%),
# TFLOP/s at S = 1024 / 4096 / 16384:
#   D=128 non-causal: kv128 pingpong 452 / 610 / 619, no pingpong 441 / 594 / 613, kv160 399 / 598 / 614 (cuDNN
#         444 / 590 / 605)                                                              -> kv128 with pingpong
#   D=128 causal:     kv128 pingpong 287 / 500 / 549, no pingpong 295 / 517 / 565, kv160 272 / 500 / 560 (cuDNN
#         289 / 475 / 550)                                                              -> kv128 without pingpong
#   D=64 non-causal:  kv128 312 / 402 / 423, kv192 292 / 405 / 449, kv128 no pingpong 323 / 388 / 405, kv128 3 stages
#         311 / 393 / 423, kv192 no pingpong 265 / 358 / 392 (cuDNN 344 / 433 / 451)     -> kv192 from 4096 keys
#   D=64 causal:      kv128 202 / 332 / 396, kv192 193 / 353 / 428, kv128 3 stages 212 / 339 / 402 (cuDNN
#         225 / 369 / 419)                                                              -> kv192 from 4096 keys
#   (from 2048 in sessions 4-8; with v10 (session 9) kv128 is ahead at causal 2048 in two measurements: the sweep
#   356 vs 348 TFLOP/s, docs/sweep_h200_sm90_session9.json, and Nsight Compute 475.8 vs 486.1 us,
#   docs/ab_session9/run7; at 4096 kv192 stays ahead: 403 vs 392 in the sweep, 413 vs 408 timed in run7)
# Session 12: three consumer warpgroups (192 x 128 tiles) with P from registers, spill-free, A/B harness on the H200
# (bf16, docs/ab_session12/run2), TFLOP/s against the two-consumer configs shipped before:
#   D=64 non-causal 512 / 1024 / 2048 / 4096 / 16384: 396 / 434 / 486 / 503 / 530 vs 364 / 410 / 430 / 444 / 468
#   D=64 causal 1024 / 2048 / 4096 (each consumer stops at its own rows' last key block): 314 / 393 / 444 vs
#   314 / 367 / 408                                     -> three consumers, causal from 2048 keys
# Session 13: with three consumers a consumer's half-visible last key block runs at half width (csrc/sm90/traits.cuh,
# kHalfLastBlock); A/B harness on the H200 (bf16, docs/ab_session13/run1), causal D=64 512 / 1024 / 2048 keys:
#   three consumers 250 / 324 / 408 TFLOP/s vs the shipped 238 / 316 (two consumers) / 402  -> three consumers, causal too
# Session 17: the D=128 pingpong config holds Q in registers (csrc/sm90/traits.cuh, kQInRegs), non-causal +1.1 / +1.3 /
#   +2.7% at 1024 / 4096 / 16384 keys; the causal config, with or without pingpong, -1.0% at 512 keys and +0.2-0.6%
#   from 1024 with it (docs/ab_session17/run1)                    -> unchanged: pingpong non-causal, not causal.
#   Two consumers at D=64 causal, with Q in registers too: 235 / 310 / 362 / 400 TFLOP/s at 512 / 1024 / 2048 / 4096
#   keys vs three consumers 246 / 322 / 398 / 442 (docs/ab_session17/run6)              -> three consumers stay
SM90_BY_SHAPE: dict[tuple[int, bool], tuple[tuple[int, KernelConfig], ...]] = {
    (128, False): ((0, SM90_CONFIGS[128][0]),),
    (128, True): ((0, SM90_CONFIGS[128][1]),),
    (64, False): ((0, SM90_CONFIGS[64][2]),),
    (64, True): ((0, SM90_CONFIGS[64][2]),),
    (256, False): ((0, SM90_CONFIGS[256][0]),),
    (256, True): ((0, SM90_CONFIGS[256][1]),),
}


def default_gpu_config(arch: int, dtype: str, head_dim: int, compiled: list[KernelConfig], right_bounded: bool = False,
                       seq_k: int = 0) -> KernelConfig | None:
    """The config cfg=None runs on a GPU of compute capability `arch` (e.g. 90); None when nothing is compiled.
    `compiled` holds only configs this GPU can run (the caller drops the sm90 family below sm_90)."""
    if arch == 90:
        choice = [cfg for min_seq_k, cfg in SM90_BY_SHAPE.get((head_dim, right_bounded), ()) if min_seq_k <= seq_k]
        if choice and choice[-1] in compiled:
            return choice[-1]
    for table_arch in sorted({a for a, _, _ in DEFAULTS if a <= arch}, reverse=True):
        cfg = DEFAULTS.get((table_arch, dtype, head_dim))
        if cfg is not None and cfg in compiled:
            return cfg
    return compiled[0] if compiled else None
