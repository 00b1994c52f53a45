"""Small real training sets built from what every machine has (no download), for the recipes' demonstrations.

    pretrain/prose   Python standard-library docstrings (English technical prose)
    pretrain/code    top-level functions and classes of the standard library's own source
    pretrain/math    arithmetic word problems with worked answers, as plain text
    sft/chat         conversation pairs from the documentation: "What does `json.dumps` do?" -> its summary
    sft/math         the word problems as prompt/completion chats, answers ending "The answer is N."
    sft/code         "Write the function `name(args)` of `module`: <summary>" -> its source
    pretrain/chat, sft/self   with `--chat-tokens N`: the calibration chat prompts (`text.prompts`) answered
                     by the dense `--chat-model` itself (`builtin:chat`, `text.chat`): as rendered conversations for
                     distillation (`recipes/pretrain/distill.yaml`), as prompt/completion chats for SFT

Each folder has `train.jsonl` and a held-out `test.jsonl` (whole items, seeded split, rows shuffled). The pre-training
and SFT domains made from the same items share one split, and prose holding a held-out chat answer is left out, so
nothing held out for evaluation is trained on in either stage. SFT rows use TRL's conversational prompt/completion
format, so the loss covers the assistant's answer with any chat template.
"""

import ast
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..text.corpus import stdlib_definitions, stdlib_docstrings, stdlib_modules


@dataclass
class OfflineDataOptions:
    output: str = field(metadata={"help": "folder to write (replaced atomically)"})
    items_per_domain: int = field(default=3000, metadata={"help": "most items per domain (train + test)"})
    test_fraction: float = field(default=0.1, metadata={"help": "share of each domain held out"})
    seed: int = field(default=0, metadata={"help": "seed of the train/test splits and the word problems"})
    overwrite: bool = field(default=False, metadata={"help": "replace an existing output folder"})
    chat_tokens: int = field(
        default=0,
        metadata={
            "help": "also write pretrain/chat and sft/self: this many tokens of chat prompts answered by the "
            "dense --chat-model (it generates them: about 3 minutes per 32,768 tokens for the default on 2 cores)"
        },
    )
    chat_model: str = field(default="default", metadata={"help": "the dense model that answers (--chat-tokens)"})


def build_offline_data(options: OfflineDataOptions) -> dict[str, dict[str, int]]:
    """Write every domain's train/test files under `options.output`; returns the row counts."""
    import numpy as np

    from ..checkpoints.atomic import atomic_folder
    from ..preflight import check_writable

    if Path(options.output).exists() and not options.overwrite:
        raise ValueError(f"{options.output} exists; pass --overwrite to replace it.")
    check_writable(options.output, "--output")
    if not 0 < options.test_fraction < 1:
        raise ValueError(f"test_fraction must be between 0 and 1, got {options.test_fraction}.")
    if options.items_per_domain < 2:
        raise ValueError(f"items_per_domain must be at least 2 (one train, one test), got {options.items_per_domain}.")
    rng = np.random.default_rng(options.seed)
    limit = options.items_per_domain

    def split(items: list) -> dict[str, list]:  # one seeded split per item set, shared by every domain made from it
        order = rng.permutation(len(items))
        n_test = min(len(items) - 1, max(1, round(options.test_fraction * len(items))))
        return {"train": [items[i] for i in order[n_test:]], "test": [items[i] for i in order[:n_test]]}

    functions, problems = split(stdlib_functions(limit)), split(word_problems(limit, rng))
    pairs = split(documentation_pairs(limit))
    held_answers = [answer for _, answer in pairs["test"]]
    # A docstring holding a held-out chat answer stays out of the prose domain, so no held-out answer is trained on.
    prose = [t for t in stdlib_docstrings() if not any(a in " ".join(t.split()) for a in held_answers)][:limit]
    domains = {
        "pretrain/prose": {k: [{"text": text} for text in v] for k, v in split(prose).items()},
        "pretrain/code": {k: [{"text": item[3]} for item in v] for k, v in functions.items()},
        "pretrain/math": {k: [{"text": f"{q}\n{a}"} for q, a in v] for k, v in problems.items()},
        "sft/chat": {k: [_chat(q, a) for q, a in v] for k, v in pairs.items()},
        "sft/math": {k: [_chat(q, a) for q, a in v] for k, v in problems.items()},
        "sft/code": {
            k: [_chat(_code_request(*item[:3]), f"```python\n{item[3]}\n```") for item in v]
            for k, v in functions.items()
        },
    }
    if options.chat_tokens:
        domains |= self_distilled_domains(options, split)
    counts = {}
    with atomic_folder(Path(options.output)) as tmp:
        for name, splits in domains.items():
            counts[name] = _write_splits(tmp / name, splits)
        (tmp / "manifest.json").write_text(json.dumps(counts, indent=2) + "\n")
    return counts


