# Two entry points for a fresh machine (Python 3.10+):
#   make app   - install everything, then open the web UI on the bundled sample traces
#   make test  - install everything, then run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

# verl (tracer.integrations.verl) pins its own transformers, so its tests run in a venv of their own,
# built from nothing: torch first, then verl 0.9.1 with torch held at 2.13.0, then the packages some
# verl modules import without declaring them, then tracer with its app and test extras.
VERL_VENV  ?= .venv-verl
VERL_PY     = $(VERL_VENV)/bin/python
VERL_STAMP  = $(VERL_VENV)/.installed

$(VERL_STAMP): constraints-verl.txt pyproject.toml
	$(PYTHON) -m venv $(VERL_VENV)
	$(VERL_PY) -m pip install --upgrade pip
	$(VERL_PY) -m pip install torch==2.13.0
	$(VERL_PY) -m pip install -c constraints-verl.txt verl==0.9.1
	$(VERL_PY) -m pip install -c constraints-verl.txt cachetools fastapi uvicorn pyzmq msgspec
	$(VERL_PY) -m pip install -c constraints-verl.txt -e '.[verl,app,test]'
	touch $(VERL_STAMP)

.PHONY: app test install clean sample-traces sample-diff-pair test-verl

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -r requirements.txt
	$(PY) -m pip install --no-deps -e .
	touch $(STAMP)

app: $(STAMP)
	$(PY) -m tracer view sample_traces

test: $(STAMP) $(VERL_STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q
	$(MAKE) test-verl

test-verl: $(VERL_STAMP)
	HF_HUB_OFFLINE=1 $(VERL_PY) -m pytest -q -rs -p no:cacheprovider tests/test_verl.py tests/test_checks_verl.py

# Regenerate the committed sample traces: hand-written loops and real TRL GRPO, RLOO and DPO runs (tiny local model, CPU).
SAMPLES = ppo grpo cispo dpo rloo-trl dpo-trl
sample-traces: $(STAMP)
	for algo in $(SAMPLES); do \
	  rm -rf sample_traces/$$algo-tiny; \
	  HF_HUB_OFFLINE=1 $(PY) -m tracer demo --algo $$algo --out sample_traces/$$algo-tiny --steps 3 --seed 0 || exit 1; \
	done
	rm -rf sample_traces/grpo-trl-tiny
	HF_HUB_OFFLINE=1 $(PY) -m tracer demo --algo grpo-trl --out sample_traces/grpo-trl-tiny --steps 4 --seed 0

# Regenerate the bundled diff pair: the GRPO loop and the same loop with one documented change (scorer clipped at
# 2 instead of 3; tracer/demo/diff_pair.py). `tracer diff` and the app's Diff page open on it.
sample-diff-pair: $(STAMP)
	rm -rf sample_traces/grpo-diff-baseline sample_traces/grpo-diff-scorer-clip
	HF_HUB_OFFLINE=1 $(PY) -m tracer.demo.diff_pair sample_traces

clean:
	rm -rf $(VENV) $(VERL_VENV) .pytest_cache tests/output
