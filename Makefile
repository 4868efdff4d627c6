# The README's commands. `make install` sets up .venv; every other target does it when needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev

.PHONY: install test test-slow reliability lesson demo stretch-demo fewshot-demo emergence-demo chat-demo align-demo bench docs docs-serve gpu-check gpu-wheels

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $@

# Two workers, a test file each at a time (its module fixtures are made once): most of the suite's
# time is subprocesses and servers that wait, so two run in about 0.6x the time of one.
test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile

# The documentation site (mkdocs.yml, docs/) into site/; --strict: a broken link or page fails it.
# Material's notice about MkDocs 2 is silenced: the docs extra pins MkDocs 1.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow

# Speed against transformers in one run (needs the hf extra, which the dev install pulls in).
bench: $(STAMP)
	$(BIN)/tinygpt bench --json bench.json

# The GPU check (benchmarks/gpu_check.py): tests/test_gpu.py, `tinygpt bench` and 3 minutes of training on a
# CUDA machine, in about 8 minutes, everything in gpu-check/ and a summary table last. DEVICE=cpu is its dry
# run at the smallest sizes (CI runs it). A machine without the project's .venv (a lent GPU machine, with its
# own torch and no network) runs it with its own Python: make gpu-check CHECK_PYTHON=python3; the wheels in
# .whl/ (make gpu-wheels, here) are installed first for the server's test.
DEVICE ?= cuda
CHECK_PYTHON ?= $(BIN)/python
CHECK_OUT ?= gpu-check
gpu-check: $(if $(filter $(BIN)/python,$(CHECK_PYTHON)),$(STAMP))
	$(CHECK_PYTHON) benchmarks/gpu_check.py --device $(DEVICE) --out $(CHECK_OUT) \
		$(if $(and $(wildcard .whl),$(filter cuda%,$(DEVICE))),--wheels .whl)

# The server test's packages (the serve extra, the openai client) as wheels for a GPU machine's Python 3.12 on
# x86-64, at the versions installed here: into .whl/, about 7 MiB.
gpu-wheels: $(STAMP)
	$(BIN)/python benchmarks/gpu_check.py --download-wheels .whl

# The reliability and security suite with its long variants (30 kills, 2,000 fuzzed bodies, the load
# run); prints the figures docs/RELIABILITY.md reports and keeps them in .reliability-figures.jsonl.
reliability: $(STAMP)
	rm -f .reliability-figures.jsonl
	TINYGPT_FIGURES=$(CURDIR)/.reliability-figures.jsonl $(BIN)/python -m pytest -m reliability

lesson: $(STAMP)
	$(BIN)/tinygpt lesson

# The main job on the built-in corpus: the Python standard library's own source. `demo` trains the
# model its time budget buys (tinygpt's sizing, measured on this machine) with the modern recipe on a
# 1,024-token BPE of the corpus: in five minutes it reaches lower bits per character than the same
# budget spent on characters, or on the 2019 recipe (the README has them); `stretch-demo` trains the
# lesson's homework model (6 x 256, 4.9M parameters), character-level as the lesson is, for the same
# time.
DEMO_DATA := data/python-stdlib-bpe
STRETCH_DATA := data/python-stdlib
DEMO_TIME ?= 5m
DEMO_STEPS = $(BIN)/tinygpt train --data $(1) --out $(2) $(3) --max-time $(DEMO_TIME) \
		--eval-interval 100 --eval-iters 10 && \
	$(BIN)/tinygpt sample $(2) --prompt "def " --max-new-tokens 300 --num-samples 2 --seed 1 && \
	$(BIN)/tinygpt eval $(2) --max-tokens 100000

$(DEMO_DATA)/meta.json: | $(STAMP)
	$(BIN)/tinygpt prepare python-stdlib --tokenizer bpe --vocab-size 1024 --out $(DEMO_DATA)

$(STRETCH_DATA)/meta.json: | $(STAMP)
	$(BIN)/tinygpt prepare python-stdlib --out $(STRETCH_DATA)

demo: $(STAMP) $(DEMO_DATA)/meta.json
	rm -rf runs/demo
	$(call DEMO_STEPS,$(DEMO_DATA),runs/demo,)

