"""Reproducer: an L2 cache policy on the decode GEMM's cp.async weight copies traps on the H100.

    python benchmarks/repro_async_copy_cache_hint.py

Why it matters: under do_bench the L2 starts full of dirty lines, and a weight streamed
with the normal policy makes them be written back while it is read. A read-only pass
over 100 MB took 45.2 us that way and 40.2 us evict-first (session 12). Triton 3.6
keeps ``eviction_policy="evict_first"`` in its IR but drops it when it lowers the
pipelined loads to ``cp.async`` (and TMA loads to ``cp.async.bulk.tensor``); Triton
3.9 emits ``.L2::cache_hint`` there.

What this does: the compiled decode kernels (pointer tile and TMA tile) get the hint
put back into their PTX -- on the weight's copies only, found by following the
weight parameter's registers -- and are assembled by the same backend and launched in
place of the original, each case in its own process. Variants: a policy from
``createpolicy.fractional.L2::evict_first`` or the constant CUTLASS uses
(0x12F0000000000000), with the system ptxas too where there is one. Controls: the
same patched PTX with the hints stripped, and a plain ``tl.load`` with
``eviction_policy`` (Triton emits ``ld.global...L2::cache_hint`` itself).
Session 13, H100, torch 2.11, Triton 3.6 (ptxas 12.8) and CUDA 13.0's ptxas: every
hinted ``cp.async`` (either policy, either ptxas) stopped with "an illegal instruction
was encountered"; the hinted TMA copies ran with the expected bits, and so did the
controls (benchmarks/results/repro_async_copy_cache_hint_h100_session13.log).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import types

_POLICY = "%rl_l2_policy"
_DEF = re.compile(r"^\s*(?:@!?%p\d+\s+)?[a-z][\w.:]*\s+(%r[a-z]*\d+),\s*([^;]*);")
_COPY = {
    "pointer": re.compile(r"^(\s*(?:@!?%p\d+\s+)?cp\.async\.cg\.shared\.global)(\s+\[[^\]]*\],\s*\[\s*(%rd\d+)[^\]]*\],"
                          r"[^;]*);(.*)$"),
    "tma": re.compile(r"^(\s*(?:@!?%p\d+\s+)?cp\.async\.bulk\.tensor\.\S+?)(\s+\[[^\]]*\],\s*\[(%rd\d+),[^\]]*\],"
                      r"\s*\[[^\]]*\]);(.*)$"),
}


def hinted_ptx(ptx: str, param: int, kind: str, policy: str) -> tuple[str, int]:
    """``ptx`` with an L2 policy on the async copies whose source derives from ``param``."""
    entry = re.search(r"\.entry\s+(\w+)\s*\(", ptx).group(1)
    root = re.search(rf"(?:ld\.param\.[bus]64|mov\.b64)\s+(%rd\d+),\s*\[?{entry}_param_{param}\]?;", ptx).group(1)
    lines = ptx.split("\n")
    defs = [(m.group(1), re.findall(r"%r[a-z]*\d+", m.group(2))) for m in map(_DEF.match, lines) if m]
    derived, changed = {root}, True
    while changed:
        changed = False
        for dst, srcs in defs:
            if dst not in derived and any(s in derived for s in srcs):
                derived.add(dst)
                changed = True
    patched = 0
    for i, line in enumerate(lines):
        m = _COPY[kind].match(line)
        if m and m.group(3) in derived:
            lines[i] = f"{m.group(1)}.L2::cache_hint{m.group(2)}, {_POLICY};{m.group(4)}"
            patched += 1
    make = (f"createpolicy.fractional.L2::evict_first.b64 {_POLICY}, 1.0;" if policy == "createpolicy"
            else f"mov.b64 {_POLICY}, 0x12F0000000000000;")
    body = next(i for i, line in enumerate(lines) if line.strip() == "{") + 1
    while lines[body].strip().startswith(".reg"):
        body += 1
    lines[body:body] = [f"\t.reg .b64 {_POLICY};", f"\t{make}"]
    return "\n".join(lines), patched


def hinted_kernel(kernel, kind: str, policy: str = "createpolicy", ptxas: str | None = None, strip: bool = False):
    """A launchable stand-in for Triton's compiled ``kernel`` (a CachedLauncher entry) whose
    weight copies carry the evict-first L2 policy (:func:`hinted_ptx`; ``strip``: the same
    PTX with the hints taken out again, a control), assembled by Triton's backend or
    ``ptxas``."""
    from triton.compiler.compiler import make_backend
    from triton.runtime import driver

    md = kernel.metadata
    ptx, patched = hinted_ptx(kernel.asm["ptx"], 1 if kind == "pointer" else 5, kind, policy)
    if strip:
        ptx = ptx.replace(".L2::cache_hint", "").replace(f", {_POLICY};", ";")
    print(f"copies hinted: {patched}{' (then stripped)' if strip else ''}", flush=True)
    if ptxas:
        d = tempfile.mkdtemp()
        with open(f"{d}/k.ptx", "w") as f:
            f.write(ptx)
        subprocess.run([ptxas, "-lineinfo", "--gpu-name=sm_90a", f"{d}/k.ptx", "-o", f"{d}/k.cubin"], check=True)
        with open(f"{d}/k.cubin", "rb") as f:
            cubin = f.read()
    else:
        backend = make_backend(md.target)
        cubin = backend.make_cubin(ptx, dict(md._asdict()), backend.parse_options(md._asdict()), md.target.arch)
    module, function, *_ = driver.active.utils.load_binary(md.name, cubin, md.shared,
                                                            driver.active.get_current_device())
    return types.SimpleNamespace(run=kernel.run, function=function, packed_metadata=kernel.packed_metadata,
                                 module=module, patched=patched)


def _case(kind: str, policy: str, ptxas: str | None, strip: bool) -> None:
    import torch

    from rlkernels.ops import gemm, gemm_tma
    from rlkernels.ops.gemm import GemmConfig

    torch.manual_seed(0)
    w = (torch.randn(12288, 4096, device="cuda") / 64).bfloat16()
    x = torch.randn(1, 4096, device="cuda").bfloat16()
    table = gemm.gemm_config(1, 12288, x.dtype)
    cfg = table if kind == "pointer" else GemmConfig(16, table.block_n, table.block_k, group_m=1,
                                                     num_warps=table.num_warps, num_stages=table.num_stages, tma=True)
    want = gemm.triton_gemm(x, w, config=table, b_transposed=True)
    launcher = gemm._launch_gemm if kind == "pointer" else gemm_tma._launch_tma
    gemm.triton_gemm(x, w, config=cfg, b_transposed=True)  # compiles; the launcher keeps the binary
    torch.cuda.synchronize()
    for key, kernel in list(launcher.kernels.items()):
        launcher.kernels[key] = hinted_kernel(kernel, kind, policy, ptxas, strip)
    for _ in range(2):
        got = gemm.triton_gemm(x, w, config=cfg, b_transposed=True)
        torch.cuda.synchronize()
    print(f"RESULT ran, same bits: {torch.equal(got, want)}", flush=True)


def _control_load() -> None:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def scale(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, eviction_policy="evict_first")
        tl.store(y_ptr + offs, x * 2, mask=offs < n)

    x = torch.randn(1 << 20, device="cuda")
    y = torch.empty_like(x)
    kernel = scale[(x.numel() // 1024,)](x, y, x.numel(), BLOCK=1024)
    torch.cuda.synchronize()
    hinted = sum("L2::cache_hint" in line for line in kernel.asm["ptx"].splitlines())
    print(f"RESULT ran, {hinted} hinted ld.global, same values: {torch.equal(y, x * 2)}", flush=True)


def main() -> int:
    if len(sys.argv) > 1:
        if sys.argv[1] == "control":
            _control_load()
        else:
            kind, policy, ptxas, strip = sys.argv[1:5]
            _case(kind, policy, ptxas or None, strip == "strip")
        return 0
    system_ptxas = shutil.which("ptxas") or ("/usr/local/cuda/bin/ptxas" if os.path.exists("/usr/local/cuda/bin/ptxas")
                                             else "")
    cases = [("control",)]
    for kind in ("pointer", "tma"):
        cases += [(kind, "createpolicy", "", "strip"), (kind, "createpolicy", "", "keep"), (kind, "constant", "", "keep")]
        if system_ptxas:
            cases.append((kind, "createpolicy", system_ptxas, "keep"))
    for case in cases:
        proc = subprocess.run([sys.executable, __file__, *case], capture_output=True, text=True,
                              env=dict(os.environ, CUDA_LAUNCH_BLOCKING="1"))
        result = [line for line in proc.stdout.splitlines() if line.startswith(("RESULT", "copies"))]
        error = [line for line in proc.stderr.strip().splitlines() if "Error" in line][-1:]
        print(" ".join(case), "->", "; ".join(result + error), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
