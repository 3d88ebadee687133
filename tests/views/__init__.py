"""tracer.views: the per-algorithm tables the app shows."""
