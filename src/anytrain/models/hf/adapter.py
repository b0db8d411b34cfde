"""Any local ``transformers`` causal LM under anytrain's trainer (``model.arch: hf``, ``model.hf_path: DIR``).

``HFCausalLM`` wraps ``AutoModelForCausalLM.from_config(DIR/config.json)`` and satisfies ``protocol.LanguageModel``:

* **Built without weights.** The parameters are created on the meta device (buffers such as RoPE's ``inv_freq`` are
  computed on the CPU at construction and kept aside, because ``to_empty`` drops buffer values too);
  ``init_weights`` materialises them: the safetensors weights of ``DIR`` (``model.args.init: pretrained``) or the
  model class's own random init seeded by ``train.seed`` (``init: random``), then re-ties shared tensors.
* **Blocks are found generically**: the largest ``nn.ModuleList`` whose children share one class (``model.layers``
  of Llama/Qwen2, ``transformer.h`` of GPT-2). FSDP, activation checkpointing and per-block compile wrap them.
* **Loss.** The body (``hf.base_model``) gives the final normed hidden states; the loss is anytrain's chunked linear +
  cross-entropy against the head's weight when the head is a bias-free ``nn.Linear`` whose output the model returns
  unchanged as its logits (checked once per ``init_weights`` with a small probe forward: soft-capped or scaled logits
  fail it), else the model's own logits and ``F.cross_entropy``. Targets equal to -100 are ignored either way.
* **Attention** (``attn_implementation: sdpa``): models whose every layer attends causally over the whole sequence run
  transformers' SDPA function under ``CAUSAL_SDPA``, a name without a mask function, so no mask is built (compiled or
  not) and SDPA gets ``is_causal``; windowed or chunked models keep transformers' ``sdpa`` and its masks.

No ``torch.distributed`` here; tensor and pipeline parallelism are not offered for this family.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from anytrain.errors import ConfigError
from anytrain.models.layers import residual_stream
from anytrain.models.losses import lm_cross_entropy
from anytrain.models.sampling import SamplingMixin

IGNORE_INDEX = -100
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
INSTALL_HINT = "pip install 'anytrain[hf]'"
NO_POSITION_LIMIT = 2**20
"""max_seq_len of a config without ``max_position_embeddings`` (the config loader's bound on data.seq_len)."""


@dataclass
class HFArgs:
    """What anytrain needs to know about an HF model; every field but the first three comes from ``DIR/config.json``
    (through ``transformers.AutoConfig``) and cannot be overridden."""

    path: str = ""
    """The model folder: ``model.hf_path`` (absolute)."""
    init: Literal["pretrained", "random"] = "pretrained"
    """pretrained: start from the folder's safetensors weights; random: the model class's own initialisation (as
    ``from_config``), seeded by train.seed, for training from scratch."""
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """transformers' attention kernel: sdpa (``scaled_dot_product_attention``; for plain causal models without any mask,
    ``CAUSAL_SDPA``) or eager."""
    residual_in_fp32: bool = False
    """Under bf16/fp16 autocast with fp32 weights, keep the residual stream fp32 as transformers does (the embedding
    tables' fp32 output carries it). False (default, as the anytrain Transformer, and as FSDP's bf16 parameters give
    anyway): the embedding outputs take the autocast dtype, so the residual adds and the norms' inputs are bf16 —
    half the bytes of the elementwise work. No effect without autocast."""
    model_type: str = ""
    architecture: str = ""
    """The ``AutoModelForCausalLM`` class the folder's config maps to, e.g. LlamaForCausalLM."""
    vocab_size: int = 0
    n_layers: int = 0
    hidden_size: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    max_seq_len: int = 0
    """max_position_embeddings (NO_POSITION_LIMIT when the config has none)."""
    tie_embeddings: bool = False

    def validate(self, prefix: str = "model.args.") -> None:
        for name in ("vocab_size", "n_layers", "hidden_size", "num_attention_heads", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(
                    f"model.hf_path: {self.path}/config.json gives {name} = {getattr(self, name)}; "
                    "expected a decoder-only causal LM config"
                )


SETTABLE = ("init", "attn_implementation", "residual_in_fp32")
"""The ``model.args`` fields a recipe may set for ``arch: hf``; the rest describe the folder's model."""


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"model.arch: hf needs the transformers package: {INSTALL_HINT}") from None
    return transformers


def check_folder(path: str | Path) -> Path:
    """``model.hf_path`` as an absolute folder holding config.json; one ConfigError naming the field otherwise."""
    if not str(path):
        raise ConfigError(
            "model.hf_path: model.arch hf needs a local Hugging Face model folder (config.json + "
            "safetensors); set --model.hf_path DIR"
        )
    folder = Path(path).expanduser().absolute()
    if not folder.is_dir():
        raise ConfigError(f"model.hf_path: {folder} is not a directory; point it at a Hugging Face model folder")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"model.hf_path: {folder} has no config.json (expected a folder written by save_pretrained)")
    return folder


