"""`pytgi bench`: a serving benchmark for pytgi and any TGI or OpenAI-compatible server.

A client only: it never imports torch. See docs/bench.md.
"""

from pytgi.bench.command import add_bench_arguments, benchmark, run_bench

__all__ = ["add_bench_arguments", "benchmark", "run_bench"]
