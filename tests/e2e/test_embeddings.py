"""An embedding model end to end: the real all-MiniLM-L6-v2 served by `pytgi serve`, asked through
the `openai` SDK, huggingface_hub's `InferenceClient`, an OpenAI-compatible client as LangChain's and
LlamaIndex's send it, and TEI's routes over HTTP; every vector against sentence-transformers in this
process. Generation routes on it, and embedding routes on a generator, are clear refusals."""

from __future__ import annotations

import base64
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from huggingface_hub import InferenceClient

from tests.e2e.server import Server
from tests.minilm import LONG, SENTENCES, minilm_dir

pytestmark = pytest.mark.slow


PROMPTS = {"query": "query: ", "passage": "passage: "}


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    path = minilm_dir(tmp_path_factory.mktemp("minilm"))
    config = path / "config_sentence_transformers.json"  # prompts, as e5's and bge's models name theirs
    config.write_text(json.dumps({**json.loads(config.read_text()), "prompts": PROMPTS}))
    return path


@pytest.fixture(scope="module")
def served(minilm, tmp_path_factory):
    srv = Server("--model-id", str(minilm), log=tmp_path_factory.mktemp("logs") / "server.log").wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def st(minilm):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm), device="cpu")


def cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_openai_sdk_embeddings_equal_sentence_transformers(served, st):
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none")
    want = st.encode(SENTENCES)
    got = client.embeddings.create(model="all-MiniLM-L6-v2", input=SENTENCES)  # the SDK asks for base64
    assert [d.index for d in got.data] == list(range(len(SENTENCES)))
    vectors = np.array([d.embedding for d in got.data])
    assert cosines(vectors, want).min() >= 0.99999
    assert (
        got.usage.prompt_tokens
        == got.usage.total_tokens
        == sum(len(st.tokenize([s])["input_ids"][0]) for s in SENTENCES)
    )
    floats = client.embeddings.create(model="m", input=SENTENCES[0], encoding_format="float")
    assert floats.data[0].embedding == vectors[0].tolist()  # the same float32 values either way
    short = client.embeddings.create(model="m", input=SENTENCES[0], dimensions=128)
    v = np.array(short.data[0].embedding)
    assert v.shape == (128,) and abs(np.linalg.norm(v) - 1) < 1e-6
    assert cosines(v, want[0][:128]) >= 0.99999  # Matryoshka: the first 128, normalized again


def test_token_ids_and_truncation(served, st):
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none")
    ids = st.tokenize([SENTENCES[1]])["input_ids"][0].tolist()
    by_ids = client.embeddings.create(model="m", input=[ids], encoding_format="float").data[0].embedding
    by_text = (
        client.embeddings.create(model="m", input=SENTENCES[1], encoding_format="float").data[0].embedding
    )
    assert by_ids == by_text
    with pytest.raises(openai.BadRequestError, match="402 tokens, more than the 256"):
        client.embeddings.create(model="m", input=LONG)
    r = httpx.post(f"{served.url}/embed", json={"inputs": LONG, "truncate": True}, timeout=60)
    assert r.status_code == 200
    assert cosines(r.json()[0], st.encode(LONG)) >= 0.99999  # cut where sentence-transformers cuts


def test_prompt_names_put_the_models_prompt_first(served, st):
    got = httpx.post(
        f"{served.url}/embed", json={"inputs": SENTENCES[:2], "prompt_name": "query"}, timeout=60
    )
    assert cosines(got.json(), st.encode(SENTENCES[:2], prompt_name="query")).min() >= 0.99999
    assert got.headers["x-total-tokens"] == str(
        sum(len(st.tokenize(["query: " + s])["input_ids"][0]) for s in SENTENCES[:2])
    )
    plain = httpx.post(f"{served.url}/embed", json={"inputs": SENTENCES[0]}, timeout=60).json()
    assert cosines(plain[0], got.json()[0]) < 0.999  # the prompt changes the vector


