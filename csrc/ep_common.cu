// ABI version and error reporting shared by every moonep_ep launcher.
#include <cstdio>
#include "ep_internal.h"

static thread_local char g_last_error[512] = "";

namespace moonep_ep {
int fail(cudaError_t e, const char* where) {
  if (e == cudaSuccess) return 0;
  std::snprintf(g_last_error, sizeof(g_last_error), "%s: %s", where, cudaGetErrorString(e));
  return static_cast<int>(e);
}
}  // namespace moonep_ep

MOONEP_EXPORT int moonep_ep_abi_version() { return MOONEP_EP_ABI_VERSION; }
MOONEP_EXPORT const char* moonep_ep_last_error() { return g_last_error; }
