"""bmm benchmark: the tiny-matrix kernel vs torch.bmm (cuBLAS), CUDA-graph replay timing.

    python -m rlkernels.bench bmm [--json PATH] [--quick] [--sweep]

Per shape and dtype: rlkernels µs, torch.bmm µs (TF32 off, so fp32 is IEEE on
both sides), the general batch-invariant path µs, speedup, achieved GB/s
(a + b + c bytes once each) and its share of a measured device copy bandwidth
(a large ``dst.copy_(src)`` timed in the same run). ``--sweep`` also times every
candidate tiny config, checks they all give the table config's bits, and prints
replacement lines for ``rlkernels.ops.bmm.TINY_TABLE``.
"""
from __future__ import annotations

import argparse
from typing import Any

import torch

from .common import graph_median_us, median_ms, print_table, write_json

SHAPES: tuple[tuple[int, int, int, int], ...] = (  # (B, m, n, k)
    (1024, 12, 12, 64),
    (1024, 12, 64, 12),
    (4096, 16, 16, 16),
    (256, 64, 64, 64),
    (8192, 8, 8, 32),
)
DTYPES = (torch.float32, torch.bfloat16)
# Goals of issue 6: >= 2x torch.bmm everywhere, and this one shape under 6.5 µs.
MIN_SPEEDUP = 2.0
# Persistent-kernel candidates of --sweep: programs per SM x pipeline depth.
PERSISTENT_PROGRAMS_PER_SM = (2, 4, 8, 16)
PERSISTENT_STAGES = (2, 3)
ABS_GOAL_US = {((1024, 12, 12, 64), torch.float32): 6.5}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sweep", action="store_true",
                        help="time every candidate tiny config and print table lines for ops/bmm.py")
    parser.add_argument("--persistent-only", action="store_true",
                        help="--sweep times only the table config and its persistent variants")
    parser.add_argument("--replays", type=int, default=200, help="kernel calls per CUDA graph")
    parser.add_argument("--shapes", default=None,
                        help="comma-separated indices into SHAPES (e.g. 0,2) to split a long --sweep")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated torch dtype names")


def candidate_configs(m: int, n: int, k: int, dtype: torch.dtype, *, persistent_only: bool = False) -> list[Any]:
    """Tiny configs worth timing for one shape (the table config among them)."""
    from ..ops.bmm import TinyConfig, tiny_blocks, tiny_config

    modes = (True, False) if dtype == torch.float32 else (True,)
    out = []
    for use_dot in modes if not persistent_only else ():
        for group in (1, 2, 4, 8, 16):
            for warps in (1, 2, 4, 8):
                cfg = TinyConfig(group, warps, use_dot)
                bm, bn, bk = tiny_blocks(m, n, k, cfg, dtype)
                staged = group * max(bm * bk, bk * bn, bm * bn)
                # Skip configs that spill (> 64 staged elements of one operand per
                # thread; such kernels also take ptxas minutes to compile) or
                # leave most threads idle.
                if staged > 64 * 32 * warps or staged < 32 * warps:
                    continue
                out.append(cfg)
    table = tiny_config(m, n, k, dtype)
    if table not in out:
        out.append(table)
    # Persistent variants of the table's config and of one twice as wide: the same
    # per-group code, with the next group's loads in flight (placement only).
    for base in (table, TinyConfig(table.group * 2, table.num_warps, table.use_dot)):
        bm, bn, bk = tiny_blocks(m, n, k, base, dtype)
        if base.group * max(bm * bk, bk * bn, bm * bn) > 64 * 32 * base.num_warps:
            continue
        for per_sm in PERSISTENT_PROGRAMS_PER_SM:
            for stages in PERSISTENT_STAGES:
                cfg = TinyConfig(base.group, base.num_warps, base.use_dot, per_sm, stages)
                if cfg not in out:
                    out.append(cfg)
    return out


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device copy bandwidth (read + write bytes / s) of a large dst.copy_(src), GB/s."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e9


def launch_floor_us(replays: int) -> float:
    """GPU time per kernel of a trivial kernel (a 1-element fill) under graph replay:
    the least any kernel costs here, whatever it computes."""
    x = torch.empty(1, device="cuda")
    return graph_median_us(lambda: x.fill_(1.0), replays=replays)


