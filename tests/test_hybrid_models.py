"""Real hybrid architectures on kvmem pages (kvmem.integrations.hf_hybrid): small random-weight
transformers models whose every cache lives in a HybridManager's groups, in one GroupPool
buffer, against the same model on transformers' own DynamicCache, teacher-forced: prefill
chunks, decode steps, a fork (tail pages and states copied) and a prefix hit (attention pages,
window pages and the state restored from a checkpoint). fp32 pages, so the logits agree to
rounding."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the hf extra")

from kvmem.allocator import (  # noqa: E402
    FullAttentionSpec,
    IndexerSpec,
    SlidingWindowSpec,
    StateSpec,
)
from kvmem.allocator._group_table import RELEASED  # noqa: E402
from kvmem.cuda import GroupPool  # noqa: E402
from kvmem.errors import ArgumentError, ArgumentTypeError, ConfigError  # noqa: E402
from kvmem.hybrid import HybridManager  # noqa: E402
from kvmem.integrations.hf_hybrid import PagedHybridLM, hybrid_groups  # noqa: E402

VOCAB = 128
TOLERANCE = 1e-4
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              max_position_embeddings=512)
CONFIGS: dict[str, dict[str, Any]] = {
    # sliding layers (window 8) beside global ones
    "gemma3_text": dict(COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
                        sliding_window=8, layer_types=["sliding_attention", "full_attention",
                                                       "sliding_attention", "full_attention"]),
    # the same with attention sinks, eager attention (additive masks) and experts
    "gpt_oss": dict(COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
                    sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
                    max_position_embeddings=131072,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                 "full_attention"]),
    # three gated-delta-net layers (conv + recurrent state), one full attention layer
    "qwen3_next": dict(COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
                       linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32,
                       layer_types=["linear_attention", "linear_attention", "linear_attention",
                                    "full_attention"]),
    # MLA latent cache + DSA indexer keys (top 8: sparse at these lengths); layer 1 reuses
    # layer 0's top-k, so it has no indexer keys
    "glm_moe_dsa": dict(COMMON, num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=32,
                        kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                        index_n_heads=2, index_head_dim=16, index_topk=8, n_routed_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                        indexer_types=["full", "shared", "full"]),
}
PAGE_SIZE = 16
SLIDING_PAGE_SIZE = 4  # the sliding group's own, smaller pages


def tiny_model(model_type: str) -> Any:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **CONFIGS[model_type])
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


class Lockstep:
    """A HybridManager, its GroupPool and the paged model, driven step by step beside the same
    model on a DynamicCache per request (the reference); every step is verified and checked,
    and the largest logit difference is kept."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.layout = hybrid_groups(model.config, torch.float32, PAGE_SIZE, SLIDING_PAGE_SIZE)
        self.manager = HybridManager(self.layout.groups, budget_bytes=4 << 20)
        self.pool = GroupPool(self.manager.allocator, self.layout.fields)
        self.lm = PagedHybridLM(model, self.layout, self.pool)
        self.refs: dict[str, Any] = {}
        self.max_diff = 0.0
        self.num_steps = 0

    def _reference(self, rid: str, tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.model(torch.tensor(tokens)[None], cache=self.refs[rid],
                              use_cache=True).logits[0]

    def admit(self, rid: str, prompt: list[int]) -> int:
        """Admit ``rid``; the reference computes the restored prefix in checkpoint-sized chunks
        (as the request that cached it did). Returns the tokens restored."""
        cached = self.manager.admit(rid, prompt).num_cached_tokens
        self.refs[rid] = transformers.DynamicCache(config=self.model.config)
        C = self.manager.checkpoint_tokens
        for c in range(0, cached, C):
            self._reference(rid, prompt[c : c + C])
        return cached

    def fork(self, parent: str, child: str) -> None:
        self.manager.fork(parent, child)
        self.refs[child] = copy.deepcopy(self.refs[parent])

    def step(self, chunks: dict[str, list[int]]) -> None:
        """One step: each request computes its chunk (after the copies listed so far)."""
        self.pool.copy_pages(self.manager.take_copies())
        ids = list(chunks)
        step = self.manager.reserve(ids, [len(chunks[r]) for r in ids])
        report = self.manager.verify(ids, step)
        assert report.ok, report.aborted
        got = self.lm.forward(torch.tensor([t for r in ids for t in chunks[r]]), step)
        at = 0
        for rid in ids:
            want = self._reference(rid, chunks[rid])
            diff = (got[at : at + len(chunks[rid])] - want).abs().max().item()
            assert diff < TOLERANCE, (rid, self.num_steps, diff)
            self.max_diff = max(self.max_diff, diff)
            at += len(chunks[rid])
        for rid in ids:
            self.manager.commit(rid, chunks[rid])
        self.manager.check()
        self.num_steps += 1


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_scenario(model_type: str) -> Lockstep:
    """Prefill a prompt in chunks ending on checkpoints, decode, fork mid-page and decode both
    with different tokens, then a second prompt sharing 40 tokens: restored at 32 and prefilled
    beside the two decodes."""
    run = Lockstep(tiny_model(model_type))
    C = run.manager.checkpoint_tokens
    assert C == PAGE_SIZE
    prompt = tokens(45, seed=1)
    assert run.admit("a", prompt) == 0
    for c in range(0, len(prompt), C):  # chunks end at 16 and 32: checkpoints, states included
        run.step({"a": prompt[c : c + C]})
    for t in tokens(2, seed=2):
        run.step({"a": [t]})
    assert run.manager.num_tokens("a") % PAGE_SIZE  # the fork copies a partly filled tail page
    run.fork("a", "b")
    for ta, tb in zip(tokens(3, seed=3), tokens(3, seed=4)):
        run.step({"a": [ta], "b": [tb]})
    second = prompt[:40] + tokens(10, seed=5)
    assert run.admit("c", second) == 32  # the longest checkpoint every group restores
    run.step({"a": [5], "c": second[32:], "b": [6]})
    for t in tokens(3, seed=6):
        run.step({"c": [t], "b": [t + 1]})
    return run


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_logits_on_kvmem_pages_match_transformers_cache(model_type: str) -> None:
    """Every step of the scenario (chunks, decodes, a fork, a prefix hit, mixed batches) gives
    the logits of the model on its own DynamicCache, within 1e-4 (fp32)."""
    run = run_scenario(model_type)
    assert run.num_steps == 12
    assert run.max_diff < TOLERANCE


def test_a_sliding_group_releases_pages_behind_its_window() -> None:
    """The gemma3 run keeps only the window's pages in the sliding group (window 8, pages of
    4): the pages behind it went back, and the logits still matched."""
    run = run_scenario("gemma3_text")
    rows = run.manager.pages_of("a", "sliding")
    n = run.manager.num_tokens("a")
    first = (n - 8 + 1) // SLIDING_PAGE_SIZE
    assert (rows[:first] == RELEASED).all() and (rows[first:] >= 0).all()
    assert (run.manager.pages_of("a", "full") >= 0).all()


def test_a_prefix_hit_needs_the_checkpointed_state() -> None:
    """Guards the restore of a state group: the qwen3_next request admitted on a prefix hit
    computes wrong logits if the copy of the checkpoint's state into its slot is skipped
    (the copies take_copies() lists are what makes a hit correct)."""
    run = Lockstep(tiny_model("qwen3_next"))
    prompt = tokens(40, seed=1)
    run.admit("a", prompt)
    for c in range(0, 32, 16):
        run.step({"a": prompt[c : c + 16]})
    assert run.admit("c", [*prompt[:32], 1, 2]) == 32
    copies = run.manager.take_copies()  # a's checkpoint at 32, then c's restore from it
    slot = int(run.manager.pages_of("c", "state")[0])
    assert [(c.group, c.dst == slot) for c in copies] == [("state", False), ("state", True)]
    run.pool.copy_pages(copies[:1])  # the restore is lost
    with pytest.raises(AssertionError, match=r"\('c', 2, "):  # c's logits differ
        run.step({"c": [1, 2]})


GROUPS_READ = [("gemma3_text", "full"), ("gemma3_text", "sliding"), ("gpt_oss", "sliding"),
               ("qwen3_next", "full"),
               ("qwen3_next", "state"), ("glm_moe_dsa", "full"), ("glm_moe_dsa", "indexer")]


@pytest.mark.parametrize(("model_type", "group"), GROUPS_READ)
def test_every_group_is_read_from_its_pages(model_type: str, group: str) -> None:
    """Noise written over one group's pages of a request (its window's pages, its state slot,
    its indexer keys) changes its next logits: the model reads every cache from kvmem's pages,
    none from a copy of its own."""
    run = Lockstep(tiny_model(model_type))
    prompt = tokens(33, seed=1)
    run.admit("a", prompt)
    for c in range(0, 32, 16):
        run.step({"a": prompt[c : c + 16]})
    held = torch.from_numpy(run.manager.pages_of("a", group)).long()
    held = held[held >= 0]
    for name in run.layout.fields[group]:
        view = run.pool.field(group, name)
        at = run.pool.locate(group, held)
        view[at] = torch.randn_like(view[at])
    with pytest.raises(AssertionError, match=r"\('a', 2, "):
        run.step({"a": prompt[32:]})


# -- the groups' bytes ------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_each_groups_bytes_are_what_its_pages_hold(model_type: str) -> None:
    """hybrid_groups' specs charge exactly the bytes the pool's fields hold, and those follow
    from the config by hand."""
    config = transformers.AutoConfig.for_model(model_type, **CONFIGS[model_type])
    layout = hybrid_groups(config, torch.float32, PAGE_SIZE, SLIDING_PAGE_SIZE)
    for spec in layout.groups:
        held = sum(math.prod(s) for s in layout.fields[spec.name].values()) * 4
        assert held == spec.page_bytes
    specs = {g.name: g for g in layout.groups}
    if model_type in ("gemma3_text", "gpt_oss"):
        kv = 2 * 2 * 16 * 4  # k and v, 2 heads of 16, fp32
        assert specs == {"full": FullAttentionSpec("full", 16, 2 * kv),
                         "sliding": SlidingWindowSpec("sliding", 8, 4, 2 * kv)}
    elif model_type == "qwen3_next":
        conv = (2 * 2 * 16 + 4 * 8) * 4  # q, k (2 heads of 16), v (4 heads of 8) x kernel 4
        rec = 4 * 16 * 8  # per value head a 16 x 8 state
        assert specs == {"full": FullAttentionSpec("full", 16, 2 * 2 * 16 * 4),
                         "state": StateSpec("state", 3 * (conv + rec) * 4)}
    else:
        full = FullAttentionSpec("full", 16, 3 * (32 + 8) * 4)  # latent + rope key, 3 layers
        assert specs == {"full": full, "indexer": IndexerSpec("indexer", full, 2 * 16 * 4)}
    # bf16 pages hold half as many bytes
    half = hybrid_groups(config, torch.bfloat16, PAGE_SIZE, SLIDING_PAGE_SIZE)
    assert [g.page_bytes * 2 for g in half.groups] == [g.page_bytes for g in layout.groups]


def test_hybrid_groups_refuses_what_it_cannot_page() -> None:
    config = transformers.AutoConfig.for_model("gemma3_text", **CONFIGS["gemma3_text"])
    config.layer_types = ["sliding_attention", "chunked_attention", "full_attention",
                          "full_attention"]
    with pytest.raises(ConfigError, match="chunked_attention"):
        hybrid_groups(config)
    config = transformers.AutoConfig.for_model("gemma3_text", **CONFIGS["gemma3_text"],
                                               use_bidirectional_attention=True)
    with pytest.raises(ConfigError, match="bidirectional"):
        hybrid_groups(config)


def test_paged_model_refuses_a_pool_of_other_groups() -> None:
    model = tiny_model("gemma3_text")
    layout = hybrid_groups(model.config, torch.float32, PAGE_SIZE, SLIDING_PAGE_SIZE)
    other = hybrid_groups(model.config, torch.float32, PAGE_SIZE, PAGE_SIZE)
    manager = HybridManager(other.groups, budget_bytes=1 << 20)
    with pytest.raises(ConfigError, match="groups"):
        PagedHybridLM(model, layout, GroupPool(manager.allocator, other.fields))


def test_an_attention_implementation_without_masks_is_refused() -> None:
    """The paged model hands its masks to eager or sdpa attention; another implementation
    (which would build its own over keys it does not see) is refused with the fix."""
    run = Lockstep(tiny_model("gemma3_text"))
    run.model.set_attn_implementation("flex_attention")
    run.manager.admit("a", [1, 2, 3])
    step = run.manager.reserve(["a"], 3)
    with pytest.raises(ConfigError, match="set_attn_implementation"):
        run.lm.forward(torch.tensor([1, 2, 3]), step)


def test_bad_input_ids_are_refused_before_a_page_is_written() -> None:
    run = Lockstep(tiny_model("gemma3_text"))
    run.manager.admit("a", [1, 2, 3])
    step = run.manager.reserve(["a"], 3)
    before = run.pool.buffer.clone()
    with pytest.raises(ArgumentError, match="computes 3 tokens"):
        run.lm.forward(torch.tensor([1, 2]), step)
    with pytest.raises(ArgumentError, match="vocabulary"):
        run.lm.forward(torch.tensor([1, 2, VOCAB]), step)
    with pytest.raises(ArgumentTypeError, match="input_ids"):
        run.lm.forward(torch.tensor([1.0, 2.0, 3.0]), step)
    assert torch.equal(run.pool.buffer, before)
