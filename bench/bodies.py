"""What reading a chat request's body costs as the history it resends grows.

    python -m bench.bodies [--messages 50,250,1000] [--repeat 200] [--output FILE]

A client of the chat API resends its whole history with every message, so the gateway parses
and checks that history on every turn (`gateway.bodies.read_json`, then the request's
validation, `gateway.openai.chat.parse`). Per history length, in this process (no server):
the milliseconds of each step, median of `--repeat` runs, for a body whose strings the raw JSON
proves storable (no escape of a NUL or a surrogate: only their depth is walked, and validation
walks no string again) and for the same body read the full way (every string checked twice),
as a body with such an escape is. Messages alternate a question and a three-sentence answer, as
`bench.overhead`'s do. Results: `bench/results/bodies.json`.
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

RESULTS: Final = h.RESULTS_DIR / "bodies.json"


def history(messages: int) -> bytes:
    """A chat request resending `messages` messages, as a client's JSON encoder writes it."""
    turns: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."}]
    for number in range(messages - 1):
        if number % 2 == 0:
            content = f"Question {number}: what about item {number * 7 % 13} and its budget?"
            turns.append({"role": "user", "content": content})
        else:
            answer = f"Item {number} is on track and its budget of {number * 31} dollars holds. "
            turns.append({"role": "assistant", "content": answer * 3, "refusal": None})
    return json.dumps({"model": "gpt-4o-mini", "messages": turns}).encode()


def _median_ms(step: Callable[[], object], repeat: int) -> float:
    step()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1000, 3)


def measure(messages: int, repeat: int) -> dict[str, Any]:
    raw = history(messages)
    assert not unsafe_escapes(raw)
    body = json.loads(raw)
    return {
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
