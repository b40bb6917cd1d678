"""The recall path: from a stored turn to the prompt sent upstream, and reading memory back.

`assemble` is the one entry point of the request path: the client's history as sent when it
fits the budget, else the prompt rebuilt by `prompt` (the prompt builder) around a memory block
(`memory_block`). Retrieval (`retrieval`) reads the query (`query`: route, terms, names,
periods), runs its legs and merges them (`fusion`). `browsing` and `tools` read memory node by
node, for the model (the memory tools) and over MCP. Nothing here reads `memory.build`.
"""
