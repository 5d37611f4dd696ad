"""`python -m infllm_cupy` (or the `infllm-cupy` script): the command line. One command for now, `demo`."""
from __future__ import annotations

import argparse
import os
import sys
import time

DEMO_DESCRIPTION = """\
The InfLLM-v2 pipeline on one synthetic long sequence with planted "needles" (a block of keys and a
later run of queries that look for it). On a GPU, key compression, stage 1 and stage 2 run their CUDA
kernels; without one, their CPU implementations (work that grows with the selection, not the
sequence squared; the references stay the oracle). Prints how
long each stage took and what was selected, and writes a PNG of the selected blocks.

Selection budget (MiniCPM4's definition): every query token gets K = topk + local-blocks 64-key blocks;
the first block and the local window (the query's own block and the local-blocks before it) are forced
and count inside K, and the other topk - 2 slots go to the best-scoring blocks. MiniCPM4: topk 64,
local-blocks 32, so K = 96 = 1 + 33 forced + 62 by score.

Retrieval is measured against a control: the same sequence without the needles' queries (the same keys,
the needle blocks included; each needle's 64 queries without the direction that looks for its block).
Stage 1 runs on each needle's queries as they are and as the control's, and counts only the (query
token, KV head) pairs for which the needle's block is a choice by score (not an init block, not in the
token's local window). A needle is retrieved when, among those pairs whose control query leaves its
block out, at least half select it (the gain): the control's gain is 0 by construction, perfect
retrieval's 1, at any budget. --control runs the control itself: there is then nothing to retrieve,
and the demo must report that and fail. A budget that holds the block for every query, or a window
that forces it, leaves nothing to show and fails too, with a hint.

Exit status: 0 when every needle is retrieved (gain >= 0.5), 1 when one is not (always with --control),
2 for a bad option."""

INIT_BLOCKS = 1     # MiniCPM4's init_blocks, which the demo does not expose
BLOCK = 64


def _timed(fn, device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) * 1e3


def _int_at_least(low: int):
    """An argparse type: an int >= `low` (the bound the option's help states)."""
    def parse(text: str) -> int:
        try:
            val = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if val < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {val}")
        return val
    return parse


_positive_int = _int_at_least(1)
_nonnegative_int = _int_at_least(0)


def _needle_count(text: str) -> int:
    """--needles: at least 1. With none the retrieval check would have nothing to measure, and a check
    that passes on nothing could not fail its control."""
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError as e:
        if "at least" not in str(e):
            raise
        raise argparse.ArgumentTypeError(f"{e}: with no needle there is nothing to retrieve, and the "
                                         f"retrieval check could not fail") from None


def add_demo_arguments(p: argparse.ArgumentParser, has_gpu: bool) -> None:
    # the budget defaults by machine (a CPU has ~1/100 of a GPU's rate); the help shows this machine's
    p.add_argument("--tokens", type=_int_at_least(4 * BLOCK), default=32768,
                   help="length of the one sequence; at least 256, and 256 per needle")
    p.add_argument("--device", default="cuda" if has_gpu else "cpu",
                   help="cpu (every stage on its CPU implementation) or cuda / cuda:N (the CUDA kernels)")
    p.add_argument("--heads", type=_positive_int, default=32,
                   help="query heads HQ (a multiple of --kv-heads)")
    p.add_argument("--kv-heads", type=_positive_int, default=2, help="key/value heads H")
    p.add_argument("--head-dim", type=_positive_int, default=128,
                   help="head dimension D (the CUDA kernels take 64 or 128)")
    p.add_argument("--needles", type=_needle_count, default=4,
                   help="needles to plant: key blocks in the first quarter, their queries in the second "
                        "half; at least 1 (the retrieval check needs something to retrieve)")
    p.add_argument("--topk", type=_int_at_least(INIT_BLOCKS + 1), default=64 if has_gpu else 8,
                   help="selection budget: K = topk + local-blocks blocks per query token, the forced "
                        f"init block and local window included; at least {INIT_BLOCKS + 1} (MiniCPM4: 64; 8 "
                        "without a GPU)")
    p.add_argument("--local-blocks", type=_nonnegative_int, default=32 if has_gpu else 4,
                   help="local window in blocks besides the query's own (MiniCPM4: 32, so 33 forced local "
                        "blocks; 4 without a GPU)")
    p.add_argument("--control", action="store_true",
                   help="plant the needle keys but not the queries that look for them: nothing to retrieve, "
                        "so the retrieval check must fail (exit status 1)")
    p.add_argument("--png", default="infllm_selection.png",
                   help="where to write the plot of the selected blocks")
    p.add_argument("--no-png", action="store_true", help="write no plot")


