#include "gemm_kernel.cuh"
MOONEP_DEFINE_CONFIG(1, dgrad, c128x256, 128, 256, 64, 1, 2, 0)
