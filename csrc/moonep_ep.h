// Public C ABI of libmoonep_ep.so: the GPU data plane over symmetric memory (barrier, histogram
// exchange, dispatch, combine, prefetch_weight, reduce_grad: ep_kernels.cu), the device planner
// (plan_kernels.cu and its plan_* files) and the routed experts' fused SwiGLU (swiglu.cu).  Every export of the
// library is declared here, and every .cu file of csrc/ includes this header, so the compiler
// checks each definition against its prototype.  Loaded with ctypes by moonep_ops/native.py.
//
// Conventions (every function below):
//   * Pointers are raw device pointers unless the argument says "host".  The library never
//     allocates, frees or keeps a pointer past the call: the caller owns every buffer and keeps
//     it alive until the work queued on `stream` has completed.
//   * Every launcher only enqueues work on `stream` (a cudaStream_t; `void* stream` is the same
//     handle, 0 is the legacy default stream) and never synchronises the host, so every call is
//     capturable in a CUDA graph.  It returns 0, or a cudaError_t code with the message in
//     moonep_ep_last_error() (launch or argument errors only: errors found on the device are
//     OR-ed into the caller's `err` word, MOONEP_ERR_* bits, and read lazily by the host).
//   * Shapes use the project's legend (moonep_ops/geometry.py): R ranks, E routed experts,
//     B = E/R home experts (= redundant slots) per rank, G = 2B receive groups per rank, S tokens
//     per rank at capacity, s tokens of this rank in this call, K top-k, N = s*K entries, D model
//     dim, F expert FFN dim, M rows of a receive buffer, NvS receive rows at capacity
//     (align_up(S*K + (tp-1)*G, tp)), nvs_s receive rows this call, tp token_padding.
//     hist_RX means a tensor of shape [R, X] (X = E+3), and so on.
//   * Peer tables: a symmetric region (the same allocation on every rank, every rank's copy
//     mapped into this process) is passed as a device array of R base pointers, entry p = rank
//     p's copy (`peers[rank]` is the local one).  Kernels write a peer's region only at rows the
//     plan gives this rank.
//   * Epochs: `epoch` is this rank's local uint64 barrier counter (device memory, starts at 0,
//     never written by the host afterwards).  Every op issues the same barriers in the same order
//     on every rank, so the counters agree at matching points; the dispatch row descriptors are
//     stamped with it (ep_kernels.cu).
//
// Diagnostics: a library built with `python -m moonep_ops.build --diagnostics` (macro
// MOONEP_DIAGNOSTICS, written to moonep_ops/lib/diagnostics/) also exports the planner hooks
// of the last section; the production library exports none of them and its kernels carry no
// trace of them.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <cuda_runtime_api.h>  // cudaStream_t

// Bumped whenever an exported signature changes (moonep_ops/native.py checks it at load).
#define MOONEP_EP_ABI_VERSION 7

#ifdef __cplusplus
#define MOONEP_EXPORT extern "C" __attribute__((visibility("default")))
#else
#define MOONEP_EXPORT __attribute__((visibility("default")))
#endif

// Error-flag bits, OR-ed into the caller's int32 error word on the device (never cleared by the
// library) and read lazily by the host.
enum MoonepEpError {
  MOONEP_ERR_BAD_IDS = 1,        // some rank passed expert ids outside [0, E)
  MOONEP_ERR_HIST = 2,           // a histogram row does not sum to s_r*K, or s/total disagree
  MOONEP_ERR_PLAN = 4,           // the plan overflowed (more than B slots, a row past nvs_s)
  MOONEP_ERR_TIMEOUT = 8,        // a cross-rank barrier timed out (a peer never arrived)
};

// dtype codes of the launchers' `dtype` arguments.
enum MoonepEpDtype {
  MOONEP_DTYPE_BF16 = 0,
  MOONEP_DTYPE_F16 = 1,
  MOONEP_DTYPE_F32 = 2,
  MOONEP_DTYPE_F64 = 3,
};

// =============================================================================================
// Library (ep_common.cu)
// =============================================================================================

/**
 * The ABI version this library was built with (MOONEP_EP_ABI_VERSION).
 */
MOONEP_EXPORT int moonep_ep_abi_version(void);

/**
 * The message of the last failed call on the calling host thread (thread-local, owned by the
 * library, valid until the next failing call on this thread; "" if none failed yet).  A
 * successful call does not clear it: read it only after a non-zero return code.
 */
MOONEP_EXPORT const char* moonep_ep_last_error(void);

// =============================================================================================
// Data plane (ep_kernels.cu).  Semantics: docs/data_plane.md.  Protocol per op (B = barrier):
//   dispatch  hist_publish, B, moonep_plan, dispatch_send, B, dispatch_recv, B
//   combine   combine_stage (or publish_ptrs), B, combine_recv, B
//   prefetch  B, push_weights, B
//   reduce    B, reduce_grads, B, zero_slots
// Every op ends with a barrier, so no peer overwrites a staging region this rank still reads.
// =============================================================================================

