#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one run of at most 8 minutes on one GPU (each part
# has its own time limit; they add up to 480 s):
#   1. a PixArt-alpha-wide transformer through the in-process pipeline, Inductor stages,
#      against serial eager and serial Inductor, at 2, 4 and 8 chunks without and with
#      CUDA graphs (the cuda_graphs option), and the GPU's busy time a step of each
#   2. `tokpipe generate` on the GPU: PixArt-alpha's pipeline at 1024 px, stale, timed
#      against serial, without and with CUDA graphs, then a released pipeline's ring
#      equal to the serial pipeline in sync mode (tests/slow/test_generate_cuda.py)
#   3. the in-process pipeline at 8 chunks with each call's timestep a view of a schedule
#      (as pipelines pass it, read from a host copy) and a fresh tensor (read by waiting for
#      the device), the steps queued as a pipeline's loop queues them (one wait at the end)
#   4. matmul and attention rates at chunked shapes against the cost model's H200 preset,
#      and the rates chunks="auto" measures on the GPU (tests/unit/test_gpu_rates.py)
#   5. the chunking overhead benchmark with CUDA graphs (without them: the part
#      "overhead", not in the default set; it ran twice alike)
#   6. joint attention's text computed by every chunk against once a step, FLUX.1's
#      widths and text length, 4096 image tokens (1024 px)
#   7. the fused K/V-cache attention kernel's tests, compiled (not interpreted), fp16/bf16
#      (each new shape class is a Triton compile of several seconds: few examples)
#   8. on two GPUs or more only (then past 8 minutes): `tokpipe generate` on two ranks
#      over NCCL, equal to serial in sync mode, then timed in stale mode
# The kernel benchmark (fused against unfused and the library's attention; it ran three
# times, and most of its time is compiling autotuning configurations) is the part "bench",
# not in the default set.
# The parts that measure what is newest come first: a run cut short still reports them.
# Writes one report, $REPORT_DIR/gpu_report.md (default: ./gpu_report), with each part's
# output; a part that fails or runs past its time is marked so and the rest still run.
#
#   bash scripts/gpu_check.sh          (--help: the usage line)
#
# Python packages missing on the machine (diffusers on a bare image) may be put as wheels
# in .whl/ at the repository root: they are installed first, without the network.
# GPU_CHECK_PARTS="pipeline generate timesteps rates graphs text kernels ranks" (the
# default; add "overhead" or "bench") chooses the parts.
set -u
DEFAULT_PARTS="pipeline generate timesteps rates graphs text kernels ranks"
USAGE="usage: [GPU_CHECK_PARTS=\"PART ...\"] [REPORT_DIR=DIR] bash scripts/gpu_check.sh
  GPU_CHECK_PARTS: of $DEFAULT_PARTS (the default), overhead, bench
  REPORT_DIR: where gpu_report.md is written (default: gpu_report, at the repository root)"
case "${1-}" in
    "") ;;
    -h|--help) echo "$USAGE"; exit 0 ;;
    *) echo "$USAGE" >&2; echo "gpu_check.sh: takes no arguments, got: $*" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
# Before anything is written: a machine without a GPU is left as it was.
if ! python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "no CUDA GPU here: nothing to check" >&2
    exit 1
fi
REPORT_DIR=${REPORT_DIR:-gpu_report}
mkdir -p "$REPORT_DIR"
REPORT="$REPORT_DIR/gpu_report.md"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tokpipe_site \
        .whl/*.whl && export PYTHONPATH=/tmp/tokpipe_site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
    || echo "warning: editable install failed; importing from the checkout" >&2

{
    echo "# GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
    echo
    echo '```'
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'triton', triton.__version__)"
    python3 -c "import diffusers; print('diffusers', diffusers.__version__)"
    echo '```'
} >"$REPORT" 2>&1

part() {  # part TITLE SECONDS COMMAND...: run one part, its output into the report
    local title=$1 seconds=$2
    shift 2
    echo "== $title" >&2
    local start=$SECONDS
    local output
    output=$(timeout "$seconds" "$@" 2>&1)
    local status=$?
    echo "$output" | tail -60 >&2
    {
        echo
        echo "## $title"
        echo
        echo "\`$*\`: exit $status after $((SECONDS - start)) s$([ $status = 124 ] && echo " (timed out)")"
        echo
        echo '```'
        echo "$output" | grep -v "should be kept in float32" | tail -80
        echo '```'
    } >>"$REPORT"
}

want() {
    [[ " ${GPU_CHECK_PARTS:-$DEFAULT_PARTS} " == *" $1 "* ]]
}

want pipeline && part "PixArt-alpha widths, in-process pipeline" 125 python3 benchmarks/gpu_pipeline.py \
    --layers 4 --grid 128 128 --chunks 2 4 8 --steps 6 --cuda-graphs --profile
generate="python3 -m tokpipe_compiler.cli generate --released pixart-alpha-xl-2-1024-ms --layers 4 \
--grid 128 128 --steps 8 --dtype bfloat16 --compare"
# the timed runs first (each also reports its distance from serial), then the test
want generate && part "tokpipe generate on the GPU: PixArt-alpha's pipeline, ring" 100 bash -c \
    "$generate && $generate --cuda-graphs \
    && python3 -m pytest -q -p no:cacheprovider tests/slow/test_generate_cuda.py -k one_gpu"
want timesteps && part "PixArt-alpha widths, timesteps as views and as fresh tensors" 75 python3 \
    benchmarks/gpu_pipeline.py --layers 4 --grid 128 128 --chunks 8 --steps 6 --cuda-graphs \
    --timesteps views fresh --queued
want rates && part "Matmul and attention rates at chunked shapes" 35 bash -c \
    "python3 benchmarks/gpu_rates.py && python3 -m pytest -q -p no:cacheprovider tests/unit/test_gpu_rates.py"
want graphs && part "Chunking overhead, CUDA graphs" 50 python3 benchmarks/overhead.py --device cuda \
    --dtype bfloat16 --tokens 1024 4096 --chunks 1 2 4 8 16 --layers 4 --reps 10 --cuda-graphs
want overhead && part "Chunking overhead" 30 python3 benchmarks/overhead.py --device cuda --dtype bfloat16 \
    --tokens 4096 --chunks 1 2 4 8 16 --layers 4 --reps 10
want text && part "Joint attention: text once a step" 40 python3 benchmarks/text_chunks.py --device cuda \
    --dtype bfloat16 --side 128 --heads 24 --chunks 2 4 8 --rounds 3 --reps 5
# The fixed shapes (fp16 and bf16) first: they ran in 46 s on an H200; then the properties.
kernel_tests='python3 -m pytest -v -p no:cacheprovider tests/unit/test_triton_attention.py -k'
want kernels && TOKPIPE_KERNEL_EXAMPLES=8 part "Kernel tests (compiled, 8 examples a property)" 55 \
    bash -c "$kernel_tests 'not matches_reference' && $kernel_tests matches_reference"
want bench && part "Kernel benchmark" 35 python3 benchmarks/gpu_kernels.py --quick
if want ranks && python3 -c "import sys, torch; sys.exit(torch.cuda.device_count() < 2)"; then
    part "tokpipe generate on two GPUs over NCCL" 150 bash -c \
        "python3 -m pytest -q -p no:cacheprovider tests/slow/test_generate_cuda.py -k two_gpus \
        && $generate --ranks 2 && $generate --ranks 2 --cuda-graphs"
fi
echo "report: $REPORT" >&2
