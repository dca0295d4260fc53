// The device planner's launch 2, plan_assign_kernel: one block per chunk of this rank's
// entries (the pieces table of launch 1 in shared memory).  Every entry's stable rank among this
// rank's entries of its expert (ordered by flat index) = before-rank prefix + earlier chunks +
// earlier warps (per-warp counters) + earlier lanes (match_any); then the destination piece by
// binary search, the slot, and the duplicate marking within the token.  Shared definitions:
// plan_internal.cuh.
#include "plan_internal.cuh"

namespace moonep_ep::plan {
namespace {

// ---------------------------------------------------------------------------------------------
// Launch 2: slots of one chunk of this rank's entries
// ---------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(1024) plan_assign_kernel(AssignArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int tid = threadIdx.x, nthr = blockDim.x, lane = tid & 31, warp = tid >> 5;
  const int W = nthr >> 5;
  const int E = a.E;
  int* base = reinterpret_cast<int*>(smem_raw);      // [E] rank of the chunk's first entry of e
  int* uptoS = base + E;                             // [E]
  int* cntw = uptoS + E;                             // [W, E] per-warp counts, then prefixes
  int* sdest = cntw + W * E;                         // [W*32*J] destination of each entry
  int* pstart = sdest + W * 32 * kAssignJ;           // [E+1]
  int* pend = pstart + E + 1;                        // [2E]
  int* pdst = pend + 2 * E;                          // [2E]
  int* pbase = pdst + 2 * E;                         // [2E]
  int* s_err = pbase + 2 * E;
  const int b = blockIdx.x;
  const int c0 = b * a.C;
  const int Cb = min(a.C, a.N - c0);

  int myerr = 0;
  int er[kAssignJ];
#pragma unroll
  for (int j = 0; j < kAssignJ; ++j) {               // this lane's entries, loads first
    const int p = (warp * kAssignJ + j) * 32 + lane;
    er[j] = p < Cb ? __ldg(a.topk + c0 + p) : -1;
  }
  if (tid == 0) *s_err = 0;
  for (int e = tid; e < E; e += nthr) {
    int acc = a.before[e];
    int c = 0;
    for (; c + 8 <= b; c += 8) {
      int x[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) x[u] = a.chunkcnt[static_cast<size_t>(c + u) * E + e];
#pragma unroll
      for (int u = 0; u < 8; ++u) acc += x[u];
    }
    for (; c < b; ++c) acc += a.chunkcnt[static_cast<size_t>(c) * E + e];
    base[e] = acc;
    uptoS[e] = a.upto[e];
  }
  const int np_total = min(a.pstart[E], 2 * E);
  for (int i = tid; i <= E; i += nthr) pstart[i] = min(a.pstart[i], np_total);
  for (int i = tid; i < np_total; i += nthr) { pend[i] = a.pend[i]; pdst[i] = a.pdst[i]; pbase[i] = a.pbase[i]; }
  for (int i = tid; i < W * E; i += nthr) cntw[i] = 0;
  __syncthreads();

  int rk[kAssignJ];
  int* myc = cntw + warp * E;
  const unsigned lt_mask = (1u << lane) - 1u;
#pragma unroll
  for (int j = 0; j < kAssignJ; ++j) {               // in flat-index order within the warp
    const int p = (warp * kAssignJ + j) * 32 + lane;
    const bool act = p < Cb;
    int e = -1;
    if (act) {
      const int x = er[j];
      if (x < 0 || x >= E) myerr |= MOONEP_ERR_BAD_IDS;
      e = clamp_i(x, 0, E - 1);
    }
    const unsigned peers = __match_any_sync(kFull, e);
    const int cur = act ? myc[e] : 0;
    __syncwarp();
    if (act && lane == 31 - __clz(peers)) myc[e] = cur + __popc(peers);
    __syncwarp();
    er[j] = e;
    rk[j] = cur + __popc(peers & lt_mask);
  }
  __syncthreads();
  for (int e = tid; e < E; e += nthr) {              // exclusive prefix over warps + base
    int run = base[e];
    for (int w = 0; w < W; ++w) {
      const int t = cntw[w * E + e];
      cntw[w * E + e] = run;
      run += t;
    }
  }
  __syncthreads();

  const int nvs_s = a.scalars[0];
  const int R = a.R, NvS = a.NvS;
  int dv[kAssignJ], dd[kAssignJ];
#pragma unroll
  for (int j = 0; j < kAssignJ; ++j) {
    const int p = (warp * kAssignJ + j) * 32 + lane;
    dv[j] = 0;
    dd[j] = 0;
    if (p < Cb) {
      const int e = er[j];
      const int gr = myc[e] + rk[j];                 // global rank: (source rank, flat index)
      if (gr >= uptoS[e]) myerr |= MOONEP_ERR_HIST;  // hist[rank] is not bincount(topk)
      const int first = pstart[e], last = max(first, pstart[e + 1]);
      int lo = first, hi = last;                     // first piece with end > gr
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (pend[mid] > gr) hi = mid; else lo = mid + 1;
      }
      int d, loff;
      if (lo < last) {
        d = pdst[lo];
        loff = pbase[lo] + gr;
      } else {                                       // only for invalid input
        myerr |= MOONEP_ERR_PLAN;
        d = last > first ? pdst[last - 1] : e / a.B;
        loff = 0;
      }
      if (loff < 0 || loff >= nvs_s) { myerr |= MOONEP_ERR_PLAN; loff = clamp_i(loff, 0, nvs_s - 1); }
      d = clamp_i(d, 0, R - 1);
      sdest[p] = d;
      dd[j] = d;
      dv[j] = d * NvS + loff;
    }
  }
  __syncthreads();
  const int K = a.K;
#pragma unroll
  for (int j = 0; j < kAssignJ; ++j) {
    const int p = (warp * kAssignJ + j) * 32 + lane;
    if (p < Cb) {
      const int k = p % K;                           // chunks start at token boundaries
      bool dup = false;
      for (int q = 1; q <= k; ++q) dup |= sdest[p - q] == dd[j];
      a.dst[c0 + p] = dup ? -dv[j] - 1 : dv[j];
    }
  }
  if (myerr) atomicOr(s_err, myerr);
  __syncthreads();
  if (tid == 0 && *s_err) atomicOr(a.err, *s_err);
}

}  // namespace

int launch_assign(const AssignArgs& aa, const Chunking& ch, cudaStream_t stream) {
  const size_t asmem = assign_smem_bytes(aa.E, ch.W);
  cudaError_t e = ensure_smem(plan_assign_kernel, kAssignSlot, asmem);
  if (e != cudaSuccess) return moonep_ep::fail(e, "moonep_plan: shared memory for the assign kernel");
  plan_assign_kernel<<<ch.nchunks, ch.W * 32, asmem, stream>>>(aa);
  return moonep_ep::fail(cudaGetLastError(), "moonep_plan: assign kernel launch");
}

cudaError_t prepare_assign(size_t bytes) {
  return ensure_smem(plan_assign_kernel, kAssignSlot, bytes);
}

}  // namespace moonep_ep::plan