/**
 * Cross-rank barrier: signal every peer, then wait for every peer (one block of 32 threads).
 * It lets the next kernel on the stream, if launched with programmatic dependent launch (the
 * planner's group kernel), become resident while it waits.  A timeout sets MOONEP_ERR_TIMEOUT
 * and returns (no trap, no hang); once that bit is set, later barriers signal but no longer wait.
 *
 * @param sig_peers   device array [R] of uint64_t*: peer table of the symmetric `sig` region
 *                    (uint64 [R] on every rank, zeroed once at set-up).  Writes sig_peers[p][rank]
 *                    for every p, waits until every sig_peers[rank][p] reaches the new epoch.
 * @param epoch       device uint64 [1]: this rank's barrier counter, incremented by 1 (local,
 *                    not symmetric).
 * @param rank        this rank, in [0, R).
 * @param R           ranks of the group.
 * @param err         device int32 [4]: err[0] the error word (MOONEP_ERR_TIMEOUT set on a
 *                    timeout); on the group's first timeout err[1] = op, err[2] = the peer it
 *                    waited for + 1, err[3] = the barrier's epoch (low 31 bits); all 0 before.
 * @param timeout_ns  nanoseconds (of the device's %globaltimer) a thread waits for one peer
 *                    before it gives up.
 * @param op          the caller's code of this barrier (> 0), recorded on a timeout (the Python
 *                    side's table: moonep_ops/native.py BARRIER_OPS).
 * @param stream      cudaStream_t to launch on.
 */
MOONEP_EXPORT int moonep_ep_barrier(void* sig_peers, void* epoch, int rank, int R, void* err,
                                    long long timeout_ns, int op, void* stream);

/**
 * Histogram exchange: the bincount of this rank's expert ids, written with (bad-ids flag, s,
 * total) as row `rank` of every peer's histogram table (one block of 1024 threads, (E+1)*4
 * bytes of shared memory).  Follow it with moonep_ep_barrier before planning.
 *
 * @param topk        device int32 [N]: this rank's top-k expert ids topk_sK, flattened.
 * @param N           entries: s*K.
 * @param E           routed experts.
 * @param rank        this rank, in [0, R).
 * @param R           ranks of the group.
 * @param s           tokens of this rank in this call (written to column E+1).
 * @param total       total tokens over all ranks this call, or -1 when every rank has s tokens
 *                    (written to column E+2).
 * @param hist_peers  device array [R] of int32_t*: peer table of the symmetric `hist` region
 *                    (int32 hist_RX, X = E+3, on every rank).  Row `rank` of every copy becomes
 *                    [bincount of topk over [0, E) (E), bad flag (0/1), s, total].
 * @param err         device int32 [1]: MOONEP_ERR_BAD_IDS set if an id is outside [0, E)
 *                    (such ids are not counted).
 * @param stream      cudaStream_t to launch on.
 */
MOONEP_EXPORT int moonep_ep_hist_publish(const void* topk, int N, int E, int rank, int R, int s,
                                         int total, void* hist_peers, void* err, void* stream);

/**
 * Dispatch, source half: copy this rank's s rows into its x_stage region (for the destinations
 * to pull) and write one stamped row descriptor and route weight per entry into the
 * destinations' desc / wland regions.  Follow it with moonep_ep_barrier, then
 * moonep_ep_dispatch_recv on every rank.
 *
 * @param x            device [s, D] rows of `row_bytes` bytes each (any dtype, contiguous):
 *                     this rank's tokens.
 * @param row_bytes    bytes of one row: D * element size.
 * @param w            device float32 [s, K] route weights, or NULL (weights sent as 0).
 * @param dst          device int32 dst_N [s*K]: the plan's destinations (moonep_plan): entry n
 *                     = d*NvS + row on rank d for a primary entry, -(d*NvS + row) - 1 for a
 *                     duplicate (an earlier entry of the same token already goes to d).
 * @param s            tokens of this rank in this call.
 * @param K            top-k.
 * @param rank         this rank, in [0, R).
 * @param R            ranks of the group.
 * @param S            capacity (tokens per rank): a descriptor names its source row as
 *                     rank*S + token.
 * @param NvS          receive rows at capacity (the divisor of the dst encoding).
 * @param nvs_s        receive rows of every destination this call; an entry at or past it sets
 *                     MOONEP_ERR_PLAN and is not sent.
 * @param x_stage      device [S, row_bytes] bytes: this rank's copy of the symmetric x_stage
 *                     region; rows [0, s) are overwritten (cudaMemcpyAsync on `stream`).
 * @param desc_peers   device array [R] of int64_t*: peer table of the symmetric desc region
 *                     (int64 [NvS] on every rank).  desc[row] = (stamp << 32) | value, stamp =
 *                     low 32 bits of (*epoch + 1), value = rank*S + token for a primary, -(row
 *                     of the primary on that rank) - 1 for a duplicate.
 * @param wland_peers  device array [R] of float*: peer table of the symmetric wland region
 *                     (float32 [NvS] on every rank): the route weight of each row sent.
 * @param epoch        device uint64 [1]: this rank's barrier counter (read only).
 * @param err          device int32 [1]: MOONEP_ERR_PLAN set for an entry outside the plan.
 * @param stream       cudaStream_t to launch on.
 */
