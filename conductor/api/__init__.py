"""The HTTP API (``conductor serve``): OpenAI's Files and Batches API and the status page."""
