"""One memory model for `dflash plan` and `dflash preflight`: bytes per device, by part, for what
`trainer/training/loop.py` really runs. Light side: stdlib only (no torch at import).

Where things live: a target copy is split layer-wise over `gpus_per_copy` GPUs; the drafter, its
optimizer, the captured features and the loss all sit on the copy's FIRST GPU (`setup_dist` puts
the rank's device there), so that GPU is the one that must fit and the one modelled here.

What the trainer holds (loop.py + speculators' DFlashDraftModel, read from their code):

- target weights / gpus_per_copy (target dtype; the base model only, no lm_head is loaded), plus
  the no-grad forward's transient working set of one layer (its MLP: gate, up and product);
- the drafter's trainable parameters in fp32 (decoder layers, fc, hidden_norm, norm), their fp32
  gradients, and under DDP (world > 1) DDP's flat gradient buckets, one more fp32 copy; on CUDA
  bf16 autocast keeps a bf16 cast of each trainable weight alive for the backward;
- AdamW's two fp32 moments: on every rank with plain AdamW, 1/data_parallel of them per rank with
  ZeRO-1 (`train.shard_optimizer_state`, torch's ZeroRedundancyOptimizer);
- the drafter's frozen tensors: embed_tokens (vocab x hidden) and verifier_norm in fp32 (the drafter
  is built in fp32), and one vocab x hidden head shared by lm_head and verifier_lm_head (full
  vocabulary: both hold the target's lm_head), fp32 on CPU and bf16 under bf16 autocast, where
  autocast would cast it to bf16 for every matmul anyway (trainer/drafter.py cast_frozen_heads);
- activations: the captured aux states (n_aux x tokens x hidden) and last hidden state, fc output,
  and per drafter layer `activation_copies` tensors of width hidden over context + query tokens
  plus the MLP's three intermediate-width tensors over the query tokens (query = anchors x block);
- logits: speculators' forward materialises the full [anchors x block, vocab] drafter logits and
  verifier targets whatever the loss; the fused (Triton, CUDA) loss adds only their gradient (bf16
  under autocast: 3 copies x 2 B), the eager loss (CPU) also keeps an fp32 log-softmax (4 x 4 B);
  with `train.loss_chunk_rows` N (trainer/training/chunked_loss.py) the same copies of N rows only;
- a runtime reserve on CUDA (context, cuBLAS/NCCL workspaces).

Every constant is in ASSUMPTIONS (echoed by `dflash plan --json`). Nothing here has been measured
on a GPU yet: the figures are arithmetic over the code, not allocator readings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GIB = float(2**30)

ASSUMPTIONS: dict[str, Any] = {
    # trainable tensors and the frozen embedding (the drafter is built fp32)
    "drafter_param_dtype": "float32",
    "trainable_bytes_per_param": {"weight": 4, "grad": 4, "ddp_bucket": 4, "autocast_copy_cuda": 2},
    "adam_moment_bytes_per_param": 8,  # exp_avg + exp_avg_sq, fp32
    "optimizer_sharding": "ZeRO-1 over data-parallel ranks when shard_optimizer_state and data_parallel > 1",
    "frozen": (
        "embed_tokens + verifier_norm fp32; one head shared by lm_head/verifier_lm_head, "
        "bf16 under bf16 autocast (CUDA), else fp32"
    ),
    "activation_copies": 4,  # saved tensors of width hidden per token and drafter layer
    "mlp_intermediate_copies": 3,  # gate, up, act*up
    "logit_copies": {"fused": 3, "eager": 4},  # logits, targets, grad (+ fp32 log-softmax for eager)
    "logit_bytes": {"fused": 2, "eager": 4},  # bf16 under autocast on CUDA, fp32 on CPU
    "runtime_reserve_gib_cuda": 1.0,
}


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

    def decoder_layer_params(self, intermediate: int | None = None) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + (q + 2 * kv + h if self.attention_bias else 0)
        mlp = 3 * h * (intermediate or self.intermediate)
        norms = 2 * self.head_dim + 2 * h  # q_norm, k_norm, input and post-attention norms
        return attention + mlp + norms

    @property
    def drafter_trainable(self) -> int:
        """Decoder layers + fc (n_aux*hidden -> hidden) + hidden_norm + norm."""
        layers = self.draft_layers * self.decoder_layer_params(self.draft_intermediate)
        return layers + self.n_aux * self.hidden * self.hidden + 2 * self.hidden

    @property
    def drafter_frozen(self) -> int:
        """embed_tokens + the shared lm_head/verifier_lm_head + verifier_norm."""
        return 2 * self.vocab * self.hidden + self.hidden


def per_device_bytes(
    s: Shapes,
    *,
    gpus_per_copy: int,
    data_parallel: int,
    tokens: int,
    anchors: int,
    block: int,
    device: str,
    shard_optimizer_state: bool = True,
    activation_bytes: int | None = None,
    loss_chunk_rows: int = 0,
) -> dict[str, float]:
    """Bytes on the first GPU of a target copy (or in host RAM for device="cpu"), by part.

    `device` "cuda": bf16 autocast, fused loss; "cpu": fp32, eager loss. `activation_bytes` overrides
    the activation width (train.precision float32 on CUDA = 4)."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device {device!r}: use cuda or cpu")
    a = ASSUMPTIONS
    cuda = device == "cuda"
    act = activation_bytes or (2 if cuda else 4)
    tb = a["trainable_bytes_per_param"]
    p = s.drafter_trainable
    ddp = data_parallel > 1
    per_param = tb["weight"] + tb["grad"] + (tb["ddp_bucket"] if ddp else 0)
    per_param += tb["autocast_copy_cuda"] if cuda and act == 2 else 0
    shards = data_parallel if (shard_optimizer_state and ddp) else 1
    q = anchors * block
    draft_inter = s.draft_intermediate or s.intermediate
    loss = "fused" if cuda else "eager"
    # under bf16 autocast the frozen head is stored in bf16 (trainer/drafter.py cast_frozen_heads)
    head_bytes = 2 if cuda and act == 2 else 4
    per_layer = (
        a["activation_copies"] * (q + tokens) * s.hidden + a["mlp_intermediate_copies"] * q * draft_inter
    )
    return {
        "target_weights": s.target_params * s.target_dtype_bytes / gpus_per_copy,
        "target_forward": tokens * s.intermediate * a["mlp_intermediate_copies"] * s.target_dtype_bytes,
        "drafter_trainable": p * per_param,
        "drafter_optimizer": p * a["adam_moment_bytes_per_param"] / shards,
        "drafter_frozen": (s.vocab * s.hidden + s.hidden) * 4 + s.vocab * s.hidden * head_bytes,
        "activations": (
            (s.n_aux + 1) * tokens * s.hidden * s.target_dtype_bytes  # captured aux + last
            + 2 * tokens * s.hidden * act  # fc output, hidden_norm
            + q * s.hidden * 4  # noise embedding (fp32 embed_tokens)
            + s.draft_layers * per_layer * act
        ),
        # train.loss_chunk_rows: one chunk's logits, targets and gradient at a time (chunked_loss.py)
        "logits": min(q, loss_chunk_rows or q) * s.vocab * a["logit_bytes"][loss] * a["logit_copies"][loss],
        "runtime_reserve": a["runtime_reserve_gib_cuda"] * GIB if cuda else 0.0,
    }
