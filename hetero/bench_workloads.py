"""Prompts of the offline benchmark's workloads.

random     random token ids, outputs ignore EOS: exact input/output lengths (the default)
code-edit  the prompt holds a source file and asks for it back with one function renamed: most
           of the answer copies the prompt (what coding assistants do; n-gram guesses pay)
chat       open questions with nothing to copy from the prompt (n-gram guesses rarely pay)

The source files of code-edit are this package's own modules (present wherever it is
installed), cut at a line boundary to about input_len tokens. Text workloads stop at EOS or
output_len tokens, so their output lengths vary; greedy sampling keeps them equal between runs
with and without speculation.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

WORKLOADS = ("random", "code-edit", "chat")

TOPICS = (
    "why the sky is blue",
    "how a bicycle stays upright",
    "the history of the printing press",
    "what makes bread rise",
    "how tides work",
    "the life of honey bees",
    "how vaccines train the immune system",
    "why cats purr",
    "how a compiler turns code into a program",
    "the water cycle",
    "how airplanes fly",
    "what causes earthquakes",
    "how the heart pumps blood",
    "why leaves change color in autumn",
    "how a rainbow forms",
    "the invention of the telephone",
)


def random_prompts(vocab: int, n: int, input_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab) for _ in range(input_len)] for _ in range(n)]


def _source_files() -> list[Path]:
    root = Path(__file__).resolve().parent
    return sorted(p for p in root.rglob("*.py") if p.stat().st_size > 2000)


def _cut(tokenizer, text: str, input_len: int) -> str:
    """The leading lines of text that fit in about input_len tokens."""
    kept, used = [], 0
    for line in text.splitlines(keepends=True):
        n = len(tokenizer.encode(line))
        if used + n > input_len and kept:
            break
        kept.append(line)
        used += n
    return "".join(kept)


def _chat(tokenizer, content: str) -> list[int]:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True
    )
    return tokenizer.encode(prompt)


def code_edit_prompts(tokenizer, n: int, input_len: int, seed: int) -> list[list[int]]:
    """Ask for a file back with one function renamed (the file takes ~input_len tokens)."""
    rng = random.Random(seed)
    out = []
    for path, source, names in _files_with_functions(tokenizer, input_len, seed, n):
        name = rng.choice(names)
        task = (
            f"Here is the file {path.name}:\n\n```python\n{source}```\n\n"
            f"Rename the function `{name}` to `{name}_v2` everywhere and reply with the whole "
            "file, nothing else."
        )
        out.append(_chat(tokenizer, task))
    return out


def _files_with_functions(tokenizer, input_len: int, seed: int, n: int):
    """n (path, source cut to input_len tokens, function names in it), cycling over the files
    whose cut defines a function (a rename needs one)."""
    files = _source_files()
    found, i = [], 0
    while len(found) < n and i < len(files) * (n // len(files) + 1):
        path = files[(seed + i) % len(files)]
        i += 1
        source = _cut(tokenizer, path.read_text(), input_len)
        names = re.findall(r"^\s*def (\w+)\(", source, flags=re.M)
        if names:
            found.append((path, source, names))
    if not found:
        raise ValueError(f"no source file defines a function within {input_len} tokens")
    return [found[j % len(found)] for j in range(n)]


def chat_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    topics = list(TOPICS)
    rng.shuffle(topics)
    return [
        _chat(tokenizer, f"Explain {topics[i % len(topics)]} in a few paragraphs.")
        for i in range(n)
    ]


def make_prompts(engine, workload: str, n: int, input_len: int, seed: int) -> list[list[int]]:
    if workload == "random":
        return random_prompts(engine.model_config.vocab_size, n, input_len, seed)
    if workload == "code-edit":
        return code_edit_prompts(engine.tokenizer, n, input_len, seed)
    if workload == "chat":
        return chat_prompts(engine.tokenizer, n, seed)
    raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {workload!r}")
