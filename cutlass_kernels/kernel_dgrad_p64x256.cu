#include "gemm_kernel.cuh"
MOONEP_DEFINE_CONFIG(1, dgrad, p64x256, 64, 256, 64, 1, 2, 1)
