"""Every error pytgi raises on purpose, in one place. How each one is answered over HTTP lives with
each API: TGI's status and `{"error", "error_type"}` in `pytgi.api.error_handlers`, OpenAI's
`{"error": {...}}` in `pytgi.api.openai.error_shape`.

No imports: the API process, the engine and the command line all take these.
"""

# --- the user's to fix before anything runs: the command line prints the message as one line


class UserError(Exception):
    """Something the user asked for cannot be done; the message names the fix."""


class ModelNotFound(UserError, FileNotFoundError):
    """No model at the path given."""


class UnsupportedModel(UserError, ValueError):
    """A model whose architecture or files pytgi cannot serve."""


class ModelTooLarge(UserError, MemoryError):
    """The model's weights do not fit in the memory available (refused before loading)."""


class GGUFConversionError(UserError, ValueError):
    """A GGUF file pytgi cannot read into a model."""


class HubError(UserError):
    """A Hub model that cannot be served: the message names the repository, the cause and the fix."""


class ConfigError(UserError, ValueError):
    """A setting, or a combination of settings, that cannot work (refused at start, in one line)."""


class DraftModelError(UserError, ValueError):
    """A draft model that cannot draft for the served one (another tokenizer, say)."""


# --- one request's fault: answered as a validation error (TGI 422, OpenAI 400)


class InvalidRequest(ValueError):
    """A request refused for what it asks (TGI answers 422, OpenAI 400), by the API's validation or
    by the engine (`SamplingParams`, `LLM`). `message` names the parameter and the fix, without TGI's
    "Input validation error: " prefix; `param` names the parameter at fault (TGI's name), `code` is
    OpenAI's (e.g. "context_length_exceeded")."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class UnknownModel(InvalidRequest):
    """A request naming a model this server does not serve (OpenAI and Anthropic answer 404)."""

    def __init__(self, message: str):
        super().__init__(message, "model", "model_not_found")


# --- a request that was admitted and then could not be answered


class InferError(Exception):
    """A request the router could not serve; `error_type` is TGI's name for the kind (and the
    `request_failure` metric's label)."""

    error_type = "generation"
    prefix = ""

    @property
    def message(self) -> str:
        return f"{self.prefix}{self}"


class Overloaded(InferError):
    """The in-flight limit is reached: refused at once, not queued."""

    error_type = "overloaded"

    def __init__(self) -> None:
        super().__init__("Model is overloaded")


class GenerationError(InferError):
    """The engine failed the request (its step raised, it refused the request, or the engine is gone):
    raised by the output pipeline (`OutputProcessor`) in the API process and the offline `LLM` alike."""

    error_type, prefix = "generation", "Request failed during generation: "


class IncompleteGeneration(InferError):
    """The stream ended without its last token."""

    error_type = "incomplete_generation"

    def __init__(self) -> None:
        super().__init__("Incomplete generation")


class GrammarError(RuntimeError):
    """A constrained request cannot go on (its matcher failed); only that request ends."""


class ClientGone(Exception):
    """The client left before its answer was ready: the request was aborted, nothing is sent."""


# --- the engine itself: fatal


class EngineDead(RuntimeError):
    """The engine process is gone: every request in flight fails, health answers 503."""


class DistributedError(RuntimeError):
    """A collective failed or timed out: a rank is gone or stuck. Fatal for the engine."""
