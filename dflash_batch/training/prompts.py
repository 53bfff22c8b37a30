"""A varied, deterministic prompt set for self-distillation, with a held-out evaluation split.

Five kinds of prompt (instructions, summaries of passages, code, arithmetic, chat) are built
from templates and word lists, so the set needs no download. The split is by a stable hash
of the prompt text: a prompt is in the evaluation split or never, whatever the set's size.
"""

from __future__ import annotations

import hashlib
import random
from typing import Dict, List, Tuple

# fmt: off
TOPICS = [
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "machine learning",
    "volcanoes", "the immune system", "climate change", "the printing press", "renewable energy",
    "the Roman Empire", "plate tectonics", "electric cars", "honey bees", "the internet",
    "ancient Egypt", "the human heart", "coral reefs", "the moon landing", "vaccines",
    "recycling", "the stock market", "dinosaurs", "the solar system", "rainforests",
    "sleep", "meditation", "the Olympic Games", "jazz music", "chess", "coffee", "tea",
    "bicycles", "the Great Wall of China", "earthquakes", "glaciers", "DNA", "gravity",
    "the printing of money", "public libraries", "bridges", "airplanes", "submarines",
    "the periodic table", "rainbows", "tides", "deserts", "the Amazon river", "penguins",
    "wolves", "octopuses", "mushrooms", "bread baking", "gardening", "the violin", "origami",
    "solar panels", "wind turbines", "smartphones", "video games", "social media", "cities",
    "farming", "the Renaissance", "the Industrial Revolution", "democracy", "money", "time zones",
]
ACTIVITIES = [
    "learning a new language", "running a marathon", "studying for exams", "saving money",
    "cooking healthy meals", "staying focused at work", "making new friends", "traveling on a budget",
    "starting a garden", "writing a novel", "learning to code", "getting better sleep",
    "reducing stress", "public speaking", "keeping a journal", "learning the guitar",
    "organizing a small party", "taking care of a puppy", "hiking safely", "moving to a new city",
]
THINGS = [
    "drinking water", "regular exercise", "reading books", "walking every day", "learning math",
    "eating vegetables", "volunteering", "working from home", "cycling to work", "playing music",
    "spending time outdoors", "keeping a budget", "taking breaks", "writing by hand",
]
PAIRS = [
    ("cats", "dogs"), ("tea", "coffee"), ("trains", "planes"), ("books", "movies"),
    ("Python", "JavaScript"), ("summer", "winter"), ("cities", "villages"), ("the sun", "the moon"),
    ("rivers", "lakes"), ("email", "letters"), ("democracy", "monarchy"), ("solar power", "wind power"),
]
NAMES = ["Alice", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jamal", "Kenji", "Lena"]
OBJECTS = ["apples", "books", "marbles", "pencils", "stickers", "cookies", "coins", "stamps", "shells", "cards"]
EMOTIONS = ["tired", "happy", "nervous", "bored", "excited", "stressed", "curious", "a bit lonely"]
LANGS = ["Python", "JavaScript", "C", "Rust", "Go", "Java", "SQL", "Bash"]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the factorial of n",
    "computes the n-th Fibonacci number", "counts the vowels in a string", "sorts a list of numbers",
    "finds the largest element of a list", "removes duplicates from a list", "checks if a word is a palindrome",
    "converts Celsius to Fahrenheit", "sums the digits of an integer", "merges two sorted lists",
    "counts the words in a sentence", "returns the average of a list", "finds the GCD of two numbers",
    "reads a file and prints each line", "flattens a nested list", "capitalizes every word in a sentence",
    "checks whether a year is a leap year", "returns the squares of the numbers from 1 to n",
]
# fmt: on
SNIPPETS = [
    "def f(xs):\n    return [x * 2 for x in xs if x > 0]",
    "def g(s):\n    return s[::-1] == s",
    "total = 0\nfor i in range(10):\n    total += i\nprint(total)",
    "def h(n):\n    if n < 2:\n        return n\n    return h(n - 1) + h(n - 2)",
    "words = text.split()\ncounts = {}\nfor w in words:\n    counts[w] = counts.get(w, 0) + 1",
    "def mean(xs):\n    return sum(xs) / len(xs)",
    "x = [1, 2, 3]\ny = x\ny.append(4)\nprint(x)",
    "def clamp(v, lo, hi):\n    return max(lo, min(v, hi))",
]
FACTS = [
    "{t} has been studied by scientists for many years.",
    "Many people find {t} fascinating because it touches everyday life.",
    "Researchers say that {t} is more complex than it first appears.",
    "In schools, {t} is often taught with simple experiments and pictures.",
    "Recent reports suggest that interest in {t} keeps growing around the world.",
    "Some experts argue that understanding {t} helps us make better decisions.",
    "The history of {t} includes surprising discoveries and a few famous mistakes.",
    "Critics point out that popular accounts of {t} often leave out important details.",
    "Local communities have organised talks and festivals about {t}.",
    "A new book about {t} became a bestseller last year.",
]
INSTRUCTIONS = [
    "Explain {t} in simple terms.",
    "Give me three interesting facts about {t}.",
    "Write a short poem about {t}.",
    "Write a haiku about {t}.",
    "Describe {t} to a ten-year-old.",
    "What are the main ideas behind {t}?",
    "Write a short story that involves {t}.",
    "List five questions a student might ask about {t}.",
    "Give me {n} tips for {a}.",
    "How do I get started with {a}?",
    "What are the benefits of {b}?",
    "Write a short paragraph encouraging someone to try {b}.",
    "Compare {p} and {q}.",
    "What is the difference between {p} and {q}?",
    "Write a product description for a book about {t}.",
    "Write an email inviting a friend to a talk about {t}.",
]
CHAT = [
    "Hi! How are you today?",
    "Hello, can you help me with something?",
    "I'm feeling {e} today. Any advice?",
    "Can you recommend a book about {t}?",
    "What should I cook for dinner tonight?",
    "Tell me a joke about {t}.",
    "What's your favourite thing about {t}?",
    "I want to start {a}. Where should I begin?",
    "Good morning! What's a good way to start the day?",
    "Can you tell me something fun about {t}?",
]
CODE_STYLES = [
    "",
    " Include a short explanation.",
    " Add comments to the code.",
    " Keep it short.",
    " Show an example call.",
    " Explain its time complexity.",
    " Write it step by step.",
]
KINDS = ("instruction", "summary", "code", "arithmetic", "chat")


