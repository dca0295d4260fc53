// moonep_plan: the MoonEP planner (policy "moonep") on the device, bit-exact with the torch op
// moonep::plan (moonep_ops/planner.py).  Plain C ABI, no host synchronisation, no allocation:
// capturable in a CUDA graph.  Implementation and algorithm notes: plan_kernels.cu.
#pragma once
#include "moonep_ep.h"

// Bytes of device scratch moonep_plan / moonep_plan_group need (0 for invalid sizes).
MOONEP_EXPORT size_t moonep_plan_workspace_bytes(int R, int E, int s, int K);

// Plan one rank's dispatch from the gathered histograms, entirely on the device.
//   hist_RX  [R, E+3] row r = [bincount of rank r's top-k ids (E), bad_ids_flag, s_r,
//                              total_num_tokens (-1: uniform s)]
//   topk_sK  [s, K]   this rank's expert ids (duplicates inside a token allowed)
//   dst_N [s*K], cu_G [2*epn], etc_RB [R, epn], zf_G2 [2*epn, 2], stats_2 [2]: the five outputs
//   of moonep::plan.  err: device int32 word, MOONEP_ERR_* bits OR-ed in (never cleared here).
// Two kernel launches: the group plan (one block; steps 1-3) fused with per-chunk expert
// histograms of topk (extra blocks of the same launch), then the slot assignment (step 4).
MOONEP_EXPORT int moonep_plan(
    const int32_t* hist_RX, const int32_t* topk_sK,
    int s, int K, int rank, int R, int E, int S, int token_padding, int NvS,
    int32_t* dst_N, int32_t* cu_G, int32_t* etc_RB, int32_t* zf_G2, int32_t* stats_2,
    void* workspace, size_t workspace_bytes, int32_t* err, cudaStream_t stream);

// Steps 1-3 only (one launch of one block): cu_G, etc_RB, zf_G2, stats_2 and the tables
// moonep_plan's slot assignment reads from the workspace.  topk is not read (s, K size the
// workspace and the uniform-s checks).  For benchmarks and for callers that only need the
// group tables.
MOONEP_EXPORT int moonep_plan_group(
    const int32_t* hist_RX, int s, int K, int rank, int R, int E, int S, int token_padding,
    int NvS, int32_t* cu_G, int32_t* etc_RB, int32_t* zf_G2, int32_t* stats_2,
    void* workspace, size_t workspace_bytes, int32_t* err, cudaStream_t stream);

// Benchmarks only: the group kernel's block 0 returns after stage `stop` (0: set-up, 1: histogram
// load and per-element checks, 2: row-sum validation + rank quotas, 3: split, 4: layout; 99, the
// default: the full plan; 197: rank quotas round by round (no rank_quotas batches); 198: every
// greedy loop round by round (no batches, no single-donor closed form); 199: as 198 and without
// the packed-key fast paths; for tests and A/B benchmarks); below 99 moonep_plan skips the slot
// assignment, to time the stages by difference.  Process-wide, not thread-safe.
MOONEP_EXPORT void moonep_plan_debug_stop(int stop);
// Benchmarks only: launch the group kernel with (1, the default) or without (0) programmatic
// dependent launch.  Process-wide, not thread-safe.
MOONEP_EXPORT void moonep_plan_debug_pdl(int on);
// Benchmarks only: int64[8] device buffer for the group kernel's clock64 stage stamps (null: off).
MOONEP_EXPORT void moonep_plan_debug_stamps(void* dev_int64x8);
// Benchmarks only: int64[5 * 32] device buffer, each warp's clock64 at the end of each stage
// (R <= 64 kernels only).
MOONEP_EXPORT void moonep_plan_debug_warp_stamps(void* dev_int64x160);
