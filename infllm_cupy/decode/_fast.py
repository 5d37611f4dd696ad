"""The decode launchers' launch path: a step's kernels collected once into a `Program` of prepared
launches (`_launch.PreparedLaunch`) that later calls replay with new per-call pointers (docs/decode.md,
6. CUDA graphs and host synchronisation).

A decode step is a handful of tiny kernels, so the host cost of each launch decides an eager call's
speed. A launcher adds its kernels to a `Launches` with tensors (and None for null pointers) among
the arguments; `run()` launches them once, `program(name=tensor, ...)` returns a `Program` whose
`run(name=tensor, ...)` launches them again with those tensors' addresses in place of the named ones.
The program keeps every other tensor it points to alive (scratch, cache tensors)."""
from __future__ import annotations

import numpy as np
import torch

from .. import _jit
from .._launch import PreparedLaunch, ptr, raw_stream

_NULL = np.uint64(0)


class Program:
    """Prepared launches in order, on one device; `run(**bindings)` re-points the named arguments and
    launches them all on torch's current stream."""

    __slots__ = ("device", "keep", "launches", "pdl", "slots", "sm90")

    def __init__(self, device: torch.device, launches, pdl, slots, keep):
        self.device, self.launches, self.pdl, self.slots, self.keep = device, launches, pdl, slots, keep
        self.sm90 = torch.cuda.get_device_capability(device)[0] >= 9

    def run(self, **bindings: torch.Tensor) -> None:
        for name, t in bindings.items():
            addr = t.data_ptr()
            for li, ai in self.slots[name]:
                self.launches[li].slots[ai] = addr
        index = self.device.index
        if torch.cuda.current_device() != index:
            with torch.cuda.device(index):
                return self._launch(index)
        self._launch(index)

    def _launch(self, index: int) -> None:
        stream = raw_stream(index)
        # programmatic dependent launches only while a graph is captured on sm_90: eagerly their driver
        # call costs more host time than it saves on the GPU (docs/decode.md, 8)
        pdl_ok = self.sm90 and torch.cuda.is_current_stream_capturing()
        for launch, pdl in zip(self.launches, self.pdl):
            launch.launch(stream, pdl and pdl_ok)


class Launches:
    """Collects `(source, name, grid, block, shared_mem, args)`; `run()` launches them in order on torch's
    current stream of `device`, `program(...)` prepares them for replays. Arguments are tensors
    (contiguous, on `device`: their address), None (a null pointer) or NumPy scalars."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.items = []

    def add(self, source: str, name: str, grid, block, shared_mem: int, args, *, pdl: bool = False) -> None:
        """`pdl`: launch as a programmatic dependent of the launch before it while a CUDA graph is being
        captured on sm_90 (a replay then overlaps the two); eagerly, and below sm_90, a plain launch
        (the driver call with launch attributes costs more host time than it saves on the GPU when
        the host is the bottleneck). The kernel must wait (griddepcontrol.wait) before reading that
        launch's output."""
        self.items.append((source, name, tuple(int(g) for g in grid), tuple(int(b) for b in block),
                           int(shared_mem), tuple(args), pdl))

    def program(self, **dynamic: torch.Tensor) -> Program:
        """The launches prepared; each argument that is one of the `dynamic` tensors (by identity) is
        re-pointed by `Program.run(name=...)`. An empty grid launches nothing."""
        launches, pdl, keep = [], [], []
        slots = {name: [] for name in dynamic}
        with torch.cuda.device(self.device):
            for source, name, grid, block, smem, args, p in self.items:
                if not all(g > 0 for g in grid):
                    continue
                packed = []
                for ai, a in enumerate(args):
                    if a is None:
                        packed.append(_NULL)
                    elif isinstance(a, torch.Tensor):
                        packed.append(ptr(a))
                        for dn, dt in dynamic.items():
                            if a is dt:
                                slots[dn].append((len(launches), ai))
                                break
                        else:
                            keep.append(a)
                    else:
                        packed.append(a)
                launches.append(PreparedLaunch(_jit.get_kernel(source, name), name=name, grid=grid,
                                               block=block, shared_mem=smem, args=packed))
                pdl.append(p)
        return Program(self.device, launches, pdl, slots, keep)

    def run(self) -> None:
        self.program().run()
