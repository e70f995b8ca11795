"""Causal LMs as pooling models on the paged engine (pytgi.engine.pooling.head): a tiny random Qwen3
embedder against transformers and sentence-transformers, a Qwen3 sequence classifier and a causal LM
scoring by two tokens' logits against transformers; long prompts in chunks, batched = alone bit for
bit; what such a model refuses."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from pytgi.core import protocol as P
from pytgi.core.config import EngineConfig
from pytgi.core.errors import ConfigError, InvalidRequest, UnsupportedModel
from pytgi.core.sampling_params import SamplingParams
from pytgi.core.tokenizer import Tokenizer
from pytgi.engine.llm_engine import LLMEngine
from tests.decoder_pooling import qwen3_causal, qwen3_classifier, qwen3_embedder
from tests.minilm import SENTENCES, minilm_dir


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    return minilm_dir(tmp_path_factory.mktemp("minilm"))


def engine(path, dtype: str = "float32", **kw) -> LLMEngine:
    # a 48-token step: prompts past it are computed in chunks
    kw = {"max_batch_total_tokens": 2048, **kw}
    return LLMEngine(
        EngineConfig(model=str(path), dtype=dtype, max_batch_prefill_tokens=48, block_size=4, **kw)
    )


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 30000) for _ in range(rng.randint(1, 160))] for _ in range(n)]


def run(eng: LLMEngine, batch: list[list[int]], params: P.PoolParams = P.PoolParams()) -> list[bytes]:
    """Every prompt submitted at once; each answer's bytes, in order."""
    for i, ids in enumerate(batch):
        eng.add_pool_request(f"r{i}", ids, params)
    got: dict[str, bytes] = {}
    while eng.has_unfinished():
        for u in eng.step():
            assert isinstance(u, P.PoolOut), u
            got[u.request_id] = u.data
    return [got[f"r{i}"] for i in range(len(batch))]


def vec(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.float32)


def test_embedder_equals_transformers_in_chunks(tmp_path, minilm):
    ref = qwen3_embedder(tmp_path, minilm)
    eng = engine(tmp_path)
    info = eng.info
    assert info.task == "embed" and info.pooling is not None
    assert (info.pooling.method, info.pooling.normalize, info.pooling.dimensions) == ("last", True, 32)
    batch = prompts(8)
    together = run(eng, batch)
    for ids, got in zip(batch, together):
        with torch.no_grad():
            want = torch.nn.functional.normalize(ref(torch.tensor([ids])).last_hidden_state[0, -1], dim=-1)
        np.testing.assert_allclose(vec(got), want.numpy(), atol=2e-6)
    short = vec(run(eng, [batch[0]], P.PoolParams(dimensions=8, normalize=True))[0])
    assert short.shape == (8,) and abs(np.linalg.norm(short) - 1) < 1e-6
    raw = vec(run(eng, [batch[0]], P.PoolParams(normalize=False))[0])
    with torch.no_grad():
        state = ref(torch.tensor([batch[0]])).last_hidden_state[0, -1].numpy()
    np.testing.assert_allclose(raw, state, atol=2e-5)
    long = max(batch, key=len)  # every token's state (/embed_all), kept over its chunks
    states = vec(run(eng, [long], P.PoolParams(tokens=True))[0]).reshape(len(long), 32)
    with torch.no_grad():
        want = ref(torch.tensor([long])).last_hidden_state[0].numpy()
    np.testing.assert_allclose(states, want, atol=2e-5)
    assert not eng.runner.pool_head.partial


@pytest.mark.parametrize("pooling", ["lasttoken", "mean_tokens"])
def test_batched_equals_alone_bit_for_bit(tmp_path, minilm, pooling):
    """On the default path (bfloat16, pytgi's batch-invariant kernels): every row's arithmetic is the
    same whatever the step, so a prompt's vector is the same bits in chunks next to others as alone
    (mean pooling: one reduction over the prompt's rows at its last chunk, whatever its chunks were).
    (In float32 the linears are PyTorch's GEMMs, whose rows change with the step's size: within 1e-6.)"""
    qwen3_embedder(tmp_path, minilm, pooling=pooling)
    batch = prompts(8)
    eng = engine(tmp_path, "bfloat16")
    assert run(eng, batch) == [run(eng, [ids])[0] for ids in batch]
    if pooling == "mean_tokens":
        return
    eng = engine(tmp_path)
    for a, b in zip(run(eng, batch), [run(eng, [ids])[0] for ids in batch]):
        np.testing.assert_allclose(vec(a), vec(b), atol=1e-6)


