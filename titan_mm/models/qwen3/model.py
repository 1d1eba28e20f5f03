"""Qwen3 and Qwen3-MoE decoder: parameters in plain modules, forward is a pure function of its inputs.

Legend:
  B batch, S sequence, D hidden_size, V vocab, H query heads, G kv heads, K head_dim,
  F dense MLP hidden, E experts, N = B*S tokens.

Parameter names (titan_mm; HF names in hf.py):
  tok_embeddings.weight [V, D]
  layers.{i}.attn_norm.weight [D]           layers.{i}.ffn_norm.weight [D]
  layers.{i}.attn.wq/wk/wv/wo.weight (+ .bias when attention_bias), attn.q_norm/k_norm.weight [K]
  dense layer:  layers.{i}.mlp.w1/w3.weight [F, D], mlp.w2.weight [D, F]
  MoE layer:    layers.{i}.moe.router.weight [E, D], moe.experts.w1/w3 [E, F, D], moe.experts.w2 [E, D, F]
  norm.weight [D]                           output.weight [V, D] (absent when tie_word_embeddings)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_mm import kernels as K
from titan_mm.nn import init
from titan_mm.nn.attention import Attention, AttnMeta
from titan_mm.nn.loss import chunked_cross_entropy, head_rows
from titan_mm.nn.mlp import SwiGLU, silu_mul
from titan_mm.nn.moe import MoE, TokenMoves, load_balancing_loss, route_stats
from titan_mm.nn.norm import RMSNorm, add_rms_norm, rms_norm
from titan_mm.nn.output import ModelOutput, Stream
from titan_mm.nn.rope import apply_rope, rope_cos_sin, rope_inv_freq
from titan_mm.models.qwen3.config import Qwen3Config


@dataclass(frozen=True)
class Ops:
    """The elementwise/fused ops a model uses: PyTorch references, or titan_mm.kernels (cfg.kernels)."""

    rms_norm: Callable = rms_norm
    add_rms_norm: Callable = add_rms_norm  # (x, residual, w, eps) -> (rms_norm(residual + x), residual + x)
    act_mul: Callable = silu_mul
    apply_rope: Callable = apply_rope
    cross_entropy: Callable = None  # (h_ND, w_VD, labels_N, chunk_size, z_loss_weight, weights_N=None) -> loss_sum
    bias_gelu: Callable | None = None  # (x, b) -> gelu_tanh(x + b) for the Qwen3-VL ViT MLP; None = nn.Linear + F.gelu
    logits: Callable = F.linear  # (h_*D, w_VD) -> logits [*, V] (no labels: eval / decoding)
    moe_moves: TokenMoves = TokenMoves()  # the MoE layers' token gathers and weighted sums
    moe_routing: Callable = route_stats  # (logits_NE, top_k, norm_topk_prob, valid_N) -> (top_w, top_i, aux stats)
    moe_float8: bool = False  # the MoE experts' grouped GEMMs in float8 (the config's moe_float8; nn/moe.py)
    norm_rope_cache: Callable | None = None  # serving decode steps: q/k norm, RoPE, cache write in one op (Attention)


def _torch_ce(h, w, labels, chunk_size, z_loss_weight, weights_N=None):
    return chunked_cross_entropy(h, w, labels, chunk_size=chunk_size, z_loss_weight=z_loss_weight, weights_N=weights_N)


def select_ops(use_kernels: bool | str, moe_float8: bool = False) -> Ops:
    """``use_kernels``: True / "all" = every op from titan_mm.kernels; False / "none" = references;
    per op: e.g. "rms_norm,swiglu" or "all,-linear_cross_entropy" (see titan_mm.kernels.resolve_ops).
    ``moe_float8``: the MoE experts' GEMMs in float8 (Ops.moe_float8)."""
    if not use_kernels:
        # the experts' CUDA GEMMs in a dtype torch._grouped_mm lacks (fp32) stay sync-free with the references too
        return Ops(cross_entropy=_torch_ce, moe_moves=TokenMoves(grouped_mm=K.grouped_mm), moe_float8=moe_float8)
    on = K.resolve_ops(use_kernels)

    def kernel_ce(h, w, labels, chunk_size, z_loss_weight, weights_N=None):
        return K.linear_cross_entropy(h, w, labels, ignore_index=-100, z_loss=z_loss_weight, chunk_size=chunk_size,
                                      weights=weights_N)

    kernel_ce.fused_linear_ce = True  # loss parallel keeps the fused kernel (per vocabulary shard); parallel/tp.py
    norm = K.rms_norm if "rms_norm" in on else rms_norm
    return Ops(
        rms_norm=norm,
        # unfused: the eager add, then the RMSNorm picked above
        add_rms_norm=K.add_rms_norm if "add_rms_norm" in on else (
            add_rms_norm if norm is rms_norm else functools.partial(add_rms_norm, norm=norm)),
        act_mul=K.swiglu if "swiglu" in on else silu_mul,
        apply_rope=K.apply_rope if "rope" in on else apply_rope,
        cross_entropy=kernel_ce if "linear_cross_entropy" in on else _torch_ce,
        bias_gelu=K.bias_gelu if "bias_gelu" in on else None,
        moe_moves=(TokenMoves(K.moe_expand, K.moe_combine, K.grouped_mm) if "moe_moves" in on
                   else TokenMoves(grouped_mm=K.grouped_mm)),
        moe_routing=K.moe_routing if "moe_routing" in on else route_stats,
        moe_float8=moe_float8,
        norm_rope_cache=K.norm_rope_cache if "norm_rope_cache" in on else None,
    )


