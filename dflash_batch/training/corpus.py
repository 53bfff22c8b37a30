"""Training prompts at scale from sources that need no network, with a held-out split by source.

Sources (each prompt names its ``source``):

* ``template``: the built-in templates and word lists of ``prompts.py`` (source: the template
  kind; its prompts share topics and snippets across texts, so a kind is held out whole or not
  at all: at 3% none is, and the held-out set is stdlib, pydoc and self-written prompts);
* ``passage``: summarise / explain / rewrite / extract tasks on passages cut from the text every
  Python installation ships: the standard library's docstrings (source: the module's file) and
  its documentation topics, ``pydoc_data.topics`` (source: the topic);
* ``code``: explain / document / test / review tasks on functions cut from the standard
  library's source files (source: the module's file);
* ``self``: user turns the target writes itself after its chat template's user header, sampled
  at temperature about 1 (``user_turns.py``; source: the turn's token ids).

A prompt is held out iff a stable hash of its *source* falls under ``eval_percent``: a module or
topic is wholly held out or wholly training, so training never reads a held-out source; the
rule depends on the source's name alone, so it holds whatever the corpus's size or seed.
Passages are deduplicated before tasks are attached (a docstring copied into two modules is
used once), prompts by their text. The standard library is the one of the Python that builds
the corpus (``meta.json`` records its version); nothing is imported, sources are parsed.
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
import sys
import sysconfig
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

from . import prompts as templates

PASSAGE_TASKS = [
    "Summarize the following text in one sentence.",
    "Summarize the following text in two or three sentences.",
    "Explain the following text in simple terms, as if to a beginner.",
    "Rewrite the following text so that it is shorter and clearer.",
    "Rewrite the following text in plain English, without jargon.",
    "List the key terms mentioned in the following text, one per line.",
    "Extract the main facts from the following text as a bulleted list.",
    "Give a short title for the following text.",
    "Write three questions that the following text answers.",
    "What is the main point of the following text?",
    "Turn the following text into a short step-by-step guide.",
    "Explain to a colleague what the following documentation describes.",
]
CODE_TASKS = [
    "Explain what this Python function does.",
    "Explain this Python code line by line.",
    "Write a docstring for this Python function.",
    "Write unit tests for this Python function.",
    "Can this code be improved? Suggest changes.",
    "Rewrite this function to make it easier to read.",
    "What are the inputs and outputs of this function?",
    "Describe a situation where this function would be useful.",
    "Are there any bugs or edge cases in this code?",
    "Summarize this code in one sentence.",
    "Add comments to this code.",
    "What is the time complexity of this function?",
]
SKIP_PARTS = {
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "turtledemo",
}
PASSAGE_CHARS = (160, 1500)  # a passage is a paragraph group of this many characters
CODE_LINES, CODE_CHARS = (5, 40), 1600


# -- the held-out rule -----------------------------------------------------------------------
def is_held_out(source: str, eval_percent: int) -> bool:
    """Stable membership of the held-out split, by the prompt's source."""
    return int(hashlib.sha256(source.encode()).hexdigest()[:8], 16) % 100 < eval_percent


def prompt_text(p: dict) -> str:
    return "\n".join(m["content"] for m in p["messages"])


# -- standard-library sources ----------------------------------------------------------------
def stdlib_files(root: Optional[Path] = None) -> List[Tuple[str, Path]]:
    """(name relative to the stdlib folder, path) of its Python source files, sorted; tests,
    IDLE, lib2to3 and installed packages left out."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if not SKIP_PARTS & set(rel.parts):
            found.append((rel.as_posix(), path))
    return sorted(found)


def _plain(text: str) -> bool:
    """Mostly ordinary text: printable ASCII, not a table or a wall of symbols."""
    letters = sum(c.isalpha() or c.isspace() for c in text)
    return text.isascii() and letters >= 0.75 * len(text)


def split_passages(text: str) -> Iterator[str]:
    """Paragraph groups of ``PASSAGE_CHARS`` characters (whitespace-collapsed paragraphs joined
    until the group is long enough; a group past the maximum is dropped)."""
    group: List[str] = []
    for para in re.split(r"\n\s*\n", text):
        para = " ".join(para.split())
        if not para:
            continue
        group.append(para)
        size = sum(len(p) + 2 for p in group)
        if size >= PASSAGE_CHARS[0]:
            passage = "\n\n".join(group)
            if len(passage) <= PASSAGE_CHARS[1] and _plain(passage):
                yield passage
            group = []


def docstring_passages(files: List[Tuple[str, Path]]) -> Iterator[Tuple[str, str]]:
    """(source, passage) from the docstrings of every module, class and function."""
    for name, path in files:
        tree = _parse(path)
        if tree is None:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    for passage in split_passages(doc):
                        yield f"stdlib:{name}", passage


def topic_passages() -> Iterator[Tuple[str, str]]:
    """(source, passage) from the Python documentation topics shipped in ``pydoc_data``."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions leave pydoc_data out
        return
    for topic in sorted(topics):
        for passage in split_passages(topics[topic]):
            yield f"pydoc:{topic}", passage


