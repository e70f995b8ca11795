"""The one-call C decoder loop against the Python layer loop over the same kernels (both models' tests)."""

from __future__ import annotations

import dataclasses

from pytgi import LLM, SamplingParams
from pytgi.engine.loading.model import load_model


def assert_loop_equals_python_path(
    fast: LLM, prompts: list, min_loop_steps: int, quantize: str = "auto"
) -> None:
    """The same tokens and prompt logprobs, bit for bit, with the model's decoder loop and without
    it; the loop must have run at least `min_loop_steps` steps. `quantize`: as `fast` was given it."""
    runner = fast.engine.runner
    model = runner.model
    used, loop = [], model.decoder_loop
    assert loop is not None

    def counting(*args, **kwargs):
        h = loop(*args, **kwargs)
        used.append(h is not None)
        return h

    counting.takes_lora, counting.takes_window = loop.takes_lora, loop.takes_window  # type: ignore[attr-defined]
    model.decoder_loop = counting
    # The same model without the loop: the Python layer loop over the same kernels.
    plain = load_model(
        fast.engine.model_path,
        runner.dtype,
        runner.device,
        dataclasses.replace(model.kernels, decoder_loop=False),
        quantize,
    )
    assert plain.decoder_loop is None  # type: ignore[attr-defined]
    params = SamplingParams(max_new_tokens=12, temperature=0, prompt_logprobs=True)
    outs = []
    for m in (model, plain):
        runner.paged.model = m
        outs.append([(o.token_ids, o.prompt_logprobs) for o in fast.generate(prompts, params)])
    assert outs[0] == outs[1]
    assert sum(used) >= min_loop_steps, used
