"""The Responses API in the terms of chat completions, and back.

Memory stores chat messages, so a Responses request is first read as chat messages
(`input_messages`): `instructions` becomes a leading system message, and each input item one
message, by these rules:

* a message item (`{"role", "content"}`, with or without `"type": "message"`) of role user,
  system or developer: that message, its parts as chat parts (`input_text` → `text`,
  `input_image` → `image_url`, `input_file` → `file`, `input_audio` as it is);
* an assistant message item: an assistant message whose content is its `output_text` joined
  (a `refusal` part becomes the `refusal` field);
* `function_call` items: tool calls (`call_id` → the call's `id`) of the assistant message just
  before them, or of a new one;
* a `function_call_output` item: a `tool` message (`call_id` → `tool_call_id`);
* `reasoning` and the built-in tools' items (web search, file search, computer, …): not chat
  messages, so not stored; they reach the upstream only when the client's input goes as it was
  sent;
* `item_reference`: the item it names, an output item of a stored response
  (`memory.write.responses.output_items`: the ids this gateway answered); any other id is
  refused (400).

A response's `output` is read by the same rules (`reply_message`), so a reply recorded from a
response and the same items sent back as input are one message. `input_items` turns chat
messages back into input items, for a prompt rebuilt from memory going to an upstream that
serves the Responses API.

For an upstream without the Responses API, `chat_request` turns a Responses body into a chat
completion request (function tools, `tool_choice`, `text.format` → `response_format`,
`max_output_tokens` → `max_tokens`, `reasoning.effort` → `reasoning_effort`, `temperature`,
`top_p`, `parallel_tool_calls`, `user`, `service_tier`, `top_logprobs`, `prompt_cache_key`,
`safety_identifier`; a tool of another type than `function` is refused with 400: chat
completions have no built-in tools, `check_translatable`), and `response_object` turns the
completion into a response object; `gateway.openai.response_events` does the same for streams.
"""

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.errors import GatewayError

Message = dict[str, Any]
Item = dict[str, Any]

# Items that are not chat messages: never stored, never an error.
_NOT_MESSAGES = frozenset(
    {
        "reasoning",
        "web_search_call",
        "file_search_call",
        "computer_call",
        "computer_call_output",
        "image_generation_call",
        "code_interpreter_call",
        "local_shell_call",
        "local_shell_call_output",
        "shell_call",
        "shell_call_output",
        "apply_patch_call",
        "apply_patch_call_output",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "mcp_call",
        "custom_tool_call",
        "custom_tool_call_output",
        "compaction",
    }
)
_ROLES = ("user", "system", "developer", "assistant")


def new_id(prefix: str) -> str:
    """A fresh id in OpenAI's style (`resp_…`, `msg_…`, `fc_…`)."""
    return f"{prefix}_{uuid.uuid4().hex}{uuid.uuid4().hex[:16]}"


def _invalid(message: str, param: str = "input") -> GatewayError:
    return GatewayError(400, message, param=param, code="invalid_value")


# -- items → chat messages ---------------------------------------------------------------------


def input_messages(body: Mapping[str, Any]) -> list[Message]:
    """The chat messages a Responses request stands for: its instructions, then its input
    (with no `item_reference` left: see `dereferenced`)."""
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _invalid("instructions must be a string", "instructions")
    messages = [instructions_message(instructions)] if instructions else []
    return [*messages, *items_to_messages(input_item_list(body.get("input")))]


def references(body: Mapping[str, Any]) -> list[str]:
    """The ids the request's `item_reference` items name (none for input that is no list)."""
    raw = body.get("input")
    named = [
        (index, item.get("id"))
        for index, item in enumerate(raw if isinstance(raw, list) else [])
        if isinstance(item, dict) and item.get("type") == "item_reference"
    ]
    ids = []
    for index, item_id in named:
        if not isinstance(item_id, str):
            raise _invalid(
                f"input[{index}]: an item_reference needs the id of an item", f"input[{index}].id"
            )
        ids.append(item_id)
    return ids


