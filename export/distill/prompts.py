"""The prompts the target answers to make a draft's training data: topic x task templates,
and varied ones (questions, summaries of passages from earlier answers, code requests).
The bench's topics are left out, so the bench measures drafts on prompts they have not seen."""

from __future__ import annotations

import random
import re

# Topics of the bench prompts (specedge/prompts.jsonl) are left out, so the bench measures the
# draft on prompts it has not seen.
TOPICS = [
    "volcanoes", "the French Revolution", "photosynthesis", "black holes",
    "the stock market", "machine learning", "the Roman Empire", "climate change", "coffee",
    "the human heart", "electric cars", "the internet", "chess", "vaccines", "the moon",
    "jazz music", "rainforests", "earthquakes", "the printing press", "bread baking",
    "the Olympic Games", "solar panels", "dinosaurs", "the immune system", "Shakespeare",
    "recycling", "the water cycle", "ancient Egypt", "gravity", "antibiotics",
    "the Great Wall of China", "cloud computing", "meditation", "the Amazon river", "glaciers",
    "the periodic table", "democracy", "octopuses", "renewable energy", "the Renaissance",
    "public speaking", "time management", "healthy eating", "learning a language", "DNA",
    "airplanes", "the ocean tides", "money", "friendship", "mountains",
    "the camera", "volunteering", "traffic lights", "the violin", "deserts", "penguins", "tea",
    "rivers", "the telephone", "smartphones", "batteries", "wind turbines",
    "nuclear power", "the human brain", "memory", "dreams", "exercise", "yoga",
    "football", "basketball", "tennis", "swimming", "cycling", "photography", "painting",
    "sculpture", "poetry", "novels", "theaters", "movies",
    "television", "radio", "newspapers", "podcasts", "video games", "board games", "puzzles",
    "mathematics", "prime numbers", "geometry", "statistics", "probability", "algebra",
    "calculus", "physics", "chemistry", "biology", "astronomy", "the solar system", "Mars",
    "Jupiter", "comets", "satellites", "rockets", "the space station",
    "hurricanes", "tornadoes", "snow", "rain", "lightning", "rainbows", "clouds", "forests",
    "trees", "flowers", "mushrooms", "insects", "butterflies", "ants", "spiders",
    "owls", "eagles", "whales", "dolphins", "sharks", "coral reefs", "elephants", "lions",
    "wolves", "horses", "dogs", "farming", "rice", "wheat", "chocolate", "cheese",
    "pizza", "soup", "spices", "cooking", "kitchens", "restaurants", "markets", "shopping",
    "advertising", "banks", "taxes", "budgets", "saving money", "jobs", "interviews",
    "teamwork", "leadership", "negotiation", "email etiquette", "writing essays",
    "note taking", "exams", "homework", "teachers", "universities",
    "online courses", "history", "archaeology", "maps", "travel", "trains", "ships", "cars",
    "roads", "cities", "villages", "architecture", "houses", "furniture", "clothing",
    "fashion", "shoes", "textiles", "plastic", "glass", "steel", "wood", "paper", "ink",
    "computers", "programming", "databases", "web browsers", "passwords", "encryption",
    "robots", "drones", "3D printing", "sensors", "electricity", "magnets", "light", "sound",
    "music theory", "guitars", "pianos", "drums", "choirs", "opera", "dance", "festivals",
    "holidays", "birthdays", "weddings", "family", "parenting", "childhood", "old age",
    "kindness", "honesty", "courage", "patience", "habits", "motivation", "stress",
    "happiness",
]


TASKS = [
    "Explain {t} to a ten-year-old.",
    "Write three interesting facts about {t}.",
    "What are the pros and cons of {t}?",
    "Write a short poem about {t}.",
    "Give me a brief history of {t}.",
    "Summarize what everyone should know about {t} in one paragraph.",
    "Write a Python function related to {t}, with a docstring and comments.",
    "Answer briefly: why does {t} matter?",
    "Write a short story that involves {t}.",
    "List five questions a student might ask about {t}, with short answers.",
]


# A second prompt set ("varied"): everyday questions, summaries of a given passage (the
# target's own greedy answers to the templates above, used as passages) and code requests,
# so that the draft does not learn only the templates' answer style.
QUESTIONS = [
    "How does {t} work?", "Why do people care about {t}?", "What is the best way to learn "
    "about {t}?", "Can you give me some tips about {t}?", "What are common mistakes people "
    "make with {t}?", "How would you describe {t} to a friend?", "What is surprising about "
    "{t}?", "Is {t} good or bad for the environment?", "How has {t} changed in the last "
    "hundred years?", "What questions should I ask an expert on {t}?", "How do I get started "
    "with {t}?", "What does a typical day look like for someone who works with {t}?",
    "Could you tell me something fun about {t}?", "What should a beginner know about {t}?",
    "How do scientists study {t}?", "What would the world be like without {t}?",
]


CODE_TASKS = [
    "checks whether a number is prime", "reverses the words in a sentence",
    "returns the second largest number in a list", "removes vowels from a string",
    "converts a temperature from Celsius to Fahrenheit", "counts the lines in a text file",
    "checks whether two strings are anagrams", "flattens a nested list",
    "returns the factorial of a number", "finds the most common element in a list",
    "validates an email address with a regular expression", "sorts a list of dictionaries "
    "by one key", "splits a list into chunks of a given size", "computes the median of a list",
    "capitalises the first letter of every word", "returns the greatest common divisor of "
    "two numbers", "checks whether a year is a leap year", "sums the digits of a number",
    "groups words by their first letter", "returns the unique values of a list in order",
    "computes the average word length of a sentence", "converts a binary string to an "
    "integer", "finds all pairs in a list that add up to a target", "rotates a list by k "
    "places", "checks whether brackets in a string are balanced",
]


