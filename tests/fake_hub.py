"""A stand-in for the Hugging Face Hub on loopback: enough of its HTTP API for huggingface_hub to
fetch models (model info, tree listing, file resolution with ETag / X-Repo-Commit / Content-Length,
byte ranges), with its error codes (401 RepoNotFound for an unknown or private repository, 401
GatedRepo for a gated file without a token, 404 RevisionNotFound / EntryNotFound). Tests point
HF_ENDPOINT at it; nothing leaves the machine."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

TOKEN = "hf_test_token"


@dataclass
class Repo:
    files: dict[str, Path]  # path in the repository -> file on disk
    gated: bool = False  # files need the token (model info does not, as on the Hub)
    private: bool = False  # everything needs the token
    commit: str = ""
    branches: dict[str, str] = field(default_factory=dict)  # other revisions: name -> commit

    def __post_init__(self) -> None:
        if not self.commit:
            h = hashlib.sha1()
            for name, path in sorted(self.files.items()):
                h.update(name.encode() + str(path.stat().st_size).encode())
            self.commit = h.hexdigest()

    def resolve(self, revision: str) -> str | None:
        if revision in ("main", self.commit):
            return self.commit
        return self.branches.get(revision) or (revision if revision in self.branches.values() else None)


class FakeHub:
    def __init__(self, repos: dict[str, Repo]) -> None:
        self.repos = repos
        self.requests: list[str] = []  # "METHOD path" of every request served
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def downloads(self) -> list[str]:
        """Files whose bytes were sent (GET of a resolve URL)."""
        return [
            r.split("/resolve/", 1)[1].split("/", 1)[1]
            for r in self.requests
            if r.startswith("GET ") and "/resolve/" in r
        ]


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    info_path = re.compile(r"^/api/models/([^/]+/[^/]+?)(?:/revision/([^/]+))?$")
    tree_path = re.compile(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?$")
    resolve_path = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _error(self, status: int, code: str, message: str) -> None:
            data = json.dumps({"error": message}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _json(self, obj: object) -> None:
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _repo(self, name: str, need_token: bool = False) -> Repo | None:
            repo = hub.repos.get(name)
            authorized = self.headers.get("Authorization") == f"Bearer {TOKEN}"
            if repo is None or (repo.private and not authorized):
                self._error(401, "RepoNotFound", "Repository not found")
                return None
            if need_token and repo.gated and not authorized:
                self._error(401, "GatedRepo", "Access to this model is restricted: you must be authenticated")
                return None
            return repo

        def _serve(self, body: bool) -> None:
            path = urlsplit(self.path).path
            hub.requests.append(f"{self.command} {path}")
            if m := info_path.match(path):
                if (repo := self._repo(m[1])) is None:
                    return
                if (commit := repo.resolve(unquote(m[2] or "main"))) is None:
                    return self._error(404, "RevisionNotFound", "Invalid rev id")
                return self._json(
                    {
                        "id": m[1],
                        "modelId": m[1],
                        "sha": commit,
                        "private": repo.private,
                        "gated": "auto" if repo.gated else False,
                        "siblings": [{"rfilename": f} for f in sorted(repo.files)],
                    }
                )
            if m := tree_path.match(path):
                if (repo := self._repo(m[1])) is None:
                    return
                if repo.resolve(unquote(m[2])) is None:
                    return self._error(404, "RevisionNotFound", "Invalid rev id")
                prefix = unquote(m[3] or "")
                return self._json(
                    [
                        {"type": "file", "path": f, "size": p.stat().st_size, "oid": _etag(p)}
                        for f, p in sorted(repo.files.items())
                        if f.startswith(prefix)
                    ]
                )
            if m := resolve_path.match(path):
                if (repo := self._repo(m[1], need_token=True)) is None:
                    return
                if (commit := repo.resolve(unquote(m[2]))) is None:
                    return self._error(404, "RevisionNotFound", "Invalid rev id")
                file = repo.files.get(unquote(m[3]))
                if file is None:
                    return self._error(404, "EntryNotFound", "Entry not found")
                return self._file(file, commit, body)
            self._error(404, "NotFound", f"no route {path}")

        def _file(self, file: Path, commit: str, body: bool) -> None:
            size = file.stat().st_size
            start = 0
            if (rng := re.match(r"bytes=(\d+)-$", self.headers.get("Range", ""))) and body:
                start = int(rng[1])
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{_etag(file)}"')
            self.send_header("Content-Length", str(size - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
            self.end_headers()
            if body:
                with open(file, "rb") as f:
                    f.seek(start)
                    while chunk := f.read(1 << 20):
                        self.wfile.write(chunk)

    return Handler


def _etag(path: Path) -> str:
    st = path.stat()
    return hashlib.sha1(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
