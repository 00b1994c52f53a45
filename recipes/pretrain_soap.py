"""Pre-train a small LLaMA the SOAP way: dense for the first 5% of steps, upcycle into SoapMoE, continue training.

One process (CPU, or one GPU):
    python recipes/pretrain_soap.py --config recipes/pretrain/soap-small.yaml --output_dir outputs/soap
The dense baseline (same steps, same data, no upcycling), and SOAP with similarity-batched data:
    python recipes/pretrain_soap.py --config recipes/pretrain/soap-small.yaml --variant dense --output_dir outputs/dense
    python recipes/pretrain_soap.py --config recipes/pretrain/soap-small.yaml --similarity_batching --output_dir ...
Several processes, with the stock launcher (two CPU processes over gloo here; drop --use_cpu on GPUs):
    torchrun --nproc_per_node 2 recipes/pretrain_soap.py --config recipes/pretrain/soap-small.yaml --use_cpu \
        --ddp_backend gloo --output_dir outputs/soap-ddp

Options: `SoapPretrainArguments` (llama_moe/training/soap_pretrain.py, which holds the recipe's code) and
transformers' `TrainingArguments`, from flags or a YAML `--config` (`llama_moe.parsing.Parser`, TRL's
`TrlParser`; flags override the file). Documents come from `--documents` (as `llama-moe batch-similar` reads them;
default: the built-in corpus); a held-out set of whole documents is the validation text. Writes the final model as a
complete checkpoint and `results.json` to --output_dir; a killed run, run again, continues from the newest complete
checkpoint of its stage and ends with the weights of an uninterrupted run (`--overwrite_output_dir true` starts over).
"""

from transformers import TrainingArguments

import llama_moe_hf  # noqa: F401  (registers the model families)
from llama_moe.parsing import Parser
from llama_moe.training.soap_pretrain import SoapPretrainArguments, preflight, pretrain


def main(argv=None) -> None:
    parser = Parser((SoapPretrainArguments, TrainingArguments), preflight=preflight)
    parser.run(pretrain, *parser.parse_args_and_config(argv))


if __name__ == "__main__":
    main()
