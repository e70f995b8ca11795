import pytest

from tests.e2e.server import Server


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The default model, default flags (but a bounded KV cache)."""
    srv = Server(log=tmp_path_factory.mktemp("logs") / "server.log").wait_ready()
    yield srv
    srv.stop()
