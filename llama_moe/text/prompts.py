"""Everyday chat prompts made offline from templates, in disjoint splits: what a converted instruct model is checked
on (`behaviour`) and what it is calibrated and healed on (`builtin:chat`, the dense model's own answers to them).

    prompts("confirm")        held-out prompts that confirm a setting (benchmarks/quality/behaviour.py)
    prompts("choose")         held-out prompts a setting is chosen on
    prompts("check")          the end-of-conversion check's short set
    prompts("calibration")    calibration and healing prompts, never in the three above

Kinds: facts (capitals), arithmetic, facts from a short text, instructions, code, rewriting, summaries, translation.
Facts, arithmetic and facts from a text carry the answer a reply must contain (`Prompt.answer`). Every prompt belongs
to a group (the country asked about, the numbers, the text), and a group's prompts all fall in one split, the
groups dealt out kind by kind in the order of their hashes: a fact asked in one split is never asked in another in
other words. The calibration split also asks about the standard library's docstrings (the built-in corpus: they are
no held-out domain anyway).
"""

import hashlib
import random
import re
from dataclasses import dataclass
from itertools import product

SPLITS = ("confirm", "choose", "check", "calibration")
# Shares of the groups, out of 20: held-out sets large enough to count answers, most for calibration.
SPLIT_SHARES = {"confirm": 4, "choose": 4, "check": 2, "calibration": 10}
HELDOUT_PER_KIND = 30  # confirm and choose: at most 30 prompts of each kind, about 220 in all
CHECK_PER_KIND = 3  # the check's set: 3 of each kind, 24 prompts

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "Russia": "Moscow", "Egypt": "Cairo", "Kenya": "Nairobi",
    "Canada": "Ottawa", "Mexico": "Mexico City", "Peru": "Lima", "Argentina": "Buenos Aires", "Chile": "Santiago",
    "Greece": "Athens", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki", "Denmark": "Copenhagen",
    "Poland": "Warsaw", "Austria": "Vienna", "Hungary": "Budapest", "Ireland": "Dublin", "Belgium": "Brussels",
    "Netherlands": "Amsterdam", "Thailand": "Bangkok", "Vietnam": "Hanoi", "South Korea": "Seoul", "India": "New Delhi",
    "Iran": "Tehran", "Iraq": "Baghdad", "Turkey": "Ankara", "Cuba": "Havana", "Colombia": "Bogota",
    "Venezuela": "Caracas", "Australia": "Canberra", "Ukraine": "Kyiv", "Czech Republic": "Prague",
    "Romania": "Bucharest", "Bulgaria": "Sofia", "Serbia": "Belgrade", "Croatia": "Zagreb", "Switzerland": "Bern",
    "Morocco": "Rabat", "Nigeria": "Abuja", "Ethiopia": "Addis Ababa", "Indonesia": "Jakarta",
    "Philippines": "Manila", "Malaysia": "Kuala Lumpur", "Pakistan": "Islamabad", "Saudi Arabia": "Riyadh",
    "Israel": "Jerusalem", "Iceland": "Reykjavik", "Scotland": "Edinburgh", "England": "London", "Wales": "Cardiff",
    "New Zealand": "Wellington", "Brazil": "Brasilia", "Uruguay": "Montevideo", "Ghana": "Accra", "Senegal": "Dakar",
    "Nepal": "Kathmandu", "Mongolia": "Ulaanbaatar", "Qatar": "Doha", "Lebanon": "Beirut", "Syria": "Damascus",
    "Jordan": "Amman", "Estonia": "Tallinn", "Latvia": "Riga", "Lithuania": "Vilnius", "Slovakia": "Bratislava",
}  # fmt: skip
CAPITAL_TEMPLATES = (
    "What is the capital of {0}?",
    "Which city is the capital of {0}?",
    "Name the capital city of {0}.",
)
NAMES = ("Anna", "Omar", "Lena", "Kenji", "Maria", "David", "Priya", "Tom", "Sofia", "Lucas", "Aisha", "Ivan")
CITIES = ("Oslo", "Lima", "Madrid", "Toronto", "Cairo", "Sydney", "Dublin", "Prague", "Seoul", "Boston", "Nairobi")
JOBS = ("teacher", "nurse", "baker", "pilot", "farmer", "chemist", "librarian", "carpenter", "lawyer", "chef")
PETS = (("dog", "Max"), ("cat", "Luna"), ("parrot", "Kiwi"), ("rabbit", "Coco"), ("horse", "Storm"), ("dog", "Rex"))
STORY = "{name} is a {job} who lives in {city}. Every morning {name} walks a {pet} called {pet_name} to the market."
STORY_QUESTIONS = (
    ("In which city does {name} live?", "city"),
    ("What is the name of {name}'s {pet}?", "pet_name"),
    ("What is {name}'s job?", "job"),
)
CATEGORIES = (
    "fruits", "colors", "animals that live in the sea", "musical instruments", "vegetables", "planets",
    "sports played with a ball", "countries in Europe", "kitchen tools", "programming languages", "birds", "trees",
    "board games", "types of weather", "things you find in an office", "jobs in a hospital", "flowers",
    "insects", "desserts", "drinks", "clothes for winter", "rivers", "car brands", "shapes", "metals", "dances",
    "languages spoken in Asia", "tools a gardener uses", "school subjects", "breakfast foods", "farm animals",
)  # fmt: skip
INSTRUCTION_TEMPLATES = (
    "List three {0}.",
    "Name two {0} and say one thing about each.",
    "Give me four examples of {0}.",
)
TOPICS = (
    "the ocean", "friendship", "autumn", "a rainy day", "the moon", "a city at night", "coffee", "a mountain",
    "the first day of school", "a garden", "winter", "a long journey", "the stars", "a quiet library", "the desert",
    "a birthday party", "an old bridge", "the sea in summer", "a small village", "music", "a busy market", "snow",
)  # fmt: skip
TOPIC_TEMPLATES = (
    "Write a short poem about {0}.",
    "Write two sentences describing {0}.",
    "Why do people like {0}? Answer briefly.",
)
CODE_TASKS = (
    "returns the square of a number", "adds two numbers", "reverses a string", "checks whether a number is even",
    "returns the largest item of a list", "counts the vowels in a string", "returns the factorial of n",
    "converts Celsius to Fahrenheit", "returns the sum of a list", "checks whether a string is a palindrome",
    "returns the length of a list", "removes duplicates from a list", "returns the first element of a list",
    "multiplies two numbers", "returns the average of a list of numbers", "capitalizes a string",
    "returns the smallest item of a list", "counts the words in a sentence", "checks whether a number is prime",
    "converts kilometers to miles", "returns the last element of a list", "sorts a list of numbers",
    "returns the absolute value of a number", "joins a list of strings with commas", "returns True if a list is empty",
    "doubles every number in a list", "returns the number of digits of an integer", "swaps two variables",
    "returns the even numbers of a list", "computes the area of a circle", "returns the n-th Fibonacci number",
    "converts a string to lowercase",
)  # fmt: skip
CODE_TEMPLATES = (
    "Write a Python function that {0}.",
    "Show me Python code for a function that {0}.",
    "How do I write a Python function that {0}?",
)
SUBJECTS = ("the meeting", "the concert", "the football game", "the school trip")
DAYS = ("friday", "next week", "the morning")
REASONS = ("many people were sick", "the room was not ready", "it rained all day")
SENTENCES = tuple(f"{s} was moved to {d} because {r}" for s, d, r in product(SUBJECTS, DAYS, REASONS))
REWRITE_TEMPLATES = (
    "Rewrite this sentence in a formal tone: {0}",
    "Correct the capitalization and punctuation of this sentence: {0}",
    "Say this in simpler words: {0}",
)
PHRASES = (
    "good morning", "thank you very much", "where is the station", "I love books", "see you tomorrow",
    "how are you", "the house is big", "I am hungry", "happy birthday", "the cat is sleeping", "good night",
    "the water is cold", "my name is Anna", "I like music", "the door is open", "we are friends", "it is raining",
    "the book is red", "where do you live", "I need help",
)  # fmt: skip
LANGUAGES = ("French", "Spanish", "German", "Italian")


