"""The write path: storing a turn.

`identity` says which conversation an incoming history belongs to (conversation ids, message
hash chains; with `system_prompts`, `rewritten` and `tool_results` for histories a client
reshaped); `store` appends its new messages verbatim under the conversation's lock and reads
them back; `tenants` holds tenants and their gateway keys; `conversations` is the operator's
view (listing, statistics, export, deletion). Nothing here summarizes or retrieves.
"""
