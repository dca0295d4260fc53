#include "gemm_kernel.cuh"
MOONEP_DEFINE_CONFIG(0, fwd, p64x256, 64, 256, 64, 1, 2, 1)