def dereferenced(body: dict[str, Any], referenced: Mapping[str, Item]) -> dict[str, Any]:
    """`body` with each `item_reference` of its input replaced by the item of `referenced` it
    names; `body` itself when it holds none."""
    raw = body.get("input")
    if not isinstance(raw, list) or not any(
        isinstance(item, dict) and item.get("type") == "item_reference" for item in raw
    ):
        return body
    resolved = []
    for index, item in enumerate(raw):
        if isinstance(item, dict) and item.get("type") == "item_reference":
            found = referenced.get(str(item.get("id")))
            if found is None:
                raise _invalid(
                    f"input[{index}]: item_reference {item.get('id')!r} names no output item "
                    "of a stored response",
                    f"input[{index}].id",
                )
            item = found
        resolved.append(item)
    return {**body, "input": resolved}


def instructions_message(instructions: str) -> Message:
    return {"role": "system", "content": instructions}


def input_item_list(raw: Any) -> list[Item]:
    """`input` as a list of items (a string is one user message)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not all(isinstance(item, dict) for item in raw):
        raise _invalid("input must be a string or a list of input items")
    if not raw:
        raise _invalid("input must not be empty")
    return raw


def items_to_messages(items: Sequence[Mapping[str, Any]]) -> list[Message]:
    """Chat messages for `items` (see the module docstring for the rules)."""
    messages: list[Message] = []
    for index, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, index))
        elif kind == "function_call":
            call = {
                "id": _text(item, "call_id", index),
                "type": "function",
                "function": {
                    "name": _text(item, "name", index),
                    "arguments": _text(item, "arguments", index),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _text(item, "call_id", index),
                    "content": output if isinstance(output, str) else _parts(output, index),
                }
            )
        elif kind not in _NOT_MESSAGES:
            raise _invalid(f"input[{index}]: unknown item type {kind!r}", f"input[{index}].type")
    return messages


def reply_message(output: Any) -> Message | None:
    """The assistant message a response's `output` items make, if any."""
    if not isinstance(output, list):
        return None
    items = [item for item in output if isinstance(item, dict)]
    try:
        messages = items_to_messages(items)
    except GatewayError:
        return None
    replies = [message for message in messages if message["role"] == "assistant"]
    if not replies:
        return None
    reply = replies[0]
    for extra in replies[1:]:  # one reply per response: later parts join the first
        reply["content"] = "".join(filter(None, (reply["content"], extra["content"]))) or None
        reply.setdefault("tool_calls", []).extend(extra.get("tool_calls", []))
    return reply


def _text(item: Mapping[str, Any], key: str, index: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _invalid(f"input[{index}].{key} must be a string", f"input[{index}].{key}")
    return value


def _message(item: Mapping[str, Any], index: int) -> Message:
    role = item.get("role")
    if role not in _ROLES:
        raise _invalid(
            f"input[{index}].role must be one of {', '.join(_ROLES)}", f"input[{index}].role"
        )
    content = item.get("content")
    if role != "assistant":
        return {
            "role": role,
            "content": content if isinstance(content, str) else _parts(content, index),
        }
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    text, refusal = [], []
    for part in _part_list(content, index):
        if part.get("type") == "refusal":
            refusal.append(str(part.get("refusal", "")))
        elif isinstance(part.get("text"), str):
            text.append(part["text"])
    message: Message = {"role": "assistant", "content": "".join(text) or None}
    if refusal:
        message["refusal"] = "".join(refusal)
    return message


def _part_list(content: Any, index: int) -> list[dict[str, Any]]:
    if not isinstance(content, list) or not all(isinstance(part, dict) for part in content):
        raise _invalid(
            f"input[{index}].content must be a string or a list of content parts",
            f"input[{index}].content",
        )
    return content


def _parts(content: Any, index: int) -> list[dict[str, Any]]:
    """Responses content parts as chat content parts."""
    parts: list[dict[str, Any]] = []
    for part in _part_list(content, index):
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            image = {"url": part["image_url"]}
            if part.get("detail"):
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        elif kind == "input_file" and ("file_id" in part or "file_data" in part):
            keys = ("file_id", "file_data", "filename")
            parts.append({"type": "file", "file": {k: part[k] for k in keys if k in part}})
        else:  # input_audio, and what chat has no form for, kept as sent
            parts.append(dict(part))
    return parts


# -- chat messages → items ---------------------------------------------------------------------


def input_items(messages: Sequence[Mapping[str, Any]]) -> list[Item]:
    """Input items for chat `messages` (the inverse of `items_to_messages`)."""
    items: list[Item] = []
    for message in messages:
        role = message.get("role")
        content = message.get("content")
        if role == "tool":
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": message.get("tool_call_id"),
                    "output": content if isinstance(content, str) else _item_parts(content),
                }
            )
            continue
        if role == "assistant":
            if content or message.get("refusal"):
                items.append({"role": "assistant", "content": _assistant_text(message)})
            items.extend(
                {
                    "type": "function_call",
                    "call_id": call.get("id"),
                    "name": call.get("function", {}).get("name"),
                    "arguments": call.get("function", {}).get("arguments"),
                }
                for call in message.get("tool_calls") or []
            )
            continue
        items.append(
            {"role": role, "content": content if isinstance(content, str) else _item_parts(content)}
        )
    return items


