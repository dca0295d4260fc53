// The device planner's launch 1, plan_group_kernel (policies "moonep" and "cost"), bit-exact
// with moonep::plan (moonep_ops/planner/: plan_group with floor/ceil caps, rank_quotas "max",
// split_quotas "max", layout, _rank_outputs; policy "cost": cost_plan, between steps 1 and 2).
// docs/planner.md has the algorithm and the measurements; the rejected alternatives are listed
// once, with their measured reasons, in its "Design notes".  Instances: plan_group_moonep.cu,
// plan_group_cost.cu; shared definitions: plan_internal.cuh.
//
// Grid 1 + nchunks, 1024 threads (R <= 12: 512, kSmallGroupThreads):
//   block 0   steps 1-3 for the whole group from the [R, E+3] histogram (validation included),
//             stage by stage, separated by block barriers:
//     0. load + validate the histogram (plan_hist.cuh) in warp tiles of rows x 32*NC columns
//        (coalesced loads, 16 in flight per lane, per-lane column and row partials, one warp
//        reduction per tile row); an invalid histogram is replaced by an empty one (nothing
//        moves), so the outputs stay in range whatever the input;
//     1. warp 0 alone, no block barrier in between: the row-sum checks, the group loads and
//        rank_quotas (plan_quotas.cuh); meanwhile idle warps sort the donors' expert keys for
//        the batched split, and with policy "cost" the candidate warps compute the level plans'
//        quotas; then the cost search (plan_cost.cuh) may replace step 1's quotas;
//     2. split_quotas (plan_split.cuh): one warp per donor, <= R-1+B rounds; a donor with <= 8
//        receivers runs rounds in batches of up to 8 (split_batches), one expert serving many
//        quotas runs in steps (split_one_expert_steps).  Meanwhile the last warp lists every
//        donor's receivers in rank order;
//     3. layout (plan_layout.cuh): one warp per destination; expert offsets;
//     4. per expert, its pieces (destinations with tokens, in rank order) with cumulative ends,
//        as a CSR table of <= 2E pieces: launch 2's searchsorted becomes a binary search.
//     The greedy loops use one warp reduction per argmax/argmin on packed (value, index) keys
//     when the values leave room for the index bits (2T < 2^(31 - log2 R)), else two.
//     When R < 32 a spare warp scans the piece counts during step 3 (no block scan in step 4),
//     and errors go straight to the error word (no end-of-kernel barrier).
//   blocks 1.. per chunk of C = tpc*K entries of topk: the expert histogram of the chunk
//             (count_chunk), which launch 2 (plan_assign.cu) turns into each entry's rank.
#pragma once
#include <algorithm>

#include "plan_internal.cuh"
#include "plan_hist.cuh"
#include "plan_quotas.cuh"
#include "plan_split.cuh"
#include "plan_cost.cuh"
#include "plan_layout.cuh"

