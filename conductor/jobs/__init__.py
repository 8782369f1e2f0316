"""Job operations: a job's lifecycle (status, cancel, expiry), the job list, the dead letter,
retention, and results in OpenAI's output format."""
