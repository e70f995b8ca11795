"""A chat body's engine requests, the one path every chat API takes: OpenAI's chat completions and
Responses, and Anthropic's Messages (each converts its body to OpenAI's chat body first)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pytgi.api.chat import tools
from pytgi.api.exchange import Exchange, in_thread
from pytgi.api.frontend.bodies import ValidRequest
from pytgi.api.openai import schema
from pytgi.api.openai.error_shape import invalid
from pytgi.core.errors import InvalidRequest


@contextmanager
def named(names: dict[str, str]) -> Iterator[None]:
    """A shared rule's refusal, answered with OpenAI's field names (`max_tokens`, not `max_new_tokens`)."""
    try:
        yield
    except InvalidRequest as exc:
        raise schema.as_openai(exc, names) from None


async def chat_requests(
    ex: Exchange, body: schema.ChatCompletionRequest, n: int
) -> tuple[list[ValidRequest], tools.Style | None]:
    """A chat body's engine requests, admitted: OpenAI's chat rules, tools and constraints, the
    chat template, validation. Anthropic's Messages route converts its body and comes here too."""
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

    def render_template() -> str:
        msgs, tool_list = tools.template_messages(messages, tool_plan, tools.style_of(template))
        try:
            return st.tokenizer.apply_chat_template(
                msgs, add_generation_prompt=True, tools=tool_list, **(body.chat_template_kwargs or {})
            )
        except ValueError as exc:
            raise invalid(f"cannot apply the chat template: {exc}", "messages") from None

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
        gi.reasoning = st.config.reasoning_parser
        gi.images = images
        # Mistral's calls open with a special token: the answer's text keeps special tokens (as vLLM's)
        gi.skip_special_tokens = tool_style not in tools.MISTRAL_STYLES
        return schema.choices(await validation.validate(gi), n, body.seed)

    return await ex.admit(n, prepare), tool_style