def _check_device(p: argparse.ArgumentParser, text: str):
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        p.error(f"argument --device: expected cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        p.error(f"argument --device: expected cpu, cuda or cuda:N, got {text!r} (no kernels for "
                f"{device.type})")
    if not torch.cuda.is_available():
        p.error(f"argument --device: {text!r}, but torch sees no CUDA GPU here (torch {torch.__version__}, "
                f"torch.cuda.is_available() is False); use --device cpu")
    if device.index is not None and device.index >= torch.cuda.device_count():
        p.error(f"argument --device: {text!r}, but there are only {torch.cuda.device_count()} CUDA device(s)")
    from ._cupy import import_cupy

    try:
        import_cupy()
    except ImportError as e:
        p.error(f"argument --device: {text!r}: {e}")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def _check_png(p: argparse.ArgumentParser, path: str) -> None:
    """Fail before the run, not after it, when the PNG cannot be written."""
    if not path:
        p.error("argument --png: empty path (use --no-png to write no plot)")
    if os.path.isdir(path):
        p.error(f"argument --png: {path!r} is a directory")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        p.error(f"argument --png: the directory {parent!r} does not exist")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        p.error(f"argument --png: {path!r} is not writable")


def _check_memory(p: argparse.ArgumentParser, args: argparse.Namespace, device) -> None:
    """Refuse sizes this machine cannot hold, naming the options, before anything is allocated: q, k, v,
    the output and the compressed keys in bf16, against the device's free memory or the host's RAM (the
    CPU implementations work in chunks of bounded size, so nothing grows with T^2)."""
    import torch

    T, HQ, H, D = args.tokens, args.heads, args.kv_heads, args.head_dim
    need = 2 * T * D * (2 * HQ + 2 * H) * 2
    if device.type == "cpu":
        try:
            have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):   # no sysconf (Windows): no estimate
            return
    else:
        have = torch.cuda.mem_get_info(device)[0]
    if need > have:
        p.error(f"arguments --tokens {T} / --heads {HQ}: the run needs about {need / 2**30:.1f} GiB, more "
                f"than the {have / 2**30:.1f} GiB of "
                f"{'host memory' if device.type == 'cpu' else 'free GPU memory'} here; "
                f"lower --tokens or --heads")


def check_demo_args(p: argparse.ArgumentParser, args: argparse.Namespace):
    """Every cross-option rule of the demo, as argparse errors (usage, message, exit status 2)."""
    min_tokens = max(4 * BLOCK, 4 * BLOCK * args.needles)
    if args.tokens < min_tokens:
        p.error(f"argument --tokens: at least {min_tokens} tokens for {args.needles} needle(s) "
                f"(256, and 256 per needle: each needle needs its own key block in the first quarter), "
                f"got {args.tokens}")
    if args.heads % args.kv_heads:
        p.error(f"argument --heads: {args.heads} query heads is not a multiple of --kv-heads {args.kv_heads} "
                f"(each KV head serves HQ / H query heads)")
    if args.topk < INIT_BLOCKS + 1:
        p.error(f"argument --topk: at least {INIT_BLOCKS + 1}, got {args.topk}: K = topk + local-blocks "
                f"slots must hold the init block and the local-blocks + 1 local blocks ({INIT_BLOCKS + 1} "
                f"keeps only those)")
    device = _check_device(p, args.device)
    _check_memory(p, args, device)
    if device.type == "cuda" and args.head_dim not in (64, 128):
        p.error(f"argument --head-dim: the CUDA kernels take 64 or 128, got {args.head_dim} "
                f"(--device cpu runs any head dimension)")
    if not args.no_png:
        _check_png(p, args.png)
    return device


