#!/usr/bin/env bash
# `make gpu OUT=<folder>` (the device machine sets OUT): the CUDA checks CI cannot run, on a GPU machine with no
# network, every result under <folder>. About 7 minutes on an H100 or H200 (estimated; at most ~11 if every step runs
# to its cap): the install (seconds), tests/runtime/test_cuda.py (GPU_TESTS_TIMEOUT s at most), benchmarks/gpu.py once
# per model (GPU_BENCH_TIMEOUT s at most each, of which GPU_BENCH_BUDGET s of timing), benchmarks/host_cost.py on the
# GPU (GPU_HOST_COST_TIMEOUT s), then gpu.py --slices on a reduced grid (GPU_SLICES_TIMEOUT s at most per part). The
# machine's python3 keeps its CUDA torch, pytest and transformers: the venv sees them, and autopipe is installed without
# its dependencies and without the index. Every step runs; the exit status is non-zero where one failed.
set -u -o pipefail

out=${1:?usage: .ci/gpu.sh RESULTS_FOLDER}
PY=${PY:-python3}
VENV=${VENV:-.venv}
tests_timeout=${GPU_TESTS_TIMEOUT:-150}
bench_timeout=${GPU_BENCH_TIMEOUT:-100}
bench_budget=${GPU_BENCH_BUDGET:-30}
host_cost_timeout=${GPU_HOST_COST_TIMEOUT:-60}
slices_timeout=${GPU_SLICES_TIMEOUT:-180}
mkdir -p "$out"
export PYTHONUNBUFFERED=1  # the logs follow the run: a step stopped at its timeout leaves what it printed

if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "make gpu: $PY has no torch; run it on the GPU machine, whose python3 holds its CUDA build (or PY=...)" >&2
    exit 2
