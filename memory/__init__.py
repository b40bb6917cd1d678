"""memstrata's domain: every message kept verbatim, summarized into a tree, recalled into a
bounded prompt. It knows nothing of HTTP (`gateway` is the edge).

A message takes three paths, one sub-package each:

- `memory.write`: storing a turn (the request path): which conversation a history belongs to,
  its messages appended verbatim, tenants and their keys, conversations as operators see them.
- `memory.build` (background): the durable job queue and its workers, segments, summaries,
  the summary tree, and what a node gains when indexed (vectors, importance, passages).
- `memory.recall` (the read path): query routing, hybrid retrieval and rank fusion, the prompt
  builder and its memory block, browsing node by node, and the memory tools.

`build` and `recall` never import each other; both may read what `write` stored. The
foundations they share sit at this package's root: `db` (engine, transactions, migrations),
`schema` (tables), `errors` (the one exception hierarchy), `tokens` (counting), `embeddings`
(the embedder interface and its implementations), `text` (word lists and the sentence
splitter) and `postgres` (the embedded server).
"""
