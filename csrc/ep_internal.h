// Internal to libmoonep_ep.so (not part of its ABI): helpers shared by the csrc/ translation
// units.  The public C ABI is moonep_ep.h.
#pragma once
#include <cuda_runtime.h>

#include "moonep_ep.h"

namespace moonep_ep {
// Set the thread-local last-error message (moonep_ep_last_error) to "where: <CUDA error
// string>" and return the code; cudaSuccess returns 0 and leaves the message alone.
int fail(cudaError_t e, const char* where);
}  // namespace moonep_ep
