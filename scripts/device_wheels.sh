#!/usr/bin/env bash
# Build .whl/: the pure-Python (and manylinux cp312) wheels that the GPU image lacks, for `run --carry .whl`
# (scripts/gpu_stage.sh installs them into /tmp/site). The image has torch, transformers, peft, numpy, pandas, pyarrow,
# httpx, anyio, h11, click, requests, aiohttp, sacrebleu, scikit-learn, ... (see the device's KINDS.md); this is the
# rest of what the serve / agents / eval / bench stages import. bitsandbytes goes to .whl_bnb/ (the 64 MiB carry
# limit: carry it alone). Usage: bash scripts/device_wheels.sh [--bnb]
set -eu
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
grep -qx '/.whl_bnb/' .git/info/exclude 2>/dev/null || echo '/.whl_bnb/' >> .git/info/exclude
# pip matches a manylinux tag's glibc number exactly: name each one a wheel may carry
PLAT="--python-version 3.12 --implementation cp --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
for n in 17 24 27 28 31 34 35 39; do PLAT="$PLAT --platform manylinux_2_${n}_x86_64"; done
dl() { python3 -m pip download -q --no-deps --only-binary=:all: $PLAT -d "$1" "${@:2}"; }
mkdir -p .whl
# server + client: polyrl serve, the openai client in the serving smoke tests, structured outputs
dl .whl fastapi starlette opentelemetry-api uvicorn pydantic pydantic-core annotated-types typing-inspection sniffio \
  openai httpx2 httpcore2 truststore distro jiter llguidance==1.9.1 jsonschema jsonschema-specifications referencing rpds-py
# bench baselines: Liger kernels, torchao float8 training, TRL's GRPOTrainer (bench grpo; datasets and its dill /
# multiprocess come with the lm-eval line below)
dl .whl liger-kernel==0.8.5 torchao==0.18.0 trl==1.16.0
# lm-eval-harness 0.4.13 and what it imports beyond the image (bench eval, tests/eval)
dl .whl lm-eval==0.4.13 tenacity==9.2.1 datasets evaluate dill multiprocess more-itertools nltk \
  pytablewriter DataProperty mbstrdecoder pathvalidate tabledata tcolorpy typepy chardet
# sdist-only packages lm-eval needs: built here (pure Python)
python3 -m pip wheel -q --no-deps -w .whl sqlitedict word2number rouge-score
# py-spy: where a server process's threads spend their time (gpu_stage.sh serve-profile)
dl .whl py-spy==0.4.3
if [ "${1:-}" = "--bnb" ]; then mkdir -p .whl_bnb; dl .whl_bnb bitsandbytes==0.50.2; fi
du -sh .whl
