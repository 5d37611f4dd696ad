#!/usr/bin/env bash
# Time every stage-2 forward tile shape on one config (ours only), one line per (tiles, selection, K).
# Usage: tools/sweep_stage2_tiles.sh [config, default 8kx2] [extra bench_stage2.py args...]
set -uo pipefail
cfg=${1:-8kx2}; shift || true
for t in "\"sm90a\"" "[8,1,64]" "[8,1,32]" "[4,1,64]" "[4,1,32]" "[4,2,32]" "[4,2,64]" "[8,2,32]" "[8,2,64]"; do
    echo "== tiles $t"
    python3 "$(dirname "$0")/bench_stage2.py" --configs "$cfg" --impls ours --skip-check --max-rep 10 \
        --ours-kwargs "{\"tiles\": $t}" "$@" 2>&1 | grep -E "^  ours |Error|error" | sed "s/^/$t /"
done
