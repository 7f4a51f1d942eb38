"""A model's shape from its Hugging Face config.json, as its users keep it.

Fields read (a nested `text_config`, as multimodal models keep it, wins over the top level
except for the dtype): num_hidden_layers (n_layer, num_layers), num_attention_heads (n_head),
num_key_value_heads (num_kv_heads; multi_query: 1; default: the q heads), head_dim (default
hidden_size / heads), torch_dtype or dtype, intermediate_size (x num_experts_per_tok for a
mixture of experts: the experts one token reads), vocab_size. A float32 config is served as
vLLM's dtype="auto" serves it: fp16, bf16 for the model types vLLM refuses in fp16 (Gemma 2 and
3, GLM-4, PLaMo 2). Multi-head latent attention and layers that are not attention are refused
in one line naming the nearest shape questprof runs. Every problem is one ConfigError line.
"""

from __future__ import annotations

import json
from pathlib import Path

from questprof.core.config import HEAD_DIMS, ConfigError

CONFIG_FILE = "config.json"
_DTYPES = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32",
           "float": "fp32"}
_NO_FP16 = {"gemma2", "gemma3", "gemma3_text", "glm4", "plamo2"}  # vLLM's fp16 refusals
_ALIASES = {"layers": ("num_hidden_layers", "n_layer", "num_layers"),
            "q_heads": ("num_attention_heads", "n_head"),
            "hidden": ("hidden_size", "n_embd", "d_model")}
ATTENTION_LAYERS = {"full_attention", "sliding_attention"}


def config_path(path) -> Path | None:
    """The config.json that `path` names (the file, or a folder holding one), else None."""
    path = Path(path)
    if path.is_dir() and (path / CONFIG_FILE).is_file():
        return path / CONFIG_FILE
    return path if path.is_file() and path.suffix == ".json" else None


def read_config(path: Path) -> dict:
    """The config's fields, the text model's (text_config) over the top level's."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not a readable JSON file: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a model config (a JSON object)")
    text = data.get("text_config")
    if isinstance(text, dict):
        top_dtype = {k: data[k] for k in ("torch_dtype", "dtype") if data.get(k)}
        data = {**data, **text, **top_dtype}
    return data


def _int(data: dict, names, where: str, required: bool = True) -> int | None:
    """The first of `names` present, as a positive integer."""
    for name in names:
        value = data.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{where}: field {name} must be a positive integer, got {value!r}")
        return value
    if required:
        raise ConfigError(f"{where}: missing field {names[0]}")
    return None


def _arch(data: dict) -> str:
    archs = data.get("architectures")
    return archs[0] if isinstance(archs, list) and archs else str(data.get("model_type", "model"))


def _refuse_unsupported(data: dict, where: str, q_heads: int) -> None:
    """One line for attention questprof does not model, naming the nearest shape it runs."""
    rank = data.get("kv_lora_rank")
    if rank:
        width = rank + int(data.get("qk_rope_head_dim") or 0)
        raise ConfigError(
            f"{where}: {_arch(data)} uses multi-head latent attention (kv_lora_rank {rank}): its "
            f"decode reads one {width}-wide latent KV head for all {q_heads} q heads, which "
            f"questprof does not model; the nearest supported shape is {q_heads} q heads over 1 "
            f"KV head of head dim {max(HEAD_DIMS)} (a .toml scenario with kv_heads = 1)")
    kinds = data.get("layer_types")
    if isinstance(kinds, list) and set(kinds) - ATTENTION_LAYERS:
        other = sorted(set(map(str, kinds)) - ATTENTION_LAYERS)
        full = sum(k in ATTENTION_LAYERS for k in kinds)
        raise ConfigError(
            f"{where}: {_arch(data)} has {', '.join(other)} layers, which are not attention over "
            f"a KV cache; the nearest supported shape is its {full} attention layers alone "
            f"(a .toml scenario with layers = {full})")


def _kv_heads(data: dict, q_heads: int, where: str) -> int:
    kv = _int(data, ("num_key_value_heads", "num_kv_heads"), where, required=False)
    if data.get("multi_query") is True:
        if kv not in (None, 1):
            raise ConfigError(f"{where}: multi_query is true but num_kv_heads is {kv}")
        kv = 1
    kv = kv or q_heads
    if kv > q_heads or q_heads % kv:
        raise ConfigError(f"{where}: {q_heads} attention heads are not a whole multiple of "
                          f"{kv} key-value heads")
    return kv


def _head_dim(data: dict, q_heads: int, where: str) -> int:
    head_dim = _int(data, ("head_dim",), where, required=False)
    if head_dim:
        return head_dim
    hidden = _int(data, _ALIASES["hidden"], where, required=False)
    if hidden is None:
        raise ConfigError(f"{where}: missing field head_dim (and hidden_size to derive it)")
    if hidden % q_heads:
        raise ConfigError(f"{where}: hidden_size {hidden} is not a multiple of "
                          f"{q_heads} attention heads, and there is no head_dim")
    return hidden // q_heads


def _dtype(data: dict, where: str, given: str | None) -> str:
    """fp16 / bf16 / fp32 from torch_dtype or dtype (`given` when the config names none)."""
    named = {k: data[k] for k in ("torch_dtype", "dtype") if isinstance(data.get(k), str)}
    if len(set(named.values())) > 1:
        raise ConfigError(f"{where}: torch_dtype {named['torch_dtype']!r} and dtype "
                          f"{named['dtype']!r} disagree")
    if not named:
        if given:
            return given
        raise ConfigError(f"{where}: missing field torch_dtype (or dtype): give --kv-dtype "
                          f"fp16 or bf16")
    text = next(iter(named.values()))
    if text not in _DTYPES:
        raise ConfigError(f"{where}: torch_dtype {text!r} is not one of {', '.join(_DTYPES)}")
    dtype = _DTYPES[text]
    if dtype == "fp32":  # vLLM's dtype="auto" serves float32 checkpoints in half precision
        return "bf16" if data.get("model_type") in _NO_FP16 else "fp16"
    return dtype


def shape_fields(path: Path, dtype: str | None = None) -> tuple[dict, str]:
    """(ModelShape fields of the whole model, a one-line account of where they came from)."""
    where = str(path)
    data = read_config(path)
    layers = _int(data, _ALIASES["layers"], where)
    q_heads = _int(data, _ALIASES["q_heads"], where)
    _refuse_unsupported(data, where, q_heads)
    fields = {"name": path.resolve().parent.name or "model", "layers": layers, "q_heads": q_heads,
              "kv_heads": _kv_heads(data, q_heads, where),
              "head_dim": _head_dim(data, q_heads, where), "dtype": _dtype(data, where, dtype),
              "dense_layers": min(2, layers),
              "intermediate": _int(data, ("intermediate_size",), where, required=False) or 0,
              "vocab": _int(data, ("vocab_size",), where, required=False) or 0}
    experts = _int(data, ("num_experts_per_tok", "experts_per_token"), where, required=False)
    if experts:
        fields["intermediate"] *= experts
    moe = f", MLP of its {experts} active experts" if experts else ""
    window = data.get("sliding_window") if data.get("use_sliding_window") is not False else None
    slide = f", sliding-window layers ({window} tokens) swept as full attention" if window else ""
    note = (f"shape of {_arch(data)} from {where}{moe}{slide}; first {fields['dense_layers']} "
            f"layers dense, as the paper keeps")
    return fields, note
