# kvmem.testing: files named for their roles (module paths, dotted and as file paths).
s/kvmem\.testing\._engine_protocol\b/kvmem.testing._fuzz_protocol/g
s/kvmem\.testing\._engines\b/kvmem.testing._fuzz_registry/g
s/kvmem\.testing\._slot_engine\b/kvmem.testing._fuzz_slots/g
s/kvmem\.testing\._manager_engine\b/kvmem.testing._fuzz_manager/g
s/kvmem\.testing\._toy_adapter\b/kvmem.testing._fuzz_toy/g
s/kvmem\.testing\._vllm_engine\b/kvmem.testing._fuzz_vllm/g
s/kvmem\.testing\._toy_engine\b/kvmem.testing._toy/g
s|kvmem/testing/_engine_protocol\.py|kvmem/testing/_fuzz_protocol.py|g
s|kvmem/testing/_engines\.py|kvmem/testing/_fuzz_registry.py|g
s|kvmem/testing/_slot_engine\.py|kvmem/testing/_fuzz_slots.py|g
s|kvmem/testing/_manager_engine\.py|kvmem/testing/_fuzz_manager.py|g
s|kvmem/testing/_toy_adapter\.py|kvmem/testing/_fuzz_toy.py|g
s|kvmem/testing/_vllm_engine\.py|kvmem/testing/_fuzz_vllm.py|g
s|kvmem/testing/_toy_engine\.py|kvmem/testing/_toy.py|g
# The vLLM conformance harness's types (kvmem.integrations.vllm.conformance / ._streams), renamed
# so that no two kvmem types share a name: RequestSpec -> StreamRequest (kvmem.testing keeps its
# RequestSpec), StepRecord -> StreamStep (kvmem.allocator keeps its StepRecord). Apply these two
# only to files that use the vLLM harness's types (the tests/test_vllm_*.py and
# test_doc_promises_vllm.py of today), never to files using kvmem.testing.RequestSpec or
# kvmem.allocator's StepRecord; then `ruff check --fix` re-sorts the import lists.
s/\bRequestSpec\b/StreamRequest/g
s/\bStepRecord\b/StreamStep/g
# The vLLM adapter's queue is an object it holds (FlushQueue): tests that peek at the queue.
s/adapter\._q_commits\b/adapter._queue.commits/g
s/adapter\._q\b/adapter._queue.entries/g
