"""The `radixkv` commands, one module each, named for its command. A module defines
`register(sub)`, which adds its parser (flags, help) to the subparsers and sets `func=run`, and
`run(args)`, which runs it and returns the exit status. `COMMANDS` lists them in `--help` order:
a new command is a new module and its name here; radixkv/cli/main.py never changes for one."""

COMMANDS = ("calc", "serve", "demo", "chat", "inspect", "stats", "events", "clear", "replay",
            "router", "route", "gateway")
