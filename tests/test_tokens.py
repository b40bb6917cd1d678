"""memory.tokens: offline encoding files, model routing, chat-format token arithmetic, and what
a recalled message's tag costs in the note (`MemoryBlock`)."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import random
import wave
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

import pytest
import tiktoken
import tiktoken.load
from tiktoken_ext import openai_public

from memory import tokens
from memory.recall.memory_block import MemoryBlock
from memory.recall.retrieval import Hit
from memory.tokens import (
    AUDIO_BYTES_PER_SECOND,
    AUDIO_TOKENS_PER_SECOND,
    FILE_PAGE_TOKENS,
    IMAGE_PART_TOKENS,
    TOKENS_PER_TOOL_CALL,
    count_message,
    count_messages,
    count_text,
    encoding_name_for_model,
    ensure_encoding_files,
    get_encoding,
    message_text,
)

ENCODINGS = ("cl100k_base", "o200k_base")
# sha1 of https://openaipublic.blob.core.windows.net/encodings/{name}.tiktoken: tiktoken's cache key
CACHE_NAMES = {
    "cl100k_base": "9b5ad71b2ce5302211f9c61530b329a4922fc6a4",
    "o200k_base": "fb374d419588a4632f3f557e76b4b70aebbca790",
}
SHA256 = {
    "cl100k_base": "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
    "o200k_base": "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
}


def _no_download(blobpath: str) -> NoReturn:
    raise AssertionError(f"tiktoken tried to download {blobpath}")


@pytest.fixture(autouse=True, scope="module")
def _offline_encodings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Load both encodings once from a fresh cache dir, with downloads made impossible."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path_factory.mktemp("tiktoken")))
        mp.setattr(tiktoken.load, "read_file", _no_download)
        for name in ENCODINGS:
            get_encoding(name)
        yield


@pytest.fixture
def no_download(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiktoken.load, "read_file", _no_download)


# --- the cache files -------------------------------------------------------------------------


@pytest.mark.usefixtures("no_download")
def test_empty_cache_dir_is_filled_and_tiktoken_loads_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    assert ensure_encoding_files(tmp_path) == tmp_path

    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(CACHE_NAMES.values())
    for name in ENCODINGS:
        data = (tmp_path / CACHE_NAMES[name]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == SHA256[name]
        # Build the encoding the way tiktoken does (its own sha256 check included), bypassing
        # tiktoken's in-process registry so the files in tmp_path are really read.
        encoding = tiktoken.Encoding(**openai_public.ENCODING_CONSTRUCTORS[name]())
        assert encoding.encode_ordinary("hello world") == get_encoding(name).encode_ordinary(
            "hello world"
        )


@pytest.mark.usefixtures("no_download")
def test_a_corrupt_cached_file_is_replaced(tmp_path: Path) -> None:
    target = tmp_path / CACHE_NAMES["o200k_base"]
    target.write_bytes(b"truncated download")
    ensure_encoding_files(tmp_path, names=["o200k_base"])
    assert hashlib.sha256(target.read_bytes()).hexdigest() == SHA256["o200k_base"]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_valid_cached_file_is_left_alone(tmp_path: Path) -> None:
    ensure_encoding_files(tmp_path, names=["cl100k_base"])
    target = tmp_path / CACHE_NAMES["cl100k_base"]
    os.utime(target, (1_000_000, 1_000_000))
    ensure_encoding_files(tmp_path, names=["cl100k_base"])
    assert target.stat().st_mtime == 1_000_000


def test_without_env_the_default_dir_is_used_and_exported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # setenv first so that monkeypatch restores the original state, whatever it was.
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "placeholder")
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR")
    monkeypatch.setattr(tokens, "_default_cache_dir", lambda: tmp_path / "user-cache")
    directory = ensure_encoding_files(names=["cl100k_base"])
    assert directory == tmp_path / "user-cache"
    assert os.environ["TIKTOKEN_CACHE_DIR"] == str(directory)
    assert (directory / CACHE_NAMES["cl100k_base"]).is_file()


def test_user_cache_dir_is_used_when_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "theirs"))
    assert ensure_encoding_files(names=["cl100k_base"]) == tmp_path / "theirs"
    assert os.environ["TIKTOKEN_CACHE_DIR"] == str(tmp_path / "theirs")


def test_unwritable_cache_dir_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    # A path below a regular file cannot be created, even by root.
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(tokens, "_fallback_cache_dir", lambda: tmp_path / "fallback")
    assert ensure_encoding_files(names=["cl100k_base"]) == tmp_path / "fallback"
    assert os.environ["TIKTOKEN_CACHE_DIR"] == str(tmp_path / "fallback")


# --- routing ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "encoding"),
    [
        ("gpt-4o", "o200k_base"),
        ("gpt-4o-mini-2024-07-18", "o200k_base"),
        ("gpt-4.1-nano", "o200k_base"),
        ("gpt-4.5-preview", "o200k_base"),
        ("gpt-5", "o200k_base"),
        ("o1-mini", "o200k_base"),
        ("o3", "o200k_base"),
        ("o4-mini", "o200k_base"),
        ("chatgpt-4o-latest", "o200k_base"),
        ("gpt-oss-120b", "o200k_base"),
        ("openai/gpt-4o", "o200k_base"),
        ("ft:gpt-4o-mini:acme::abc123", "o200k_base"),
        ("GPT-4O", "o200k_base"),
        ("gpt-4", "cl100k_base"),
        ("gpt-4-turbo", "cl100k_base"),
        ("gpt-4-0613", "cl100k_base"),
        ("gpt-3.5-turbo", "cl100k_base"),
        ("text-embedding-3-small", "cl100k_base"),
        ("openai/gpt-3.5-turbo", "cl100k_base"),
        ("llama-3.1-8b-instruct", "cl100k_base"),
        ("mistralai/mistral-large", "cl100k_base"),
        ("", "cl100k_base"),
    ],
)
def test_encoding_name_for_model(model: str, encoding: str) -> None:
    assert encoding_name_for_model(model) == encoding


# --- counting --------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["gpt-4o", "gpt-4", "llama3"])
def test_count_text_known_values(model: str) -> None:
    assert count_text("hello world", model=model) == 2
    assert count_text("", model=model) == 0


def test_special_token_text_is_counted_not_refused() -> None:
    # encode() would raise on "<|endoftext|>"; user text may contain it.
    assert count_text("<|endoftext|>", model="gpt-4o") > 1
    assert count_text("<|endoftext|>", model="gpt-4") > 1


def test_encodings_differ_where_they_should() -> None:
    text = "Günther's naïve façade — 東京タワー"
    assert get_encoding("o200k_base").encode_ordinary(text) != get_encoding(
        "cl100k_base"
    ).encode_ordinary(text)
    assert count_text(text, model="gpt-4o") == len(get_encoding("o200k_base").encode(text))
    assert count_text(text, model="gpt-4") == len(get_encoding("cl100k_base").encode(text))


@pytest.mark.parametrize("repeat", [1, 40], ids=["short", "by digest"])
def test_a_kept_count_is_the_count_of_its_own_encoding(repeat: int) -> None:
    """Counts are kept per text (by value when short, by digest from `SHORT_TEXT` on), and per
    encoding: the same text counted for a model of each encoding, in turns and again, gives
    each encoding's own count every time."""
    text = "Günther's naïve façade — 東京タワー " * repeat + str(random.random())
    assert (len(text) >= tokens.SHORT_TEXT) is (repeat > 1)
    expected = {
        model: len(get_encoding(name).encode_ordinary(text))
        for model, name in (("gpt-4o", "o200k_base"), ("gpt-4", "cl100k_base"))
    }
    assert expected["gpt-4o"] != expected["gpt-4"]
    for _ in range(3):
        assert {model: count_text(text, model=model) for model in expected} == expected


