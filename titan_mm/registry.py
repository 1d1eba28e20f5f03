"""The model-family contract: name -> :class:`ModelSpec`. A family registers itself with one call to
:func:`register` from its package ``__init__``; nothing outside a family's folder reads its config fields or
names it. The trainer, the memory estimator, the kernel tuner, the optimizer and the benches ask the spec.

Built-in families are registered lazily on first lookup (importing titan_mm.registry stays cheap).
"qwen3" and "qwen3_moe" are the same spec (one config class covers dense and MoE; the flavor or the HF
config.json decides); both names list every Qwen3 flavor.

How to add a family: docs/models.md (the Qwen2 family in titan_mm/models/qwen2/ is the worked example).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from titan_mm.models.hf_io import HFCheckpointError, local_hf_dir, read_hf_config

if TYPE_CHECKING:  # the media-layout types of DataNeeds (titan_mm.nn.media); named for annotations only
    from titan_mm.nn.media import AudioFrontEnd, ClipLayout, DocLayout, VisionLayout


class SpecError(ValueError):
    """A model-selection mistake the user must fix (unknown family or flavor, bad hf_path or overrides)."""


@dataclass(frozen=True)
class VisionDims:
    """The numbers of a vision tower that tools need (the estimator, the tuner, the benches)."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_dim: int
    """Values per flattened patch (channels x temporal x patch x patch)."""
    merge_size: int
    deepstack_layers: int = 0
    """Decoder blocks that receive a DeepStack addition (0: none)."""


@dataclass(frozen=True)
class LinearDims:
    """The fixed-size per-sequence state of a decoder's linear-attention layers (Gated DeltaNet), which the
    serving engine keeps in state slots instead of KV blocks."""

    layers: tuple[int, ...]
    """Decoder layer ids of the linear-attention blocks (the others are full attention, with KV blocks)."""
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    """Width W of the causal short convolution; its state is the last W - 1 inputs."""

    @property
    def conv_channels(self) -> int:
        """Channels of the convolution: q and k of every key head, v of every value head."""
        return self.num_key_heads * 2 * self.key_head_dim + self.num_value_heads * self.value_head_dim