class Qwen3Block(nn.Module):
    """Pre-norm decoder block. forward(h, cos, sin, attn) -> (h, moe stats [2, E] or None)."""

    def __init__(self, cfg: Qwen3Config, layer_id: int, ops: Ops | None = None):
        super().__init__()
        ops = ops or select_ops(cfg.kernels, cfg.moe_float8)
        self.layer_id = layer_id
        self.window = cfg.layer_window(layer_id)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.rms_norm)
        o_bias = cfg.attention_bias if cfg.attention_output_bias is None else cfg.attention_output_bias
        self.attn = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                              cfg.attention_bias, cfg.rms_norm_eps, qk_norm=cfg.qk_norm, o_bias=o_bias,
                              norm_impl=ops.rms_norm, rope_impl=ops.apply_rope, layer_id=layer_id,
                              decode_prologue=ops.norm_rope_cache)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.rms_norm)
        self.add_norm = ops.add_rms_norm  # residual add + ffn_norm (one Triton kernel when add_rms_norm is on)
        if cfg.is_moe_layer(layer_id):
            self.moe = MoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                           cfg.norm_topk_prob, ops.moe_moves, ops.moe_float8, ops.moe_routing)
            self.mlp = None
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, ops.act_mul)
            self.moe = None

    def forward(self, h_BSD: torch.Tensor, cos_BSK: torch.Tensor, sin_BSK: torch.Tensor, attn: AttnMeta | None):
        a_BSD = self.attn(self.attn_norm(h_BSD), cos_BSK, sin_BSK, attn, self.window)
        # h = h + a; x = ffn_norm(h). ffn_norm's weight is read here, in the block's forward, where the TP
        # plan's grad_sum hooks (installed on the block) see it; the module FQN stays layers.{i}.ffn_norm.
        x_BSD, h_BSD = self.add_norm(a_BSD, h_BSD, self.ffn_norm.weight, self.ffn_norm.eps)
        if self.moe is not None:
            y_BSD, stats = self.moe(x_BSD, None if attn is None else attn.valid_BS)
            return h_BSD + y_BSD, stats
        return h_BSD + self.mlp(x_BSD), None

    def reset_parameters(self, std: float) -> None:
        self.attn_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attn.reset_parameters(std)
        (self.moe if self.moe is not None else self.mlp).reset_parameters(std)


