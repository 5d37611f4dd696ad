"""tools/q8_accuracy.py (docs/stage2_fwd.md §12) at a small size on the CPU: it runs, its bf16 row is our
kernels' accuracy, and its 8-bit rows really quantize (a control: an emulation that forgot to round would
read like bf16)."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_q8_accuracy_tool_orders_the_schemes():
    p = subprocess.run([sys.executable, "tools/q8_accuracy.py", "--tokens", "2048", "--heads", "4",
                        "--kv-heads", "1", "--head-dim", "64", "--topk", "8", "--local-blocks", "4", "--rows",
                        "48", "--inputs", "structured", "--schemes", "bf16,fp8,int8-smooth,int8-qk,fp8-pv"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {m[0]: (float(m[1]), float(m[2])) for m in
            re.findall(r"^\s+(\S+)\s+cosine min ([\d.]+) .*rel L1 max ([\d.]+)", p.stdout, re.M)}
    assert set(rows) == {"bf16", "fp8", "int8-smooth", "int8-qk", "fp8-pv"}, p.stdout
    assert rows["bf16"][0] > 0.99999 and rows["bf16"][1] < 0.002
    for name in ("fp8", "int8-smooth", "int8-qk", "fp8-pv"):
        assert rows[name][1] > 5 * rows["bf16"][1], (name, rows)          # quantized
    assert rows["int8-smooth"][1] < rows["fp8"][1]                           # int8 scores beat e4m3's
    assert rows["int8-qk"][1] < rows["int8-smooth"][1] and rows["fp8-pv"][1] < rows["int8-smooth"][1]
