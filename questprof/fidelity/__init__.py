"""Fidelity: what Quest's page selection keeps of dense attention (docs/FIDELITY.md).

capture (a cache and its decode queries, safetensors on disk), hooks and model_run (a
transformers model's own attention, recorded or served over Quest's pages), page_index (the
backend's summary / estimate / topk on one layer), metrics and evaluate (the six measures per
q head), prompts and synthetic (where caches come from), rows and runner (result rows).
"""
