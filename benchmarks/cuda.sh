#!/usr/bin/env bash
# The CUDA checks and figures, in one run on a machine with a GPU: the tests that need CUDA
# (captured decode graphs against the eager path, the Triton attention kernels and their
# model options (windows, chunks, soft-caps, sinks), int4
# dequantisation and int8 matmul, the int4/int8 CUDA layers, the sampler, the whole engine
# against transformers, int4 and int8 served, int8 activations' Triton kernels and start-up
# choice),
# then benchmarks/synthetic.py on random weights of real shapes (the embedded model's file
# is not needed): CUDA graphs against eager decode, side by side, each weight format, and
# transformers of the same shape. Runs from a checkout without installing it.
#
#     bash benchmarks/cuda.sh [OUTDIR]      # logs: OUTDIR/tests.log, OUTDIR/synthetic.log
#
# PYTHON picks the interpreter (default python3); each step has its own time limit, so one
# that hangs or fails does not cost the others.
set -u
out=${1:-.}
mkdir -p "$out"
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
# The C++ kernels are CPU kernels: do not build them here (a build switch).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} SERVELM_NO_KERNELS=1 PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
$py -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"

# A hung test costs a minute, not the step, where pytest-timeout is installed.
pt_timeout=$($py -c "import pytest_timeout" 2>/dev/null && echo "--timeout 60")
timeout 150 $py -m pytest -q -p no:cacheprovider $pt_timeout tests/test_cuda_graphs.py tests/test_triton_attention.py \
    "tests/test_quantization.py::test_cuda_quantized_layers_match_their_weights" \
    "tests/test_quantization.py::test_tinygemm_operands_hold_the_same_weights" \
    "tests/test_quantization.py::test_cuda_probes_run_before_any_graph_capture" \
    "tests/test_quantization.py::test_quantized_layers_take_inputs_without_rows" \
    "tests/test_sampler.py::test_cuda_matches_cpu_paths" tests/test_triton_quant.py \
    tests/test_engine_cuda.py 2>&1 | tee "$out/tests.log"
# Int8 activations (w8a8's Triton form) and the start-up choice of the layers that run it.
timeout 90 $py -m pytest -q -p no:cacheprovider $pt_timeout tests/test_w8a8.py -k "triton or cuda" \
    2>&1 | tee -a "$out/tests.log"
# Triton's attention against the reference with windows, chunks, soft-caps and sinks (the
# cpu backends' cases skip: no C++ kernels here).
timeout 120 $py -m pytest -q -p no:cacheprovider $pt_timeout tests/test_attention.py \
    -k "windows or int8_cache or every_backend" 2>&1 | tee -a "$out/tests.log"
# The quantised KV cache (int8, fp8) in Triton and under captured graphs.
timeout 90 $py -m pytest -q -p no:cacheprovider $pt_timeout tests/test_kv_quant.py -k "triton or graph" \
    2>&1 | tee -a "$out/tests.log"

bench() {
    local limit=$1; shift
    echo "== synthetic.py $*" | tee -a "$out/synthetic.log"
    timeout "$limit" $py benchmarks/synthetic.py "$@" 2>&1 | tee -a "$out/synthetic.log"
}
echo "== roofline" | tee -a "$out/synthetic.log"
timeout 30 $py -m servelm.cli roofline --device cuda --params 8e9 --layers 32 --heads 32 \
    --kv-heads 8 --head-dim 128 --batches 1,64 --prompt-lens 512 2>&1 | tee -a "$out/synthetic.log"
bench 60 --shape smollm2-135m --batch 1,8,64 --transformers
bench 90 --shape llama3-8b --batch 1,64 --transformers
# Decode attention in place (Triton) against gather + SDPA, 64 streams of 1,000 tokens.
bench 60 --shape llama3-8b --batch 64 --context 1000 --modes eager,gather
echo "== int4 kernels by rows" | tee -a "$out/synthetic.log"
timeout 45 $py benchmarks/cuda_int4.py 2>&1 | tee -a "$out/synthetic.log"
echo "== w8a8 (int8 activations) by rows" | tee -a "$out/synthetic.log"
timeout 60 $py benchmarks/cuda_w8a8.py 2>&1 | tee -a "$out/synthetic.log"
bench 60 --shape llama3-8b --quantization int4 --batch 1,64
bench 40 --shape smollm2-135m --quantization int4 --batch 1,64
bench 60 --shape llama3-8b --quantization int8 --batch 1,64
bench 40 --shape smollm2-135m --quantization int8 --batch 1,64
