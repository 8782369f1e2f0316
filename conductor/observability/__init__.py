"""Metrics and read-only views: worker and broker figures, the exporter, live workers, and the
model overview of ``conductor inspect``."""
