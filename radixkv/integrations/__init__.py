"""Connectors that plug radixkv into inference engines: `vllm/` (a vLLM KV connector) and
`sglang/` (an SGLang HiCache storage backend), over the engine-side helpers they share: `link`
(the client across radixkv restarts), `layout` and `pages_kernel` (engine KV pages <-> radixkv's
canonical blocks), `held` (leases kept for the next call) and `releaser` (Releases and Inserts
sent unwaited). They import radixkv's client side only, never the service."""