@dataclass(frozen=True)
class ModelDims:
    """The decoder's shapes. MoE fields are 0 for dense models."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    """Dense MLP width (of the dense layers; 0 when every layer is MoE)."""
    dense_layers: int
    """Decoder blocks with a dense MLP."""
    moe_layers: int = 0
    num_experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    tie_word_embeddings: bool = False
    vision: VisionDims | None = None
    max_position_embeddings: int = 0
    """Longest sequence the positions are built for (the serving engine's default max_model_len; 0: unknown)."""
    linear: LinearDims | None = None
    """The linear-attention layers' state (None: every layer is full attention, cached in KV blocks only)."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


@dataclass(frozen=True)
class TokenizerNames:
    """A family's built-in tokenizer (``data.tokenizer_path = "builtin:<family>"``): a built-in vocabulary of
    titan_mm.data.tokenizer with some of its added tokens renamed, at the same ids and with the same BPE."""

    base: str
    """The built-in vocabulary it renames (a key of titan_mm.data.tokenizer.BUILTIN)."""
    renames: dict[int, str]
    """Added-token id -> the family's name for that token."""


@dataclass(frozen=True)
class Runtime:
    """Settings of a built model that the step and the tuner read (they are runtime fields of its config)."""

    attn_backend: str
    """"sdpa" | "flex" | "varlen" (titan_mm/nn/attention.py)."""
    kernels: bool | str
    """The titan_mm.kernels ops spec the model was built with (False: PyTorch references)."""
    sliding_window: int | None = None
    """The window of the model's sliding-window layers (None: every layer attends fully); the attention
    metadata is built with it."""


POSITION_AXES = {"1d": 1, "mrope": 3}
"""Position kinds a family may declare (DataNeeds.positions) -> rows of its position_ids."""


@dataclass(frozen=True)
class ImageSplit:
    """One image as a family's own split of tokens (BAGEL's ``[vision_start, ViT tokens, vision_end]``), as its
    training builds it: what the serving engine puts in a prompt's image pad (1-D positions)."""

    ids: list[int]
    """The split's L tokens."""
    positions: list[int]
    """[L] each token's position less the split's first position, which follows the token before it (BAGEL: all 0,
    one position for the whole split)."""
    advance: int
    """Positions the split takes: the token after it is at the split's first position + ``advance``."""
    seq: dict[str, Any]
    """Per-token keys of the split ([L] arrays; e.g. the token kinds), 0 on every other token of a row."""
    flat: dict[str, Any]
    """Keys concatenated over a step's images ([N, ...] arrays: the ViT's patches, positions, lengths)."""
    bidirectional: bool = True
    """Its tokens attend to all of the split (the rest of the prompt stays causal)."""


@dataclass(frozen=True)
class SplitLayout:
    """A family whose prompts hold images as splits of its own (:class:`ImageSplit`) instead of the Qwen-VL
    pads the vision processor expands; what the serving engine asks it (each a Bound of the family's config)."""

    image: Callable[..., ImageSplit]
    """image(payload: a PIL image, encoded bytes or an array; the [data] section; the tokenizer) -> the split
    (SkipSample for an image it cannot read)."""
    pad: Callable[..., int]
    """pad(tokenizer) -> the prompt token that stands for one image (replaced by its split)."""
    chat: Callable[..., list[int]]
    """chat(parsed sample, tokenizer) -> the prompt ids of chat messages in the family's training layout, one
    ``pad`` per image part in order, ending where the answer starts (SkipSample for a part it cannot take)."""


@dataclass(frozen=True)
class DataNeeds:
    """What the data pipeline must produce for this family."""

    positions: str = "1d"
    """"1d": positions restart per document; "mrope": 3-D [3, B, S] M-RoPE positions (Qwen-VL)."""
    doc_positions: Callable[..., Any] | None = None
    """The family's builder of one document's [axes, L] positions, (ids, media items, pad ids, processor config)
    (Qwen-VL: titan_mm.data.vision.mrope_positions); None: 1-D positions, restarting per document at collate."""
    patch_size: int = 0
    """Vision patch size in pixels (0: no vision input)."""
    temporal_patch_size: int = 0
    merge_size: int = 0
    """Patches per merged visual token along each spatial axis."""
    special_tokens: dict[str, int] = field(default_factory=dict)
    """Token ids the processors must place, by role (image_pad, video_pad, vision_start, vision_end, ...)."""
    chat_template: str = "chatml_think"
    """The processors' chat template for this family (titan_mm.data.processors.CHAT_TEMPLATES: "chatml", or
    "chatml_think" with Qwen3's think block); data.chat_template may override it."""
    video: bool = True
    """The family trains on video parts. False: they are skipped and counted (unknown_modality)."""
    vision_layout: VisionLayout | None = None
    """The family's image / video processing (titan_mm.nn.media.VisionLayout: mean / std, frame sampling, pixel
    bounds, video timing and audio-in-video order; titan_mm.data.vision follows it). Required with a patch size."""
    video_tokens_per_second: float = 0.0
    """Temporal positions per second of video, for layouts whose video is one run of pads (HF
    vision_config.tokens_per_second; the Omni thinkers' position_id_per_seconds)."""
    seconds_per_chunk: float = 0.0
    """A layout whose audio_in_video is "chunks": a video part's video and audio tokens interleave in chunks of
    this many seconds (Qwen2.5-Omni's seconds_per_chunk)."""
    audio: AudioFrontEnd | None = None
    """The family's audio front end (titan_mm.nn.media.AudioFrontEnd: clip padding and the audio tower's token
    count; titan_mm.data.audio follows it). None: the family takes no audio (its samples with audio parts are
    skipped and counted, unknown_modality)."""
    clips: ClipLayout | None = None
    """A family trained on captioned clips through frozen encoders (titan_mm.nn.media.ClipLayout; titan_mm.data.clips
    reads a latent cache or encodes raw clips in the pipeline). None: token rows."""
    docs: DocLayout | None = None
    """A family that builds its packed documents from the records itself (titan_mm.nn.media.DocLayout; the loader
    packs, mixes and resumes them). None: the chat / text processors build them."""
    splits: SplitLayout | None = None
    """A family whose served images are splits of its own (:class:`SplitLayout`); None: the vision processor's
    pads (or no images)."""

    def takes(self, kind: str) -> bool:
        """Whether the family's inputs hold media of ``kind`` ("image", "video" or "audio") in its token rows: what
        the serving engine accepts in a prompt and an eval task may carry."""
        return {"image": bool(self.patch_size) or self.splits is not None,
                "video": bool(self.patch_size) and self.video,
                "audio": self.audio is not None}[kind]

    @property
    def position_axes(self) -> int:
        """Rows of a batch's ``position_ids`` (1: [B, S]; 3: [3, B, S]); what the collator packs."""
        return POSITION_AXES[self.positions]


@dataclass(frozen=True)
class KernelShapes:
    """The widths at which the model calls each titan_mm.kernels op on one rank (tensor-parallel degree
    ``tp`` applied), for launch-config tuning before the first step (titan_mm/kernels/_tuning.py)."""

    rms_norm: tuple[int, ...] = ()
    """Row widths of plain RMSNorms over [N, width] (hidden: attn_norm / final norm)."""
    head_norm: tuple[tuple[int, int], ...] = ()
    """(heads, head_dim) of per-head RMSNorms over [N, heads, head_dim] (q/k-norm)."""
    add_rms_norm: tuple[int, ...] = ()
    swiglu: tuple[int, ...] = ()
    rope: tuple[tuple[int, int, int], ...] = ()
    """(q heads, kv heads, head_dim)."""
    bias_gelu: tuple[int, ...] = ()
    """ViT MLP widths with a tanh GELU; tuned at the vision token count."""
    vocab: int = 0
    """Vocabulary of the fused linear cross-entropy (0: no LM head)."""

    def plus(self, **extra: tuple) -> "KernelShapes":
        """These shapes and ``extra``'s (field -> more keys), each field's keys once, sorted: an encoder's on top of
        its decoder's."""
        return dataclasses.replace(self, **{f: tuple(sorted({*getattr(self, f), *keys})) for f, keys in extra.items()})


@dataclass(frozen=True)
class BlockBytes:
    """Activation bytes per token (decoder) or per patch (vision encoder) of one block."""

    kept: float
    """Saved for the backward under the topology's AC mode (what every block holds at the loss)."""
    full: float
    """Saved without AC (what one block holds while it is recomputed under AC)."""
    bwd_tmp: float
    """Largest gradient temporaries of its backward, on top of what it saved."""


@dataclass(frozen=True)
class MemoryTerms:
    """A family's activation terms for the memory estimator (titan_mm/parallel/memory.py), for one topology,
    activation dtype and kernels / compile / float8 setting; the shapes come from :class:`ModelDims`."""

    decoder: BlockBytes
    """Bytes per token of one decoder block (tp / sequence parallel applied)."""
    head: float
    """Bytes per token saved outside the blocks through the forward (final norm, RoPE tables)."""
    vision: BlockBytes | None = None
    """Bytes per patch of one vision-encoder block (None: no vision encoder)."""
    vision_stem: float = 0.0
    """Bytes per patch saved outside the vision-encoder blocks (patch embedding input, mergers)."""
    vision_head: float = 0.0
    """Bytes per token saved through the forward when the batch has vision input (DeepStack additions)."""
    loss_chunk: int = 4096
    """Tokens per chunk of the PyTorch chunked cross-entropy (titan_mm.nn.loss)."""


@dataclass(frozen=True)
class FusedRows:
    """How a fused projection (several matrices in one weight, e.g. q/k/v) lays out its output rows (dim -2 of a
    weight [..., rows, in]): rows = [groups, sum(sizes)], and part j is the ``sizes[j]`` rows of every group.
    Concatenated q / k / v: ``FusedRows(1, (q_rows, k_rows, v_rows))``; head-major [H, 3, Dh]:
    ``FusedRows(H, (Dh, Dh, Dh))``."""

    groups: int
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class SeqKey:
    """A batch key laid out along the sequence: ``[..., B, S, *trailing]`` (M-RoPE positions lead with 3)."""

    name: str
    trailing: tuple[str | int, ...] = ()
    """The dims after S, by name or size (latents [B, S, C]: ``("C",)``); the CP split cuts the axis before them."""
    dtype: str = "int64"

    def axis(self, t: torch.Tensor) -> int:
        """The sequence axis of ``t``, this key's tensor."""
        return t.dim() - 1 - len(self.trailing)


ATTN_KEYS = (SeqKey("position_ids"), SeqKey("doc_ids", dtype="int32"), SeqKey("prefix_mask", dtype="bool"),
             SeqKey("seg_ids", dtype="int32"), SeqKey("seg_kinds", dtype="int8"))
"""Sequence keys of every batch: RoPE positions and the attention description (titan_mm.nn.attention)."""
TOKEN_KEYS = (SeqKey("input_ids"), SeqKey("labels"))


@dataclass(frozen=True)
class BatchSchema:
    """The typed record a family's batches are: what packing, the CP splitter and PP micro-batching cut along the
    sequence and what they leave whole. ``tokens`` False: no input_ids / labels (a diffusion transformer's
    latents, timesteps and encoder states)."""

    seq: tuple[SeqKey, ...] = ()
    """The family's own sequence keys (its prepare_batch's, its data's); ATTN_KEYS (and TOKEN_KEYS) are added."""
    row: tuple[str, ...] = ()
    """Per-row keys ([B, ...]: a timestep per row, pooled encoder states): never cut along the sequence."""
    tokens: bool = True
    flat: tuple[str, ...] = ()
    """Keys concatenated over the batch's items ([N, ...]: one family's ViT patches side by side), neither per row
    nor per position: data.balance cannot cut them into rows, so preflight refuses it with several dp ranks."""

    @property
    def seq_keys(self) -> tuple[SeqKey, ...]:
        """Every sequence key: tokens (when ``tokens``), the attention keys, then the family's."""
        return (TOKEN_KEYS if self.tokens else ()) + ATTN_KEYS + self.seq


@dataclass(frozen=True)
class ModelSpec:
    """Every extension point of a model family, as one typed value."""

    name: str
    config_cls: type
    flavors: dict[str, Any]
    build: Callable[[Any], torch.nn.Module]
    """build(cfg) -> nn.Module, under the caller's device context (meta in the trainer). The module follows
    the embed -> trunk -> head contract of docs/models.md."""
    config_from_hf: Callable[..., Any]
    """config_from_hf(hf_dir) -> config."""
    load_hf: Callable[[torch.nn.Module, str], None]
    """load_hf(model, hf_dir): checks names/shapes/model_type, loads full tensors (plain, meta or FSDP model)."""
    save_hf: Callable[..., None]
    """save_hf(model_or_state_dict, cfg, out_dir, dtype=None): safetensors + config.json for transformers."""
    flops: Callable[..., float]
    """flops(cfg, doc_lens, **batch_grids) -> training FLOPs of a batch with these document lengths
    (docs/flops.md); vision families also read ``image_grid_thw`` / ``video_grid_thw``."""
    plan: Callable[[Any], Any]
    """plan(cfg) -> titan_mm.parallel.plan.ParallelizePlan."""
    dims: Callable[[Any], ModelDims]
    """dims(cfg) -> the shapes tools need."""
    runtime: Callable[[Any], Runtime]
    """runtime(cfg) -> the attention backend, kernels and sliding window the config carries."""
    with_runtime: Callable[..., Any]
    """with_runtime(cfg, attn_backend=..., kernels=...) -> cfg with those runtime fields set."""
    data_needs: Callable[[Any], DataNeeds]
    """data_needs(cfg) -> what the data pipeline must produce (positions, patch / merge sizes, tokens)."""
    kernel_shapes: Callable[..., KernelShapes]
    """kernel_shapes(cfg, tp=1, encoder_tp=False) -> the widths each kernel op runs at on one rank."""
    memory_terms: Callable[..., MemoryTerms] | None = None
    """memory_terms(cfg, topo, act_bytes, kernels=..., compile=..., float8=...) ->
    MemoryTerms: the family's activation bytes per token / patch. None: no estimate yet (the memory tool refuses
    the family in one line; pipeline stages split the blocks evenly)."""
    prepare_batch: Callable[[Any, dict, torch.device], dict] | None = None
    """prepare_batch(cfg, batch, device) -> a new batch with the host-built metadata the forward needs in place of
    the keys it was built from (vision grids -> VisionMeta, visual-token indices; the forward takes no grid),
    called on the host before the batch moves to the device and before any context-parallel split. None: the
    batch is the forward's input as it is."""
    seq_keys: tuple[str, ...] = ()
    """Keys that prepare_batch adds laid out along the sequence ([B, S] or [..., B, S]): context parallelism
    splits them with input_ids."""
    batch_schema: BatchSchema | None = None
    """The family's batch record (:meth:`schema`); None: a token batch whose own sequence keys are ``seq_keys``."""
    param_groups: Callable[[torch.nn.Module, Any, list[dict], float], list[dict]] | None = None
    """param_groups(model, cfg, groups, base_lr) -> groups split per part with their lr (None: as built)."""
    fused_params: Callable[[Any], dict[str, FusedRows]] | None = None
    """fused_params(cfg) -> {fnmatch pattern over parameter FQNs: FusedRows} of the weights that fuse several
    projections; Muon (optimizer.muon_split_fused) orthogonalizes their parts one by one. None: no fused weights."""
    hf_model_types: tuple[str, ...] = ()
    """HF config.json model_type values this spec reads."""
    kv_cache: bool = True
    """The forward runs through the paged KV-cache path (attn.kv_cache), so the serving engine and eval tasks
    decode it. False: a layer keeps state the cache does not hold; decode by re-running the sequence."""
    encoder_balance: bool = False
    """prepare_batch takes ``encoder_balance`` (a planner from the train step) and plans the vision tower's all-to-all
    (titan_mm.parallel.encoder_balance; parallel.encoder_balance). False: the option is refused for this family."""
    objectives: tuple[str, ...] = ("causal",)
    """The registered objectives (titan_mm.objectives) that train the family, one per token group of a packed row
    (BAGEL: ("causal", "flow_matching")). The job's ``[objective] kind`` may put a diffusion LM in "causal"'s place.
    The model's forward takes ``loss`` and answers each objective's hook (``lm_loss``, ``predict_velocity``)."""
    objective_options: Callable[[Any], dict[str, dict]] | None = None
    """objective_options(cfg) -> {objective name: its options} (e.g. flow matching's sampler and timestep shift from
    the model config); None: every objective with its defaults."""
    synthetic: Callable[[Any, int], Callable[[list[torch.Generator]], dict]] | None = None
    """synthetic(model_cfg, seq_len) -> make_batch(generators) -> a micro-batch of the family's own rows, one
    generator per row, for ``data.dataset = "synthetic"`` (families without tokens); None: random token rows."""
    tokenizer: TokenizerNames | None = None
    """The family's built-in tokenizer, ``builtin:<name>``, where its special tokens carry other names than the base
    vocabulary's (Qwen2.5-Omni's ``<|AUDIO|>``, ...); None: it has none of its own."""

    def schema(self) -> BatchSchema:
        """The family's :class:`BatchSchema`: ``batch_schema``, or the token batch with ``seq_keys``."""
        return self.batch_schema or BatchSchema(tuple(SeqKey(k) for k in self.seq_keys))

    def flavor(self, name: str):
        if name not in self.flavors:
            near = difflib.get_close_matches(name, list(self.flavors), n=3, cutoff=0.4)
            hint = f"did you mean {' or '.join(map(repr, near))}? " if near else ""
            raise SpecError(f"model.flavor {name!r} is not a flavor of {self.name!r}; {hint}"
                            f"available: {', '.join(self.flavors)}")
        return self.flavors[name]


_REGISTRY: dict[str, ModelSpec] = {}
# name -> module whose import registers it (built-in families; others call register() themselves)
_BUILTIN = {
    "bagel": "titan_mm.models.bagel",
    "qwen2": "titan_mm.models.qwen2",
    "qwen2_5_vl": "titan_mm.models.qwen2_5_vl",
    "qwen2_5_omni": "titan_mm.models.qwen2_5_omni",
    "qwen3": "titan_mm.models.qwen3",
    "qwen3_moe": "titan_mm.models.qwen3",
    "qwen3_omni_moe": "titan_mm.models.qwen3_omni_moe",
    "qwen3_vl": "titan_mm.models.qwen3_vl",
    "qwen3_vl_moe": "titan_mm.models.qwen3_vl",
    "qwen3_5": "titan_mm.models.qwen3_5",
    "qwen3_5_moe": "titan_mm.models.qwen3_5",
    "wan": "titan_mm.models.wan",
}


def register(spec: ModelSpec, *aliases: str) -> ModelSpec:
    """Register ``spec`` under its name (and aliases, as copies named after the alias). Re-registering
    the same name replaces it (module reloads)."""
    _REGISTRY[spec.name] = spec
    for a in aliases:
        _REGISTRY[a] = dataclasses.replace(spec, name=a)
    return spec


def get_model_spec(name: str) -> ModelSpec:
    if name not in _REGISTRY and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])
    if name not in _REGISTRY:
        known = sorted(set(_REGISTRY) | set(_BUILTIN))
        near = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
        hint = f"did you mean {' or '.join(map(repr, near))}? " if near else ""
        raise SpecError(f"unknown model {name!r}; {hint}registered: {', '.join(known)}")
    return _REGISTRY[name]


