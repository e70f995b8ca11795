import subprocess
import sys


def check_api_process_never_imports_torch(then: str = "") -> None:
    """Import the API process's modules, run `then`, and check torch and transformers stayed out."""
    code = (
        "import sys\n"
        "import pytgi.server.launcher, pytgi.server.app, pytgi.server.tgi, pytgi.server.openai\n"
        "import pytgi.router.infer, pytgi.router.engine_client, pytgi.bench.cli\n"
        f"{then}"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_api_process_never_imports_torch():
    # resolving (converting) the default model as well: tests/model/test_default_model_api.py
    check_api_process_never_imports_torch()


def test_the_engine_never_imports_fastapi():
    code = (
        "import sys\n"
        "import pytgi.engine.process, pytgi.engine.worker, pytgi.engine.engine\n"
        "assert 'fastapi' not in sys.modules and 'starlette' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
