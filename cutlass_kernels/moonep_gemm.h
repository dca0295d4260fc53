// Public C ABI of libmoonep_gemm.so: the CUTLASS sm90 grouped GEMMs of the routed experts (no
// torch inside).  Every export of the library is declared here; prep.cu, which defines them,
// includes this header, so the compiler checks each definition against its prototype.  Loaded
// with ctypes by moonep_ops/native.py.
//
// Conventions:
//   * Pointers are raw device pointers unless the argument says "host".  The library never
//     allocates or frees memory and keeps no pointer past the call: the caller owns every buffer
//     and keeps it alive until the work queued on `stream` has completed.
//   * moonep_grouped_gemm only enqueues work on `stream` (a cudaStream_t passed as void*; 0 is
//     the legacy default stream) and never synchronises the host; group sizes are read on the
//     device, so a call is capturable in a CUDA graph.
//   * Return codes differ from libmoonep_ep.so: 0 on success, -1 on failure with the message in
//     moonep_gemm_last_error() (no CUDA error codes).
//   * Shapes use the project's legend (moonep_ops/geometry.py): B = epn home experts (= slots)
//     per rank, G = 2B groups of a receive buffer (groups [0, B) home experts, [B, 2B) slots),
//     M rows of the buffer, and a weight W_g is [O, I] (nn.Linear layout).  The size arguments
//     keep CUTLASS-style names m, n, k: m = M (rows), n = O, k = I.  The operands keep CUTLASS's
//     names A, B, D (B here is an operand, not the legend's B; that one is `epn`).
//   * Elements are bf16 unless stated; every tensor is contiguous, every base pointer 16-byte
//     aligned (TMA), n and k multiples of 8.
#pragma once
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

// Bumped whenever an exported signature, the config table or the meaning of an argument changes
// (moonep_ops/native.py checks it at load).  8: two families of configs per kind (cluster 1 x 2
// and torch._grouped_mm's 2 x 1), one per call; more configs, so a longer tuning table; the
// MOONEP_GEMM_PDL flag.  9: every ABI 8 export unchanged plus the FP8 grouped GEMM
// (moonep_grouped_gemm_fp8, moonep_gemm_fp8_workspace_bytes); native.py loads either version
// (GEMM_ABI_VERSION 8, GEMM_FP8_ABI_VERSION 9) and calls the FP8 exports only from a library
// that reports 9.  10: the FP8 GEMM has several configs fused in one kernel, chosen on the
// device by its own cost model or forced (moonep_grouped_gemm_fp8 gains config, tuning and
// flags; moonep_gemm_fp8_num_configs and moonep_gemm_fp8_config_info); native.py accepts 8 and
// 10 and calls the FP8 exports only from a library that reports 10.  11: every ABI 10 export
// unchanged plus the MOONEP_GEMM_KEEP_TAIL flag (bf16 fwd / dgrad and the FP8 GEMM); native.py
// sends it only to a library that reports 11 (an older one zeroes the tail, which is allowed).
// 12: every ABI 11 export unchanged plus the FP8 weight-gradient grouped GEMM
// (moonep_grouped_gemm_fp8_wgrad, moonep_gemm_fp8_wgrad_workspace_bytes,
// moonep_gemm_fp8_wgrad_num_configs, moonep_gemm_fp8_wgrad_config_info); native.py calls them
// only from a library that reports 12.
#define MOONEP_GEMM_ABI_VERSION 12
#define MOONEP_API __attribute__((visibility("default")))

