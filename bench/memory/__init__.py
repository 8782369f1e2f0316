"""Redis memory held bounded: the disk tier and a job of any size through a Redis of fixed size."""
