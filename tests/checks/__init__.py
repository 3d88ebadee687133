"""tracer check: each check on hand-written and real runs."""
