"""The OpenAI-facing surface with memory: one chat completion, from the client's body to the
reply stored.

`chat` is the handler and reads top-down: identify, store, assemble, forward, record, enqueue.
`relay` forwards the prompt upstream and relays the answer (`toolloop` when the memory tools are
offered, `streams` for server-sent events), `replies` rebuilds the assistant's message from what
came back, `turn` is what the request established and records the reply, and `degraded` serves
requests while the database is down. `responses` serves the Responses API the same way, with
`translate` (items and chat messages, responses and completions) and `response_events` (its
streams); `passthrough` relays every other `/v1` path unchanged.
"""
