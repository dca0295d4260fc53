// C ABI of libmoonep_gemm.so (loaded with ctypes by moonep_ops/_native.py; no torch inside).
// Every pointer argument is a raw device pointer except `tuning`, a host array of floats.
#pragma once
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOONEP_GEMM_ABI_VERSION 7
#define MOONEP_API __attribute__((visibility("default")))

// kind: 0 fwd (y = x W^T), 1 dgrad (dx = dy W), 2 wgrad (dW += dy^T x, fp32),
//       3 wgrad_lp (dW = dy^T x written in bf16; empty groups' dW set to zero).
// flags (bit mask):
//   MOONEP_GEMM_KEEP_EMPTY_SLOTS  wgrad_lp only: an empty *slot* group (g >= epn) is left
//       untouched instead of zeroed.  The MoE backward writes slot grads into a pool whose
//       slots are zero outside a backward (reduce_grad re-zeroes what it consumes), so zeroing
//       the unused slots again would only burn N*K*2 bytes of bandwidth per unused slot.
#define MOONEP_GEMM_KEEP_EMPTY_SLOTS 1
MOONEP_API int moonep_gemm_abi_version(void);
MOONEP_API const char* moonep_gemm_last_error(void);
MOONEP_API int moonep_gemm_num_configs(int kind);
// info[8] = {BM, BN, BK, cluster_m, cluster_n, pingpong, epilogue subtile width (0: CUTLASS's),
// swap_ab}; returns 0 on success.
MOONEP_API int moonep_gemm_config_info(int kind, int cfg, int* info);
// Device workspace one call needs (problem arrays for every config + CUTLASS workspaces).
MOONEP_API size_t moonep_gemm_workspace_bytes(int kind, int G, int sm_count);

// One grouped GEMM on `stream`.  Rows of group g are [cu[g-1], cu[g]) (cu[-1] := 0), read on
// the device.  config >= 0 forces a config; config == -1 evaluates the cost model on the device
// for every config in cand_mask and runs the one gemm_cost_model.pick chooses (the cheapest;
// near-ties to the least MMA work): one launch of the kind's fused kernel either way.
// tuning = gemm_cost_model.tuning_table(kind): peak TF/s, HBM TB/s, 5 floats per config, the
// tie tolerance.  Workspace bytes 0-3: the config that ran; 8-15: SM cycles of the choice.
//   fwd:   A = x [M,K] bf16, B = w_local/w_slot [epn,N,K] bf16, D = y [M,N] bf16
//   dgrad: A = dy [M,N] bf16, B = w_local/w_slot [epn,N,K] bf16, D = dx [M,K] bf16
//   wgrad: A = dy [M,N] bf16, B = x [M,K] bf16, D = grad_local, D_slot = grad_slot [epn,N,K]
//          fp32, accumulated into (beta = 1).  B_slot is unused.
//   wgrad_lp: as wgrad with D, D_slot bf16 [epn,N,K], overwritten (beta = 0).
// For fwd/dgrad the rows of D at or past cu[G-1] are set to zero.
// Returns 0, or -1 with a message in moonep_gemm_last_error().
MOONEP_API int moonep_grouped_gemm(int kind, int config, int raster,
                        const void* A, const void* B, const void* B_slot,
                        void* D, void* D_slot, const int* cu_seqlens,
                        int G, int epn, int M, int N, int K,
                        const float* tuning, int cand_mask, int flags,
                        void* workspace, size_t workspace_bytes, int sm_count,
                        void* stream);

#ifdef __cplusplus
}
#endif
