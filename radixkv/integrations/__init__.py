"""Connectors that plug radixkv into inference engines (vLLM; `layout` maps engine KV pages to
radixkv's canonical block layout and is shared by them)."""
