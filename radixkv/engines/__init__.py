"""Engine adapters: inference engines that reuse prompt KV through radixkv.

`radixkv.engines.hf` adapts a Hugging Face causal LM (needs the `hf` extra: transformers);
`radixkv.engines.tiny_llama` builds small random-weight Llama models for tests and benchmarks;
`radixkv.engines.demo` runs two engine processes against a service. Importing this package
imports neither torch nor transformers.
"""