fi
# without pip: the machine's pip and setuptools install autopipe (a venv's own setuptools may be too old to build it)
test -x "$VENV/bin/python" || "$PY" -m venv --system-site-packages --without-pip "$VENV" || exit 2
vpy=$VENV/bin/python
if ! "$vpy" -c "import torch" 2>/dev/null; then
    # $PY is itself a venv's (the GPU image's is): --system-site-packages reached its base Python, not the packages
    # beside its torch, so a .pth file puts those on the path
    purelib=$("$vpy" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    "$PY" -c "import site; print('\n'.join(site.getsitepackages()))" >"$purelib/system_site_packages.pth"
fi
if ! "$vpy" -m pip install --no-deps --no-build-isolation --no-index -e . >"$out/install.log" 2>&1; then
    tail -20 "$out/install.log" >&2
    echo "make gpu: installing autopipe without network failed (log: $out/install.log)" >&2
    exit 2
fi
missing=$("$vpy" -c "import importlib.util as u
print(' '.join(m for m in ('pytest', 'tabulate', 'sympy', 'numpy', 'transformers') if not u.find_spec(m)))")
if [ -n "$missing" ]; then
    echo "make gpu: $vpy cannot import $missing; the GPU machine has no network: carry them as wheels" >&2
    exit 2
fi
if ! "$vpy" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "make gpu: $vpy's torch ($("$vpy" -c 'import torch; print(torch.__version__)')) sees no CUDA device" >&2
    exit 2
fi

gpu=$("$vpy" -c "import re, torch
print(re.sub(r'[^a-z0-9]+', '_', torch.cuda.get_device_name().lower()).strip('_'))")
about=$("$vpy" - <<'PY'
import subprocess, torch, transformers
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
print(f"gpu: {torch.cuda.get_device_name()} x {torch.cuda.device_count()}, torch {torch.__version__} "
      f"(CUDA {torch.version.cuda}), transformers {transformers.__version__}, autopipe at {commit or 'unknown'}")
PY
)
status=0

tests=$out/cuda_tests_$gpu.txt
printf '%s\ncommand: pytest tests/runtime/test_cuda.py -v (timeout %s s)\n\n' "$about" "$tests_timeout" >"$tests"
timeout -k 10 "$tests_timeout" "$vpy" -m pytest tests/runtime/test_cuda.py -v -rs --durations=10 -p no:cacheprovider \
    2>&1 | tee -a "$tests"
code=${PIPESTATUS[0]}
[ "$code" = 124 ] && echo "make gpu: test_cuda.py ran past $tests_timeout s and was stopped" | tee -a "$tests"
[ "$code" != 0 ] && status=1

# CUDA graphs: tests then benchmark, each under its own cap (not yet run on a GPU)
graph_tests_timeout=${GPU_GRAPH_TESTS_TIMEOUT:-90}
graph_bench_timeout=${GPU_GRAPH_BENCH_TIMEOUT:-110}
graph_tests=$out/cuda_graphs_tests_$gpu.txt
printf '%s\ncommand: pytest tests/runtime/test_cuda_graphs.py -v (timeout %s s)\n\n' "$about" "$graph_tests_timeout" \
    >"$graph_tests"
timeout -k 10 "$graph_tests_timeout" "$vpy" -m pytest tests/runtime/test_cuda_graphs.py -v -rs --durations=10 \
    -p no:cacheprovider 2>&1 | tee -a "$graph_tests"
code=${PIPESTATUS[0]}
[ "$code" = 124 ] && echo "make gpu: test_cuda_graphs.py ran past $graph_tests_timeout s, stopped" | tee -a "$graph_tests"
[ "$code" != 0 ] && status=1
timeout -k 10 "$graph_bench_timeout" "$vpy" benchmarks/gpu_graphs.py --budget 20 --out "$out/gpu_graphs_$gpu.txt" \
    2>&1 | tee "$out/gpu_graphs_$gpu.log"
code=${PIPESTATUS[0]}
[ "$code" = 124 ] && echo "make gpu: gpu_graphs.py ran past $graph_bench_timeout s, stopped" | tee -a "$out/gpu_graphs_$gpu.log"
[ "$code" != 0 ] && status=1

log=$out/gpu_bench_$gpu.log
echo "$about" >"$log"
for model in transformer cnn; do  # one run each: a model stopped at its timeout leaves the other's table
    timeout -k 10 "$bench_timeout" "$vpy" benchmarks/gpu.py --models "$model" --budget "$bench_budget" \
        --out "$out/gpu_${model}_$gpu.txt" 2>&1 | tee -a "$log"
    code=${PIPESTATUS[0]}
    [ "$code" = 124 ] && echo "make gpu: gpu.py --models $model ran past $bench_timeout s, stopped" | tee -a "$log"
    [ "$code" != 0 ] && status=1
done

timeout -k 10 "$host_cost_timeout" "$vpy" benchmarks/host_cost.py --device cuda --out "$out/host_cost_$gpu.txt" \
    2>&1 | tee -a "$log"
code=${PIPESTATUS[0]}
[ "$code" = 124 ] && echo "make gpu: host_cost.py ran past $host_cost_timeout s, stopped" | tee -a "$log"
[ "$code" != 0 ] && status=1

# Stages on SM slices. The full grid (3 models x K in {2, 4} x M in {4, 8, 16} x 3 schedules, with the
# probe for each K) does not fit make gpu's minutes: this runs the targets only.
echo "make gpu: gpu.py --slices grid cut to: the probe U at K=4; gpt-877M K=4 M=16 gpipe/1f1b/interleaved;" \
     "gpt-135M and resnet50 K=4 M=8 gpipe. Cut: K=2, M=4, the other M and schedules of the smaller models" \
     "(the full grid: python benchmarks/gpu.py --slices 2,4)" | tee -a "$log"
slices=$out/gpu_slices_$gpu.txt
for part in "gpt-877M 16 gpipe,1f1b,interleaved" "gpt-135M,resnet50 8 gpipe --no-probe"; do
    set -- $part
    timeout -k 10 "$slices_timeout" "$vpy" benchmarks/gpu.py --slices 4 --slice-models "$1" --slice-chunks "$2" \
        --slice-schedules "$3" ${4:-} --out "$out/gpu_slices_${1%%,*}_$gpu.txt" 2>&1 | tee -a "$log"
    code=${PIPESTATUS[0]}
    [ "$code" = 124 ] && echo "make gpu: gpu.py --slices ($1) ran past $slices_timeout s, stopped" | tee -a "$log"
    [ "$code" != 0 ] && status=1
done
cat "$out"/gpu_slices_gpt-877M_"$gpu".txt "$out"/gpu_slices_gpt-135M_"$gpu".txt >"$slices" 2>/dev/null
echo "make gpu: results in $out: $(ls "$out" | tr '\n' ' ')"
exit $status
