// common/pdl.cuh: programmatic dependent launch (sm_90), shared by the kernels launched as dependents.
//
// pdl_launch_dependents: the next kernel in the stream, if launched with programmatic stream
// serialization, may start once every CTA of this grid has issued it (or exited), so its launch and
// prologue overlap this grid's tail. pdl_wait: returns once the grid this one was launched behind has
// completed and its stores are visible; at once for a grid launched without the attribute. Waiting
// covers the whole previous grid whatever it triggered early, so no result depends on either call.
// Below sm_90 both are no-ops (the launchers use the attribute only on sm_90).
#pragma once

__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