// kind: 0 fwd (y = x W^T), 1 dgrad (dx = dy W), 2 wgrad (dW += dy^T x, fp32),
//       3 wgrad_lp (dW = dy^T x written in bf16; empty groups' dW set to zero).
// flags (bit mask):
//   MOONEP_GEMM_KEEP_EMPTY_SLOTS  wgrad_lp and the FP8 wgrad only: an empty *slot* group
//       (g >= epn) is left untouched instead of zeroed.  The MoE backward writes slot grads into a pool whose
//       slots are zero outside a backward (reduce_grad re-zeroes what it consumes), so zeroing
//       the unused slots again would only burn O*I*2 bytes of bandwidth per unused slot.
#define MOONEP_GEMM_KEEP_EMPTY_SLOTS 1
//   MOONEP_GEMM_PDL  launch the GEMM kernel as a programmatic dependent launch of the prep
//       kernel: its CTAs may start (launch, rasterise, occupy SMs) while the prep kernel finishes,
//       and wait on the device for the prep grid's results before reading them.  Hides part of
//       the per-call launch gap; results are identical.
#define MOONEP_GEMM_PDL 2
//   MOONEP_GEMM_KEEP_TAIL  fwd / dgrad (and the FP8 GEMM): the rows of D at or past
//       cu_seqlens[G-1] are left as they are (torch._grouped_mm's contract) instead of zeroed.
//       The zeroing runs before the GEMM (which waits for the whole prep grid): on the H200
//       +12.5 us median on 60-176 MB tails, ~0 below 20 MB; callers that never read the tail
//       (the MoE layer's intermediates) skip it.
#define MOONEP_GEMM_KEEP_TAIL 4

/**
 * The ABI version this library was built with (MOONEP_GEMM_ABI_VERSION).
 */
MOONEP_API int moonep_gemm_abi_version(void);

/**
 * The message of the last failure of moonep_grouped_gemm or moonep_grouped_gemm_fp8 on the
 * calling host thread (thread-local, owned by the library; each such call clears it first).
 */
MOONEP_API const char* moonep_gemm_last_error(void);

/**
 * Compiled configs of `kind` (0..3), in the order of moonep_ops/gemm/cost_model.py CONFIGS and
 * of the config index below; 0 for an invalid kind.  The configs of a kind that share a cluster
 * shape (moonep_gemm_config_info's cluster_m, cluster_n) form a FAMILY, one fused kernel, and
 * follow one after the other: family 0 (cluster 1 x 2) first, then, for fwd, dgrad and wgrad_lp,
 * family 1 (cluster 2 x 1: torch._grouped_mm's cooperative 128x256x64 and ping-pong 64x128x128).
 */
MOONEP_API int moonep_gemm_num_configs(int kind);

/**
 * Geometry of one compiled config.
 *
 * @param kind  0 fwd, 1 dgrad, 2 wgrad, 3 wgrad_lp.
 * @param cfg   config index in [0, moonep_gemm_num_configs(kind)).
 * @param info  host int32 [8], output: {BM, BN, BK, cluster_m, cluster_n, pingpong (0/1),
 *              epilogue subtile width (0: CUTLASS's), swap_ab (0/1)}.
 * @return 0, or -1 for an invalid kind or cfg (info untouched, no message).
 */
MOONEP_API int moonep_gemm_config_info(int kind, int cfg, int* info);

/**
 * Bytes of device workspace one moonep_grouped_gemm call of (kind, G, sm_count) needs (problem
 * arrays for every config of the kind + their CUTLASS workspaces); 0 for an invalid kind or
 * G <= 0.  Depends on nothing else, so callers may cache it.
 */
MOONEP_API size_t moonep_gemm_workspace_bytes(int kind, int G, int sm_count);

