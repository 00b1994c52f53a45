from setuptools import find_packages, setup

setup(
    name="llama-moe-hf",
    version="0.1.0",
    description="Turn dense LLaMA-family checkpoints into Mixture-of-Experts models for Hugging Face transformers.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    # recipes/convert/ ships inside the package as llama_moe_hf/presets, so `--preset` works from any install
    packages=[*find_packages(include=["llama_moe_hf", "llama_moe_hf.*"]), "llama_moe_hf.presets"],
    package_dir={"llama_moe_hf.presets": "recipes/convert"},
    package_data={
        "llama_moe_hf.evaluation": ["tasks/*.yaml", "tasks/*.jsonl"],  # the local lm-eval task
        "llama_moe_hf.presets": ["*.yaml"],
    },
    py_modules=["llama_moe_cli"],
    install_requires=[
        "torch>=2.9",
        "transformers>=5.23,<6",
        "safetensors>=0.8",
        "huggingface_hub>=2.4",
        "accelerate>=1.15",
        "gguf>=0.19",
        "tqdm",
        "pyyaml",
        "trl>=1.16",  # TrlParser: the command line's dataclass flags and --config recipe files
    ],
    extras_require={
        "calibration": ["datasets>=5.2", "k-means-constrained>=0.9.1", "scikit-learn"],
        "similarity": ["scikit-learn", "faiss-cpu", "datasets>=5.2"],  # llama-moe batch-similar
        "sentence-transformers": ["sentence-transformers"],  # batch-similar --embedder sentence-transformers
        "flash-attn": ["flash-attn>=2.7"],  # attn_implementation="flash_attention_2" (CUDA)
        "train": ["trl>=1.16", "peft>=0.21", "datasets>=5.2", "matplotlib"],  # matplotlib: the demonstrations' plots
        "deepspeed": ["deepspeed>=0.18"],  # recipes/accelerate/zero{2,3}.yaml (zero_optimization.leaf_module)
        "analysis": ["matplotlib"],  # llama-moe analyze: the PNG plots
        "eval": ["lm-eval>=0.4.9"],  # llama-moe eval --tasks: lm-evaluation-harness around our model instance
        "test": [
            "pytest",
            "psutil",
            "trl>=1.16",
            "peft>=0.21",
            "datasets>=5.2",
            "k-means-constrained>=0.9.1",
            "scikit-learn",
            "faiss-cpu",
            "sentence-transformers",
            "deepspeed>=0.18",  # the ZeRO configs are validated and run on CPU
            "matplotlib",
            "lm-eval>=0.4.9",
        ],
    },
    entry_points={"console_scripts": ["llama-moe=llama_moe_cli:main"]},
)
