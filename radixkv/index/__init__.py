"""The prefix index: a radix tree of token blocks -> pool block ids, with lock counts and an
eviction policy over its unlocked leaves. Pure Python, no I/O; knows nothing of gRPC or memory."""