def _assistant_text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content or message.get("refusal") or "")


def _item_parts(content: Any) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for part in content if isinstance(content, list) else []:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            parts.append({"type": "input_text", "text": part.get("text", "")})
        elif kind == "image_url":
            image = part.get("image_url") or {}
            parts.append({"type": "input_image", "image_url": image.get("url"), **_detail(image)})
        elif kind == "file":
            parts.append({"type": "input_file", **(part.get("file") or {})})
        elif isinstance(part, dict):
            parts.append(part)
    return parts


def _detail(image: Mapping[str, Any]) -> dict[str, Any]:
    return {"detail": image["detail"]} if image.get("detail") else {}


def stored_items(body: Mapping[str, Any]) -> list[Item]:
    """The request's input as the input items `GET /v1/responses/{id}/input_items` lists:
    each with an `id` and a `type`, a message's content as a list of parts."""
    items: list[Item] = []
    for raw in input_item_list(body.get("input")):
        item = {"type": "message", **raw}
        if item["type"] == "message":
            content = item.get("content")
            if isinstance(content, str):
                kind = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": kind, "text": content}]
            item.setdefault("status", "completed")
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}
        item.setdefault("id", new_id(prefix.get(item["type"], "item")))
        items.append(item)
    return items


# -- a Responses request as a chat completion request ------------------------------------------

_SAME_FIELDS = (
    "model",
    "temperature",
    "top_p",
    "parallel_tool_calls",
    "user",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
)


def check_translatable(body: Mapping[str, Any]) -> None:
    """Refuse (400) a Responses `body` that `chat_request` cannot translate: its tools and
    `tool_choice`, checked before anything of the request is stored."""
    tools = body.get("tools")
    if tools and not isinstance(tools, list):
        raise _invalid("tools must be a list", "tools")
    for tool in tools or []:
        _chat_tool(tool)
    if "tool_choice" in body:
        _chat_tool_choice(body["tool_choice"])


def translatable(body: Mapping[str, Any]) -> bool:
    """Whether `check_translatable` lets `body` through."""
    try:
        check_translatable(body)
    except GatewayError:
        return False
    return True


def chat_request(body: Mapping[str, Any], messages: list[Message]) -> dict[str, Any]:
    """The chat completion request for a Responses `body` whose prompt is `messages`."""
    check_translatable(body)
    chat: dict[str, Any] = {key: body[key] for key in _SAME_FIELDS if key in body}
    chat["messages"] = messages
    if body.get("tools"):
        chat["tools"] = [_chat_tool(tool) for tool in body["tools"]]
    if "tool_choice" in body:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    if isinstance(body.get("max_output_tokens"), int):
        chat["max_tokens"] = body["max_output_tokens"]
    if isinstance(body.get("top_logprobs"), int):
        chat["logprobs"] = True
        chat["top_logprobs"] = body["top_logprobs"]
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort"):
        chat["reasoning_effort"] = reasoning["effort"]
    text = body.get("text")
    text_format = text.get("format") if isinstance(text, dict) else None
    if isinstance(text_format, dict) and text_format.get("type") == "json_schema":
        schema = {k: v for k, v in text_format.items() if k != "type"}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif isinstance(text_format, dict) and text_format.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def _chat_tool(tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise GatewayError(
            400,
            f"tool type {kind!r} needs an upstream that serves the Responses API "
            "(chat completions have function tools only)",
            param="tools",
            code="unsupported_value",
        )
    keys = ("name", "description", "parameters", "strict")
    return {"type": "function", "function": {k: tool[k] for k in keys if tool.get(k) is not None}}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, str):
        return choice
    raise GatewayError(
        400,
        "this tool_choice needs an upstream that serves the Responses API",
        param="tool_choice",
        code="unsupported_value",
    )