LANGUAGES = ["Python", "Python", "Python", "JavaScript", "Go", "Rust", "Java", "C"]


def varied_prompts(n: int, seed: int, passages: list[str]) -> list[str]:
    """`n` prompts, a third each of questions, passage summaries and code requests."""
    rng = random.Random(seed + 1)
    pools = [[q.format(t=t) for q in QUESTIONS for t in TOPICS],
             [f"Summarize the following passage in {k}.\n\n{p}" for p in passages
              for k in ("one sentence", "two sentences")],
             [f"Write a {lang} function that {task}." for lang in LANGUAGES
              for task in CODE_TASKS]]
    for pool in pools:
        rng.shuffle(pool)
    picked = [pool[i] for i in range(n) for pool in pools if i < len(pool)][:n]
    if len(picked) < n:
        raise ValueError(f"--varied-prompts can be at most {len(picked)}, got {n}")
    return picked


def passages_from(data: list[dict], tokenizer) -> list[str]:
    """The target's greedy template answers, cut at their last full stop, as passages."""
    out = []
    for ex in data:
        passage = passage_of(tokenizer.decode(ex["ids"][ex["start"] + 1:].tolist(),
                                              skip_special_tokens=True))
        if passage is not None:
            out.append(passage)
    return out


def training_prompts(n: int, seed: int) -> list[str]:
    """`n` distinct prompts from topic x task templates, shuffled with `seed`."""
    pool = [task.format(t=topic) for topic in TOPICS for task in TASKS]
    random.Random(seed).shuffle(pool)
    if n > len(pool):
        raise ValueError(f"--prompts can be at most {len(pool)}, got {n}")
    return pool[:n]


def pool_requests(seed: int) -> list[tuple[str, str]]:
    """Every template, question and code request as (kind, request): each kind's list
    shuffled with `seed`, then taken a kind at a time in turn, so that any first part of the
    list mixes the three kinds (the corpus takes it in order, shard by shard; corpus.py)."""
    rng = random.Random(seed + 2)
    pools = [("template", [task.format(t=t) for t in TOPICS for task in TASKS]),
             ("question", [q.format(t=t) for q in QUESTIONS for t in TOPICS]),
             ("code", sorted({f"Write a {lang} function that {task}." for lang in LANGUAGES
                              for task in CODE_TASKS}))]
    for _, pool in pools:
        rng.shuffle(pool)
    longest = max(len(pool) for _, pool in pools)
    return [(kind, pool[i]) for i in range(longest) for kind, pool in pools if i < len(pool)]


def summary_request(passage: str, rng: random.Random) -> str:
    """A request to summarise `passage`, in one or two sentences (as the varied prompts)."""
    length = rng.choice(("one sentence", "two sentences"))
    return f"Summarize the following passage in {length}.\n\n{passage}"


def passage_of(answer: str) -> str | None:
    """An answer cut at its last full stop, as a passage to summarise: None if that leaves
    under 200 characters or holds code."""
    text = answer[:answer.rfind(".") + 1].strip()
    return text if len(text) >= 200 and "```" not in text else None


# The first words of a code request that the target finishes itself (grow.py): a fixed pool
# of code tasks runs out after a few hundred requests, while the target, steered only by these
# openings, writes as many different ones as it is asked for, in the words its users use.
CODE_OPENINGS = (
    "Write a Python function that", "Write a Python function that",
    "Write a Python program that", "Write a Python class", "In Python, how can I",
    "In JavaScript, how do I", "Write a JavaScript function that", "Write a Java method that",
    "Write a C program that", "Write a Go function that", "Write a Rust function that",
    "Write a SQL query that", "Write a bash script that", "Write an HTML page with",
    "Write a regular expression that", "Write a unit test for a Python function that",
)

# What a code-change request asks of a block of code taken from an earlier answer.
CODE_EDITS = [
    "Explain what this code does, step by step:", "Add comments to this code:",
    "Make this code shorter and easier to read:", "Add error handling to this code:",
    "Write three test cases for this code:", "Is there a bug in this code? Explain, then fix "
    "it:", "Rewrite this code in {lang}:", "Rename the variables in this code so that their "
    "names say what they hold:", "What is the time complexity of this code, and why?",
    "Make this code faster, and say what you changed:", "Review this code as a senior "
    "developer would:", "Turn this code into a command-line tool:",
]
EDIT_LANGUAGES = ["Python", "JavaScript", "Java", "Go", "Rust", "C++", "TypeScript"]
_CODE_BLOCK = re.compile(r"```(\w*)\n(.*?)\n```", re.S)


def code_blocks(answer: str, lines: tuple[int, int] = (3, 30)) -> list[tuple[str, str]]:
    """The fenced code blocks of an answer as (language, code), those of `lines` lines."""
    return [(m.group(1), m.group(2)) for m in _CODE_BLOCK.finditer(answer)
            if lines[0] <= m.group(2).count("\n") + 1 <= lines[1]]


def code_edit_request(language: str, code: str, rng: random.Random) -> str:
    """A request to change or explain `code` (CODE_EDITS), the code fenced after it."""
    edit = rng.choice(CODE_EDITS)
    if "{lang}" in edit:
        edit = edit.format(lang=rng.choice([x for x in EDIT_LANGUAGES
                                            if x.lower() != language.lower()]))
    return f"{edit}\n\n```{language}\n{code}\n```"