MOONEP_EXPORT int moonep_ep_dispatch_send(const void* x, int64_t row_bytes, const void* w,
                                          const void* dst, int s, int K, int rank, int R, int S,
                                          int NvS, int nvs_s, void* x_stage, void* desc_peers,
                                          void* wland_peers, const void* epoch, void* err,
                                          void* stream);

/**
 * Dispatch, destination half (after the barrier that follows every rank's dispatch_send): fill
 * rows [0, nvs_s) of a fresh receive buffer.  Rows whose descriptor carries this call's stamp
 * are pulled from the source's x_stage (primaries) or copied from the primary's row on this rank
 * (duplicates, by a second kernel); every other row is zero.  If any MOONEP_ERR_* bit is set in
 * `err`, every row is zero.  Grid: min(nvs_s/8, 8*num_sms) blocks of 256 threads, one warp per
 * row; 16-byte vector copies when row_bytes % 16 == 0 (then h and every x_stage must be 16-byte
 * aligned).
 *
 * @param h             device [nvs_s, row_bytes] bytes (M = nvs_s rows of D elements), output,
 *                      every row written.
 * @param w_out         device float32 [nvs_s], output: each row's route weight (0 for rows
 *                      nobody sent).
 * @param nvs_s         receive rows this call.
 * @param row_bytes     bytes of one row: D * element size.
 * @param desc          device int64 [NvS]: this rank's copy of the desc region (read only).
 * @param wland         device float32 [NvS]: this rank's copy of the wland region (read only).
 * @param xstage_peers  device array [R] of const char*: peer table of the x_stage region.
 * @param R             ranks of the group.
 * @param S             capacity (decodes a descriptor's source row rank*S + token).
 * @param epoch         device uint64 [1]: this rank's barrier counter (read only; the stamp a
 *                      row must carry is its low 32 bits).
 * @param err           device int32 [1]: error word (read only here).
 * @param num_sms       SMs of the device (sizes the grid).
 * @param stream        cudaStream_t to launch on.
 */
MOONEP_EXPORT int moonep_ep_dispatch_recv(void* h, void* w_out, int nvs_s, int64_t row_bytes,
                                          const void* desc, const void* wland,
                                          const void* xstage_peers, int R, int S,
                                          const void* epoch, void* err, int num_sms,
                                          void* stream);

/**
 * Combine, destination half (staged mode): copy the expert outputs h (and their route weights)
 * into this rank's staging regions for the sources to pull.  Only cudaMemcpyAsync, no kernel.
 * Follow it with moonep_ep_barrier, then moonep_ep_combine_recv on every rank.
 *
 * @param h          device [n_rows, row_bytes] bytes: this rank's expert outputs (M rows).
 * @param n_rows     rows of h (M <= NvS; not checked).
 * @param row_bytes  bytes of one row: D * element size.
 * @param w          device float32 [n_rows], or NULL (w_stage untouched).
 * @param y_stage    device [NvS, row_bytes] bytes: this rank's copy of the symmetric y_stage
 *                   region; rows [0, n_rows) are overwritten.
 * @param w_stage    device float32 [NvS]: this rank's copy of the symmetric w_stage region.
 * @param stream     cudaStream_t to enqueue the copies on.
 */
MOONEP_EXPORT int moonep_ep_combine_stage(const void* h, int64_t n_rows, int64_t row_bytes,
                                          const void* w, void* y_stage, void* w_stage,
                                          void* stream);

/**
 * Combine, destination half (direct mode: one address space, e.g. a one-rank group): instead of
 * staging h, publish where it is.  Writes (h, w, rows) into column `rank` of every peer's int64
 * [3, R] pointer table (row 0: h, row 1: w, row 2: rows).  One block of 128 threads.
 *
 * @param table_peers  device array [R] of int64_t*: peer table of the symmetric int64 [3, R]
 *                     pointer table.
 * @param rank         this rank, in [0, R).
 * @param R            ranks of the group.
 * @param h            device pointer to this rank's expert outputs [rows, D] (stored, not read;
 *                     it must stay valid until the peers' combine_recv has completed).
 * @param w            device pointer to their float32 [rows] route weights, or NULL.
 * @param rows         rows of h (M).
 * @param stream       cudaStream_t to launch on.
 */
MOONEP_EXPORT int moonep_ep_publish_ptrs(void* table_peers, int rank, int R, const void* h,
                                         const void* w, int64_t rows, void* stream);

