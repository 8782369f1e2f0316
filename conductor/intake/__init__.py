"""Intake: input lines and files checked at the edge, then submitted through one path (the CLI,
the HTTP API and a library caller that submits a file all use conductor/intake/file_intake.py)."""
