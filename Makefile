# Two commands on a fresh clone:
#   make lab    set everything up, then open the notebooks in JupyterLab (as root too)
#   make test   set everything up, then run unit tests and every notebook (nbval)
# Both create .venv with the Python found as $(PYTHON) (3.10 or newer).
#   make lab LAB_ARGS="--ip=0.0.0.0 --port=8888 --no-browser"   your own JupyterLab options
#   make lab CPU=1   on a machine without an NVIDIA GPU: torch's CPU-only build (see CPU below)
#   make gpu-check   on a CUDA GPU: gpu tests, every lesson, every benchmark; results to benchmarks/RESULTS.md
#   make gpu-check PY=python3   the same with that Python's packages, no .venv (an offline GPU machine: README)
#   make site        run every lesson and write a static site of the results to _site/ (FROM=DIR: lessons executed before)
#   make mutants     each lesson with one gpukit measurement made wrong: do its checks fail? (tests/mutants.py)
#   make fake-cuda-old-torch   the fake-GPU tests again under torch 2.11, the lent GPU machines' (a venv made and removed)

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The lessons' kernelspec says "Python 3" (ipykernel's default): JupyterLab rewrites a notebook whose
# kernelspec differs from the kernel it runs, so opening a lesson would mark it modified.
KERNEL_DISPLAY_NAME := Python 3
# Extra pytest options, e.g. make unit PYTEST_ARGS=--random-order (any order) or PYTEST_ARGS="-k memory".
PYTEST_ARGS ?=
# Processes make test runs the suite in (pytest-xdist; each test file and each lesson runs whole in one of them).
# Two fill CI's two cores: the suite took 17 min instead of about 30 in one. With an NVIDIA GPU, one: lessons
# that time the GPU or fill its memory must not run beside each other. make test TEST_WORKERS=1 runs it in one.
TEST_WORKERS ?= $(if $(shell command -v nvidia-smi 2>/dev/null),1,2)
# Your own JupyterLab options, after gpukit's: `gpukit lab` (gpukit/jupyter.py) adds the save hook that keeps each
# lesson's language_info, so that opening a lesson leaves `git status` clean, and --allow-root as root.
LAB_ARGS ?=
# CPU=1 installs torch's CPU-only build from TORCH_INDEX first (about 0.2 GB, where the default build from PyPI brings
# about 3 GB of CUDA libraries a machine without an NVIDIA GPU never uses). Set TORCH_INDEX to use another index
# (https://download.pytorch.org/whl/cu126 for an older driver, say). To switch an existing .venv: make clean first.
CPU ?=
TORCH_INDEX ?= $(if $(CPU),https://download.pytorch.org/whl/cpu)

# The lessons' site (gpukit/site.py): _site/ is the folder actions/upload-pages-artifact publishes by default.
SITE_DIR := _site
# Empty: run every lesson here. A folder of executed lessons to publish as they are, e.g. the gpu profile's from
# make gpu-check: make site FROM=runs/gpu-check/DATE-TIME/notebooks
FROM ?=

# Empty: use .venv (made by setup). Set to a Python that already has gpukit's dependencies to skip the venv.
PY ?=

.PHONY: lab test setup unit notebooks lint clean gpu-check site mutants fake-cuda-old-torch

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10) and "gpukit needs Python 3.10 or newer; set PYTHON=python3.11 (or another) and run make again.")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(if $(TORCH_INDEX),$(BIN)/python -m pip install --quiet torch torchvision --index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install --quiet -e ".[dev,gpu]"
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 --display-name "$(KERNEL_DISPLAY_NAME)" >/dev/null
	@# Outputs of lessons you run stay out of git: nbstripout as the clone's git filter. Its --install records no
	@# options, and the committed cell ids must stay (nbstripout renumbers them): the filter is set with --keep-id.
	if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then $(BIN)/nbstripout --install && \
		git config filter.nbstripout.clean "'$(abspath $(BIN))/python' -m nbstripout --keep-id"; fi
	@$(if $(TORCH_INDEX),true,command -v nvidia-smi >/dev/null || echo "note: no NVIDIA GPU here, and torch came with \
	its CUDA libraries (about 3 GB). For the CPU-only build: make clean && make lab CPU=1")
	touch $(STAMP)

lab: setup
	$(BIN)/gpukit lab notebooks/ $(LAB_ARGS)

test: setup
	$(BIN)/python -m pytest tests/ --nbval-lax --nbval-kernel-name gpukit-lessons notebooks/ -p no:cacheprovider \
		-n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The unit tests without the slow ones (a browser, strict nbval, the fake GPU's coverage): a few minutes.
unit: setup
	$(BIN)/python -m pytest tests/ -m "not slow" $(PYTEST_ARGS)

notebooks: setup
	$(BIN)/python -m pytest --nbval-lax --nbval-kernel-name gpukit-lessons notebooks/

# Exits 3 at once, running nothing, where there is no CUDA GPU (gpukit/gpucheck.py).
gpu-check: $(if $(PY),,setup)
	$(or $(PY),$(BIN)/python) -m gpukit gpu-check

# Every lesson executed (profile: GPUKIT_PROFILE, else gpukit's choice: tiny on two cores or in CI), one page
# each with its figures and checks; fails naming the lesson and cell if a lesson raised or showed no figure.
site: $(if $(PY),,setup)
	$(or $(PY),$(BIN)/python) -m gpukit site $(SITE_DIR) $(if $(FROM),--from $(FROM))

# Lesson mutation testing: each lesson run (tiny profile) with one of gpukit's measurements made wrong by a known
# factor; prints lesson × mutant (killed, survived, crashed, n/a) and the score. Every lesson × every mutant takes
# hours on two cores: choose, e.g. make mutants MUTANTS_ARGS="--lessons 00 --mutants matmul_tflops_x2 timeit_x2".
MUTANTS_ARGS ?=
mutants: setup
	$(BIN)/python -m tests.mutants $(MUTANTS_ARGS)

# The tests that run gpukit on the fake GPU (tests/fake_cuda.py) again under OLD_TORCH, the lent H100 and H200 machines'
# torch: torch.cuda's Python calls its C functions with other arguments from one version to the next, and the fake must
# take what each passes. A venv in build/ gets torch and torchvision of those versions from PyPI without their
# dependencies; everything else, the CUDA libraries torch loads when imported among them, comes from .venv, after them
# on sys.path. PyPI has only torch's CUDA build for Linux: 531 MB, downloaded in 29 s and installed in 90 s here
# (2026-11-29), 1.2 GB unpacked. The venv is removed afterwards, passed or failed.
OLD_TORCH ?= 2.11.0
OLD_TORCHVISION ?= 0.26.0
OLD_VENV := build/torch-$(OLD_TORCH)
FAKE_CUDA_TESTS = $(shell grep -lP "def test_\w*\x28.*\bfake_cuda\b" tests/test_*.py)
fake-cuda-old-torch: setup
	rm -rf $(OLD_VENV) && $(BIN)/python -m venv $(OLD_VENV)
	$(OLD_VENV)/bin/python -m pip install --quiet --no-deps --no-cache-dir torch==$(OLD_TORCH) \
		torchvision==$(OLD_TORCHVISION) || { rm -rf $(OLD_VENV); exit 1; }
	$(BIN)/python -c "import sysconfig; print(f\"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\")" \
		> "$$($(OLD_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz-dot-venv.pth"
	$(OLD_VENV)/bin/python -c "import torch; assert torch.__version__.startswith('$(OLD_TORCH)'), torch.__version__" \
		&& $(OLD_VENV)/bin/python -m pytest $(FAKE_CUDA_TESTS) -m "not slow" -p no:cacheprovider $(PYTEST_ARGS); \
		status=$$?; rm -rf $(OLD_VENV); exit $$status

lint: setup
	$(BIN)/ruff check gpukit tests benchmarks && $(BIN)/ruff format --check gpukit tests benchmarks

clean:
	-test -x $(BIN)/nbstripout && $(BIN)/nbstripout --uninstall  # the git filter runs .venv's Python
	rm -rf $(VENV) .pytest_cache $(SITE_DIR)
