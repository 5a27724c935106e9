"""``rlkernels bench`` / ``python -m rlkernels.bench``: the benchmark entry point.

Each suite lives in ``rlkernels/bench/<suite>.py`` and exposes ``run(args) -> list[dict]``,
optionally ``add_arguments(parser)`` for its own options, and ``NEEDS_CUDA`` (default
True; a suite that runs on the CPU sets it False). Every argument -- suite names first,
then the GPU a suite needs, then the suite's own options -- is checked before any suite runs.
"""
from __future__ import annotations

import argparse
import importlib
import os
import textwrap
from types import ModuleType

SUITES = ("gemm", "training", "logprob", "sample", "bmm", "cpu", "attention", "model", "moe", "tp", "rollout")
# ``all``: the GPU suites (what the README's GPU benchmark command runs); ``cpu`` runs only by name.
ALL = ("gemm", "training", "logprob", "bmm")
SUITE_HELP = {
    "gemm": "matmul/linear forward, bf16 and fp32 (IEEE), M from 1 (decode) to 16384 (prefill) on "
            "LLM layer shapes: rlkernels vs stock cuBLAS and cuBLASLt-no-split; time, TFLOP/s, ratio to stock",
    "training": "Linear forward+backward at 8192 tokens, bf16: rlkernels vs torch autograd; "
                "the dX and dW kernels alone in TFLOP/s",
    "logprob": "fused lm-head log-prob (+ entropy) vs materialized logits + log_softmax, and Liger / "
               "Cut Cross-Entropy when installed: forward ms, forward+backward ms, extra peak memory",
    "sample": "fused lm-head sampling (linear_sample) vs logits GEMM + softmax + multinomial at N = 1 .. "
              "4096, D = 2048 / 4096, V = 151936: eager ms, graph-replay µs, ratio, extra peak memory",
    "bmm": "tiny batched matmuls vs torch.bmm (CUDA-graph replay): µs, speedup, GB/s against a measured "
           "copy bandwidth",
    "cpu": "the CPU (torch) backend, a reference path, vs stock PyTorch on the CPU; needs no GPU",
    "attention": "batch-invariant fused attention (bf16, 16/8 heads, causal): prefill fwd and fwd+bwd TFLOP/s "
                 "vs SDPA flash/cuDNN and FlexAttention, decode µs and TB/s, prefill == decode bits",
    "model": "a random-weight HF model (Qwen3-1.7B shape by default), stock vs rlkernels: scoring, a "
             "policy-gradient training step, generate and long-sequence scoring; ms, tok/s, peak GiB, ratio, "
             "and the share of log-probs that are bitwise equal batched vs alone (sampler vs trainer for "
             "generate); --device cpu --config tiny runs without a GPU",
    "moe": "the invariant mixture-of-experts block vs stock transformers (eager and grouped_mm experts) at "
           "Qwen3-30B-A3B's shape: the layer alone over 1 .. 16384 tokens (forward, forward+backward), a 4-layer "
           "model's scoring, training and eager decode; ms, ratio, bitwise share; --device cpu runs tiny shapes",
    "rollout": "an RL step's rollout (P prompts x N samples, EOS row scaled so responses end after ~M tokens): "
               "rlkernels.rollout (continuous batching) vs rlkernels.generate as one static graphed batch vs "
               "transformers' generate_batch and compiled static generate; tok/s; the decode step against its HBM "
               "floor and its launches per layer; --device cpu --config tiny runs without a GPU",
    "tp": "the TP-invariant row-parallel linear and vocab-parallel log-prob vs the stock TP layers (all_reduce), "
          "one process per GPU (NCCL) at TP 1, 2, 4, ..; ms, ratio, bitwise equal to TP = 1; --device cpu runs "
          "gloo processes",
}

DESCRIPTION = """\
Time rlkernels against stock PyTorch (and installed peers) and print a table per
suite: medians of device-event timings, with stock measured in the same run.
Every suite except cpu (and model with --device cpu) needs a CUDA GPU."""


