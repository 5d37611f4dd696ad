// common/params.cuh: reading a kernel's parameter struct (the one __grid_constant__ argument each
// kernel takes; its fields are declared again in the launcher, infllm_cupy/_params.py).
#pragma once

// A field of the parameter struct as one scalar load, for the locals a kernel binds at its top.
// Without it NVVM merges the loads of neighbouring fields into vector loads (ld.param.v2 / .v4),
// which ptxas keeps in vector registers from the kernel's start (LDC.64 / LDC.128), where a
// scalar load is read from the constant bank at each use or kept in a uniform register; at the
// register cap that spilled (the sm_90a dk/dv at D = 128: 56 B). The empty volatile asm after the
// load emits no instruction and ends the vectorizer's chain of loads.
template <typename X>
__device__ __forceinline__ X param_field(const X& field) {
    const X x = field;
    asm volatile("");
    return x;
}
