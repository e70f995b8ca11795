"""The serving settings' one table: flags, environment variables, configs and docs/flags.md from it."""

from __future__ import annotations

import argparse
from pathlib import Path

from pytgi.api import launcher
from pytgi.core import flags
from pytgi.core.config import EngineConfig, ServerConfig

DOCS = Path(__file__).resolve().parents[2] / "docs" / "flags.md"


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    launcher.add_serve_arguments(p)
    return p.parse_args(argv)


def test_docs_flag_list_is_the_table() -> None:
    assert DOCS.read_text() == flags.markdown(), "run: python -m pytgi.core.flags > docs/flags.md"


def test_each_setting_has_its_own_flag_and_variable() -> None:
    table = flags.table()
    assert len({s.flag for s in table}) == len({s.env for s in table}) == len(table)
    assert {s.reader for s in table} == {"engine", "server"}
    by_flag = {s.flag: s for s in table}
    assert by_flag["--model-id"].name == "model" and by_flag["--model-id"].env == "MODEL_ID"
    assert by_flag["--disable-prefix-caching"].name == "enable_prefix_caching"


def test_flags_and_environment_build_both_configs(monkeypatch) -> None:
    monkeypatch.setenv("MAX_BATCH_SIZE", "7")
    monkeypatch.setenv("DISABLE_PREFIX_CACHING", "1")
    monkeypatch.setenv("CORS_ALLOW_ORIGIN", "https://a.example,https://b.example")
    monkeypatch.setenv("JSON_OUTPUT", "0")
    args = parse(["--max-total-tokens", "512", "--api-key-exempt", "health,metrics", "--port", "8080"])
    engine = EngineConfig(**flags.from_args(args, "engine"))
    assert (engine.max_batch_size, engine.max_total_tokens, engine.enable_prefix_caching) == (7, 512, False)
    assert engine.batch_invariant and engine.model is None
    server = ServerConfig(engine, Path("."), "m", **flags.from_args(args, "server"))
    assert server.port == 8080 and server.api_key_exempt == ("health", "metrics")
    assert server.cors_allow_origin == ("https://a.example", "https://b.example") and not server.json_output
    # flags given replace the environment's list; a switch flag flips its default
    args = parse(
        [
            "--cors-allow-origin",
            "https://c.example",
            "--cors-allow-origin",
            "https://d.example",
            "--disable-batch-invariance",
            "--json-output",
        ]
    )
    server = ServerConfig(engine, Path("."), "m", **flags.from_args(args, "server"))
    assert server.cors_allow_origin == ("https://c.example", "https://d.example") and server.json_output
    assert not EngineConfig(**flags.from_args(args, "engine")).batch_invariant


def test_defaults_are_the_configs_defaults(monkeypatch) -> None:
    for s in flags.table():
        monkeypatch.delenv(s.env, raising=False)
    args = parse([])
    assert EngineConfig(**flags.from_args(args, "engine")) == EngineConfig()
    server = ServerConfig(EngineConfig(), Path("."), "m", **flags.from_args(args, "server"))
    assert server == ServerConfig(EngineConfig(), Path("."), "m")


def test_server_settings_validate_themselves(tmp_path, monkeypatch) -> None:
    """ServerConfig.validate: each refusal a ConfigError naming the flag, before any model is read;
    the names it checks against are those the API side's modules define."""
    import pytest

    from pytgi.api.chat.reasoning import PARSERS
    from pytgi.api.middleware import EXEMPTIONS
    from pytgi.api.replicas.affinity import POLICIES
    from pytgi.core.config import API_KEY_EXEMPTIONS, REASONING_PARSERS, REPLICA_ROUTING, ConfigError

    assert tuple(EXEMPTIONS) == API_KEY_EXEMPTIONS and PARSERS == REASONING_PARSERS
    assert POLICIES == REPLICA_ROUTING

    def config(**kw) -> ServerConfig:
        return ServerConfig(EngineConfig(), Path("."), "m", **kw)

    config().validate()
    config(api_key_exempt=("none",), reasoning_parser="qwen3", chat_template="{{ x }}").validate()
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    config(chat_template=str(tmp_path / "t.jinja"), ssl_keyfile="k", ssl_certfile="c").validate()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for kw, message in [
        (dict(api_key_exempt=("health", "secrets")), "--api-key-exempt: unknown route name(s) secrets"),
        (dict(reasoning_parser="nope"), "--reasoning-parser: unknown 'nope'"),
        (dict(chat_template=str(tmp_path / "missing.jinja")), "--chat-template: "),
        (dict(ssl_keyfile="k"), "HTTPS needs both"),
        (dict(replicas=-1), "--replicas must be >= 0"),
        (dict(min_replicas=2), "need --replicas N"),
        (dict(replicas=2, replica_routing="random"), "--replica-routing: unknown 'random'"),
        (dict(replicas=2, min_replicas=3, max_replicas=2), "--min-replicas 3 is above --max-replicas 2"),
        (dict(replicas=5, max_replicas=4), "outside the autoscaling bounds"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            config(**kw).validate()
