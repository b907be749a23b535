"""`DSparkDrafter`: the DSpark draft model as a Transformers `PreTrainedModel`.

Design (paper sections 2.2, 3.1, 3.2.1):

* **Context features.** Raw outputs of the target layers `config.target_layer_ids` (HF `hidden_states[i + 1]`) are
  concatenated `[.., m*d]` and projected by a bias-free `fc` followed by RMSNorm `hidden_norm`.
* **KV injection.** In every draft layer, queries come from the block rows only; keys and values are the sequence
  concatenation [context features ; block] through the layer's own k/v projections (k gets the per-head `k_norm`,
  both get RoPE at their true positions). The block attends bidirectionally to itself and to every context row
  strictly before its anchor. At inference the context keys/values live in a `DSparkContextCache`.
* **Block layout.** `config.block_layout = "dspark"` (default): input = target embedding of the anchor followed by
  `block_size - 1` mask embeddings (a learned vector unless `config.mask_token_id` names a target token); slot k
  predicts the token at anchor position + k + 1. `"dflash"` (z-lab's / transformers' DFlash checkpoints): the anchor
  followed by `block_size` mask embeddings; the anchor slot predicts nothing and mask slot k predicts anchor
  position + k. Either way one forward yields `block_size` drafts (`DraftBlock` is the same), rows sit at their true
  positions anchor + j, and the decoding loops need not know the layout.
* **RoPE** comes from `config.rope_parameters` through transformers' own initialisation (`ROPE_INIT_FUNCTIONS`, the
  standard formula for "default", transformers' run-time update for "dynamic" / "longrope"); frequencies stay float32
  whatever the drafter's dtype.
* **Shared, frozen embedding and LM head.** They are *bound* from the target at run time (`bind_target`) and are not
  submodules, so checkpoints stay small. Binding checks the target against the config's fingerprint.
* **Sequential head** (Markov / gated Markov / RNN / none) and **confidence head** live in `sequential_heads.py`.
* **Reduced draft vocabulary** (`config.draft_vocab_size` = Vd, EAGLE-3's idea). The persistent buffer `d2t`
  `[Vd]` holds the sorted target ids the drafter may propose (draft id i <-> target id d2t[i]; speculators store the
  offset d2t[i] - i and a bool mask t2d instead, see `d2t_offsets` / `t2d`). The base logits are the bound target
  head's rows gathered by `d2t` (`draft_lm_head`: a [Vd, d] product) and the Markov head lives in draft ids; a
  previous token outside the draft vocabulary (the anchor / bonus token can be one) reads W1's extra "unknown" row
  (`to_draft_inputs`). `DraftBlock.logits` stays full-vocabulary `[B, K, V]`, -inf outside the draft ids (zero
  probability there), and `tokens` are target ids, so greedy and rejection verification are unchanged and exact: a
  target token the drafter cannot propose is simply never accepted as a draft and is emitted by the target itself.

Two forwards share the same layers: `forward` (training layout: many anchors per sequence, full context given) and
`draft` (inference: one anchor per row, cached context, then the sequential sampling loop). Tests pin that they agree.
Imports nothing from `dspark_hf` by absolute path so `save_pretrained` can ship it for `trust_remote_code=True`.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.utils import ModelOutput, logging

from .configuration_dspark import DSparkConfig
from .draft_head import DraftHead, parse_draft_head_dtype
from .drafting import DraftBlock, DSparkContextCache, SparseLogits
from .release_format import dequantize_release_state, is_int8_release
from .sequential_heads import ConfidenceHead, build_sequential_head

LogitsProcessorFn = Callable[[torch.LongTensor, torch.Tensor], torch.Tensor]

logger = logging.get_logger(__name__)

# Readers of foreign checkpoint formats (DeepSpec, z-lab, ...), registered by `dspark_hf.convert` when it is importable.
# Each takes a local folder and returns `(DSparkConfig, state_dict, format_name)`, or `None` for a native folder. Kept
# as a registry so that this file imports nothing from dspark_hf (it is copied next to checkpoints).
FOREIGN_FORMAT_READERS: list[Callable[[str], "tuple[DSparkConfig, dict, str] | None"]] = []


class SamplingParamsLike(Protocol):
    """What `sample_block` needs from a sampling configuration (`dspark_hf.SamplingParams` satisfies it)."""

    do_sample: bool

    def warp(self, logits: torch.Tensor) -> torch.Tensor: ...


class DSparkRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin `[B, T, head_dim]` of the standard rotary embedding at integer `positions` `[B, T]`."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class DSparkRotaryEmbedding(nn.Module):
    """RoPE of `config.rope_parameters`: frequencies from transformers' `ROPE_INIT_FUNCTIONS` (the standard formula for
    "default"), attention scaling applied to cos / sin, and transformers' own run-time update for "dynamic" and
    "longrope". The frequency buffers are not saved and stay float32 under `.to(dtype)`."""

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        self.config = config
        self.rope_type = config.rope_parameters["rope_type"]
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        inv_freq, self.attention_scaling = self.rope_init_fn(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @property
    def rope_init_fn(self) -> Callable:
        if self.rope_type == "default":
            return self.compute_default_rope_parameters
        return ROPE_INIT_FUNCTIONS[self.rope_type]

    @staticmethod
    def compute_default_rope_parameters(config: DSparkConfig, device=None, seq_len=None, **kwargs) -> tuple[torch.Tensor, float]:
        base = float(config.rope_parameters["rope_theta"])
        dim = int(config.head_dim)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))
        return inv_freq, 1.0

    def reset_parameters(self) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, self.attention_scaling = self.rope_init_fn(self.config)
        return inv_freq, inv_freq.clone()

    def _apply(self, fn, recurse=True):
        # Device moves apply; dtype casts do not reach the frequencies (they would lose precision in bf16).
        kept = {name: getattr(self, name) for name in ("inv_freq", "original_inv_freq")}
        super()._apply(fn, recurse)
        for name, value in kept.items():
            moved = getattr(self, name)
            if moved.is_floating_point() and moved.dtype != torch.float32:
                source = moved if "meta" in (value.device.type, moved.device.type) else value
                setattr(self, name, source.to(device=moved.device, dtype=torch.float32))
        return self

    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin `[B, T, head_dim]` in `x.dtype` at integer `position_ids` `[B, T]`."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float32)
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[B, H, T, D]`, cos/sin `[B, T, D]`."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class DSparkAttention(nn.Module):
    """Attention whose keys/values are [context ; block] and whose queries are the block rows."""

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rotary_emb = DSparkRotaryEmbedding(config)
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = DSparkRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = DSparkRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def key_values(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values `[B, H_kv, T, D]` of rows `x` `[B, T, d]` at `positions` `[B, T]`."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(k, positions)
        return apply_rotary(k, cos, sin), v

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        context_keys: torch.Tensor | None,
        context_values: torch.Tensor | None,
        attention_mask: torch.Tensor,
    ) -> torch.Tensor:
        """hidden `[B, Q, d]` (block rows); attention_mask `[B, Q, T_ctx + Q]` bool, True = may attend."""
        b, q_len, _ = hidden.shape
        q = self.q_norm(self.q_proj(hidden).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        cos, sin = self.rotary_emb(q, positions)
        q = apply_rotary(q, cos, sin)
        k, v = self.key_values(hidden, positions)
        if context_keys is not None and context_keys.shape[2] > 0:
            k = torch.cat([context_keys, k], dim=2)
            v = torch.cat([context_values, v], dim=2)
        grouped = self.num_kv_heads != self.num_heads
        if grouped and q.device.type == "cpu" and not torch.is_grad_enabled():
            # drafting on a CPU: SDPA reads the grouped key/value heads as they are (no copies of the context;
            # `models.gqa_attention` explains why that matters); training keeps the copies, whose backward is standard
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask[:, None], enable_gqa=True)
        else:
            if grouped:
                repeat = self.num_heads // self.num_kv_heads
                k = k.repeat_interleave(repeat, dim=1)
                v = v.repeat_interleave(repeat, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask[:, None])  # [B, H, Q, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim))


class DSparkMLP(nn.Module):
    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DSparkDecoderLayer(nn.Module):
    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        self.self_attn = DSparkAttention(config)
        self.mlp = DSparkMLP(config)
        self.input_layernorm = DSparkRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DSparkRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        context_keys: torch.Tensor | None,
        context_values: torch.Tensor | None,
        attention_mask: torch.Tensor,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(
            self.input_layernorm(hidden), positions, context_keys, context_values, attention_mask
        )
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


@dataclass
class DSparkOutput(ModelOutput):
    """Output of `DSparkDrafter.forward` (training layout).

    Attributes:
        hidden_states: `[B, A, K, d]` final (normed) backbone states of every block slot.
        logits: `[B, A, K, V]` base logits U_k through the bound LM head, when `return_logits=True`; over the
            draft vocabulary (`[B, A, K, Vd]`, indexed by draft id) when `config.draft_vocab_size` is set.
    """

    hidden_states: torch.Tensor | None = None
    logits: torch.Tensor | None = None  # [B, A, K, Vd] with a reduced draft vocabulary (draft ids)


class DSparkPreTrainedModel(PreTrainedModel):
    config_class = DSparkConfig
    base_model_prefix = "dspark"
    main_input_name = "anchor_ids"
    supports_gradient_checkpointing = False
    _no_split_modules = ["DSparkDecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, DSparkRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, DSparkRotaryEmbedding):
            inv_freq, original = module.reset_parameters()
            init.copy_(module.inv_freq, inv_freq)
            init.copy_(module.original_inv_freq, original)
        elif isinstance(module, DSparkDrafter):
            if module.mask_embedding is not None:
                init.normal_(module.mask_embedding, mean=0.0, std=std)
            if getattr(module, "d2t", None) is not None:  # placeholder mapping until set_draft_vocab / loading
                init.copy_(module.d2t, torch.arange(module.d2t.shape[0], dtype=module.d2t.dtype))
        if hasattr(module, "markov_w2"):
            # The transition bias starts at zero: an untrained head leaves the backbone's logits untouched.
            init.zeros_(module.markov_w2.weight)


class DSparkDrafter(DSparkPreTrainedModel):
    """DSpark drafter: parallel DFlash-style backbone + sequential head + confidence head.

    Typical use::

        drafter = DSparkDrafter.from_target(target, block_size=7, num_hidden_layers=2, markov_rank=256)
        out = target.generate(**inputs, assistant_model=drafter)   # batch 1 (the hook: see candidate_generator)

    The drafter must be bound to its target (`bind_target`) before drafting; `from_target` and the generation entry
    points do it for you.
    """

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__(config)
        if not config.target_layer_ids:
            raise ValueError("DSparkConfig.target_layer_ids is empty: the drafter needs at least one target layer.")
        d = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = DSparkRMSNorm(d, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([DSparkDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = DSparkRMSNorm(d, eps=config.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(d)) if config.mask_token_id is None else None
        if config.reduced_vocab:
            # Draft id -> target id (sorted). A placeholder (the first Vd ids) until `set_draft_vocab` or loading.
            self.register_buffer("d2t", torch.arange(config.draft_vocab_size, dtype=torch.long), persistent=True)
        else:
            self.register_buffer("d2t", None)
        num_draft = config.num_draft_tokens
        # W1 of a reduced vocabulary has one extra row: the previous token is outside the draft vocabulary.
        self.markov_head = build_sequential_head(config.sequential_head, num_draft, config.markov_rank, d,
                                                 num_draft + 1 if config.reduced_vocab else None)
        self.confidence_head = None
        if config.confidence_head:
            # [h_k; W1[x_{k-1}]] by default; h_k alone without a sequential head or with confidence_head_with_markov=False
            with_markov = self.markov_head is not None and config.confidence_head_with_markov
            self.confidence_head = ConfidenceHead(d + (config.markov_rank if with_markov else 0), uses_features=with_markov)
        self._bound: dict[str, nn.Module] = {}
        self._draft_head_dtype: torch.dtype | None = None  # see set_draft_head_dtype
        self._draft_head: tuple | None = None  # (source weight, key, W, b): the head rows the drafts use
        self._draft_kernel: tuple | None = None  # (source weight, key, DraftHead): those rows in the drafting dtype
        self.last_speculation_stats = None  # set by generate(assistant_model=self): see SpeculationStats
        self.assist_options = None  # how generate(assistant_model=self) picks drafts: see set_assist
        self.post_init()
        self.set_sts_temperatures(config.sts_temperatures)
        # `generate(assistant_model=self)` needs the candidate-generator hook; `import dspark_hf` installs it, and a
        # trust_remote_code copy of this file (in a process that may never import dspark_hf) installs it here.
        from .candidate_generator import install_generate_hook

        install_generate_hook()

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs) -> "DSparkDrafter":
        """`PreTrainedModel.from_pretrained`, made strict: a checkpoint that cannot be read, or whose weights do not
        cover this drafter exactly (missing, unexpected or mis-shaped tensors), raises instead of loading half-random
        weights. Pass `target=` to bind the loaded drafter to its target (fingerprint checked). A folder (or Hub id) in
        the int8 release format (`dspark_hf.testbed.release`: its safetensors metadata / `.int8` keys) is dequantized
        on load (`from_int8_release`, the same code as `load_release`)."""
        target = kwargs.pop("target", None)
        want_info = kwargs.pop("output_loading_info", False)
        foreign = _read_foreign_format(pretrained_model_name_or_path)
        if foreign is not None:
            model = cls._from_converted(pretrained_model_name_or_path, *foreign, **kwargs)
            if target is not None:
                model.bind_target(target)
            return (model, {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}) if want_info else model
        _check_stored_draft_vocab(pretrained_model_name_or_path)
        release_file = _int8_release_file(pretrained_model_name_or_path, kwargs)
        try:
            if release_file is not None:
                model, info = cls.from_int8_release(pretrained_model_name_or_path, release_file, **kwargs), {}
            else:
                model, info = super().from_pretrained(
                    pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
                )
        except (OSError, ValueError, RuntimeError, KeyError) as err:
            raise type(err)(f"could not load a DSpark drafter from {pretrained_model_name_or_path!s}: {err}") from err
        except Exception as err:  # e.g. safetensors' own error type for a truncated file
            raise OSError(
                f"could not load a DSpark drafter from {pretrained_model_name_or_path!s} (corrupted checkpoint?): {err}"
            ) from err
        problems = {k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        if problems:
            raise ValueError(
                f"the checkpoint at {pretrained_model_name_or_path!s} does not match this drafter's architecture: "
                + "; ".join(f"{k}: {v[:8]}{' ...' if len(v) > 8 else ''}" for k, v in problems.items())
            )
        if model.d2t is not None:
            try:
                validate_draft_vocab(model.d2t, model.config.draft_vocab_size, model.config.vocab_size)
            except ValueError as err:
                raise ValueError(f"the checkpoint at {pretrained_model_name_or_path!s} holds a bad draft vocabulary "
                                 f"mapping (d2t): {err}") from err
        if target is not None:
            model.bind_target(target)
        return (model, info) if want_info else model

    @classmethod
    def from_int8_release(cls, path, weights_file=None, **kwargs) -> "DSparkDrafter":
        """A drafter from the int8 release format (see `release_format`): strict (every tensor present and shaped
        right), in `dtype` (default: the config's, else float32), on `device_map` when that names one device."""
        from safetensors.torch import load_file

        hub = {k: kwargs[k] for k in ("revision", "cache_dir", "local_files_only", "token", "subfolder") if k in kwargs}
        config = kwargs.get("config")
        try:
            if not isinstance(config, DSparkConfig):
                config = cls.config_class.from_pretrained(path, **hub)
            stored = load_file(weights_file or os.path.join(os.fspath(path), hub.get("subfolder") or "",
                                                             "model.safetensors"))
        except Exception as err:  # safetensors raises its own error type on a truncated file
            raise OSError(f"could not read the release drafter at {path}: {err}") from err
        state = dequantize_release_state(stored, str(path))
        drafter = cls(config)
        expected = drafter.state_dict()
        missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        shapes = sorted(k for k in set(expected) & set(state) if expected[k].shape != state[k].shape)
        if missing or unexpected or shapes:
            raise ValueError(f"the release drafter at {path} does not match its config: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}, mis-shaped {shapes[:5]}")
        drafter.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()}, strict=True)
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        if dtype is None or dtype == "auto":
            dtype = getattr(config, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        drafter = drafter.to(dtype)
        device = kwargs.get("device_map")
        if isinstance(device, dict):
            devices = set(device.values())
            if len(devices) != 1:
                raise ValueError(f"a release drafter loads on one device, got device_map={device}")
            device = devices.pop()
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device is not None:
            drafter = drafter.to(device)
        return drafter.eval()

    # ------------------------------------------------------------------ saving / sharing
    # Set by `dspark_hf.hub.card` (on `import dspark_hf`): writes README.md, the generated model card. A copy of this
    # file loaded with trust_remote_code has none, and then saves no card.
    _model_card_writer: Callable[..., Any] | None = None
    # Set by `dspark_hf.hub.remote_code` (on `import dspark_hf`): writes custom_generate/ (the batched loop as a
    # transformers custom_generate recipe). A trust_remote_code copy of this file has none and writes none.
    _custom_generate_writer: Callable[..., Any] | None = None

    def save_pretrained(self, save_directory, *args, model_card: bool | dict = True, **kwargs):
        """`PreTrainedModel.save_pretrained` (config, weights without the target's embedding / head, and the
        trust_remote_code files), `custom_generate/` (the batched loop for `target.generate(custom_generate=folder,
        trust_remote_code=True)`, see `dspark_hf.hub.remote_code`), plus `README.md`: the model card
        `dspark_hf.hub.card.write_model_card` generates (settings, the target as `base_model`, usage;
        `model_card={...}` passes its options: metrics, calibration, license, datasets, ...). `model_card=False` writes
        none. `push_to_hub=True` uploads that card too."""
        push = kwargs.pop("push_to_hub", False)
        main = args[0] if args else kwargs.get("is_main_process", True)
        writer = type(self)._model_card_writer if model_card is not False else None
        options = dict(model_card) if isinstance(model_card, dict) else {}
        hub: dict[str, Any] = {}
        if push and main:
            from transformers.utils.hub import hf_api

            hub = {k: kwargs.pop(k) for k in ("commit_message", "commit_description", "create_pr", "revision")
                   if k in kwargs}
            repo_id = kwargs.pop("repo_id", os.path.basename(os.path.normpath(os.fspath(save_directory))))
            hub["repo_id"] = hf_api().create_repo(repo_id, private=kwargs.pop("private", None),
                                                  token=kwargs.get("token"), exist_ok=True).repo_id
            options.setdefault("repo_id", hub["repo_id"])
        with self.portable_target() if hub else contextlib.nullcontext():
            result = super().save_pretrained(save_directory, *args, **kwargs)
            if main and type(self)._custom_generate_writer is not None:
                type(self)._custom_generate_writer(save_directory)
            if main and writer is not None:
                writer(self, save_directory, **options)
        if hub:
            repo_id = hub.pop("repo_id")
            self._upload_modified_files(save_directory, repo_id, files_timestamps={}, token=kwargs.get("token"),
                                        **{"commit_message": "Upload DSpark drafter", **hub})
        return result

    def push_to_hub(self, repo_id: str, *, model_card: bool | dict = True, commit_message: str | None = None,
                    commit_description: str | None = None, private: bool | None = None, token: bool | str | None = None,
                    revision: str | None = None, create_pr: bool = False, max_shard_size: int | str | None = "50GB",
                    tags: list[str] | None = None) -> Any:
        """Uploads the drafter with its generated model card (`README.md`, see `save_pretrained`) instead of
        transformers' generic one, in one commit; the recorded target is made portable first (a local target path is
        not uploaded, see `DSparkConfig.portable_target_fields`). `model_card=False`: transformers' own behaviour."""
        if model_card is False or type(self)._model_card_writer is None:
            return super().push_to_hub(repo_id, commit_message=commit_message, commit_description=commit_description,
                                       private=private, token=token, revision=revision, create_pr=create_pr,
                                       max_shard_size=max_shard_size, tags=tags)
        from transformers.utils.hub import hf_api

        repo_id = hf_api().create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
        options = dict(model_card) if isinstance(model_card, dict) else {}
        options.setdefault("repo_id", repo_id)
        if tags:
            options["tags"] = [*options.get("tags", []), *tags]
        with tempfile.TemporaryDirectory() as tmp, self.portable_target():
            self.save_pretrained(tmp, max_shard_size=max_shard_size, model_card=options)
            return self._upload_modified_files(
                tmp, repo_id, files_timestamps={}, commit_message=commit_message or "Upload DSpark drafter",
                token=token, create_pr=create_pr, revision=revision, commit_description=commit_description)

    @contextlib.contextmanager
    def portable_target(self):
        """Within the block, the config records its target machine-independently (`portable_target_fields`)."""
        fields = ("target_name_or_path", "target_revision", "target_aliases")
        saved = {name: getattr(self.config, name) for name in fields}
        portable = self.config.portable_target_fields()
        if saved["target_name_or_path"] and portable["target_name_or_path"] != saved["target_name_or_path"]:
            logger.info(f"sharing the drafter with target {portable['target_name_or_path']!r} instead of the local "
                        f"path {saved['target_name_or_path']!r} (aliases {portable['target_aliases']})")
        try:
            for name in fields:
                setattr(self.config, name, portable[name])
            yield self.config
        finally:
            for name, value in saved.items():
                setattr(self.config, name, value)

    @classmethod
    def _from_converted(cls, source, config: DSparkConfig, state_dict: dict, source_format: str,
                        **kwargs) -> "DSparkDrafter":
        """A drafter from a foreign checkpoint converted in memory (see `dspark_hf.convert`)."""
        dtype = kwargs.pop("dtype", None)
        legacy = kwargs.pop("torch_dtype", None)
        dtype = legacy if dtype is None else dtype
        device = kwargs.pop("device_map", None)
        for harmless in ("trust_remote_code", "local_files_only"):
            kwargs.pop(harmless, None)
        if kwargs:
            raise ValueError(f"{source!s} is a {source_format} checkpoint, converted in memory; from_pretrained "
                             f"options {sorted(kwargs)} do not apply to it (convert it once with `dspark-hf convert`)")
        logger.warning(f"{source!s} is a {source_format} checkpoint: converted it in memory to a DSpark drafter "
                       f"(`dspark-hf convert` writes the native folder once)")
        model = cls(config)
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        if missing or unexpected:
            raise ValueError(f"the {source_format} checkpoint at {source!s} does not match the converted drafter: "
                             f"missing {sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}")
        if isinstance(dtype, str) and dtype != "auto":
            dtype = getattr(torch, dtype)
        if dtype == "auto":
            dtype = next(iter(state_dict.values())).dtype if state_dict else None
        if dtype is not None:
            model.to(dtype=dtype)
        if isinstance(device, (str, torch.device)) and str(device) not in ("auto",):
            model.to(device=device)
        elif device is not None:
            raise ValueError(f"device_map={device!r} is not supported for a checkpoint converted in memory; give a "
                             "device string or move the drafter with .to()")
        return model.eval()

    # ------------------------------------------------------------------ target binding
    @classmethod
    def from_target(
        cls, target: PreTrainedModel, draft_vocab: Sequence[int] | torch.Tensor | None = None, **config_overrides
    ) -> "DSparkDrafter":
        """A randomly initialised drafter configured for `target`, bound to it, on its device and dtype.

        `draft_vocab`: the target ids of a reduced draft vocabulary (e.g. from
        `dspark_hf.training.vocab.build_draft_vocab`); sets `draft_vocab_size` to its length. Passing only
        `draft_vocab_size=Vd` keeps the placeholder mapping (the first Vd ids) until `set_draft_vocab`."""
        if draft_vocab is not None:
            draft_vocab = torch.as_tensor(draft_vocab)
            config_overrides.setdefault("draft_vocab_size", int(draft_vocab.numel()))
        config = DSparkConfig.from_target_config(target.config, **config_overrides)
        drafter = cls(config)
        drafter.to(device=target.device, dtype=target.dtype)
        if draft_vocab is not None:
            drafter.set_draft_vocab(draft_vocab)
        drafter.bind_target(target)
        return drafter

    # ------------------------------------------------------------------ draft vocabulary
    def set_draft_vocab(self, target_ids: Sequence[int] | torch.Tensor) -> None:
        """Sets the reduced draft vocabulary: `config.draft_vocab_size` distinct target ids, in any order (stored
        sorted in `d2t`). Do it before training: the Markov rows and the LM-head rows are indexed by draft id."""
        if self.d2t is None:
            raise ValueError("this drafter drafts over the full vocabulary (DSparkConfig.draft_vocab_size is None); "
                             "build it with draft_vocab_size=len(ids) to use a reduced draft vocabulary")
        ids = torch.as_tensor(target_ids)
        if ids.is_floating_point() or ids.dim() != 1:
            raise ValueError(f"the draft vocabulary must be a 1-D sequence of integer target ids, got shape "
                             f"{tuple(ids.shape)} dtype {ids.dtype}")
        ids = ids.long().sort().values
        validate_draft_vocab(ids, self.config.draft_vocab_size, self.config.vocab_size)
        with torch.no_grad():
            self.d2t.copy_(ids.to(self.d2t.device))
        self._draft_head = self._draft_kernel = None

    @property
    def t2d(self) -> torch.Tensor | None:
        """`[V]` bool: which target ids the drafter can propose (speculators' `t2d`); `None` = all of them."""
        if self.d2t is None:
            return None
        return torch.zeros(self.config.vocab_size, dtype=torch.bool, device=self.d2t.device).index_fill_(0, self.d2t, True)

    def d2t_offsets(self) -> torch.Tensor | None:
        """speculators / EAGLE-3's `d2t` convention: target id = draft id + offset[draft id]."""
        if self.d2t is None:
            return None
        return self.d2t - torch.arange(self.d2t.shape[0], device=self.d2t.device)

    def to_draft_inputs(self, token_ids: torch.LongTensor) -> torch.LongTensor:
        """Target ids -> the Markov head's W1 rows: their draft ids, and Vd (the "unknown" row) for ids outside
        the draft vocabulary. The identity with the full vocabulary."""
        if self.d2t is None:
            return token_ids
        vd = self.d2t.shape[0]
        index = torch.searchsorted(self.d2t, token_ids.contiguous()).clamp_(max=vd - 1)
        return torch.where(self.d2t[index] == token_ids, index, torch.full_like(index, vd))

    def in_draft_vocab(self, token_ids: torch.LongTensor) -> torch.Tensor:
        """Bool mask of the target ids the drafter can propose (all True with the full vocabulary)."""
        if self.d2t is None:
            return torch.ones_like(token_ids, dtype=torch.bool)
        return self.to_draft_inputs(token_ids) < self.d2t.shape[0]

    def check_target(self, target: PreTrainedModel) -> None:
        """Raises `ValueError` if `target` does not match the fingerprint this drafter was built for."""
        text = target.config.get_text_config()
        cfg = self.config
        problems = []
        for what, mine, theirs in (
            ("vocab size", cfg.target_vocab_size or cfg.vocab_size, text.vocab_size),
            ("hidden size", cfg.target_hidden_size or cfg.hidden_size, text.hidden_size),
            ("layer count", cfg.target_num_hidden_layers, text.num_hidden_layers),
        ):
            if mine is not None and int(mine) != int(theirs):
                problems.append(f"{what}: drafter expects {mine}, target has {theirs}")
        if problems:
            name = cfg.target_name_or_path or "its original target"
            if cfg.converted_from:
                name += f" (converted from a {cfg.converted_from} checkpoint)"
            raise ValueError(
                f"this DSpark drafter was built for {name} and does not fit the given target "
                f"({getattr(target.config, '_name_or_path', '') or type(target).__name__}): " + "; ".join(problems)
            )
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        if embed is None or head is None:
            raise ValueError("the target must expose input embeddings and an LM head (get_output_embeddings()).")
        offloaded = [what for what, module in (("input embedding", embed), ("LM head", head))
                     if getattr(getattr(module, "weight", None), "device", None) == torch.device("meta")]
        if offloaded:  # accelerate offload (device_map with "disk" / "cpu" next to a GPU): weights exist in forwards only
            raise ValueError(
                f"the target's {' and '.join(offloaded)} is offloaded (its weights are on the meta device between "
                "forwards), but the drafter reads them directly every round: keep both on the device that runs the "
                "target and offload decoder layers only, e.g. device_map={'model.embed_tokens': 0, 'lm_head': 0, "
                "'model.norm': 0, 'model.rotary_emb': 0, 'model.layers': 'disk'} (names vary by architecture)")
        if self.d2t is not None:
            validate_draft_vocab(self.d2t, cfg.draft_vocab_size, int(head.weight.shape[0]))

    def bind_target(self, target: PreTrainedModel) -> "DSparkDrafter":
        """Shares `target`'s (frozen) embedding and LM head with this drafter; checks the fingerprint first."""
        self.check_target(target)
        # Stored outside `_modules` on purpose: they are the target's, never saved with the drafter.
        self._bound = {"embed": target.get_input_embeddings(), "lm_head": target.get_output_embeddings()}
        return self

    def bound_to(self, target: PreTrainedModel) -> bool:
        return bool(self._bound) and self._bound["embed"] is target.get_input_embeddings()

    def _require_bound(self) -> tuple[nn.Module, nn.Module]:
        if not self._bound:
            raise RuntimeError(
                "this DSparkDrafter is not bound to a target: call drafter.bind_target(target) "
                "(generate() does it for you)."
            )
        return self._bound["embed"], self._bound["lm_head"]

    def embed_tokens(self, token_ids: torch.LongTensor) -> torch.Tensor:
        return self._require_bound()[0](token_ids).to(self.dtype)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's full LM head `[..., V]` (what the target's distributions come from)."""
        head = self._require_bound()[1]
        return head(hidden.to(head.weight.dtype))

    def _head_key(self, weight: torch.Tensor) -> tuple:
        """What the cached head rows depend on: the head's values and device, and the `d2t` mapping."""
        return (weight._version, weight.device,
                None if self.d2t is None else (self.d2t._version, self.d2t.device, self.d2t.data_ptr()))

    def _head_rows(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The LM-head weight (and bias) rows the drafts use: all V, or the `d2t` rows, in `dtype` (None = as is).
        Cached, detached (the head is frozen); rebuilt when the head, its values, `d2t` or the dtype change."""
        head = self._require_bound()[1]
        weight, bias = head.weight, getattr(head, "bias", None)
        meta = (self._head_key(weight), dtype)
        cached = self._draft_head
        if cached is None or cached[0] is not weight or cached[1] != meta:
            w, b = weight.detach(), None if bias is None else bias.detach()
            if self.d2t is not None:
                w = w.index_select(0, self.d2t.to(w.device))
                b = None if b is None else b.index_select(0, self.d2t.to(b.device))
            if dtype is not None:
                w, b = w.to(dtype), None if b is None else b.to(dtype)
            self._draft_head = cached = (weight, meta, w, b)
        return cached[2], cached[3]

    def draft_lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Base logits over the draft vocabulary `[..., Vd]` (the full LM head without a reduced vocabulary), in the
        head's dtype; gradients flow to `hidden` only (the head is the target's, frozen)."""
        if self.d2t is None:
            return self.lm_head(hidden)
        weight, bias = self._head_rows(None)
        return nn.functional.linear(hidden.to(weight.dtype), weight, bias)

    def set_assist(self, lookup: Any = None, *, sps: Any = None, use_drafter: bool = True,
                   lookup_max_tokens: int = 16, min_survival: float = 0.3, realized_gate: bool = False,
                   drafter_backoff: bool = True) -> None:
        """How `target.generate(..., assistant_model=self)` (batch size 1) picks each round's drafts; a runtime option
        (never saved). `set_assist()` restores the default (the whole block every round).

        Args:
            lookup: an `NgramLookup` (n-gram drafts from the target's own answers and from the sequence itself).
                Each round tries it first; its drafts are used when they pay, and the drafter runs otherwise.
            sps: the target's cost curve (`dspark_hf.profile_sps(target)`). With it each round verifies the number of
                drafts (lookup or drafter) that maximises expected tokens per second, possibly none: on a CPU, where a
                forward of 2 tokens can cost far more than one, rounds the drafts would not pay for are plain steps.
            use_drafter: False: never run the drafter (lookup drafts or a plain step).
            lookup_max_tokens: the most lookup drafts per round.
            min_survival: without `sps`, lookup drafts are verified while their estimated prefix survival is at
                least this.
            realized_gate: run the drafter only while its rounds emit tokens at least as fast as plain steps, both
                timed in this call (`AssistOptions.realized_gate`).
            drafter_backoff: with `sps`, skip the drafter for a few rounds after rounds whose schedule verified
                nothing (`AssistOptions.drafter_backoff`).
        Lossless either way (see `models/lookup.py` and `candidate_generator.AssistOptions`).
        """
        from .candidate_generator import AssistOptions

        if lookup is None and sps is None and use_drafter and not realized_gate:  # (backoff needs sps)
            self.assist_options = None
            return
        self.assist_options = AssistOptions(lookup=lookup, lookup_max_tokens=lookup_max_tokens,
                                            use_drafter=use_drafter, sps=sps, min_survival=min_survival,
                                            realized_gate=realized_gate, drafter_backoff=drafter_backoff)

    @property
    def draft_head_dtype(self) -> torch.dtype | None:
        """The weight dtype of the drafts' base logits (`set_draft_head_dtype`); `None` = the target's head as is."""
        return self._draft_head_dtype

    def set_draft_head_dtype(self, dtype: torch.dtype | str | None) -> None:
        """Drafts' base logits from the target's LM-head rows in another weight dtype: a runtime option (never saved,
        training unaffected), `None` by default.

        On a CPU the K-row product with the LM head (V x d) is the largest part of a drafting round
        (`scripts/bench_round_overhead.py`: 22 of the 29 points a batch-1 round costs beyond the target's forward on
        SmolLM2-135M, fp32). Fewer bytes per weight make it cheaper (`models/draft_head.py` has the kernels):

        * `torch.int8` / `"int8"` (CPU only): fbgemm's int8 GEMM, weights int8 per row, activations quantized
          dynamically per call. The cheapest on a CPU (the head about 4x cheaper than fp32; argmax as fp32's on
          98.5-99.6% of slots on SmolLM2 drafter states).
        * `torch.float16` / `"float16"`: fp16 weights (fbgemm's fp16 GEMM on a CPU, fp32 accumulation: logits within
          4e-3 of fp32, same argmax; a half copy elsewhere). About 2.3x cheaper than fp32 on a CPU.
        * `torch.bfloat16`: a bf16 copy: for hardware with bf16 GEMMs (GPUs, AMX CPUs); slower on an AVX2-only CPU.
        * `torch.float32`: an fp32 copy (e.g. for a low-precision target). `None`: the target's head as it is.

        Lossless whatever the dtype: the drafts are drawn from (greedy: are the argmax of) the distribution these
        logits give, and `DraftBlock.logits` carries exactly that distribution to verification; only which drafts
        are proposed, so acceptance, may change. The rows are prepared on the first draft (int8: a quantized copy of
        V x d bytes; float16: 2 V x d bytes) and follow the bound target, its values and the draft vocabulary.
        """
        dtype = parse_draft_head_dtype(dtype)
        if dtype == torch.int8 and self._bound and self._bound["lm_head"].weight.device.type != "cpu":
            raise ValueError(f"draft head dtype int8 runs on the CPU only (fbgemm); the target's head is on "
                             f"{self._bound['lm_head'].weight.device}: use float16 or bfloat16 there")
        self._draft_head_dtype = dtype
        self._draft_head = self._draft_kernel = None

    def draft_head_kernel(self) -> DraftHead:
        """The kernel behind `draft_logits` (cached; rebuilt when the head, its values, `d2t` or the dtype change)."""
        head = self._require_bound()[1]
        weight = head.weight
        meta = (self._head_key(weight), self._draft_head_dtype)
        cached = self._draft_kernel
        if cached is None or cached[0] is not weight or cached[1] != meta:
            rows, bias = self._head_rows(None)
            self._draft_kernel = cached = (weight, meta, DraftHead(rows, bias, self._draft_head_dtype))
        return cached[2]

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Base draft logits `[..., Vd]` (float32; Vd = V without a reduced draft vocabulary) of drafter states, with
        the head weights in the dtype set by `set_draft_head_dtype`."""
        if self._draft_head_dtype is None and self.d2t is None:
            return self.lm_head(hidden).float()
        return self.draft_head_kernel()(hidden)

    def set_sts_temperatures(self, temperatures: Sequence[float] | None) -> None:
        """Stores STS temperatures (one per block position) in the config and the runtime buffer."""
        temperatures = [float(t) for t in (temperatures or [])]
        if temperatures and len(temperatures) != self.config.block_size:
            raise ValueError(
                f"sts_temperatures needs {self.config.block_size} values (one per block position), got {len(temperatures)}"
            )
        if any(not t > 0 for t in temperatures):
            raise ValueError(f"sts_temperatures must be > 0, got {temperatures}")
        self.config.sts_temperatures = temperatures

    # ------------------------------------------------------------------ shared pieces
    def context_features(self, hidden_states: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """Concatenates the target's `hidden_states[i + 1]` for i in `target_layer_ids` -> `[B, T, m*d]`."""
        picked = []
        for i in self.config.target_layer_ids:
            if i + 1 >= len(hidden_states) or hidden_states[i + 1] is None:
                raise ValueError(
                    f"target hidden state of layer {i} (hidden_states[{i + 1}]) is missing; run the target with "
                    f"output_hidden_states={[j + 1 for j in self.config.target_layer_ids]}"
                )
            picked.append(hidden_states[i + 1])
        return torch.cat(picked, dim=-1)

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """`[B, T, m*d]` concatenated target states -> `[B, T, d]` context features."""
        return self.hidden_norm(self.fc(features.to(self.dtype)))

    def block_embeddings(self, anchor_ids: torch.LongTensor) -> torch.Tensor:
        """anchor ids `[...]` -> `[..., L, d]`: the anchor embedding then `L - 1` mask embeddings, L =
        `config.num_block_slots` (`block_size` in the "dspark" layout, `block_size + 1` in "dflash")."""
        rows = self.config.num_block_slots
        anchor = self.embed_tokens(anchor_ids)[..., None, :]
        if self.mask_embedding is not None:
            mask = self.mask_embedding.to(anchor.dtype)
        else:
            mask = self.embed_tokens(torch.tensor(self.config.mask_token_id, device=anchor_ids.device))
        mask = mask.expand(*anchor.shape[:-2], rows - 1, anchor.shape[-1])
        return torch.cat([anchor, mask], dim=-2)

    def draft_slots(self, block_hidden: torch.Tensor) -> torch.Tensor:
        """`[..., L, d]` states of every block row -> `[..., K, d]` those of the K rows that predict drafts (row k of
        the result predicts anchor position + k + 1, whatever the layout)."""
        first = self.config.first_draft_slot
        return block_hidden[..., first:first + self.config.block_size, :]

    @torch.no_grad()
    def block_states(
        self,
        cache: DSparkContextCache,
        anchor_ids: torch.LongTensor,
        anchor_positions: torch.LongTensor | None = None,
        anchor_embeddings: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The parallel backbone forward of one drafting round: `[B, L, d]` final (normed) states of every block row
        (L = `config.num_block_slots`; `draft_slots` picks the K predicting rows). Rows sit at positions anchor + j
        and attend to each other and to every valid context row strictly before the anchor.

        `anchor_embeddings` `[B, d]` replaces the anchor row's embedding (transformers' DFlash path embeds it itself).
        """
        if cache.valid is None:
            raise ValueError("the drafter cache is empty: append the target's context rows before drafting")
        if anchor_positions is None:
            anchor_positions = cache.next_position
        b = anchor_ids.shape[0]
        rows = self.config.num_block_slots
        device = anchor_ids.device
        positions = anchor_positions[:, None] + torch.arange(rows, device=device)  # [B, L]
        sees_ctx = cache.valid & (cache.positions < anchor_positions[:, None])  # [B, T]
        mask = torch.cat(
            [sees_ctx[:, None, :].expand(b, rows, -1), torch.ones(b, rows, rows, dtype=torch.bool, device=device)],
            dim=-1,
        )
        block = self.block_embeddings(anchor_ids)
        if anchor_embeddings is not None:
            block = block.clone()
            block[:, 0] = anchor_embeddings.to(block.dtype)
        return self._backbone(block, positions, lambda i: (cache.keys[i], cache.values[i]), mask)

    def _backbone(
        self,
        block: torch.Tensor,
        positions: torch.Tensor,
        context: Callable[[int], tuple[torch.Tensor | None, torch.Tensor | None]],
        attention_mask: torch.Tensor,
    ) -> torch.Tensor:
        hidden = block
        for idx, layer in enumerate(self.layers):
            keys, values = context(idx)
            hidden = layer(hidden, positions, keys, values, attention_mask)
        return self.norm(hidden)

    # ------------------------------------------------------------------ training layout
    def forward(
        self,
        anchor_ids: torch.LongTensor,
        anchor_positions: torch.LongTensor,
        context_hidden_states: torch.Tensor,
        context_position_ids: torch.LongTensor | None = None,
        context_mask: torch.Tensor | None = None,
        return_logits: bool = True,
    ) -> DSparkOutput:
        """Parallel forward for A anchors per sequence (training / evaluation layout).

        Args:
            anchor_ids: `[B, A]` anchor tokens.
            anchor_positions: `[B, A]` their positions; block a sees context rows with position < anchor_positions[a].
            context_hidden_states: `[B, T, m*d]` concatenated target layer outputs (see `context_features`).
            context_position_ids: `[B, T]`; defaults to 0..T-1.
            context_mask: `[B, T]` bool, False for padding.
        """
        b, a = anchor_ids.shape
        k = self.config.num_block_slots  # block rows (the block_size drafts come from `draft_slots`)
        ctx = self.project_context(context_hidden_states)  # [B, T, d]
        t = ctx.shape[1]
        if context_position_ids is None:
            context_position_ids = torch.arange(t, device=ctx.device).expand(b, t)
        if context_mask is None:
            context_mask = torch.ones(b, t, dtype=torch.bool, device=ctx.device)
        block = self.block_embeddings(anchor_ids).reshape(b, a * k, -1)  # [B, A*K, d]
        positions = (anchor_positions[..., None] + torch.arange(k, device=ctx.device)).reshape(b, a * k)
        # Block a: context rows strictly before its anchor, and its own block rows (bidirectionally).
        sees_ctx = context_mask[:, None, :] & (context_position_ids[:, None, :] < anchor_positions[..., None])
        sees_ctx = sees_ctx.repeat_interleave(k, dim=1)  # [B, A*K, T]
        block_id = torch.arange(a, device=ctx.device).repeat_interleave(k)
        sees_block = (block_id[:, None] == block_id[None, :]).expand(b, -1, -1)
        mask = torch.cat([sees_ctx, sees_block], dim=-1)

        def context(idx: int) -> tuple[torch.Tensor, torch.Tensor]:
            return self.layers[idx].self_attn.key_values(ctx, context_position_ids)

        hidden = self.draft_slots(self._backbone(block, positions, context, mask).reshape(b, a, k, -1))
        return DSparkOutput(hidden_states=hidden, logits=self.draft_lm_head(hidden) if return_logits else None)

    # ------------------------------------------------------------------ inference
    def new_cache(self) -> DSparkContextCache:
        return DSparkContextCache()

    @torch.no_grad()
    def append_context(
        self,
        cache: DSparkContextCache,
        features: torch.Tensor,
        positions: torch.LongTensor,
        valid: torch.Tensor | None = None,
    ) -> None:
        """Appends verified context rows: `features` `[B, N, m*d]` at `positions` `[B, N]`; `valid` `[B, N]`."""
        if valid is None:
            valid = torch.ones(positions.shape, dtype=torch.bool, device=positions.device)
        ctx = self.project_context(features)
        keys, values = zip(*(layer.self_attn.key_values(ctx, positions) for layer in self.layers))
        cache.append(list(keys), list(values), valid.bool(), positions)

    @torch.no_grad()
    def draft(
        self,
        cache: DSparkContextCache,
        anchor_ids: torch.LongTensor,
        *,
        anchor_positions: torch.LongTensor | None = None,
        do_sample: bool = False,
        sampling: SamplingParamsLike | None = None,
        logits_processor: LogitsProcessorFn | None = None,
        prefix_ids: torch.LongTensor | None = None,
        generator: torch.Generator | None = None,
        num_drafts: int | None = None,
        candidates: int | None = None,
    ) -> DraftBlock:
        """One drafting round: a parallel backbone forward, then the sequential loop.

        Args:
            cache: context rows of every batch row (see `append_context`).
            anchor_ids: `[B]` the last verified (bonus) token of every row.
            anchor_positions: `[B]` their positions; defaults to `cache.next_position`.
            do_sample: sample drafts from the processed distribution; otherwise take its argmax.
            sampling: alternatively, a `SamplingParams` (do_sample, temperature, top-k, top-p) applied to each slot.
            logits_processor: applied to each slot's Markov-corrected logits, called as
                `processor(ids [B, L], scores [B, V])` with the ids so far (HF `LogitsProcessorList` works).
            prefix_ids: `[B, L]` the sequence before the drafts (needed only by id-dependent processors).
            generator: RNG for sampling.
            num_drafts: stop the sequential loop after this many slots (default `block_size`).
            candidates: override `config.draft_candidates` (0 = score the full vocabulary).
        Returns:
            a `DraftBlock` with tokens `[B, K]` (target ids), processed logits `[B, K, V]` over the full vocabulary
            (-inf outside a reduced draft vocabulary) and confidences `[B, K]`.
        """
        k = self.config.block_size
        num_drafts = k if num_drafts is None else max(1, min(int(num_drafts), k))
        hidden = self.draft_slots(self.block_states(cache, anchor_ids, anchor_positions))  # [B, K, d]
        base_logits = self.draft_logits(hidden[:, :num_drafts])  # [B, K, Vd] float32
        prepared = self.prepare_candidates(base_logits, candidates)
        return self.sample_block(  # (`candidates` too: a `prepared` of None means "the whole vocabulary" only with it)
            hidden[:, :num_drafts], base_logits, anchor_ids, do_sample=do_sample, sampling=sampling,
            logits_processor=logits_processor, prefix_ids=prefix_ids, generator=generator, candidates=candidates,
            prepared=prepared,
        )

    def prepare_candidates(
        self, base_logits: torch.Tensor, candidates: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """Block-parallel part of the candidate restriction (`config.draft_candidates`, overridden by `candidates`;
        0 = full vocabulary): top-M base logits `[B, K, M]`, their ids, and the head's W2 rows for them
        `[B, K, M, r]`. `None` when the loop scores the full vocabulary."""
        m = self.config.draft_candidates if candidates is None else candidates
        if not m or m >= base_logits.shape[-1]:
            return None
        values, ids = base_logits.topk(m, dim=-1)
        rows = self.markov_head.candidate_rows(ids) if self.markov_head is not None else None
        return values, ids, rows

    def sample_block(
        self,
        hidden: torch.Tensor,
        base_logits: torch.Tensor,
        anchor_ids: torch.LongTensor,
        *,
        do_sample: bool = False,
        sampling: "SamplingParamsLike | None" = None,
        logits_processor: LogitsProcessorFn | None = None,
        prefix_ids: torch.LongTensor | None = None,
        generator: torch.Generator | None = None,
        candidates: int | None = None,
        prepared: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    ) -> DraftBlock:
        """The sequential stage: left to right, bias U_k by the head, process, sample or argmax, score confidence.

        hidden `[B, K, d]`, base_logits `[B, K, Vd]` float32 (draft ids; Vd = V without a reduced draft
        vocabulary), anchor_ids `[B]` (target ids). The loop works in draft ids; tokens come back as target ids and the
        logits over the full vocabulary, -inf outside the draft vocabulary. Logits processing comes either from
        `sampling` (an object with `.warp(logits)` and `.do_sample`, e.g. `SamplingParams`; applied to the candidate
        logits directly) or from an HF-style `logits_processor(ids, scores [B, V])`. `candidates` overrides
        `config.draft_candidates` (0 = full vocabulary); `prepared` passes `prepare_candidates`' result instead.
        """
        b, num_drafts, _ = base_logits.shape
        vocab = self.config.vocab_size
        d2t = self.d2t  # None: draft ids are target ids
        if sampling is not None:
            do_sample = bool(sampling.do_sample)
        if prepared is None:
            prepared = self.prepare_candidates(base_logits, candidates)
        restrict = prepared is not None
        head = self.markov_head
        if restrict:
            cand_values, cand_ids, cand_rows = prepared  # [B, K, M], [B, K, M] draft ids, [B, K, M, r]
            cand_targets = cand_ids if d2t is None else d2t[cand_ids]  # their target ids
        state = None if head is None else head.init_state(b, hidden.device, hidden.dtype)
        ids = prefix_ids if prefix_ids is not None else anchor_ids[:, None]
        prev = self.to_draft_inputs(anchor_ids)  # the head's W1 row of the previous token (draft id or "unknown")
        # keep [B, M] / [B, Vd] logits until the end (HF processors need the full vocabulary at every step)
        compact = (restrict or d2t is not None) and logits_processor is None
        tokens, logits, features_all = [], [], []
        for slot in range(num_drafts):
            if restrict:
                step_logits = cand_values[:, slot]
                if head is not None:
                    latent, features, state = head.step(prev, hidden[:, slot], state)
                    step_logits = step_logits + head.project_rows(latent, cand_rows[:, slot]).float()
            else:
                step_logits = base_logits[:, slot]
                if head is not None:
                    latent, features, state = head.step(prev, hidden[:, slot], state)
                    step_logits = step_logits + head.project(latent).float()
            if head is not None:
                features_all.append(features)
            if logits_processor is not None:
                # HF processors need the whole vocabulary; tokens outside the candidates / draft vocab stay at -inf
                if restrict:
                    step_logits = base_logits.new_full((b, vocab), float("-inf")).scatter(
                        1, cand_targets[:, slot], step_logits)
                elif d2t is not None:
                    step_logits = base_logits.new_full((b, vocab), float("-inf")).index_copy(1, d2t, step_logits)
                step_logits = logits_processor(ids, step_logits)
            elif sampling is not None:
                step_logits = sampling.warp(step_logits)
            if do_sample:
                pick = torch.multinomial(torch.softmax(step_logits, dim=-1), 1, generator=generator).squeeze(-1)
            else:
                pick = step_logits.argmax(dim=-1)
            if not compact:  # pick is a target id (the processor saw the full vocabulary, or there is no reduction)
                token, prev = pick, self.to_draft_inputs(pick)
            elif restrict:
                token = cand_targets[:, slot].gather(1, pick[:, None]).squeeze(1)
                prev = cand_ids[:, slot].gather(1, pick[:, None]).squeeze(1)
            else:  # pick is a draft id
                token, prev = d2t[pick], pick
            if logits_processor is not None:  # id-dependent processors see the drafts so far
                ids = torch.cat([ids, token[:, None]], dim=-1)
            tokens.append(token)
            logits.append(step_logits)
        stacked = torch.stack(logits, dim=1)
        sparse = None
        if compact:  # the exact draft distribution: softmax over the candidates / draft ids, zero elsewhere
            # kept sparse: the [B, K, V] tensor is built only if someone reads it (greedy verification does not)
            ids = cand_targets if restrict else d2t.expand(b, num_drafts, -1)
            sparse, stacked = SparseLogits(stacked.float(), ids, vocab), None
        raw = confidences = None
        if self.confidence_head is not None:
            # c_k reads h_k and W1[x_{k-1}]; it does not steer sampling, so it is scored once for the whole block.
            feats = torch.stack(features_all, dim=1) if features_all else None
            raw = self.confidence_head(hidden[:, :num_drafts], feats).float()  # [B, K]
            if self.config.sts_temperatures:  # read from the config: it is what save_pretrained / calibration write
                temps = torch.tensor(self.config.sts_temperatures[:num_drafts], dtype=raw.dtype, device=raw.device)
                confidences = torch.sigmoid(raw / temps)
            else:
                confidences = torch.sigmoid(raw)
        return DraftBlock(
            tokens=torch.stack(tokens, dim=1),
            logits=stacked,
            confidences=confidences,
            confidence_logits=raw,
            sparse_logits=sparse,
        )


def _read_foreign_format(folder) -> "tuple[DSparkConfig, dict, str] | None":
    """`(config, state_dict, format)` when `folder` is a local checkpoint folder of a foreign format that a registered
    reader converts (see `FOREIGN_FORMAT_READERS`); `None` for native folders and Hub ids. A foreign folder with no
    reader registered (this file used alone, as remote code) raises a clear error instead of loading garbage."""
    import json
    import os

    try:
        path = os.fspath(folder)
    except TypeError:
        return None
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        return None
    for reader in FOREIGN_FORMAT_READERS:
        converted = reader(path)
        if converted is not None:
            return converted
    try:
        model_type = json.loads(open(config_path).read()).get("model_type")
    except (OSError, ValueError):
        return None
    if model_type not in (None, DSparkConfig.model_type):
        raise ValueError(f"{path} is not a DSpark drafter (config.json model_type={model_type!r}); convert it with "
                         f"`dspark-hf convert {path} OUT` (or import dspark_hf, which converts it on loading)")
    return None


def _int8_release_file(name, kwargs: dict) -> str | None:
    """The local `model.safetensors` of `name` (a folder, or a Hub id resolved through the HF cache / Hub as
    `from_pretrained` does) when it is in the int8 release format; else `None` (the regular loading path)."""
    try:
        path = os.fspath(name)
    except TypeError:
        return None
    subfolder = kwargs.get("subfolder") or ""
    if os.path.isdir(path):
        weights = os.path.join(path, subfolder, "model.safetensors")
        return weights if os.path.isfile(weights) and is_int8_release(weights) else None
    try:
        from transformers.utils import cached_file

        weights = cached_file(path, "model.safetensors", subfolder=subfolder, revision=kwargs.get("revision"),
                              cache_dir=kwargs.get("cache_dir"), token=kwargs.get("token"),
                              local_files_only=kwargs.get("local_files_only", False),
                              _raise_exceptions_for_missing_entries=False,
                              _raise_exceptions_for_connection_errors=False)
    except Exception:  # not resolvable: the regular loading path reports it
        return None
    return weights if weights and is_int8_release(weights) else None


def _check_stored_draft_vocab(folder) -> None:
    """For a local checkpoint folder: a clear error when its stored `d2t` does not fit its `draft_vocab_size` (before
    transformers' generic size-mismatch error). Other sources are left to the regular loading checks."""
    import json
    import os

    try:
        path = os.fspath(folder)
    except TypeError:
        return
    config_path, weights_path = os.path.join(path, "config.json"), os.path.join(path, "model.safetensors")
    if not (os.path.isfile(config_path) and os.path.isfile(weights_path)):
        return
    try:
        from safetensors import safe_open

        size = json.loads(open(config_path).read()).get("draft_vocab_size")
        with safe_open(weights_path, framework="pt") as handle:
            shape = handle.get_slice("d2t").get_shape() if "d2t" in handle.keys() else None
    except Exception:  # unreadable files: the regular loading path reports them
        return
    if size is None and shape is not None:
        raise ValueError(f"the checkpoint at {path} stores a draft vocabulary mapping (d2t) but its config has no "
                         "draft_vocab_size")
    if size is not None and shape is None:
        raise ValueError(f"the checkpoint at {path} has draft_vocab_size={size} but stores no draft vocabulary "
                         "mapping (d2t)")
    if size is not None and list(shape) != [int(size)]:
        raise ValueError(f"the checkpoint at {path} holds a bad draft vocabulary mapping (d2t): shape {list(shape)}, "
                         f"but draft_vocab_size is {size}")


def validate_draft_vocab(d2t: torch.Tensor, draft_vocab_size: int | None, vocab_size: int) -> None:
    """Raises `ValueError` unless `d2t` is a valid draft -> target id mapping: 1-D integer, `draft_vocab_size`
    entries, strictly increasing (so unique) target ids in [0, vocab_size)."""
    if d2t.dim() != 1 or d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise ValueError(f"d2t must be a 1-D integer tensor of target ids, got shape {tuple(d2t.shape)} dtype {d2t.dtype}")
    if draft_vocab_size is not None and d2t.shape[0] != draft_vocab_size:
        raise ValueError(f"d2t holds {d2t.shape[0]} ids but DSparkConfig.draft_vocab_size is {draft_vocab_size}")
    if d2t.numel() == 0:
        raise ValueError("d2t is empty")
    lo, hi = int(d2t.min()), int(d2t.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"d2t ids must lie in [0, {vocab_size}) (the target's vocabulary), got ids in [{lo}, {hi}]")
    unique, counts = torch.unique(d2t, return_counts=True)
    if unique.numel() != d2t.numel():
        raise ValueError(f"d2t has duplicate target ids, e.g. {unique[counts > 1][:5].tolist()}")
    if bool((d2t[1:] < d2t[:-1]).any()):
        raise ValueError("d2t must be sorted in increasing order of target id (draft id i <-> i-th smallest id)")


DSparkConfig.register_for_auto_class()
DSparkDrafter.register_for_auto_class("AutoModel")

__all__ = ["DSparkDrafter", "DSparkPreTrainedModel", "DSparkOutput", "DSparkRotaryEmbedding", "FOREIGN_FORMAT_READERS",
           "validate_draft_vocab"]