/**
 * One grouped GEMM over the G groups of a receive buffer, on `stream`: a prep kernel (reads
 * cu_seqlens, writes the problem arrays into the workspace, chooses the config, zeroes output
 * tails), then one launch of the fused CUTLASS kernel of the call's family (that of the forced
 * config or of every candidate), which runs the chosen config.
 * Group g owns rows [cu_seqlens[g-1], cu_seqlens[g]) of the buffer (cu_seqlens[-1] := 0),
 * clamped to [0, m] on the device, so bad offsets never read or write out of bounds.  Group g
 * uses weight (or weight grad) g of B (D for wgrad) when g < epn, else g - epn of B_slot
 * (D_slot).
 *   fwd:      A = x_MI [m, k], B = W [epn, n, k] (W_g is [O, I]), D = y_MO [m, n].  Rows of D at
 *             or past cu_seqlens[G-1] are set to zero.
 *   dgrad:    A = dy_MO [m, n], B = W [epn, n, k], D = dx_MI [m, k].  Rows of D at or past
 *             cu_seqlens[G-1] are set to zero.
 *   wgrad:    A = dy_MO [m, n], B = x_MI [m, k]; D = dW of the home experts and D_slot = dW of
 *             the slots, fp32 [epn, n, k] each, accumulated into (beta = 1; empty groups
 *             untouched).  B_slot is unused.
 *   wgrad_lp: as wgrad with D, D_slot bf16 [epn, n, k], overwritten (beta = 0); the dW of an
 *             empty group is zeroed (slot groups: unless MOONEP_GEMM_KEEP_EMPTY_SLOTS).
 *
 * @param kind             0 fwd, 1 dgrad, 2 wgrad, 3 wgrad_lp.
 * @param config           config index to force (any family), or -1: the device cost model
 *                         evaluates every config in cand_mask and runs the one cost_model.pick
 *                         chooses (the cheapest; near-ties to the least MMA work).
 * @param raster           tile order of the persistent scheduler: 0 along m (co-resident CTAs
 *                         share a weight slice), 1 along n.
 * @param A                device, first operand (see the kinds above).
 * @param B                device, second operand: home-expert weights [epn, n, k] (fwd, dgrad)
 *                         or x_MI (wgrad).
 * @param B_slot           device, slot weights [epn, n, k] (fwd, dgrad); unused for wgrad (may
 *                         be NULL).
 * @param D                device, output: y / dx (fwd, dgrad), home-expert weight grads
 *                         (wgrad).
 * @param D_slot           device, slot weight grads [epn, n, k] (wgrad); unused for fwd/dgrad.
 * @param cu_seqlens       device int32 [G]: cumulative row ends of the groups (the planner's
 *                         cu_G), read by the prep kernel only.
 * @param G                groups: must be 2*epn and <= 1024.
 * @param epn              B of the legend: home experts (= slots) per rank.
 * @param m                M: rows of the buffer (m == 0: nothing is launched, returns 0).
 * @param n                O: output features of a weight (multiple of 8).
 * @param k                I: input features of a weight (multiple of 8).
 * @param tuning           host float32 [2 + 5*moonep_gemm_num_configs(kind) + 1], read during
 *                         the call only: {peak TF/s, HBM TB/s, then per config eta, bw_frac,
 *                         tau_sw_us, tau0_us, tau_epi_us, then the tie tolerance}
 *                         (moonep_ops/gemm/cost_model.py tuning_table(kind)).  May be NULL when
 *                         config >= 0.
 * @param cand_mask        bit c: config c is a candidate of the device choice (config == -1
 *                         only); bits past the kind's configs are ignored, and a mask with no
 *                         valid bit means every config of family 0.  The candidates must be of
 *                         one family (else -1); at most 6 fwd/dgrad candidates (the op passes
 *                         at most 5: the prep kernel's cost grows with each).
 * @param flags            MOONEP_GEMM_* bits (MOONEP_GEMM_KEEP_EMPTY_SLOTS: wgrad_lp only;
 *                         MOONEP_GEMM_KEEP_TAIL: fwd / dgrad only; MOONEP_GEMM_PDL: any
 *                         kind); an unknown bit fails.
 * @param workspace        device scratch of at least moonep_gemm_workspace_bytes(kind, G,
 *                         sm_count) bytes, no initialisation needed; one per concurrent call.
 *                         Bytes 0-3 (int32) receive the index of the config that ran (written
 *                         on the device by the prep kernel).
 * @param workspace_bytes  its size in bytes.
 * @param sm_count         SMs of the device, in [1, 1024]: the persistent grid and the cost
 *                         model's CTA count (and so the workspace size).
 * @param stream           cudaStream_t to launch on.
 * @return 0, or -1 with a message in moonep_gemm_last_error() (argument check, CUTLASS
 *         initialisation or a launch error).
 */
MOONEP_API int moonep_grouped_gemm(int kind, int config, int raster,
                                   const void* A, const void* B, const void* B_slot,
                                   void* D, void* D_slot, const int* cu_seqlens,
                                   int G, int epn, int m, int n, int k,
                                   const float* tuning, int cand_mask, int flags,
                                   void* workspace, size_t workspace_bytes, int sm_count,
                                   void* stream);

