// Tuning options of the grouped GEMM and the grouped MLP, passed per call
// (grouped_gemm.h, GroupedMlpConfig::gemm): no process-wide state. The
// defaults are the tuned ones; a field left at its default ("0" or "-1")
// keeps it. The options change speed only, never results, except `kernel`,
// which picks a kernel with its own (deterministic) order of additions, and
// `fp8_promote`.
#pragma once

namespace moeflow {

// Which grouped GEMM kernel runs (on GPUs that have it; else the portable one).
enum class GemmKernel {
  kAuto,            // the fastest that applies (Hopper: the TMA kernel for stacked weights)
  kSm90CpAsync,     // Hopper cp.async + wgmma kernel, 128 x 256 tiles (forward)
  kSm90Narrow,      // the same with 128 x 128 tiles (forward)
  kPortable,        // mma.sync kernel (any GPU from sm_80); the MLP's FC1 then runs unfused
  kTmaDirectStore,  // the TMA kernel, outputs by masked stores instead of TMA stores
};

// Tile of the blockwise FP8 forward and wgrad (rows x columns of the output
// per block).
enum class Fp8Tile {
  kAuto,     // the measured best for the shape (docs/tuning.md)
  k128x128,  // two consumer warpgroups, m64n128 each
  k128x192,  // two consumer warpgroups, m64n192 each (a quarter fewer L2 bytes per FLOP)
  k192x128,  // three consumer warpgroups, m64n128 each (the same saving on the A side)
};

struct GemmOptions {
  GemmKernel kernel = GemmKernel::kAuto;
  // TMA kernel pipeline stages, 2-4; 0: 4 (fewer when shared memory is short).
  int stages = 0;
  // TMA kernel epilogue staging buffers per consumer warpgroup, 2-5; 0: 2.
  int bufs = 0;
  // m tiles per raster band (all kernels; at most 4096); 0: 8.
  int raster = 0;
  // K slices consumer warpgroup 1 trails consumer 0 (TMA); -1: 1.
  int stagger = -1;
  // Block b starts (b % 8) * desync * 1000 cycles late (TMA); -1: 4 for wgrad, else 0.
  int desync = -1;
  // Fused FC1 / dGLU: K slices the stage ring skips the stage the helper warps
  // hold; -1: min(20, K/64 - 16).
  int hold = -1;
  // Grouped MLP dgrad: the dGLU fused into the FC2 dgrad epilogue (Hopper).
  bool fused_dglu = false;
  // Blockwise FP8 forward and wgrad: the tile shape.
  Fp8Tile fp8_tile = Fp8Tile::kAuto;
  // Tensorwise FP8 forward and wgrad (one scale per operand): 128-wide K
  // slices the tensor cores sum before each float32 promotion; 0: all of K
  // (fast accumulation); -1: 4. Changes the rounding of the result (as
  // `kernel`).
  int fp8_promote = -1;
};

}  // namespace moeflow
