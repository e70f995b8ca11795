"""Models named by their Hugging Face Hub id, as TGI, vLLM and llama.cpp users name them.

`org/name` is a Hugging Face model (config, tokenizer, `*.safetensors`); `org/name:TAG` the GGUF file of a
quantization (`Q4_K_M`, `Q8_0`, `BF16`...), as llama.cpp's `-hf` takes it; `org/name/file.gguf` one file.
huggingface_hub does the transport, so its cache (`HF_HOME`, `HF_HUB_CACHE`), endpoint (`HF_ENDPOINT`),
token (`HF_TOKEN`) and offline mode (`HF_HUB_OFFLINE`) hold as for every other Hub client. What to fetch
is decided here, from the repository's file list (`choose_files`: no network, unit-tested); a model
already in the cache serves without the Hub.
"""

from __future__ import annotations

import importlib
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

from pytgi.core.errors import HubError
from pytgi.core.gguf_convert import SPLIT

log = logging.getLogger("pytgi.hub")

_NAME = r"[A-Za-z0-9][\w.-]*"
HUB_ID = re.compile(rf"^(?P<repo>{_NAME}/{_NAME})(?::(?P<tag>[\w.-]+)|/(?P<file>[^:]+\.gguf))?$")
# A GGUF file's quantization, as llama.cpp's tools name files: model-Q4_K_M.gguf, model.IQ4_XS.gguf,
# model-UD-Q4_K_XL.gguf, model-bf16.gguf.
QUANT = re.compile(
    r"(?:^|[-._])((?:UD-)?(?:I?Q[1-8](?:_[0-9A-Z]+)*|T?Q[12]_0|BF16|F16|F32|FP16|FP32|MXFP4(?:_MOE)?))"
    r"(?=$|[-._])",
    re.IGNORECASE,
)
DEFAULT_TAG = "Q4_K_M"
HF_FILES = {  # beside the *.safetensors, what pytgi reads of a Hugging Face model directory
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    # an embedding model's sentence-transformers files (pytgi.core.pooling), and its pooling's folder
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
}
POOLING_CONFIG = re.compile(r"^[0-9]+_Pooling/config\.json$")
PICKLED = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class HubRef:
    repo: str  # org/name
    tag: str | None = None  # a GGUF quantization
    file: str | None = None  # a GGUF file's path in the repository

    def __str__(self) -> str:
        return self.repo + (f":{self.tag}" if self.tag else f"/{self.file}" if self.file else "")


@dataclass(frozen=True)
class Selection:
    kind: str  # "hf" (a model directory) or "gguf" (one file, or the parts of a split one)
    files: tuple[str, ...]


@dataclass(frozen=True)
class Fetched:
    path: Path  # the snapshot directory ("hf"), or the GGUF file (the first part of a split one)
    parts: tuple[Path, ...]  # every GGUF part, in order (empty for "hf")
    sha: str  # the commit served


def parse_hub_id(model: str) -> HubRef | None:
    """`org/name`, `org/name:TAG` or `org/name/path/file.gguf`; None when `model` is not shaped like one."""
    m = HUB_ID.match(model)
    if m is None or model.startswith((".", "/", "~")):
        return None
    return HubRef(m["repo"], m["tag"], m["file"])


def gguf_tag(path: str) -> str | None:
    """The quantization a GGUF file's name (or else its folder's) carries, upper-cased."""
    for part in reversed(Path(SPLIT.sub(".gguf", path)).with_suffix("").parts):
        found = QUANT.findall(part)
        if found:
            return found[-1].upper()
    return None


def _gguf_groups(files: list[str]) -> dict[str, list[str]]:
    """GGUF files by the name they share (a split file's parts together, in order); projectors
    (`mmproj`) are not models."""
    groups: dict[str, list[str]] = {}
    for f in sorted(files):
        if f.lower().endswith(".gguf") and "mmproj" not in Path(f).name.lower():
            groups.setdefault(SPLIT.sub(".gguf", f), []).append(f)
    return groups


def _split_parts(parts: list[str], repo: str) -> tuple[str, ...]:
    if len(parts) > 1 or SPLIT.search(parts[0]):
        total = {int(m[2]) for m in map(SPLIT.search, parts) if m}
        if len(total) != 1 or len(parts) != total.pop():
            raise HubError(
                f"{repo}: the split GGUF {SPLIT.sub('.gguf', parts[0])} is missing parts ({', '.join(parts)})"
            )
    return tuple(parts)


