"""Measurement back-ends: event timing, ceilings, CUPTI / Nsight Compute bytes, NVML."""
