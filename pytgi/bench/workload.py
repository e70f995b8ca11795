"""The benchmark's requests: prompts of known token lengths, output lengths, arrival times.

Everything is seeded, so the same arguments give the same prompts in every run and for every server.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from pytgi.core.tokenizer import Tokenizer

MAX_ADJUST_ROUNDS = 64


@dataclass(frozen=True)
class BenchRequest:
    """One request: the prompt text, its token count, and how many tokens to ask for."""

    index: int
    prompt: str
    input_len: int
    output_len: int

    def to_json(self) -> dict:
        return asdict(self)


def default_tokenizer_dir() -> Path:
    """The default model's Hugging Face directory (converted from its GGUF file once, without torch)."""
    from pytgi.core.model_files import resolve_model

    return resolve_model(None, progress=True).path


def load_tokenizer(path: str | Path | None) -> tuple[Tokenizer, Path]:
    directory = Path(path).expanduser() if path else default_tokenizer_dir()
    return Tokenizer.from_dir(directory), directory


def token_pool(tokenizer: Tokenizer) -> list[int]:
    """Ids random prompts are drawn from: every non-special token."""
    return [i for i in range(tokenizer.vocab_size) if i not in tokenizer.special_ids]


def count_tokens(tokenizer: Tokenizer, text: str) -> int:
    """How the benchmark counts tokens of any text, prompt or output, for every server."""
    return len(tokenizer.encode(text, add_special_tokens=False)) if text else 0


def exact_length_text(tokenizer: Tokenizer, rng: random.Random, length: int, pool: list[int]) -> str:
    """Random text that encodes (add_special_tokens=False) to exactly `length` tokens.

    Random ids decoded to text do not in general re-encode to the same number of tokens (neighbouring
    pieces merge, partial UTF-8 sequences become U+FFFD), so: decode, re-encode, trim the excess or
    append new random ids, and repeat until the length is exact.
    """
    if length < 1:
        raise ValueError(f"a prompt needs at least one token, not {length}")
    for _ in range(8):  # restarts, should the adjustment ever cycle
        ids = [rng.choice(pool) for _ in range(length)]
        for _ in range(MAX_ADJUST_ROUNDS):
            text = tokenizer.decode(ids)
            enc = tokenizer.encode(text, add_special_tokens=False)
            if len(enc) == length and text.strip():
                return text
            if len(enc) > length:
                ids = enc[:length]
            else:
                ids = enc + [rng.choice(pool) for _ in range(length - len(enc))]
                if not text.strip():
                    ids = [rng.choice(pool) for _ in range(length)]
    raise RuntimeError(f"could not build a prompt of exactly {length} tokens")


def synthetic_requests(
    tokenizer: Tokenizer,
    num: int,
    input_min: int,
    input_max: int,
    output_min: int,
    output_max: int,
    seed: int = 0,
    shared_prefix_len: int = 0,
) -> list[BenchRequest]:
    """`num` random-text prompts, input lengths uniform in [input_min, input_max], output lengths uniform
    in [output_min, output_max]; the same seed gives the same requests.

    With `shared_prefix_len`, every prompt is one shared random text of that many tokens, a newline,
    then its own random part; `input_len` is then the whole prompt's count (the two parts may merge a
    token at the seam)."""
    if not 1 <= input_min <= input_max:
        raise ValueError(f"need 1 <= input-min <= input-max, got {input_min}..{input_max}")
    if not 1 <= output_min <= output_max:
        raise ValueError(f"need 1 <= output-min <= output-max, got {output_min}..{output_max}")
    if shared_prefix_len < 0:
        raise ValueError(f"shared prefix length must be >= 0, got {shared_prefix_len}")
    rng = random.Random(seed)
    pool = token_pool(tokenizer)
    prefix = (
        exact_length_text(tokenizer, random.Random(seed + 1), shared_prefix_len, pool) + "\n"
        if shared_prefix_len
        else ""
    )
    out = []
    for i in range(num):
        n_in = rng.randint(input_min, input_max)
        n_out = rng.randint(output_min, output_max)
        text = exact_length_text(tokenizer, rng, n_in, pool)
        got = count_tokens(tokenizer, text)
        assert got == n_in, f"prompt {i}: {got} tokens, wanted {n_in}"
        if prefix:
            text = prefix + text
            n_in = count_tokens(tokenizer, text)
        out.append(BenchRequest(i, text, n_in, n_out))
    return out


def dataset_requests(tokenizer: Tokenizer, path: str | Path, num: int | None = None) -> list[BenchRequest]:
    """Requests from a JSONL file of `{"prompt": str, "output_len": int}` lines (the first `num`)."""
    out: list[BenchRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                prompt, output_len = item["prompt"], item["output_len"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f'{path}:{lineno}: expected {{"prompt": str, "output_len": int}}: {e}'
                ) from e
            if not isinstance(prompt, str) or not prompt or not isinstance(output_len, int) or output_len < 1:
                raise ValueError(
                    f"{path}:{lineno}: `prompt` must be a non-empty string and `output_len` a "
                    "positive integer"
                )
            out.append(BenchRequest(len(out), prompt, count_tokens(tokenizer, prompt), output_len))
            if num is not None and len(out) >= num:
                break
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


def poisson_arrivals(num: int, rate: float, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of a Poisson process of `rate` requests/s; the first at 0.

    rate = inf sends everything at once."""
    if rate <= 0:
        raise ValueError(f"request rate must be positive, not {rate}")
    if rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed)
    times, t = [], 0.0
    for i in range(num):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times
