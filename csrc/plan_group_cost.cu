// The device planner's group kernel (plan_group.cuh), policy "cost" (slack_ppm > 0 and
// replica_cost > 0): its instances (R <= kCostMaxR: NJ <= 2) and their launch.  Policy "moonep"'s
// instances (plan_group_moonep.cu) carry none of its code or registers.
#include "plan_group.cuh"

namespace moonep_ep::plan {

int launch_group_cost(GroupArgs ga, int grid, size_t smem, cudaStream_t stream) {
  const int R = ga.R;                                                // <= 64: check_sizes
  if (sorting_warps_fit(R, kSmallGroupThreads / 32))
    return launch_group<1, kSmallGroupThreads, true>(ga, grid, smem, stream);
  if (R <= 32) return launch_group<1, kGroupThreads, true>(ga, grid, smem, stream);
  return launch_group<2, kGroupThreads, true>(ga, grid, smem, stream);
}

cudaError_t prepare_group_cost(size_t bytes) {
  cudaError_t e = cudaSuccess;
  for (cudaError_t r : {ensure_group_smem<1, kGroupThreads, true>(bytes),
                        ensure_group_smem<2, kGroupThreads, true>(bytes),
                        ensure_group_smem<1, kSmallGroupThreads, true>(bytes)})
    if (e == cudaSuccess) e = r;
  return e;
}

}  // namespace moonep_ep::plan
