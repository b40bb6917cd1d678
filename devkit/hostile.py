"""Hostile input for the chat endpoint, as hypothesis strategies: the fuzz test
(`tests/test_fuzz.py`) and the fault benchmark (`bench.faults`) draw from the same ones.

`payloads` are request bodies as bytes: JSON bodies of every shape (valid chats with odd
extras, valid messages, wrong types,
NUL and unpaired surrogates, huge and non-finite numbers) encoded as a client's JSON library
would, and raw bytes (garbage, deep nesting, `1e999`). `header_sets` are extra request headers
(conversation ids, budgets, content types), given as latin-1 text as they travel.
"""

import json
from typing import Any

from hypothesis import strategies as st

texts = st.text(max_size=30) | st.sampled_from(["a\x00b", "a\ud800b", "\udfff", "", " ", "é" * 40])
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | texts
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)
_roles = st.sampled_from(["user", "assistant", "system", "developer", "tool", "function", "x"])
_calls = st.lists(
    st.fixed_dictionaries(
        {"id": texts, "type": st.just("function")},
        optional={"function": st.fixed_dictionaries({"name": texts, "arguments": texts | values})},
    ),
    max_size=2,
)
_parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}))
messages = st.fixed_dictionaries(
    {"role": _roles | values},
    optional={
        "content": texts | values | _parts,
        "name": texts | values,
        "tool_calls": _calls | values,
        "tool_call_id": texts | values,
    },
)
bodies = st.fixed_dictionaries(
    {"model": st.just("m") | texts | values, "messages": st.lists(messages, max_size=4) | values},
    optional={
        "stream": st.booleans() | values,
        "user": texts | values,
        "metadata": values,
        "temperature": values,
        "tools": values,
        "max_tokens": values,
        "stop": values,
    },
)


# Valid messages with hostile company: most of these are answered, so answers are fuzzed too.
_plain = st.fixed_dictionaries(
    {
        "model": st.just("m"),
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.just("user"), "content": st.text(min_size=1, max_size=40)}
            ),
            min_size=1,
            max_size=3,
        ),
    },
    optional={
        "stream": st.booleans(),
        "metadata": values,
        "user": st.text(max_size=10),
        "stop": values,
    },
)


def _encoded(body: Any) -> bytes:
    # As a client's JSON library sends it: escapes for whatever is not ASCII.
    return json.dumps(body, ensure_ascii=True).encode()


def nested(depth: int) -> bytes:
    """A chat body with `depth` nested arrays in one of its fields."""
    return b'{"model": "m", "messages": [], "x": ' + b"[" * depth + b"]" * depth + b"}"


raw = st.binary(max_size=200) | st.sampled_from(
    [nested(70), nested(1500), b'{"model": "m", "temperature": 1e999, "messages": []}']
)
payloads = _plain.map(_encoded) | bodies.map(_encoded) | raw
# Printable, not starting or ending with a space: other values cannot travel in a header at all.
_latin1 = st.text(
    alphabet=st.characters(codec="latin-1", exclude_categories=["Cc"]), max_size=12
).map(str.strip)
header_sets = st.fixed_dictionaries(
    {},
    optional={
        "X-Memstrata-Conversation": _latin1,
        "X-Memstrata-Budget": _latin1,
        "content-type": st.sampled_from(["application/json", "text/plain", "application/x+json"]),
    },
)
