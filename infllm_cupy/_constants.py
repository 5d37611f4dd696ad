"""Constants shared by the launchers, the references, the pipeline and the test helpers: one
definition each, imported everywhere else.

Not here on purpose: each reference's `_CHUNK_ELEMS` (stage1/naive.py, stage2/naive.py,
selections.py) bounds the working set of its own loop, so the values differ and stay local; and
the `WARPS`-like constants of each launcher mirror a `#define` of its own `.cu` file.
"""
from __future__ import annotations

# The `backend=` argument of every public op: "auto" runs the kernels on CUDA tensors and the
# reference on CPU tensors; the other two force one side (checked by `_checks.check_backend`).
BACKENDS = ("auto", "kernels", "reference")

# Head dims every kernel is instantiated for (compression, stage 1, stage 2).
HEAD_DIMS = (64, 128)

# Keys per selectable KV block: InfLLM-v2's block size, which stage 1 selects and the stage-2
# kernels are built for (kernels_cu: BLOCK_N); also the block of the synthetic selections.
KV_BLOCK = 64
