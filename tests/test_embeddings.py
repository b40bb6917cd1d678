"""memory.embeddings: the local ONNX model, the upstream client, the factory and helpers."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import struct
from pathlib import Path
from typing import Any

import httpx2
import numpy as np
import openai
import pytest

from devkit.upstream import UpstreamServer
from gateway.settings import Settings
from memory import tokens
from memory.embeddings import (
    EMBEDDING_DIM,
    Embedder,
    LocalEmbedder,
    Quantization,
    UpstreamEmbedder,
    centroid,
    make_embedder,
)
from memory.errors import ProviderError, SchemaMismatch
from memory.provider import Provider
from tests.inprocess import running_app

SENTENCES = [
    "The cat sits on the mat",
    "A cat is sitting on a rug",
    "Quarterly revenue grew 8%",
    "",
    "ok",
    "Postgres with pgvector stores the embeddings next to the text they were computed from, "
    "so a single query can filter by tenant and rank by similarity.",
    "word " * 400,  # longer than the 256-token window: truncated, not an error
]


@pytest.fixture(scope="module")
def local() -> LocalEmbedder:
    return LocalEmbedder()


def _norm(vector: list[float]) -> float:
    return math.sqrt(sum(x * x for x in vector))


# --- local model -----------------------------------------------------------------------------


async def test_local_vectors_are_384_wide_and_unit_length(local: LocalEmbedder) -> None:
    vectors = await local.embed(SENTENCES)
    assert len(vectors) == len(SENTENCES)
    for vector in vectors:
        assert len(vector) == EMBEDDING_DIM == local.dim
        assert all(isinstance(x, float) for x in vector)
        assert _norm(vector) == pytest.approx(1.0, abs=1e-5)


async def test_paraphrases_are_closer_than_unrelated_text(local: LocalEmbedder) -> None:
    cat, cat_paraphrase, revenue = await local.embed(SENTENCES[:3])
    # The vectors are unit length: cosine distance is 1 - dot.
    near = 1.0 - float(np.dot(cat, cat_paraphrase))
    far = 1.0 - float(np.dot(cat, revenue))
    assert near < 0.5 < far
    assert near < far - 0.3


@pytest.mark.parametrize("quantization", ["dynamic", "off"])
async def test_batching_and_sorting_do_not_change_vectors(quantization: Quantization) -> None:
    # Different batch sizes put each text next to different neighbours and paddings. Int8
    # products scale a run's activations together: there each text must run alone.
    local = LocalEmbedder(quantization=quantization)
    one_by_one = [(await local.embed([text]))[0] for text in SENTENCES]
    small_batches = await LocalEmbedder(batch_size=2, quantization=quantization).embed(SENTENCES)
    one_batch = await local.embed(SENTENCES)
    for a, b, c in zip(one_by_one, small_batches, one_batch, strict=True):
        assert np.allclose(a, b, atol=1e-4)
        assert np.allclose(a, c, atol=1e-4)


async def test_order_of_results_follows_input(local: LocalEmbedder) -> None:
    forward = await local.embed(SENTENCES)
    backward = await local.embed(SENTENCES[::-1])
    for a, b in zip(forward, backward[::-1], strict=True):
        assert np.allclose(a, b, atol=1e-4)


async def test_duplicates_get_identical_vectors(local: LocalEmbedder) -> None:
    a, b = await local.embed(["same text", "same text"])
    assert np.allclose(a, b, atol=1e-6)


async def test_empty_input_loads_nothing() -> None:
    never_loaded = LocalEmbedder(model_path="/nonexistent/model.onnx")
    assert await never_loaded.embed([]) == []


async def test_construction_does_no_io_and_load_errors_are_provider_errors(
    tmp_path: Path,
) -> None:
    missing = LocalEmbedder(model_path=tmp_path / "missing.onnx")
    with pytest.raises(ProviderError):
        await missing.embed(["hello"])

    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not a model")
    with pytest.raises(ProviderError):
        await LocalEmbedder(model_path=garbage).embed(["hello"])

    with pytest.raises(ProviderError):
        await LocalEmbedder(tokenizer_path=tmp_path / "missing.json").embed(["hello"])


async def test_model_of_another_width_is_a_schema_mismatch() -> None:
    with pytest.raises(SchemaMismatch, match="384"):
        await LocalEmbedder(dim=512).embed(["hello"])


async def test_a_bare_string_is_refused(local: LocalEmbedder) -> None:
    with pytest.raises(TypeError):
        await local.embed("hello")


async def test_concurrent_first_use_loads_once_and_agrees() -> None:
    fresh = LocalEmbedder()
    results = await asyncio.gather(*(fresh.embed(SENTENCES[:3]) for _ in range(4)))
    for other in results[1:]:
        assert np.allclose(results[0], other, atol=1e-6)


async def test_the_event_loop_keeps_running_during_inference(local: LocalEmbedder) -> None:
    await local.warmup()
    ticks = 0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    try:
        await local.embed(SENTENCES * 40)
    finally:
        done.set()
        await task
    assert ticks > 10


def test_local_embedder_satisfies_the_protocol(local: LocalEmbedder) -> None:
    embedder: Embedder = local
    assert embedder.dim == EMBEDDING_DIM
    assert embedder.name


# --- upstream --------------------------------------------------------------------------------


def _fake_vector(seed: int, dim: int = EMBEDDING_DIM) -> list[float]:
    return [float(seed)] + [0.0] * (dim - 1)


class FakeUpstream:
    """An OpenAI-style /embeddings endpoint that answers in reverse order."""

    def __init__(self, dim: int = EMBEDDING_DIM) -> None:
        self.dim = dim
        self.requests: list[httpx2.Request] = []

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append(request)
        body = json.loads(request.content)
        data = [
            {"object": "embedding", "index": i, "embedding": _fake_vector(int(text), self.dim)}
            for i, text in enumerate(body["input"])
        ]
        return httpx2.Response(200, json={"object": "list", "data": data[::-1]})


def _provider(handler: Any, *, api_key: str | None = "sk-test", retries: int = 0) -> Provider:
    client = httpx2.AsyncClient(transport=httpx2.MockTransport(handler))
    return Provider(
        base_url="http://upstream.test/v1/",
        api_key=api_key,
        max_retries=retries,
        http_client=client,
    )


def _upstream(handler: Any, *, dim: int = EMBEDDING_DIM) -> tuple[Provider, Embedder]:
    provider = _provider(handler)
    return provider, UpstreamEmbedder(provider, model="m", dim=dim)


async def test_upstream_orders_by_index_and_batches() -> None:
    fake = FakeUpstream()
    provider, embedder = _upstream(fake)
    async with contextlib.aclosing(provider):
        texts = [str(i) for i in range(300)]
        vectors = await embedder.embed(texts)
    assert [v[0] for v in vectors] == [float(i) for i in range(300)]
    assert [len(json.loads(r.content)["input"]) for r in fake.requests] == [256, 44]
    request = fake.requests[0]
    assert str(request.url) == "http://upstream.test/v1/embeddings"
    assert request.headers["authorization"] == "Bearer sk-test"
    assert json.loads(request.content)["model"] == "m"
    assert json.loads(request.content)["encoding_format"] == "base64"


async def test_upstream_reads_base64_vectors() -> None:
    """What OpenAI sends for `encoding_format: base64`: little-endian float32."""
    expected = [[float(i), -0.5, *[0.25] * (EMBEDDING_DIM - 2)] for i in range(3)]

    def handler(request: httpx2.Request) -> httpx2.Response:
        data = [
            {"index": i, "embedding": base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()}
            for i, v in enumerate(expected)
        ]
        return httpx2.Response(200, json={"data": data})

    provider, embedder = _upstream(handler)
    async with contextlib.aclosing(provider):
        assert await embedder.embed(["a", "b", "c"]) == expected


async def test_upstream_empty_input_sends_nothing() -> None:
    fake = FakeUpstream()
    provider, embedder = _upstream(fake)
    async with contextlib.aclosing(provider):
        assert await embedder.embed([]) == []
    assert fake.requests == []


async def test_upstream_sends_no_empty_strings() -> None:
    seen: list[list[str]] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        texts = json.loads(request.content)["input"]
        seen.append(texts)
        data = [{"index": i, "embedding": _fake_vector(0)} for i in range(len(texts))]
        return httpx2.Response(200, json={"data": data})

    provider, embedder = _upstream(handler)
    async with contextlib.aclosing(provider):
        await embedder.embed(["", "x"])
    assert seen == [[" ", "x"]]


async def test_upstream_http_error_is_a_provider_error() -> None:
    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(500, json={"error": {"message": "boom"}})

    provider, embedder = _upstream(handler)
    async with contextlib.aclosing(provider):
        with pytest.raises(ProviderError, match="500") as info:
            await embedder.embed(["a"])
    assert isinstance(info.value.__cause__, openai.APIStatusError)


async def test_upstream_transport_error_is_a_provider_error() -> None:
    def handler(request: httpx2.Request) -> httpx2.Response:
        raise httpx2.ConnectError("connection refused", request=request)

    provider, embedder = _upstream(handler)
    async with contextlib.aclosing(provider):
        with pytest.raises(ProviderError) as info:
            await embedder.embed(["a"])
    assert isinstance(info.value.__cause__, openai.APIConnectionError)


@pytest.mark.parametrize(
    "response",
    [
        httpx2.Response(200, text="<html>gateway timeout</html>"),
        httpx2.Response(200, json={"data": []}),
        httpx2.Response(200, json={"data": [{"index": 5, "embedding": _fake_vector(0)}]}),
        httpx2.Response(200, json={"data": [{"index": 0, "embedding": ["x"] * EMBEDDING_DIM}]}),
        httpx2.Response(200, json={"data": [{"index": 0, "embedding": "not base64!"}]}),
        httpx2.Response(200, json=[1, 2, 3]),
    ],
    ids=["not-json", "too-few", "bad-index", "non-numeric", "bad-base64", "not-an-object"],
)
async def test_upstream_malformed_reply_is_a_provider_error(response: httpx2.Response) -> None:
    provider, embedder = _upstream(lambda request: response)
    async with contextlib.aclosing(provider):
        with pytest.raises(ProviderError):
            await embedder.embed(["a"])


async def test_upstream_wrong_width_is_a_schema_mismatch() -> None:
    provider, embedder = _upstream(FakeUpstream(dim=1536))
    async with contextlib.aclosing(provider):
        with pytest.raises(SchemaMismatch, match="1536"):
            await embedder.embed(["1"])


async def test_upstream_can_ask_for_the_width() -> None:
    fake = FakeUpstream()
    provider = _provider(fake, api_key=None)
    embedder = UpstreamEmbedder(provider, model="m", dim=384, send_dimensions=True)
    await embedder.embed(["1"])
    await provider.aclose()
    assert json.loads(fake.requests[0].content)["dimensions"] == 384
    assert "authorization" not in fake.requests[0].headers


# --- factory ---------------------------------------------------------------------------------


async def test_make_embedder_local_is_lazy() -> None:
    embedder = make_embedder(provider="local", model_path="/nonexistent/model.onnx")
    assert isinstance(embedder, LocalEmbedder)
    assert embedder.dim == EMBEDDING_DIM


async def test_make_embedder_upstream_checks_width() -> None:
    provider = _provider(FakeUpstream())
    embedder = make_embedder(provider="upstream", upstream=provider, model="m")
    assert isinstance(embedder, UpstreamEmbedder)
    with pytest.raises(SchemaMismatch, match=r"vector\(384\)"):
        make_embedder(
            provider="upstream", upstream=provider, model="text-embedding-3-small", dim=1536
        )
    with pytest.raises(ValueError):
        make_embedder(provider="upstream", upstream=provider)
    await provider.aclose()


# --- helpers ---------------------------------------------------------------------------------


def test_centroid_is_the_unit_mean_direction() -> None:
    assert centroid([[1.0, 0.0], [0.0, 1.0]]) == pytest.approx([1 / math.sqrt(2)] * 2)
    assert centroid([[2.0, 0.0]]) == pytest.approx([1.0, 0.0])
    assert centroid([[1.0, 0.0], [-1.0, 0.0]]) == [0.0, 0.0]
    with pytest.raises(ValueError):
        centroid([])


async def test_serve_loads_the_local_model_and_both_encodings_before_it_answers(
    database_url: str, upstream: UpstreamServer
) -> None:
    """Loaded on first use, they made the first request of each process wait: 0.35-0.45 s for
    the encoding of a model named outside OpenAI's latest (cl100k_base), ~0.2 s for the local
    model of a conversation with something to recall."""
    tokens.get_encoding.cache_clear()
    settings = Settings(database_url=database_url, upstream_base_url=upstream.url, workers=0)
    async with running_app(settings) as app:
        assert isinstance(app.state.embedder, LocalEmbedder)
        assert app.state.embedder.loaded
        assert tokens.get_encoding.cache_info().currsize == 2


async def test_serve_starts_and_says_so_when_the_local_model_cannot_load(
    database_url: str, upstream: UpstreamServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = tmp_path / "no-model.onnx"
    settings = Settings(
        database_url=database_url,
        upstream_base_url=upstream.url,
        workers=0,
        embedding_model_path=missing,
    )
    with caplog.at_level("ERROR", logger="gateway.app"):
        async with running_app(settings) as app:
            assert isinstance(app.state.embedder, LocalEmbedder)
            assert not app.state.embedder.loaded
    assert any(str(missing) in record.getMessage() for record in caplog.records)