/**
 * Combine, source half (after the barrier): y[t] = sum over k = 0..K-1 of the row entry (t, k)
 * was sent to, accumulated in fp32 (fp64 for MOONEP_DTYPE_F64) in k order and rounded once;
 * with `weighted`, of that row times its route weight (the product in the accumulation type,
 * rounded, then added: no FMA, so bitwise the CPU reference).
 * Grid (s, ceil(D / (128 * V))) blocks of 128 threads, V = 16 bytes / element size when
 * D % V == 0 (16-byte loads; the staged rows must then be 16-byte aligned), else 1.  An entry
 * whose rank is >= R or whose row is past that rank's rows contributes 0 and sets
 * MOONEP_ERR_PLAN; if any MOONEP_ERR_* bit is already set, y and w_out are all zero.
 *
 * @param y             device [s, D] of `dtype`, output, every element written.
 * @param w_out         device float32 [s, K], output: the route weight each entry's row carries
 *                      (read back from wstage_peers), or NULL (not computed).
 * @param s             tokens of this rank in this call.
 * @param K             top-k.
 * @param D             model dim: elements per row.
 * @param dtype         element type of y and the staged rows (MoonepEpDtype: 0 bf16, 1 f16,
 *                      2 f32, 3 f64); another value returns cudaErrorInvalidValue.
 * @param weighted      non-zero: multiply every row by its route weight (read from
 *                      wstage_peers, which must then be given: the rows' weights were staged or
 *                      published with them) before adding it; 0: add the rows as they are.
 * @param dst           device int32 dst_N [s*K]: the dispatch's plan (moonep_plan).
 * @param NvS           receive rows at capacity (the divisor of the dst encoding).
 * @param n_rows        staged mode: rows each peer's y_stage holds (bounds every entry's row).
 *                      Unused when rows_of is not NULL.
 * @param rows_of       device int64 [R]: rows each rank published (direct mode: row 2 of the
 *                      publish_ptrs table), or NULL (staged mode: n_rows for every rank).
 * @param ystage_peers  device array [R] of `dtype` pointers: each rank's staged rows [rows, D]
 *                      (staged: the y_stage peer table; direct: row 0 of the pointer table).
 * @param wstage_peers  device array [R] of const float*: each rank's route weights [rows]
 *                      (staged: the w_stage peer table; direct: row 1 of the pointer table);
 *                      read only when w_out is not NULL or `weighted` is non-zero.
 * @param R             ranks of the group.
 * @param err           device int32 [1]: error word.
 * @param stream        cudaStream_t to launch on.
 */
MOONEP_EXPORT int moonep_ep_combine_recv(void* y, void* w_out, int s, int K, int D, int dtype,
                                         int weighted, const void* dst, int NvS, int n_rows,
                                         const void* rows_of, const void* ystage_peers,
                                         const void* wstage_peers, int R, void* err,
                                         void* stream);

/**
 * prefetch_weight: every owner pushes its home experts into the slots that hold them.  For
 * every (d, b) with e = etc[d*B + b] >= 0 and e / B == rank, tensor i's row e % B of `local`
 * is copied to row b of rank d's slot tensor, for all n tensors.  Does nothing if `err` has
 * MOONEP_ERR_TIMEOUT.  Grid (min(R*B*chunks, 4*num_sms), n) blocks of 512 threads, 32 KiB per
 * work item.  Put a barrier before (the peers are done with the slots) and after.
 *
 * @param n          tensors per call, in [1, 8] (else cudaErrorInvalidValue).
 * @param local      host array [n] of device pointers: this rank's home tensors [B, row_bytes[i]]
 *                   (an expert's weight flattened into one row of bytes).  The host arrays are
 *                   read during the call only.
 * @param peers      host array [n] of device pointers, each a device array [R] of char*: the peer
 *                   table of slot tensor i ([B, row_bytes[i]] bytes on every rank).
 * @param row_bytes  host int64 [n]: bytes of one expert's row of tensor i.
 * @param etc        device int32 etc_RB [R, B]: experts_to_copy of the plan (global expert id in
 *                   slot b of rank d, or -1).
 * @param R          ranks of the group.
 * @param B          home experts (= slots) per rank: E/R.
 * @param rank       this rank, in [0, R).
 * @param err        device int32 [1]: error word (read only).
 * @param num_sms    SMs of the device (sizes the grid).
 * @param stream     cudaStream_t to launch on.
 */
MOONEP_EXPORT int moonep_ep_push_weights(int n, const void* const* local, const void* const* peers,
                                         const int64_t* row_bytes, const void* etc, int R, int B,
                                         int rank, const void* err, int num_sms, void* stream);

/**
 * reduce_grad: every owner pulls the slot grads of its home experts and adds them into its local
 * grads in place, one slot at a time in ascending (src*B + b), in fp32 (bf16 grads: read once,
 * summed in fp32, rounded once, RNE).  Does nothing if `err` has MOONEP_ERR_TIMEOUT.  Shared
 * memory (2*R*B + B + 1)*4 bytes <= 48 KiB (else cudaErrorInvalidValue).  Put a barrier before
 * (every slot grad complete) and after (every owner has read the slots), then zero_slots.
 *
 * @param n          tensors per call, in [1, 8] (else cudaErrorInvalidValue).
 * @param local      host array [n] of device pointers: this rank's home grads [B, row_bytes[i] /
 *                   element size], of `dtype`, updated in place.
 * @param peers      host array [n] of device pointers, each a device array [R] of char*: the peer
 *                   table of slot grad tensor i ([B, row_bytes[i]] bytes on every rank).
 * @param row_bytes  host int64 [n]: bytes of one expert's row of tensor i.
 * @param etc        device int32 etc_RB [R, B]: experts_to_copy of the plan.
 * @param R          ranks of the group.
 * @param B          home experts (= slots) per rank: E/R.
 * @param rank       this rank, in [0, R).
 * @param err        device int32 [1]: error word (read only).
 * @param num_sms    SMs of the device (sizes the grid).
 * @param dtype      MOONEP_DTYPE_F32 or MOONEP_DTYPE_BF16, the same for all n tensors (else
 *                   cudaErrorInvalidValue).
 * @param stream     cudaStream_t to launch on.
 */
