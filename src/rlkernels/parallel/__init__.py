"""Tensor parallelism with the same bits at every TP size (opt-in contracts, torch.distributed)."""
from .column_parallel import column_parallel_tree_linear
from .row_parallel import TREE_SEGMENTS, plain_row_parallel_linear, row_parallel_tree_linear, tree_linear
from .vocab_parallel import VOCAB_SHARDS, sharded_linear_logprob, vocab_parallel_linear_logprob
from .vocab_parallel_sample import sharded_linear_sample, vocab_parallel_linear_sample

__all__ = ["TREE_SEGMENTS", "VOCAB_SHARDS", "column_parallel_tree_linear", "plain_row_parallel_linear",
           "row_parallel_tree_linear", "sharded_linear_logprob", "sharded_linear_sample", "tree_linear", "vocab_parallel_linear_logprob",
           "vocab_parallel_linear_sample"]
