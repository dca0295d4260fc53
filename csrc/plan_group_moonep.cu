// The device planner's group kernel (plan_group.cuh), policy "moonep": its instances and their
// launch.  One instance per register-slot count NJ = ceil(R/32) rounded up to a power of two,
// and the 512-thread block while it has a sorting warp per rank (R <= 12).
#include "plan_group.cuh"

namespace moonep_ep::plan {

int launch_group_moonep(GroupArgs ga, int grid, size_t smem, cudaStream_t stream) {
  const int R = ga.R, nj = (R + 31) / 32;
  if (sorting_warps_fit(R, kSmallGroupThreads / 32))                 // R <= 12
    return launch_group<1, kSmallGroupThreads>(ga, grid, smem, stream);
  if (nj <= 1) return launch_group<1>(ga, grid, smem, stream);
  if (nj <= 2) return launch_group<2>(ga, grid, smem, stream);
  if (nj <= 4) return launch_group<4>(ga, grid, smem, stream);
  if (nj <= 8) return launch_group<8>(ga, grid, smem, stream);
  if (nj <= 16) return launch_group<16>(ga, grid, smem, stream);
  return launch_group<32>(ga, grid, smem, stream);
}

cudaError_t prepare_group_moonep(size_t bytes) {
  cudaError_t e = cudaSuccess;
  for (cudaError_t r : {ensure_group_smem<1, kGroupThreads, false>(bytes),
                        ensure_group_smem<2, kGroupThreads, false>(bytes),
                        ensure_group_smem<4, kGroupThreads, false>(bytes),
                        ensure_group_smem<8, kGroupThreads, false>(bytes),
                        ensure_group_smem<16, kGroupThreads, false>(bytes),
                        ensure_group_smem<32, kGroupThreads, false>(bytes),
                        ensure_group_smem<1, kSmallGroupThreads, false>(bytes)})
    if (e == cudaSuccess) e = r;
  return e;
}

}  // namespace moonep_ep::plan
