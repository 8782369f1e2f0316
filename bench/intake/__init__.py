"""Intake of files: conductor submit and the Batch API against plain XADD, and submit's peak memory."""
