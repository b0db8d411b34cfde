"""Checkpoints: DCP save / load / fallback (``dcp``), loading without running code from them (``safe_load``), a
read-only tensor view of one checkpoint (``tensors``), a run's model with a checkpoint's weights (``run_model``),
export as a Hugging Face folder or one safetensors file (``export``), and Hugging Face weights into a built model
(``hf_import``, ``model.init_from``)."""
