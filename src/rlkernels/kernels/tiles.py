"""Tile placement shared by the GEMM-shaped kernels."""
from __future__ import annotations

from ._triton import tl, triton

if triton is not None:

    @triton.jit
    def grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
        """(pid_m, pid_n) of tile ``tile_id`` in grouped order: GROUP_M row blocks walk the
        column blocks together, so they share the streamed column operand in L2.
        Placement only: a tile's arithmetic (its K order above all) is the same wherever
        it lands."""
        num_in_group = GROUP_M * num_pid_n
        first_m = (tile_id // num_in_group) * GROUP_M
        group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
        return first_m + ((tile_id % num_in_group) % group_size), (tile_id % num_in_group) // group_size
else:  # pragma: no cover - the torch backend still imports without Triton
    grouped_tile = None
