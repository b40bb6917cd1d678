"""gateway.openai.translate and response_events: Responses items and chat messages, responses
and completions, and their streams, checked against each other."""

import json
from typing import Any

import pytest

from gateway.errors import GatewayError
from gateway.openai import translate
from gateway.openai.response_events import ChatEvents, ResponseReply
from gateway.openai.streams import EventReader

OUTPUT = [
    {"id": "rs_1", "type": "reasoning", "summary": []},
    {
        "id": "msg_1",
        "type": "message",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
    },
    {
        "id": "fc_1",
        "type": "function_call",
        "status": "completed",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city":"Paris"}',
    },
    {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
]


def test_a_reply_and_the_same_items_sent_back_are_one_message() -> None:
    reply = translate.reply_message(OUTPUT)
    assert reply == {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_time", "arguments": "{}"},
            },
        ],
    }
    resent = translate.input_messages(
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
                *OUTPUT,
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            ],
        }
    )
    assert resent == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        reply,
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]


def test_chat_messages_and_items_round_trip() -> None:
    reply = translate.reply_message(OUTPUT)
    assert reply is not None
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "see"},
                {"type": "image_url", "image_url": {"url": "https://a.example/x.png"}},
                {"type": "file", "file": {"file_id": "file-1"}},
                {"type": "input_audio", "input_audio": {"data": "AAA", "format": "wav"}},
            ],
        },
        reply,
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
        {"role": "assistant", "content": "Sunny at noon."},
    ]
    assert translate.items_to_messages(translate.input_items(messages)) == messages


@pytest.mark.parametrize(
    ("bad", "param"),
    [
        ([{"type": "item_reference", "id": "msg_1"}], "input[0].type"),
        ([{"type": "no_such_item"}], "input[0].type"),
        ([{"role": "user", "content": 3}], "input[0].content"),
        ([{"type": "function_call", "name": "f"}], "input[0].call_id"),
        ("", "input"),
    ],
)
def test_items_memory_cannot_read_are_refused(bad: Any, param: str) -> None:
    body = {"input": bad} if bad != "" else {"input": []}
    with pytest.raises(GatewayError) as refused:
        translate.input_messages(body)
    # Named down to the item and its field, as OpenAI names a bad parameter.
    assert (refused.value.status, refused.value.param) == (400, param)


def test_a_responses_request_as_a_chat_request() -> None:
    body = {
        "model": "m",
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"},
        "max_output_tokens": 50,
        "reasoning": {"effort": "low"},
        "text": {"format": {"type": "json_schema", "name": "s", "schema": {}, "strict": True}},
        "stream": True,
        "store": True,
        "include": ["reasoning.encrypted_content"],
    }
    chat = translate.chat_request(body, [{"role": "user", "content": "hi"}])
    assert chat == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        ],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "max_tokens": 50,
        "reasoning_effort": "low",
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "s", "schema": {}, "strict": True},
        },
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with pytest.raises(GatewayError) as built_in:
        translate.chat_request({"model": "m", "tools": [{"type": "web_search"}]}, [])
    assert built_in.value.param == "tools"


def completion(finish: str = "stop") -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "created": 7,
        "model": "m-1",
        "choices": [
            {
                "index": 0,
                "finish_reason": finish,
                "message": {
                    "role": "assistant",
                    "content": "Hello there",
                    "tool_calls": [
                        {
                            "id": "call_9",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    }


def test_a_completion_as_a_response() -> None:
    response = translate.response_object(completion(), {"model": "m"}, response_id="resp_1")
    assert (response["id"], response["status"], response["created_at"]) == (
        "resp_1",
        "completed",
        7,
    )
    assert [item["type"] for item in response["output"]] == ["message", "function_call"]
    assert response["usage"]["input_tokens"] == 5 and response["usage"]["output_tokens"] == 3
    assert translate.reply_message(response["output"]) == {
        **completion()["choices"][0]["message"],
        "role": "assistant",
    }
    cut = translate.response_object(completion("length"), {"model": "m"}, response_id="r")
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert translate.response_object({"error": {}}, {}, response_id="r") is None


def chat_stream() -> bytes:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return f"data: {json.dumps({'choices': [choice]})}\n\n"

    call = {"index": 0, "id": "call_9", "type": "function", "function": {"name": "f"}}
    return (
        chunk({"role": "assistant", "content": "Hello"})
        + chunk({"content": " there"})
        + chunk({"tool_calls": [{**call, "function": {"name": "f", "arguments": ""}}]})
        + chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]})
        + chunk({}, "tool_calls")
        + 'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}\n\n'
        + "data: [DONE]\n\n"
    ).encode()


def test_a_chat_stream_as_responses_events() -> None:
    skeleton = translate.response_skeleton({"model": "m"}, response_id="resp_s", model="m")
    events = ChatEvents(skeleton)
    sent = events.start()
    reader = EventReader()
    for piece in (chat_stream()[i : i + 7] for i in range(0, len(chat_stream()), 7)):
        for event in reader.feed(piece):
            sent += events.event(event)
    sent += events.finish()
    kinds = [e.raw.split(b"\n", 1)[0].decode() for e in EventReader().feed(sent)]
    assert kinds == [
        f"event: response.{kind}"
        for kind in (
            "created",
            "in_progress",
            "output_item.added",
            "content_part.added",
            "output_text.delta",
            "output_text.delta",
            "output_text.done",
            "content_part.done",
            "output_item.done",
            "output_item.added",
            "function_call_arguments.delta",
            "function_call_arguments.done",
            "output_item.done",
            "completed",
        )
    ]
    numbers = [json.loads(e.data or "")["sequence_number"] for e in EventReader().feed(sent)]
    assert numbers == list(range(len(kinds)))
    # Read back by the reader that records a stream: the same reply as the whole completion's.
    reply = ResponseReply()
    reply.feed(sent)
    assert reply.done
    assert reply.message() == translate.reply_message(
        translate.response_object(completion(), {"model": "m"}, response_id="r")["output"]
    )
    final = reply.response()
    assert final is not None and final["usage"]["output_tokens"] == 3


def test_a_cut_responses_stream_keeps_what_arrived() -> None:
    skeleton = translate.response_skeleton({"model": "m"}, response_id="resp_c", model="m")
    events = ChatEvents(skeleton)
    sent = events.start()
    for event in EventReader().feed(chat_stream()[:150]):
        sent += events.event(event)
    reply = ResponseReply()
    reply.feed(sent)
    assert not reply.done
    assert reply.message() == {"role": "assistant", "content": "Hello"}
    partial = reply.response()
    assert partial is not None and partial["status"] == "incomplete"