@pytest.mark.parametrize("pooling", ["lasttoken", "mean_tokens", "cls_token"])
def test_embedder_equals_sentence_transformers(tmp_path, minilm, pooling):
    """Every pooling sentence-transformers has for a causal LM: the last token's state, or the mean or
    first of every token's, kept chunk by chunk (the 20-times sentence spans several 48-token chunks)."""
    from sentence_transformers import SentenceTransformer

    qwen3_embedder(tmp_path, minilm, pooling=pooling)
    st = SentenceTransformer(str(tmp_path), device="cpu")
    tok = Tokenizer.from_dir(tmp_path)
    texts = [*SENTENCES, "The quick brown fox jumps over the lazy dog. " * 20]
    got = np.stack([vec(v) for v in run(engine(tmp_path), [tok.encode(t) for t in texts])])
    want = np.stack([st.encode(t) for t in texts])  # one at a time: no padding
    cos = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cos.min() >= 0.99999
    ranks = lambda m: np.argsort(-(m @ m.T), axis=1)[:, :5]
    assert (ranks(got) == ranks(want)).all()


@pytest.mark.parametrize("labels", [1, 3])
def test_sequence_classifier_equals_transformers(tmp_path, minilm, labels):
    ref = qwen3_classifier(tmp_path, minilm, labels)
    eng = engine(tmp_path)
    assert eng.info.task == "classify" and eng.info.pooling is not None
    assert len(eng.info.pooling.labels) == labels
    batch = prompts(5, seed=labels)
    got = run(eng, batch)
    for ids, data in zip(batch, got):
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0]
        np.testing.assert_allclose(vec(data), want.numpy(), atol=2e-5)


def test_a_causal_lm_scores_by_two_tokens(tmp_path, minilm):
    ref = qwen3_causal(tmp_path, minilm)
    eng = engine(tmp_path, task="classify", classifier_tokens=("no", "yes"))
    tok = Tokenizer.from_dir(tmp_path)
    no, yes = (tok.encode(w, add_special_tokens=False)[0] for w in ("no", "yes"))
    assert eng.info.pooling is not None
    assert eng.info.pooling.labels == ("yes",) and eng.info.pooling.label_token_ids == (no, yes)
    batch = prompts(4, seed=7)
    got = run(eng, batch)
    for ids, data in zip(batch, got):
        with torch.no_grad():
            logits = ref(torch.tensor([ids])).logits[0, -1]
        np.testing.assert_allclose(vec(data), [(logits[yes] - logits[no]).item()], atol=2e-5)
        p_yes = torch.softmax(logits[[no, yes]], 0)[1].item()
        assert abs(1 / (1 + np.exp(-vec(data)[0])) - p_yes) < 1e-5  # its sigmoid: P(yes) of the two


def test_a_pooling_models_sizes_are_its_prompts_in_flight(tmp_path, minilm):
    """Its longest input is its sentence-transformers max_seq_length (400 here); its KV cache holds
    that and four steps' chunks (not a generator's share of memory)."""
    qwen3_embedder(tmp_path, minilm)
    info = engine(tmp_path, max_batch_total_tokens=None).info
    assert (info.max_input_tokens, info.max_total_tokens) == (400, 401)
    assert info.max_batch_total_tokens == (401 + 4 * 48) // 4 * 4
    assert not info.enable_prefix_caching


def test_what_a_pooling_causal_lm_refuses(tmp_path, minilm):
    qwen3_causal(tmp_path / "lm", minilm)
    with pytest.raises(ConfigError, match="--classifier-tokens"):
        engine(tmp_path / "lm", task="classify")
    with pytest.raises(ConfigError, match="not one"):
        engine(tmp_path / "lm", task="classify", classifier_tokens=("no", "yes please"))
    with pytest.raises(ConfigError, match="--num-shard"):
        engine(tmp_path / "lm", task="embed", num_shard=2)
    generator = engine(tmp_path / "lm")  # no sentence-transformers files: it generates
    assert generator.info.task == "generate"
    with pytest.raises(InvalidRequest, match="computes no embeddings"):
        generator.add_pool_request("a", [5, 6], P.PoolParams())
    qwen3_embedder(tmp_path / "emb", minilm)
    eng = engine(tmp_path / "emb")
    with pytest.raises(InvalidRequest, match="does not generate"):
        eng.add_request("a", [5, 6], SamplingParams(max_new_tokens=2))
    for params, words in [
        (P.PoolParams(dimensions=33), "dimensions"),
    ]:
        with pytest.raises(InvalidRequest, match=words):
            eng.add_pool_request("b", [5, 6], params)
    with pytest.raises(InvalidRequest, match="more than"):
        eng.add_pool_request("c", [5] * (eng.info.max_input_tokens + 1), P.PoolParams())
    assert not eng.has_unfinished()
    cfg = json.loads((tmp_path / "emb/config.json").read_text())  # an embedder trained to attend both ways
    (tmp_path / "emb/config.json").write_text(json.dumps({**cfg, "is_causal": False}))
    with pytest.raises(UnsupportedModel, match="is_causal false"):
        engine(tmp_path / "emb")


