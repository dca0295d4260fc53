// When does a warp's clock64 right after __syncthreads() read?  One warp arrives ~5,000 cycles
// late; every warp records clock64 before the barrier, right after it, and again after one
// volatile shared load.  On the H200 warp 0's read right after the barrier comes 70-105 cycles
// after the block started, long before the late warp arrives: __syncthreads() is
// BAR.SYNC.DEFER_BLOCKING, and the warp goes on issuing until a memory instruction.  After the
// shared load the read is past the late warp's arrival.  This is why the device planner's
// thread-0 stage stamps are warp 0's arrivals (diagnostics/plan_warp_stamps.py).
// Standalone: needs neither moonep library.
//
//   nvcc -O3 -gencode arch=compute_90a,code=sm_90a -o /tmp/clock_barrier_probe \
//        diagnostics/clock_barrier_probe.cu && /tmp/clock_barrier_probe
#include <cuda_runtime.h>

#include <cstdio>

__global__ void probe(long long* out, int late_warp, int spin) {
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  __shared__ int s;
  if (threadIdx.x == 0) s = 0;
  __syncthreads();
  if (w == late_warp) {
    const long long t0 = clock64();
    while (clock64() - t0 < spin) {}
  }
  const long long before = clock64();
  if (w == late_warp && l == 0) s = 1;
  __syncthreads();
  const long long after = clock64();
  const int seen = *reinterpret_cast<volatile int*>(&s);   // the late warp's write
  const long long after_load = clock64();
  if (l == 0) {
    out[w * 4] = before;
    out[w * 4 + 1] = after;
    out[w * 4 + 2] = after_load;
    out[w * 4 + 3] = seen;
  }
}

int main() {
  long long* d = nullptr;
  if (cudaMalloc(&d, 32 * 4 * sizeof(long long)) != cudaSuccess) return 1;
  long long h[32 * 4];
  for (int nt : {512, 1024}) {
    for (int late : {1, 5, 15}) {
      probe<<<1, nt>>>(d, late, 5000);
      if (cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost) != cudaSuccess) return 1;
      const int nw = nt / 32;
      long long first = h[0], last = h[0];
      for (int w = 0; w < nw; ++w) {
        if (h[w * 4] < first) first = h[w * 4];
        if (h[w * 4] > last) last = h[w * 4];
      }
      int early = 0, unseen = 0;
      for (int w = 0; w < nw; ++w) {
        early += h[w * 4 + 1] < last;
        unseen += h[w * 4 + 3] == 0;
      }
      std::printf("%4d threads, late warp %2d: it arrives at %lld; warp 0 reads %lld right after "
                  "the barrier, %lld after a shared load; warps reading before the late arrival: "
                  "%d of %d; warps that missed the late write: %d\n",
                  nt, late, last - first, h[1] - first, h[2] - first, early, nw, unseen);
    }
  }
  return 0;
}
