"""One memory model for `dflash plan` and `dflash preflight`: bytes per device, by part, for what
`trainer/training/loop.py` really runs. Light side: stdlib only (no torch at import).

Where things live: a target copy is split layer-wise over `gpus_per_copy` GPUs; the drafter, its
optimizer, the captured features and the loss all sit on the copy's FIRST GPU (`setup_dist` puts
the rank's device there), so that GPU is the one that must fit and the one modelled here.

What the trainer holds (loop.py + speculators' DFlashDraftModel, read from their code):

- target weights / gpus_per_copy (target dtype; the base model only, no lm_head is loaded), plus
  the no-grad forward's transient working set of one layer (its MLP: gate, up and product; for a hybrid
  target the larger of that and a Gated DeltaNet layer's set, trainer/layout/hybrid.py: the forward
  keeps no cache, so no recurrent state outlives its layer);
- the drafter's trainable parameters in fp32 (decoder layers, fc, hidden_norm, norm) and their fp32
  gradients: under DDP (data_parallel > 1, shard none or optimizer) views into its buckets
  (`gradient_as_bucket_view`: no second copy), which live for the whole run; on one rank and under
  FSDP2 the optimizer's `zero_grad(set_to_none=True)` frees them every step; on CUDA bf16 autocast
  keeps a bf16 cast of each trainable weight alive for the backward;
- the optimizer step's own working set: on CUDA AdamW runs its foreach kernels, which hold one fp32
  copy of the parameters it updates on this rank (the square roots of the second moments); on CPU
  it steps one parameter at a time. The step comes after the backward has freed the activations
  and logits, and the backward makes the freed-every-step gradients as it frees them, so
  `drafter_step` is only what the step phase (those gradients + the foreach copy) holds beyond the
  activations and logits;
- the optimizer's fp32 state: AdamW's two moments per parameter, or (`train.optimizer: muon`) Muon's
  one momentum buffer per weight-matrix element and AdamW's two moments for the rest (norms); on
  every rank with `train.shard: none`, 1/data_parallel per rank with ZeRO-1 (`optimizer`, torch's
  ZeroRedundancyOptimizer);
- `train.shard: full` (FSDP2, data_parallel > 1): weights, gradients and moments 1/data_parallel per
  rank, plus the gathered working set (`drafter_gathered`): the root group (fc and norms) whole for the
  step, one draft layer gathered and the next prefetched, in the compute dtype (bf16 on CUDA), and one
  group's unsharded gradient before its fp32 reduce-scatter; no autocast copies (the gathered weights
  already are bf16);
- the drafter's frozen tensors: embed_tokens (vocab x hidden, fp32: the drafter is built in fp32;
  none with `train.share_target_embedding`, the default, where the drafter reads the in-process
  target's own embedding, counted in target_weights) and verifier_norm in fp32, and one vocab x
  hidden head shared by lm_head and verifier_lm_head (full vocabulary: both hold the target's
  lm_head), fp32 on CPU and bf16 under bf16 autocast, where autocast would cast it to bf16 for every
  matmul anyway (trainer/drafter/model.py cast_frozen_heads); with `drafter.draft_vocab_size` D, two
  separate D x hidden heads (the target's rows of the kept tokens);
- activations: the captured aux states (n_aux x tokens x hidden) and last hidden state, fc output,
  and per drafter layer what autograd saves, counted by storage on CPU (bench/memory.py's layer
  marginal): `query_hidden_copies` tensors of width hidden over the query tokens (query = anchors x
  block: norms, q and o projections, attention output, residuals; 9.5 measured), k and v over
  context + query tokens at the kv width, and `mlp_intermediate_copies` intermediate-width tensors
  over the query tokens (gate, its activation, up, their product); sdpa on CPU adds per layer k and v
  repeated to every query head (GQA) and its dense fp32 mask, [query, context + query] (flex attention
  on CUDA takes GQA and a block mask of a few KiB); with `train.activation_checkpointing` only each
  layer's input over the query tokens is kept, and one layer's tensors exist again while its backward
  recomputes it;
- logits: speculators' forward materialises the full [anchors x block, vocab] drafter logits and
  verifier targets whatever the loss; the fused (Triton, CUDA) loss adds only their gradient (bf16
  under autocast: 3 copies x 2 B); the eager loss (CPU, fp32) peaks at 3 copies too, measured by
  bench/memory.py (the forward holds the verifier logits, their rows at the anchored positions and the
  drafter's logits; the backward the log-softmax, its gradient and the loss's gradient); with
  `train.loss_chunk_rows` N (trainer/training/chunked_loss.py) the same copies of N rows only; with a
  draft vocabulary D columns instead of vocab. The target-agreement check (training/health.py) scores
  the same rows at a time (at most 1024), before the drafter's forward, so it never adds a peak;
- a runtime reserve on CUDA (context, cuBLAS/NCCL workspaces).

Every constant is in ASSUMPTIONS (echoed by `dflash plan --json`). On CPU every term is checked against
torch's allocator by bench/memory.py (each configuration within 15 %); on a GPU nothing has been
measured yet: the CUDA figures are arithmetic over the code, not allocator readings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.layout.hybrid import LinearAttention, forward_working_bytes

GIB = float(2**30)
SHARD_LEVELS = ("none", "optimizer", "full")  # train.shard

ASSUMPTIONS: dict[str, Any] = {
    # trainable tensors and the frozen embedding (the drafter is built fp32)
    "drafter_param_dtype": "float32",
    "trainable_bytes_per_param": {"weight": 4, "grad": 4, "autocast_copy_cuda": 2},
    "ddp_gradients": "views into DDP's buckets (gradient_as_bucket_view): no second copy",
    "adam_moment_bytes_per_param": 8,  # exp_avg + exp_avg_sq, fp32
    "adam_foreach_bytes_per_param_cuda": 4,  # the step's sqrt(exp_avg_sq) list (foreach on CUDA)
    "muon_momentum_bytes_per_param": 4,  # momentum_buffer, fp32 (train.optimizer muon: weight matrices)
    "shard_levels": {
        "none": "weights, gradients, moments whole on every rank",
        "optimizer": "moments / data_parallel (ZeRO-1)",
        "full": "weights, gradients, moments / data_parallel (FSDP2) + the gathered working set",
    },
    "fsdp_gathered_layers": 2,  # the running draft layer and the prefetched next one
    "frozen": (
        "embed_tokens fp32 unless shared with the in-process target (train.share_target_embedding), "
        "verifier_norm fp32; one head shared by lm_head/verifier_lm_head (two draft-vocabulary heads "
        "with drafter.draft_vocab_size), bf16 under bf16 autocast (CUDA), else fp32"
    ),
    # per drafter layer, saved for the backward (storages counted on CPU; see the module docstring)
    "query_hidden_copies": 10,  # of width hidden over the query tokens (9.5 measured)
    "context_kv_copies": 2,  # k and v over context + query tokens, kv width
    "mlp_intermediate_copies": 4,  # gate, act(gate), up, act(gate)*up
    "target_mlp_copies": 3,  # the target's no-grad MLP working set: gate, up, their product
    "logit_copies": {"fused": 3, "eager": 3},  # at the peak: see the module docstring
    "logit_bytes": {"fused": 2, "eager": 4},  # bf16 under autocast on CUDA, fp32 on CPU
    "sdpa_cpu_per_layer": (
        "k and v repeated to every query head over context + query; fp32 mask [query, context + query]"
    ),
    "runtime_reserve_gib_cuda": 1.0,
}


TARGET_WIDTHS = ("hidden", "vocab", "intermediate", "heads", "kv_heads", "head_dim", "linear")  # Shapes.of


@dataclass(frozen=True)
class Shapes:
    """What the model needs of a target and a drafter (speculators' Qwen3-style draft layers)."""

    target_params: int
    target_dtype_bytes: int
    hidden: int
    vocab: int
    intermediate: int  # the target's MLP width
    heads: int
    kv_heads: int
    head_dim: int
    attention_bias: bool = False
    draft_layers: int = 1
    draft_intermediate: int | None = None  # default: the target's
    n_aux: int = 5
    draft_vocab: int | None = None  # drafter.draft_vocab_size (None: the whole vocabulary)
    linear: LinearAttention | None = None  # a hybrid target's linear-attention layers

    @classmethod
    def of(cls, target: Any, params: int, dtype_bytes: int, **drafter: Any) -> Shapes:
        """A target's shapes from what names its widths as this class does (trainer/target/info.py's
        `TargetInfo`, the plan's `TargetShape`: without attention biases), with `params` parameters of
        `dtype_bytes` each, and the drafter's keywords (draft_layers, draft_intermediate, n_aux,
        draft_vocab)."""
        widths = {k: getattr(target, k) for k in TARGET_WIDTHS}
        bias = getattr(target, "attention_bias", False)
        return cls(
            target_params=params, target_dtype_bytes=dtype_bytes, attention_bias=bias, **widths, **drafter
        )

    def decoder_layer_params(self, intermediate: int | None = None) -> int:
        return self.decoder_layer_matrix_params(intermediate) + self._decoder_layer_vectors()

    def decoder_layer_matrix_params(self, intermediate: int | None = None) -> int:
        """The layer's weight matrices (q, k, v, o, gate, up, down): what Muon updates."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * (intermediate or self.intermediate)

    def _decoder_layer_vectors(self) -> int:
        """Biases and norms (q_norm, k_norm, input and post-attention norms)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        bias = q + 2 * kv + self.hidden if self.attention_bias else 0
        return bias + 2 * self.head_dim + 2 * self.hidden

    @property
    def drafter_matrix_params(self) -> int:
        """The trainable weight matrices (draft layers' and fc): Muon's share under train.optimizer muon."""
        return (
            self.draft_layers * self.decoder_layer_matrix_params(self.draft_intermediate)
            + self.n_aux * self.hidden * self.hidden
        )

    @property
    def head_rows(self) -> int:
        """Rows of each frozen head: the draft vocabulary, else the whole vocabulary."""
        return self.draft_vocab or self.vocab

    @property
    def drafter_trainable(self) -> int:
        """Decoder layers + fc (n_aux*hidden -> hidden) + hidden_norm + norm."""
        layers = self.draft_layers * self.decoder_layer_params(self.draft_intermediate)
        return layers + self.n_aux * self.hidden * self.hidden + 2 * self.hidden

    @property
    def head_elements(self) -> int:
        """The frozen heads: lm_head and verifier_lm_head are one shared vocab x hidden tensor with the
        whole vocabulary, two draft_vocab x hidden ones with a draft vocabulary."""
        return (2 if self.draft_vocab else 1) * self.head_rows * self.hidden

    @property
    def drafter_frozen(self) -> int:
        """embed_tokens + the heads + verifier_norm."""
        return self.vocab * self.hidden + self.head_elements + self.hidden


def per_device_bytes(
    s: Shapes,
    *,
    gpus_per_copy: int,
    data_parallel: int,
    tokens: int,
    anchors: int,
    block: int,
    device: str,
    optimizer: str,
    shard: str = "optimizer",
    activation_bytes: int | None = None,
    loss_chunk_rows: int = 0,
    activation_checkpointing: bool = False,
    share_embedding: bool = True,
    target_in_process: bool = True,
    dense_attention: bool | None = None,
) -> dict[str, float]:
    """Bytes on the first GPU of a target copy (or in host RAM for device="cpu"), by part.

    `device` "cuda": bf16 autocast, fused loss; "cpu": fp32, eager loss. `optimizer` (train.optimizer,
    adamw or muon) has no default here: the run config's is its one home. `activation_bytes` overrides
    the activation width (train.precision float32 on CUDA = 4). `target_in_process` False
    (`target.source: vllm`): a trainer rank holds no target weights and runs no target forward, and
    the drafter keeps its own embedding (there is no target copy to share it with); the captured
    features still arrive on its device. `dense_attention` (default: on CPU): the draft layers run
    sdpa (or eager) attention, which keeps k and v repeated to every query head and a dense mask;
    flex attention (drafter.attn_implementation auto on CUDA) keeps neither. Eager attention's score
    matrices are not modelled: it is a lower bound there."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device {device!r}: use cuda or cpu")
    if shard not in SHARD_LEVELS:
        raise ValueError(f"shard {shard!r}: use one of {', '.join(SHARD_LEVELS)}")
    if optimizer not in ("adamw", "muon"):
        raise ValueError(f"optimizer {optimizer!r}: use adamw or muon")
    a = ASSUMPTIONS
    cuda = device == "cuda"
    act = activation_bytes or (2 if cuda else 4)
    tb = a["trainable_bytes_per_param"]
    p = s.drafter_trainable
    level = shard if data_parallel > 1 else "none"
    fsdp = level == "full"
    q = anchors * block
    draft_inter = s.draft_intermediate or s.intermediate
    # DDP's bucket views live all run; one rank's and FSDP2's gradients are freed every step
    grads_persist = data_parallel > 1 and not fsdp
    if fsdp:  # sharded fp32 weights + gradients; the gathered bf16 layers replace autocast's copies
        weights, grads = p * tb["weight"] / data_parallel, p * tb["grad"] / data_parallel
        layer = s.decoder_layer_params(s.draft_intermediate)
        root = p - s.draft_layers * layer  # fc, hidden_norm, norm
        gathered = (min(a["fsdp_gathered_layers"], s.draft_layers) * layer + root) * act + (layer + root) * 4
    else:
        weights = p * (tb["weight"] + (tb["autocast_copy_cuda"] if cuda and act == 2 else 0))
        grads, gathered = p * tb["grad"], 0.0
    moment_shards = data_parallel if level in ("optimizer", "full") else 1
    muon = s.drafter_matrix_params if optimizer == "muon" else 0
    optimizer_state = (
        muon * a["muon_momentum_bytes_per_param"] + (p - muon) * a["adam_moment_bytes_per_param"]
    )
    loss = "fused" if cuda else "eager"
    # under bf16 autocast the frozen head is stored in bf16 (trainer/drafter/model.py cast_frozen_heads)
    head_bytes = 2 if cuda and act == 2 else 4
    q_dim, kv_dim = s.heads * s.head_dim, s.kv_heads * s.head_dim
    per_layer = act * (
        a["query_hidden_copies"] * q * s.hidden
        + a["context_kv_copies"] * (tokens + q) * kv_dim
        + a["mlp_intermediate_copies"] * q * draft_inter
    )
    if (not cuda) if dense_attention is None else dense_attention:
        # sdpa: k and v repeated to every query head, and its dense fp32 mask
        per_layer += act * 2 * (tokens + q) * q_dim + 4 * q * (tokens + q)
    # activation checkpointing: each layer's input kept, one layer's tensors again in its backward
    layers_act = (
        q * s.hidden * s.draft_layers * act + per_layer
        if activation_checkpointing
        else s.draft_layers * per_layer
    )
    share_embedding = share_embedding and target_in_process
    here = 1 if target_in_process else 0
    forward = max(
        tokens * s.intermediate * a["target_mlp_copies"] * s.target_dtype_bytes,
        forward_working_bytes(s.linear, tokens, s.target_dtype_bytes),
    )
    activations = (
        (s.n_aux + 1) * tokens * s.hidden * s.target_dtype_bytes  # captured aux + last
        + 2 * tokens * s.hidden * act  # fc output, hidden_norm
        + q * s.hidden * 4  # noise embedding (fp32 embed_tokens)
        + layers_act
    )
    # train.loss_chunk_rows: one chunk's logits, targets and gradient at a time (chunked_loss.py)
    logits = min(q, loss_chunk_rows or q) * s.head_rows * a["logit_bytes"][loss] * a["logit_copies"][loss]
    foreach = (p - muon) * a["adam_foreach_bytes_per_param_cuda"] / moment_shards if cuda else 0
    step_phase = (0 if grads_persist else grads) + foreach
    return {
        "target_weights": here * s.target_params * s.target_dtype_bytes / gpus_per_copy,
        "target_forward": here * forward,
        "drafter_trainable": weights + (grads if grads_persist else 0),
        # what the optimizer step holds beyond the activations and logits the backward freed
        "drafter_step": max(0.0, step_phase - activations - logits),
        "drafter_gathered": gathered,
        "drafter_optimizer": optimizer_state / moment_shards,
        # train.share_target_embedding: the in-process target's embedding serves the drafter too
        "drafter_frozen": (0 if share_embedding else s.vocab * s.hidden * 4)
        + s.hidden * 4
        + s.head_elements * head_bytes,
        "activations": activations,
        "logits": logits,
        "runtime_reserve": a["runtime_reserve_gib_cuda"] * GIB if cuda else 0.0,
    }
