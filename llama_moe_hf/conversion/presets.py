"""Named conversion presets: the recipe files of `recipes/convert/`, by file name (`llama-moe convert --preset NAME`).

The files are the only copy of each preset's settings, so `--preset g-moefication` and `--config
recipes/convert/g-moefication.yaml` are the same conversion: an installed package carries them as
`llama_moe_hf/presets/` (setup.py maps the folder there), an editable install reads the clone's `recipes/convert/`.
A file's leading comment lines, up to its example command, are the preset's description in `llama-moe convert --help`.
"""

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]
PRESETS_DIR = _PACKAGE / "presets" if (_PACKAGE / "presets").is_dir() else _PACKAGE.parent / "recipes" / "convert"
# The best conversion without training measured so far (docs/quality.md, "How each default was chosen").
BEST_PRESET = "g-moefication"


def preset_names() -> list[str]:
    """The presets there are, sorted (none when the package runs without its clone's `recipes/` folder)."""
    return sorted(path.stem for path in PRESETS_DIR.glob("*.yaml"))


def sparsity_presets() -> list[str]:
    """`sparse-N`: the best measured recipe with N% of the FFN neurons active per token, by increasing N."""
    names = [name for name in preset_names() if name.startswith("sparse-") and name[7:].isdigit()]
    return sorted(names, key=lambda name: int(name[7:]))


def preset_path(name: str) -> Path:
    """The recipe file of preset `name`; one ValueError naming the presets for an unknown name."""
    path = PRESETS_DIR / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(preset_names()) or f"none: {PRESETS_DIR} is missing"
        raise ValueError(f"Unknown preset {name!r}; the presets are: {known}.")
    return path


def preset_description(name: str) -> str:
    """The leading comment lines of the preset's file, up to its example command, as one paragraph."""
    lines = []
    for line in preset_path(name).read_text(encoding="utf-8").splitlines():
        text = line.removeprefix("#").strip()
        if not line.startswith("#") or text.startswith("llama-moe "):
            break
        lines.append(text)
    return " ".join(lines)
