"""Benchmarks: ``python -m rlkernels.bench {gemm,training,logprob,bmm,all} [--json PATH]``."""