def self_distilled_domains(options: OfflineDataOptions, split) -> dict:
    """pretrain/chat and sft/self: `builtin:chat`'s conversations, answered by `options.chat_model`."""
    from ..loading import load_model
    from ..text.chat import SelfDistilledChats

    dense, tokenizer, _ = load_model(options.chat_model, dtype="float32")
    if not tokenizer.chat_template:
        raise ValueError(f"--chat-tokens needs an instruct model with a chat template; {options.chat_model} has none.")
    chats = SelfDistilledChats(dense, tokenizer)
    texts = chats.texts(options.chat_tokens)
    conversations = split(list(zip(texts, chats.pairs)))
    return {
        "pretrain/chat": {k: [{"text": text} for text, _ in v] for k, v in conversations.items()},
        "sft/self": {k: [_chat(*pair) for _, pair in v] for k, v in conversations.items()},
    }


def _chat(question: str, answer: str) -> dict:
    return {"prompt": [{"role": "user", "content": question}], "completion": [{"role": "assistant", "content": answer}]}


def _code_request(module: str, name: str, summary: str) -> str:
    return f"Write the function `{name}` of Python's `{module}` module. {summary}"


def _write_splits(folder: Path, splits: dict[str, list[dict]]) -> dict[str, int]:
    """One JSON-lines file per split, rows in their shuffled order (a dataset `fraction` keeps the first rows)."""
    folder.mkdir(parents=True)
    for split, rows in splits.items():
        with open(folder / f"{split}.jsonl", "w", encoding="utf-8") as file:
            file.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    return {split: len(rows) for split, rows in splits.items()}


def stdlib_functions(limit: int, max_lines: int = 40) -> list[tuple[str, str, str, str]]:
    """(module, signature, docstring summary, source) of public, documented top-level functions of at most
    `max_lines` lines."""
    found = []
    for module, node, source in stdlib_definitions():
        doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
        if doc and source.count("\n") < max_lines:
            signature = f"{node.name}({ast.unparse(node.args)})"
            found.append((module, signature, _summary(doc), source))
            if len(found) == limit:
                return found
    return found
    return found


def documentation_pairs(limit: int) -> list[tuple[str, str]]:
    """("What does `module.name` do in Python?", the first paragraph of its docstring) for public functions and
    classes with a summary of at least 60 characters."""
    pairs = []
    for module in stdlib_modules():
        for attr in _public_names(module):
            member = getattr(module, attr, None)
            doc = inspect.getdoc(member) if callable(member) else None
            summary = _summary(doc) if doc else ""
            if len(summary) >= 60:
                pairs.append((f"What does `{module.__name__}.{attr}` do in Python?", summary))
                if len(pairs) == limit:
                    return pairs
    return pairs


def _public_names(module) -> list[str]:
    """`__all__`, or else the public names the module defines itself (not its imports)."""
    if hasattr(module, "__all__"):
        return sorted(module.__all__)
    names = [name for name in dir(module) if not name.startswith("_")]
    return [name for name in names if getattr(getattr(module, name), "__module__", None) == module.__name__]