// =============================================================================================
// FP8 grouped GEMM with blockwise scaling (kernel_fp8_fwd.cu; the DeepSeek-V3 recipe).
// Configs (cluster 1 x 2, CUTLASS's FP8 blockwise-scaled mainloops: each 128-deep K block is
// accumulated by the tensor cores in fp32 and then promoted, times its two scales, into an fp32
// accumulator; no FP8 fast accumulation; bf16 output), in config-index order:
//   0 c128x128  cooperative 128 x 128 x 128;   1 p64x128  ping-pong 64 x 128 x 128.
// =============================================================================================

// Most configs the FP8 GEMM will ever list (the tuning table's stride).
#define MOONEP_GEMM_FP8_MAX_CONFIGS 8
// The FP8 tuning table: floats, for c in [0, MOONEP_GEMM_FP8_MAX_CONFIGS):
//   [c] fixed_us, [MAX + c] per_round_us, [2 MAX + c] per_kblock_us, then [3 MAX] mem_bytes_per_us
//   and [3 MAX + 1] tie_tol (see the cost model in kernel_fp8_fwd.cu; moonep_ops/gemm/tuning_fp8.py).
#define MOONEP_GEMM_FP8_TUNING_LEN (3 * MOONEP_GEMM_FP8_MAX_CONFIGS + 2)

/**
 * Number of FP8 configs compiled into this library (config indices 0 .. n-1).
 */
MOONEP_API int moonep_gemm_fp8_num_configs(void);

/**
 * Geometry of FP8 config `config` into out8[8]: BM, BN, BK, cluster_m, cluster_n, pingpong,
 * epilogue width (0: CUTLASS's), swap-AB (0).  Returns 0, or -1 for an index out of range.
 */
MOONEP_API int moonep_gemm_fp8_config_info(int config, int* out8);

/**
 * Bytes of device workspace one moonep_grouped_gemm_fp8 call of (G, sm_count) needs (the
 * per-group problem arrays + CUTLASS's workspace); 0 for G outside [1, 1024] or sm_count outside
 * [1, 1024].  Depends on nothing else, so callers may cache it.
 */
MOONEP_API size_t moonep_gemm_fp8_workspace_bytes(int G, int sm_count);

/**
 * D = A . B_g^T per group, on `stream`, with e4m3 operands and fp32 scales: a prep kernel (reads
 * cu_seqlens on the device, writes the problem arrays into the workspace, chooses the config,
 * zeroes the padding rows of D), then one launch of the fused CUTLASS kernel, which runs the
 * chosen config.  Never synchronises the host; capturable.  With C =
 * ceil(k/128) and P = ceil(n/128), the real values are A[m, j] * a_scale[m, j/128] and
 * B_g[o, j] * b_scale_g[o/128, j/128]; a last tile cut short by n or k is scaled like a full one.
 * Group g owns rows [cu_seqlens[g-1], cu_seqlens[g]) (cu_seqlens[-1] := 0), clamped to [0, M] on
 * the device; an empty group is skipped; rows at or past cu_seqlens[G-1] are set to zero.  Group
 * g uses weight g of b_local when g < epn, else g - epn of b_slot.  k need not be a multiple of
 * 128 (the last K tile is partial).
 *
 * @param a              device e4m3 [M, k] row-major (the rows of every group).
 * @param a_scale        device fp32 [M, C] row-major: a_scale[m, c] scales a[m, 128c : 128c+128].
 * @param b_local        device e4m3 [epn, n, k] (nn.Linear [O, I] per expert, k contiguous).
 * @param b_local_scale  device fp32 [epn, P, C] row-major: one scale per 128 x 128 block.
 * @param b_slot         device e4m3 [epn, n, k]: the slot weights (groups epn .. G-1).
 * @param b_slot_scale   device fp32 [epn, P, C].
 * @param d              device bf16 [M, n] row-major, output (every row written).
 * @param cu_seqlens     device int32 [G]: inclusive END row offsets of the groups (the planner's
 *                       cu_G), read by the prep kernel only.
 * @param G              groups: must be 2*epn and <= 1024.
 * @param epn            home experts (= slots) per rank, >= 1.
 * @param M              rows of a and d (M == 0: nothing is launched, returns 0).
 * @param n              output features O (multiple of 16).
 * @param k              input features I, the reduction (multiple of 16).
 * @param config         -1: the prep kernel chooses the config from the group sizes with the
 *                       cost model (needs `tuning`); 0 .. num_configs-1: that config.
 * @param tuning         host float[MOONEP_GEMM_FP8_TUNING_LEN], copied into the launch (NULL
 *                       allowed when config >= 0).
 * @param flags          MOONEP_GEMM_PDL (the GEMM as a programmatic dependent launch of
 *                       the prep kernel; results identical) and / or MOONEP_GEMM_KEEP_TAIL
 *                       (rows at or past cu_seqlens[G-1] left as they are, not zeroed).
 * @param workspace      device scratch of at least moonep_gemm_fp8_workspace_bytes(G, sm_count)
 *                       bytes, 256-byte aligned (any torch allocation is), no initialisation
 *                       needed; one per concurrent
 *                       call (keep it alive until the call's work has completed).
 * @param workspace_bytes  its size in bytes.
 * @param sm_count       SMs of the device, in [1, 1024]: the persistent grid.
 * @param stream         cudaStream_t to launch on.
 * @return 0, or -1 with a message in moonep_gemm_last_error() (argument check, CUTLASS
 *         initialisation or a launch error).  a, b_local, b_slot and d must be 16-byte aligned.
 */
