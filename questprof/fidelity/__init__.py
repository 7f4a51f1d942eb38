"""Fidelity: what Quest's page selection keeps of dense attention (docs/FIDELITY.md).

capture (a cache and its decode queries, safetensors on disk), hooks and model_run (a
transformers model's own attention, recorded or served over Quest's pages), page_index and
host_index (the index Quest's selection runs on: the backend's summary / estimate / topk on
one layer), metrics (the measures per q head, the NumPy reference) and metrics_device (its torch
device path), evaluate, evaluate_device and evaluate_selectors (the metrics of a batch of
captures: Quest's on the host, Quest's where the model ran, the other selectors'), task_decode,
task_selectors and task_answers (the task: each selector in the decode loop), prompts,
prompts_spread and synthetic (where caches come from), rows and runner (result rows).
"""
