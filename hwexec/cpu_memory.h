// Peak bytes of the CPU tensors LibTorch allocates in this process: on a CPU rank, what a GPU's
// caching allocator reports as `peak_allocated_bytes`, so that a CPU run's memory can be set
// against the simulator's.
//
// LibTorch's CPU allocator is process-wide, and so is this count: one rank runs per process.
#pragma once

namespace nnsim::hwexec {

// Installs the counting allocator (once; later calls do nothing) and says whether it counts:
// false with a LibTorch built with CUDA (a GPU rank reads the caching allocator instead), whose
// CPU allocator interface this file is not compiled against.
bool count_cpu_memory();

double cpu_allocated_bytes();  // CPU tensor bytes live now
double cpu_peak_bytes();       // the most live at once since the last reset
void reset_cpu_peak();         // the peak becomes what is live now

}  // namespace nnsim::hwexec