class Qwen3Model(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.cfg = cfg
        self.ops = select_ops(cfg.kernels, cfg.moe_float8)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): Qwen3Block(cfg, i, self.ops) for i in range(cfg.num_hidden_layers)})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.ops.rms_norm)
        self.output = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        inv_freq, self.rope_scale = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                                  cfg.max_position_embeddings)
        self.register_buffer("rope_inv_freq", inv_freq, persistent=False)
        self.n_moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))

    # ---- weights ----
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialize every parameter in place (HF init: normal(0, initializer_range), norms = 1) and
        recompute the RoPE buffer on ``buffer_device`` (default: where the parameters live). Call after
        ``to_empty(device=...)`` for meta-built models; works on FSDP-sharded (DTensor) parameters."""
        std = self.cfg.initializer_range
        with torch.no_grad():
            init.normal_(self.tok_embeddings.weight, mean=0.0, std=std)
            for block in self.layers.values():
                block.reset_parameters(std)
            self.norm.reset_parameters()
            if self.output is not None:
                init.normal_(self.output.weight, mean=0.0, std=std)
        self.init_buffers(buffer_device)

    def init_buffers(self, buffer_device: torch.device | str | None = None) -> None:
        if buffer_device is None:
            buffer_device = self.tok_embeddings.weight.device
            if buffer_device.type == "meta":
                buffer_device = "cpu"
        inv, self.rope_scale = rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling,
                                             self.cfg.max_position_embeddings, device=buffer_device)
        self.rope_inv_freq = inv

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    # ---- forward: embed -> trunk -> head (docs/models.md) ----
    def embed(self, input_ids: torch.Tensor) -> Stream:
        return Stream(self.tok_embeddings(input_ids))

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin [B, S, K] for position_ids [B, S]."""
        return rope_cos_sin(position_ids, self.rope_inv_freq, self.rope_scale, dtype)

    def trunk(self, stream: Stream, rope: tuple[torch.Tensor, torch.Tensor], attn: AttnMeta | None,
              start: int = 0, stop: int | None = None) -> Stream:
        """Blocks ``start .. stop-1`` (any contiguous slice: a pipeline stage). Router statistics are summed
        into the stream and DeepStack-style additions are added after their block."""
        cos_BSK, sin_BSK = rope
        h_BSD, stats_2E = stream.h, stream.moe_stats
        for i in range(start, self.cfg.num_hidden_layers if stop is None else stop):
            h_BSD, st = self.layers[str(i)](h_BSD, cos_BSK, sin_BSK, attn)
            if st is not None:
                stats_2E = st if stats_2E is None else stats_2E + st
            if i < len(stream.adds):
                h_BSD = h_BSD + stream.adds[i]
        return Stream(h_BSD, stats_2E, stream.adds)

    def head(self, stream: Stream, attn: AttnMeta | None, labels: torch.Tensor | None = None,
             logits_at: torch.Tensor | None = None, loss_weights: torch.Tensor | None = None,
             hidden: bool = False) -> ModelOutput:
        """Final norm and the MoE aux loss, then: with ``hidden``, the final-norm hidden states (an objective's
        input, titan_mm.objectives); with ``labels``, :meth:`lm_loss` over them (the parity tests' shortcut for the
        causal LM); else logits ([B, V] at positions ``logits_at`` [B] when given; [B, K, V] for ``logits_at``
        [B, K])."""
        h_BSD = self.norm(stream.h)
        B, S = h_BSD.shape[:2]
        aux = torch.zeros((), dtype=torch.float32, device=h_BSD.device)
        if stream.moe_stats is not None and self.cfg.moe_aux_loss:
            valid = None if attn is None else attn.valid_BS
            # rows as in HF: MoE layers x tokens (padding excluded); a python float needs no device copy
            rows = float(B * S * self.n_moe_layers) if valid is None else valid.sum().float() * self.n_moe_layers
            aux = self.cfg.router_aux_loss_coef * load_balancing_loss(stream.moe_stats, rows, self.cfg.num_experts)
        if hidden:
            return ModelOutput(logits=None, loss_sum=None, aux_loss=aux, hidden=h_BSD)
        if labels is None:
            if logits_at is not None:
                rows = torch.arange(B, device=h_BSD.device).view(B, *([1] * (logits_at.dim() - 1)))
                h_BSD = h_BSD[rows, logits_at]  # [B, D], or [B, K, D] (speculative decoding)
            return ModelOutput(logits=self.ops.logits(h_BSD, self.lm_head_weight), loss_sum=None, aux_loss=aux)
        return ModelOutput(logits=None, loss_sum=self.lm_loss(h_BSD, labels, loss_weights), aux_loss=aux)

    def lm_loss(self, h_BSD: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None = None,
                index: torch.Tensor | None = None) -> torch.Tensor:
        """The causal-LM objective's hook (titan_mm.objectives.causal): fp32 sum over ``targets`` [B, S] != -100 of
        the LM head's cross-entropy from the final-norm ``h_BSD``, each token's times ``weights`` [B, S] when given
        (a diffusion objective's 1/t); fused (``ops.cross_entropy``: no [N, V] logits; vocab-parallel under TP).
        ``index``: the labeled positions over B x S, built on the host (the head then runs on them alone)."""
        B, S = h_BSD.shape[:2]
        h_ND, labels_N, w_N = head_rows(h_BSD.reshape(B * S, -1), targets.reshape(-1),
                                        None if weights is None else weights.reshape(-1), index)
        extra = () if w_N is None else (w_N,)  # ops without weights keep their 5-argument call
        return self.ops.cross_entropy(h_ND, self.lm_head_weight, labels_N, self.cfg.loss_chunk_size,
                                      self.cfg.z_loss_weight, *extra)

    def token_logprobs(self, h_BSD: torch.Tensor, targets: torch.Tensor,
                       index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy objective's hook (titan_mm.objectives.policy): fp32 log p(targets) [B, S] and the entropy
        [B, S] of the next-token distribution from the final-norm ``h_BSD`` (0 where targets is -100). Holds fp32
        logits [N, V]: RL batches are short completions. ``index``: the labeled positions over B x S, built on the
        host (the head then runs on them alone, as lm_loss's)."""
        B, S = targets.shape
        h_ND, t_N, _ = head_rows(h_BSD.reshape(B * S, -1), targets.reshape(-1), None, index)
        rows = index is not None or h_BSD.device.type == "cpu"  # head_rows kept the labeled rows only
        logp_NV = self.ops.logits(h_ND, self.lm_head_weight).float().log_softmax(-1)
        lp_N = logp_NV.gather(-1, t_N.clamp(min=0)[:, None])[:, 0]
        with torch.no_grad():  # logged only: no [N, V] tensors kept for a backward that never comes
            ent_N = -(logp_NV.exp() * logp_NV).sum(-1)
        valid_BS = targets != -100
        if rows:  # back to [B, S]; the CPU's boolean rows are the labeled positions in order, as an index's
            at = index if index is not None else valid_BS.reshape(-1).nonzero().squeeze(1)
            zero = torch.zeros(B * S, dtype=torch.float32, device=h_BSD.device)
            return zero.index_put((at,), lp_N).view(B, S), zero.index_put((at,), ent_N).view(B, S)
        return lp_N.view(B, S).where(valid_BS, 0.0), ent_N.view(B, S).where(valid_BS, 0.0)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attn: AttnMeta | None = None,
        labels: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
        loss_weights: torch.Tensor | None = None,
        loss: Callable | None = None,
    ) -> ModelOutput:
        """input_ids [B, S]; position_ids [B, S] (restart per document; default arange); attn from
        build_attn_meta (None = plain causal rows; its ``kv_cache``, when set, is written and returned);
        ``loss``: an objective's ``loss(model, out) -> {term: sum}`` (titan_mm.objectives; the train step's), called
        on the hidden states, its sums in ``out.terms``. labels [B, S] already shifted, -100 = ignore; loss_weights
        [B, S] per-token loss weights (None: 1): the causal LM's sum in ``out.loss_sum`` (parity tests)."""
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device)[None].expand(B, S)
        stream = self.embed(input_ids)
        stream = self.trunk(stream, self.rope(position_ids, stream.h.dtype), attn)
        out = self.head(stream, attn, labels, logits_at, loss_weights, hidden=loss is not None)
        return finish(self, out, attn, loss)


def finish(model: nn.Module, out: ModelOutput, attn: AttnMeta | None, loss: Callable | None) -> ModelOutput:
    """A forward's last words: the objective's loss terms on its output (inside the forward, where FSDP's gathered
    and the cast parameters live), and the KV cache that came in through ``attn``."""
    if loss is not None:
        out = out._replace(terms=loss(model, out))
    return out if attn is None else out._replace(kv_cache=attn.kv_cache)


def build(cfg: Qwen3Config) -> Qwen3Model:
    """Build under the caller's device context (``with torch.device("meta"):`` in the trainer)."""
    return Qwen3Model(cfg)