def choose_files(repo: str, files: list[str], ref: HubRef) -> Selection:
    """What to fetch of a repository holding `files` (paths relative to its root)."""
    groups = _gguf_groups(files)
    if ref.file is not None:
        group = groups.get(SPLIT.sub(".gguf", ref.file))
        if ref.file not in files or group is None:
            have = ", ".join(sorted(groups)) or "none"
            raise HubError(f"{repo}: no file {ref.file} in the repository (GGUF files: {have})")
        return Selection("gguf", _split_parts(group, repo))
    top = [f for f in files if "/" not in f]
    if ref.tag is None and {"adapter_config.json", "adapter_model.safetensors"} <= set(top):
        return Selection("hf", ("adapter_config.json", "adapter_model.safetensors"))  # a LoRA adapter
    safetensors = [f for f in top if f.endswith(".safetensors")]
    if ref.tag is None and "config.json" in top and safetensors:
        pooling = [f for f in files if POOLING_CONFIG.match(f)]
        return Selection("hf", tuple(sorted(safetensors + [f for f in top if f in HF_FILES] + pooling)))
    if not groups:
        if ref.tag is not None:
            raise HubError(
                f"{repo}: :{ref.tag} names a GGUF quantization, but the repository has no GGUF files"
            )
        if pickled := [f for f in top if f.endswith(PICKLED)]:
            raise HubError(
                f"{repo} has only pickled PyTorch weights ({', '.join(pickled)}): "
                "pytgi loads *.safetensors or GGUF only, since unpickling a checkpoint can run any code; "
                "pick a repository with safetensors weights"
            )
        raise HubError(
            f"{repo} holds no model pytgi can load: neither config.json with *.safetensors nor *.gguf"
        )
    tags: dict[str, list[str]] = {}
    for name in groups:
        tags.setdefault(gguf_tag(name) or "", []).append(name)
    want = (ref.tag or DEFAULT_TAG).upper()
    listing = ", ".join(sorted(t for t in tags if t)) or "none"
    if want in tags:
        chosen = tags[want]
    elif ref.tag is None and len(groups) == 1:
        chosen = list(groups)
    elif ref.tag is None:
        raise HubError(
            f"{repo} has several GGUF files and no {DEFAULT_TAG}: name one with {repo}:TAG "
            f"(tags here: {listing})"
        )
    else:
        raise HubError(f"{repo}: no GGUF file for the tag {ref.tag} (tags here: {listing})")
    if len(chosen) > 1:
        raise HubError(
            f"{repo}: {len(chosen)} GGUF files carry the tag {want} ({', '.join(chosen)}): "
            f"name one with {repo}/FILE.gguf"
        )
    return Selection("gguf", _split_parts(groups[chosen[0]], repo))


# -- fetching -----------------------------------------------------------------------------------
def _http_errors() -> tuple[type[BaseException], ...]:
    """The Hub answered with an HTTP error, or could not be reached."""
    from huggingface_hub.errors import HfHubHTTPError

    return (HfHubHTTPError, *_unreachable_errors())


