"""Text from a text run's final weights, whatever strategy trained them (`make sample RUN=<run folder>`).

    python -m lab.sample --run-name gpt-tiny-auto-20261126-101500 --prompt "ROMEO:" --max-new-tokens 300

The newest checkpoint of runs/<run-name>/ is gathered into one ordinary GPT-2 state dict in this process
(strategies.export_checkpoint) and tokens are drawn one at a time with the run's own tokenizer, as nanoGPT's
sample.py does.
"""

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from core.gpt import gpt_model, strategies, text_corpus
from core.run import flags
from core.run.checkpoints import Checkpoints, step_of
from core.run.flags import ConfigError, opt
from core.run.layout import saved_config


@dataclass
class Config:
    run_name: str = opt("", "the text run to sample (a folder under --out-dir)", check=flags.RunName())
    out_dir: str = opt("runs", "folder holding one folder per run", check=flags.Folder(create=False))
    prompt: str = opt("", "the text generation starts from (default: a newline)", check=flags.Text())
    max_new_tokens: int = opt(500, "tokens to generate", min=1)
    temperature: float = opt(0.8, "softmax temperature (lower: more conservative; 0: always the likeliest token)", min=0)
    top_k: int = opt(200, "draw from the k likeliest tokens (0: all)", min=0)
    seed: int = opt(1234, "seed of the draws", min=0)


def load_model(cfg: Config):
    """The run's newest checkpoint as a GPT2LMHeadModel in eval mode, its folder and its tokenizer."""
    from transformers import GPT2LMHeadModel

    run_dir = Path(cfg.out_dir) / cfg.run_name
    if not cfg.run_name or not run_dir.is_dir():
        raise ConfigError(f"sampling needs --run-name of a run under {cfg.out_dir}/ (make sample RUN=<run folder>)"
                          + (f"; {run_dir} does not exist" if cfg.run_name else ""))
    if not (run_dir / "tokenizer.json").is_file():
        raise ConfigError(f"{run_dir} has no tokenizer.json: it was not trained on text, so its tokens mean nothing; "
                          "sample a run of --dataset text")
    checkpoints = Checkpoints(run_dir / "checkpoints").complete()
    if not checkpoints:
        raise ConfigError(f"{run_dir} has no complete checkpoint to sample from; train it first (or --resume auto)")
    saved = saved_config(json.loads((checkpoints[-1] / "config.json").read_text()))
    if getattr(saved, "nvme_path", ""):
        raise ConfigError(f"{checkpoints[-1]} is an NVMe-offload checkpoint, whose weights DeepSpeed cannot read back; "
                          "train with --export and load runs/<run>/hf instead")
    model = gpt_model.without_biases(GPT2LMHeadModel(gpt_model.gpt2_config(saved)), saved)  # --no-bias: as trained
    model.load_state_dict(strategies.export_checkpoint(checkpoints[-1]), strict=False)  # lm_head: tied to wte
    model.tie_weights()
    model.eval()
    return model, checkpoints[-1], saved, text_corpus.load_tokenizer(run_dir / "tokenizer.json")


@torch.no_grad()
def generate(model, ids: list[int], cfg: Config, context: int, vocab: int) -> list[int]:
    """Draw --max-new-tokens tokens one at a time from the softmax of the last position's logits over the
    tokenizer's vocabulary, divided by --temperature and cut to the --top-k likeliest; seeded by --seed. Temperature
    0 is its limit: the likeliest token each time, as --top-k 1."""
    generator = torch.Generator().manual_seed(cfg.seed)
    x = torch.tensor([ids])
    for _ in range(cfg.max_new_tokens):
        # at most context - 1 tokens: training (gpt_model.window_loss) never runs the last position
        logits = model(input_ids=x[:, -(context - 1):]).logits[:, -1, :vocab].float()
        top_k = 1 if cfg.temperature == 0 else cfg.top_k
        logits = logits / (cfg.temperature or 1.0)
        if top_k and top_k < vocab:
            kth = torch.topk(logits, top_k).values[:, -1:]
            logits = logits.masked_fill(logits < kth, -math.inf)
        x = torch.cat([x, torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)], dim=1)
    return x[0].tolist()


def main(argv=None) -> str:
    cfg = flags.parse_config(Config, argv, __doc__, prog="python -m lab.sample")
    try:
        model, checkpoint, saved, tokenizer = load_model(cfg)
        ids = text_corpus.encode_prompt(tokenizer, cfg.prompt or "\n")
    except (ConfigError, FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    text = tokenizer.decode(generate(model, ids, cfg, saved.seq_len, tokenizer.get_vocab_size()))
    how = "temperature 0: the likeliest token each time" if cfg.temperature == 0 else \
        f"temperature {cfg.temperature}, top-k {cfg.top_k}"
    print(f"{checkpoint} (step {step_of(checkpoint)}), {how}:\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
