"""Causal LMs as pooling models end to end: a tiny random Qwen3 embedder (Qwen3-Embedding's layout)
and a Qwen3 causal LM served as a reranker by its "no"/"yes" logits (`--task classify
--classifier-tokens no,yes`, Qwen3-Reranker's way), served by `pytgi serve` on the paged engine and
asked through the `openai` SDK, huggingface_hub's InferenceClient and TEI's and vLLM's routes; every
answer against sentence-transformers or transformers in this process."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import torch
import transformers
from huggingface_hub import InferenceClient

from tests.decoder_pooling import qwen3_causal, qwen3_embedder
from tests.e2e.server import Server
from tests.minilm import DOCS, QUERY, SENTENCES, minilm_dir

pytestmark = pytest.mark.slow
LONG = "The quick brown fox jumps over the lazy dog. " * 30  # 300 tokens: chunked at 128 a step


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    return minilm_dir(tmp_path_factory.mktemp("minilm"))


def serve(make, minilm, factory, name: str, *flags: str):
    """`make`'s tiny model saved under `name`, served in float32 with `flags`."""
    path = factory.mktemp(name)
    make(path, minilm)
    log = factory.mktemp("logs") / f"{name}.log"
    srv = Server("--model-id", str(path), "--dtype", "float32", *flags, log=log).wait_ready()
    return srv, path


@pytest.fixture(scope="module")
def embedder(minilm, tmp_path_factory):
    srv, path = serve(
        qwen3_embedder, minilm, tmp_path_factory, "qwen3-embedding", "--max-batch-prefill-tokens", "128"
    )
    yield srv, path
    srv.stop()


@pytest.fixture(scope="module")
def reranker(minilm, tmp_path_factory):
    flags = ("--task", "classify", "--classifier-tokens", "no,yes")
    srv, path = serve(qwen3_causal, minilm, tmp_path_factory, "qwen3-reranker", *flags)
    yield srv, path
    srv.stop()


def test_openai_sdk_and_inference_client_equal_sentence_transformers(embedder):
    from sentence_transformers import SentenceTransformer

    srv, path = embedder
    st = SentenceTransformer(str(path), device="cpu")
    texts = [*SENTENCES, LONG]
    want = np.stack([st.encode(t) for t in texts])
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none")
    got = client.embeddings.create(model="qwen3-embedding", input=texts)
    vectors = np.array([d.embedding for d in got.data])
    cos = (vectors * want).sum(-1) / np.linalg.norm(vectors, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cos.min() >= 0.99999
    assert got.usage.prompt_tokens == sum(len(st.tokenize([t])["input_ids"][0]) for t in texts)
    short = client.embeddings.create(model="m", input=SENTENCES[0], dimensions=16).data[0].embedding
    assert len(short) == 16 and abs(np.linalg.norm(short) - 1) < 1e-6
    hub = InferenceClient(base_url=srv.url)
    np.testing.assert_allclose(hub.feature_extraction(SENTENCES[0])[0], want[0], atol=1e-5)
    sims = hub.sentence_similarity(SENTENCES[0], other_sentences=SENTENCES[1:3])
    np.testing.assert_allclose(sims, want[1:3] @ want[0], atol=1e-5)


def test_concurrent_requests_equal_alone(embedder):
    """16 clients at once, long prompts chunked beside short ones: float32 GEMMs' rows follow the
    step's size, so within 1e-6 (bit for bit on the default bfloat16 path: tests/model)."""
    srv, _ = embedder

    def embed(text: str) -> list[float]:
        r = httpx.post(f"{srv.url}/embed", json={"inputs": text}, timeout=60)
        return r.json()[0]

    texts = [f"{s} ({i})" + (LONG if i % 5 == 0 else "") for i, s in enumerate(SENTENCES * 3)]
    alone = [embed(t) for t in texts]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(embed, texts))
    np.testing.assert_allclose(np.array(together), np.array(alone), atol=1e-6)
    states = httpx.post(f"{srv.url}/embed_all", json={"inputs": texts[0]}, timeout=60).json()[0]
    tokens = httpx.post(f"{srv.url}/tokenize", json={"inputs": texts[0]}, timeout=60).json()[0]
    assert len(states) == len(tokens) and len(states[0]) == 32  # every token's state, over its chunks


@pytest.mark.parametrize(
    "path,body,status,words",
    [
        ("/embed", {"inputs": "x", "dimensions": 33}, 422, "dimensions must be in 1..32"),
        ("/generate", {"inputs": "hello"}, 422, "is an embedding model"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400, "embedding model"),
        ("/embed", {"inputs": [[1, 99999]]}, 422, "< 30522"),
    ],
)
def test_what_an_embedder_refuses(embedder, path, body, status, words):
    srv, _ = embedder
    r = httpx.post(f"{srv.url}{path}", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert words in r.text
    assert httpx.post(f"{srv.url}/embed", json={"inputs": "still here"}, timeout=60).status_code == 200


def reference_scores(path, pairs: list[tuple[str, str]]) -> list[float]:
    """Qwen3-Reranker's score by transformers: P("yes") of the two at the pair's last token."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.Qwen3ForCausalLM.from_pretrained(path).eval()
    no, yes = (tok.convert_tokens_to_ids(t) for t in ("no", "yes"))
    out = []
    for a, b in pairs:
        ids = tok(a, b, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            logits = model(ids).logits[0, -1]
        out.append(torch.softmax(logits[[no, yes]], 0)[1].item())
    return out


def test_a_causal_lm_reranks_by_its_yes_and_no_logits(reranker):
    srv, path = reranker
    want = reference_scores(path, [(QUERY, d) for d in DOCS])
    tei = httpx.post(f"{srv.url}/rerank", json={"query": QUERY, "texts": DOCS}, timeout=60).json()
    assert [r["index"] for r in tei] == list(np.argsort(want)[::-1])
    for r in tei:
        assert abs(r["score"] - want[r["index"]]) < 1e-5
    v1 = httpx.post(
        f"{srv.url}/v1/rerank", json={"model": "m", "query": QUERY, "documents": DOCS, "top_n": 1}, timeout=60
    ).json()
    assert [r["index"] for r in v1["results"]] == [tei[0]["index"]]
    score = httpx.post(f"{srv.url}/v1/score", json={"text_1": QUERY, "text_2": DOCS}, timeout=60).json()
    np.testing.assert_allclose([d["score"] for d in score["data"]], want, atol=1e-5)
    info = httpx.get(f"{srv.url}/info", timeout=60).json()
    assert info["model_pipeline_tag"] == "text-classification"
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi"}, timeout=60)
    assert r.status_code == 400 and "generates no text" in r.text
