"""The build path: background work that turns stored messages into the summary tree.

`jobs` is the durable queue in Postgres and `worker` the loop that runs it. For a conversation's
job, `tree` embeds new messages (`indexing`: vector, `importance`, `passages`), closes level-1
`segments`, writes their summaries (`summarize`, which keeps key `facts`) and rolls them up 8 → 1
level by level. Nothing here is on the request path, and nothing here reads `memory.recall`.
"""
