"""nanoGPT's train.py on shakespeare_char, re-typed as one plain PyTorch loop: the reference `lab.bench text` races
fabric_gpt.py against (karpathy/nanoGPT, MIT licence; model.py and train.py with the README's CPU recipe).

    python -m lab.nanogpt_reference [--data-dir data/text] [--out record.json]

It reads the same prepared train.bin/val.bin (text_corpus.py: Shakespeare, char tokens) that fabric_gpt.py
--tokenizer char trains on (prepared if missing; TEXT_MIRROR offline), draws batches
as nanoGPT does (random windows of block_size + 1 tokens, every position trained), and writes its validation loss
and tokens/s. The validation loss is measured on the windows fabric_gpt.py evaluates (text_corpus.Windows), so the
two losses are one estimate of the same quantity.
"""

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F


# ----------------------------------------------------------------------------- config (the README's CPU recipe)
@dataclass
class Recipe:
    block_size: int = 64
    batch_size: int = 12
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False  # train.py's default
    max_iters: int = 2000
    learning_rate: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 100
    lr_decay_iters: int = 2000
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    seed: int = 1337


# ----------------------------------------------------------------------------- model (nanoGPT's model.py)
class LayerNorm(nn.Module):
    def __init__(self, ndim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, r: Recipe):
        super().__init__()
        self.c_attn = nn.Linear(r.n_embd, 3 * r.n_embd, bias=r.bias)
        self.c_proj = nn.Linear(r.n_embd, r.n_embd, bias=r.bias)
        self.n_head, self.n_embd, self.dropout = r.n_head, r.n_embd, r.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, r: Recipe):
        super().__init__()
        self.c_fc = nn.Linear(r.n_embd, 4 * r.n_embd, bias=r.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * r.n_embd, r.n_embd, bias=r.bias)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, r: Recipe):
        super().__init__()
        self.ln_1, self.attn = LayerNorm(r.n_embd, r.bias), CausalSelfAttention(r)
        self.ln_2, self.mlp = LayerNorm(r.n_embd, r.bias), MLP(r)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, r: Recipe, vocab_size: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, r.n_embd), nn.Embedding(r.block_size, r.n_embd)
        self.h = nn.ModuleList([Block(r) for _ in range(r.n_layer)])
        self.ln_f = LayerNorm(r.n_embd, r.bias)
        self.lm_head = nn.Linear(r.n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * r.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if getattr(module, "bias", None) is not None:
                torch.nn.init.zeros_(module.bias)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)

    def configure_optimizers(self, r: Recipe):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": r.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=r.learning_rate, betas=(r.beta1, r.beta2))  # fused only on CUDA


# ----------------------------------------------------------------------------- data and schedule (train.py)
def get_batch(prepared, r: Recipe):
    data = prepared.tokens("train")  # a memmap recreated every batch, as train.py does
    ix = torch.randint(len(data) - r.block_size, (r.batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + r.block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + r.block_size].astype(np.int64)) for i in ix])
    return x, y


def get_lr(it: int, r: Recipe) -> float:
    if it < r.warmup_iters:
        return r.learning_rate * (it + 1) / (r.warmup_iters + 1)
    if it > r.lr_decay_iters:
        return r.min_lr
    ratio = (it - r.warmup_iters) / (r.lr_decay_iters - r.warmup_iters)
    return r.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (r.learning_rate - r.min_lr)


@torch.no_grad()
def val_loss(model, windows, batch_size: int) -> float:
    """Mean loss over fabric_gpt.py's fixed validation windows of block_size + 1 tokens, block_size predictions each."""
    model.eval()
    losses = []
    for i in range(0, len(windows), batch_size):
        w = torch.stack([windows[j][0] for j in range(i, min(i + batch_size, len(windows)))])
        losses.append(model(w[:, :-1], w[:, 1:]).item())
    model.train()
    return sum(losses) / len(losses)


# ----------------------------------------------------------------------------- train
def train(prepared, r: Recipe, windows, warmup: int) -> dict:
    torch.manual_seed(r.seed)
    model = GPT(r, prepared.vocab_size)
    optimizer = model.configure_optimizers(r)
    for it in range(r.max_iters):
        if it == min(warmup, r.max_iters - 1):  # timed as fabric_gpt.py times: after its --timing-warmup steps
            started = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it, r)
        x, y = get_batch(prepared, r)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), r.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if it % 250 == 0 or it == r.max_iters - 1:  # nanoGPT's log_interval reads loss.item() too
            print(f"iter {it}: loss {loss.item():.4f}", flush=True)
    seconds = time.perf_counter() - started
    timed = r.max_iters - min(warmup, r.max_iters - 1)
    return {"val_loss": val_loss(model, windows, r.batch_size), "timed_s": seconds, "timed_steps": timed,
            "tokens_per_s": timed * r.batch_size * r.block_size / seconds, "recipe": vars(r),
            "eval_windows": len(windows.starts)}


def build_parser():
    from core.run.flags import Folder, OutFile, Parser, number

    parser = Parser(description=__doc__, prog="python -m lab.nanogpt_reference")
    parser.add_argument("--data-dir", default="data/text", type=Folder(), help="the corpus and its prepared tokens, "
                        "as fabric_gpt.py's (default: data/text)")
    parser.add_argument("--out", default="", type=OutFile(optional=True), help="a JSON file for the record "
                        "(default: none)")
    parser.add_argument("--max-iters", type=number(int, min=1), default=Recipe.max_iters, help="iterations, "
                        "also the cosine's length (default: 2000)")
    parser.add_argument("--eval-windows", type=number(int, min=1), default=2400, help="fixed validation windows "
                        "(default: 2400, fabric_gpt.py's --eval-batches 200 of 12)")
    parser.add_argument("--eval-seed", type=number(int, min=0), default=1235, help="seed of the validation windows "
                        "(default: 1235, fabric_gpt.py's under its default --seed 1234)")
    parser.add_argument("--timing-warmup", type=number(int, min=0), default=2, help="first iterations left out "
                        "of tokens/s (default: 2, as fabric_gpt.py)")
    return parser


def main(argv=None) -> None:
    from core.gpt import text_corpus

    args = build_parser().parse_args(argv)
    r = Recipe(max_iters=args.max_iters, lr_decay_iters=args.max_iters)
    try:
        prepared = text_corpus.prepare("", "char", 0, args.data_dir)
        # fabric_gpt.py's windows of block_size + 1 tokens: x, y one apart, block_size predictions each
        windows = text_corpus.Windows(prepared, "val", r.block_size + 1, args.eval_windows, args.eval_seed)
    except text_corpus.TextError as e:
        raise SystemExit(f"error: {e}") from None
    record = train(prepared, r, windows, args.timing_warmup)
    print(f"val loss {record['val_loss']:.4f}, {record['tokens_per_s']:,.0f} tokens/s")
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
