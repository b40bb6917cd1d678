"""What a chat request's resent history costs to read, hash and count, as it grows.

    python -m bench.bodies [--messages 50,250,1000] [--repeat 200] [--output FILE]

A client of the chat API resends its whole history with every message, so the gateway parses
and checks that history on every turn (`gateway.bodies.read_json`, then the request's
validation, `gateway.openai.chat.parse`), hashes it to find its conversation
(`memory.write.identity`) and, while it fits the budget, counts its tokens
(`memory.recall.assemble`). Per history length, in this process (no server), the milliseconds
of each step, median of `--repeat` runs:

* reading and validating a body whose strings the raw JSON proves storable (no escape of a NUL
  or a surrogate: only their depth is walked, and validation walks no string again), and the
  same body read the full way (every string checked twice), as a body with such an escape is;
* hashing its messages' chain (`chains.chain`) and counting their tokens (`tokens.count_each`,
  gpt-4o-mini), each the first time (texts not seen before: what every turn paid before
  canonical forms and counts were kept) and again (the next turn's).

Messages alternate a question and a three-sentence answer, as `bench.overhead`'s do. Results:
`bench/results/bodies.json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from bench import harness as h
from gateway.bodies import loads, unsafe_escapes
from gateway.schemas import ChatCompletionRequest, storable_context
from memory import tokens
from memory.write import chains

RESULTS: Final = h.RESULTS_DIR / "bodies.json"


MODEL: Final = "gpt-4o-mini"


def turns(messages: int, *, salt: str = "") -> list[dict[str, Any]]:
    """`messages` messages of a conversation (`salt` makes their texts new)."""
    said: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."}]
    for number in range(messages - 1):
        if number % 2 == 0:
            content = f"Question {number}{salt}: what about item {number * 7 % 13} and its budget?"
            said.append({"role": "user", "content": content})
        else:
            answer = f"Item {number} is on track and its budget of {number * 31} dollars holds. "
            said.append({"role": "assistant", "content": answer * 3, "refusal": None})
    return said


def history(messages: int) -> bytes:
    """A chat request resending `messages` messages, as a client's JSON encoder writes it."""
    return json.dumps({"model": MODEL, "messages": turns(messages)}).encode()


def _median_ms(step: Callable[[], object], repeat: int) -> float:
    step()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1000, 3)


def _first_ms(step: Callable[[list[dict[str, Any]]], object], messages: int, runs: int) -> float:
    """`step` over histories whose texts it never saw before, median of `runs`."""
    fresh = [turns(messages, salt=f" ({run}, {step.__name__})") for run in range(runs)]
    times = []
    for said in fresh:
        started = time.perf_counter()
        step(said)
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1000, 3)


def _count(said: list[dict[str, Any]]) -> list[int]:
    return tokens.count_each(said, model=MODEL)


def measure(messages: int, repeat: int) -> dict[str, Any]:
    raw = history(messages)
    assert not unsafe_escapes(raw)
    body = json.loads(raw)
    said = body["messages"]
    runs = max(repeat // 10, 5)
    return {
        "hash_first_ms": _first_ms(chains.chain, messages, runs),
        "hash_again_ms": _median_ms(lambda: chains.chain(said), repeat),
        "count_first_ms": _first_ms(_count, messages, runs),
        "count_again_ms": _median_ms(lambda: _count(said), repeat),
        "messages": messages,
        "bytes": len(raw),
        "json_ms": _median_ms(lambda: json.loads(raw), repeat),
        "scan_ms": _median_ms(lambda: unsafe_escapes(raw), repeat),
        "full": {
            "read_ms": _median_ms(lambda: loads(raw, unsafe=True), repeat),
            "validate_ms": _median_ms(
                lambda: ChatCompletionRequest.model_validate(body, context=storable_context(True)),
                repeat,
            ),
        },
        "proved": {
            "read_ms": _median_ms(lambda: loads(raw, unsafe=unsafe_escapes(raw)), repeat),
            "validate_ms": _median_ms(
                lambda: ChatCompletionRequest.model_validate(body, context=storable_context(False)),
                repeat,
            ),
        },
    }


def table(report: dict[str, Any]) -> list[str]:
    rows = [
        [
            f"{row['messages']:,}",
            f"{row['bytes']:,}",
            row["json_ms"],
            f"{row['full']['read_ms']} + {row['full']['validate_ms']}",
            f"{row['proved']['read_ms']} + {row['proved']['validate_ms']}",
            f"{row['hash_first_ms']} / {row['hash_again_ms']}",
            f"{row['count_first_ms']} / {row['count_again_ms']}",
        ]
        for row in report["rows"]
    ]
    return h.markdown_table(
        [
            "messages",
            "bytes",
            "json.loads ms",
            "read + validate ms, every string checked",
            "read + validate ms, strings proved storable",
            "hash ms, first time / again",
            "count ms, first time / again",
        ],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", default="50,250,1000")
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = [measure(int(count), args.repeat) for count in args.messages.split(",")]
    report = {"benchmark": "bodies", "machine": h.machine_info(), "rows": rows}
    h.write_results(args.output, report)
    print("\n".join(table(report)))


if __name__ == "__main__":
    main()
