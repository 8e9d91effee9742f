"""The worker runtimes, one per vLLM worker: `PrefillWorker` publishes KV and holds finished requests,
`DecodeWorker` reads a request's KV; their threads live here, at the edge.

Built on `core`, `wire` and `transport`.
"""
