// The device planner's C ABI (moonep_plan, moonep_plan_group, moonep_plan_workspace_bytes,
// moonep_plan_prepare and the diagnostics hooks; moonep_ep.h): the argument checks, the
// workspace, and which kernel instances run.  The planner itself (policies "moonep" and "cost",
// bit-exact with moonep::plan; docs/planner.md) is two launches:
//   launch 1, plan_group_kernel (plan_group.cuh; its instances in plan_group_moonep.cu and
//     plan_group_cost.cu): the whole group's plan from the gathered histogram rows, and this
//     rank's expert counts per chunk of its top-k ids;
//   launch 2, plan_assign_kernel (plan_assign.cu): every entry's slot.
// The map of the planner's files and their shared definitions: plan_internal.cuh.
#include <climits>
#include <cstdio>

#include "plan_internal.cuh"

namespace moonep_ep::plan {
#ifdef MOONEP_DIAGNOSTICS
int g_pdl = 1;                   // moonep_plan_debug_pdl
#endif
}  // namespace moonep_ep::plan

using namespace moonep_ep::plan;

namespace {

thread_local char g_where[256];

#ifdef MOONEP_DIAGNOSTICS
int g_debug_stop = 99;           // moonep_plan_debug_stop
long long* g_stamps = nullptr;   // moonep_plan_debug_stamps
long long* g_wstamps = nullptr;  // moonep_plan_debug_warp_stamps
#endif

int bad_arg(const char* fmt, int v0, int v1 = 0) {
  std::snprintf(g_where, sizeof(g_where), fmt, v0, v1);
  return moonep_ep::fail(cudaErrorInvalidValue, g_where);
}

int check_sizes(int s, int K, int rank, int R, int E, int S, int tp, int NvS, int ppm,
                long long rc) {
  if (R < 1 || R > kMaxR) return bad_arg("moonep_plan: R=%d outside [1, 1024]", R);
  if (E < R || E % R) return bad_arg("moonep_plan: E=%d must be a positive multiple of R=%d", E, R);
  if (K < 1 || K > kMaxK) return bad_arg("moonep_plan: K=%d outside [1, 127]", K);
  if (S < 1 || s < 1 || s > S) return bad_arg("moonep_plan: s=%d outside [1, S=%d]", s, S);
  if (rank < 0 || rank >= R) return bad_arg("moonep_plan: rank=%d outside [0, R=%d)", rank, R);
  if (tp < 1) return bad_arg("moonep_plan: token_padding=%d < 1", tp);
  if (static_cast<long long>(R) * S * K >= (1ll << 31))
    return bad_arg("moonep_plan: R*S*K >= 2^31 (R=%d, S=%d)", R, S);
  if (ppm < 0 || ppm > kPPM) return bad_arg("moonep_plan: slack_ppm=%d outside [0, 10^6]", ppm);
  if (rc < 0) return bad_arg("moonep_plan: replica_cost < 0%.0d", 0);
  if (rc >= (1ll << 40)) return bad_arg("moonep_plan: replica_cost >= 2^40 token copies%.0d", 0);
  if (ppm > 0 && (R > kCostMaxR || E / R > kCostMaxB))
    return bad_arg("moonep_plan: policy cost on the device needs R <= 64 and E/R <= 256 "
                   "(R=%d, E/R=%d)", R, E / R);
  const long long G = 2ll * (E / R);
  // With a slack a rank receives up to slack_cap(S*K) copies (Geometry.NvS).
  const long long SK = ppm > 0 ? slack_cap(static_cast<long long>(S) * K, ppm)
                               : static_cast<long long>(S) * K;
  const long long need = (SK + (tp - 1) * G + tp - 1) / tp * tp;
  if (NvS < need || static_cast<long long>(R) * NvS >= (1ll << 31))
    return bad_arg("moonep_plan: NvS=%d below the geometry's NvS or R*NvS >= 2^31 (R=%d)", NvS, R);
  return 0;
}

int run_plan(const int32_t* hist, const int32_t* topk, int s, int K, int rank, int R, int E, int S,
             int tp, int NvS, int ppm, long long rcost, int32_t* dst, int32_t* cu, int32_t* etc,
             int32_t* zf, int32_t* stats, void* ws, size_t ws_bytes, int32_t* err,
             cudaStream_t stream, bool assign) {
  if (int bad = check_sizes(s, K, rank, R, E, S, tp, NvS, ppm, rcost)) return bad;
  if (!hist || !cu || !etc || !zf || !stats || !ws || !err || (assign && (!topk || !dst)))
    return bad_arg("moonep_plan: null pointer argument (%d)", 0);
  const WsLayout L = ws_layout(R, E, s, K);
  if (ws_bytes < L.total)
    return bad_arg("moonep_plan: workspace of %d bytes is too small (need %d)",
                   static_cast<int>(ws_bytes > INT_MAX ? INT_MAX : ws_bytes),
                   static_cast<int>(L.total > INT_MAX ? INT_MAX : L.total));
  char* w = static_cast<char*>(ws);
  const Chunking ch = chunking(E, s, K);
  GroupArgs ga;
  ga.hist = hist; ga.topk = topk;
  ga.s = s; ga.K = K; ga.rank = rank; ga.R = R; ga.E = E; ga.B = E / R; ga.S = S; ga.tp = tp;
  ga.NvS = NvS;
  ga.cu = cu; ga.etc = etc; ga.zf = zf; ga.stats = stats;
  ga.pend = reinterpret_cast<int32_t*>(w + L.pend);
  ga.pdst = reinterpret_cast<int32_t*>(w + L.pdst);
  ga.pbase = reinterpret_cast<int32_t*>(w + L.pbase);
  ga.pstart = reinterpret_cast<int32_t*>(w + L.pstart);
  ga.before = reinterpret_cast<int32_t*>(w + L.before);
  ga.upto = reinterpret_cast<int32_t*>(w + L.upto);
  ga.scalars = reinterpret_cast<int32_t*>(w + L.scalars);
  ga.chunkcnt = reinterpret_cast<int32_t*>(w + L.chunkcnt);
  ga.C = ch.C; ga.N = s * K;
  // nvs_s of T = R*s*K (< 2^31: check_sizes); the kernel computes it only for per-rank s
  ga.nvs_uni = nvs_of(static_cast<unsigned>(R * s * K), R, tp, E / R, NvS, ppm);
  // slack_ppm = 0 is policy "cost" without slack, i.e. MoonEP (planner.plan_group): no search.
  ga.slack_ppm = ppm;
  // replica_cost = 0: the score is the max load, and MoonEP's, ceil(T/R), is the least any plan
  // has, so MoonEP wins or ties and wins the tie (docs/planner.md, "Reductions"): the search
  // would always pick it, so it is skipped (only the slack's NvS / nvs_s remain).
  ga.cost = ppm > 0 && rcost > 0 ? 1 : 0;
  ga.replica_cost = rcost;
  ga.err = err;
#ifdef MOONEP_DIAGNOSTICS
  ga.stop = g_debug_stop;
  ga.stamps = g_stamps;
  ga.wstamps = g_wstamps;
  const bool full = g_debug_stop >= 99;   // a stage stop launches no slot assignment
#else
  constexpr bool full = true;
#endif
  const size_t gsmem_g = group_smem_bytes(R, E, ga.cost != 0);
  const size_t gsmem_c = static_cast<size_t>(E) * 4;
  const size_t gsmem = gsmem_g > gsmem_c ? gsmem_g : gsmem_c;
  const int grid = assign && full ? 1 + ch.nchunks : 1;
  const int rc = ga.cost ? launch_group_cost(ga, grid, gsmem, stream)   // R <= 64: check_sizes
                         : launch_group_moonep(ga, grid, gsmem, stream);
  if (rc || !assign || !full) return rc;

  AssignArgs aa;
  aa.topk = topk; aa.N = s * K; aa.K = K; aa.R = R; aa.E = E; aa.B = E / R; aa.NvS = NvS;
  aa.C = ch.C;
  aa.pend = ga.pend; aa.pdst = ga.pdst; aa.pbase = ga.pbase; aa.pstart = ga.pstart;
  aa.before = ga.before; aa.upto = ga.upto;
  aa.scalars = ga.scalars; aa.chunkcnt = ga.chunkcnt;
  aa.dst = dst; aa.err = err;
  return launch_assign(aa, ch, stream);
}

}  // namespace

