// Constants of the device copy of the cost model of moonep_ops/gemm/cost_model.py.  The model
// itself runs in prep.cu's prep_kernel (keep it in step with the Python one; the CUDA test
// compares the config chosen on the device with the Python selector's).
#pragma once

#include "configs.h"

namespace moonep {

// Constants handed over by value (from moonep_ops/gemm/tuning.py through the C ABI's `tuning`
// array).
struct Tuning {
  float peak_tflops, hbm_tbps;
  float c[kMaxConfigs][5];  // eta, bw_frac, tau_sw_us, tau0_us, tau_epi_us
};

__host__ __device__ inline long long cdiv_ll(long long a, long long b) { return (a + b - 1) / b; }

}  // namespace moonep
