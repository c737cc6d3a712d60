"""Build a :class:`ModelSpec` from a Hugging Face ``config.json``.

Supported ``model_type`` families (multimodal wrappers are read through ``text_config``):

====================================  ===================================================
llama, mistral, qwen2, qwen3          dense GQA
qwen2_moe, qwen3_moe                  GQA + routed (and shared) experts
glm4_moe                              GQA + routed and shared experts, leading dense layers
deepseek_v2, deepseek_v3, kimi_k2,    MLA + routed and shared experts
kimi_k25 (text_config)
glm_moe_dsa                           MLA + DSA indexer (IndexShare via ``indexer_types``)
gpt_oss                               GQA with sliding-window layers (``layer_types``) + experts
====================================  ===================================================

Anything else, or a config missing a field its family needs, raises :class:`ConfigError` naming
what is missing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvmem._validate import is_integer_like, show
from kvmem.errors import ArgumentTypeError, ConfigError, KVMemError
from kvmem.planning._spec import (
    AttentionSpec,
    IndexerSpec,
    ModelSpec,
    MoESpec,
    VisionSpec,
    WeightFormat,
    WeightScheme,
)

__all__ = ["SUPPORTED_MODEL_TYPES", "load_hf_config", "model_from_hf_config"]

_DENSE = ("llama", "mistral", "qwen2", "qwen3")
_GQA_MOE = ("qwen2_moe", "qwen3_moe", "glm4_moe")
_MLA = ("deepseek_v2", "deepseek_v3", "kimi_k2", "glm_moe_dsa")
SUPPORTED_MODEL_TYPES: tuple[str, ...] = (*_DENSE, *_GQA_MOE, *_MLA, "kimi_k25", "gpt_oss")


def load_hf_config(path: str | Path, name: str | None = None) -> ModelSpec:
    """Read a ``config.json`` (or a folder holding one) into a :class:`ModelSpec`."""
    if not isinstance(path, (str, Path)):
        raise ArgumentTypeError(f"path={show(path)}: expected a str or Path to a config.json.")
    if name is not None and not isinstance(name, str):
        raise ArgumentTypeError(f"name={show(name)}: expected None or a str.")
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(
            f"no Hugging Face config at {str(path)!r}; pass a config.json or its folder."
        )
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p} is not valid JSON: {exc}.") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {p}: {exc.strerror or exc}.") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{p} holds a JSON {type(cfg).__name__}, not an object.")
    default_name = p.parent.name or "hf-model"
    return model_from_hf_config(cfg, name=name or default_name, source=str(p))


class _Fields:
    """Reads fields of one config dict, naming the missing one in the error."""

    def __init__(self, cfg: dict[str, Any], model_type: str) -> None:
        self.cfg = cfg
        self.model_type = model_type

    def need(self, key: str) -> Any:
        value = self.cfg.get(key)
        if value is None:
            raise ConfigError(
                f"config.json (model_type {self.model_type!r}) lacks {key!r}, which kvmem needs "
                "to size this model; add it or describe the model with ModelSpec."
            )
        return value

    def get(self, key: str, default: Any) -> Any:
        value = self.cfg.get(key)
        return default if value is None else value

    def count(self, key: str, default: int | None = None) -> int:
        """``key`` as an integer (``default`` when absent, required without one): a float, a
        bool or a string is refused, not truncated or parsed."""
        value = self.need(key) if default is None else self.get(key, default)
        if not is_integer_like(value):
            raise ConfigError(
                f"config.json (model_type {self.model_type!r}) has {key}={show(value)}: "
                "expected an integer; fix the config or describe the model with ModelSpec."
            )
        return int(value)


def model_from_hf_config(
    cfg: dict[str, Any], name: str = "hf-model", source: str = "config.json"
) -> ModelSpec:
    """Build a :class:`ModelSpec` from a parsed ``config.json`` dict."""
    if not isinstance(cfg, dict):
        raise ArgumentTypeError(f"cfg={show(cfg)}: expected the dict of a parsed config.json.")
    for label, value in (("name", name), ("source", source)):
        if not isinstance(value, str):
            raise ArgumentTypeError(f"{label}={show(value)}: expected a str.")
    try:
        return _model_from_hf_config(cfg, name, source)
    except KVMemError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, ArithmeticError) as exc:
        # A field of the wrong type (a string where a count belongs, a list for a dict) fails
        # in the arithmetic that sizes the model: report it as the config's fault.
        raise ConfigError(
            f"{source}: a field has a value kvmem cannot use ({type(exc).__name__}: {exc}); "
            "check the counts and sizes in it, or describe the model with ModelSpec."
        ) from None


def _model_from_hf_config(cfg: dict[str, Any], name: str, source: str) -> ModelSpec:
    model_type, body = _text_model(cfg)
    f = _Fields(body, model_type)
    layers = f.count("num_hidden_layers")
    hidden = f.count("hidden_size")
    heads = f.count("num_attention_heads")
    tied = f.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    if not isinstance(tied, bool):  # (bool("false") is True)
        raise ConfigError(f"{source}: tie_word_embeddings={show(tied)} is not a JSON true or "
                          "false; fix the config, or describe the model with ModelSpec.")
    common: dict[str, Any] = dict(
        name=name,
        source=source,
        num_layers=layers,
        hidden_size=hidden,
        vocab_size=f.count("vocab_size"),
        tie_word_embeddings=tied,
    )
    quant = body.get("quantization_config") or cfg.get("quantization_config")
    attention = _attention(f, model_type, heads, hidden)
    moe, num_dense = _moe(f, model_type, layers)
    indexer = None
    if model_type == "glm_moe_dsa":
        types = body.get("indexer_types")
        own = sum(1 for t in types if t == "full") if isinstance(types, list) else layers
        indexer = IndexerSpec(
            head_dim=f.count("index_head_dim"),
            num_heads=f.count("index_n_heads"),
            num_cache_layers=own,
        )
    vision = _vision(cfg.get("vision_config"))
    return ModelSpec(
        **common,
        attention=attention,
        indexer=indexer,
        num_dense_layers=num_dense,
        intermediate_size=f.count("intermediate_size", 0) if num_dense else 0,
        moe=moe,
        num_mtp_layers=f.count("num_nextn_predict_layers", 0),
        vision=vision,
        weights=_weights(quant, moe is not None),
    )


def _text_model(cfg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The language model's ``model_type`` and config dict (a multimodal wrapper's
    ``text_config``); refuses a type kvmem does not read."""
    top_type = cfg.get("model_type")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else None
    model_type = top_type
    if top_type == "kimi_k25" or (top_type not in SUPPORTED_MODEL_TYPES and text is not None):
        if text is None:
            raise ConfigError(f"config.json (model_type {top_type!r}) lacks 'text_config'.")
        model_type = text.get("model_type")
        body = text
    else:
        body = cfg
    if model_type not in SUPPORTED_MODEL_TYPES or model_type == "kimi_k25":
        raise ConfigError(
            f"config.json model_type {model_type!r} is not supported; kvmem reads "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}. Describe other models with ModelSpec."
        )
    return str(model_type), body


