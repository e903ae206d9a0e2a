"""The `radixkv` command (`main`), the cache inspector (`inspector`) and the demo (`demo`).
Every subcommand talks to the service through `radixkv.client` only."""
