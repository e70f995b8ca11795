"""Which `lora_path` a runtime adapter load may read (`pytgi.api.openai.lora_routes.allowed_source`):
inside --lora-dirs only, after symlinks and `..`; a Hub id only where the operator allows them; every
refusal the same words, whether or not the path exists."""

from __future__ import annotations

import os

import pytest

from pytgi.api.openai.lora_routes import NOT_ALLOWED, allowed_source
from pytgi.core.adapters import HUB_PREFIX, AdapterError


@pytest.fixture
def tree(tmp_path):
    allowed, outside = tmp_path / "adapters", tmp_path / "private"
    (allowed / "mine").mkdir(parents=True)
    (outside / "secret").mkdir(parents=True)
    (allowed / "link").symlink_to(outside / "secret")  # inside by name, outside in fact
    (allowed / "inner").symlink_to(allowed / "mine")  # a link that stays inside
    return allowed, outside


def refused(path: str, dirs: tuple[str, ...], hub: bool = False) -> str:
    with pytest.raises(AdapterError) as exc:
        allowed_source(path, dirs, hub)
    return str(exc.value)


def test_a_directory_inside_lora_dirs_is_read_by_its_real_path(tree):
    allowed, _ = tree
    dirs = (str(allowed),)
    assert allowed_source(str(allowed / "mine"), dirs, False) == os.path.realpath(allowed / "mine")
    assert allowed_source("mine", dirs, False) == os.path.realpath(allowed / "mine")  # relative: looked up
    assert allowed_source("inner", dirs, False) == os.path.realpath(allowed / "mine")
    assert allowed_source(str(allowed / "x" / ".." / "mine"), dirs, False) == os.path.realpath(
        allowed / "mine"
    )


def test_every_way_out_is_refused_with_the_same_words(tree):
    allowed, outside = tree
    dirs = (str(allowed),)
    attempts = [
        str(outside / "secret"),  # exists, outside
        str(outside / "nothing-here"),  # does not exist, outside
        str(allowed / ".." / "private" / "secret"),  # `..` out of the directory
        "../private/secret",  # the same, relative
        "link",  # a symlink out of it
        str(allowed / "missing"),  # inside, but no such directory
        "/etc",
        "",
        "a\0b",
        "\ud800",  # a lone surrogate (the fuzzer's)
    ]
    assert {refused(p, dirs) for p in attempts} == {NOT_ALLOWED}
    assert refused(str(allowed / "mine"), ()) == NOT_ALLOWED  # no --lora-dirs: nothing on disk
    assert str(outside) not in NOT_ALLOWED and "exist" not in NOT_ALLOWED


def test_a_hub_id_only_with_the_flag(tree):
    allowed, _ = tree
    assert refused("org/adapter", (str(allowed),)) == NOT_ALLOWED
    assert allowed_source("org/adapter", (), True) == HUB_PREFIX + "org/adapter"
    assert refused("org/adapter:Q4_K_M", (), True) == NOT_ALLOWED  # tags and files are a model's
    assert refused("/abs/path", (), True) == NOT_ALLOWED  # never a Hub id


def test_the_engine_never_reads_a_marked_hub_id_as_a_path(tmp_path, monkeypatch):
    """`hub:org/x` skips the local lookup, so a directory of that name in the server's working
    directory is not what a client reaches."""
    from pytgi.core import model_files as registry

    (tmp_path / "org" / "x").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert registry.resolve_adapter("org/x") == tmp_path.joinpath("org", "x").relative_to(
        tmp_path
    )  # unmarked
    fetched = []
    monkeypatch.setattr(registry.hub, "fetch", lambda ref, progress: fetched.append(ref.repo) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        registry.resolve_adapter(HUB_PREFIX + "org/x")
    assert fetched == ["org/x"]
