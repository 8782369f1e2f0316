"""The formats of what a caller sends and reads: input lines (native and OpenAI's batch input),
their checks, the request options an OpenAI line carries to the engine, the lines of an input file
(JSON lines or Parquet), the shape signature of an item, and OpenAI's batch output lines. Pure
functions of bytes: nothing here talks to Redis."""