@dataclass(frozen=True)
class Prompt:
    """One user turn; `answer`, where set, is what a correct reply contains (case-insensitive)."""

    kind: str
    text: str
    group: str
    answer: str | None = None

    def correct(self, reply: str) -> bool | None:
        """Whether `reply` holds the answer (None: no answer to check). Numbers must stand alone (12 is not 112)."""
        if self.answer is None:
            return None
        if self.answer.lstrip("-").isdigit():
            return re.search(rf"(?<![\d.]){re.escape(self.answer)}(?![\d])", reply.replace(",", "")) is not None
        return self.answer.lower() in reply.lower()


def _capitals():
    for country, capital in CAPITALS.items():
        for template in CAPITAL_TEMPLATES:
            yield Prompt("facts", template.format(country), f"capital:{country}", capital)


def _arithmetic():
    rng = random.Random(0)
    for _ in range(900):
        op = rng.choice("+-*")
        a, b = (rng.randint(2, 12), rng.randint(2, 12)) if op == "*" else (rng.randint(3, 60), rng.randint(2, 40))
        a, b = (b, a) if op == "-" and b > a else (a, b)
        result = {"+": a + b, "-": a - b, "*": a * b}[op]
        words = {"+": "plus", "-": "minus", "*": "times"}[op]
        text = rng.choice((f"What is {a} {op} {b}?", f"What is {a} {words} {b}?", f"Calculate {a} {op} {b}."))
        text += " Answer with the number only."  # a 135M model otherwise explains past its 32 tokens
        yield Prompt("arithmetic", text, f"arithmetic:{a}{op}{b}", str(result))


