"""The command line: tracer info / view / demo and what a user reads."""
