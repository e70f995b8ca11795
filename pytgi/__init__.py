"""pytgi: a text-generation inference server in Python.

`from pytgi import LLM, SamplingParams` loads the engine (torch) lazily, so that processes that
only need plain data (the API process) can import pytgi without torch.
"""

from typing import Any

from pytgi.core.errors import InvalidRequest
from pytgi.core.sampling_params import SamplingParams
from pytgi.core.version import __version__

__all__ = ["LLM", "InvalidRequest", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "RequestOutput"):
        from pytgi import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'pytgi' has no attribute {name!r}")