MOONEP_EXPORT int moonep_ep_reduce_grads(int n, const void* const* local, const void* const* peers,
                                         const int64_t* row_bytes, const void* etc, int R, int B,
                                         int rank, const void* err, int num_sms, int dtype,
                                         void* stream);

/**
 * Zero this rank's consumed slots: row b of every slot tensor for which etc[rank*B + b] >= 0.
 * Grid (min(B*chunks, 4*num_sms), n) blocks of 512 threads.
 *
 * @param n          tensors per call, in [1, 8] (else cudaErrorInvalidValue).
 * @param slots      host array [n] of device pointers: this rank's slot tensors [B, row_bytes[i]]
 *                   bytes.
 * @param row_bytes  host int64 [n]: bytes of one slot's row of tensor i.
 * @param etc        device int32 etc_RB [R, B]: experts_to_copy of the plan (row `rank` read).
 * @param B          slots per rank: E/R.
 * @param rank       this rank.
 * @param num_sms    SMs of the device (sizes the grid).
 * @param stream     cudaStream_t to launch on.
 */
MOONEP_EXPORT int moonep_ep_zero_slots(int n, const void* const* slots, const int64_t* row_bytes,
                                       const void* etc, int B, int rank, int num_sms,
                                       void* stream);

// =============================================================================================
// SwiGLU of the routed experts (swiglu.cu): bf16 in and out, fp32 math, elementwise over
// n = M*F elements of each tensor (any shape, contiguous).  Pointers 16-byte aligned.  n <= 0
// launches nothing and returns 0.  The plain kernels: a thread per 8 elements (n/2048 blocks of
// 256 threads); the gated ones below say their grids.
// =============================================================================================

/**
 * a = bf16(silu(g) * u), silu(g) = g * sigmoid(g).
 *
 * @param g        device bf16 [M, F]: gate projection.
 * @param u        device bf16 [M, F]: up projection.
 * @param a        device bf16 [M, F], output.
 * @param n        elements of each tensor: M*F.
 * @param num_sms  unused (the grid covers every pack; kept in the ABI).
 * @param stream   cudaStream_t to launch on.
 */
MOONEP_EXPORT int moonep_ep_swiglu_fwd(const void* g, const void* u, void* a, int64_t n,
                                       int num_sms, void* stream);

/**
 * dg = bf16(da * u * sigmoid(g) * (1 + g * (1 - sigmoid(g)))), du = bf16(da * silu(g)), and
 * a = bf16(silu(g) * u) recomputed (for w2's weight grad instead of saved).
 *
 * @param g        device bf16 [M, F]: gate projection (forward input).
 * @param u        device bf16 [M, F]: up projection (forward input).
 * @param da       device bf16 [M, F]: grad of the forward output a.
 * @param dg       device bf16 [M, F], output: grad of g.
 * @param du       device bf16 [M, F], output: grad of u.
 * @param a        device bf16 [M, F], output: the forward output, recomputed.
 * @param n        elements of each tensor: M*F.
 * @param num_sms  unused (the grid covers every pack; kept in the ABI).
 * @param stream   cudaStream_t to launch on.
 */
MOONEP_EXPORT int moonep_ep_swiglu_bwd(const void* g, const void* u, const void* da, void* dg,
                                       void* du, void* a, int64_t n, int num_sms, void* stream);

/**
 * The gated variant of the routed experts with biases and gpt-oss's clamped SwiGLU
 * (moonep::moe_experts_ext): with grp the row's group (the number of cu entries <= the row),
 * g' = g + b1[grp], u' = u + b3[grp], gc = min(g', limit), uc = clamp(u', -limit, limit):
 * a = bf16(gc * sigmoid(alpha * gc) * (uc + offset)).  swiglu: alpha 1, limit inf, offset 0.
 *
 * @param g, u     device bf16 [M, F]: gate and up projections (GEMM outputs, no bias).
 * @param b1, b3   device bf16 [G, F] per-group gate / up biases, or null (no bias).
 * @param cu       device int32 [G]: inclusive end rows of the groups (cu_seqlens).
 * @param G        groups; rows past cu[G-1] get no bias (their output is unread).
 * @param F        columns, a multiple of 8 (else cudaErrorInvalidValue).
 * @param a        device bf16 [M, F], output.
 * @param n        elements of each tensor: M*F (a multiple of F).
 * @param alpha, limit, offset  the activation's parameters.
 * @param num_sms  unused (a thread per pack of 8; kept in the ABI).
 * @param stream   cudaStream_t to launch on.
 */
MOONEP_EXPORT int moonep_ep_glu_fwd(const void* g, const void* u, const void* b1, const void* b3,
                                    const void* cu, int G, int64_t F, void* a, int64_t n,
                                    float alpha, float limit, float offset, int num_sms,
                                    void* stream);

/**
 * Backward of moonep_ep_glu_fwd (arguments as there; da the grad of a):
 * dg = bf16(g' <= limit ? da * (uc + offset) * sig * (1 + alpha * gc * (1 - sig)) : 0),
 * du = bf16(-limit <= u' <= limit ? da * gc * sig : 0), sig = sigmoid(alpha * gc), and a
 * recomputed.  dg, du are the grads of g and u (and of the biases' row copies).
 */
