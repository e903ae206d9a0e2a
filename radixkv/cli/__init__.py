"""The `radixkv` command: `main` builds it from one module per command (`commands/`), over the
shared flags (`flags`), the cache summary (`summary`) and what the views print with (`render`).
Every subcommand talks to the service through `radixkv.client.client` only."""