# -- a chat completion as a response object ----------------------------------------------------


def response_skeleton(body: Mapping[str, Any], *, response_id: str, model: str) -> dict[str, Any]:
    """A response object without output: what `response.created` announces."""
    text = body.get("text") if isinstance(body.get("text"), dict) else {"format": {"type": "text"}}
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "model": model,
        "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "store": body.get("store", True),
        "temperature": body.get("temperature", 1.0),
        "text": text,
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p", 1.0),
        "truncation": body.get("truncation", "disabled"),
        "usage": None,
        "user": body.get("user"),
    }


def message_item(text: str, *, item_id: str, status: str = "completed") -> Item:
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def call_item(call: Mapping[str, Any], *, item_id: str, status: str = "completed") -> Item:
    function = call.get("function") or {}
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call.get("id"),
        "name": function.get("name"),
        "arguments": function.get("arguments") or "",
    }


def finished(response: dict[str, Any], finish_reason: str | None, usage: Any) -> None:
    """Complete `response` (in place) with its status and usage, from the chat completion's
    `finish_reason` and `usage`."""
    incomplete = {"length": "max_output_tokens", "content_filter": "content_filter"}
    if finish_reason in incomplete:
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": incomplete[finish_reason]}
    else:
        response["status"] = "completed"
    response["usage"] = response_usage(usage)


def response_usage(usage: Any) -> dict[str, Any] | None:
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens_details") or {}
    completion = usage.get("completion_tokens_details") or {}
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "input_tokens_details": {"cached_tokens": prompt.get("cached_tokens") or 0},
        "output_tokens": usage.get("completion_tokens", 0),
        "output_tokens_details": {"reasoning_tokens": completion.get("reasoning_tokens") or 0},
        "total_tokens": usage.get("total_tokens", 0),
    }


def chat_usage(usage: Any) -> dict[str, Any] | None:
    """A response's `usage` as a chat completion counts it (`response_usage` turned back)."""
    if not isinstance(usage, dict):
        return None
    inputs = usage.get("input_tokens_details") or {}
    outputs = usage.get("output_tokens_details") or {}
    return {
        "prompt_tokens": usage.get("input_tokens", 0),
        "prompt_tokens_details": {"cached_tokens": inputs.get("cached_tokens") or 0},
        "completion_tokens": usage.get("output_tokens", 0),
        "completion_tokens_details": {"reasoning_tokens": outputs.get("reasoning_tokens") or 0},
        "total_tokens": usage.get("total_tokens", 0),
    }


def response_object(completion: Any, body: Mapping[str, Any], *, response_id: str) -> Any:
    """The response object for a chat `completion` (None if it is not one)."""
    try:
        choice = completion["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError):
        return None
    response = response_skeleton(
        body, response_id=response_id, model=str(completion.get("model") or body.get("model"))
    )
    if isinstance(completion.get("created"), int):
        response["created_at"] = completion["created"]
    output: list[Item] = []
    if message.get("content") or message.get("refusal"):
        item = message_item(_assistant_text(message), item_id=new_id("msg"))
        if not message.get("content"):  # a refusal alone is a refusal part
            item["content"] = [{"type": "refusal", "refusal": message["refusal"]}]
        output.append(item)
    output.extend(call_item(call, item_id=new_id("fc")) for call in message.get("tool_calls") or [])
    response["output"] = output
    finished(response, choice.get("finish_reason"), completion.get("usage"))
    return response


def dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode()
