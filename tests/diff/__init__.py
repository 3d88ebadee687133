"""tracer diff and tracer.testing on trace pairs whose differences are known."""
