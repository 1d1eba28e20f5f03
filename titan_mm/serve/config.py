"""The serving engine's settings: one dataclass, field docstrings as in titan_mm.config (``--help`` via tyro)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import torch

from titan_mm.config import ConfigError
from titan_mm.dtypes import torch_dtype

QUANTIZATIONS = ("none", "int8_weight_only", "fp8_weight_only", "fp8_rowwise", "fp8_rowwise_fused", "int4_weight_only")
"""serve.quantization's modes (titan_mm/serve/runner/weights.py: torchao's configs and titan's Fp8Linear)."""
KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn}  # besides "auto" (serve.dtype's)
FP8_CAPABILITY = (8, 9)  # float8 GEMMs and casts: Ada / Hopper and newer
INT4_CAPABILITY = (8, 0)  # tinygemm's int4 GEMM: tensor cores of Ampere and newer


@dataclass
class ServeConfig:
    block_size: int = 16
    """Tokens per KV-cache block (the unit of allocation, sharing and prefix caching)."""
    num_blocks: int = 0
    """Blocks in the KV pool; 0: sized from the memory left after the weights (gpu_memory_utilization)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the device memory the engine may use in all (weights, activations, KV pool); on CPU, of the
    available host memory, and the pool is capped at max_num_seqs sequences of max_model_len tokens."""
    dtype: str = "auto"
    """Weights and KV-cache dtype (titan_mm.dtypes names); auto: bfloat16 on CUDA, float32 on CPU."""
    paged_decode: bool = True
    """One-token decode steps read the keys in place from the pool (titan_mm.kernels.paged_decode_attention:
    Triton on CUDA, its PyTorch reference elsewhere); false: they gather every cached key first, as prefill does."""
    cuda_graphs: bool = True
    """Decode steps replay a CUDA graph per padded batch size, all captured when the engine starts (CUDA, bf16,
    with paged_decode; elsewhere they run eagerly through the same static buffers)."""
    graph_sampling: bool = False
    """A decode step (one-token rows, paged_decode) draws its rows itself, inside its CUDA graphs (eagerly
    elsewhere): greedy rows and rows with temperature, top-k and top-p, seeded or not, with the tokens of the draw
    after the step, and each token's own logprob (logprobs=0); a batch with a penalty, min-p, top logprobs, a
    first-token fork or beams samples after the step as before. Off by default until a sampled serving workload
    measures its gain (its GPU test passed on the H100; RL's rollout engine turns it on)."""
    packed_prefill: bool = True
    """Prefill chunks of a step run as one packed row (each sequence's new tokens back to back; varlen attention
    on CUDA in bf16, a block-diagonal mask elsewhere) instead of rows padded to the longest chunk (false). Families
    with linear-attention states (Qwen3.5) always use padded rows: their state is kept per row. With
    mixed_attention it took Qwen3-8B's workload A from 50.6% to 63.7% of the HBM roofline on an H100
    (docs/serving.md)."""
    mixed_attention: bool = True
    """A step that is not all one-token rows (prefill chunks, with or without decode rows beside them, and
    speculative steps) runs as one packed row whose attention reads every row's keys in place from the pool: one
    titan_mm.kernels.paged_attention launch per layer for decode rows and prefill chunks alike, instead of the
    decode rows apart and the chunks through gathered keys (Triton on CUDA, its PyTorch reference elsewhere).
    Steps of one-token rows only keep paged_decode and their CUDA graphs. Families with linear-attention states
    (Qwen3.5) keep padded rows (tests/gpu/test_paged_attention_gpu.py: the kernel and the engine on an H100)."""
    async_scheduling: bool = True
    """Schedule and launch each step before the previous step's tokens are read back: its decode rows take those
    tokens on the device, and the host checks stops, detokenizes and reports while the GPU runs. It applies to
    steps whose sampled rows need nothing from the host between tokens (no beam search, penalties, first-token
    fork of n > 1, or speculation); the others run in turn. Outputs reach the caller one step later."""
    freeze_gc: bool = True
    """When the first engine of a process starts, everything alive then (the imported libraries, the model) moves
    out of the reach of Python's cyclic garbage collector (gc.freeze, as vLLM does), so a full collection scans what
    serving allocates, not some 330,000 start-up objects. On a 2-core CPU at 256 decoding rows one full collection
    in 500 steps stopped a step for 131-136 ms; frozen, the longest step's host time was 12 ms (bench/serve_profile.py
    --host --freeze_gc 0 / 1; the mean host time moved within its noise). Once a process has frozen objects (this
    or its own gc.freeze) later engines leave it be; the engine's own objects are never frozen, so a dropped engine
    is freed. False: the process's GC as it is (the trainer's eval and RL engines: the heap is the trainer's)."""
    kernels: bool = True
    """Models loaded by the engine (from_pretrained) run the fused titan_mm.kernels ops (RMSNorm, residual add +
    RMSNorm, RoPE, SwiGLU: one Triton kernel each instead of several elementwise ones) on CUDA; on CPU they keep
    the PyTorch ops. A model passed to Engine() keeps the ops it was built with (its config's kernels)."""
    max_num_seqs: int = 64
    """Most sequences decoded together in one step (n > 1 and beam search count every sequence)."""
    max_num_batched_tokens: int = 2048
    """Most tokens (prefill chunks + decode tokens) in one forward."""
    max_model_len: int = 0
    """Longest sequence (prompt + generated) a request may reach; 0: the model's max_position_embeddings."""
    enable_prefix_caching: bool = True
    """Share full KV blocks across requests by a chained hash of their tokens (and images)."""
    enable_chunked_prefill: bool = True
    """Split long prompts into chunks that run in the same step as other sequences' decode tokens; off: a
    prompt is prefilled whole, so max_num_batched_tokens must hold max_model_len."""
    max_queue_len: int = 1024
    """Most requests waiting for admission; one more is refused with QueueFull (HTTP 429)."""
    priority_levels: int = 3
    """Priority classes 0 .. priority_levels-1; 0 is served first (then earliest deadline, then arrival)."""
    preemptible_priority: int = 2
    """Running requests of this priority or lower (number >= this) are preempted to admit a waiting request of a
    higher class; priority_levels turns this off (blocks running out still preempts the lowest class first)."""
    token_rate_limit: float = 0.0
    """Admitted tokens per second (prompt + max_tokens x n), a token bucket; 0: no limit. Refused: QueueFull."""
    token_rate_burst_s: float = 1.0
    """Seconds of token_rate_limit the bucket holds (the burst a quiet engine admits at once)."""

    speculative_method: str = ""
    """Speculative decoding: "" off, "ngram" (prompt lookup), "draft" (a small model of the same vocabulary)."""
    num_speculative_tokens: int = 4
    """Guesses per decoding sequence and step."""
    ngram_max: int = 3
    """ngram: the longest tail of the sequence looked up in its earlier tokens."""
    ngram_min: int = 1
    """ngram: the shortest tail looked up."""
    draft_model: str = ""
    """draft: an HF folder or a titan_mm run / checkpoint of the draft model (Engine.from_pretrained)."""
    fuse_projections: bool = True
    """Models the engine owns (from_pretrained, or Engine(owns_weights=True)) run q/k/v as one GEMM and gate/up as
    one (titan_mm/serve/runner/weights.py): two launches fewer per attention and one per dense MLP in every step.
    Training keeps its layout; a model passed to Engine() otherwise is served as it was given (the trainer's, in
    eval and RL)."""
    quantization: str = "none"
    """Weight quantization of the attention and dense-MLP projections of a model the engine owns (the head,
    embeddings, MoE routers and experts, and vision towers keep the serving dtype): none; int8_weight_only (per-row
    int8 weights; CPU and CUDA); fp8_weight_only (per-row float8 e4m3 weights), fp8_rowwise (w8a8: those weights
    times per-row dynamic float8 activations), both torchao's; fp8_rowwise_fused (titan's rowwise w8a8: the
    activations' cast one Triton launch, then torch._scaled_mm; sizes a multiple of 16, dtype bfloat16); the fp8
    modes need CUDA capability >= 8.9; int4_weight_only (groups of 128, tinygemm; CUDA capability >= 8.0, dtype
    bfloat16). Not with tensor_parallel_size > 1 yet."""
    kv_cache_dtype: str = "auto"
    """The KV cache's storage: auto (serve.dtype's) or fp8_e4m3 (float8 e4m3, one byte a value, no scale: half the
    bytes a decode step reads per cached token and twice the blocks in the same memory). Keys and values are
    rounded when written and read back in the serving dtype; attention math is unchanged. CUDA needs compute
    capability >= 8.9; elsewhere the reference ops run it (the CPU tests)."""
    tensor_parallel_size: int = 1
    """Processes the model is split over by its family's tensor-parallel plan (heads, kv heads and vocabulary must
    divide); launch that many with torchrun. Rank 0 takes the requests and serves HTTP; the others follow its steps."""

    def check(self) -> None:
        """Raise ConfigError naming the first field out of range."""
        ints = dict(block_size=self.block_size, max_num_seqs=self.max_num_seqs,
                    max_num_batched_tokens=self.max_num_batched_tokens, max_queue_len=self.max_queue_len,
                    priority_levels=self.priority_levels, tensor_parallel_size=self.tensor_parallel_size)
        for name, v in ints.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"serve.{name} must be a positive int, got {v!r}")
        for name, v in dict(num_blocks=self.num_blocks, max_model_len=self.max_model_len).items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"serve.{name} must be an int >= 0 (0: automatic), got {v!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"serve.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not 0 <= self.preemptible_priority <= self.priority_levels:
            raise ConfigError(f"serve.preemptible_priority must be in 0 .. priority_levels={self.priority_levels}, "
                              f"got {self.preemptible_priority}")
        if self.graph_sampling and not self.paged_decode:
            raise ConfigError("serve.graph_sampling draws inside the decode steps, which need serve.paged_decode; "
                              "turn paged_decode on or graph_sampling off")
        if self.speculative_method not in ("", "ngram", "draft"):
            raise ConfigError(f"serve.speculative_method must be '', 'ngram' or 'draft', got {self.speculative_method!r}")
        for name, v in dict(num_speculative_tokens=self.num_speculative_tokens, ngram_min=self.ngram_min).items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"serve.{name} must be a positive int, got {v!r}")
        if self.ngram_max < self.ngram_min:
            raise ConfigError(f"serve.ngram_max ({self.ngram_max}) must be >= ngram_min ({self.ngram_min})")
        if self.token_rate_limit < 0 or self.token_rate_burst_s <= 0:
            raise ConfigError(f"serve.token_rate_limit must be >= 0 and token_rate_burst_s > 0, got "
                              f"{self.token_rate_limit}, {self.token_rate_burst_s}")
        if self.quantization not in QUANTIZATIONS:
            near = difflib.get_close_matches(self.quantization, QUANTIZATIONS, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"serve.quantization={self.quantization!r} is not a mode{hint} (modes: "
                              f"{', '.join(QUANTIZATIONS)})")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"serve.kv_cache_dtype={self.kv_cache_dtype!r} is not a cache dtype (auto, "
                              f"{', '.join(KV_CACHE_DTYPES)})")
        if self.quantization != "none" and self.tensor_parallel_size > 1:
            raise ConfigError(f"serve.quantization={self.quantization!r} with tensor_parallel_size="
                              f"{self.tensor_parallel_size}: quantized weights are not split over tp yet; set one of "
                              "them back (quantization none, or tensor_parallel_size 1)")

    def serving_dtype(self, device: torch.device) -> torch.dtype:
        """Weights and KV-cache dtype on ``device`` (``dtype``; auto: bfloat16 on CUDA, float32 elsewhere)."""
        if self.dtype != "auto":
            return torch_dtype(self.dtype)
        return torch.bfloat16 if device.type == "cuda" else torch.float32

    def kv_dtype(self, device: torch.device) -> torch.dtype:
        """The KV cache's storage dtype on ``device`` (serve.kv_cache_dtype; auto: the serving dtype)."""
        return KV_CACHE_DTYPES.get(self.kv_cache_dtype) or self.serving_dtype(device)

    def check_weights(self, device: torch.device, owned: bool, capability: tuple[int, int] | None = None) -> None:
        """The rules of the load-time transforms and of the KV cache's dtype on ``device`` (``capability``: its CUDA
        compute capability); ``owned``: the engine owns the model's weights (from_pretrained, or
        Engine(owns_weights=True))."""
        on = f"this device is {device.type}" + (f" of capability {capability[0]}.{capability[1]}" if capability else "")
        if self.kv_cache_dtype.startswith("fp8") and device.type == "cuda" and (capability or (0, 0)) < FP8_CAPABILITY:
            raise ConfigError(f"serve.kv_cache_dtype={self.kv_cache_dtype!r} needs a CUDA GPU of compute capability "
                              f">= 8.9 (Ada, Hopper or newer); {on}: use auto")
        q = self.quantization
        if q == "none":
            return
        if not owned:
            raise ConfigError(f"serve.quantization={q!r} rewrites the model's weights, and Engine() serves a caller's "
                              "model as given; load it with Engine.from_pretrained or pass Engine(owns_weights=True)")
        if q.startswith("fp8") and (device.type != "cuda" or capability is None or capability < FP8_CAPABILITY):
            raise ConfigError(f"serve.quantization={q!r} needs a CUDA GPU of compute capability >= 8.9 (Ada, Hopper "
                              f"or newer); {on}: use int8_weight_only or none")
        if q == "int4_weight_only" and (device.type != "cuda" or capability is None or capability < INT4_CAPABILITY):
            raise ConfigError(f"serve.quantization='int4_weight_only' needs CUDA of compute capability >= 8.0 (torch's "
                              f"int4 tensor-core GEMM); {on}: use int8_weight_only or none")
        if q in ("int4_weight_only", "fp8_rowwise_fused") and self.serving_dtype(device) != torch.bfloat16:
            raise ConfigError(f"serve.quantization={q!r} needs serve.dtype bfloat16 (auto on CUDA; its GEMM writes "
                              f"bf16), got {self.dtype!r}")

    def check_model(self, name: str, max_model_len: int, linear: bool, kv_cache: bool = True) -> None:
        """The rules that depend on the model ``name`` (its context ``max_model_len``, after serve.max_model_len;
        ``linear``: it has linear-attention layers; ``kv_cache``: it decodes through the paged KV cache)."""
        if not kv_cache:
            raise ConfigError(f"model {name!r} does not decode through the paged KV cache yet, so the engine "
                              "cannot serve it; its spec needs a KV-cache path first (docs/models.md)")
        if not max_model_len:
            raise ConfigError(f"{name} does not name its context length; set serve.max_model_len")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ConfigError(f"serve.enable_chunked_prefill=false needs max_num_batched_tokens >= max_model_len "
                              f"({self.max_num_batched_tokens} < {max_model_len}); raise it, lower "
                              "max_model_len, or enable chunked prefill")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(f"serve.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                              f"({self.max_num_seqs}): every running sequence needs its decode token each step")
        if self.speculative_method and linear:
            raise ConfigError(f"serve.speculative_method={self.speculative_method!r}: model {name!r} has "
                              "linear-attention layers, whose recurrent state cannot be rolled back past rejected "
                              "guesses; set serve.speculative_method = ''")

    def check_draft(self, has_draft: bool, vocab: int | None = None, draft_vocab: int | None = None,
                    draft_name: str = "", draft_linear: bool = False) -> None:
        """speculative_method "draft" and a draft model come together; the draft shares the target's vocabulary
        and has no linear-attention layers."""
        if (self.speculative_method == "draft") != has_draft:
            raise ConfigError("serve.speculative_method='draft' needs a draft model (serve.draft_model), and a draft "
                              "model needs speculative_method='draft'")
        if not has_draft:
            return
        if draft_vocab != vocab:
            raise ConfigError(f"the draft model's vocabulary ({draft_vocab}) differs from the target's ({vocab}); "
                              "pick a draft of the same tokenizer")
        if draft_linear:
            raise ConfigError(f"the draft model {draft_name!r} has linear-attention layers, whose state cannot "
                              "be rolled back past rejected guesses; pick a draft of full-attention layers only")