def test_a_bare_decoder_model_embeds_by_its_last_token(tmp_path, minilm):
    """e5-mistral's layout: `MistralModel` (here Qwen3Model) with no sentence-transformers files: its
    last token's state, normalized (vLLM's default for a causal LM)."""
    ref = qwen3_embedder(tmp_path, minilm)
    for name in ("modules.json", "sentence_bert_config.json"):
        (tmp_path / name).unlink()
    import json

    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3Model"]}))
    eng = engine(tmp_path)
    assert eng.info.task == "embed"
    ids = prompts(1)[0]
    with torch.no_grad():
        want = torch.nn.functional.normalize(ref(torch.tensor([ids])).last_hidden_state[0, -1], dim=-1)
    np.testing.assert_allclose(vec(run(eng, [ids])[0]), want.numpy(), atol=2e-6)


def test_the_offline_llm_embeds_and_scores(tmp_path, minilm):
    """vLLM's offline API on pooling models: `LLM.embed` on the Qwen3 embedder and on
    all-MiniLM-L6-v2 (an encoder: PoolingEngine) against sentence-transformers, `LLM.score` on the
    yes/no reranker against transformers, and `generate` refused on both."""
    from sentence_transformers import SentenceTransformer

    from pytgi import LLM

    qwen3_embedder(tmp_path / "emb", minilm)
    for path in (tmp_path / "emb", minilm):
        st = SentenceTransformer(str(path), device="cpu")
        llm = LLM(str(path), dtype="float32")
        got = np.array([o.outputs.embedding for o in llm.embed(SENTENCES[:4])])
        want = np.stack([st.encode(s) for s in SENTENCES[:4]])
        np.testing.assert_allclose(got, want, atol=2e-5)
        assert len(llm.embed(SENTENCES[0], dimensions=8)[0].outputs.embedding) == 8
        cos = llm.score(SENTENCES[0], SENTENCES[1:3])
        np.testing.assert_allclose([c.outputs.score for c in cos], want[1:3] @ want[0], atol=2e-5)
        with pytest.raises(InvalidRequest, match="does not generate"):
            llm.generate("hi")
    ref = qwen3_causal(tmp_path / "rr", minilm)
    llm = LLM(str(tmp_path / "rr"), dtype="float32", task="classify", classifier_tokens=("no", "yes"))
    tok = Tokenizer.from_dir(tmp_path / "rr")
    no, yes = (tok.encode(w, add_special_tokens=False)[0] for w in ("no", "yes"))
    scores = llm.score("a question", ["an answer", "another one"])
    for doc, s in zip(["an answer", "another one"], scores):
        ids = tok.encode_pair("a question", doc)[0]
        assert s.prompt_token_ids == ids
        with torch.no_grad():
            logits = ref(torch.tensor([ids])).logits[0, -1]
        assert abs(s.outputs.score - torch.softmax(logits[[no, yes]], 0)[1].item()) < 1e-5
    with pytest.raises(InvalidRequest, match="give one text_1"):
        llm.score(["a", "b"], ["c", "d", "e"])


def test_a_gguf_causal_lm_embeds_with_task_embed(tmp_path):
    """`--task embed` on a GGUF file (Qwen3-Embedding is published as GGUF too): its last token's
    state, normalized, as transformers computes it from the same file."""
    import transformers

    from pytgi import LLM
    from tests.tiny_repos import gguf_model

    path = gguf_model(tmp_path / "tiny-F16.gguf")[0]
    llm = LLM(str(path), dtype="float32", task="embed")
    assert llm.engine.info.task == "embed"
    ids = llm.encode("The quick brown fox")
    got = np.array(llm.embed(ids)[0].outputs.embedding)
    ref = transformers.AutoModel.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.nn.functional.normalize(ref(torch.tensor([ids])).last_hidden_state[0, -1], dim=-1)
    np.testing.assert_allclose(got, want.numpy(), atol=1e-5)
