// moonep_ep: the GPU data plane (planner, dispatch, combine, prefetch, reduce, barriers) and the
// routed experts' fused SwiGLU (swiglu.cu).
// Plain C ABI: raw device pointers, ints and a cudaStream_t; no torch.  Loaded with ctypes by
// moonep_ops/_native.py (ep_lib).  Every launcher returns 0 on success, else a CUDA error
// code (moonep_ep_last_error() has the message).  Nothing here synchronises the host.
#pragma once
#include <cstdint>
#include <cstddef>
#include <cuda_runtime.h>

#define MOONEP_EP_ABI_VERSION 2
#define MOONEP_EXPORT extern "C" __attribute__((visibility("default")))

// Error-flag bits, OR-ed into the int32 error word on the device and read lazily by the host.
enum MoonepEpError : int32_t {
  MOONEP_ERR_BAD_IDS = 1,        // some rank passed expert ids outside [0, E)
  MOONEP_ERR_HIST = 2,           // a histogram row does not sum to s_r*K, or s/total disagree
  MOONEP_ERR_PLAN = 4,           // the plan overflowed (more than epn slots, a row past nvs_s)
  MOONEP_ERR_TIMEOUT = 8,        // a cross-rank barrier timed out (a peer never arrived)
};

// dtype codes of the launchers' `dtype` arguments.
enum MoonepEpDtype : int { MOONEP_DTYPE_BF16 = 0, MOONEP_DTYPE_F16 = 1, MOONEP_DTYPE_F32 = 2,
                           MOONEP_DTYPE_F64 = 3 };

namespace moonep_ep {
// Set the thread-local last-error message and return the code (used by every launcher).
int fail(cudaError_t e, const char* where);
}

// The device planner (moonep_plan, moonep_plan_group) is declared in plan_kernels.h.
