#!/usr/bin/env bash
# Make vLLM 0.33.0's v1 scheduler and KV cache manager importable on a CPU-only machine, for
# kvmem.integrations.vllm (the conformance suite, `python -m kvmem.integrations.vllm`) and the
# benchmarks' side-by-side figures, without touching the current environment: the vLLM wheel is
# unzipped as source (its compiled extensions are never imported on this path) and only the
# pure-Python / small packages that `vllm.v1.core.sched.scheduler` and `vllm.config` import go
# into a folder of their own (pip --target --no-deps, pinned). torch (a CPU build), numpy,
# pydantic, transformers... come from the current environment (kvmem's `.[dev,hf]` extras).
#
#     bash benchmarks/setup_vllm_cpu.sh [DIR]        # default DIR: /tmp/vllm_env
#     PYTHONPATH=DIR/site:DIR/deps python -m kvmem.integrations.vllm conformance --streams 200
#
# Idempotent: a second run finds the wheel, the unzipped source and the packages in place and
# only re-checks the import (delete DIR to start over). PYTHON=... picks the interpreter.
set -euo pipefail
dir=${1:-/tmp/vllm_env}
py=${PYTHON:-python}
version=0.33.0
mkdir -p "$dir/site" "$dir/deps" "$dir/wheel"

check() {
    PYTHONPATH="$dir/site:$dir/deps" "$py" -c "
import vllm.config, vllm.v1.core.sched.scheduler, vllm.v1.core.sched.async_scheduler
from vllm.config import ModelConfig  # noqa: F401
import vllm
assert vllm.__version__ == '$version', vllm.__version__
print('vllm', vllm.__version__, 'scheduler imports')" 2>/dev/null
}

if check; then
    echo "PYTHONPATH=$dir/site:$dir/deps"
    exit 0
fi

# 1. The wheel, unzipped as source (once).
if ! ls "$dir"/wheel/vllm-$version-*.whl >/dev/null 2>&1; then
    "$py" -m pip download "vllm==$version" --no-deps --only-binary=:all: -d "$dir/wheel"
fi
if [ ! -f "$dir/site/vllm/__init__.py" ]; then
    "$py" -m zipfile -e "$dir"/wheel/vllm-$version-*.whl "$dir/site"
fi

# 2. What the scheduler's import chain needs beyond kvmem's own dependencies, pinned as vLLM
#    0.33.0 pins them (attrs, sniffio, cloudpickle, py-cpuinfo: aiohttp, openai, the engine's
#    serialization and platform detection; einops: ModelConfig inspects the model class).
#    --upgrade makes a rerun over a partial folder replace what it finds.
"$py" -m pip install --quiet --upgrade --target "$dir/deps" --no-deps \
    "fastapi>=0.133.0,<0.137.0" "starlette>=1.0.1" "aiohttp>=3.14.4" "multidict>=6.9.1" \
    aiohappyeyeballs aiosignal frozenlist propcache yarl "openai>=2.25.0" \
    "oss-harmony>=0.0.11" "llguidance>=1.7.0,<1.8.0" "xgrammar==0.2.8" \
    "apache-tvm-ffi==0.1.11" partial-json-parser cachetools cbor2 msgspec pybase64 \
    prometheus_client pyzmq uvloop \
    "attrs==26.1.0" "sniffio==1.3.1" "cloudpickle==3.1.3" "py-cpuinfo==9.0.0" "einops==0.8.2"

# 3. The import must work now; say what is missing otherwise.
if ! check; then
    PYTHONPATH="$dir/site:$dir/deps" "$py" -c "import vllm.v1.core.sched.scheduler; from vllm.config import ModelConfig"
    exit 1
fi
echo "PYTHONPATH=$dir/site:$dir/deps"