def _attention(f: _Fields, model_type: str, heads: int, hidden: int) -> AttentionSpec:
    """MLA for the DeepSeek-style families; else GQA (MHA when every head has its own KV),
    with the sliding-window layers ``layer_types`` names."""
    if model_type in _MLA:
        return AttentionSpec(
            kind="mla",
            num_heads=heads,
            kv_lora_rank=f.count("kv_lora_rank"),
            qk_rope_head_dim=f.count("qk_rope_head_dim"),
            qk_nope_head_dim=f.count("qk_nope_head_dim"),
            v_head_dim=f.count("v_head_dim"),
            q_lora_rank=f.get("q_lora_rank", None),
        )
    kv_heads = f.count("num_key_value_heads", heads)
    head_dim = f.count("head_dim", hidden // heads)
    sliding, window = 0, None
    layer_types = f.cfg.get("layer_types")
    if isinstance(layer_types, list):
        sliding = sum(1 for t in layer_types if t == "sliding_attention")
        if sliding:
            window = f.count("sliding_window")
    return AttentionSpec(
        kind="gqa" if kv_heads != heads else "mha",
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        sliding_window=window,
        num_sliding_layers=sliding,
    )


def _moe(f: _Fields, model_type: str, layers: int) -> tuple[MoESpec | None, int]:
    """The MoE part and the number of dense layers."""
    if model_type in _DENSE:
        return None, layers
    if model_type == "gpt_oss":
        experts = f.count("num_local_experts", 0) or f.count("num_experts")
        top_k = f.count("num_experts_per_tok", 0) or f.count("experts_per_token")
        return MoESpec(
            num_layers=layers,
            num_experts=experts,
            top_k=top_k,
            intermediate_size=f.count("intermediate_size"),
        ), 0
    if model_type in ("qwen2_moe", "qwen3_moe"):
        dense_only = set(f.get("mlp_only_layers", []))
        step = f.count("decoder_sparse_step", 1)
        moe_layers = sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
        shared_size = f.count("shared_expert_intermediate_size", 0)
        return MoESpec(
            num_layers=moe_layers,
            num_experts=f.count("num_experts"),
            top_k=f.count("num_experts_per_tok"),
            intermediate_size=f.count("moe_intermediate_size"),
            num_shared_experts=1 if shared_size else 0,
            shared_intermediate_size=shared_size or None,
        ), layers - moe_layers
    # DeepSeek-style: the first `first_k_dense_replace` layers are dense.
    mlp_types = f.cfg.get("mlp_layer_types")
    if isinstance(mlp_types, list):
        dense = sum(1 for t in mlp_types if t == "dense")
    else:
        dense = f.count("first_k_dense_replace", 0)
    return MoESpec(
        num_layers=layers - dense,
        num_experts=f.count("n_routed_experts"),
        top_k=f.count("num_experts_per_tok"),
        intermediate_size=f.count("moe_intermediate_size"),
        num_shared_experts=f.count("n_shared_experts", 0),
    ), dense


def _vision(vc: Any) -> VisionSpec | None:
    """A rough vision tower: ``layers * (4 h^2 + 2 h * intermediate)`` parameters."""
    if not isinstance(vc, dict):
        return None
    layers = vc.get("num_hidden_layers") or vc.get("vt_num_hidden_layers") or vc.get("depth")
    hidden = vc.get("hidden_size") or vc.get("vt_hidden_size")
    if not layers or not hidden:
        return None
    inter = vc.get("intermediate_size") or vc.get("vt_intermediate_size") or 4 * hidden
    params = int(layers) * (4 * int(hidden) ** 2 + 2 * int(hidden) * int(inter))
    return VisionSpec(num_params=params, num_layers=int(layers), hidden_size=int(hidden))


def _weights(quant: Any, has_experts: bool) -> WeightScheme:
    """The checkpoint's weight formats from ``quantization_config`` (BF16 without one)."""
    if not isinstance(quant, dict):
        return WeightScheme()
    method = quant.get("quant_method")
    if method == "fp8":
        block = quant.get("weight_block_size") or [128, 128]
        fp8 = WeightFormat(kind="fp8", block_size=int(block[0]))
        return WeightScheme(attention=fp8, dense_mlp=fp8, shared_experts=fp8, routed_experts=fp8)
    if method == "mxfp4":
        return WeightScheme(routed_experts=WeightFormat(kind="mxfp4"))
    if method == "compressed-tensors":
        for group in (quant.get("config_groups") or {}).values():
            w = (group or {}).get("weights") or {}
            if w.get("num_bits") == 4 and w.get("type", "int") == "int":
                fmt = WeightFormat(
                    kind="int4",
                    group_size=int(w.get("group_size") or 128),
                    zero_point=not w.get("symmetric", True),
                )
                if has_experts:
                    return WeightScheme(routed_experts=fmt)
                return WeightScheme(attention=fmt, dense_mlp=fmt)
    return WeightScheme()
