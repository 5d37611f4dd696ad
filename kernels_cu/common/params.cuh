// common/params.cuh: a kernel's parameters, declared once as a field list.
//
// Each kernel's parameters are one macro, LIST(F, M), that calls F(type, name) for a pointer or a
// scalar and M(name) for a TMA tensor map (TmaMap, kernels_cu/common/wgmma_sm90.cuh):
//
//   #define STAGE2_FWD_PARAMS(F, M) \
//       F(const T* __restrict__, q)  /* [total_q, HQ, D] */ \
//       M(tmap_k) \
//       F(int, total_q)
//   template <typename T> struct Stage2FwdParams { PARAM_FIELDS(STAGE2_FWD_PARAMS) };
//   template <typename T> __global__ void stage2_fwd(PARAM_ARGS(STAGE2_FWD_PARAMS)) { ... q[i] ... }
//
// The list makes both the kernel's argument list and a struct of the same fields in the same order.
// The struct is the layout the launcher packs (its declaration in infllm_cupy, `_params.KernelParams`,
// is checked against it field by field at compile time); the launcher then hands the driver each
// field's bytes as one argument. The fields are real kernel arguments, not members of one
// __grid_constant__ struct, because NVVM treats a __restrict__ pointer argument as not aliased
// (read-only loads through the non-coherent path) and versions loops on scalar arguments, neither of
// which it does for a struct's fields: those cost the forward and the decode step 1-2%
// (ARCHITECTURE.md, 3. Shared infrastructure).
#pragma once

#define PARAM_MEMBER_(type, name) type name;
#define PARAM_MEMBER_TMAP_(name) TmaMap name;
#define PARAM_ARG_(type, name) , type name
// by value and __grid_constant__: TMA reads the map where the launch put it (no local copy)
#define PARAM_ARG_TMAP_(name) , const __grid_constant__ TmaMap name
#define PARAM_DROP_FIRST_(...) PARAM_DROP_FIRST2_(__VA_ARGS__)
#define PARAM_DROP_FIRST2_(first, ...) __VA_ARGS__

// The members of the struct of LIST's fields.
#define PARAM_FIELDS(LIST) LIST(PARAM_MEMBER_, PARAM_MEMBER_TMAP_)
// The kernel's argument list: LIST's fields, comma-separated (a type may not contain a comma).
#define PARAM_ARGS(LIST) PARAM_DROP_FIRST_(LIST(PARAM_ARG_, PARAM_ARG_TMAP_))

// For a __forceinline__ body a kernel calls with its fields: the same parameter list with the tensor
// maps by reference (they stay where the launch put them), and the names to forward in the call.
#define PARAM_REF_TMAP_(name) , const TmaMap& name
#define PARAM_NAME_(type, name) , name
#define PARAM_TMAP_NAME_(name) , name
#define PARAM_REF_ARGS(LIST) PARAM_DROP_FIRST_(LIST(PARAM_ARG_, PARAM_REF_TMAP_))
#define PARAM_NAMES(LIST) PARAM_DROP_FIRST_(LIST(PARAM_NAME_, PARAM_TMAP_NAME_))
