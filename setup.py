import re
from pathlib import Path

from setuptools import find_packages, setup

# The version and the transformers range live in the model code, which saved folders carry (read, not imported:
# importing it needs transformers).
MODEL_CODE = Path(__file__).with_name("llama_moe_hf") / "modeling" / "configuration_llama_moe.py"
CONSTANTS = dict(re.findall(r'^(LLAMA_MOE_VERSION|TRANSFORMERS_REQUIREMENT) = "([^"]+)"', MODEL_CODE.read_text(), re.M))

setup(
    name="llama-moe-hf",
    version=CONSTANTS["LLAMA_MOE_VERSION"],
    description="Turn dense LLaMA-family checkpoints into Mixture-of-Experts models for Hugging Face transformers.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    # recipes/convert/ ships inside the package as llama_moe/presets, so `--preset` works from any install
    # llama_moe_hf: the model code (importing it registers the families); llama_moe: the tools and the command
    packages=[
        *find_packages(include=["llama_moe_hf", "llama_moe_hf.*", "llama_moe", "llama_moe.*"]),
        "llama_moe.presets",
    ],
    package_dir={"llama_moe.presets": "recipes/convert"},
    package_data={
        "llama_moe.evaluation": ["tasks/*.yaml", "tasks/*.jsonl"],  # the local lm-eval task
        "llama_moe.presets": ["*.yaml"],
    },
    # Everything the documented commands' default paths import; what only an option needs is an extra, and the
    # command refuses that option at once, before any model is loaded, naming the extra (llama_moe/preflight.py).
    install_requires=[
        "torch>=2.13",  # tests/other_ends.py runs the smoke tests on the newest; CI runs the suite on 2.13.0
        "transformers" + CONSTANTS["TRANSFORMERS_REQUIREMENT"],
        "safetensors>=0.8",
        "huggingface_hub>=2.4",
        "accelerate>=1.15",
        "gguf>=0.19",
        "tqdm",
        "pyyaml",
        "numpy",
        "packaging",  # the model configs' version checks (transformers needs it too)
        "trl>=1.16",  # TrlParser: the command line's dataclass flags and --config recipe files; SFT
        "datasets>=5.2",  # calibration and eval data by name, batch-similar's datasets output, the training recipes
        "pyarrow",  # .parquet documents, packed sequences
        "k-means-constrained>=0.9.1",  # convert: balanced k-means (--method cluster/residual, the presets)
        "scipy",  # convert --method carve: balanced linear assignment (k-means-constrained needs it too)
        "scikit-learn",  # batch-similar: TF-IDF embedding and the exact neighbour search
        "matplotlib",  # analyze: the PNG plots
    ],
    extras_require={
        "eval": ["lm-eval>=0.4.9"],  # llama-moe eval --tasks: lm-evaluation-harness around our model instance
        "similarity": ["faiss-cpu"],  # batch-similar --search faiss (and the fast path of --search auto)
        "sentence-transformers": ["sentence-transformers"],  # batch-similar --embedder sentence-transformers
        "deepspeed": ["deepspeed>=0.18"],  # recipes/accelerate/zero{2,3}.yaml, --deepspeed ds_zero{2,3}.json
        "flash-attn": ["flash-attn>=2.7"],  # attn_implementation="flash_attention_2" (CUDA)
        "train": ["peft>=0.21"],  # LoRA on the experts (docs/modeling.md)
        "test": [
            "pytest",
            "pytest-xdist",  # the README's test command: a worker per core (tests/conftest.py shares the threads out)
            "psutil",
            "peft>=0.21",
            "faiss-cpu",
            "sentence-transformers",
            "deepspeed>=0.18",  # the ZeRO configs are validated and run on CPU
            "lm-eval>=0.4.9",
        ],
    },
    entry_points={
        "console_scripts": ["llama-moe=llama_moe.commands:main"],
        # the model code's save calls these (modeling/save_hooks.py, SAVE_HOOKS): the card of a `trl sft` run
        "llama_moe_hf.model_saved": ["training_card=llama_moe.training.trl_card:on_model_saved"],
    },
)