@pytest.mark.parametrize("model", ["gpt-4o", "gpt-4"])
def test_message_overhead(model: str) -> None:
    # 3 framing + "user" (1) + "hello world" (2)
    assert count_message({"role": "user", "content": "hello world"}, model=model) == 6
    # + 1 for having a name + "bob" (1)
    named = {"role": "user", "name": "bob", "content": "hello world"}
    assert count_message(named, model=model) == 8
    # content None (assistant turn with only tool calls) costs nothing itself
    assert count_message({"role": "assistant", "content": None}, model=model) == 4


def test_count_messages_adds_reply_priming() -> None:
    one = {"role": "user", "content": "hello world"}
    assert count_messages([], model="gpt-4o") == 3
    assert count_messages([one, one], model="gpt-4o") == 6 + 6 + 3
    assert count_messages((m for m in [one]), model="gpt-4o") == 9  # any iterable


# The openai-cookbook example ("How to count tokens with tiktoken", section 6) whose counts it
# checked against the API's usage.prompt_tokens: 129 for gpt-3.5/gpt-4, 124 for gpt-4o(-mini).
COOKBOOK_MESSAGES: list[dict[str, Any]] = [
    {
        "role": "system",
        "content": "You are a helpful, pattern-following assistant that translates corporate "
        "jargon into plain English.",
    },
    {
        "role": "system",
        "name": "example_user",
        "content": "New synergies will help drive top-line growth.",
    },
    {
        "role": "system",
        "name": "example_assistant",
        "content": "Things working well together will increase revenue.",
    },
    {
        "role": "system",
        "name": "example_user",
        "content": "Let's circle back when we have more bandwidth to touch base on opportunities "
        "for increased leverage.",
    },
    {
        "role": "system",
        "name": "example_assistant",
        "content": "Let's talk later when we're less busy about how to do better.",
    },
    {
        "role": "user",
        "content": "This late pivot means we don't have time to boil the ocean for the client "
        "deliverable.",
    },
]


