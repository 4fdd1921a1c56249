"""GPT-2's head and its cross-entropy taken a chunk of tokens at a time (--chunked-loss): the float32 logits of one
chunk (CHUNK tokens x the vocabulary) exist at once, never those of every token (the 1.6B model at micro-batch 8:
8,192 x 50,257 logits, 1.6 GB in float32 beside their bf16 copy), and the gradients of the hidden states and of the
head come out of the same pass, as Liger-Kernel's fused linear cross-entropy does, so that backward keeps no logits
either. It computes transformers' causal LM loss (labels shifted, -100 ignored, the mean over the rest):
tests/test_gpt.py holds it to ForCausalLMLoss, in float32 and within bf16's rounding under autocast.
"""

import torch
import torch.nn.functional as F

CHUNK = 2048  # tokens a chunk: 2,048 x 50,257 float32 logits are 412 MB
IGNORE = -100


def shifted(labels: torch.Tensor) -> torch.Tensor:
    """The token each position predicts (the next one), -100 for a sequence's last: transformers' shift."""
    return F.pad(labels, (0, 1), value=IGNORE)[..., 1:].reshape(-1)


def chunk_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, classes: int | None = None):
    """(the chunk's summed loss, its softmax in float32, which targets count) for hidden rows h; rows of `weight`
    from `classes` on (--pad-vocab-to's padding) get -inf logits: no probability, no gradient."""
    logits = (h @ weight.t()).float()
    if classes is not None and classes < logits.shape[1]:
        logits[:, classes:] = float("-inf")
    lse = logits.logsumexp(-1)
    valid = targets != IGNORE
    picked = logits.gather(1, targets.clamp_min(0)[:, None])[:, 0]
    return ((lse - picked) * valid).sum(), logits.sub_(lse[:, None]).exp_(), valid


class LinearCrossEntropy(torch.autograd.Function):
    """The mean cross-entropy of hidden [N, h] under the head weight [V, h]; both gradients computed in forward,
    chunk by chunk, and scaled by the incoming gradient in backward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                classes: int | None = None):
        count = (targets != IGNORE).sum().clamp_min(1)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], chunk):
            h, t = hidden[start:start + chunk], targets[start:start + chunk]
            loss, p, valid = chunk_loss(h, weight, t, classes)
            total += loss
            p[torch.arange(len(t), device=p.device), t.clamp_min(0)] -= 1  # d loss / d logits: softmax - one-hot
            p *= (valid / count)[:, None]
            p = p.to(h.dtype)  # the matmuls in the run's dtype, as the head's own backward (autocast's under it)
            grad_hidden[start:start + chunk] = p @ weight
            grad_weight += (p.t() @ h).float()
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total / count

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad.to(grad_hidden.dtype), (grad_weight * grad).to(ctx.weight_dtype), None, None, None


def causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int = CHUNK,
                   classes: int | None = None, shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' causal LM loss of hidden states [B, T, h] under the head `weight` (labels: [B, T] token ids),
    over the first `classes` rows of the head (all by default); shift_labels, as transformers', are labels shifted
    already: each position's own target."""
    h = hidden.reshape(-1, hidden.shape[-1])
    targets = shifted(labels) if shift_labels is None else shift_labels.reshape(-1)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return LinearCrossEntropy.apply(h, weight, targets, chunk, classes)
    total = sum(chunk_loss(h[s:s + chunk], weight, targets[s:s + chunk], classes)[0]
                for s in range(0, h.shape[0], chunk))
    return total / (targets != IGNORE).sum().clamp_min(1)