// Every planner kernel's shared-memory limit raised now, on the current device, so a Buffer's
// first dispatch makes no cudaFuncSetAttribute call.  SymmBackend calls this when a Buffer is
// built.  (It was written against the fresh-process virtual-rank timeouts of docs/multi_gpu.md;
// measured on the H200, it does not remove them.)
MOONEP_EXPORT int moonep_plan_prepare() {
  constexpr size_t kAbove = 48 * 1024 + 1;   // any size above the default: sets the opt-in max
  cudaError_t e = cudaSuccess;
  // every instance run_plan can launch
  for (cudaError_t r : {prepare_group_moonep(kAbove), prepare_group_cost(kAbove),
                        prepare_assign(kAbove)})
    if (e == cudaSuccess) e = r;
  return moonep_ep::fail(e, "moonep_plan_prepare");
}

MOONEP_EXPORT size_t moonep_plan_workspace_bytes(int R, int E, int s, int K) {
  if (R < 1 || E < R || E % R || s < 1 || K < 1 || K > kMaxK) return 0;
  return ws_layout(R, E, s, K).total;
}

MOONEP_EXPORT int moonep_plan(const int32_t* hist_RX, const int32_t* topk_sK, int s, int K,
                              int rank, int R, int E, int S, int token_padding, int NvS,
                              int slack_ppm, int64_t replica_cost, int32_t* dst_N,
                              int32_t* cu_G, int32_t* etc_RB, int32_t* zf_G2, int32_t* stats_2,
                              void* workspace, size_t workspace_bytes, int32_t* err,
                              cudaStream_t stream) {
  return run_plan(hist_RX, topk_sK, s, K, rank, R, E, S, token_padding, NvS, slack_ppm,
                  replica_cost, dst_N, cu_G, etc_RB, zf_G2, stats_2, workspace, workspace_bytes,
                  err, stream, true);
}

