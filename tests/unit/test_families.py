"""The family registry (pytgi/core/families.py): the one list of architectures, its lookups, the
engine's code it names, and docs/models.md's table generated from it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from pytgi.core import families, gguf_convert, pooling
from pytgi.core.families import DECODER, ENCODER, FAMILIES, VISION, causal_lm, family_of, gguf_architecture

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pytgi"
ARCH = re.compile(
    r"^[A-Z][A-Za-z0-9_]*(ForCausalLM|ForConditionalGeneration|ForSequenceClassification|(?<!LMHead)Model)$"
)


def test_docs_models_table_is_current():
    doc = (ROOT / "docs" / "models.md").read_text()
    assert families.with_table(doc) == doc, f"run: {families.REGENERATE}"


def test_an_architecture_belongs_to_one_family():
    seen: dict[str, str] = {}
    for f in FAMILIES:
        assert f.architectures, f.name
        for arch in f.architectures:
            assert arch not in seen, f"{arch} is in {seen[arch]} and {f.name}"
            seen[arch] = f.name
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)


def test_each_family_declares_what_its_kind_needs():
    for f in FAMILIES:
        assert f.attention <= set(families.ATTENTION_KINDS), f.name
        assert set(f.kv_dtypes) <= set(families.KV_DTYPES), f.name
        if f.kind == DECODER:
            assert f.config and f.generators, f.name
        elif f.kind == VISION:
            assert f.config and f.model and f.images and not f.lora, f.name
        else:
            assert f.kind == ENCODER and f.model and not f.generators and not f.kv_dtypes, f.name
        if f.recurrent:  # a state cannot take back rejected drafts (LoRA needs no rollback)
            assert not f.speculation, f.name


def test_the_engine_code_each_family_names_exists():
    from pytgi.engine.models.registry import config_reader, model_class

    for f in FAMILIES:
        if f.config:
            assert callable(config_reader(f)), f.name
        if f.model:
            assert isinstance(model_class(f), type), f.name


def test_lookups():
    assert family_of("Qwen3ForCausalLM").name == "Qwen3"
    assert family_of("NoSuchForCausalLM") is None and family_of(None) is None
    assert causal_lm("Qwen3ForSequenceClassification") == "Qwen3ForCausalLM"
    assert causal_lm("MistralModel") == "MistralForCausalLM"
    assert causal_lm("Qwen3ForCausalLM") is None and causal_lm("BertModel") is None
    assert gguf_architecture("llama", experts=False).architecture == "LlamaForCausalLM"
    assert gguf_architecture("llama", experts=True).architecture == "MixtralForCausalLM"
    assert gguf_architecture("qwen35", experts=False).model_type == "qwen3_5_text"
    assert gguf_architecture("mamba", experts=False).model_type == "mamba"
    assert gguf_architecture("rwkv7", experts=False) is None


def test_the_lists_others_read_come_from_the_registry():
    assert pooling.ENCODERS == {"BertModel", "RobertaModel", "XLMRobertaModel", "ModernBertModel"}
    assert "Qwen3ForSequenceClassification" in pooling.DECODER_CLASSIFIERS
    assert "MistralModel" in pooling.DECODER_EMBEDDERS
    assert gguf_convert.DELTANET_TYPES == {"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"}
    assert gguf_convert.LFM2_TYPES == {"lfm2", "lfm2_moe"}
    assert gguf_convert.KDA_TYPES == {"kimi_linear"}
    for f in FAMILIES:
        for g in f.gguf:
            assert g.architecture in f.generators, (f.name, g.name)


def _sources() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text())) for p in sorted(PACKAGE.rglob("*.py"))]


def _arch_names(node: ast.AST) -> list[str]:
    return [
        n.value
        for n in ast.walk(node)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and ARCH.match(n.value)
    ]


def test_the_registry_is_the_only_list_of_architectures():
    """Outside pytgi/core/families.py no literal lists two architectures, and no module-level name
    is bound to one: a reader may compare its own architecture, never keep a list."""
    found = []
    for path, tree in _sources():
        if path == PACKAGE / "core" / "families.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Tuple | ast.List | ast.Set | ast.Dict):
                elts = node.keys if isinstance(node, ast.Dict) else node.elts
                listed = [
                    str(e.value) for e in elts if isinstance(e, ast.Constant) and ARCH.match(str(e.value))
                ]
                if len(listed) > 1:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {listed}")
        for stmt in tree.body:
            value = stmt.value if isinstance(stmt, ast.Assign | ast.AnnAssign) else None
            if value is not None and (bound := _arch_names(value)):
                found.append(f"{path.relative_to(ROOT)}:{stmt.lineno} {bound}")
    assert not found, "architectures listed outside the registry:\n" + "\n".join(found)


def test_no_code_asks_a_class_name():
    """A capability is a lookup (the registry, or an attribute a class declares), never a comparison
    with `type(x).__name__`."""
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path, tree in _sources()
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare)
        and any(
            isinstance(a, ast.Attribute) and a.attr in ("__name__", "__qualname__") for a in ast.walk(node)
        )
    ]
    assert not found, found