def run_demo(args: argparse.Namespace, device) -> int:
    import torch
    from tqdm import tqdm

    from . import compress_k
    from .config import InfLLMv2Config
    from .stage1 import stage1_select
    from .stage2.attention import sparse_attn_varlen
    from .synthetic import RETRIEVAL_GAIN, needle_retrieval, synthetic_sequence
    from .viz import plot_selection_maps, selection_density

    T, HQ, H, D = args.tokens, args.heads, args.kv_heads, args.head_dim
    # always sparse, even below MiniCPM's 8192-token dense fallback
    cfg = InfLLMv2Config(dense_len=0, topk=args.topk, local_blocks=args.local_blocks, init_blocks=INIT_BLOCKS)
    kernels = device.type == "cuda"
    impl = impl1 = "kernel" if kernels else "cpu"          # on CPU every stage's CPU implementation
    K = cfg.topk + cfg.local_blocks
    name = torch.cuda.get_device_name(device) if kernels else "CPU"
    print(f"InfLLM-v2 demo on {name}: one sequence of {T} "
          f"tokens, HQ={HQ}, H={H}, D={D}, bf16; K = topk {cfg.topk} + local_blocks {cfg.local_blocks} = {K} "
          f"blocks of {cfg.block_size} keys per token: {cfg.init_blocks} init + {cfg.local_blocks + 1} local "
          f"(the query's own block and the {cfg.local_blocks} before it) forced, "
          f"{K - cfg.init_blocks - cfg.local_blocks - 1} by score")
    q, k, v, needles, q_control = synthetic_sequence(T, HQ, H, D, args.needles, torch.bfloat16, device,
                                                     needle_logit=0.0 if args.control else 8.0,
                                                     return_control=True)
    if args.control:
        print("control: the needle keys are planted, the queries that look for them are not")
    cu = torch.tensor([0, T], dtype=torch.int32, device=device)

    def select():
        return stage1_select(q, ck1, ck2, cu, cu1, cu2, T, topk=cfg.topk, local_blocks=cfg.local_blocks,
                             init_blocks=cfg.init_blocks)

    timings = {}
    # one bar step per stage (stage 2 takes seconds on CPU); off when stderr is not a terminal
    with tqdm(total=5, unit="stage", disable=None, leave=False) as bar:
        if kernels:   # compile outside the timings
            bar.set_description("compiling kernels")
            cu256 = torch.tensor([0, 256], dtype=torch.int32, device=device)
            compress_k(k[:256], cu256)
        bar.set_description("compress 32/16")
        (ck1, cu1), timings[f"compress 32/16 [{impl1}]"] = _timed(
            lambda: compress_k(k, cu, cfg.kernel_size, cfg.kernel_stride), device)
        bar.update()
        bar.set_description("compress 128/64")
        (ck2, cu2), timings[f"compress 128/64 [{impl1}]"] = _timed(
            lambda: compress_k(k, cu, cfg.coarse_kernel_size, cfg.coarse_kernel_stride), device)
        bar.update()
        bar.set_description("stage 1")
        if kernels:
            select()
        topk_idx, timings[f"stage 1 + pooling + top-k [{impl1}]"] = _timed(select, device)
        bar.update()
        bar.set_description("stage 2")
        backend = "kernels" if kernels else "auto"
        with torch.no_grad():
            if kernels:
                sparse_attn_varlen(q[:256], k[:256], v[:256], cu256, cu256, topk_idx[:, :256], 256, 256)
            out, timings[f"stage 2 sparse attention [{impl}]"] = _timed(
                lambda: sparse_attn_varlen(q, k, v, cu, cu, topk_idx, T, T, backend=backend), device)
        bar.update()
        bar.set_description("retrieval check")
        found, timings[f"retrieval check: stage 1 x2 [{impl}]"] = _timed(
            lambda: needle_retrieval(q, k, q_control, needles, cfg, backend=backend), device)
        bar.update()

    print("\nstage timings (ms, one run after warm-up compiles):" if kernels else
          "\nstage timings (ms, one run of each, every stage on its CPU implementation):")
    for name, ms in timings.items():
        print(f"  {name:42s} {ms:10.1f}")

    valid = topk_idx >= 0
    K = topk_idx.shape[-1]
    print(f"\nselection: K = {K} slots per token and KV head; {valid.float().mean().item():.1%} of slots "
          f"used (early tokens have fewer than K causal blocks, tail -1)")
    print("  retrieval, per needle: the (query token, KV head) pairs of its 64 queries for which its block "
          "is a choice by\n  score (not forced), the share selecting it with the needle and without it (the "
          "control's queries), and\n  the gain: the share selecting it among the pairs whose control "
          "leaves it out")
    for (kb, qs), r in zip(needles, found):
        where = f"needle keys in block {kb:4d}, queries {qs}-{qs + BLOCK - 1}:"
        if not r.pairs:
            print(f"  {where} no pair by score (the block is forced for every one of its queries)")
            continue
        gain = (f"gain {r.gain:.2f} of {r.open_pairs} pairs" if r.open_pairs else
                "no pair left out by the control")
        print(f"  {where} {r.pairs:3d} pairs by score, {r.recall:4.0%} with the needle, "
              f"{r.control_recall:4.0%} without: {gain}")
    t = needles[0][1] + 32
    row = topk_idx[0, t]
    print(f"  token {t}, KV head 0 selects: {row[row >= 0].tolist()}")
    last = topk_idx[0, -1]
    print(f"  the last token attends {int((last >= 0).sum())} of its {-(-T // BLOCK)} causal blocks")
    print(f"  output finite: {bool(torch.isfinite(out).all())}")

    if not args.no_png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig = plot_selection_maps(topk_idx.cpu(), cu.cpu(), heads=range(min(H, 4)), needles=needles,
                                  suptitle=f"selected 64-key blocks, {T} tokens"
                                           f"{' (control: no needle queries)' if args.control else ''}")
        try:
            fig.savefig(args.png, dpi=110)
        except OSError as e:
            print(f"{_prog()} demo: error: argument --png: cannot write {args.png!r}: {e}",
                  file=sys.stderr)
            return 2
        finally:
            plt.close(fig)
        print(f"\nwrote {args.png}: query block (y) against key block (x), shaded by the share of the "
              f"block's tokens that selected it; needles circled, the future (not causal) in grey")
        dens = selection_density(topk_idx.cpu(), cu.cpu(), cu.cpu())
        nqb = dens.shape[0]
        share = dens.sum().item() / (nqb * (nqb + 1) / 2)
        print(f"  density: {share:.1%} of the causal (query block, key block) pairs")
    missed = [(kb, r) for (kb, _), r in zip(needles, found) if not r.retrieved]
    if missed:
        kb, r = missed[0]
        if args.control:
            hint = " (--control: expected)"
        elif r.pairs == 0:
            hint = (f"; the local window of {cfg.local_blocks + 1} blocks reaches back to the needle block "
                    f"from its queries: lower --local-blocks or raise --tokens")
        elif cfg.topk <= cfg.init_blocks + 1:
            hint = f"; --topk {cfg.topk} keeps only the forced blocks, no slot by score: raise --topk"
        elif r.open_pairs == 0:
            hint = (f"; K = {K} slots leave little to choose (the control selects the block for every pair): "
                    f"lower --topk or raise --tokens")
        else:
            hint = ""
        print(f"\nno retrieval: the needle(s) in key block(s) {[b for b, _ in missed]} are not retrieved "
              f"(block {kb}: {r.reason()}){hint}; exit status 1", file=sys.stderr)
        return 1
    print(f"\nretrieved: every needle's block is selected in at least {min(r.gain for r in found):.0%} of "
          f"the pairs whose control query leaves it out ({RETRIEVAL_GAIN:.0%} needed; the control: 0% by "
          f"construction)")
    return 0