def _unreachable_errors() -> tuple[type[BaseException], ...]:
    """What huggingface_hub raises when the Hub cannot be reached (its HTTP library varies by version)."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    errors: list[type[BaseException]] = [OfflineModeIsEnabled, ConnectionError, TimeoutError]
    for module in ("httpx2", "httpx", "requests"):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        errors.append(getattr(mod, "TransportError", None) or mod.exceptions.ConnectionError)
    return tuple(errors)


def _cause(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def cache_folder(repo: str) -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE) / ("models--" + repo.replace("/", "--"))


def _from_cache(ref: HubRef, revision: str | None, why: str) -> tuple[Path, str, list[str]]:
    """The cached snapshot of `revision` (default: main): (its folder, its commit, its files)."""
    folder = cache_folder(ref.repo)
    rev = revision or "main"
    ref_file = folder / "refs" / rev
    commit = rev if COMMIT.match(rev) else ref_file.read_text().strip() if ref_file.is_file() else None
    snapshot = folder / "snapshots" / commit if commit else None
    if commit is None or snapshot is None or not snapshot.is_dir():
        raise HubError(
            f"{ref.repo}: {why}, and revision {rev} is not in the cache ({folder}); "
            f"fetch it where the Hub is reachable: pytgi download {ref}"
        )
    files = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]
    return snapshot, commit, files


def _local(snapshot: Path, files: tuple[str, ...], kind: str, sha: str) -> Fetched:
    paths = tuple(snapshot / f for f in files)
    if kind == "hf":
        return Fetched(snapshot, (), sha)
    return Fetched(paths[0], paths, sha)


def fetch(ref: HubRef, revision: str | None = None, progress: bool = True) -> Fetched:
    """The files `ref` needs, from the Hub into huggingface_hub's cache or from that cache alone
    (HF_HUB_OFFLINE=1, or the Hub unreachable). `progress`: huggingface_hub's bars; each file's
    download is also logged (one JSON line each with --json-output)."""
    from huggingface_hub import HfApi, constants, get_token, hf_hub_download
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import disable_progress_bars

    if not progress:
        disable_progress_bars()
    where = constants.ENDPOINT
    if constants.HF_HUB_OFFLINE:
        snapshot, sha, files = _from_cache(ref, revision, "HF_HUB_OFFLINE is set")
        sel = choose_files(ref.repo, files, ref)
        log.info("HF_HUB_OFFLINE is set: serving %s from the cache (commit %s)", ref, sha)
        return _local(snapshot, sel.files, sel.kind, sha)
    token = "" if get_token() else " (a private repository needs HF_TOKEN)"
    try:
        info = HfApi().model_info(ref.repo, revision=revision, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except RevisionNotFoundError:
        raise HubError(f"{ref.repo}: revision {revision} not found on {where}") from None
    except GatedRepoError:
        raise HubError(_gated(ref.repo, where)) from None
    except RepositoryNotFoundError:
        raise HubError(f"{ref.repo}: repository not found on {where}{token}") from None
    except _http_errors() as exc:
        why = f"the Hub at {where} is unreachable ({_cause(exc)})"
        snapshot, sha, files = _from_cache(ref, revision, why)
        sel = choose_files(ref.repo, files, ref)
        log.warning("%s: serving %s from the cache (commit %s)", why, ref, sha)
        return _local(snapshot, sel.files, sel.kind, sha)
    sha = info.sha or ""
    sel = choose_files(ref.repo, [s.rfilename for s in info.siblings or []], ref)
    paths: list[Path] = []
    for name in sel.files:
        start = time.monotonic()
        try:
            path = Path(
                hf_hub_download(ref.repo, name, revision=sha, etag_timeout=constants.HF_HUB_ETAG_TIMEOUT)
            )
        except GatedRepoError:
            raise HubError(_gated(ref.repo, where)) from None
        except RepositoryNotFoundError:
            raise HubError(f"{ref.repo}: repository not found on {where}{token}") from None
        except _http_errors() as exc:
            raise HubError(f"{ref.repo}: downloading {name} from {where} failed ({_cause(exc)})") from None
        size = path.stat().st_size
        log.info(
            "%s: %s (%d bytes) in %.1f s",
            ref.repo,
            name,
            size,
            time.monotonic() - start,
            extra={"fields": {"repo": ref.repo, "file": name, "bytes": size, "commit": sha}},
        )
        paths.append(path)
    snapshot = paths[0].parents[len(Path(sel.files[0]).parts) - 1]
    rev = revision or "main"
    if rev != sha:  # the files came by commit: record which commit the branch or tag named, as
        ref_file = cache_folder(ref.repo) / "refs" / rev  # snapshot_download does, for offline use
        ref_file.parent.mkdir(parents=True, exist_ok=True)
        ref_file.write_text(sha)
    return _local(snapshot, sel.files, sel.kind, sha)


def _gated(repo: str, where: str) -> str:
    from huggingface_hub import get_token

    if get_token():
        return (
            f"{repo} is gated and HF_TOKEN has no access to it: accept its terms on its page at {where}, "
            "with the account of that token"
        )
    return (
        f"{repo} is gated: accept its terms on its page at {where}, "
        "then set HF_TOKEN to a token of that account"
    )