stretch-demo: $(STAMP) $(STRETCH_DATA)/meta.json
	rm -rf runs/stretch-demo
	$(call DEMO_STEPS,$(STRETCH_DATA),runs/stretch-demo,--preset stretch)

# Few-shot prompting, measured: a 2-layer model trained on sequences that each hold a fresh random
# letter -> digit mapping learns to read the mapping off its context. About 4 minutes on a 2-core CPU;
# rewrites the figures in docs/. One thread: a step of this model is ~25 ms of arithmetic, and on a
# busy 2-core machine two threads spent 8x the CPU time (10x the wall time) waiting on each other.
FEWSHOT := runs/fewshot-demo
fewshot-demo: export OMP_NUM_THREADS = 1
fewshot-demo: $(STAMP)
	rm -rf $(FEWSHOT)/run $(FEWSHOT)/text
	$(BIN)/tinygpt fewshot-data --out $(FEWSHOT)/text --episodes 60000
	$(BIN)/tinygpt prepare $(FEWSHOT)/text/train.txt --out $(FEWSHOT)/data
	$(BIN)/tinygpt train --data $(FEWSHOT)/data --out $(FEWSHOT)/run --quiet \
		--n-layer 2 --n-head 4 --n-embd 64 --block-size 48 --batch-size 32 --lr 3e-3 --warmup 100 \
		--max-iters 5000 --max-time 8m --eval-interval 500 --arch gpt2 --optimizer adamw --lr-schedule cosine
	$(BIN)/tinygpt plot $(FEWSHOT)/run --out docs/fewshot-demo-loss.png --title "the few-shot demo's training run"
	$(BIN)/tinygpt fewshot $(FEWSHOT)/run --task synthetic --shots 0,1,2,3 --show-prompt --quiet \
		--plot docs/fewshot-demo.png

# Induction heads forming while a model trains: a 2-layer model and a 1-layer control on rows of
# repeated random segments, probed every 10 steps (tinygpt emergence). About a minute on a laptop
# CPU; prints the summary and rewrites docs/emergence-demo.png, then draws the 2-layer run's heads
# (inspect heads) and one induction head and one previous-token head on a repeated sequence
# (docs/images/). One thread, as fewshot-demo: the runs are then the same on every machine.
EMERGENCE := runs/emergence-demo
REPEAT := SUrdVvJgHcSUrdVvJgHc
emergence-demo: export OMP_NUM_THREADS = 1
emergence-demo: $(STAMP)
	rm -rf $(EMERGENCE)
	$(BIN)/tinygpt emergence --out $(EMERGENCE) --quiet
	cp $(EMERGENCE)/emergence.png docs/emergence-demo.png
	$(BIN)/tinygpt inspect heads $(EMERGENCE)/L2 --out docs/images/emergence-heads.png
	$(BIN)/tinygpt attention $(EMERGENCE)/L2 --prompt $(REPEAT) --layer 1 --head 0 --out docs/images/induction-head.png
	$(BIN)/tinygpt attention $(EMERGENCE)/L2 --prompt $(REPEAT) --layer 0 --head 1 \
		--out docs/images/previous-token-head.png

# Chat: a base model on the task's plain text, then a run trained on conversations with the loss on
# the assistant's tokens; exact match on held-out conversations before and after. About 3 minutes on
# a 2-core CPU. One thread, as fewshot-demo, for the same reason.
chat-demo: export OMP_NUM_THREADS = 1
chat-demo: $(STAMP)
	rm -rf runs/chat-demo
	$(BIN)/python benchmarks/chat_demo.py --out runs/chat-demo

# The course's last stage, from nothing: a 2-layer model pretrained on worked sums until it answers 40% of the
# held-out prompts; GRPO for a minute with the task's checker as its only teacher; DPO with the SFT term and
# pure DPO from the same base, on pairs of its own answers. Each run's report and plot (GRPO's copied to docs/
# for the tutorial "Align a model: rewards"). About 3 minutes on a 2-core CPU. One thread, as fewshot-demo,
# for the same reason.
ALIGN := runs/align-demo
align-demo: export OMP_NUM_THREADS = 1
align-demo: $(STAMP)
	rm -rf $(ALIGN)
	$(BIN)/python benchmarks/align_demo.py --out $(ALIGN)
	cp $(ALIGN)/grpo.png docs/align-demo-grpo.png
