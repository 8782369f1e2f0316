"""The Redis contract: every key name, the schema version, the Lua scripts and one typed wrapper per
script, the per-model thresholds, and the records that cross Redis (items, batches, results)."""