def spec_for_hf_dir(hf_dir: str) -> ModelSpec:
    """The spec whose hf_model_types contains config.json's model_type."""
    d = read_hf_config(hf_dir)
    mt = d.get("model_type") or d.get("_class_name")  # a diffusers config names its class instead
    for n in _BUILTIN:
        get_model_spec(n)
    for spec in _REGISTRY.values():
        if mt in spec.hf_model_types:
            return spec
    raise SpecError(f"no registered model reads model_type={mt!r} ({hf_dir}/config.json)")


def spec_for_config(model_cfg: Any) -> ModelSpec:
    """The registered spec whose config class ``model_cfg`` is (tools that are handed a bare config). A family's
    config may subclass another's (Qwen2.5-Omni's subclasses Qwen2.5-VL's): the most derived class wins."""
    for n in _BUILTIN:
        get_model_spec(n)
    by_cls: dict[type, ModelSpec] = {}
    for spec in _REGISTRY.values():  # families that share a class (qwen3 / qwen3_moe): the first registered
        by_cls.setdefault(spec.config_cls, spec)
    for cls in type(model_cfg).__mro__:
        if cls in by_cls:
            return by_cls[cls]
    raise SpecError(f"no registered model family has the config class {type(model_cfg).__name__}")


def hf_model_types() -> list[str]:
    """Every config.json model_type a registered family reads."""
    for n in _BUILTIN:
        get_model_spec(n)
    return sorted({t for spec in _REGISTRY.values() for t in spec.hf_model_types})