def code_snippets(files: List[Tuple[str, Path]]) -> Iterator[Tuple[str, str]]:
    """(source, code) of top-level and method functions of ``CODE_LINES`` lines."""
    for name, path in files:
        tree = _parse(path)
        if tree is None:
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                span = node.end_lineno - first + 1
                if CODE_LINES[0] <= span <= CODE_LINES[1]:
                    code = _dedent(lines[first - 1 : node.end_lineno])
                    if len(code) <= CODE_CHARS and code.isascii():
                        yield f"stdlib:{name}", code


def _parse(path: Path) -> Optional[ast.Module]:
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None


def _dedent(lines: List[str]) -> str:
    indent = min((len(s) - len(s.lstrip()) for s in lines if s.strip()), default=0)
    return "\n".join(s[indent:].rstrip() for s in lines)


# -- the corpus ------------------------------------------------------------------------------
def _unique(pairs: Iterator[Tuple[str, str]]) -> List[Tuple[str, str]]:
    """First occurrence of each text (whitespace-insensitive), in order."""
    seen, out = set(), []
    for source, text in pairs:
        norm = " ".join(text.split())
        if norm not in seen:
            seen.add(norm)
            out.append((source, text))
    return out


def _tasks(
    units: List[Tuple[str, str]], tasks: List[str], kind: str, fence: bool, rng: random.Random
) -> List[dict]:
    """Every (unit, task) pair as a prompt, in a seeded order that visits units round-robin: the
    first len(units) prompts use each unit once, the next each unit again with another task."""
    per_unit = []
    for source, text in units:
        order = rng.sample(tasks, len(tasks))
        body = f"```python\n{text}\n```" if fence else text
        per_unit.append([(source, f"{task}\n\n{body}") for task in order])
    rng.shuffle(per_unit)
    out = []
    for round_ in range(len(tasks)):
        for made in per_unit:
            source, content = made[round_]
            out.append(
                {"kind": kind, "source": source, "messages": [{"role": "user", "content": content}]}
            )
    return out


def offline_sources(
    seed: int, stdlib_root: Optional[Path] = None, template_count: int = 6000
) -> Dict[str, List[dict]]:
    """Candidate prompts per kind, each kind in its seeded order (earlier ones are used first)."""
    rng = random.Random(seed)
    files = stdlib_files(stdlib_root)
    passages = _unique(list(docstring_passages(files)) + list(topic_passages()))
    snippets = _unique(code_snippets(files))
    made = [
        {"kind": p["kind"], "source": "template:" + p["kind"], "messages": p["messages"]}
        for p in templates.build_prompts(template_count, seed)
    ]
    return {
        "passage": _tasks(passages, PASSAGE_TASKS, "passage", False, rng),
        "code": _tasks(snippets, CODE_TASKS, "code", True, rng),
        "template": made,
    }


def build_corpus(
    count: int,
    seed: int = 0,
    eval_percent: int = 3,
    shares: Optional[Dict[str, float]] = None,
    stdlib_root: Optional[Path] = None,
) -> List[dict]:
    """``count`` distinct prompts ``{"id", "kind", "source", "split", "messages"}``, mixing the
    offline kinds by ``shares`` (a kind that runs out leaves its place to the others)."""
    shares = shares or {"passage": 0.45, "code": 0.35, "template": 0.20}
    pools = offline_sources(
        seed, stdlib_root, template_count=max(1000, int(count * shares.get("template", 0)) + 500)
    )
    want = {k: int(round(count * shares.get(k, 0))) for k in pools}
    taken: Dict[str, List[dict]] = {k: [] for k in pools}
    seen: set = set()
    # Fill each kind to its share, then top up from whichever kinds have prompts left.
    for phase in ("share", "top-up"):
        for kind, pool in pools.items():
            for p in pool:
                total = sum(len(v) for v in taken.values())
                if total >= count or (phase == "share" and len(taken[kind]) >= want[kind]):
                    break
                text = prompt_text(p)
                if text not in seen:
                    seen.add(text)
                    taken[kind].append(p)
            pools[kind] = [p for p in pool if prompt_text(p) not in seen]
    out = []
    for kind, chosen in taken.items():
        for i, p in enumerate(chosen):
            split = "eval" if is_held_out(p["source"], eval_percent) else "train"
            out.append(dict(p, id=f"{kind}-{i}", split=split))
    return out


def describe() -> dict:
    """What the offline sources depend on (for meta.json)."""
    return {"python": sys.version.split()[0], "stdlib": sysconfig.get_paths()["stdlib"]}