@pytest.mark.parametrize(
    ("model", "expected"),
    [("gpt-3.5-turbo", 129), ("gpt-4-0613", 129), ("gpt-4o", 124), ("gpt-4o-mini", 124)],
)
def test_matches_api_counts_from_the_cookbook(model: str, expected: int) -> None:
    assert count_messages(COOKBOOK_MESSAGES, model=model) == expected


def test_content_parts() -> None:
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    message = {
        "role": "user",
        "content": [{"type": "text", "text": "hello world"}, image],
    }
    assert count_message(message, model="gpt-4o") == 3 + 1 + 2 + IMAGE_PART_TOKENS

    unknown = {"type": "custom_part", "value": "a b c"}
    as_json = json.dumps(unknown, separators=(",", ":"))
    with_unknown = {"role": "user", "content": [unknown]}
    assert count_message(with_unknown, model="gpt-4o") == 3 + 1 + count_text(
        as_json, model="gpt-4o"
    )


def wav(seconds: float, *, rate: int = 24_000) -> str:
    """A silent 16-bit mono WAV clip, base64."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as clip:
        clip.setnchannels(1)
        clip.setsampwidth(2)
        clip.setframerate(rate)
        clip.writeframes(b"\0\0" * int(rate * seconds))
    return base64.b64encode(buffer.getvalue()).decode()


def pdf(pages: int) -> str:
    objects = "".join(
        f"{n + 3} 0 obj << /Type /Page /Parent 2 0 R >> endobj\n" for n in range(pages)
    )
    document = f"%PDF-1.4\n2 0 obj << /Type /Pages /Count {pages} >> endobj\n{objects}%%EOF"
    return base64.b64encode(document.encode()).decode()


def only_part(part: dict[str, Any]) -> int:
    """Tokens of a user message holding `part` alone, framing and role left out."""
    return count_message({"role": "user", "content": [part]}, model="gpt-4o") - 3 - 1


@pytest.mark.parametrize("seconds", [0.5, 3.0, 30.0])
def test_audio_costs_its_length_never_its_base64(seconds: float) -> None:
    data = wav(seconds)
    chat = {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
    responses = {"type": "input_audio", "data": data, "format": "wav"}
    expected = round(seconds * AUDIO_TOKENS_PER_SECOND)
    assert only_part(chat) == only_part(responses) == expected
    assert count_text(data, model="gpt-4o") > 20 * expected  # what the payload's text costs


def test_audio_of_another_format_is_estimated_from_its_size() -> None:
    data = base64.b64encode(b"\xff\xfb" * AUDIO_BYTES_PER_SECOND * 2).decode()  # 4 s of bytes
    part = {"type": "input_audio", "input_audio": {"data": data, "format": "mp3"}}
    assert only_part(part) == 4 * AUDIO_TOKENS_PER_SECOND
    broken = {"type": "input_audio", "input_audio": {"data": "not base64!", "format": "wav"}}
    assert only_part(broken) >= 1


def test_files_cost_per_page() -> None:
    inline = {"type": "file", "file": {"filename": "a.pdf", "file_data": pdf(3)}}
    data_url = {"type": "input_file", "file_data": f"data:application/pdf;base64,{pdf(2)}"}
    by_id = {"type": "file", "file": {"file_id": "file-abc"}}
    assert only_part(inline) == 3 * FILE_PAGE_TOKENS
    assert only_part(data_url) == 2 * FILE_PAGE_TOKENS
    assert only_part(by_id) == FILE_PAGE_TOKENS
    assert only_part({"type": "input_image", "image_url": "https://example.com/a.png"}) == (
        IMAGE_PART_TOKENS
    )


def test_tool_calls_and_tool_results_are_counted() -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
    }
    assistant = {"role": "assistant", "content": None, "tool_calls": [call]}
    # 3 framing + "assistant" (1) + per call: overhead + "get_weather" (2) + arguments (5)
    assert count_message(assistant, model="gpt-4o") == 3 + 1 + TOKENS_PER_TOOL_CALL + 2 + 5
    two_calls = {**assistant, "tool_calls": [call, call]}
    assert count_message(two_calls, model="gpt-4o") == 4 + 2 * (TOKENS_PER_TOOL_CALL + 7)

    result = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    # 3 framing + "tool" (1) + "sunny" (2) + "call_1" (3)
    assert count_message(result, model="gpt-4o") == 9


def test_malformed_messages_do_not_crash() -> None:
    odd: list[dict[str, Any]] = [
        {"role": "user"},
        {"role": "user", "content": {"unexpected": "shape"}},
        {"role": "assistant", "tool_calls": [{"function": None}, "junk"]},
        {"role": "user", "content": [None, 3, {"type": "text", "text": None}]},
    ]
    for message in odd:
        assert count_message(message, model="gpt-4o") >= 3


# --- plain text ------------------------------------------------------------------------------


def test_message_text() -> None:
    assert message_text({"role": "user", "content": "plain"}) == "plain"
    assert message_text({"role": "assistant", "content": None}) == ""
    assert message_text({"role": "assistant"}) == ""
    parts = [
        {"type": "text", "text": "first"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        {"type": "text", "text": "second"},
    ]
    assert message_text({"role": "user", "content": parts}) == "first\nsecond"


# --- a recalled message's tag ----------------------------------------------------------------


@pytest.mark.parametrize("name", ENCODINGS)
def test_a_recalled_message_tag_costs_what_it_encodes_to(name: str) -> None:
    """The note costs each candidate's `[#id speaker]` from its parts (the id by its digits); the
    cost must be the tag's own encoding, whatever the id's length and the speaker."""
    enc = get_encoding(name)
    rng = random.Random(13)
    speakers = ["Caroline", "Jean-Luc", "O'Brien", "bob_2", "9lives", "李雷", "José", "[x]", " a"]
    for _ in range(400):
        node_id = rng.choice([rng.randint(1, 999), rng.randint(1, 10**7), rng.randint(1, 10**15)])
        speaker = rng.choice(speakers)
        conversation_id = rng.choice([1, 2])
        hit = Hit(
            node_id=node_id,
            conversation_id=conversation_id,
            level=0,
            seq=0,
            span_start=0,
            span_end=0,
            role="user",
            name=speaker,
            text="hello",
            created_at=datetime(2026, 11, 27, tzinfo=UTC),
            score=1.0,
            token_count=40,
        )
        where = "" if conversation_id == 1 else ", other conversation"
        tag = len(enc.encode_ordinary(f"[#{node_id} {speaker}{where}]"))
        framing = tokens.TOKENS_PER_MESSAGE + len(enc.encode_ordinary("user"))
        framing += tokens.TOKENS_PER_NAME + len(enc.encode_ordinary(speaker))
        heading = 13  # the first message of its sitting brings the sitting's heading
        block = MemoryBlock(enc=enc, primary=1)
        assert block.cost_of_message(hit) == 40 - framing + tag + 1 + heading, (node_id, speaker)