def test_huggingface_hub_inference_client(served, st):
    client = InferenceClient(served.url)
    got = client.feature_extraction(SENTENCES[0])
    assert got.shape == (1, 384)
    assert cosines(got[0], st.encode(SENTENCES[0])) >= 0.99999
    scores = client.sentence_similarity(SENTENCES[0], other_sentences=SENTENCES[1:4])
    want = st.similarity(st.encode(SENTENCES[:1]), st.encode(SENTENCES[1:4]))[0].tolist()
    np.testing.assert_allclose(scores, want, atol=1e-5)


def test_an_openai_compatible_client_as_langchain_sends_it(served, st):
    """LangChain's OpenAIEmbeddings (check_embedding_ctx_length=False) and LlamaIndex's OpenAILike
    post lists of strings with a model name and read `data[i].embedding` by index."""
    texts = [f"document number {i}: {SENTENCES[i % len(SENTENCES)]}" for i in range(100)]
    r = httpx.post(
        f"{served.url}/v1/embeddings",
        json={"input": texts, "model": "text-embedding-ada-002", "encoding_format": "float"},
        headers={"Authorization": "Bearer sk-anything"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "text-embedding-ada-002"
    vectors = [d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])]
    assert cosines(vectors, st.encode(texts)).min() >= 0.99999


def test_batched_vectors_equal_alone(served):
    """Sent at once from 16 clients, each vector is the same bits as sent alone."""

    def embed(text: str) -> str:
        r = httpx.post(
            f"{served.url}/v1/embeddings", json={"input": text, "encoding_format": "base64"}, timeout=60
        )
        return r.json()["data"][0]["embedding"]

    texts = [f"{s} ({i})" for i, s in enumerate(SENTENCES * 4)]
    alone = [embed(t) for t in texts]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(embed, texts))
    assert together == alone
    assert len(base64.b64decode(alone[0])) == 384 * 4


def test_tei_routes(served, st):
    url = served.url
    raw = httpx.post(f"{url}/embed", json={"inputs": SENTENCES[:2], "normalize": False}, timeout=60).json()
    assert len(raw) == 2 and abs(np.linalg.norm(raw[0]) - 1) > 1e-3  # mean pooled, not normalized
    unit = httpx.post(f"{url}/embed", json={"inputs": SENTENCES[0], "dimensions": 64}, timeout=60)
    assert unit.headers["x-total-tokens"] == "8"
    assert len(unit.json()[0]) == 64 and abs(np.linalg.norm(unit.json()[0]) - 1) < 1e-6
    rows = httpx.post(f"{url}/embed_all", json={"inputs": SENTENCES[0]}, timeout=60).json()
    assert np.array(rows).shape == (1, 8, 384)
    np.testing.assert_allclose(np.array(rows[0]).mean(0), raw[0], atol=1e-5)
    root = httpx.post(url, json={"inputs": SENTENCES[0], "normalize": False}, timeout=60).json()
    assert root == [raw[0]]
    info = httpx.get(f"{url}/info").json()
    assert info["model_pipeline_tag"] == "feature-extraction"
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["max_input_length"] == 256 and info["max_client_batch_size"] == 2048


