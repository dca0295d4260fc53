#include "gemm_kernel.cuh"
MOONEP_DEFINE_CONFIG(0, fwd, c128x256, 128, 256, 64, 1, 2, 0)
