"""Prompt sources for the load generator: random token ids, random words, or a JSONL file."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


class DatasetError(ValueError):
    """A prompt source that cannot be used as asked (bad file, bad line, missing lengths)."""


@dataclass(frozen=True)
class BenchPrompt:
    """One request's input.

    prompt: text, or a list of token ids (completions endpoint only).
    input_len: prompt length in tokens when known exactly (token-id prompts), else None;
        the server's reported prompt_tokens is used where it is given.
    output_len: max_tokens to ask for.
    """

    prompt: str | list[int]
    input_len: int | None
    output_len: int


# Common English words that most BPE vocabularies hold as one token with a leading space,
# so N words come out close to N tokens whatever the server's tokenizer.
_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have "
    "from or one had by word but not what all were we when your can said there use an each "
    "which she do how their if will up other about out many then them these so some her "
    "would make like him into time has look two more write go see number no way could people "
    "my than first water been call who oil its now find long down day did get come made may "
    "part over new sound take only little work know place year live me back give most very "
    "after thing our just name good sentence man think say great where help through much "
    "before line right too mean old any same tell boy follow came want show also around form "
    "three small set put end does another well large must big even such because turn here "
    "why ask went men read need land different home us move try kind hand picture again "
    "change off play spell air away animal house point page letter mother answer found study "
    "still learn should world high every near add food between own below country plant last "
    "school father keep tree never start city earth eye light thought head under story saw"
).split()

# Token ids far from the special tokens at the bottom of most vocabularies and inside the
# vocabulary of any model worth benchmarking.
DEFAULT_TOKEN_RANGE = (1000, 20000)


def random_token_prompts(num: int, input_len: int, output_len: int, seed: int = 0,
                         token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE) -> list[BenchPrompt]:
    """num prompts of exactly input_len random token ids each (for /v1/completions)."""
    rng = random.Random(seed)
    low, high = token_range
    return [BenchPrompt([rng.randrange(low, high) for _ in range(input_len)], input_len, output_len)
            for _ in range(num)]


def random_word_prompts(num: int, input_len: int, output_len: int,
                        seed: int = 0) -> list[BenchPrompt]:
    """num prompts of input_len random common words each: about input_len tokens."""
    rng = random.Random(seed)
    return [BenchPrompt(" ".join(rng.choices(_WORDS, k=input_len)), None, output_len)
            for _ in range(num)]


def load_jsonl(path: str | Path, num: int | None, output_len: int | None,
               allow_token_ids: bool = True) -> list[BenchPrompt]:
    """Prompts from a JSONL file, one {"prompt": str | [ids], "output_len"?: int} per line.

    num: how many to take; the file is repeated from the top if it has fewer lines
    (None: every line once). output_len: for lines without their own.
    """
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise DatasetError(f"cannot read dataset {path}: {e.strerror or e}") from None
    items: list[BenchPrompt] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        items.append(_parse_line(line, f"{path}:{lineno}", output_len, allow_token_ids))
    if not items:
        raise DatasetError(f"dataset {path} has no prompts")
    if num is None:
        return items
    return [items[i % len(items)] for i in range(num)]


def _parse_line(line: str, where: str, output_len: int | None,
                allow_token_ids: bool) -> BenchPrompt:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(obj, dict) or "prompt" not in obj:
        raise DatasetError(f'{where}: expected an object with a "prompt" key')
    prompt = obj["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        if not allow_token_ids:
            raise DatasetError(f"{where}: token-id prompts need the /v1/completions endpoint")
        input_len = len(prompt)
    elif isinstance(prompt, str) and prompt:
        input_len = None
    else:
        raise DatasetError(f'{where}: "prompt" must be a non-empty string or list of token ids')
    out = obj.get("output_len", output_len)
    if out is None:
        raise DatasetError(f'{where}: no "output_len" and no --output-len given')
    if not isinstance(out, int) or isinstance(out, bool) or out < 1:
        raise DatasetError(f'{where}: "output_len" must be a positive integer')
    return BenchPrompt(prompt, input_len, out)