MOONEP_EXPORT int moonep_plan_group(const int32_t* hist_RX, int s, int K, int rank, int R, int E,
                                    int S, int token_padding, int NvS, int slack_ppm,
                                    int64_t replica_cost, int32_t* cu_G,
                                    int32_t* etc_RB, int32_t* zf_G2, int32_t* stats_2,
                                    void* workspace, size_t workspace_bytes, int32_t* err,
                                    cudaStream_t stream) {
  return run_plan(hist_RX, nullptr, s, K, rank, R, E, S, token_padding, NvS, slack_ppm,
                  replica_cost, nullptr, cu_G, etc_RB, zf_G2, stats_2, workspace, workspace_bytes,
                  err, stream, false);
}

#ifdef MOONEP_DIAGNOSTICS
// Diagnostics hooks (moonep_ep.h): process-wide, read by the next launches.
MOONEP_EXPORT void moonep_plan_debug_stop(int stop) { g_debug_stop = stop; }

MOONEP_EXPORT void moonep_plan_debug_pdl(int on) { g_pdl = on != 0; }

MOONEP_EXPORT void moonep_plan_debug_stamps(void* dev_int64x8) {
  g_stamps = static_cast<long long*>(dev_int64x8);
}

MOONEP_EXPORT void moonep_plan_debug_warp_stamps(void* dev_int64x160) {
  g_wstamps = static_cast<long long*>(dev_int64x160);
}
#endif  // MOONEP_DIAGNOSTICS
