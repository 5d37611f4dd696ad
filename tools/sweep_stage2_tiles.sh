#!/usr/bin/env bash
# Time every stage-2 forward tile shape (the SM80 kernel's FwdTiles, and the sm_90a kernel) on one
# size, interleaved in one process by tools/ab_fwd_interleaved.py: one row per selection, the ratio
# of each shape to the sm_90a kernel's time.
# Usage: tools/sweep_stage2_tiles.sh [T, default 8192] [B, default 2] [extra ab_fwd_interleaved.py args...]
#   e.g. tools/sweep_stage2_tiles.sh 8192 2 --K 64 --sel a b c
set -euo pipefail
T=${1:-8192}; B=${2:-2}
[ $# -gt 0 ] && shift
[ $# -gt 0 ] && shift
dir=$(cd "$(dirname "$0")" && pwd)
variants=("sm90a=$dir/../kernels_cu:sm90a")
for t in 8,1,64 8,1,32 4,1,64 4,1,32 4,2,32 4,2,64 8,2,32 8,2,64; do
    variants+=("w${t//,/_}=$dir/../kernels_cu:$t")
done
python3 "$dir/ab_fwd_interleaved.py" --variants "${variants[@]}" --T "$T" --B "$B" "$@"
