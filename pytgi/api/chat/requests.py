"""A chat body's engine requests, the one path every chat API takes: OpenAI's chat completions and
Responses, and Anthropic's Messages (each converts its body to OpenAI's chat body first)."""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from pytgi.api.chat import tools
from pytgi.api.exchange import Exchange, in_thread
from pytgi.api.frontend.bodies import ValidRequest
from pytgi.api.openai import schema
from pytgi.api.openai.error_shape import OpenAIError, invalid
from pytgi.core.errors import InvalidRequest


@contextmanager
def named(names: dict[str, str]) -> Iterator[None]:
    """A shared rule's refusal, answered with OpenAI's field names (`max_tokens`, not `max_new_tokens`)."""
    try:
        yield
    except InvalidRequest as exc:
        raise schema.as_openai(exc, names) from None


async def chat_requests(
    ex: Exchange, body: schema.ChatCompletionRequest, n: int, cache_marks: Sequence[tuple[int, float]] = ()
) -> tuple[list[ValidRequest], tools.Style | None]:
    """A chat body's engine requests, admitted: OpenAI's chat rules, tools and constraints, the
    chat template, validation. Anthropic's Messages route converts its body and comes here too.
    `cache_marks`: (messages, seconds) pins, each of the prompt up to the end of its first messages
    (Anthropic's cache_control), given to the engine as prompt tokens (`SamplingParams.cache_pins`)."""
    st = ex.st
    template = st.tokenizer.chat_template
    with ex.refused():
        messages = schema.check_chat(body)
        image_refs = schema.take_images(messages)
        grammar, grammar_field = schema.constraint(body)
        tool_plan = tools.plan(body.tools, body.tool_choice, body.parallel_tool_calls, template)
        if tool_plan is not None and tool_plan.forced:
            if grammar is not None:
                raise invalid(
                    f'`tool_choice` "{body.tool_choice if isinstance(body.tool_choice, str) else "function"}"'
                    f" forces a tool call: it cannot be combined with `{grammar_field}`",
                    grammar_field,
                )
            grammar, grammar_field = tools.grammar(tool_plan, st.tokenizer.special_id), "tools"
    tool_style = tool_plan.style if tool_plan is not None else None
    assert st.validation is not None
    validation = st.validation
    max_tokens, max_tokens_name = body.max_new_tokens
    names = {
        "inputs": "messages",
        "max_new_tokens": max_tokens_name,
        "top_n_tokens": "top_logprobs",
        "grammar": grammar_field,
    }

    def render_template(count: int | None = None) -> str:
        """The prompt, or (`count`) the text of its first `count` messages without the answer's start."""
        msgs, tool_list = tools.template_messages(messages[:count], tool_plan, tools.style_of(template))
        try:
            return st.tokenizer.apply_chat_template(
                msgs, add_generation_prompt=count is None, tools=tool_list, **body.template_kwargs
            )
        except ValueError as exc:
            raise invalid(f"cannot apply the chat template: {exc}", "messages") from None

    def pins(text: str, prompt: list[int]) -> list[tuple[int, float]]:
        """Each mark's prompt tokens: those wholly inside the text its messages alone render to, as
        far as it is the prompt's (none where the prompt is not the text's tokens: images, truncation)."""
        ids, offsets = st.tokenizer.encode_with_offsets(text, add_special_tokens=False)
        if ids != prompt:
            return []
        ends = [end for _, end in offsets]
        out: dict[int, float] = {}
        for count, seconds in cache_marks:
            try:
                part = render_template(count)
            except OpenAIError:  # a template that cannot end there (it wants a user turn): no pin
                continue
            shared = len(os.path.commonprefix([part, text]))
            tokens = bisect.bisect_right(ends, shared)
            if tokens:
                out[tokens] = max(out.get(tokens, 0.0), seconds)
        return sorted(out.items())

    async def prepare() -> list[ValidRequest]:
        with named(names):
            return await preparenamed()

    async def preparenamed() -> list[ValidRequest]:
        images = await st.load_images(image_refs)
        text = await in_thread(render_template)
        gi = schema.to_input(
            body,
            text,
            max_tokens,
            body.top_logprobs if body.logprobs else None,
            schema.MAX_CHAT_TOP_LOGPROBS,
            add_special_tokens=False,
            grammar=grammar,
            adapter=st.adapter_of(body.model),
        )
        reasoning = st.config.reasoning_parser
        # harmony's reasoning is a message of its own, not a <think> block a constraint could wait for:
        # a constraint applies from the first token (a forced call's grammar opens with its message)
        gi.reasoning = reasoning if reasoning != "harmony" else None
        gi.images = images
        gi.skip_special_tokens = not tools.keeps_special_tokens(template, tool_style, reasoning)
        valid = await validation.validate(gi)
        info = st.client.info
        if cache_marks and info is not None and info.prefix_cache_max_pin_seconds > 0:
            valid.sampling.cache_pins = await in_thread(pins, text, valid.input_ids)
        return schema.choices(valid, n, body.seed)

    return await ex.admit(n, prepare), tool_style