def _prog() -> str:
    """The name the command was called by: `infllm-cupy` (the installed script) or
    `python -m infllm_cupy`."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name.startswith("infllm-cupy") else "python -m infllm_cupy"


def build_parser(has_gpu: bool | None = None) -> argparse.ArgumentParser:
    from . import __version__

    if has_gpu is None:
        import torch

        has_gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(
        prog=_prog(),
        description="InfLLM-v2 block-sparse attention: CUDA kernels compiled at run time, PyTorch "
                    "references of every op.")
    p.add_argument("--version", action="version", version=f"infllm-cupy {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    demo = sub.add_parser("demo", help="run the pipeline on a synthetic sequence and plot what it selects",
                          description=DEMO_DESCRIPTION,
                          formatter_class=type("Formatter", (argparse.ArgumentDefaultsHelpFormatter,
                                                             argparse.RawDescriptionHelpFormatter), {}))
    add_demo_arguments(demo, has_gpu)
    demo.set_defaults(parser=demo)   # the cross-option checks report through the demo's own usage line
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = build_parser()
    if not argv:
        p.print_help(sys.stderr)
        return 2
    args = p.parse_args(argv)
    if args.command == "demo":
        device = check_demo_args(args.parser, args)
        return run_demo(args, device)
    p.print_help(sys.stderr)   # options without a command (none today besides --version)
    return 2


def demo(argv=None) -> int:
    """`python -m infllm_cupy demo ARGV...`."""
    return main(["demo", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