@functools.lru_cache(maxsize=8)
def _load_config(folder: str, mtime_ns: int):  # noqa: ARG001 - the key: a rewritten config.json is read again
    transformers = _transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(folder)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"model.hf_path: {folder}/config.json is not a config transformers can read ({first})"
        ) from None
    if type(config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ConfigError(
            f"model.hf_path: {folder} holds a {config.model_type!r} model, which has no AutoModelForCausalLM class"
        )
    return config


def read_config(folder: str | Path):
    """The folder's ``transformers`` config (cached until config.json changes)."""
    folder = check_folder(folder)
    return _load_config(str(folder), (folder / "config.json").stat().st_mtime_ns)


def resolve_args(model_cfg: Any) -> HFArgs:
    """``ModelConfig`` (arch hf) -> HFArgs: the shape from ``hf_path``'s config.json, ``init`` and
    ``attn_implementation`` from ``model.args``; any other ``model.args`` key is one ConfigError naming it."""
    for key in model_cfg.args:
        if key not in SETTABLE:
            known = {f.name for f in fields(HFArgs)}
            why = "is read from model.hf_path's config.json" if key in known else "unknown field"
            raise ConfigError(f"model.args.{key}: {why}; model.arch hf takes only {', '.join(SETTABLE)}")
    from anytrain.config import from_dict

    chosen = from_dict(HFArgs, dict(model_cfg.args), prefix="model.args.")
    folder = check_folder(model_cfg.hf_path)
    config = read_config(folder)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    mapping = _transformers().MODEL_FOR_CAUSAL_LM_MAPPING
    args = HFArgs(
        path=str(folder),
        init=chosen.init,
        attn_implementation=chosen.attn_implementation,
        residual_in_fp32=chosen.residual_in_fp32,
        model_type=config.model_type,
        architecture=mapping[type(config)].__name__,
        vocab_size=int(text.vocab_size),
        n_layers=int(getattr(text, "num_hidden_layers", 0) or 0),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(text, "num_key_value_heads", 0) or heads),
        head_dim=int(getattr(text, "head_dim", 0) or (hidden // heads if heads else 0)),
        max_seq_len=int(getattr(text, "max_position_embeddings", 0) or NO_POSITION_LIMIT),
        tie_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
    )
    args.validate()
    return args


@contextlib.contextmanager
def _parameters_on_meta():
    """Every parameter registered inside goes to the meta device as it is registered (its class and requires_grad
    kept); buffers are created wherever the surrounding device context says."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def find_blocks(root: nn.Module) -> tuple[str, nn.ModuleList]:
    """(qualified name, list) of the largest ``nn.ModuleList`` whose children all share one class: the decoder
    layers. Ties go to the first found."""
    best: tuple[str, nn.ModuleList] | None = None
    for name, module in root.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and len({type(c) for c in module}) == 1:
            if best is None or len(module) > len(best[1]):
                best = (name, module)
    if best is None:
        raise ConfigError(
            f"model.hf_path: {type(root).__name__} has no nn.ModuleList of repeated layers to shard "
            "and checkpoint per block"
        )
    return best


class HFCausalLM(SamplingMixin, nn.Module):
    """A ``transformers`` causal LM as an anytrain ``LanguageModel``. Token ids (B, T) -> logits (B, T, V), or with
    targets (B, T) the mean next-token loss over targets != -100 (a scalar). Parameter names: ``hf.<HF name>``."""

    def __init__(self, args: HFArgs) -> None:
        super().__init__()
        self.args = args
        transformers = _transformers()
        config = copy.deepcopy(read_config(args.path))  # from_config keeps (and sets attributes on) the object it gets
        on_meta = torch.get_default_device().type == "meta"
        implementation = args.attn_implementation
        if implementation == "sdpa" and plain_causal(config):
            implementation = causal_sdpa()
        self.mask_free = implementation == CAUSAL_SDPA
        """No attention-mask code runs in forward (``CAUSAL_SDPA``): nothing for the compiler to materialise, nothing
        read on the host (whole-body compile and CUDA graph capture are sound)."""
        try:
            with torch.device("cpu"), _parameters_on_meta():
                self.hf = transformers.AutoModelForCausalLM.from_config(
                    config, dtype=torch.float32, attn_implementation=implementation
                )
        except ValueError as exc:
            if "attention implementation" not in str(exc) and "attn_implementation" not in str(exc):
                raise
            raise ConfigError(
                f"model.args.attn_implementation: {args.architecture} does not support "
                f"{args.attn_implementation!r}; set --model.args.attn_implementation eager"
            ) from None
        # buffer values computed at construction (RoPE tables, masks): to_empty drops them, init_weights copies back
        self._buffer_values = {name: b.detach().clone() for name, b in self.named_buffers() if b.device.type != "meta"}
        self._blocks_name, _ = find_blocks(self.hf)
        self._blocks_name = "hf." + self._blocks_name
        if not args.residual_in_fp32:  # the embedding tables outside the blocks start the residual stream
            for name, module in self.named_modules():
                if isinstance(module, nn.Embedding) and not name.startswith(self._blocks_name + "."):
                    module.register_forward_hook(_stream_dtype)
        self.fused_head = False
        if not on_meta:  # built for use (eval, export): materialise on the CPU now, as the other families do
            self.to_empty(device="cpu")
            self.init_weights()

    # ----------------------------------------------------------------------------------------------------------------
    # weights

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """After ``to_empty``: buffers back, weights from the folder (``init: pretrained``) or the class's random init
        seeded by ``seed`` (``init: random``), shared tensors re-tied, and the fused-loss probe run."""
        for name, buffer in self.named_buffers():
            if name in self._buffer_values:
                buffer.copy_(self._buffer_values[name])
        if self.args.init == "pretrained":
            self._load_pretrained()
        else:
            if seed is not None:
                torch.manual_seed(seed)
            for module in self.hf.modules():  # the class's init skips modules flagged as initialised
                module.__dict__.pop("_is_hf_initialized", None)
                for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
                    tensor.__dict__.pop("_is_hf_initialized", None)
            self.hf.initialize_weights()
            for name, buffer in self.named_buffers():  # the class's init may rewrite buffers; keep construction's
                if name in self._buffer_values:
                    buffer.copy_(self._buffer_values[name])
        self.hf.tie_weights()
        self.fused_head = self._probe_fused_head()

    def _load_pretrained(self) -> None:
        """Copy the folder's safetensors tensors into the parameters and persistent buffers (on their device), one
        tensor at a time. A checkpoint key without a place (after adding the base-model prefix) is an error unless the
        class lists it as ignorable; a missing one is an error unless it is tied to a loaded tensor."""
        folder = Path(self.args.path)
        targets = {k: v for k, v in self.hf.state_dict(keep_vars=True).items()}
        prefix = self.hf.base_model_prefix
        ignorable = [re.compile(p) for p in (getattr(self.hf, "_keys_to_ignore_on_load_unexpected", None) or [])]
        loaded: set[str] = set()
        for file in safetensors_files(folder):
            with open_safetensors(file, "model.hf_path") as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    name = key if key in targets else f"{prefix}.{key}" if prefix else key
                    if name not in targets:
                        if any(p.search(key) for p in ignorable):
                            continue
                        raise ConfigError(
                            f"model.hf_path: {file.name} holds {key}, which {type(self.hf).__name__} has no place for"
                        )
                    tensor, target = handle.get_tensor(key), targets[name]
                    if tensor.shape != target.shape:
                        raise ConfigError(
                            f"model.hf_path: {key} in {file.name} has shape {tuple(tensor.shape)}, "
                            f"the model expects {tuple(target.shape)}"
                        )
                    target.copy_(tensor)
                    loaded.add(name)
        tied = getattr(self.hf, "all_tied_weights_keys", None) or {}
        missing = [n for n in targets if n not in loaded and not (n in tied and tied[n] in loaded)]
        missing = [
            n
            for n in missing
            if not any(re.search(p, n) for p in getattr(self.hf, "_keys_to_ignore_on_load_missing", None) or [])
        ]
        if missing:
            raise ConfigError(
                f"model.hf_path: {folder} lacks {missing[0]}"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                + "; or set --model.args.init random"
            )

    @torch.no_grad()
    def _probe_fused_head(self) -> bool:
        """Whether ``lm_head(base_model(x).last_hidden_state)`` is exactly the model's logits: the head is a
        bias-free Linear fed the body's output, and whatever the head returns comes out unchanged (a forward hook
        replaces the head's output with a marker tensor and the returned logits must equal it). 1 x 4 tokens, eval
        mode (no dropout), on the parameters' device."""
        head, body = self.hf.get_output_embeddings(), self.hf.base_model
        if type(head) is not nn.Linear or head.bias is not None or body is self.hf:
            return False
        device = head.weight.device
        tokens = torch.arange(4, device=device)[None] % self.args.vocab_size
        seen: dict[str, torch.Tensor] = {}
        marker = torch.randn(1, 4, self.args.vocab_size, generator=torch.Generator().manual_seed(0)).to(device)

        def hook(_module, inputs, _output):
            seen["hidden"] = inputs[0]
            return marker.to(_output.dtype)

        was_training = self.hf.training
        self.hf.eval()
        handle = head.register_forward_hook(hook)
        try:
            logits = self.hf(input_ids=tokens, use_cache=False).logits
        finally:
            handle.remove()
            self.hf.train(was_training)
        if logits.shape != marker.shape or not torch.equal(logits.float(), marker):
            return False
        self.hf.eval()
        try:
            hidden = body(input_ids=tokens, use_cache=False).last_hidden_state
        finally:
            self.hf.train(was_training)
        return hidden.shape == seen["hidden"].shape and torch.equal(hidden, seen["hidden"])

    # ----------------------------------------------------------------------------------------------------------------
    # forward

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V), or with ``targets`` (B, T) the mean next-token loss over targets != -100."""
        if targets is None:
            return self.hf(input_ids=tokens, use_cache=False).logits
        if self.fused_head:
            hidden = self.hf.base_model(input_ids=tokens, use_cache=False).last_hidden_state  # (B, T, D)
            return lm_cross_entropy(hidden, self.hf.get_output_embeddings().weight, targets)
        logits = self.hf(input_ids=tokens, use_cache=False).logits  # (B, T, V)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)

    # ----------------------------------------------------------------------------------------------------------------
    # protocol

    def blocks(self) -> list[nn.Module]:
        """The decoder layers (``find_blocks``), wrapped or not, in order."""
        return list(self.get_submodule(self._blocks_name))

    def _embedding_params(self) -> int:
        tables = {id(m.weight): m.weight for m in self.hf.modules() if isinstance(m, nn.Embedding)}
        return sum(w.numel() for w in tables.values())

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameters (shared tensors once). exclude_embedding drops every ``nn.Embedding`` table (tokens and, for
        GPT-2-style models, learned positions) and keeps the LM head (counted again when it is tied)."""
        total = sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
        if exclude_embedding:
            total -= self._embedding_params()
            head = self.hf.get_output_embeddings()
            if head is not None and self.args.tie_embeddings:
                total += head.weight.numel()
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6·N + 12·L·(H·E)·T.

        N = ``num_params(exclude_embedding=True)`` (the LM head counts, embedding tables do not); L decoder layers,
        H·E the attention width (query heads × head dim, = hidden size for most models); T = seq_len. The attention
        term counts QKᵀ and AV over the full window (no causal discount, no sliding-window discount), the
        PaLM / torchtitan convention used for the other families. Recomputation is not counted (that would be HFU).
        """
        width = self.args.num_attention_heads * self.args.head_dim
        return 6.0 * self.num_params(exclude_embedding=True) + 12.0 * self.args.n_layers * width * seq_len

    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size


CAUSAL_SDPA = "anytrain_causal_sdpa"
"""``attn_implementation: sdpa`` for a model whose every layer attends causally over the whole sequence: transformers'
own SDPA attention function registered under this name, with no attention-mask function. transformers then builds no
mask at all (its mask code returns at once for an implementation without one), so SDPA always runs with ``is_causal``
(the causal FlashAttention / cuDNN kernels, native GQA): also under ``torch.compile``, where transformers itself (torch
< 2.14) materialises a (B, 1, T, T) mask, and without its check for packed position ids, which reads a GPU tensor on
the host. Exact because anytrain passes no padding mask and no position ids (one causal sequence per row)."""


@functools.cache
def causal_sdpa() -> str:
    """Register ``CAUSAL_SDPA`` with transformers' attention interface (once) and return the name."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    return CAUSAL_SDPA


def plain_causal(config: Any) -> bool:
    """Whether every layer of the config's model attends causally over the whole sequence: no sliding window (unless
    switched off), no chunked attention, every entry of ``layer_types`` (if any) "full_attention"."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        return all(kind == "full_attention" for kind in layer_types) and not getattr(text, "attention_chunk_size", None)
    window = getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)
    return not window and not getattr(text, "attention_chunk_size", None)


def _stream_dtype(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
    """Forward hook on an embedding table: its output in the autocast dtype (``residual_in_fp32: false``)."""
    return residual_stream(output, keep_fp32=False)


def safetensors_index(folder: Path, field: str) -> list[Path] | None:
    """The weight files ``folder/model.safetensors.index.json`` names (None without one); an index that is not a
    JSON object with a ``weight_map`` of file names is one ConfigError naming ``field`` and the file, and so is a name
    that is absolute or leads out of ``folder`` through ``..`` (checked on the name: the files of a Hugging Face cache
    snapshot are symbolic links to the cache's blobs, outside the snapshot folder)."""
    index = folder / INDEX_FILE
    if not index.is_file():
        return None
    try:
        names = set(json.loads(index.read_text())["weight_map"].values())
        files = sorted(folder / name for name in names)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(
            f"{field}: {index} is not a safetensors index (a JSON object whose weight_map maps tensor "
            f"names to files: {type(exc).__name__} {exc}); restore it from the model's "
            "source"
        ) from None
    for name in sorted(names):
        normal = os.path.normpath(name)
        if os.path.isabs(name) or normal == os.pardir or normal.startswith(os.pardir + os.sep):
            raise ConfigError(
                f"{field}: {index} names the weight file {name!r}, outside {folder}; only files of the model's "
                "folder are read: restore the index from the model's source"
            )
    for file in files:
        if not file.is_file():
            raise ConfigError(f"{field}: {file} is listed in {index} but missing; restore it from the model's source")
    return files


@contextlib.contextmanager
def open_safetensors(file: Path, field: str):
    """``safe_open(file)`` on the CPU; a damaged file (truncated, or not safetensors) is one ConfigError naming
    ``field`` and the file instead of safetensors' own error."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            yield handle
    except (SafetensorError, OSError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(
            f"{field}: {file} is not a readable safetensors file ({first}); it may be truncated: "
            "download or copy it again"
        ) from None


_FROM_SCRATCH = "convert the weights, or set --model.args.init random to train from scratch"


def safetensors_files(folder: Path, field: str = "model.hf_path", fix: str = _FROM_SCRATCH) -> list[Path]:
    """The weight files of a Hugging Face model folder: those its index names, else its ``model.safetensors``; one
    ConfigError naming ``field`` otherwise (ending with ``fix`` when the folder has neither)."""
    files = safetensors_index(folder, field)
    if files is not None:
        return files
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    raise ConfigError(
        f"{field}: {folder} has neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors weights are read); {fix}"
    )