def _operands(B: int, m: int, n: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(B * 7 + m * 5 + n * 3 + k)
    a = torch.randn(B, m, k, device="cuda", generator=g).to(dtype)
    b = (torch.randn(B, k, n, device="cuda", generator=g) * k ** -0.5).to(dtype)
    return a, b


def _bytes(B: int, m: int, n: int, k: int, dtype: torch.dtype) -> int:
    return B * (m * k + k * n + m * n) * torch.tensor([], dtype=dtype).element_size()


def _sweep(a: torch.Tensor, b: torch.Tensor, replays: int,
           persistent_only: bool = False) -> tuple[list[dict[str, Any]], str]:
    from ..ops.bmm import _triton_bmm, tiny_config

    B, m, k = a.shape
    n, dtype = b.shape[-1], a.dtype
    want = _triton_bmm(a, b, dtype, config=tiny_config(m, n, k, dtype))
    rows = []
    for cfg in candidate_configs(m, n, k, dtype, persistent_only=persistent_only):
        try:
            same = torch.equal(_triton_bmm(a, b, dtype, config=cfg), want)
            us = graph_median_us(lambda: _triton_bmm(a, b, dtype, config=cfg), replays=replays)
        except Exception as exc:  # noqa: BLE001 - a config that cannot launch is reported, not fatal
            rows.append({"config": cfg.short(), "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
            continue
        rows.append({"config": cfg.short(), "us": us, "same_bits": same, "cfg": cfg})
    ok = [r for r in rows if "us" in r and r["same_bits"]]
    best = min(ok, key=lambda r: r["us"])["cfg"] if ok else None
    dt = {torch.float32: "_F32", torch.bfloat16: "_BF16", torch.float16: "_F16"}[dtype]
    extra = f", {best.programs_per_sm}, {best.num_stages}" if best is not None and best.persistent else ""
    line = (f"    ({m}, {n}, {k}, {dt}): TinyConfig({best.group}, {best.num_warps}, {best.use_dot}{extra}),"
            if best else f"    # ({m}, {n}, {k}, {dt}): no candidate gave the table's bits")
    for r in rows:
        r.pop("cfg", None)
    return rows, line


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import rlkernels.ops.bmm as bmm_mod
    from rlkernels.ops.bmm import bmm, tiny_config

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 torch.bmm must be IEEE like ours
    replays = getattr(args, "replays", 200)
    copy_gbs = copy_bandwidth_gbs()
    floor_us = launch_floor_us(replays)
    shapes = SHAPES[:2] if args.quick else SHAPES
    if getattr(args, "shapes", None):
        shapes = tuple(SHAPES[int(i)] for i in args.shapes.split(","))
    dtypes = tuple(getattr(torch, name.strip()) for name in getattr(args, "dtypes", "float32,bfloat16").split(","))
    rows: list[dict[str, Any]] = []
    sweeps: dict[str, Any] = {}
    table_lines: list[str] = []
    for (B, m, n, k) in shapes:
        for dtype in dtypes:
            a, b = _operands(B, m, n, k, dtype)
            with torch.no_grad():
                ours = bmm(a, b)
                general = bmm_mod._triton_bmm(a, b, dtype, force_general=True)
                us = graph_median_us(lambda: bmm(a, b), replays=replays)
                us_general = graph_median_us(lambda: bmm_mod._triton_bmm(a, b, dtype, force_general=True),
                                             replays=replays)
                us_torch = graph_median_us(lambda: torch.bmm(a, b), replays=replays)
            cfg = tiny_config(m, n, k, dtype)
            gbs = _bytes(B, m, n, k, dtype) / (us * 1e-6) / 1e9
            goal = ABS_GOAL_US.get(((B, m, n, k), dtype))
            row = {
                "shape": f"{B}x{m}x{n}x{k}", "dtype": str(dtype).replace("torch.", ""),
                "config": cfg.short(), "path": "tiny",
                "rlkernels_us": us, "torch_bmm_us": us_torch, "general_us": us_general,
                "speedup": us_torch / us, "GB/s": gbs, "copy_%": 100.0 * gbs / copy_gbs,
                "bits_eq_general": torch.equal(ours, general),
                # No kernel beats max(launch floor, bytes at copy bandwidth): the speedup
                # over torch.bmm that any kernel could reach on this shape.
                "hbm_floor_us": _bytes(B, m, n, k, dtype) / (copy_gbs * 1e3),
                "max_possible_speedup": us_torch / max(floor_us, _bytes(B, m, n, k, dtype) / (copy_gbs * 1e3)),
                "goal_met": (us_torch / us >= MIN_SPEEDUP) and (goal is None or us <= goal),
            }
            rows.append(row)
            if getattr(args, "sweep", False):
                sweep_rows, line = _sweep(a, b, replays, getattr(args, "persistent_only", False))
                sweeps[f"{row['shape']}/{row['dtype']}"] = sweep_rows
                table_lines.append(line)
                print_table(f"bmm sweep {row['shape']} {row['dtype']}", sweep_rows,
                            ["config", "us", "same_bits", "error"])
    print_table(f"bmm (CUDA-graph replay; copy bandwidth {copy_gbs:.0f} GB/s; launch floor {floor_us:.2f} us)", rows,
                ["shape", "dtype", "config", "path", "rlkernels_us", "torch_bmm_us", "general_us", "speedup",
                 "max_possible_speedup", "GB/s", "copy_%", "bits_eq_general", "goal_met"])
    if table_lines:
        print("Suggested TINY_TABLE entries (fastest config with the table's bits):")
        print("\n".join(table_lines))
    write_json(args.json, "bmm", rows, {"copy_bandwidth_gbs": copy_gbs, "launch_floor_us": floor_us, "sweeps": sweeps,
                                        "suggested_table": table_lines})
    return rows
