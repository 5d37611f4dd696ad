"""Toy model of the L2 reuse of the dk/dv kernel's query tiles under a CTA order (development tool).

    python tools/l2_order_model.py --T 32768 --B 2 --order hb --walk down --split0 8

Selection (a) of `bench_stage2.py` (block 0, the diagonal and random earlier picks per 64-token query
block, K = 64, H = 2 KV heads, G = 16 so a query block is 16 tiles of 64 rows). Each CTA is one key
block's list of query tiles; 264 CTA slots (2 per SM) read one 32-KB tile per time step each and take
the next CTA in launch order when done; L2 is an LRU over tiles. Prints the hit rate of the tile
reads and the makespan in steps against the ideal (reads / slots). The model ignores every other
cost, so it ranks orders by reuse and balance, nothing more: against Nsight it gave 18% / 7.1% where
10.4% / 3.75% were measured for the old order at 32k x 2 / 32k x 8 (docs/stage2_bwd.md, 9. CTA order).
"""
from __future__ import annotations

import argparse
import collections
import heapq

import numpy as np

H, K, TILES_PER_QB, SLOTS = 2, 64, 16, 264


def tile_lists(T: int, B: int, seed: int = 0) -> dict:
    """(h, b, key block) -> the query blocks that selected it, ascending."""
    nb = T // 64
    rng = np.random.default_rng(seed)
    out = {}
    for h in range(H):
        for b in range(B):
            lists = [[] for _ in range(nb)]
            for qb in range(nb):
                picks = range(qb + 1) if qb < K else [0, qb,
                                                      *rng.choice(np.arange(1, qb), K - 2, replace=False)]
                for j in picks:
                    lists[j].append(qb)
            out.update({(h, b, j): sorted(lists[j]) for j in range(nb)})
    return out


def cta_order(order: str, B: int, nb: int, heavy: int = 1) -> list:
    """Launch order. "key": key block slowest (the kernel's order 0); "hb": block 0 of every (h, b)
    first, then (h, b) slowest (order 1); with `heavy` > 1, blocks 1 .. heavy - 1 of every (h, b)
    ((h, b) slowest) come before the rest."""
    if order == "key":
        return [(h, b, j) for j in range(nb) for b in range(B) for h in range(H)]
    first = [(h, b, 0) for b in range(B) for h in range(H)]
    cut = min(max(heavy, 1), nb)
    return first + [(h, b, j) for b in range(B) for h in range(H) for j in range(1, cut)] \
        + [(h, b, j) for b in range(B) for h in range(H) for j in range(cut, nb)]


def simulate(lists: dict, ctas: list, walk: str, split0: int, cap_tiles: int, passes: int = 1,
             nqb: int = 0) -> tuple[float, int, float]:
    """L2 hit rate, makespan and ideal makespan. `passes` > 1: the kernel's query-range passes, one
    after the other (query blocks [p nqb / P, (p + 1) nqb / P) in pass p; a CTA with none exits at
    once; the LRU carries over). walk "phase": each CTA walks its (descending) list cyclically from
    the point a wavefront that sweeps the pass's range once per mean CTA length has reached when
    the CTA starts (the mean taken from the lists: an oracle a kernel would estimate)."""
    lru, hits, reads, end = collections.OrderedDict(), 0, 0, 0
    total = 0
    for p in range(passes):
        lo, hi = p * nqb // passes, (p + 1) * nqb // passes
        work = []
        for c in ctas:
            qbs = [qb for qb in lists[c] if passes == 1 or lo <= qb < hi]
            qbs = qbs if walk == "up" else qbs[::-1]
            n = len(qbs)
            if n == 0:
                continue
            parts = split0 if c[2] == 0 and passes == 1 else 1
            work += [(c, qbs[i * n // parts:(i + 1) * n // parts]) for i in range(parts)]
        if not work:
            continue
        n_tiles = TILES_PER_QB * sum(len(q) for _, q in work)
        total += n_tiles
        sweep = n_tiles / len(work)
        start, heap = end, []

        def tiles(w, now):
            (h, b, _), qbs = work[w]
            if walk == "phase" and len(qbs) > 1:
                x = hi - 1 - ((now - start) / sweep % 1.0) * (hi - lo)   # the wavefront's query block
                k = next((pos for pos, qb in enumerate(qbs) if qb <= x), 0)
                qbs = qbs[k:] + qbs[:k]
            return [(h, b, qb, t) for qb in qbs for t in range(TILES_PER_QB)]

        for s in range(min(SLOTS, len(work))):
            heapq.heappush(heap, (start, s, 0, tiles(s, start)))
        nxt, seq = min(SLOTS, len(work)), SLOTS
        while heap:
            now, s, k, tl = heapq.heappop(heap)
            if k == len(tl):
                end = max(end, now)
                if nxt < len(work):
                    heapq.heappush(heap, (now, seq, 0, tiles(nxt, now)))
                    nxt, seq = nxt + 1, seq + 1
                continue
            reads += 1
            if tl[k] in lru:
                hits += 1
                lru.move_to_end(tl[k])
            else:
                lru[tl[k]] = None
                if len(lru) > cap_tiles:
                    lru.popitem(last=False)
            heapq.heappush(heap, (now + 1, s, k + 1, tl))
    return hits / reads, end, total / SLOTS


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, default=32768)
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--order", default="hb", choices=["key", "hb"])
    p.add_argument("--walk", default="down", choices=["up", "down", "phase"])
    p.add_argument("--passes", type=int, default=1, help="query-range passes (the kernel's dkdv_passes)")
    p.add_argument("--split0", type=int, default=8, help="parts of block 0")
    p.add_argument("--cap", type=int, default=1200, help="L2 capacity in 32-KB tiles")
    p.add_argument("--heavy", type=int, default=1, help="order hb: key blocks 1 .. heavy - 1 first")
    a = p.parse_args()
    lists = tile_lists(a.T, a.B)
    hit, end, ideal = simulate(lists, cta_order(a.order, a.B, a.T // 64, a.heavy), a.walk, a.split0, a.cap,
                               a.passes, a.T // 64)
    print(f"T={a.T} B={a.B} order={a.order} heavy={a.heavy} walk={a.walk} split0={a.split0} "
          f"passes={a.passes}: L2 hit rate {hit:.3f}, "
          f"makespan {end} steps (ideal {ideal:.0f})")


if __name__ == "__main__":
    main()