def test_tei_tokenize_and_decode(served, st):
    """TEI's shapes on an embedding model: a list of tokens per input (special tokens without a span,
    others with their UTF-8 byte span), and one text per list of ids."""
    url = served.url
    one = httpx.post(f"{url}/tokenize", json={"inputs": "Héllo world"}, timeout=60).json()
    assert [t["id"] for t in one[0]] == st.tokenize(["Héllo world"])["input_ids"][0].tolist()
    assert one[0][0] == {"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None}
    world = one[0][-2]
    assert world["text"] == "world" and (world["start"], world["stop"]) == (7, 12)  # é is two bytes
    many = httpx.post(
        f"{url}/tokenize", json={"inputs": ["a", "b c"], "add_special_tokens": False}, timeout=60
    ).json()
    assert [[t["text"] for t in toks] for toks in many] == [["a"], ["b", "c"]]
    prompted = httpx.post(f"{url}/tokenize", json={"inputs": "a", "prompt_name": "query"}, timeout=60).json()
    assert [t["text"] for t in prompted[0]] == ["[CLS]", "query", ":", "a", "[SEP]"]
    ids = [t["id"] for t in one[0]]
    assert httpx.post(f"{url}/decode", json={"ids": ids}, timeout=60).json() == ["hello world"]
    both = httpx.post(f"{url}/decode", json={"ids": [ids, ids], "skip_special_tokens": False}, timeout=60)
    assert both.json() == ["[CLS] hello world [SEP]"] * 2
    assert httpx.post(f"{url}/tokenize", json={"inputs": []}, timeout=60).status_code == 422
    assert httpx.post(f"{url}/decode", json={"ids": [99999]}, timeout=60).status_code == 422


@pytest.mark.parametrize(
    "path,body,status,words",
    [
        ("/embed", {"inputs": []}, 422, "cannot be empty"),
        ("/embed", {"inputs": "x", "dimensions": 385}, 422, "dimensions must be in 1..384"),
        ("/embed", {"inputs": "x", "truncation_direction": "up"}, 422, "right or left"),
        ("/embed", {"inputs": "x", "prompt_name": "title"}, 422, "prompts are query, passage"),
        ("/embed", {"inputs": [[1, 99999]]}, 422, "< 30522"),
        ("/embed", {"inputs": 5}, 422, "inputs"),
        ("/v1/embeddings", {"input": [[]]}, 400, "cannot be empty"),
        ("/v1/embeddings", {"input": "x", "encoding_format": "hex"}, 400, "encoding_format"),
        ("/generate", {"inputs": "hello"}, 422, "is an embedding model"),
        ("/", {"inputs": {"source_sentence": "a"}}, 422, "sentences"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}]},
            400,
            "is an embedding model",
        ),
        ("/v1/completions", {"prompt": "hi"}, 400, "is an embedding model"),
    ],
)
def test_bad_requests_are_refused_and_the_server_goes_on(served, path, body, status, words):
    r = httpx.post(f"{served.url}{path}", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert words in r.text
    assert httpx.post(f"{served.url}/embed", json={"inputs": "still here"}, timeout=60).status_code == 200


def test_a_generator_refuses_embedding_routes(server):
    r = httpx.post(f"{server.url}/v1/embeddings", json={"input": "hello"}, timeout=60)
    assert r.status_code == 400 and "computes no embeddings" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/embed", json={"inputs": "hello"}, timeout=60)
    assert r.status_code == 422 and "computes no embeddings" in r.json()["error"]


def test_an_embedding_model_by_its_hub_id_keeps_its_pooling(minilm, st, tmp_path):
    """From a loopback stand-in for the Hub: the sentence-transformers files come too (1_Pooling's
    folder included), so the vectors are normalized mean-pooled ones, as sentence-transformers makes."""
    from tests.e2e.test_hub import hub_env
    from tests.fake_hub import FakeHub, Repo

    files = {str(p.relative_to(minilm)): p for p in minilm.rglob("*") if p.is_file()}
    repo = "sentence-transformers/all-MiniLM-L6-v2"
    with FakeHub({repo: Repo(files)}) as hub:
        srv = Server("--model-id", repo, env=hub_env(hub.url, tmp_path / "hf"), log=tmp_path / "hub.log")
        try:
            srv.wait_ready()
            body = {"input": SENTENCES[0], "encoding_format": "float"}  # normalized as the model says
            got = httpx.post(f"{srv.url}/v1/embeddings", json=body, timeout=60).json()["data"][0]["embedding"]
            assert cosines(got, st.encode(SENTENCES[0])) >= 0.99999
            assert abs(np.linalg.norm(got) - 1) < 1e-5  # the model's Normalize module, from the Hub
            assert httpx.get(f"{srv.url}/info").json()["max_input_length"] == 256  # its max_seq_length
        finally:
            srv.stop()