MOONEP_EXPORT int moonep_ep_glu_bwd(const void* g, const void* u, const void* da, const void* b1,
                                    const void* b3, const void* cu, int G, int64_t F, void* dg,
                                    void* du, void* a, int64_t n, float alpha, float limit,
                                    float offset, int num_sms, void* stream);

/**
 * The fp32 elements of the workspace (`work`) that moonep_ep_glu_bwd_bias_grads (num_sums 2,
 * row_dots 0) or moonep_ep_bias_scale_rows_bwd (num_sums 1 with db2 else 0, row_dots 1) needs:
 * num_sums tile-sum arrays [M / 128 + G + 1, C] (one row per tile of up to 128 rows of one
 * group), then with row_dots the row sums per 256 columns [ceil(C / 256), M].  Host only;
 * -1 for M < 0, G < 1, C <= 0 or num_sums < 0.
 *
 * @param M         rows of the tensors.
 * @param G         groups (the length of cu).
 * @param C         columns: F or D.
 * @param num_sums  tensors whose group sums the call makes.
 * @param row_dots  non-zero: the call also sums each row (d_rows).
 */
MOONEP_EXPORT int64_t moonep_ep_row_tile_work(int64_t M, int G, int64_t C, int num_sums,
                                              int row_dots);

/**
 * moonep_ep_glu_bwd with the bias grads in the same pass (the experts with biases): dg, du, a
 * bitwise moonep_ep_glu_bwd's, for every row of [M, F] (rows past cu[G-1] included, with no
 * bias), and db1[g] = sum of dg's rows of group g, db3[g] = the same of du, in fp32 over the
 * bf16 values, in an order fixed by the code: tiles of up to 128 rows of one group by 256
 * columns, in a tile 8 row lanes (lane r: rows r, r + 8, ... ascending) added in lane order,
 * then a group's tiles ascending (run to run bitwise and for any num_sms; no atomics; not
 * torch's order).  Rows past cu[G-1] are not summed (their values may be anything, NaN too).
 * Two kernels: the row tiles (a block of 256 threads per tile and 256 columns, at most
 * 32*num_sms blocks, taking the rest grid-stride), then the sums over each group's tiles.
 *
 * @param g, u, da    device bf16 [M, F]: as moonep_ep_glu_bwd.
 * @param b1, b3      device bf16 [G, F] per-group gate / up biases, or null (no bias).
 * @param cu          device int32 [G]: inclusive end rows of the groups, ascending, cu[G-1] <= M.
 * @param G           groups, >= 1.
 * @param F           columns, a multiple of 8 (else cudaErrorInvalidValue).
 * @param dg, du, a   device bf16 [M, F], outputs.
 * @param db1, db3    device fp32 [G, F], outputs, every element written (an empty group: 0).
 * @param work        device fp32 workspace of moonep_ep_row_tile_work(M, G, F, 2, 0) elements
 *                    (its contents on entry are not read).
 * @param M           rows, >= 0 (M = 0: db1, db3 zero).
 * @param alpha, limit, offset  the activation's parameters.
 * @param num_sms     SMs of the device (sizes the grids, not the results; <= 0: 132).
 * @param stream      cudaStream_t to launch on.
 */
MOONEP_EXPORT int moonep_ep_glu_bwd_bias_grads(const void* g, const void* u, const void* da,
                                               const void* b1, const void* b3, const void* cu,
                                               int G, int64_t F, void* dg, void* du, void* a,
                                               void* db1, void* db3, void* work, int64_t M,
                                               float alpha, float limit, float offset,
                                               int num_sms, void* stream);

/**
 * The route-weight pass of moonep::moe_experts_ext with the down bias:
 * z[m] = bf16((y[m] + b2[grp(m)]) * w[m]), fp32 math (bitwise the torch formula).
 *
 * @param y        device bf16 [M, D]: the down projection (no bias).
 * @param b2       device bf16 [G, D] per-group down biases, or null.
 * @param cu       device int32 [G]: inclusive end rows of the groups; later rows get no bias.
 * @param G, D     groups and columns (D a multiple of 8, else cudaErrorInvalidValue).
 * @param w        device fp32 [M]: the rows' route weights.
 * @param z        device bf16 [M, D], output.
 * @param M        rows.
 */
MOONEP_EXPORT int moonep_ep_bias_scale_rows(const void* y, const void* b2, const void* cu, int G,
                                            int64_t D, const void* w, void* z, int64_t M,
                                            int num_sms, void* stream);

/**
 * Its backward, with the down bias's grad in the same pass: dy[m] = bf16(dz[m] * w[m]) (bitwise
 * the torch formula), d_rows[m] = sum_D dz * (y + b2[grp(m)]) in fp32 (per 256 columns: each
 * thread's 8, then a shuffle tree over the warp; then the 256-column sums ascending: not
 * torch's order), every row of [M, D]; with db2, db2[g] = sum of dy's rows of group g in fp32,
 * in the order of moonep_ep_glu_bwd_bias_grads's sums (rows past cu[G-1] not summed).  Two
 * kernels, as there: the row tiles, then the sums over the tiles.
 *
 * @param dz       device bf16 [M, D]: the grad of z.
 * @param y, b2, cu, G, D, w  as moonep_ep_bias_scale_rows (cu ascending, cu[G-1] <= M).
 * @param dy       device bf16 [M, D], output.
 * @param d_rows   device fp32 [M], output.
 * @param db2      device fp32 [G, D], output (every element written; an empty group: 0), or
 *                 null (no sums).
 * @param work     device fp32 workspace of moonep_ep_row_tile_work(M, G, D, db2 ? 1 : 0, 1)
 *                 elements (its contents on entry are not read).
 * @param M        rows, >= 0.
 * @param num_sms  SMs of the device (sizes the grids, not the results; <= 0: 132).
 * @param stream   cudaStream_t to launch on.
 */
