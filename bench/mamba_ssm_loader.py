"""mamba-ssm for the side-by-side benches, importable where it was installed without its CUDA build.

mamba-ssm may be installed without its CUDA extensions (``selective_scan_cuda``, Mamba-1's scan) and without
causal-conv1d: its Mamba-2 path is Triton (``mamba_ssm/ops/triton``), and the Mamba-2 module falls back to
``nn.Conv1d`` without causal-conv1d. Two of its modules import the extension unguarded: the top-level
``mamba_ssm/__init__.py`` and ``mamba_ssm/ops/selective_scan_interface.py`` (which ``models/mixer_seq_simple.py``
reaches through ``modules/mamba_simple.py``). So the package is registered as a bare module whose ``__path__`` is the
installed folder (its ``__init__`` never runs), and, for ``MambaLMHeadModel``, an empty placeholder stands in for
the extension.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types


def mamba_ssm_package() -> str | None:
    """Register ``mamba_ssm`` as a bare package (submodules import, its ``__init__`` does not run); None, or why
    not."""
    if "mamba_ssm" in sys.modules:
        return None
    spec = importlib.util.find_spec("mamba_ssm")  # locates the package without executing it
    if spec is None or not spec.submodule_search_locations:
        return "mamba_ssm is not installed"
    package = types.ModuleType("mamba_ssm")
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    sys.modules["mamba_ssm"] = package
    return None


def import_mamba_ssm(module: str):
    """(the module ``mamba_ssm.<module>``, None), or (None, why not): mamba-ssm absent, a missing dependency (einops,
    ...) or an incompatible version."""
    why = mamba_ssm_package()
    if why is not None:
        return None, why
    name = f"mamba_ssm.{module}"
    try:
        return importlib.import_module(name), None
    except Exception as exc:  # noqa: BLE001 - reported in the row, the other rows run
        return None, f"{name} does not import: {type(exc).__name__}: {exc}"


def load_chunk_scan_combined():
    """(``mamba_chunk_scan_combined``, None), or (None, why not): only its Triton modules are imported."""
    module, why = import_mamba_ssm("ops.triton.ssd_combined")
    return (module.mamba_chunk_scan_combined, None) if module is not None else (None, why)


def load_lm_head_model():
    """(``MambaLMHeadModel``, None), or (None, why not). Where the CUDA extension ``selective_scan_cuda`` is not
    built, an empty placeholder module takes its name for the import chain: Mamba-2 never calls it (only Mamba-1's
    CUDA scan, ``selective_scan_fn`` / ``mamba_inner_fn``, does), so a Mamba-1 model built this way would fail."""
    if importlib.util.find_spec("selective_scan_cuda") is None and "selective_scan_cuda" not in sys.modules:
        sys.modules["selective_scan_cuda"] = types.ModuleType("selective_scan_cuda")
    module, why = import_mamba_ssm("models.mixer_seq_simple")
    return (module.MambaLMHeadModel, None) if module is not None else (None, why)


def mamba_ssm_version() -> str | None:
    """The installed distribution's version ("unknown" without its metadata), None where it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    if importlib.util.find_spec("mamba_ssm") is None:
        return None
    try:
        return version("mamba_ssm")
    except PackageNotFoundError:
        return "unknown"
