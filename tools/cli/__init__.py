"""The `moerules` command: one parser (main), its config flags, and the run/launch subcommands."""
