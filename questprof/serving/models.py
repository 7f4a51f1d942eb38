"""The model `serve` runs and the prompts it sends.

--model takes what the fidelity command loads (a .gguf file, a transformers folder, 'smollm2',
'random:<scenario>') or a Hugging Face config.json, built with random weights by transformers'
`from_config` (timing needs no download). Prompts are seeded random token ids of each request's
length: the loop's time does not depend on what the tokens say.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from questprof.core.config import ConfigError
from questprof.fidelity.models import LoadedModel, device, load_model
from questprof.serving.loop import Request
from questprof.serving.mixes import Spec


def _from_config(path: Path, seed: int) -> LoadedModel:
    """A random-weight causal LM of the architecture config.json names."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        config = AutoConfig.for_model(**data)
        dtype = getattr(torch, str(data.get("dtype") or data.get("torch_dtype") or "float32"))
        torch.manual_seed(seed)
        # built where it runs, in the config's dtype: an 8B model's random weights take
        # seconds on a GPU, minutes (and 32 GB in float32) on the host
        with torch.device(device()):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (OSError, json.JSONDecodeError, ValueError, KeyError, TypeError,
            AttributeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"model {path} cannot be loaded by transformers: {first}") from None
    context = int(getattr(config, "max_position_embeddings", 0) or 0)
    name = path.parent.name if path.name == "config.json" else path.stem  # a folder's, or its own
    return LoadedModel(model.eval(), None, f"random:{name or path.stem}",
                       context)


def load_serving_model(spec: str, seed: int = 0) -> LoadedModel:
    """The model of --model (see the module); ConfigError when transformers cannot load it."""
    path = Path(spec).expanduser()
    if path.suffix == ".json":
        if not path.is_file():
            raise ConfigError(f"model {path} not found")
        return _from_config(path, seed)
    return load_model(spec, seed)


def requests_for(specs: list[Spec], vocab: int, seed: int = 0) -> list[Request]:
    """Each spec as a request of seeded random token ids in 1..vocab-1."""
    rng = np.random.default_rng(seed)
    return [Request(tuple(int(t) for t in rng.integers(1, vocab, size=s.prompt)), s.output,
                    s.arrival) for s in specs]