MOONEP_API int moonep_grouped_gemm_fp8(const void* a, const float* a_scale, const void* b_local,
                                       const float* b_local_scale, const void* b_slot,
                                       const float* b_slot_scale, void* d,
                                       const int* cu_seqlens, int G, int epn, int M, int n, int k,
                                       int config, const float* tuning, int flags,
                                       void* workspace, size_t workspace_bytes, int sm_count,
                                       void* stream);

// =============================================================================================
// FP8 weight-gradient grouped GEMM with blockwise scaling (kernel_fp8_wgrad.cu; ABI 12):
//   dW_g [O, I] (bf16) = (dy * s_dy)[rows of g]^T . (x * s_x)[rows of g], fp32 accumulation,
// the reduction over each group's tokens.  The operands are token-major e4m3 copies with one
// fp32 scale per 1 x 128 tile along the tokens of one group (moonep::quantize_fp8_tokens,
// moonep_ops/ops/quantize_fp8.py): with Nb = floor(M/128) + G token tiles and Mp = 128 * Nb,
//   a_t [O, Mp] e4m3 (dy^T), a_t_scale [Nb, O] fp32; b_t [I, Mp] e4m3 (x^T), b_t_scale [Nb, I];
// group g (rows [cu[g-1], cu[g]) of the buffer, M_g of them) owns the token tiles
// t0_g = floor(cu[g-1] / 128) + g .. t0_g + ceil(M_g / 128) - 1, i.e. the columns
// [128 t0_g, 128 t0_g + M_g) of a_t / b_t and the rows t0_g.. of the scales.
// Configs (cluster 1 x 2, CUTLASS's FP8 blockwise mainloops with scale granularity (1, 1, 128):
// each 128-token K block is promoted, times s_dy[kb, o] * s_x[kb, i], into an fp32 accumulator;
// bf16 output), in config-index order:
//   0 c128x128  cooperative 128 x 128 x 128;   1 p64x128  ping-pong 64 x 128 x 128.
// The tuning table has the FP8 GEMM's layout (MOONEP_GEMM_FP8_TUNING_LEN floats; the model is
// in kernel_fp8_wgrad.cu, its host mirror moonep_ops/gemm/fp8_wgrad_cost.py).
// =============================================================================================

/**
 * Number of FP8 wgrad configs compiled into this library (config indices 0 .. n-1).
 */
MOONEP_API int moonep_gemm_fp8_wgrad_num_configs(void);

/**
 * Geometry of FP8 wgrad config `config` into out8[8]: BM, BN, BK, cluster_m, cluster_n,
 * pingpong, epilogue width (0: CUTLASS's), swap-AB (0).  Returns 0, or -1 for an index out of
 * range.
 */
MOONEP_API int moonep_gemm_fp8_wgrad_config_info(int config, int* out8);

