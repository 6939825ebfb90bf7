#!/usr/bin/env bash
# The benchmark on one GPU: GPT-2 small (L=12, d=768, 12 heads, vocab 50257), T=1024, batch 8, bf16, every policy,
# with fused (sdpa, the conf default) and eager attention; then the GPU-only tests. Under ten minutes on an H200.
#
# 1. Here, on a machine with pip and network, once: fetch the pure-Python packages bench.policies and the tests
#    import that the GPU image lacks (hydra-core, omegaconf, antlr4-python3-runtime; torch, lightning, numpy,
#    matplotlib, pyyaml and pytest are there) into .whl/ (git-ignored), at the versions of this venv:
#
#        bash bench/gpu.sh --fetch-wheels
#
# 2. On the lent GPU (the device tool): run(command="bash bench/gpu.sh", carry=[".whl"], timeout_s=600).
#    Everything lands in $OUT (at most 8 files come back): gpu.log (all output), gpt2_sdpa.md and gpt2_eager.md
#    (each benchmark's header, table and targets), tests.log, and bench.tar.gz (every results.csv/.json/table.md).
#    Elsewhere, OUT=<folder> bash bench/gpu.sh does the same on any CUDA machine. A dry run of the script's own
#    plumbing on a CPU: BENCH_DEVICE=cpu BENCH_MODEL=micro OUT=/tmp/gpu bash bench/gpu.sh
#
# Budget (H200, estimated, not yet measured): each benchmark ~1-2 min (GPT-2 init, 9 policies x (memory, FLOPs and
# 2+20 timed steps of ~30-80 ms), 40 Lightning/bare step pairs), the tests < 1 min. Each part has its own timeout
# so the whole stays under 10 minutes and whatever finished still comes back.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
DEVICE=${BENCH_DEVICE:-cuda}
MODEL=${BENCH_MODEL:-gpt2}

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    set -e
    mkdir -p .whl
    versions=$("$PY" -c 'import importlib.metadata as m; print(" ".join(f"{n}=={m.version(n)}" for n in ("hydra-core", "omegaconf", "antlr4-python3-runtime")))')
    read -r hydra omegaconf antlr <<<"$versions"
    # hydra-core and omegaconf ship pure-Python wheels; antlr4-python3-runtime 4.9.x is an sdist only, so its
    # (pure-Python) wheel is built here.
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d .whl "$hydra" "$omegaconf"
    "$PY" -m pip wheel -q --no-deps -w .whl "$antlr"
    ls -l .whl
    exit 0
fi

: "${OUT:?set OUT to a folder for the results (the device tool sets it)}"
mkdir -p "$OUT"
WORK=$(mktemp -d)
export PYTHONUNBUFFERED=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 DEVICE

CHECK_ENV='
import importlib.metadata as m, os, sys, torch
names = ("torch", "lightning", "hydra-core", "omegaconf", "matplotlib", "pytest")
print("python", sys.version.split()[0], "|", ", ".join(f"{n} {m.version(n)}" for n in names))
if os.environ["DEVICE"] == "cuda":
    if not torch.cuda.is_available():
        sys.exit(f"no CUDA device visible to torch {torch.__version__}: this script is for a GPU machine")
    print("cuda", torch.version.cuda, "|", torch.cuda.get_device_name(), "| bf16:", torch.cuda.is_bf16_supported())
'

main() {
    echo "== $(date -u +%FT%TZ) $(hostname)"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>/dev/null || true
    if ! "$PY" -c "import hydra, omegaconf" 2>/dev/null; then
        if ! compgen -G ".whl/*.whl" >/dev/null; then
            echo "hydra/omegaconf missing and no .whl/ carried: run 'bash bench/gpu.sh --fetch-wheels' here first"
            return 2
        fi
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || return 2
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    "$PY" -c "$CHECK_ENV" || return 2

    local rc=0 attention files
    for attention in sdpa eager; do
        echo "== bench.policies --device $DEVICE --model $MODEL --attention $attention"
        timeout 240 "$PY" -m bench.policies --device "$DEVICE" --model "$MODEL" --attention "$attention" \
            --rounds 20 --overhead-steps 40 --out "$WORK/${MODEL}_$attention" || rc=1
        cp "$WORK/${MODEL}_$attention/table.md" "$OUT/${MODEL}_$attention.md" 2>/dev/null || true
    done

    echo "== pytest -m gpu"
    # Only the files that hold GPU tests: collecting the others would import what this image may lack (datasets).
    mapfile -t files < <(grep -l "mark.gpu" tests/test_*.py)
    timeout 150 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider "${files[@]}" 2>&1 | tee "$OUT/tests.log" || rc=1

    (cd "$WORK" && tar czf "$OUT/bench.tar.gz" .) || true
    for f in "$OUT/${MODEL}"_*.md; do
        if [[ -f "$f" ]]; then
            printf '\n== %s\n' "$(basename "$f")"
            cat "$f"
        fi
    done
    return $rc
}

main 2>&1 | tee "$OUT/gpu.log"
exit "${PIPESTATUS[0]}"
