"""The disk tier: the object store, store segments of waiting items, the producer's spill past
a model's resident_tokens ceiling, the feeder, and results moved to the store."""
