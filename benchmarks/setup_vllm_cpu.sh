#!/usr/bin/env bash
# Make vLLM's KV cache manager importable on a CPU-only machine, for bench_manager.py's
# side-by-side figures, without touching the current environment: the vLLM 0.33.0 wheel is
# unzipped as source (its compiled extensions are never imported on this path) and only the
# pure-Python / small packages that `vllm.v1.core.kv_cache_manager` imports go into a folder
# of their own (pip --target --no-deps, pinned as vLLM 0.33.0 pins them). torch (a CPU build),
# numpy, pydantic, transformers... come from the current environment.
#
#     bash benchmarks/setup_vllm_cpu.sh [DIR]        # default DIR: /tmp/vllm_env
#     PYTHONPATH=DIR/site:DIR/deps taskset -c 1 python benchmarks/bench_manager.py
set -euo pipefail
dir=${1:-/tmp/vllm_env}
mkdir -p "$dir/site" "$dir/deps"
pip download vllm==0.33.0 --no-deps --only-binary=:all: -d "$dir/wheel"
python -m zipfile -e "$dir"/wheel/vllm-0.33.0-*.whl "$dir/site"
pip install --target "$dir/deps" --no-deps \
    "fastapi>=0.133.0,<0.137.0" "starlette>=1.0.1" "aiohttp>=3.14.4" "multidict>=6.9.1" \
    aiohappyeyeballs aiosignal frozenlist propcache yarl "openai>=2.25.0" \
    "oss-harmony>=0.0.11" "llguidance>=1.7.0,<1.8.0" "xgrammar==0.2.8" \
    "apache-tvm-ffi==0.1.11" partial-json-parser cachetools cbor2 msgspec pybase64 \
    prometheus_client pyzmq uvloop
export PYTHONPATH="$dir/site:$dir/deps"
python -c "from vllm.v1.core.kv_cache_manager import KVCacheManager; import vllm; print('vllm', vllm.__version__, 'imports')"
echo "PYTHONPATH=$PYTHONPATH"
