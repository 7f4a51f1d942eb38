"""A request mix through transformers' continuous batching with questprof's attention.

`serve` starts transformers' manager (`continuous_batching_context_manager`), adds each request
at its arrival time with its own forced output length (no end-of-sequence token, so every
policy does the same work), and collects each request's tokens and the time each token came
out (`record_timestamps`). Concurrency is transformers' `max_requests_per_batch`. Each forward
is split into where its time went (serving/step_time.py).
"""

from __future__ import annotations

import inspect
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass

from questprof.core.config import ConfigError
from questprof.serving.inplace import InPlaceDecode
from questprof.serving.paged_attention import Policy, QuestPaged, StepLog, bound
from questprof.serving.step_time import StepClock, step_parts

RESULT_WAIT_S = 600.0  # one request's longest wait for its result before the run gives up


class OwnAttention:
    """`serve --engine transformers`: the loop's own attention left in place (the baseline: for
    5.17 its 'paged|sdpa', which gathers every request's keys each layer); dense only, and its
    time counts in the rest of the model (no attention timer of ours around it)."""


@dataclass(frozen=True)
class Request:
    """Prompt token ids, the tokens to generate, and seconds after the start it arrives."""

    prompt: tuple[int, ...]
    output: int
    arrival: float = 0.0


@dataclass(frozen=True)
class Served:
    """What one request got: its tokens, when it was added (perf_counter seconds) and when each
    token came out."""

    index: int
    prompt_len: int
    tokens: tuple[int, ...]
    added: float
    timestamps: tuple[float, ...]


@dataclass(frozen=True)
class LoopSettings:
    """transformers' continuous batching settings of a run: page (block) size, requests per
    batch, cache pages (None: transformers sizes it from free memory), tokens per forward
    (None: transformers'; a prefill longer than it is chunked) and whether transformers
    captures its forwards as CUDA graphs (its own attention only: questprof's decode plans each
    forward on the host)."""

    page_size: int
    concurrency: int
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    cuda_graph: bool = False


def _configs(settings: LoopSettings, longest_output: int):
    """(GenerationConfig, ContinuousBatchingConfig): greedy, no end-of-sequence token, CUDA
    graphs as the settings say and no switch to flash."""
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig
    gen = GenerationConfig(do_sample=False, max_new_tokens=longest_output, eos_token_id=-1,
                           pad_token_id=0)
    return gen, ContinuousBatchingConfig(**cb_fields(ContinuousBatchingConfig, settings))


def cb_fields(config_class, settings: LoopSettings) -> dict:
    """The ContinuousBatchingConfig arguments this transformers takes: the page size is
    `page_size` (5.24) or `block_size` (5.17: the H200's, 2026-12-02, which has no
    `auto_switch_to_flash` either); settings a version lacks are left out."""
    names = set(inspect.signature(config_class).parameters)
    want = {"page_size" if "page_size" in names else "block_size": settings.page_size,
            "num_blocks": settings.num_blocks, "max_batch_tokens": settings.max_batch_tokens,
            "max_requests_per_batch": settings.concurrency, "use_cuda_graph": settings.cuda_graph,
            "auto_switch_to_flash": False, "allow_block_sharing": False}
    return {k: v for k, v in want.items() if k in names}


def _feed(manager, requests: list[Request], start: float) -> None:
    """Add every request at its arrival time (request id = its position in the mix)."""
    for i in sorted(range(len(requests)), key=lambda j: requests[j].arrival):
        wait = start + requests[i].arrival - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        manager.add_request(list(requests[i].prompt), request_id=str(i),
                            max_new_tokens=requests[i].output, record_timestamps=True)


def _collect(manager, requests: list[Request], feeder: threading.Thread) -> list[Served]:
    """Each request's result as it finishes; ConfigError naming the first that the loop refused,
    RuntimeError when the loop itself stopped."""
    got: dict[int, Served] = {}
    while len(got) < len(requests):
        feeding = feeder.is_alive()  # asked before the wait: a request may arrive during it
        result = manager.get_result(timeout=0.1 if feeding else RESULT_WAIT_S)
        if result is None:
            if feeding:
                continue
            why = manager.background_thread_status.fatal_error
            raise RuntimeError(f"transformers' loop returned {len(got)} of {len(requests)} "
                               f"requests and then stopped: {why!r}") from why
        if result.error:  # transformers refused it (a request past the cache's memory)
            raise ConfigError(f"request {result.request_id}: transformers' loop refused it: "
                              f"{str(result.error).splitlines()[0]}")
        i = int(result.request_id)
        got[i] = Served(i, len(requests[i].prompt), tuple(result.generated_tokens),
                        float(result.created_time), tuple(result.timestamps or ()))
    return [got[i] for i in range(len(requests))]


def serve(model, requests: list[Request], policy: Policy, settings: LoopSettings,
          engine=None) -> tuple[list[Served], StepLog]:
    """Every request of the mix through transformers' loop with `policy`'s attention (decode by
    `engine`: paged_attention.HostDecode by default, stages_decode.StagesDecode, or
    inplace.InPlaceDecode, whose attention reads the loop's cache in place)."""
    gen, cb = _configs(settings, max(r.output for r in requests))
    clock = StepClock(model.device if model.device.type == "cuda" else None)
    own = isinstance(engine, OwnAttention)
    if own and policy.name != "dense":
        raise ValueError(f"transformers' own attention is dense: policy {policy.name!r} needs "
                         "questprof's attention")
    attention = (engine.attention(policy, clock) if isinstance(engine, InPlaceDecode)
                 else QuestPaged(policy, engine=None if own else engine, timer=clock))
    with (nullcontext() if own else bound(model, attention)), clock.watching(model), \
            model.continuous_batching_context_manager(
                generation_config=gen, continuous_batching_config=cb, block=True, timeout=5,
                warmup=False) as manager:
        start = time.perf_counter()
        feeder = threading.Thread(target=_feed, args=(manager, requests, start), daemon=True)
        feeder.start()
        served = _collect(manager, requests, feeder)
        feeder.join()
    attention.log.parts = step_parts(clock)
    return served, attention.log

