"""A chat request's engine requests, the one path every chat API takes: OpenAI's chat completions and
Responses, and Anthropic's Messages each translate their body into a `ChatRequest`
(`pytgi.api.chat.language`) and come here. Refusals are `InvalidRequest`s naming the chat request's
fields; each API names them its own way."""

from __future__ import annotations

import bisect
import copy
import os
import random
from collections.abc import Sequence

from pytgi.api.chat import tools
from pytgi.api.chat.language import MAX_TOP_LOGPROBS, ChatRequest, Image, Message, renamed
from pytgi.api.exchange import Exchange, in_thread
from pytgi.api.frontend.bodies import GrammarType, ValidRequest
from pytgi.api.frontend.media import ImageRef, load_images
from pytgi.api.state import State
from pytgi.core.errors import InvalidRequest
from pytgi.core.image_geometry import added_positions, wrap_images

# the router's names for what a chat request names otherwise (the rest are the same)
ROUTER_NAMES = {"inputs": "messages", "max_new_tokens": "max_tokens", "top_n_tokens": "top_logprobs"}


def images(messages: Sequence[Message]) -> list[ImageRef]:
    """The conversation's images in prompt order."""
    return [p.ref for m in messages if isinstance(m.content, list) for p in m.content if isinstance(p, Image)]


def choices(req: ValidRequest, n: int, seed: int | None) -> list[ValidRequest]:
    """n engine requests for n choices: a given seed becomes seed + choice, so each is reproducible;
    without one each sampled choice draws its own."""
    out = [req]
    for i in range(1, n):
        other = copy.copy(req)
        other.sampling = copy.copy(req.sampling)
        if req.sampling.sampling:
            other.sampling.seed = random.getrandbits(63) if seed is None else (seed + i) % 2**64
        out.append(other)
    return out


class Prompt:
    """A chat request's prompt: its tools' plan and the chat template's text."""

    def __init__(self, st: State, chat: ChatRequest) -> None:
        if not chat.messages:
            raise InvalidRequest("`messages` cannot be empty", "messages")
        self.st, self.chat = st, chat
        template = st.tokenizer.chat_template
        self.tool_plan = tools.plan(chat.tools, chat.tool_choice, chat.parallel_tool_calls, template)
        self.style = tools.style_of(template)

    @property
    def tool_style(self) -> tools.Style | None:
        return self.tool_plan.style if self.tool_plan is not None else None

    def text(self, count: int | None = None) -> str:
        """The prompt, or (`count`) the text of its first `count` messages without the answer's start."""
        msgs, tool_list = tools.template_messages(self.chat.messages[:count], self.tool_plan, self.style)
        try:
            return self.st.tokenizer.apply_chat_template(
                msgs, add_generation_prompt=count is None, tools=tool_list, **self.chat.template_kwargs
            )
        except ValueError as exc:
            raise InvalidRequest(f"cannot apply the chat template: {exc}", "messages") from None

    def pins(self, text: str, prompt: list[int]) -> list[tuple[int, float]]:
        """Each cache mark's prompt tokens: those wholly inside the text its messages alone render to,
        as far as it is the prompt's (none where the prompt is not the text's tokens: images,
        truncation)."""
        ids, offsets = self.st.tokenizer.encode_with_offsets(text, add_special_tokens=False)
        if ids != prompt:
            return []
        ends = [end for _, end in offsets]
        out: dict[int, float] = {}
        for count, seconds in self.chat.cache_marks:
            try:
                part = self.text(count)
            except InvalidRequest:  # a template that cannot end there (it wants a user turn): no pin
                continue
            shared = len(os.path.commonprefix([part, text]))
            tokens = bisect.bisect_right(ends, shared)
            if tokens:
                out[tokens] = max(out.get(tokens, 0.0), seconds)
        return sorted(out.items())


async def chat_requests(ex: Exchange, chat: ChatRequest) -> tuple[list[ValidRequest], tools.Style | None]:
    """A chat request's engine requests, admitted: its tools and constraint, the chat template,
    validation (the router's refusals named as the chat request names the fields); `chat.n` of them."""
    st = ex.st
    with ex.refused():
        prompt = Prompt(st, chat)
        image_refs = images(chat.messages)
        grammar: GrammarType | None = chat.constraint
        grammar_name = "constraint"
        if prompt.tool_plan is not None and prompt.tool_plan.forced:
            if grammar is not None:
                raise InvalidRequest(
                    "a `tool_choice` that forces a tool call cannot be combined with an output constraint",
                    "constraint",
                )
            grammar, grammar_name = tools.grammar(prompt.tool_plan, st.tokenizer.special_id), "tools"
    assert st.validation is not None
    validation = st.validation

    async def prepare() -> list[ValidRequest]:
        with renamed({**ROUTER_NAMES, "grammar": grammar_name}):
            images = await st.load_images(image_refs)
            text = await in_thread(prompt.text)
            gi = chat.sampling.to_input(
                text,
                chat.top_logprobs,
                MAX_TOP_LOGPROBS,
                stream=chat.stream,
                add_special_tokens=False,
                grammar=grammar,
                adapter=st.adapter_of(chat.model),
                cache_key=chat.cache_key,
            )
            reasoning = st.config.reasoning_parser
            # harmony's reasoning is a message of its own, not a <think> block a constraint could wait
            # for: a constraint applies from the first token (a forced call's grammar opens with its message)
            gi.reasoning = reasoning if reasoning != "harmony" else None
            gi.images = images
            template = st.tokenizer.chat_template
            gi.skip_special_tokens = not tools.keeps_special_tokens(template, prompt.tool_style, reasoning)
            valid = await validation.validate(gi)
            info = st.client.info
            if chat.cache_marks and info is not None and info.prefix_cache_max_pin_seconds > 0:
                valid.sampling.cache_pins = await in_thread(prompt.pins, text, valid.input_ids)
            return choices(valid, chat.n, chat.sampling.seed)

    return await ex.admit(chat.n, prepare), prompt.tool_style


async def prompt_tokens(st: State, chat: ChatRequest) -> int:
    """How many tokens the chat request's prompt is (the chat template with the tools, and the
    positions its images take), without admitting it."""
    prompt = Prompt(st, chat)
    refs = images(chat.messages)
    if refs and not st.takes_images:
        raise InvalidRequest(f"the model `{st.config.model_id}` does not take images", refs[0].where)
    layout = st.client.info.image_layout if st.client.info is not None else None
    added = 0
    if layout is not None and refs:  # fetched only where an image's size decides its positions
        data = await load_images(refs, st.media_limits()) if layout.sized else [b""] * len(refs)
        added = added_positions(layout, data)

    def count() -> int:
        text = prompt.text()
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest(
                "`messages` must be valid Unicode (no lone surrogates)", "messages"
            ) from None
        if layout is not None:
            text = wrap_images(text, layout, st.image_token_text())
        return len(st.tokenizer.encode(text, add_special_tokens=False)) + added

    return await in_thread(count)
