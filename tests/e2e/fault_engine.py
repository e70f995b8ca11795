"""A real server whose engine fails every step that holds a request whose prompt starts with
FAULT_PROMPT's first tokens: per-step failure isolation, end to end.

`python -m tests.e2e.fault_engine serve FLAGS` is `pytgi serve FLAGS` with this module as the engine
process's entry point; run with other arguments, it is that engine process (`pytgi.engine.process`
with `FaultyRunner` as rank 0's runner).
"""

from __future__ import annotations

import sys

FAULT_PROMPT = "zqxj fault injection"


def _engine_main() -> int:
    from pytgi.core.tokenizer import Tokenizer
    from pytgi.engine import process
    from pytgi.engine.execution.runner import ModelRunner

    class FaultyRunner(ModelRunner):
        def __init__(self, config, rank=0):
            super().__init__(config, rank)
            self.prefix = Tokenizer.from_dir(config.model).encode(FAULT_PROMPT)[:3]

        def execute(self, batch):
            if any(s.request.prompt_ids[: len(self.prefix)] == self.prefix for s in batch):
                raise RuntimeError("injected fault")
            return super().execute(batch)

    return process.main(runner_cls=FaultyRunner)


def _serve_main(argv: list[str]) -> int:
    from pytgi.api.launcher import serve
    from pytgi.cli import build_parser

    return serve(build_parser().parse_args(argv), engine_module="tests.e2e.fault_engine")


if __name__ == "__main__":
    sys.exit(_serve_main(sys.argv[1:]) if sys.argv[1:2] == ["serve"] else _engine_main())
