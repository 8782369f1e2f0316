"""Fleets against the oracle: workers joining and leaving, fair share between tenants."""
