"""TRL, verl and vLLM wiring on the real trainers."""