def _summary(doc: str) -> str:
    return " ".join(doc.strip().split("\n\n")[0].split())


_NAMES = ["Ana", "Ben", "Chloe", "Dev", "Eli", "Fatima", "Grace", "Hugo", "Iris", "Jon", "Kemal", "Lena"]
_ITEMS = ["apples", "books", "stamps", "marbles", "pencils", "cards", "shells", "coins", "stickers", "eggs"]


def word_problems(count: int, rng) -> list[tuple[str, str]]:
    """`count` different arithmetic word problems with worked answers ending in "The answer is N.", from five
    templates (a repeat would sit in both splits)."""
    templates = [_buy_and_give, _groups, _share, _price, _twice]
    problems: dict[tuple[str, str], None] = {}
    for i in range(100 * count):
        problems[templates[i % len(templates)](rng)] = None
        if len(problems) == count:
            break
    return list(problems)


def _pick(rng, options):
    return options[int(rng.integers(len(options)))]


def _buy_and_give(rng):
    name, item = _pick(rng, _NAMES), _pick(rng, _ITEMS)
    start, bought = int(rng.integers(5, 60)), int(rng.integers(2, 40))
    given = int(rng.integers(1, start + bought))
    total = start + bought
    question = f"{name} has {start} {item}. {name} gets {bought} more and gives {given} away. How many {item} are left?"
    answer = (
        f"{name} starts with {start} {item} and gets {bought} more: {start} + {bought} = {total}. "
        f"After giving {given} away: {total} - {given} = {total - given}. The answer is {total - given}."
    )
    return question, answer


def _groups(rng):
    item = _pick(rng, _ITEMS)
    boxes, per_box = int(rng.integers(2, 13)), int(rng.integers(2, 25))
    question = f"There are {boxes} boxes with {per_box} {item} in each box. How many {item} are there in total?"
    answer = (
        f"{boxes} boxes of {per_box} {item}: {boxes} x {per_box} = {boxes * per_box}. The answer is {boxes * per_box}."
    )
    return question, answer


def _share(rng):
    name, item = _pick(rng, _NAMES), _pick(rng, _ITEMS)
    friends, each = int(rng.integers(2, 10)), int(rng.integers(2, 20))
    total = friends * each
    question = f"{name} shares {total} {item} equally among {friends} friends. How many {item} does each friend get?"
    answer = f"{total} {item} shared by {friends} friends: {total} / {friends} = {each}. The answer is {each}."
    return question, answer


def _price(rng):
    name, item = _pick(rng, _NAMES), _pick(rng, _ITEMS)
    count, price = int(rng.integers(2, 10)), int(rng.integers(1, 12))
    cost = count * price
    paid = cost + int(rng.integers(0, 30))
    question = f"{name} buys {count} {item} at {price} dollars each and pays with {paid} dollars. How much change?"
    answer = (
        f"The {item} cost {count} x {price} = {cost} dollars. The change is {paid} - {cost} = {paid - cost} "
        f"dollars. The answer is {paid - cost}."
    )
    return question, answer


def _twice(rng):
    first, other, item = int(rng.integers(len(_NAMES))), int(rng.integers(1, len(_NAMES))), _pick(rng, _ITEMS)
    first, second = _NAMES[first], _NAMES[(first + other) % len(_NAMES)]  # two different people
    base, extra = int(rng.integers(3, 40)), int(rng.integers(1, 15))
    more = 2 * base + extra
    question = (
        f"{first} has {base} {item}. {second} has {extra} more than twice as many. "
        f"How many {item} do they have together?"
    )
    answer = (
        f"{second} has 2 x {base} + {extra} = {more}. Together: {base} + {more} = {base + more}. "
        f"The answer is {base + more}."
    )
    return question, answer
