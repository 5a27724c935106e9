"""A/B of source trees: the same linear_logprob timings from several checkouts, in
alternating processes, with the output bits compared.

    python benchmarks/ab_trees.py NAME=PATH [NAME=PATH ...] [--rounds 5] [--shape N,D,V] [--json OUT]

Each PATH is a checkout (its ``src`` goes first on PYTHONPATH). Every round runs one
worker process per tree, in a rotating order, so clock and temperature drift are shared
between the trees; a tree's time is the median over rounds of its workers' medians. A
worker times (``triton.testing.do_bench`` medians after warm-up) the forward, the
forward+backward, and the backward's dH GEMM over one 8192-column chunk
(``dH += g @ W[chunk]``, fp32 accumulator), and hashes its outputs: a change that
should not move a bit must give every tree the same hashes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = r"""
import hashlib, json, sys
import torch, triton.testing
import rlkernels
from rlkernels import linear_logprob
from rlkernels.ops.matmul import engine_for
n, d, v = (int(x) for x in sys.argv[1].split(","))
gen = torch.Generator(device="cuda").manual_seed(0)
bf = torch.bfloat16
h = torch.randn(n, d, device="cuda", generator=gen).to(bf).requires_grad_()
w = (torch.randn(v, d, device="cuda", generator=gen) * 3 * d ** -0.5).to(bf).requires_grad_()
t = torch.randint(0, v, (n,), device="cuda", generator=gen)
gl, ge = torch.randn(n, device="cuda", generator=gen), torch.randn(n, device="cuda", generator=gen)
def fwd():
    return linear_logprob(h, w, t, return_entropy=True)
def fwd_bwd():
    lp, en = fwd()
    return (lp, en, *torch.autograd.grad((lp, en), (h, w), (gl, ge)))
cv = min(v, 8192)
g = torch.randn(n, cv, device="cuda", generator=gen).to(bf) * 1e-3
acc = torch.randn(n, d, device="cuda", generator=gen)
engine = engine_for(h.device, "triton")
def dh():
    engine.gemm(g, w.detach()[:cv], out=acc, accumulate=True)
def digest(ts):
    m = hashlib.sha256()
    for x in ts:
        m.update(x.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return m.hexdigest()[:16]
outs = fwd_bwd()
start = acc.clone()
dh()
hashes = {"fwd_bwd": digest(outs), "dh": digest([acc])}
acc.copy_(start)
del outs
res = {}
for name, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd), ("dh_chunk", dh)):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    res[name] = triton.testing.do_bench(fn, warmup=50, rep=400, return_mode="median")
import triton
env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
print("RESULT " + json.dumps({"ms": res, "hashes": hashes, "rlkernels": rlkernels.__file__, "env": env}))
"""


def run_worker(path: str, shape: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(path, "src"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", WORKER, shape], env=env, capture_output=True, text=True, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"worker for {path} failed:\n{out.stderr[-2000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trees", nargs="+", help="NAME=PATH")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--shape", default="8192,4096,151936", help="N,D,V")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    trees = dict(t.split("=", 1) for t in args.trees)
    names = list(trees)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(run_worker(trees[name], args.shape))
            print(name, runs[name][-1]["ms"], flush=True)
    summary = {}
    for name in names:
        summary[name] = {k: statistics.median(w["ms"][k] for w in runs[name]) for k in runs[name][0]["ms"]}
        summary[name]["hashes"] = sorted({json.dumps(w["hashes"], sort_keys=True) for w in runs[name]})
    first = names[0]
    for name in names:
        summary[name]["same_bits_as_" + first] = summary[name]["hashes"] == summary[first]["hashes"]
        summary[name]["fwd_bwd_ratio"] = summary[name]["fwd_bwd"] / summary[first]["fwd_bwd"]
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "ab_trees", "shape": args.shape, "trees": trees, "summary": summary, "runs": runs},
                      f, indent=1)


if __name__ == "__main__":
    main()
