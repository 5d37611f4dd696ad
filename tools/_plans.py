"""Kernel variants by name for the development tools: each name is a stage-2 plan
(infllm_cupy/stage2/plan.py).

Forward (`fwd_variant_named`: a plan and the launcher keywords that go with it):
    auto, sm80, sm90a       the plan `kernel=` gives (what the op runs)
    sm90a_pair, sm90a_single, sm90a_split
                            the sm_90a plan, with that step shape forced in every CTA through the
                            launcher's `_force_steps` hook (the shape is each CTA's choice, no plan field)
    W,M,K                   the SM80 kernel with FwdTiles(warps W, m_tiles M, sub_keys K)
Backward (`bwd_variant_named`: a plan and the launcher keywords that go with it):
    auto, sm80, sm90a       the plan `kernel=` gives (sm90a: both dk/dv instances where G allows)
    sm90a_tiles, sm90a_gather
                            the sm_90a dk/dv with one instance only (fixed tiles: dq on one shared
                            ring; gathered tokens: dq's per-CTA ring choice)
    sm90a_split             fixed tiles, dq on a ring per warpgroup in every CTA
    DQ,COLS                 the SM80 kernels with BwdTiles(dq_warps DQ, dkdv_cols COLS)
Either may end in `+FIELD=VALUE...` (e.g. `sm90a+kv_passes=3+split_min=0`, `sm90a+dkdv_passes=16`):
those plan fields replaced (ints, or 0/1 for bools). A backward name's `+pdl=0` is no plan field: the
sm_90a dk/dv's query-range passes launched one after the other, through `stage2_bwd`'s `_pdl` hook.

`plan_mod` is the plan module to build from (this package's by default; the A/B tool passes that of
another tree's package).
"""
from __future__ import annotations

import dataclasses

FWD_STEPS = {"sm90a_pair": "pair", "sm90a_single": "single", "sm90a_split": "split"}   # `_force_steps`
# (dk/dv instance, dq step shape forced through `_force_dq_steps`, None: each CTA's choice)
BWD_VARIANTS = {"sm90a_tiles": ("tiles", "single"), "sm90a_gather": ("gather", None),
                "sm90a_split": ("tiles", "split")}


def _plan_mod(plan_mod):
    if plan_mod is None:
        from infllm_cupy.stage2 import plan as plan_mod
    return plan_mod


def _capability(q):
    import torch

    return torch.cuda.get_device_capability(q.device)


def _split(name: str) -> tuple[str, dict]:
    """'base+f=v+g=w' -> ('base', {'f': 'v', 'g': 'w'})."""
    base, *parts = name.split("+")
    fields = {}
    for part in parts:
        key, _, value = part.partition("=")
        if not key or not value:
            raise ValueError(f"plan field overrides are +FIELD=VALUE, got {part!r} in {name!r}")
        fields[key] = value
    return base, fields


def with_fields(plan, overrides: str):
    """`plan` with the fields of `overrides` ('+FIELD=VALUE...', as a name's tail) replaced."""
    return _replace(plan, _split("x" + overrides)[1]) if overrides else plan


def _replace(plan, fields: dict):
    typed = {}
    for key, value in fields.items():
        current = getattr(plan, key)          # AttributeError names an unknown field
        typed[key] = bool(int(value)) if isinstance(current, bool) else type(current)(value)
    return dataclasses.replace(plan, **typed)


def fwd_variant_named(name: str, q, k, max_seqlen_k: int, split_min: int | None,
                      plan_mod=None) -> tuple[object, dict]:
    """The forward variant called `name` (see the module docstring) for these tensors: its plan and
    the keywords the forward launchers (`stage2_fwd`, `ops.token_fwd`, `ops.layout_fwd`) take with it,
    `{"_force_steps": shape}` for a forced step shape, else none. (The plan module of an older tree,
    whose FwdPlan still has a `step` field, gets the shape there.)"""
    pm = _plan_mod(plan_mod)
    base, fields = _split(name)
    launch = {}
    if "," in base:
        plan = pm.FwdPlan("sm80", pm.FwdTiles(*(int(x) for x in base.split(","))))
    else:
        kernel = "sm90a" if base in FWD_STEPS else base
        plan = pm.fwd_plan(_capability(q), q.shape[2], q.dtype, max_seqlen_k, k.shape[0], split_min=split_min,
                           kernel=kernel)
        if base in FWD_STEPS:
            if "step" in {f.name for f in dataclasses.fields(plan)}:
                plan = dataclasses.replace(plan, step=FWD_STEPS[base])
            else:
                launch = {"_force_steps": FWD_STEPS[base]}
    return _replace(plan, fields), launch


def bwd_variant_named(name: str, q, k, max_seqlen_q: int, max_seqlen_k: int,
                      plan_mod=None) -> tuple[object, dict]:
    """The backward variant called `name` (see the module docstring) for these tensors: its plan and
    the keywords `stage2_bwd` takes with it: `{"_pdl": False}` for `+pdl=0`, `_force_dq_steps` for the
    variants that force the dq's step shape. (The plan module of an older tree, whose BwdPlan still
    has `pdl` or `dq_step` fields, gets them there.)"""
    pm = _plan_mod(plan_mod)
    base, fields = _split(name)
    launch = {}
    if "pdl" in fields and "pdl" not in {f.name for f in dataclasses.fields(pm.BwdPlan)}:
        launch["_pdl"] = bool(int(fields.pop("pdl")))
    if "," in base:
        plan = pm.BwdPlan("sm80", pm.BwdTiles(*(int(x) for x in base.split(","))), dq="sm80")
    else:
        kernel = "sm90a" if base in BWD_VARIANTS else base
        G = q.shape[1] // k.shape[1]
        plan = pm.bwd_plan(_capability(q), G, q.shape[2], q.dtype, max_seqlen_q, max_seqlen_k, k.shape[0],
                           kernel=kernel)
        if base in BWD_VARIANTS:
            dkdv, dq_step = BWD_VARIANTS[base]
            if dkdv == "gather" and not pm.GATHER_G[0] <= G <= pm.GATHER_G[1]:
                raise ValueError(f"{base} needs {pm.GATHER_G[0]} <= G <= {pm.GATHER_G[1]}, got G = {G}")
            plan = dataclasses.replace(plan, dkdv=dkdv)
            if "dq_step" in {f.name for f in dataclasses.fields(plan)}:
                plan = dataclasses.replace(plan, dq_step=dq_step or "auto")
            elif dq_step is not None:
                launch["_force_dq_steps"] = dq_step
    return _replace(plan, fields), launch