def list_models() -> list[str]:
    return sorted(set(_REGISTRY) | set(_BUILTIN))


def families() -> list[ModelSpec]:
    """One spec per family (aliases sharing a config class and flavors are listed once)."""
    out: dict[tuple[type, int], ModelSpec] = {}
    for n in _BUILTIN:
        get_model_spec(n)
    for spec in _REGISTRY.values():
        out.setdefault((spec.config_cls, id(spec.flavors)), spec)
    return list(out.values())


def resolve_model(name: str, flavor: str, hf_path: str | None = None, overrides: str | dict = "",
                  attn_backend: str = "sdpa", kernels: bool | str = False,
                  moe_float8: bool = False) -> tuple[ModelSpec, Any]:
    """(spec, model config): the flavor or the HF config.json, then the JSON ``overrides`` of config fields,
    then the runtime fields. ``moe_float8`` (float8.moe_experts): the MoE experts' GEMMs in float8, the runtime field
    of the same name that every MoE family's config has. Every mistake is a :class:`SpecError` naming what to fix."""
    spec = get_model_spec(name)
    if hf_path:
        try:  # a local folder or a Hub repo id (config files only: the weights are fetched by their reader)
            folder = local_hf_dir(hf_path)
            d = read_hf_config(folder)
            mt = d.get("model_type") or d.get("_class_name")  # a diffusers config names its class instead
        except HFCheckpointError as e:
            raise SpecError(str(e)) from None
        except ValueError as e:  # json's decode error
            raise SpecError(f"{Path(folder) / 'config.json'} is not valid JSON ({e}); re-download it") from None
        cfg_file = Path(folder) / "config.json"
        if not mt:
            raise SpecError(f"{cfg_file} has no model_type; add one of the registered types "
                            f"({', '.join(hf_model_types())}), or point model.hf_path at the original HF folder")
        try:
            model_cfg = spec.config_from_hf(folder)
        except (ValueError, KeyError, TypeError) as e:  # the family's reader names what does not fit
            why = f"the key {e} is missing" if isinstance(e, KeyError) else str(e)
            raise SpecError(f"{cfg_file} (model.name {name!r}): {why}") from None
    else:
        model_cfg = spec.flavor(flavor)
    kw: dict[str, Any] = json.loads(overrides) if isinstance(overrides, str) and overrides else dict(overrides or {})
    if kw:
        try:
            model_cfg = override(model_cfg, kw)
        except (TypeError, ValueError) as e:
            raise SpecError(f"model.overrides {kw}: {e}") from None
    model_cfg = spec.with_runtime(model_cfg, attn_backend=attn_backend, kernels=kernels)
    if moe_float8:
        d = spec.dims(model_cfg)
        if not d.num_experts or d.hidden_size % 16 or d.moe_intermediate_size % 16:
            raise SpecError(f"float8.moe_experts needs a MoE model with widths that are multiples of 16; {name!r} "
                            f"(hidden {d.hidden_size}, {d.num_experts} experts of width {d.moe_intermediate_size}) "
                            "is not one: set float8.moe_experts = false")
        model_cfg = dataclasses.replace(model_cfg, moe_float8=True)
    return spec, model_cfg


def override(cfg: Any, kw: dict[str, Any], where: str = "model.overrides") -> Any:
    """``cfg`` with fields replaced; a dict for a field that holds a config dataclass reaches inside it
    (``{"text": {"num_hidden_layers": 2}}``); JSON lists become tuples. Unknown keys raise with hints."""
    fields = {f.name for f in dataclasses.fields(cfg)}
    unknown = [k for k in kw if k not in fields]
    if unknown:
        hints = {k: difflib.get_close_matches(k, list(fields), n=2) for k in unknown}
        raise SpecError(f"{where} has unknown model-config fields {hints} (key: closest valid names)")
    new = {}
    for k, v in kw.items():
        cur = getattr(cfg, k)
        if isinstance(v, dict) and dataclasses.is_dataclass(cur):
            v = override(cur, v, f"{where}.{k}")
        elif isinstance(v, list):
            v = tuple(v)
        new[k] = v
    return dataclasses.replace(cfg, **new)
