"""Cross-encoders end to end: a tiny random BERT reranker (one label) and a three-label classifier
with all-MiniLM-L6-v2's tokenizer, served by `pytgi serve`, asked on TEI's /rerank and /predict and
vLLM's /v1/rerank and /v1/score; every score against sentence-transformers' CrossEncoder (or
transformers' own model) in this process. An embedding model reranks by cosine."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
import transformers

from tests.e2e.server import Server
from tests.minilm import DOCS, QUERY, minilm_dir

pytestmark = pytest.mark.slow


def cross_encoder(path, minilm, labels: int):
    torch.manual_seed(labels)
    cfg = transformers.BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    cfg.num_labels = labels
    if labels > 1:
        cfg.id2label = {0: "negative", 1: "neutral", 2: "positive"}
        cfg.label2id = {v: k for k, v in cfg.id2label.items()}
    transformers.BertForSequenceClassification(cfg).eval().save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        if (minilm / name).is_file():
            shutil.copy(minilm / name, path / name)
    return path


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    return minilm_dir(tmp_path_factory.mktemp("minilm"))


@pytest.fixture(scope="module")
def reranker(minilm, tmp_path_factory):
    path = cross_encoder(tmp_path_factory.mktemp("reranker"), minilm, 1)
    srv = Server("--model-id", str(path), log=tmp_path_factory.mktemp("logs") / "rerank.log").wait_ready()
    yield srv, path
    srv.stop()


@pytest.fixture(scope="module")
def classifier(minilm, tmp_path_factory):
    path = cross_encoder(tmp_path_factory.mktemp("classifier"), minilm, 3)
    srv = Server("--model-id", str(path), log=tmp_path_factory.mktemp("logs") / "classify.log").wait_ready()
    yield srv, path
    srv.stop()


def st_scores(path, pairs) -> list[float]:
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(path), device="cpu").predict(pairs).tolist()


def test_rerank_routes_equal_sentence_transformers_cross_encoder(reranker):
    srv, path = reranker
    want = st_scores(path, [(QUERY, d) for d in DOCS])  # a sigmoid over the one logit
    tei = httpx.post(f"{srv.url}/rerank", json={"query": QUERY, "texts": DOCS, "return_text": True}).json()
    assert [r["index"] for r in tei] == list(np.argsort(want)[::-1])
    for r in tei:
        assert abs(r["score"] - want[r["index"]]) < 1e-5 and r["text"] == DOCS[r["index"]]
    v1 = httpx.post(
        f"{srv.url}/v1/rerank", json={"model": "m", "query": QUERY, "documents": DOCS, "top_n": 2}
    )
    body = v1.json()
    assert [r["index"] for r in body["results"]] == [r["index"] for r in tei[:2]]
    assert body["results"][0]["document"] == {"text": DOCS[tei[0]["index"]]}
    assert body["usage"]["total_tokens"] > 0 and body["model"] == "m"
    vllm = httpx.post(f"{srv.url}/rerank", json={"query": QUERY, "documents": DOCS}).json()  # vLLM's body
    assert [r["index"] for r in vllm["results"]] == [r["index"] for r in tei]
    raw = httpx.post(f"{srv.url}/rerank", json={"query": QUERY, "texts": DOCS, "raw_scores": True}).json()
    for r in raw:
        assert abs(1 / (1 + np.exp(-r["score"])) - want[r["index"]]) < 1e-5


def test_score_route_one_to_many_and_pairwise(reranker):
    srv, path = reranker
    one = httpx.post(f"{srv.url}/v1/score", json={"text_1": QUERY, "text_2": DOCS}).json()
    np.testing.assert_allclose(
        [d["score"] for d in one["data"]], st_scores(path, [(QUERY, d) for d in DOCS]), atol=1e-5
    )
    assert [d["index"] for d in one["data"]] == [0, 1, 2, 3] and one["object"] == "list"
    firsts = ["a cat", "a dog"]
    pairwise = httpx.post(f"{srv.url}/score", json={"text_1": firsts, "text_2": DOCS[:2]}).json()
    np.testing.assert_allclose(
        [d["score"] for d in pairwise["data"]], st_scores(path, list(zip(firsts, DOCS[:2]))), atol=1e-5
    )
    bad = httpx.post(f"{srv.url}/v1/score", json={"text_1": firsts, "text_2": DOCS})
    assert bad.status_code == 400 and "give one text_1" in bad.text


def test_concurrent_reranks_equal_alone(reranker):
    srv, _ = reranker

    def rerank(i: int) -> list:
        return httpx.post(
            f"{srv.url}/rerank", json={"query": f"{QUERY} {i}", "texts": DOCS}, timeout=60
        ).json()

    alone = [rerank(i) for i in range(12)]
    with ThreadPoolExecutor(12) as pool:
        assert list(pool.map(rerank, range(12))) == alone


def test_long_pairs_are_refused_unless_truncated(reranker):
    srv, path = reranker
    long = "word " * 600
    r = httpx.post(f"{srv.url}/rerank", json={"query": QUERY, "texts": [long]})
    assert r.status_code == 422 and "more than the 512" in r.text
    r = httpx.post(f"{srv.url}/rerank", json={"query": QUERY, "texts": [long], "truncate": True})
    assert r.status_code == 200
    assert abs(r.json()[0]["score"] - st_scores(path, [(QUERY, long)])[0]) < 1e-5  # cut as transformers cuts


def test_predict_labels(classifier):
    srv, path = classifier
    model = transformers.BertForSequenceClassification.from_pretrained(path).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)

    def probs(*texts: str) -> dict[str, float]:
        with torch.no_grad():
            p = model(**tok(*texts, return_tensors="pt")).logits[0].softmax(-1).tolist()
        return dict(zip(["negative", "neutral", "positive"], p, strict=True))

    one = httpx.post(f"{srv.url}/predict", json={"inputs": "I like you"}).json()
    assert [d["score"] for d in one] == sorted((d["score"] for d in one), reverse=True)
    want = probs("I like you")
    for d in one:
        assert abs(d["score"] - want[d["label"]]) < 1e-5
    pair = httpx.post(f"{srv.url}/predict", json={"inputs": ["I like you", "I love you"]}).json()
    want = probs("I like you", "I love you")
    for d in pair:
        assert abs(d["score"] - want[d["label"]]) < 1e-5
    batch = httpx.post(f"{srv.url}/", json={"inputs": ["I like you", "a", "b"]}).json()  # TEI's POST /
    assert len(batch) == 3 and {d["label"] for d in batch[0]} == {"negative", "neutral", "positive"}
    info = httpx.get(f"{srv.url}/info").json()
    assert info["model_pipeline_tag"] == "text-classification"
    assert info["model_type"]["classifier"]["id2label"] == {"0": "negative", "1": "neutral", "2": "positive"}
    refused = httpx.post(f"{srv.url}/rerank", json={"query": "q", "texts": ["a"]})
    assert refused.status_code == 422 and "not a reranker" in refused.text


@pytest.mark.parametrize(
    "path,body,status,words",
    [
        ("/embed", {"inputs": "x"}, 422, "is a cross-encoder"),
        ("/v1/embeddings", {"input": "x"}, 400, "computes no embeddings"),
        ("/generate", {"inputs": "x"}, 422, "generates no text"),
        ("/rerank", {"query": "q", "texts": []}, 422, "nothing to score"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, 400, "top_n must be >= 1"),
        ("/predict", {"inputs": [["a", "b", "c"]]}, 422, "a pair is two texts"),
    ],
)
def test_bad_requests_on_a_cross_encoder(reranker, path, body, status, words):
    srv, _ = reranker
    r = httpx.post(f"{srv.url}{path}", json=body)
    assert r.status_code == status, r.text
    assert words in r.text


def test_an_embedding_model_reranks_by_cosine(minilm, tmp_path_factory):
    from sentence_transformers import SentenceTransformer

    srv = Server("--model-id", str(minilm), log=tmp_path_factory.mktemp("logs") / "embed.log").wait_ready()
    try:
        st = SentenceTransformer(str(minilm), device="cpu")
        want = st.similarity(st.encode([QUERY]), st.encode(DOCS))[0].tolist()
        got = httpx.post(f"{srv.url}/v1/score", json={"text_1": QUERY, "text_2": DOCS}).json()
        np.testing.assert_allclose([d["score"] for d in got["data"]], want, atol=1e-5)
        ranked = httpx.post(f"{srv.url}/rerank", json={"query": QUERY, "texts": DOCS}).json()
        assert [r["index"] for r in ranked] == list(np.argsort(want)[::-1])
        r = httpx.post(f"{srv.url}/predict", json={"inputs": "x"})
        assert r.status_code == 422 and "computes no labels" in r.text
    finally:
        srv.stop()


def test_a_cross_encoder_saved_with_no_activation_scores_by_its_logit(minilm, tmp_path_factory):
    """sentence-transformers' CrossEncoder saved with activation_fn Identity (its config.json's
    `sentence_transformers` entry): its scores are the logits, as `predict` gives them."""
    path = cross_encoder(tmp_path_factory.mktemp("identity"), minilm, 1)
    cfg = json.loads((path / "config.json").read_text())
    cfg["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity", "version": "5.0.0"}
    (path / "config.json").write_text(json.dumps(cfg))
    srv = Server("--model-id", str(path), log=tmp_path_factory.mktemp("logs") / "identity.log").wait_ready()
    try:
        want = st_scores(path, [(QUERY, d) for d in DOCS])
        assert min(want) < 0 or max(want) > 1  # logits, not probabilities
        got = httpx.post(f"{srv.url}/v1/score", json={"text_1": QUERY, "text_2": DOCS}).json()
        np.testing.assert_allclose([d["score"] for d in got["data"]], want, atol=1e-5)
        label = httpx.post(f"{srv.url}/predict", json={"inputs": [QUERY, DOCS[0]]}).json()
        assert abs(label[0]["score"] - want[0]) < 1e-5
    finally:
        srv.stop()
