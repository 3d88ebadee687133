"""The sampler faults ``tracer demo --algo grpo-vllm --bug NAME`` injects (:mod:`tracer.demo.grpo_vllm`
builds them). A module of its own so that the CLI lists them without importing TRL or vLLM.

- ``raw-logprobs``: the engine reports logprobs before temperature (vLLM ``logprobs_mode="raw_logprobs"``);
- ``top-p`` / ``top-k`` / ``repetition-penalty``: the engine samples with top_p 0.8, top_k 5 or
  repetition_penalty 1.3, which the trainer's logprobs do not apply;
- ``stale-sync``: the trainer's weights never reach the engine after step 0.
"""

VLLM_BUGS = ("raw-logprobs", "top-p", "top-k", "repetition-penalty", "stale-sync")
