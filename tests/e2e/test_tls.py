"""`--ssl-keyfile` / `--ssl-certfile`: the server speaks HTTPS (a self-signed certificate made by
the `openssl` command line for this test), and the real clients talk to it."""

from __future__ import annotations

import shutil
import ssl
import subprocess

import httpx
import pytest

from tests.e2e.server import Server
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")]


def test_https(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    trust = ssl.create_default_context(cafile=str(cert))
    srv = Server("--ssl-keyfile", str(key), "--ssl-certfile", str(cert), log=tmp_path / "tls.log")
    url = srv.url.replace("http://", "https://")
    try:

        def healthy() -> bool:
            assert srv.proc.poll() is None, srv.tail()
            try:
                return httpx.get(f"{url}/health", verify=trust, timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, 300, "the TLS server's /health", interval=0.25)
        r = httpx.post(
            f"{url}/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}, verify=trust
        )
        assert r.status_code == 200 and r.json()["generated_text"]
        import openai

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", http_client=httpx.Client(verify=trust))
        assert client.completions.create(model="", prompt="Hi", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served on the TLS port
            httpx.get(f"{srv.url}/health", timeout=5)
        assert "on https://" in srv.tail()
    finally:
        srv.stop()