def _suite_list() -> str:
    width = max(len(s) for s in SUITES)
    lines = [textwrap.fill(text, 78, initial_indent=f"  {name:<{width}}  ", subsequent_indent=" " * (width + 4))
             for name, text in [*SUITE_HELP.items(), ("all", ", ".join(ALL))]]
    return ("suites (one, a comma-separated list, or all):\n" + "\n".join(lines) +
            "\n\nexamples:\n  rlkernels bench gemm --quick\n  rlkernels bench all --json results/\n"
            "  rlkernels bench gemm --help   (the suite's own options)")


def _common_parser(prog: str, description: str, epilog: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog, add_help=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-h", "--help", action="store_true", help="show this help and exit (after a suite name: "
                                                                  "that suite's options too)")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="write results as JSON: a file for one suite, a directory (one <suite>.json each) "
                             "for several")
    parser.add_argument("--quick", action="store_true", help="fewer shapes (a smoke run)")
    return parser


def _suite_parser(name: str, mod: ModuleType) -> argparse.ArgumentParser:
    """The suite's own options (its add_arguments), for parsing what the common parser left."""
    parser = argparse.ArgumentParser(prog=f"rlkernels bench {name}", add_help=False)
    if hasattr(mod, "add_arguments"):
        mod.add_arguments(parser)
    return parser


def _suite_help(name: str, mod: ModuleType) -> str:
    parser = _common_parser(f"rlkernels bench {name}", textwrap.fill(SUITE_HELP[name], 78), None)
    if hasattr(mod, "add_arguments"):
        mod.add_arguments(parser.add_argument_group(f"{name} options"))
    needs = "needs a CUDA GPU" if getattr(mod, "NEEDS_CUDA", True) else "runs without a GPU"
    parser.epilog = f"This suite {needs}."
    return parser.format_help()


def main(argv: list[str] | None = None) -> int:
    parser = _common_parser("rlkernels bench", DESCRIPTION, _suite_list())
    parser.add_argument("suite", nargs="?", help="which suite(s) to run: see below")
    args, rest = parser.parse_known_args(argv)
    if args.suite is None:
        if args.help:
            parser.print_help()
            return 0
        parser.error(f"missing suite; expected one of {', '.join(SUITES)}, all, or a comma-separated list")
    names = tuple(n for item in args.suite.split(",") for n in (ALL if item == "all" else (item,)))
    unknown = [s for s in names if s not in SUITES]
    if unknown:
        parser.error(f"unknown suite {', '.join(repr(s) for s in unknown)}; "
                     f"expected one of {', '.join(SUITES)}, all, or a comma-separated list")
    mods = {name: importlib.import_module(f"rlkernels.bench.{name}") for name in dict.fromkeys(names)}
    if args.help:
        print("\n".join(_suite_help(name, mod) for name, mod in mods.items()), end="")
        return 0
    many = len(mods) > 1
    plans = []
    for name, mod in mods.items():  # parse every suite's options before any suite runs
        sub_args = _suite_parser(name, mod).parse_args(rest)
        sub_args.quick = args.quick
        sub_args.json = os.path.join(args.json, f"{name}.json") if args.json and (many or os.path.isdir(args.json)) \
            else args.json
        plans.append((mod, sub_args))
    if args.json and not (many or os.path.isdir(args.json)):
        parent = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(parent):
            parser.error(f"argument --json: directory {parent!r} does not exist")
    elif args.json and os.path.exists(args.json) and not os.path.isdir(args.json):
        parser.error(f"argument --json: {args.json!r} is a file; several suites write one <suite>.json each "
                     "into a directory")
    need_cuda = [name for name, mod in mods.items() if getattr(mod, "NEEDS_CUDA", True)]
    if need_cuda:
        import torch

        if not torch.cuda.is_available():
            hint = "" if "cpu" in mods else "; `rlkernels bench cpu` runs without one"
            parser.error(f"suite{'s' if len(need_cuda) > 1 else ''} {', '.join(need_cuda)} "
                         f"need{'' if len(need_cuda) > 1 else 's'} a CUDA GPU (timings are CUDA-event medians) "
                         f"and torch sees none here{hint}")
    if args.json and many:
        os.makedirs(args.json, exist_ok=True)
    for mod, sub_args in plans:
        mod.run(sub_args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
