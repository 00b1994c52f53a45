"""Launched by test_structure.py with `torchrun --nproc_per_node 2` on CPU (gloo): a converted folder loaded with the
tensor-parallel plan, then with tensor and expert parallelism, must give the single-process logits."""

import json
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import llama_moe_hf  # noqa: F401  (registers the Auto classes)
from llama_moe.parsing import finish_distributed_run


def main(folder: str, out: str) -> None:
    dist.init_process_group("gloo")
    input_ids = torch.randint(0, 90, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(input_ids).logits
        layouts = {"tp": {"tp_plan": "auto"}, "tp+ep": {"distributed_config": DistributedConfig(tp_size=2, ep_size=2)}}
        differences = {}
        for name, kwargs in layouts.items():
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()
            sharded = type(model.model.layers[1].mlp.experts.gate_up_proj).__name__ == "DTensor"
            differences[name] = ((model(input_ids).logits - expected).abs().max().item(), sharded)
    if dist.get_rank() == 0:
        with open(out, "w") as handle:
            json.dump(differences, handle)


if __name__ == "__main__":
    main(*sys.argv[1:])
    finish_distributed_run()  # gloo's threads can abort a process at interpreter exit (SIGABRT, seen in CI)
