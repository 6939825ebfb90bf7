#!/usr/bin/env bash
# The benchmark on one CUDA GPU, bf16-mixed, micro-batch 8 × 1024 tokens, every registered policy and loss head:
#   gpt2   GPT-2 small (L=12, d=768, 12 heads, vocab 50257, sdpa attention, as conf/model/gpt2.yaml)
#   llama  llama-tiny scaled to GPT-2 small's width and depth (L=12, d=768, 12 heads, 4 key/value heads,
#          SwiGLU 2048, vocab 32000, eager attention)
# first the device's calibration (bench.calibrate: its measured: block in the matched conf/gpu entry), then the GPU-only
# tests (pytest -m gpu). Results go to $OUT: gpu.log (everything printed), calibrate.md and catalogue/, <name>.md
# (each benchmark's header, tables and targets), tests.log, bench.tar.gz (every results.csv / results.json /
# table.md).
#
#   OUT=runs/gpu bash bench/gpu.sh
#   BENCH_DEVICE=cpu BENCH_ROUNDS=1 OUT=/tmp/gpu bash bench/gpu.sh micro   # the script's plumbing, on a CPU
#
# An environment without hydra-core/omegaconf and without network: `bash bench/gpu.sh --fetch-wheels` on a machine
# with pip and network writes their wheels to .whl/ (git-ignored); copied along, they are installed from there.
# Each benchmark has its own timeout, so whatever finished still lands in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
DEVICE=${BENCH_DEVICE:-cuda}
ROUNDS=${BENCH_ROUNDS:-10}

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    set -e
    mkdir -p .whl
    read -r hydra omegaconf antlr < <("$PY" -c 'import importlib.metadata as m
print(" ".join(f"{n}=={m.version(n)}" for n in ("hydra-core", "omegaconf", "antlr4-python3-runtime")))')
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl "$hydra" "$omegaconf"
    "$PY" -m pip wheel -q --no-deps -w .whl "$antlr"  # an sdist only: build its pure-Python wheel
    ls -l .whl
    exit 0
fi

: "${OUT:?set OUT to a folder for the results}"
mkdir -p "$OUT"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1

SHAPE=(--batch 8 --seq 1024 --precision bf16-mixed)
GPT2=(--model gpt2 --vocab 50257 --head-vocab 50257)
LLAMA=(--model llama-tiny --vocab 32000 --head-vocab 32000 model.n_layer=12 model.n_embd=768 model.n_head=12
    model.n_kv_head=4 model.mlp_hidden=2048 model.block_size=1024)
if [[ "${1:-}" == "micro" ]]; then  # the plumbing only: tiny shapes, fp32
    SHAPE=(--seq 32 --precision 32-true --overhead-steps 2)
    GPT2=(--model micro --head-vocab 4096)
    LLAMA=(--model llama-tiny --head-vocab 4096 model.n_layer=2 model.n_embd=64)
fi

bench() {  # bench <name> <args...>
    local name=$1
    shift
    echo "== $(date -u +%T) bench.policies $*"
    timeout 240 "$PY" -m bench.policies --device "$DEVICE" --rounds "$ROUNDS" "${SHAPE[@]}" "$@" \
        --out "$WORK/$name" || return 1
    cp "$WORK/$name/table.md" "$OUT/$name.md"
}

main() {
    echo "== $(date -u +%FT%TZ) $(hostname)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
    if ! "$PY" -c "import hydra, omegaconf" 2>/dev/null; then
        compgen -G ".whl/*.whl" >/dev/null || { echo "no hydra/omegaconf and no .whl/: see --fetch-wheels"; return 2; }
        "$PY" -m pip install -q --no-index --no-deps --target "$WORK/site" .whl/*.whl || return 2
        export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    "$PY" -c 'import sys, torch, lightning, hydra
print("python", sys.version.split()[0], "| torch", torch.__version__, "| lightning", lightning.__version__,
      "| cuda", torch.version.cuda, "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")' \
        || return 2

    local rc=0 files
    if [[ "$DEVICE" == "cuda" ]]; then  # first: the catalogue entry's measured: block, which the benchmarks then use
        echo "== $(date -u +%T) bench.calibrate"
        timeout 120 "$PY" -m bench.calibrate --write-matched "$OUT/catalogue" 2>&1 | tee "$OUT/calibrate.md" || rc=1
    fi
    bench gpt2 "${GPT2[@]}" || rc=1
    bench llama "${LLAMA[@]}" || rc=1
    if [[ "$DEVICE" == "cuda" ]]; then
        echo "== $(date -u +%T) pytest -m gpu"
        mapfile -t files < <(grep -l "mark.gpu" tests/test_*.py)
        timeout 90 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider "${files[@]}" 2>&1 | tee "$OUT/tests.log" \
            || rc=1
    fi
    tar czf "$OUT/bench.tar.gz" -C "$WORK" --exclude=site . || rc=1
    return $rc
}

main 2>&1 | tee "$OUT/gpu.log"
exit "${PIPESTATUS[0]}"