def _instruction(rng: random.Random) -> str:
    p, q = rng.choice(PAIRS)
    return rng.choice(INSTRUCTIONS).format(
        t=rng.choice(TOPICS),
        n=rng.randint(3, 7),
        a=rng.choice(ACTIVITIES),
        b=rng.choice(THINGS),
        p=p,
        q=q,
    )


def _summary(rng: random.Random) -> str:
    topic = rng.choice(TOPICS)
    sentences = [s.format(t=topic) for s in rng.sample(FACTS, rng.randint(3, 6))]
    passage = " ".join(s[0].upper() + s[1:] for s in sentences)
    ask = rng.choice(
        [
            "Summarize the following passage in one sentence.",
            "Summarize this text in two sentences.",
            "What is the main point of this passage?",
            "Give a short title and a one-line summary for this text.",
        ]
    )
    return f"{ask}\n\n{passage}"


def _code(rng: random.Random) -> str:
    choice = rng.random()
    if choice < 0.6:
        verb = rng.choice(
            [
                "Write a {l} function that {t}.",
                "Show me {l} code that {t}.",
                "How would you write a {l} function that {t}?",
            ]
        )
        return verb.format(l=rng.choice(LANGS), t=rng.choice(CODE_TASKS)) + rng.choice(CODE_STYLES)
    snippet = rng.choice(SNIPPETS)
    ask = rng.choice(
        [
            "What does this code do?",
            "Explain this Python code line by line.",
            "Can this code be improved?",
        ]
    )
    return f"{ask}\n\n```python\n{snippet}\n```"


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(2, 999), rng.randint(2, 99)
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    return rng.choice(
        [
            f"What is {a} + {b}?",
            f"What is {a} - {b}?",
            f"Compute {a} * {b}.",
            f"What is {a * b} divided by {b}?",
            f"{name} has {a} {obj} and gets {b} more. How many {obj} does {name} have now?",
            f"{name} had {a + b} {obj} and gave away {b}. How many are left?",
            f"If one box holds {b} {obj}, how many {obj} are in {a % 20 + 2} boxes?",
            f"Solve for x: x + {b} = {a + b}.",
            f"What is {b} percent of {a * 10}?",
        ]
    )


def _chat(rng: random.Random) -> List[Dict[str, str]]:
    first = rng.choice(CHAT).format(
        e=rng.choice(EMOTIONS), t=rng.choice(TOPICS), a=rng.choice(ACTIVITIES)
    )
    if rng.random() < 0.7:
        return [{"role": "user", "content": first}]
    # A two-turn conversation: the earlier reply is short and generic on purpose.
    follow = rng.choice(
        [
            "Thanks! Can you say more?",
            "Why is that?",
            "Could you give an example?",
            "Make it shorter, please.",
        ]
    )
    reply = rng.choice(
        ["Sure, happy to help.", "Of course! Here is a quick answer.", "That's a great question."]
    )
    return [
        {"role": "user", "content": first},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": follow},
    ]


_MAKERS = {
    "instruction": _instruction,
    "summary": _summary,
    "code": _code,
    "arithmetic": _arithmetic,
    "chat": _chat,
}


def is_eval(text: str, eval_percent: int) -> bool:
    """Stable membership of the held-out split (by the prompt's text, not its index)."""
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) % 100 < eval_percent


def build_prompts(count: int, seed: int = 0) -> List[dict]:
    """``count`` distinct prompts ``{"id", "kind", "messages"}``, kinds in turn (a kind whose
    combinations run out yields fewer)."""
    rng = random.Random(seed)
    seen, out = set(), []
    attempts = 0
    while len(out) < count and attempts < count * 50:
        kind = KINDS[attempts % len(KINDS)]
        made = _MAKERS[kind](rng)
        attempts += 1
        messages = made if isinstance(made, list) else [{"role": "user", "content": made}]
        key = "\n".join(m["content"] for m in messages)
        if key in seen:
            continue
        seen.add(key)
        out.append({"id": f"{kind}-{len(out)}", "kind": kind, "messages": messages})
    return out


def split_prompts(prompts: List[dict], eval_percent: int = 3) -> Tuple[List[dict], List[dict]]:
    """(train, eval): the held-out split by stable hash of each prompt's text."""
    train, held = [], []
    for p in prompts:
        key = "\n".join(m["content"] for m in p["messages"])
        (held if is_eval(key, eval_percent) else train).append(p)
    return train, held
