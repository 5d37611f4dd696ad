"""The decode launchers' eager path: several launches under one device context and one CuPy view of
torch's current stream (docs/decode.md, "CUDA graphs and host synchronisation"). A decode step is a
handful of tiny kernels, so per-launch Python work (entering the device context, wrapping the stream)
is a large share of an eager call; `launch` pays it per kernel. Errors go through `launch` itself, so
they read the same."""
from __future__ import annotations

import torch

from .. import _jit
from .._launch import current_stream, launch

_BIG_SMEM = 48 * 1024


class Launches:
    """Collects `(source, name, grid, block, shared_mem, args)` and runs them in order on torch's
    current stream of `device` (`run`)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.items = []

    def add(self, source: str, name: str, grid, block, shared_mem: int, args, *, pdl: bool = False) -> None:
        """`pdl`: launch as a programmatic dependent of the launch before it while a CUDA graph is being
        captured on sm_90 (a replay then overlaps the two); eagerly, and below sm_90, a plain launch
        (the driver call with launch attributes costs more host time than it saves on the GPU when
        the host is the bottleneck). The kernel must wait (griddepcontrol.wait) before reading that
        launch's output."""
        self.items.append((source, name, tuple(int(g) for g in grid), tuple(int(b) for b in block),
                           int(shared_mem), args, pdl))

    def run(self) -> None:
        items = [it for it in self.items if all(g > 0 for g in it[2])]   # an empty grid launches nothing
        if not items:
            return
        pdl_ok = (torch.cuda.is_current_stream_capturing()
                  and torch.cuda.get_device_capability(self.device)[0] >= 9)
        with torch.cuda.device(self.device):
            stream = current_stream()
            for source, name, grid, block, smem, args, pdl in items:
                kern = _jit.get_kernel(source, name)
                if pdl and pdl_ok:
                    launch(kern, name=name, grid=grid, block=block, args=args, shared_mem=smem, pdl=True)
                    continue
                try:
                    if smem > _BIG_SMEM and kern.max_dynamic_shared_size_bytes < smem:
                        kern.max_dynamic_shared_size_bytes = smem
                    kern(grid, block, args, shared_mem=smem, stream=stream)
                except Exception:  # noqa: BLE001 - `launch` raises the same failure with its message
                    launch(kern, name=name, grid=grid, block=block, args=args, shared_mem=smem)
                    raise
