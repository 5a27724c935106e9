"""GEMM producers: the dispatch table, the Triton and TMA host paths, cuBLASLt-no-split, the torch chain, backends."""