MOONEP_EXPORT int moonep_ep_bias_scale_rows_bwd(const void* dz, const void* y, const void* b2,
                                                const void* cu, int G, int64_t D, const void* w,
                                                void* dy, void* d_rows, void* db2, void* work,
                                                int64_t M, int num_sms, void* stream);

// =============================================================================================
// Device planner (plan_kernels.cu): the planner of policies "moonep" and "cost" on the device,
// bit-exact with the torch op moonep::plan (moonep_ops/planner/) for every histogram that
// passes validation.  No host synchronisation, no allocation: capturable in a CUDA graph.
// Algorithm notes: docs/planner.md; the planner's files: plan_internal.cuh.
// Argument checks (else cudaErrorInvalidValue and a message): 1 <= R <= 1024, E a positive
// multiple of R, 1 <= K <= 127, 1 <= s <= S, 0 <= rank < R, tp >= 1, R*S*K < 2^31,
// 0 <= slack_ppm <= 10^6, 0 <= replica_cost < 2^40, with slack_ppm > 0 (policy "cost")
// R <= 64 and E/R <= 256, NvS >= align_up(SK + (tp-1)*G, tp) with SK = S*K, or
// slack_cap(S*K) = ceil(S*K * (10^6 + slack_ppm) / 10^6) with a slack, R*NvS < 2^31,
// workspace_bytes large enough, no NULL pointer argument.
// =============================================================================================

/**
 * Raise the dynamic shared-memory limit of every planner kernel on the current device (no stream
 * work, idempotent), so the first dispatch makes no attribute call.  SymmBackend calls it when a
 * Buffer is built.
 * @return 0, or -1 with moonep_ep_last_error() set
 */
MOONEP_EXPORT int moonep_plan_prepare(void);

/**
 * Bytes of device workspace moonep_plan / moonep_plan_group need; 0 for invalid sizes (R < 1,
 * E not a positive multiple of R, s < 1, K outside [1, 127]).
 */
MOONEP_EXPORT size_t moonep_plan_workspace_bytes(int R, int E, int s, int K);

/**
 * Plan this rank's dispatch from the gathered histograms.  Two kernel launches on `stream`: the
 * group plan (block 0: validation, rank quotas, split, layout, the per-expert piece table),
 * fused with the per-chunk expert histograms of topk_sK (blocks 1..), then the slot assignment
 * of every entry.  The first is launched with programmatic dependent launch: it may become
 * resident while the previous kernel on the stream still runs, and reads nothing before that
 * kernel has completed.  An invalid histogram plans as an empty one (nothing moves) and sets
 * an error bit, so every output stays in range whatever the input.
 *
 * @param hist_RX          device int32 [R, E+3]: row r = [bincount of rank r's top-k ids (E),
 *                         bad-ids flag, s_r, total tokens (-1: every rank has s)], as written
 *                         by moonep_ep_hist_publish (read only).
 * @param topk_sK          device int32 [s, K]: this rank's expert ids (duplicates inside a
 *                         token allowed; an id outside [0, E) sets MOONEP_ERR_BAD_IDS and is
 *                         clamped).
 * @param s                tokens of this rank in this call.
 * @param K                top-k.
 * @param rank             this rank, in [0, R).
 * @param R                ranks of the group.
 * @param E                routed experts (B = E/R).
 * @param S                capacity: max tokens per rank per call.
 * @param token_padding    tp: every receive group's rows are padded to a multiple of tp.
 * @param NvS              receive rows at capacity (the geometry's NvS, or more; with a slack
 *                         the geometry's NvS of that slack, Geometry(slack_ppm=...).NvS).
 * @param slack_ppm        policy "cost"'s cap slack eps in parts per million, [0, 10^6]: a rank
 *                         may receive up to U = slack_cap(ceil(T/R)) copies (T = total entries
 *                         of the call, computed on the device from the rows).  0: policy
 *                         "moonep" (also policy "cost" without slack, which plans as MoonEP).
 *                         > 0: policy "cost": MoonEP's plan and 2 x 8 level plans, scored
 *                         on the device (planner.cost_plan), the first minimum planned.
 * @param replica_cost     policy "cost"'s replica cost in token copies, [0, 2^40): the score
 *                         is max rank load + replica_cost * max links.  Read only when
 *                         slack_ppm > 0 (pass 0 otherwise).
 * @param dst_N            device int32 [s*K], output: entry n's destination, d*NvS + row on
 *                         rank d; -(d*NvS + row) - 1 for a duplicate (an earlier entry of the
 *                         same token already goes to rank d; its row is filled by a local copy).
 * @param cu_G             device int32 [G], output: cumulative row ends of this rank's receive
 *                         groups (cu_seqlens without the leading 0): groups [0, B) are the home
 *                         experts, [B, 2B) the slots.
 * @param etc_RB           device int32 [R, B], output: experts_to_copy for every rank: global
 *                         expert id held by slot b of rank d, or -1.
 * @param zf_G2            device int32 [G, 2], output: per group (first padding row, padding
 *                         rows); (0, 0) for a group without padding.
 * @param stats_2          device int32 [2], output: [slots this rank fills, copies of this
 *                         rank's experts on other ranks].
 * @param workspace        device scratch of at least moonep_plan_workspace_bytes(R, E, s, K)
 *                         bytes, no initialisation needed; one per concurrent call.
 * @param workspace_bytes  its size in bytes.
 * @param err              device int32 [1]: MOONEP_ERR_* bits OR-ed in (never cleared here).
 * @param stream           stream to launch on.
 */
