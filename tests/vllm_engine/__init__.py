"""The real vLLM engine (run in the vLLM venv: make test-vllm)."""
