import subprocess
import sys


def test_the_api_process_never_imports_torch():
    code = (
        "import sys\n"
        "import pytgi.server.launcher, pytgi.server.app, pytgi.server.tgi, pytgi.server.openai\n"
        "import pytgi.router.infer, pytgi.router.engine_client, pytgi.bench.cli\n"
        "from pytgi.models.registry import resolve_model\n"
        "resolve_model(None, progress=False)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_engine_never_imports_fastapi():
    code = (
        "import sys\n"
        "import pytgi.engine.process, pytgi.engine.worker, pytgi.engine.engine\n"
        "assert 'fastapi' not in sys.modules and 'starlette' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
