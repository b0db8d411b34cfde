"""anytrain's benchmarks: scripts over the public API, run from the repository root as ``python -m bench.<name>``.

Scripts (each has ``--help``): alibi, allreduce_vs_raw, causal_conv, cost_model_validation, cost_projection,
eval_throughput, hardware_switch, mamba_kernels, mamba_train, packing, prepare, scaling, sdpa_backends, tp_optimizer,
train_check, transformer, transformer_parts. Modules the scripts and tests import: ``common`` (random batches, timing,
result files, rows in child processes), ``scaling_cases`` and ``scaling_analysis`` (the scaling study's cases and its
efficiencies, cost-model predictions, merge, table and plot), ``eval_stage`` (eval_throughput's eval child).
Results: ``bench/results/``; GPU-host drivers: ``bench/device/``.
"""
