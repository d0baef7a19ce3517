"""The `prism` command line: one console script, one module per subcommand (main.py)."""
