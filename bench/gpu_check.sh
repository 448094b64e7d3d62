#!/usr/bin/env bash
# The GPU checks of the kernels, as one short run on a device machine (an H200 with JAX/CUDA,
# flax, orbax and pytest preinstalled; no network): the compiled Pallas kernels against their
# references (tests/test_kernels.py's GPU test compiles every op with mode=pallas), then each
# kernel timed against its reference at full sizes. Results land in $OUT (default /tmp/gpu_check).
#
#     bash bench/gpu_check.sh        # via the device tool: run(command="bash bench/gpu_check.sh", timeout_s=580)
#
# Last, the serving engine on the kernels against the reference path, side by side: the embedded
# SmolLM2 (a 98 MB GGUF) is over the 64 MiB a device run carries, so it serves random weights of
# Llama-3.1-8B's shapes (bench/configs/llama3-8b.json), its first 4 layers (compiles stay short).
# After the kernel tests, the expert-parallel MoE block on ragged_all_to_all against the one-device
# block (one GPU: expert=1, see the step). Each step has its own time limit, 580 s in all at worst.
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
timeout 200 python3 -m pytest -q -rs -o addopts="" tests/test_kernels.py tests/test_kernels_attention.py tests/test_kernels_quant.py tests/test_kernels_sinks.py tests/test_kernels_delta.py::test_compiled_kernels_match_reference_on_gpu 2>&1 | tee "$out/tests.log"
# The expert-parallel MoE block on its GPU exchange, jax.lax.ragged_all_to_all (XLA:CPU cannot
# compile it), compiled and run against the one-device block. This machine has one GPU and GPU
# devices cannot be faked, so the mesh is expert=1: the op runs over a single participant, which
# still compiles and runs XLA:GPU's ragged-all-to-all, but no row crosses devices; the offsets of
# ep > 1 are the same code, tested on CPU through the dense emulation (tests/test_moe_dispatch.py).
timeout 60 python3 -m pytest -q -rs -o addopts="" tests/test_moe_dispatch.py -k platform_exchange 2>&1 | tee "$out/moe_dispatch.log"
timeout 170 python3 bench/kernels.py --json > "$out/kernels.json" 2> "$out/kernels.err"
echo "bench/kernels.py exit $?"
tail -c 3000 "$out/kernels.json"
timeout 150 python3 bench/serving.py --config bench/configs/llama3-8b.json --layers 4 --kernels pallas \
    --requests 8 --prompt-len 128 --new-tokens 32 --skip throughput,widths,memory,formats --json \
    > "$out/serving.json" 2> "$out/serving.err"
echo "bench/serving.py exit $?"
cat "$out/serving.json"
