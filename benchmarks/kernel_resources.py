"""Registers, spills and shared memory of the attention kernels, compiled for sm_90 without a GPU.

    python benchmarks/kernel_resources.py [--head-dims 128,64]
    PYTHONPATH=/path/to/triton-3.6 python benchmarks/kernel_resources.py   # the device's Triton

Each kernel is compiled the way its default launch specializes it (``ops.attention``'s
launch settings; pointers and 16-divisible integers marked divisible by 16) for an
H100 (sm_90), with the Triton that is importable, and ``cuobjdump -res-usage`` reads
the cubin. No GPU is needed, so a change that moves a kernel's register count (and with
it how many CTAs fit on an SM) shows before a device run: a batch stride written as a
separate address term took the decode split kernel from 128 to 159 registers at
D = 128, one CTA per SM instead of two, and 3 % slower steps. Register counts depend on
the Triton version (compile with the device's: 3.6 on the H100 machines).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import torch
import triton
import triton.backends.nvidia as nvidia_backend
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from rlkernels.kernels.attention import forward_ws as W
from rlkernels.kernels.attention.backward import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel
from rlkernels.kernels.attention.forward import attn_fwd_kernel
from rlkernels.kernels.attention.split import attn_combine_kernel, attn_split_kernel
from rlkernels.ops import attention as A
from rlkernels.ops.attention import launch, triton_host, ws_host
from rlkernels.ops.attention.key_blocks import DEFAULT_CHAIN

try:
    from triton.experimental.gluon._runtime import GluonASTSource
except Exception:  # Triton without Gluon
    GluonASTSource = None

TARGET = GPUTarget("cuda", 90, 32)
# A representative problem: 16 query / 8 KV heads, B = 16 caches of 4096 keys (decode) or
# packed rows (prefill); only which integers are divisible by 16 reaches the compiler.
HQ, HKV, S = 16, 8, 4096
FLOAT_ARGS = ("qk_scale", "sm_scale")


def _signature(fn, dtype: str, ints: dict[str, int], constexprs: dict[str, object]):
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_desc"):
            # K/V descriptors are read in key blocks, q/dO descriptors (dK/dV kernel) in query blocks.
            rows = constexprs["BLOCK_M" if name in ("q_desc", "do_desc") else "BLOCK_N"]
            sig[name] = f"tensordesc<{dtype[1:]}[{rows}, {constexprs['BLOCK_D']}]>"
        elif name.endswith("_ptr"):
            is_index = name in ("q_start_ptr", "q_len_ptr", "k_start_ptr", "k_len_ptr")
            sig[name] = "*i32" if is_index else ("*fp32" if name in ("ws_ptr", "lse_ptr", "delta_ptr") else dtype)
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in FLOAT_ARGS:
            sig[name] = "fp32"
        else:
            value = ints.get(name, 7)
            sig[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def resources(fn, ints: dict[str, int], constexprs: dict[str, object], num_warps: int, num_stages: int,
              options: dict | None = None) -> str:
    sig, attrs = _signature(fn, "*bf16", ints, constexprs)
    compiled = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=TARGET,
                              options={"num_warps": num_warps, "num_stages": num_stages, **(options or {})})
    return _usage(compiled)


def ws_resources(d: int, dense: bool) -> str:
    """The warp-specialized forward (kernels.attention.forward_ws) as ops.attention launches
    it. The registers shown are the launch's (forward_ws.launch_registers); the partitions then
    hold 24 and consumer_registers each through setmaxnreg. Stack bytes are spills."""
    consumers = ws_host.WS_CONSUMERS[d]
    rows = ws_host.ws_layout(torch.bfloat16, (W.WG_ROWS, d))
    box = ws_host.ws_layout(torch.bfloat16, (1, W.WG_ROWS, d))
    descs = {"q_desc": f"tensordesc<bf16[{W.WG_ROWS}, {d}],{rows!r}>", "o_desc": f"tensordesc<bf16[{W.WG_ROWS}, {d}],{rows!r}>",
             "k_desc": f"tensordesc<bf16[1, {W.WG_ROWS}, {d}],{box!r}>",
             "v_desc": f"tensordesc<bf16[1, {W.WG_ROWS}, {d}],{box!r}>"}
    constexprs = dict(CAUSAL=True, BLOCK_N=ws_host.WS_BLOCK_N, BLOCK_D=d, S_SPLIT=DEFAULT_CHAIN.split,
                      STAGES=ws_host.WS_STAGES, REVERSE_M=True, DENSE=dense, CONSUMERS=consumers,
                      CONSUMER_REGS=W.consumer_registers(consumers))
    sig = {}
    for name in W.attn_fwd_ws_kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in descs:
            sig[name] = descs[name]
        elif name in ("o_ptr", "v_ptr"):
            sig[name] = "*bf16"
        elif name.endswith("_ptr"):
            sig[name] = "*fp32" if dense or name == "lse_ptr" else "*i32"
        else:
            sig[name] = "fp32" if name == "qk_scale" else "i32"
    compiled = triton.compile(GluonASTSource(W.attn_fwd_ws_kernel, sig, constexprs, {}), target=TARGET,
                              options={"num_warps": 4, "maxnreg": W.launch_registers(consumers),
                                       "enable_fp_fusion": False})
    return _usage(compiled)


def _usage(compiled) -> str:
    tool = os.path.join(os.path.dirname(nvidia_backend.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", out)
    return f"{found.group(1):>4} regs  {found.group(2):>4} B stack  {found.group(3):>6} B static smem" if found else out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--head-dims", default="128,64")
    args = p.parse_args()
    fwd_opts = {"enable_fp_fusion": False}
    print(f"Triton {triton.__version__}, sm_90")
    for d in (int(x) for x in args.head_dims.split(",")):
        bd = triton_host._pow2(d)
        chain = DEFAULT_CHAIN
        fl, bl = A.default_fwd_launch(d, S), A.default_bwd_launch(d)
        ints = dict(stride_qt=HQ * d, stride_qh=d, stride_kt=HKV * d, stride_kh=d, stride_vt=HKV * d, stride_vh=d,
                    stride_ot=HQ * d, stride_oh=d, stride_lh=16 * S, stride_dot=HQ * d, stride_doh=d,
                    stride_dkt=HKV * d, stride_dkh=d, stride_dvt=HKV * d, stride_dvh=d, stride_dqt=HQ * d,
                    stride_dqh=d, H=HQ, HKV=HKV, G=HQ // HKV, D=d, N_SPLITS=4, ROWS_PAD=16, WS_ROWS=16 * HKV * 64,
                    LQ=1, K_ADD=S, KV_ROWS=S, K_HEAD_ROWS=0, K_HEAD_COLS=d, V_HEAD_ROWS=0, V_HEAD_COLS=d,
                    Q_HEAD_ROWS=0, Q_HEAD_COLS=d, DO_HEAD_ROWS=0, DO_HEAD_COLS=d)
        common = dict(CAUSAL=True, BLOCK_N=chain.block_n, BLOCK_D=bd, S_SPLIT=chain.split, IEEE=False,
                      EVEN_D=d == bd)
        rows = [
            ("forward (prefill)", attn_fwd_kernel,
             dict(common, BLOCK_M=fl.full.block_m, DENSE=False, KLEN_PTR=True, REVERSE_M=True, TMA=fl.tma,
                  ONE_SPLIT=False), fl.full.num_warps,
             fl.full.num_stages, fwd_opts),
            ("forward (keys in one split)", attn_fwd_kernel,
             dict(common, BLOCK_M=A.default_fwd_launch(d, chain.split).full.block_m, DENSE=False, KLEN_PTR=True,
                  REVERSE_M=True, TMA=fl.tma, ONE_SPLIT=True), A.default_fwd_launch(d, chain.split).full.num_warps,
             fl.full.num_stages, fwd_opts),
            ("split-KV (several splits)", attn_split_kernel,
             dict(common, BLOCK_M=fl.split.block_m, DENSE=True, KLEN_PTR=False, FINISH=False), fl.split.num_warps,
             fl.split.num_stages, fwd_opts),
            ("split-KV (one split)", attn_split_kernel,
             dict(common, BLOCK_M=fl.split.block_m, DENSE=True, KLEN_PTR=False, FINISH=True), fl.split.num_warps,
             fl.split.num_stages, fwd_opts),
            ("combine", attn_combine_kernel,
             dict(BLOCK_M=2, BLOCK_D=bd, BLOCK_DC=min(bd, launch.COMBINE_BLOCK_D), EVEN_D=d == bd, DENSE=True,
                  KLEN_PTR=False), launch.COMBINE_WARPS, launch.COMBINE_STAGES, fwd_opts),
            ("backward dK/dV", attn_bwd_dkdv_kernel,
             dict(CAUSAL=True, BLOCK_M=bl.dkdv.block_m, BLOCK_N=bl.dkdv.block_n, BLOCK_D=bd, IEEE=False,
                  EVEN_D=d == bd, TMA=bl.tma, DENSE=False), bl.dkdv.num_warps, bl.dkdv.num_stages, None),
            ("backward dQ", attn_bwd_dq_kernel,
             dict(CAUSAL=True, BLOCK_M=bl.dq.block_m, BLOCK_N=bl.dq.block_n, BLOCK_D=bd, IEEE=False,
                  EVEN_D=d == bd, REVERSE_M=True, TMA=bl.tma, DENSE=False), bl.dq.num_warps, bl.dq.num_stages, None),
        ]
        for name, fn, constexprs, warps, stages, opts in rows:
            print(f"D = {d:<4} {name:<27} {warps} warps: {resources(fn, ints, constexprs, warps, stages, opts)}")
        if d in ws_host.WS_CONSUMERS and GluonASTSource is not None and W.attn_fwd_ws_kernel is not None:
            for name, dense in (("warp-specialized (dense)", True), ("warp-specialized (bounds)", False)):
                warps = 4 * ws_host.WS_CONSUMERS[d] + 1
                print(f"D = {d:<4} {name:<27} {warps} warps: {ws_resources(d, dense)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
