"""Offline prompt sets: chat questions, code completion cut from the Python standard library, and
summarization passages. Deterministic for a given seed; cut to the profile's `max_input_tokens`.

- `chat`: `prompts/chat.txt`, one question per line.
- `code`: function sources taken with `inspect.getsource` from stdlib modules at build time, cut at a
  line in the middle ("complete this code"), so the prompts are real source text, not synthetic.
- `summarize`: `prompts/summarize.txt`, passages separated by `---` lines, wrapped in an instruction.
"""

from __future__ import annotations

import importlib
import inspect
import random
from pathlib import Path

from specbuild.core.errors import UsageError

PROMPT_DIR = Path(__file__).parent / "prompts"
# Pure-Python stdlib modules whose function sources make realistic completion prompts.
CODE_MODULES = ("textwrap", "shlex", "heapq", "bisect", "fnmatch", "colorsys", "json.decoder", "string",
                "difflib", "statistics", "calendar", "posixpath")


def _lines(path: Path) -> list[str]:
    return [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def chat_prompts() -> list[str]:
    return _lines(PROMPT_DIR / "chat.txt")


def summarize_prompts() -> list[str]:
    body = "\n".join(ln for ln in (PROMPT_DIR / "summarize.txt").read_text().splitlines()
                     if not ln.startswith("#"))
    passages = [p.strip() for p in body.split("\n---\n") if p.strip()]
    return [f"Summarize the following text in a few sentences.\n\n{p}\n\nSummary:" for p in passages]


def code_prompts(seed: int = 0, limit: int = 40) -> list[str]:
    """Prefixes of real stdlib functions: the first part of the body, to be completed."""
    rng = random.Random(seed)
    out: list[str] = []
    for modname in CODE_MODULES:
        module = importlib.import_module(modname)
        for _, fn in sorted(inspect.getmembers(module, inspect.isfunction)):
            if fn.__module__ != module.__name__:
                continue
            try:
                lines = inspect.getsource(fn).splitlines()
            except (OSError, TypeError):
                continue
            if len(lines) < 6:
                continue
            cut = rng.randint(3, max(3, len(lines) // 2))
            out.append("Complete the following Python code.\n\n" + "\n".join(lines[:cut]) + "\n")
    rng.shuffle(out)
    return out[:limit]


def prompt_set(name: str, seed: int = 0) -> list[str]:
    if name == "chat":
        return chat_prompts()
    if name == "code":
        return code_prompts(seed)
    if name == "summarize":
        return summarize_prompts()
    raise UsageError(f"unknown prompt set {name!r}; known: chat, code, summarize.")


def build_prompts(mix: dict[str, int], *, count: int = 200, seed: int = 0, counter=None,
                  max_input_tokens: int | None = None, chat: bool = False) -> list[str]:
    """`count` prompts drawn from the weighted `mix` (set name -> weight), each cut to
    `max_input_tokens` tokens of `counter` (a TokenCounter) when both are given, and wrapped in the
    target's chat template when `chat` (instruct models answer a bare question with an early EOS)."""
    rng = random.Random(seed)
    pools = {name: prompt_set(name, seed) for name in mix}
    for name, pool in pools.items():
        if not pool:
            raise UsageError(f"prompt set {name!r} is empty; check {PROMPT_DIR}.")
    names = list(mix)
    weights = [mix[n] for n in names]
    out = []
    for _ in range(count):
        text = rng.choice(pools[rng.choices(names, weights)[0]])
        if counter is not None and max_input_tokens:
            text = counter.truncate(text, max_input_tokens)
        if counter is not None and chat:
            text = counter.chat(text)
        out.append(text)
    return out