/**
 * Bytes of device workspace one moonep_grouped_gemm_fp8_wgrad call of (G, sm_count) needs; 0
 * for G or sm_count outside [1, 1024].  Depends on nothing else (callers may cache it).
 */
MOONEP_API size_t moonep_gemm_fp8_wgrad_workspace_bytes(int G, int sm_count);

/**
 * dW_g = A_g^T-reduction per group, on `stream`: a prep kernel (reads cu_seqlens on the device,
 * orders the groups largest first, chooses the config, writes the problem arrays, zeroes the dW
 * of empty groups), then one launch of the fused CUTLASS kernel.  Never synchronises the host;
 * capturable.  Group g writes d_local[g] when g < epn, else d_slot[g - epn] (every element of
 * it, once, beta = 0); an empty group's dW is zeroed, except an empty slot group's with
 * MOONEP_GEMM_KEEP_EMPTY_SLOTS (left untouched).  The group offsets are clamped to
 * [0, 128 * (n_tiles - G) + 127], so bad offsets never read or write out of bounds.
 *
 * @param a_t            device e4m3 [m, 128 * n_tiles]: dy^T, token-major tiles (see above).
 * @param a_t_scale      device fp32 [n_tiles, m]: one scale per (token tile, row of a_t).
 * @param b_t            device e4m3 [n, 128 * n_tiles]: x^T.
 * @param b_t_scale      device fp32 [n_tiles, n].
 * @param d_local        device bf16 [epn, m, n]: dW of the home experts (groups 0 .. epn-1).
 * @param d_slot         device bf16 [epn, m, n]: dW of the slots (groups epn .. G-1).
 * @param cu_seqlens     device int32 [G]: inclusive END row offsets of the groups.
 * @param G              groups: 2*epn, <= 1024.
 * @param epn            home experts (= slots) per rank, >= 1.
 * @param n_tiles        Nb = floor(M/128) + G: the token tiles of the operands.
 * @param m              O, rows of dW (multiple of 16).
 * @param n              I, columns of dW (multiple of 16).
 * @param config         -1: chosen on the device by the cost model (needs `tuning`); else forced.
 * @param tuning         host float[MOONEP_GEMM_FP8_TUNING_LEN] (NULL allowed when config >= 0).
 * @param flags          MOONEP_GEMM_PDL and / or MOONEP_GEMM_KEEP_EMPTY_SLOTS.
 * @param workspace      device scratch of at least moonep_gemm_fp8_wgrad_workspace_bytes(G,
 *                       sm_count) bytes, 256-byte aligned, one per concurrent call.
 * @param workspace_bytes  its size in bytes.
 * @param sm_count       SMs of the device, in [1, 1024]: the persistent grid.
 * @param stream         cudaStream_t to launch on.
 * @return 0, or -1 with a message in moonep_gemm_last_error().  a_t, b_t, d_local and d_slot
 *         must be 16-byte aligned.
 */
MOONEP_API int moonep_grouped_gemm_fp8_wgrad(const void* a_t, const float* a_t_scale,
                                             const void* b_t, const float* b_t_scale,
                                             void* d_local, void* d_slot, const int* cu_seqlens,
                                             int G, int epn, int n_tiles, int m, int n,
                                             int config, const float* tuning, int flags,
                                             void* workspace, size_t workspace_bytes,
                                             int sm_count, void* stream);

// =============================================================================================
// Diagnostics (MOONEP_DIAGNOSTICS builds only: `python -m moonep_ops.build --diagnostics`,
// moonep_ops/lib/diagnostics/).  The library exports no extra function; its prep kernel also
// writes the selector's timing into the call's workspace (int64 words, SM cycles of clock64,
// written on the device by block 0 of the prep kernel):
//   bytes  8-15  the choice itself: from the model's start (rows known; wgrad: LPT order known)
//                to the chosen config being known; 0 when there is nothing to choose (config
//                >= 0, or one candidate: bytes 16-39 are then untouched);
//   bytes 16-23  block 0 from entry to the end;
//   bytes 24-31  from entry to the rows being known (first barrier);
//   bytes 32-39  from entry to the model's start.
// The production prep kernel reads no clock and writes none of these bytes.
// =============================================================================================

#ifdef __cplusplus
}
#endif
