"""The package is laid out by process (docs/architecture.md): `pytgi.core` (imported by both sides; no
torch, no FastAPI), the API side (`pytgi.api`, and `pytgi.bench`, a client), the engine side
(`pytgi.engine`: the engine, models, kernels, distributed). The engine never imports the API side, the
API side never imports the engine, the core imports neither; the import graph, in-function imports
counted, has no cycle; at most five modules sit at the package root. On the API side, the chat
language (`pytgi.api.chat`) imports no API's own module, however indirectly: each API translates
into it, never the other way; and no API imports another's."""

import subprocess
import sys

from tests.import_graph import ROOT, cycles, graph

API = ("pytgi.api", "pytgi.bench")
ENGINE = ("pytgi.engine",)
CORE = ("pytgi.core",)


def side(module: str) -> str:
    for name, prefixes in (("api", API), ("engine", ENGINE), ("core", CORE)):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return name
    return "root"


def test_each_side_imports_only_itself_and_the_core():
    allowed = {"core": {"core"}, "api": {"api", "core"}, "engine": {"engine", "core"}}
    wrong = [
        f"{a} ({side(a)}) imports {b} ({side(b)})"
        for a, targets in graph().items()
        for b in targets
        if side(a) in allowed and side(b) not in allowed[side(a)]
    ]
    assert not wrong, "\n".join(wrong)


VENDORS = ("pytgi.api.openai", "pytgi.api.anthropic", "pytgi.api.tgi")


def is_vendor(module: str) -> bool:
    return any(module == v or module.startswith(v + ".") for v in VENDORS)


def test_the_chat_language_imports_no_api_of_its_own():
    g = graph()
    chat = sorted(m for m in g if m == "pytgi.api.chat" or m.startswith("pytgi.api.chat."))
    assert "pytgi.api.chat.language" in chat and "pytgi.api.chat.requests" in chat
    wrong = []
    for start in chat:
        seen, todo = {start}, [(start, [start])]
        while todo:  # every module it imports, however indirectly, with the path there
            module, path = todo.pop()
            for target in g[module] - seen:
                seen.add(target)
                if is_vendor(target):
                    wrong.append(" → ".join([*path, target]))
                todo.append((target, [*path, target]))
    assert not wrong, "\n".join(wrong)


def test_no_api_imports_another():
    def api(module: str) -> str | None:
        return next((v for v in VENDORS if module == v or module.startswith(v + ".")), None)

    wrong = [
        f"{a} imports {b}"
        for a, targets in graph().items()
        for b in targets
        if api(a) is not None and api(b) is not None and api(a) != api(b)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_import_graph_has_no_cycle():
    assert cycles(graph()) == []


def test_at_most_five_modules_at_the_package_root():
    assert len(list((ROOT / "pytgi").glob("*.py"))) <= 5


def check_api_process_never_imports_torch(then: str = "") -> None:
    """Import the API process's modules, run `then`, and check torch and transformers stayed out."""
    code = (
        "import sys\n"
        "import pytgi.api.launcher, pytgi.api.app, pytgi.api.tgi, pytgi.api.openai\n"
        "import pytgi.api.frontend.infer, pytgi.api.frontend.engine_client, pytgi.bench.command\n"
        f"{then}"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_api_process_never_imports_torch():
    # resolving (converting) the default model as well: tests/model/test_default_model_api.py
    check_api_process_never_imports_torch()


def test_the_core_imports_neither_torch_nor_fastapi():
    core = sorted(m for m in graph() if side(m) == "core")
    code = (
        "import sys\n"
        f"import {', '.join(core)}\n"
        "bad = {'torch', 'transformers', 'fastapi', 'starlette'} & set(sys.modules)\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_engine_never_imports_fastapi():
    code = (
        "import sys\n"
        "import pytgi.engine.process, pytgi.engine.distributed.worker, pytgi.engine.llm_engine, pytgi.engine.distributed.remote_rank\n"
        "assert 'fastapi' not in sys.modules and 'starlette' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_version_is_the_packages():
    import tomllib

    from pytgi.core.version import __version__

    assert __version__ == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
