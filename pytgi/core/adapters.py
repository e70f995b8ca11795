"""LoRA adapters in PEFT's format: what `--lora-adapters` names and what an adapter directory says.

No torch here: the launcher and the API process read this; `pytgi.engine.models.lora` loads the weights
into the model. An adapter directory holds `adapter_config.json` and `adapter_model.safetensors`
(what `PeftModel.save_pretrained` writes). Each targeted linear `W` of the base model gains
`scaling · B A` (A: rank × in, B: out × rank), `scaling = lora_alpha / r`, or `lora_alpha / √r` with
`use_rslora`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pytgi.core.errors import UserError

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
HUB_PREFIX = "hub:"  # a runtime load's Hub id, as the API process passes it: never read as a local path
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/@+-]{0,127}")


class AdapterError(UserError, ValueError):
    """An adapter that cannot be served, and why."""


@dataclass(frozen=True)
class AdapterSpec:
    name: str  # what requests call it (`adapter_id`, OpenAI's and Anthropic's `model`)
    source: str  # a local directory or a Hub id


def parse_specs(values: Iterable[str]) -> list[AdapterSpec]:
    """`--lora-adapters` entries, `name=PATH_OR_HUB_ID` or a bare `PATH_OR_HUB_ID` (which names
    itself, as TGI's LORA_ADAPTERS does)."""
    specs: list[AdapterSpec] = []
    for value in values:
        name, sep, source = value.strip().partition("=")
        if not sep:
            name, source = value.strip(), value.strip()
        name, source = name.strip(), source.strip()
        check_name(name)
        if not source:
            raise AdapterError(f"--lora-adapters: {value!r} names no path or Hub id")
        if any(s.name == name for s in specs):
            raise AdapterError(f"--lora-adapters: two adapters are named {name!r}")
        specs.append(AdapterSpec(name, source))
    return specs


def check_name(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise AdapterError(
            f"adapter name {name!r}: 1 to 128 letters, digits and . _ - : / @ +, starting with a letter "
            "or digit"
        )


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    rslora: bool
    base_model: str | None  # base_model_name_or_path, as trained (informational)

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def read_config(path: Path, max_rank: int) -> AdapterConfig:
    """The adapter directory's config, checked: a LoRA that pytgi can apply, of rank <= max_rank."""
    file = path / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"{path} is not a PEFT adapter directory: it has no {CONFIG_FILE}")
    if not (path / WEIGHTS_FILE).is_file():
        raise AdapterError(f"{path} has no {WEIGHTS_FILE} (pytgi loads an adapter's safetensors only)")
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{file}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise AdapterError(f"{file}: not a JSON object")
    kind = data.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(f"{path}: a {kind} adapter; pytgi serves LoRA adapters only")
    unsupported = {
        "use_dora": "DoRA",
        "modules_to_save": "modules_to_save (fully trained layers)",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "fan_in_fan_out": "fan_in_fan_out",
    }
    for key, what in unsupported.items():
        if data.get(key):
            raise AdapterError(f"{path}: {what} is not supported")
    if data.get("bias", "none") != "none":
        raise AdapterError(f"{path}: trained biases (bias={data['bias']!r}) are not supported")
    rank, alpha = data.get("r"), data.get("lora_alpha", data.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{path}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"{path}: rank {rank} is above --max-lora-rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"{path}: lora_alpha must be a number, got {alpha!r}")
    base = data.get("base_model_name_or_path")
    base = base if isinstance(base, str) else None
    return AdapterConfig(rank, float(alpha), bool(data.get("use_rslora")), base)
