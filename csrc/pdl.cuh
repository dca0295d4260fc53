// Programmatic dependent launch (PDL) for the moonep_ep kernels: a kernel launched with
// programmatic stream serialization may become resident while its predecessor still runs.
//   grid_dep_wait():   blocks until the predecessor grid has completed and flushed its writes;
//                      nothing the predecessor writes may be read before it.
//   grid_dep_launch(): lets this kernel's own PDL-launched successor become resident now (it
//                      still waits for this kernel's completion before reading anything).
// Without the launch attribute (or with a non-kernel predecessor) both are no-ops.
#pragma once

__device__ __forceinline__ void grid_dep_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void grid_dep_launch() {
  asm volatile("griddepcontrol.launch_dependents;" :::);
}
