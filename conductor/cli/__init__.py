"""The command line (``conductor``), one module per group of commands."""
