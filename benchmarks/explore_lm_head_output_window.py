"""Experiment: an access-policy window that inverts the L2 policy for the lm head at decode.

    python benchmarks/explore_lm_head_output_window.py [--json PATH] [--ms 1,4,16]

The lm head's weight (1.2 GB) is larger than the H100's largest access-policy window
(128 MiB), so ``ops.l2_window`` cannot mark it streaming as it does the 20-100 MB decode
weights. But a window also sets the property of every access *outside* it (``missProp``):
a window over a small tensor with hitProp normal and missProp streaming makes everything
else -- the weight -- streaming. Session 15 traced the lm head's extra ~9 us at M = 16 to
its 4.9 MB of stored logits (benchmarks/explore_lm_head_row_cost.py); if the stored
lines are evicted and written back among the weight's reads, keeping them (window on
the output) or keeping the activation rows every program re-reads (window on x) might
remove that cost. A cache policy never changes a value: each variant's bits are
checked against the table tile without a window.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

import torch

from rlkernels.bench.common import compare_variants, print_table, write_json
from rlkernels.ops import gemm, l2_window
from rlkernels.ops._launch import current_device


def _inverted_window(keep: torch.Tensor, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` launched with a window over ``keep`` (hit normal), everything else streaming."""
    drv = l2_window._driver()
    value = l2_window._StreamAttr()
    value.window = l2_window._Window(keep.data_ptr(), keep.numel() * keep.element_size(), 1.0, l2_window._NORMAL,
                                     l2_window._STREAMING)

    def run() -> Any:
        stream = torch._C._cuda_getCurrentRawStream(current_device())
        saved = l2_window._StreamAttr()
        assert drv.get(stream, l2_window._ACCESS_POLICY_WINDOW, saved) == 0
        assert drv.set(stream, l2_window._ACCESS_POLICY_WINDOW, value) == 0
        try:
            return fn()
        finally:
            assert drv.set(stream, l2_window._ACCESS_POLICY_WINDOW, saved) == 0
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--ms", default="1,4,16")
    parser.add_argument("--shapes", default="4096x151936", help="KxN,...")
    args = parser.parse_args(argv)
    if l2_window._driver() is None:
        print("no CUDA driver API: nothing to measure")
        return 1
    rows: list[dict[str, Any]] = []
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        gen = torch.Generator(device="cuda").manual_seed(0)
        w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16()
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            cfg = gemm.gemm_config(m, n, x.dtype)

            def table(out=out, x=x, cfg=cfg):
                return gemm.triton_gemm(x, w, out=out, config=cfg, b_transposed=True)
            want = table().clone()
            fns = {"stock": lambda x=x: torch.nn.functional.linear(x, w),
                   "table": table,
                   "keep_out": _inverted_window(out, table),
                   "keep_x": _inverted_window(x, table)}
            for row in compare_variants(fns, want):
                row.update({"K": k, "N": n, "M": m, "tile": cfg.short()})
                rows.append(row)
                print(row, flush=True)
        del w
        torch.cuda.empty_cache()
    print_table("lm head at decode with an inverted L2 window (eager = do_bench; graph = replay)", rows,
                ["K", "N", "M", "tile", "variant", "eager_us", "eager_ratio", "graph_us", "graph_ratio", "same_bits"])
    write_json(args.json, "explore_lm_head_output_window", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
