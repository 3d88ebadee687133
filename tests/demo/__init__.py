"""The demo loops, their regression baselines and the benchmark traces."""
