"""Contiguous blocks of neurons."""

from ..registry import METHODS
from .base import SplitMethod


@METHODS.register("sequential")
class SequentialSplit(SplitMethod):
    description = "Sequential: expert e takes the e-th contiguous block of FFN neurons."
    mergeable = True

    def split(self, layer_idx, dense, context):
        from ..experts import split_sequential

        t = self.target
        return split_sequential(self.dense_config.intermediate_size, t.num_experts, t.num_shared_experts)
