"""`radixkv gateway`: an OpenAI-compatible HTTP front end that sends each request to the engine
whose radixkv member holds the longest cached prefix of its prompt (radixkv/gateway/http_app.py)."""
