#include "gemm_kernel.cuh"
MOONEP_DEFINE_CONFIG(1, dgrad, p128x128, 128, 128, 64, 1, 2, 1)