namespace moonep_ep::plan {

// Programmatic dependent launch (the group kernel is launched with programmatic stream
// serialization): the launch and the shared-memory set-up overlap the previous kernel, and
// griddepcontrol.wait blocks until that kernel has completed and flushed its writes.  Nothing
// global is read or written before the wait; the reads after it bypass L1 (ld.global.cg), since
// this block may have become resident while the previous kernel still ran.  The trigger right
// after the wait lets a PDL-launched successor do the same (grid_dep_*: pdl.cuh).

// ---------------------------------------------------------------------------------------------
// Launch 1.  Block 0: steps 0-4.  NJ = ceil(R/32) rounded up to a power of two (register slots of
// the per-rank values each lane holds in the warp-level greedy loops).  kCost: policy "cost"'s
// search between steps 1 and 2 (its own instances, NJ <= 2: the policy "moonep" kernels carry
// none of its code or registers).
// ---------------------------------------------------------------------------------------------

template <int NJ, int NT, bool kCost = false>
__global__ void __launch_bounds__(NT, 1) plan_group_kernel(GroupArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  if (blockIdx.x > 0) {
    count_chunk<kGroupThreads / NT>(a, reinterpret_cast<int*>(smem_raw));
    return;
  }
  const int tid = threadIdx.x, nthr = blockDim.x, lane = tid & 31, warp = tid >> 5;
  const int nwarps = nthr >> 5;
  const int R = a.R, E = a.E, B = a.B, rank = a.rank, X = E + 3;
  stamp(a, 0);

  const GroupSmem sm = group_smem(smem_raw, R, E);
  clear_group_smem(sm, R, E);
  grid_dep_wait();                                   // the histogram is the last kernel's output
  grid_dep_launch();
  stamp(a, 1);
  // This thread's metadata row (R <= 1024 = blockDim) and the total: in flight over the barrier.
  const int total0 = __ldcg(a.hist + static_cast<size_t>(rank) * X + E + 2);
  int m_bad = 0, m_sr = 0, m_tr = 0;
  if (tid < R) {
    m_bad = __ldcg(a.hist + static_cast<size_t>(tid) * X + E);
    m_sr = __ldcg(a.hist + static_cast<size_t>(tid) * X + E + 1);
    m_tr = __ldcg(a.hist + static_cast<size_t>(tid) * X + E + 2);
  }
  __syncthreads();
  if (plan_stop(a) == 0) return;

  // ---- 0. load and validate ------------------------------------------------------------------
  const int vmax = a.S * a.K;        // a count above S*K is invalid (host: R*S*K < 2^31)
  const bool one_word = static_cast<unsigned long long>(E) * (static_cast<unsigned>(vmax) + 1ull)
                        < (1ull << 32);
  load_validate<NT>(a, sm, vmax, one_word, total0, m_bad, m_sr, m_tr);
  wstamp<NJ>(a, 0);
  __syncthreads();                                   // sums, row sums, error bits complete
  stamp(a, 2);
  if (plan_stop(a) == 1) return;

  // Packed keys: value << ib | index-part in one u32, so one warp reduction gives the first
  // argmax / argmin.  Valid whenever the values (balances + T, quotas, counts: all in [0, 2T])
  // leave room for the index bits; else the two-reduction paths.
  const int ibR = ceil_log2(R), ibB = ceil_log2(B);
  const unsigned MR = (1u << ibR) - 1u, MB = (1u << ibB) - 1u;
  // The batched split (split_batches) needs a warp per rank to sort during step 1, one quota
  // key per lane (R <= 32) and B <= 64.
  // Scratch for the sorted keys: slotoff, [R, B], written by the layout (step 3) before
  // anything reads it there.
  // Diagnostics stops 198 and 199 (tests, benchmarks) turn every shortcut off: greedy loops
  // round by round.  Always on in the production build (plan_stop: 99).
  const bool shortcuts = plan_stop(a) != 198 && plan_stop(a) != 199;
  const bool batch_ok = shortcuts && NJ == 1 && B <= 64 &&
                        sorting_warps_fit(R, nwarps);

  const CostSmem cs = cost_smem(smem_raw + group_smem_base(R, E), R);   // policy "cost" only
  // ---- 1. validity, group loads, rank_quotas: all in warp 0, no block barrier -----------------
  if (warp == 0) {
    int don[NJ], cap_hi;
    const bool vq = rank_quotas_warp<NJ>(a, sm, total0, one_word, shortcuts, don, cap_hi);
    if constexpr (NJ <= 2 && kCost) {
      if (vq) cost_moonep_candidate<NJ>(cs, don, R, B, cap_hi);
    }
  } else if (batch_ok && (warp & 3) != 0 && warp - 1 - (warp >> 2) < R) {
    sort_donor_keys(sm, warp - 1 - (warp >> 2), R, B, ibB, MB, group_copies(a, total0, true));
  }
  // Policy "cost", the level quotas (see cost_warp): the kCostLevels levels even .. hi evenly
  // on the candidate warps, during step 1.  On an invalid histogram (warp 0 may be zeroing remE
  // meanwhile) the results are garbage and unused: the search is skipped after the barrier.
  if constexpr (NJ <= 2 && kCost) {
    const int cwarp = cost_warp(warp, nwarps);
    if (cwarp >= 0)
      cost_levels<NJ>(cs, sm.remE, R, B, group_copies(a, total0, true), cwarp,
                      cost_cwarps(nwarps), a.slack_ppm, plan_stop(a) != 199);
  }
  if (warp == nwarps - 1 && lane == 0) {
    // nvs_s for either validity.  T = R*s*K (uniform s, or an invalid histogram) is the host's;
    // only per-rank s needs it here.
    int nv = a.nvs_uni;
    if (total0 != -1)
      nv = nvs_of(static_cast<unsigned>(group_copies(a, total0, true)), R, a.tp, B, a.NvS,
                  a.slack_ppm);
    sm.misc[5] = nv;
    sm.misc[6] = a.nvs_uni;
  }
  wstamp<NJ>(a, 1);
  __syncthreads();
  stamp(a, 3);
  const bool valid = sm.misc[3] != 0;
  const int T = group_copies(a, total0, valid);
  const int nvs_s = valid ? sm.misc[5] : sm.misc[6];
  if (plan_stop(a) == 2) return;

  // Policy "cost", the splits and the choice.  All warps split the (candidate, critical donor)
  // pairs of the levels and of MoonEP's plan (step 1's quotas); warp 0 scores the candidates,
  // picks the first minimum, and its quotas replace step 1's outputs, so steps 2-4 below plan
  // it.  An invalid histogram plans as MoonEP's plan of the empty one (as without the policy).
  if constexpr (NJ <= 2 && kCost) {
    if (valid)
      cost_search<NJ>(a, cs, sm.remE, sm.donor_of, sm.z_of, sm.rmask, sm.donors, sm.misc, R, B,
                      T, a.replica_cost, plan_stop(a) != 199);
  }

  // ---- 2. split_quotas (one warp per donor; the last warp lists the receivers meanwhile) -------
  const int ndon = sm.misc[1];
  const int ib2 = max(ibR, ibB);
  const bool packed2 =
      plan_stop(a) != 199 && B <= 64 && static_cast<long long>(T) < (1ll << (31 - ib2));
  const int nsplit = nwarps > 1 ? nwarps - 1 : 1;
  if (warp == nwarps - 1 && nwarps > 1) list_receivers(sm, R);
  for (int k = warp; k < ndon && warp < nsplit; k += nsplit)
    split_donor<NJ>(sm, k, sm.donors[k], R, B, ibR, ibB, MR, MB, packed2, batch_ok, shortcuts);
  wstamp<NJ>(a, 2);
  __syncthreads();
  stamp(a, 4);
  if (plan_stop(a) == 3) return;

  // ---- 3. layout (one warp per destination) ---------------------------------------------------
  const bool spare = R < nwarps;
  if (spare && warp == nwarps - 1) scan_pieces_spare(sm, E);
  for (int d = warp; d < R; d += nwarps) layout_destination(a, sm, d, spare, nvs_s);
  wstamp<NJ>(a, 3);
  __syncthreads();
  stamp(a, 5);
  if (plan_stop(a) == 4) return;

  // ---- 4. per-expert pieces (CSR) for the slot assignment -------------------------------------
  const int npieces_total = spare ? sm.misc[4] : block_excl_scan(sm.pcnt, E, sm.wsum);   // <= 2E
  pieces_few_receivers(a, sm);
  pieces_many_receivers(a, sm, ndon);
  if (tid == 0) {
    a.pstart[E] = npieces_total;
    a.stats[0] = min(sm.nrem[rank], B);
    a.stats[1] = sm.copies[rank];
    a.scalars[0] = nvs_s;
    a.scalars[1] = valid ? 1 : 0;
  }
  stamp(a, 6);
  wstamp<NJ>(a, 4);
}

// ---------------------------------------------------------------------------------------------
// Host side: one instance's launch
// ---------------------------------------------------------------------------------------------

// The histogram load's warp tiles (load_hist_tiles): NC columns per lane (E >= 1024: 8, >= 256:
// 4, >= 64: 2, else 1), column blocks of 32*NC, rows split so the tiles cover about one per warp.
// On the host: four dependent integer divisions the kernel's critical path no longer pays.
inline void load_tiling(int R, int E, int nwarps, GroupArgs& ga) {
  const int nc = E >= 1024 ? 8 : E >= 256 ? 4 : E >= 64 ? 2 : 1;
  const int ncb = (E + 32 * nc - 1) / (32 * nc);
  int nrb = std::max(1, std::min(R, nwarps / ncb));
  const int NR = (R + nrb - 1) / nrb;
  nrb = (R + NR - 1) / NR;
  ga.ld_nc = nc; ga.ld_ncb = ncb; ga.ld_NR = NR; ga.ld_ntiles = ncb * nrb;
  // __umulhi(2 t, ceil(2^31 / ncb)) == t / ncb for t, ncb <= 1024 (checked exhaustively)
  ga.ld_ncb_mul = static_cast<unsigned>(((1ull << 31) + ncb - 1) / ncb);
}

template <int NJ, int NT, bool kCost>
cudaError_t ensure_group_smem(size_t bytes) {
  return ensure_smem(plan_group_kernel<NJ, NT, kCost>, group_slot<NJ, NT, kCost>(), bytes);
}

template <int NJ, int NT = kGroupThreads, bool kCost = false>
int launch_group(GroupArgs ga, int grid, size_t smem, cudaStream_t stream) {
  load_tiling(ga.R, ga.E, NT / 32, ga);
  cudaError_t e = ensure_group_smem<NJ, NT, kCost>(smem);
  if (e != cudaSuccess) return moonep_ep::fail(e, "moonep_plan: shared memory for the group kernel");
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(NT);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
#ifdef MOONEP_DIAGNOSTICS
  cfg.numAttrs = g_pdl ? 1 : 0;
#else
  cfg.numAttrs = 1;
#endif
  e = cudaLaunchKernelEx(&cfg, plan_group_kernel<NJ, NT, kCost>, ga);
  if (e != cudaSuccess) return moonep_ep::fail(e, "moonep_plan: group kernel launch");
  return moonep_ep::fail(cudaGetLastError(), "moonep_plan: group kernel launch");
}

}  // namespace moonep_ep::plan