def _stories():
    for index, (name, city, job, (pet, pet_name)) in enumerate(product(NAMES, CITIES, JOBS, PETS)):
        if index % 7:  # a spread of the combinations is plenty
            continue
        fields = {"name": name, "city": city, "job": job, "pet": pet, "pet_name": pet_name}
        story = STORY.format(**fields)
        question, key = STORY_QUESTIONS[index % len(STORY_QUESTIONS)]
        yield Prompt("text_facts", f"{story}\n\n{question.format(**fields)}", f"story:{story}", fields[key])
        yield Prompt("summaries", f"Summarize this text in one sentence:\n\n{story}", f"story:{story}")


def _templated(kind, templates, fillers):
    for filler, template in product(fillers, templates):
        yield Prompt(kind, template.format(filler), f"{kind}:{filler}")


def _translations():
    for phrase, language in product(PHRASES, LANGUAGES):
        yield Prompt("translation", f"Translate '{phrase}' into {language}.", f"translation:{phrase}")


def _all_prompts():
    yield from _capitals()
    yield from _arithmetic()
    yield from _stories()
    yield from _templated("instructions", INSTRUCTION_TEMPLATES, CATEGORIES)
    yield from _templated("instructions", TOPIC_TEMPLATES, TOPICS)
    yield from _templated("code", CODE_TEMPLATES, CODE_TASKS)
    yield from _templated("rewriting", REWRITE_TEMPLATES, SENTENCES)
    yield from _translations()


def _digest(group: str) -> bytes:
    return hashlib.sha256(group.encode()).digest()  # stable, unlike Python's seeded `hash`


def split_of_groups(groups) -> dict[str, str]:
    """{group: split}: a kind's groups in the order of their hashes, dealt out by `SPLIT_SHARES` in turn, so that
    every split gets its share of every kind (a hash alone left 4 code prompts in one split and 30 in another)."""
    slots = [split for split, share in SPLIT_SHARES.items() for _ in range(share)]
    return {group: slots[rank % len(slots)] for rank, group in enumerate(sorted(set(groups), key=_digest))}


def prompts(split: str) -> list[Prompt]:
    """The split's prompts, deduplicated, kinds interleaved (any prefix holds every kind), in a fixed order."""
    if split not in SPLITS:
        raise ValueError(f"Unknown prompt split {split!r}: choose one of {', '.join(SPLITS)}.")
    every = list({p.text: p for p in _all_prompts()}.values())
    splits = {}
    for kind in {p.kind for p in every}:
        splits |= split_of_groups(p.group for p in every if p.kind == kind)
    chosen = [p for p in every if splits[p.group] == split]
    if split == "calibration":
        chosen += list(_docstring_prompts())
    random.Random(split).shuffle(chosen)
    by_kind: dict[str, list[Prompt]] = {}
    for prompt in chosen:
        by_kind.setdefault(prompt.kind, []).append(prompt)
    cap = {"check": CHECK_PER_KIND, "confirm": HELDOUT_PER_KIND, "choose": HELDOUT_PER_KIND}.get(split)
    by_kind = {kind: group[:cap] for kind, group in by_kind.items()}
    longest = max(map(len, by_kind.values()))
    return [group[i] for i in range(longest) for group in by_kind.values() if i < len(group)]


def _docstring_prompts():
    """Questions about the standard library's documentation: calibration only."""
    from ..text.corpus import stdlib_docstrings

    templates = (
        "Explain this documentation in plain words:\n\n{0}",
        "Summarize in one sentence:\n\n{0}",
        "What is this text about?\n\n{0}",
    )
    for index, doc in enumerate(stdlib_docstrings()):
        paragraph = doc.split("\n\n")[0][:600]
        yield Prompt("docs", templates[index % len(templates)].format(paragraph), f"docs:{index}")