MOONEP_EXPORT int moonep_plan(const int32_t* hist_RX, const int32_t* topk_sK, int s, int K,
                              int rank, int R, int E, int S, int token_padding, int NvS,
                              int slack_ppm, int64_t replica_cost, int32_t* dst_N,
                              int32_t* cu_G, int32_t* etc_RB, int32_t* zf_G2, int32_t* stats_2,
                              void* workspace, size_t workspace_bytes, int32_t* err,
                              cudaStream_t stream);

/**
 * The group plan only (one launch of one block, with programmatic dependent launch): cu_G,
 * etc_RB, zf_G2, stats_2 and the workspace tables moonep_plan's slot assignment reads; no dst_N.
 * topk is not read (s and K size the workspace and the uniform-s checks).  For callers that
 * only need the group tables, and for benchmarks.  Arguments as for moonep_plan.
 */
MOONEP_EXPORT int moonep_plan_group(const int32_t* hist_RX, int s, int K, int rank, int R, int E,
                                    int S, int token_padding, int NvS, int slack_ppm,
                                    int64_t replica_cost, int32_t* cu_G,
                                    int32_t* etc_RB, int32_t* zf_G2, int32_t* stats_2,
                                    void* workspace, size_t workspace_bytes, int32_t* err,
                                    cudaStream_t stream);

// =============================================================================================
// Diagnostics (MOONEP_DIAGNOSTICS builds only: `python -m moonep_ops.build --diagnostics`,
// moonep_ops/lib/diagnostics/).  Planner hooks for tests of the slow paths, A/B benchmarks and
// the probes in diagnostics/.  Each sets a process-wide host variable read by the next
// moonep_plan / moonep_plan_group launches (not thread-safe; no stream work).
// =============================================================================================
#ifdef MOONEP_DIAGNOSTICS

/**
 * Stage stop and slow-path switches of the group kernel.
 *
 * @param stop  99 (the default): the full plan.  0..4: block 0 returns after stage `stop` (0:
 *              set-up, 1: histogram load and per-element checks, 2: row-sum validation and rank
 *              quotas, 3: split, 4: layout), and moonep_plan skips the slot assignment, to time
 *              the stages by difference (the outputs are garbage).  197: the full plan with rank
 *              quotas round by round (no rank_quotas batches); 198: every greedy loop round by
 *              round (no batches, no single-donor closed form); 199: as 198 and without the
 *              packed-key fast paths.  197-199 give the same plan (tests compare them).
 */
MOONEP_EXPORT void moonep_plan_debug_stop(int stop);

/**
 * @param on  1 (the default): launch the group kernel with programmatic dependent launch; 0:
 *            without (to measure what the overlapped launch saves).
 */
MOONEP_EXPORT void moonep_plan_debug_pdl(int on);

/**
 * @param dev_int64x8  device int64 [8] that thread 0 of the group kernel's block 0 fills with
 *                     clock64 (SM cycles) at its stage boundaries: 0 start, 1 after the
 *                     dependency wait, 2 histogram loaded, 3 rank quotas, 4 split, 5 layout,
 *                     6 end ([7] unused); taken right after each __syncthreads(), so they time
 *                     warp 0's arrivals (diagnostics/clock_barrier_probe.cu).  NULL: off.
 *                     Owned by the caller, kept alive while enabled.
 */
MOONEP_EXPORT void moonep_plan_debug_stamps(void* dev_int64x8);

/**
 * @param dev_int64x160  device int64 [5, 32]: [stage i, warp w] = warp w's clock64 as it reaches
 *                       the end of stage i (load, rank quotas, split, layout, pieces), before the
 *                       barrier.  Written by the R <= 64 kernels only (the 512-thread kernel of
 *                       R <= 12 has 16 warps: columns 16..31 untouched).  Policy cost's
 *                       kernels also write rows 5 and 6 (its search, between rank quotas and
 *                       split: the candidates' splits, the choice), so with that policy the
 *                       buffer is [7, 32] (224 int64).
 *                       NULL: off.  Owned by the caller, kept alive while enabled.
 */
MOONEP_EXPORT void moonep_plan_debug_warp_stamps(void* dev_int64x160);

#endif  // MOONEP_DIAGNOSTICS
