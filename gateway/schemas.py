"""Request bodies of the OpenAI surface, validated leniently.

Only what memstrata relies on is checked (roles, content types, the fields that identify a
message); every other field is allowed and forwarded as the client sent it: the request that
goes upstream is the client's own JSON, not a re-serialisation of these models.
"""

from datetime import datetime
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


def _storable(value: Any) -> bool:
    """Whether Postgres can hold every string in `value` (text and jsonb refuse NUL
    characters and unpaired surrogates, which JSON escapes can still carry)."""
    if isinstance(value, str):
        if "\x00" in value:
            return False
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, dict):
        return all(_storable(key) and _storable(item) for key, item in value.items())
    if isinstance(value, list):
        return all(_storable(item) for item in value)
    return True


_UNSTORABLE = "text must not contain NUL characters (\\u0000) or unpaired surrogates"


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    type: str = "function"
    function: ToolCallFunction


def storable_context(unsafe: bool) -> dict[str, bool]:
    """The validation context of a body read by `gateway.bodies.read_json`: whether its raw
    JSON escaped a NUL or a surrogate (`unsafe_escapes`); without, no string is walked again."""
    return {"unsafe_escapes": unsafe}


class _Storable(BaseModel):
    """A body or message whose every string Postgres can hold (checked unless the validation
    context, `storable_context`, says the raw body could not hold such text)."""

    @model_validator(mode="before")
    @classmethod
    def _storable_text(cls, data: Any, info: ValidationInfo) -> Any:
        unsafe = (info.context or {}).get("unsafe_escapes", True)
        if unsafe and not _storable(data):
            raise ValueError(_UNSTORABLE)
        return data


class ChatMessage(_Storable):
    """One message of `messages`."""

    model_config = ConfigDict(extra="allow")
    role: Role
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _required_parts(self) -> "ChatMessage":
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        if self.role == "assistant":
            extra = self.model_extra or {}
            # As OpenAI's: content may be left out for tool calls, a refusal, or the
            # deprecated `function_call`.
            if (
                self.content is None
                and not self.tool_calls
                and "refusal" not in extra
                and not extra.get("function_call")
            ):
                raise ValueError("an assistant message needs content, tool_calls or function_call")
        elif self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        return self


class ChatCompletionRequest(BaseModel):
    """The body of `POST /v1/chat/completions`."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    stream: StrictBool | None = None
    user: str | None = None

    # Both are stored: `user` with the conversation, `model` with the reply.
    @field_validator("model", "user")
    @classmethod
    def _storable_text(cls, value: str | None) -> str | None:
        if not _storable(value):
            raise ValueError(_UNSTORABLE)
        return value


class ResponsesRequest(_Storable):
    """The body of `POST /v1/responses` (its `input` is read by `gateway.openai.translate`)."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, min_length=1)
    store: StrictBool | None = None
    stream: StrictBool | None = None
    user: str | None = None


class ImportMessage(ChatMessage):
    """A message to import, with the time it was originally sent, and whether it is a system
    prompt that replaced the conversation's (as an export writes one)."""

    created_at: datetime | None = None
    system_prompt: StrictBool = False

    @model_validator(mode="after")
    def _system_prompt_role(self) -> "ImportMessage":
        if self.system_prompt and self.role not in ("system", "developer"):
            raise ValueError("only a system or developer message can be a system prompt")
        return self


class ImportRequest(BaseModel):
    """The body of `POST /admin/conversations/{id}/messages`."""

    messages: list[ImportMessage] = Field(min_length=1)
    model: str = Field(default="gpt-4o", description="Model whose tokenizer counts the tokens")
    user: str | None = None
