"""Encoders for embeddings (pytgi.engine.models.encoder, pytgi.engine.pooling.encoder_engine): tiny random BERT and
XLM-RoBERTa against transformers' own models, the real all-MiniLM-L6-v2 against sentence-transformers
(cosine >= 0.99999, the same ranking), a prompt's vector the same bits batched or alone, and the
pooling engine's steps."""

from __future__ import annotations

import json
import random
import time
from typing import Literal

import pytest
import torch
import transformers

from pytgi.core import protocol as P
from pytgi.core.config import EngineConfig
from pytgi.core.errors import ConfigError, InvalidRequest, UnsupportedModel
from pytgi.core.model_files import ResolvedModel
from pytgi.core.pooling import PoolingInfo, read_pooling
from pytgi.core.sampling_params import SamplingParams
from pytgi.engine.models.encoder import finish, pool
from pytgi.engine.models.encoders import load_encoder
from pytgi.engine.pooling.encoder_engine import PoolingEngine
from tests import minilm as examples
from tests.minilm import minilm_dir

SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def tiny(path, family: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    cfg: transformers.PretrainedConfig
    model: transformers.PreTrainedModel
    if family == "bert":
        cfg = transformers.BertConfig(vocab_size=120, max_position_embeddings=64, **SHAPE)
        model = transformers.BertModel(cfg)
    else:
        cfg = transformers.XLMRobertaConfig(
            vocab_size=120, max_position_embeddings=66, pad_token_id=1, type_vocab_size=1, **SHAPE
        )
        model = transformers.XLMRobertaModel(cfg)
    model.eval().save_pretrained(path)
    return model


def prompts(n: int, vocab: int = 120, most: int = 60, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)  # ids from 2: no padding token inside a prompt (RoBERTa numbers around it)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(1, most))] for _ in range(n)]


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_tiny_encoder_equals_transformers(tmp_path, family):
    ref = tiny(tmp_path, family)
    ours = load_encoder(tmp_path, torch.float32)
    for ids in prompts(6):
        with torch.no_grad():
            want = ref(torch.tensor([ids])).last_hidden_state[0]
        got = ours(torch.tensor(ids), [len(ids)])
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_a_prompts_vector_is_the_same_batched_or_alone(tmp_path, family):
    tiny(tmp_path, family)
    model = load_encoder(tmp_path, torch.float32)
    pooling = PoolingInfo(method="mean", normalize=True, dimensions=32)
    batch = prompts(12, most=60, seed=2)
    lens = [len(p) for p in batch]
    together = pool(model(torch.tensor([t for p in batch for t in p]), lens), lens, pooling)
    for ids, v in zip(batch, together, strict=True):
        alone = pool(model(torch.tensor(ids), [len(ids)]), [len(ids)], pooling)[0]
        assert torch.equal(v, alone)


def test_pooling_methods_and_matryoshka():
    h = torch.arange(12, dtype=torch.float32).view(4, 3)
    mean, cls, last = (
        pool(h, [3, 1], PoolingInfo(method=m, normalize=False, dimensions=3)) for m in ("mean", "cls", "last")
    )
    assert mean[0].tolist() == [3.0, 4.0, 5.0] and mean[1].tolist() == [9.0, 10.0, 11.0]
    assert cls[0].tolist() == [0.0, 1.0, 2.0] and last[0].tolist() == [6.0, 7.0, 8.0]
    v = finish(torch.tensor([3.0, 4.0, 12.0]), True, 2)  # cut, then a unit vector again
    torch.testing.assert_close(v, torch.tensor([0.6, 0.8]))


def test_a_checkpoint_lacking_weights_is_refused(tmp_path):
    tiny(tmp_path, "bert")
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["encoder.layer.1.output.dense.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(UnsupportedModel, match="lacks 1 weights"):
        load_encoder(tmp_path, torch.float32)


SENTENCES = [
    *examples.SENTENCES,
    "A man is riding a white horse on an enclosed ground.",
    "Someone in a gorilla costume is playing a set of drums.",
    examples.LONG,  # past the model's 256 tokens: cut as sentence-transformers cuts
]


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    return minilm_dir(tmp_path_factory.mktemp("minilm"))


def test_all_minilm_equals_sentence_transformers(minilm):
    from sentence_transformers import SentenceTransformer

    from pytgi.core.tokenizer import Tokenizer

    want = SentenceTransformer(str(minilm), device="cpu").encode(SENTENCES, convert_to_tensor=True)
    pooling = read_pooling(minilm, 384)
    assert pooling == PoolingInfo(method="mean", normalize=True, dimensions=384, max_seq_length=256)
    model, tok = load_encoder(minilm, torch.float32), Tokenizer.from_dir(minilm)
    ids = [tok.encode(s) for s in SENTENCES]
    assert len(tok.encode(SENTENCES[-1])) > 256
    ids = [i if len(i) <= 256 else i[:255] + [i[-1]] for i in ids]  # ST keeps [SEP] at the cut
    lens = [len(i) for i in ids]
    got = torch.stack(
        [
            finish(v, True, None)
            for v in pool(model(torch.tensor([t for i in ids for t in i]), lens), lens, pooling)
        ]
    )
    cos = torch.nn.functional.cosine_similarity(got, want)
    assert cos.min() >= 0.99999, cos
    for q in range(len(SENTENCES)):  # the same neighbours, in the same order
        assert (got @ got[q]).topk(5).indices.tolist() == (want @ want[q]).topk(5).indices.tolist()


def engine(path, **kw) -> PoolingEngine:
    return PoolingEngine(EngineConfig(model=str(path), **kw), ResolvedModel(path, "tiny"))


def run(eng: PoolingEngine) -> dict[str, P.PoolOut]:
    out: dict[str, P.PoolOut] = {}
    while eng.has_unfinished():
        for o in eng.step():
            assert isinstance(o, P.PoolOut)
            out[o.request_id] = o
    return out


def test_the_pooling_engine_batches_within_its_budget(tmp_path):
    tiny(tmp_path, "bert")
    (tmp_path / "modules.json").write_text(
        json.dumps([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}])
    )
    eng = engine(tmp_path, max_batch_prefill_tokens=100, max_batch_size=3)
    assert eng.info.task == "embed" and eng.info.max_input_tokens == 64
    batch = prompts(7, most=60, seed=3)
    for i, ids in enumerate(batch):
        eng.add_pool_request(f"r{i}", ids, P.PoolParams())
    out: dict[str, P.PoolOut] = {}
    most = 0
    while eng.has_unfinished():
        got = eng.step()
        assert len(eng.flight) <= 3 and eng.flight_tokens <= 100  # in flight: within the budgets
        most = max(most, len(eng.flight) + eng.last_step.batch_size)
        out.update({o.request_id: o for o in got if isinstance(o, P.PoolOut)})
    assert len(out) == 7 and most > 1
    for i, ids in enumerate(batch):  # the same bits as each alone
        eng.add_pool_request("alone", ids, P.PoolParams())
        assert run(eng)["alone"].data == out[f"r{i}"].data
        assert out[f"r{i}"].num_tokens == len(ids) and out[f"r{i}"].rows == 1


def test_the_pooling_engine_answers_what_a_request_asks(tmp_path):
    tiny(tmp_path, "bert")
    eng = engine(tmp_path)
    ids = prompts(1, seed=4)[0]
    eng.add_pool_request("raw", ids, P.PoolParams(normalize=False))
    eng.add_pool_request("unit", ids, P.PoolParams(normalize=True, dimensions=8))
    eng.add_pool_request("tokens", ids, P.PoolParams(tokens=True))
    out = run(eng)
    raw = torch.frombuffer(bytearray(out["raw"].data), dtype=torch.float32)
    unit = torch.frombuffer(bytearray(out["unit"].data), dtype=torch.float32)
    tokens = torch.frombuffer(bytearray(out["tokens"].data), dtype=torch.float32).view(len(ids), 32)
    torch.testing.assert_close(unit, torch.nn.functional.normalize(raw[:8], dim=0))
    torch.testing.assert_close(tokens.mean(0), raw)
    assert out["tokens"].rows == len(ids)
    with pytest.raises(InvalidRequest, match="more than the 64"):
        eng.add_pool_request("long", [5] * 65, P.PoolParams())
    with pytest.raises(InvalidRequest, match="dimensions must be in 1..32"):
        eng.add_pool_request("dims", [5], P.PoolParams(dimensions=33))
    with pytest.raises(InvalidRequest, match="does not generate"):
        eng.submit(P.Submit("gen", [5], SamplingParams()))


def test_flags_an_embedding_model_cannot_take_are_refused(tmp_path):
    tiny(tmp_path, "bert")
    with pytest.raises(ConfigError, match="--num-shard, --lora-adapters"):
        engine(tmp_path, num_shard=2, lora_adapters=("a=/x",))
    with pytest.raises(ConfigError, match="max_batch_prefill_tokens \\(32\\) must be >= max_input_tokens"):
        engine(tmp_path, max_batch_prefill_tokens=32)


def test_an_encoder_is_never_loaded_as_a_generator(tmp_path):
    from pytgi.engine.llm_engine import LLMEngine

    tiny(tmp_path, "bert")
    with pytest.raises(UnsupportedModel, match="is an embedding model"):
        LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32"))


def tiny_classifier(path, family: str, labels: int = 1) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model: transformers.PreTrainedModel
    if family == "bert":
        bert = transformers.BertConfig(vocab_size=120, max_position_embeddings=64, **SHAPE)
        bert.num_labels = labels
        model = transformers.BertForSequenceClassification(bert)
    else:
        cfg = transformers.XLMRobertaConfig(
            vocab_size=120,
            max_position_embeddings=66,
            pad_token_id=1,
            type_vocab_size=1,
            **SHAPE,
        )
        cfg.num_labels = labels
        model = transformers.XLMRobertaForSequenceClassification(cfg)
    model.eval().save_pretrained(path)
    return model


@pytest.mark.parametrize("family,labels", [("bert", 1), ("bert", 3), ("xlm-roberta", 1)])
def test_a_cross_encoders_logits_equal_transformers_batched_or_alone(tmp_path, family, labels):
    ref = tiny_classifier(tmp_path, family, labels)
    eng = engine(tmp_path)
    assert eng.info.task == "classify" and eng.info.pooling is not None
    assert len(eng.info.pooling.labels) == labels
    pairs = [(a, b) for a, b in zip(prompts(6, most=20, seed=5), prompts(6, most=30, seed=6), strict=True)]
    for i, (a, b) in enumerate(pairs):
        eng.add_pool_request(f"p{i}", a + b, P.PoolParams(pair_at=len(a)))
    out = run(eng)
    for i, (a, b) in enumerate(pairs):
        types = [0] * len(a) + [1] * len(b) if family == "bert" else [0] * (len(a) + len(b))
        with torch.no_grad():
            want = ref(torch.tensor([a + b]), token_type_ids=torch.tensor([types])).logits[0]
        got = torch.frombuffer(bytearray(out[f"p{i}"].data), dtype=torch.float32)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        eng.add_pool_request("alone", a + b, P.PoolParams(pair_at=len(a)))
        assert run(eng)["alone"].data == out[f"p{i}"].data


def tiny_modernbert(
    path, labels: int | None = None, pooling: Literal["cls", "mean"] = "cls"
) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    cfg = transformers.ModernBertConfig(
        vocab_size=120,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,  # global, local, local, global
        num_attention_heads=4,
        local_attention=8,  # a local layer sees 4 tokens either side
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
    )
    cfg._attn_implementation = "sdpa"
    model: transformers.PreTrainedModel
    if labels is None:
        model = transformers.ModernBertModel(cfg)
    else:
        cfg.num_labels, cfg.classifier_pooling = labels, pooling
        model = transformers.ModernBertForSequenceClassification(cfg)
    model.eval().save_pretrained(path)
    return model


def test_tiny_modernbert_equals_transformers_batched_or_alone(tmp_path):
    ref = tiny_modernbert(tmp_path)
    model = load_encoder(tmp_path, torch.float32)
    batch = prompts(6, most=40, seed=7)  # past the local window
    lens = [len(p) for p in batch]
    together = model(torch.tensor([t for p in batch for t in p]), lens)
    for ids, rows in zip(batch, together.split(lens), strict=True):
        with torch.no_grad():
            want = ref(torch.tensor([ids])).last_hidden_state[0]
        torch.testing.assert_close(rows, want, atol=2e-5, rtol=1e-5)
        assert torch.equal(model(torch.tensor(ids), [len(ids)]), rows)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_a_modernbert_cross_encoder_equals_transformers(tmp_path, pooling):
    ref = tiny_modernbert(tmp_path, labels=2, pooling=pooling)
    eng = engine(tmp_path)
    assert eng.info.task == "classify"
    batch = prompts(4, most=30, seed=8)
    for i, ids in enumerate(batch):
        eng.add_pool_request(f"r{i}", ids, P.PoolParams())
    out = run(eng)
    for i, ids in enumerate(batch):
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0]
        got = torch.frombuffer(bytearray(out[f"r{i}"].data), dtype=torch.float32)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_the_pooling_engine_drops_aborted_requests_and_fails_a_prompt_alone(tmp_path, monkeypatch):
    """Aborted while waiting or while a worker computes it: no result. A prompt whose forward raises
    fails its own request; the others in flight beside it are answered."""
    tiny(tmp_path, "bert")
    eng = engine(tmp_path)
    batch = prompts(6, seed=5)
    forward = eng.model.forward

    def flaky(ids, lens, types=None):
        if ids.tolist() == batch[2]:
            raise RuntimeError("boom")
        if ids.tolist() == batch[4]:
            time.sleep(1.0)  # still computing when aborted
        return forward(ids, lens, types)

    monkeypatch.setattr(eng.model, "forward", flaky)
    for i, ids in enumerate(batch):
        eng.add_pool_request(f"r{i}", ids, P.PoolParams())
    with pytest.raises(InvalidRequest, match="already in use"):
        eng.add_pool_request("r0", batch[0], P.PoolParams())
    eng.abort_request("r5")  # waiting
    out: dict[str, P.PoolOut | P.TokenOut] = {o.request_id: o for o in eng.step()}
    eng.abort_request("r4")  # handed to the workers by the step
    while eng.has_unfinished():
        out.update({o.request_id: o for o in eng.step()})
    assert sorted(out) == ["r0", "r1", "r2", "r3"]
    assert isinstance(out["r2"], P.TokenOut) and "boom" in (out["r2"].error or "")
    assert all(isinstance(out[k], P.PoolOut) for k in out if k != "r2")
    assert eng.stats()["failed_steps"] >= 1 and not eng.flight and not eng.aborted
