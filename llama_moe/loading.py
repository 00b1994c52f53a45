"""Load a model for the commands that read one (`analyze`, `eval`): a local folder, a Hub id, or the built-in default.

Our families are registered with the Auto classes on import, so a converted folder loads without running remote code;
other folders load as transformers loads them (remote code only with `trust_remote_code`).
"""

from collections.abc import Callable
from pathlib import Path

from .devices import default_device

DEFAULT_MODEL = "default"  # the built-in dense model (SmolLM2-135M-Instruct, no download)
DTYPES = ("auto", "float32", "bfloat16", "float16")


def model_folder(
    spec: str, *, revision: str | None = None, token: str | None = None, download: Callable = None
) -> Path:
    """The local folder of `spec`: `default`, a folder with config.json, or a Hub id (fetched with `download`,
    default `huggingface_hub.snapshot_download`, which reads the local cache first)."""
    from .checkpoints import default_model_path, hub_folder

    if spec == DEFAULT_MODEL:
        return default_model_path()
    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a model folder (no config.json).")
        return path
    if download is None:
        from huggingface_hub import snapshot_download as download
    return hub_folder(str(spec), revision=revision, token=token, download=download)


def load_model(
    spec: str,
    *,
    dtype: str = "auto",
    device: str | None = None,
    trust_remote_code: bool = False,
    download: Callable = None,
):
    """(model in eval mode on `device`, tokenizer, local folder) for `spec` (see `model_folder`). `dtype="auto"` keeps
    the checkpoint's dtype, except on a CPU without half-precision instructions for it (`cpu_dtype`)."""
    from transformers import AutoModelForCausalLM

    import llama_moe_hf  # noqa: F401  (registers the families with the Auto classes)
    from llama_moe_hf.modeling import MODEL_FAMILIES  # noqa: F401  (registers the families: no remote code is run)

    from .checkpoints.folder import TOKENIZER_FILES, read_tokenizer
    from .checkpoints.writer import check_weights

    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
    folder = model_folder(spec, download=download)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):  # transformers would blame sentencepiece
        raise ValueError(
            f"{folder} has no tokenizer (no tokenizer.json or tokenizer.model): copy the source's into it."
        )
    check_weights(folder)
    tokenizer = read_tokenizer(folder, trust_remote_code=trust_remote_code)
    device = device or default_device()
    if dtype == "auto" and str(device).startswith("cpu"):
        dtype = cpu_dtype(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, trust_remote_code=trust_remote_code)
    return model.to(device).eval(), tokenizer, folder


def cpu_dtype(folder: Path) -> str:
    """What `dtype="auto"` computes in on a CPU: a bfloat16 checkpoint stays bfloat16 where the CPU has bf16
    instructions (AVX512-BF16 or AMX); elsewhere half precision is emulated, several times slower than float32
    (benchmarks/reports/cpu-dtype.md, "Decoding on a CPU: float32 or bfloat16"), so it is float32."""
    import json

    import torch

    config = json.loads((Path(folder) / "config.json").read_text())
    saved = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private, so looked up with a default
    has_bf16 = any(getattr(torch.cpu, check, lambda: False)() for check in checks)
    return "auto" if saved == "float32" or (saved == "bfloat16" and has_bf16) else "float32"


def parameter_counts(model) -> tuple[int, int]:
    """(total, active per token) parameters of a loaded model: our families count active experts exactly, any other
    model is dense (all parameters active)."""
    from .conversion.registry import FAMILIES, count_parameters

    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if model.config.model_type in FAMILIES:
        return count_parameters(model.config, shapes)
    total = sum(p.numel() for p in model.parameters())
    return total, total
