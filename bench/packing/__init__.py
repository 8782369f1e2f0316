"""Batch packing against FIFO peers and the offline oracle: the suite, the sweep, the shape lifecycle."""
