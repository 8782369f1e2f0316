"""The broker's speed and load on Redis: submit and claim, claim contention, the cluster claim, idle fleets,
the handoff."""
