"""A trained GPT-2 as a Hugging Face model folder that the tools people already use load as they are:

    python -m core.gpt.hf_export runs/<run> # the run's newest checkpoint (any strategy) -> runs/<run>/hf/
    make export RUN=<run>                   # the same
    python fabric_gpt.py ... --export       # at the end of a run, from the live model

runs/<run>/hf/ holds config.json, generation_config.json and model.safetensors (sharded with an index file above
2 GB, as save_pretrained writes it) in the run's training dtype (--dtype), and a text run's tokenizer saved by
transformers' PreTrainedTokenizerFast (<|endoftext|> its eos and pad token, the run's sequence its model_max_length);
`AutoModelForCausalLM.from_pretrained("runs/<run>/hf")`, `AutoTokenizer` and `pipeline("text-generation")` load it.
Sharded checkpoints (ZeRO, FSDP2, tensor and pipeline parallel) are gathered into one ordinary state dict in one
process (strategies.export_checkpoint); the weights are written from that dict itself, never copied into a second model.
"""

import contextlib
import shutil
import sys
from pathlib import Path

import torch

from core.gpt import gpt_model
from core.run.files import DiskFull, disk_full, free_bytes, why_full
from core.run.layout import saved_config

SHARD = "2GB"  # save_pretrained's shards: serializing one holds its bytes once more, so small ones keep the peak low


EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_dtype(precision: str, asked: str = "auto") -> torch.dtype:
    """The dtype of the folder's weights: the run's training dtype unless asked otherwise (bf16-mixed and bf16-true:
    bfloat16, 16-mixed: float16, 32-true: float32)."""
    if asked != "auto":
        return EXPORT_DTYPES[asked]
    return torch.bfloat16 if "bf16" in precision else torch.float16 if precision.startswith("16") else torch.float32


def write_hf_folder(state_dict: dict, cfg, folder, dtype: torch.dtype = torch.float32, checkpoint=None) -> Path:
    """Write `state_dict` (GPT2LMHeadModel keys, any dtype) for a run of `cfg`'s shape as a Hugging Face folder in
    `dtype`, with the run's tokenizer (runs/<run>/tokenizer.json) where it has one. Written under `<folder>.partial`;
    an existing folder is kept as `<folder>.previous` until the new one is in place (replace_folder). A full disk
    ends in DiskFull naming the bytes, the partial folder removed (`checkpoint`: what the export came from)."""
    from transformers import GenerationConfig, GPT2LMHeadModel

    folder = Path(folder)
    tokenizer = run_tokenizer(folder.parent, cfg)
    end_of_text = tokenizer.eos_token_id if tokenizer is not None else None
    # float32 attention is ours, and so is --pad-vocab-to's padding (zero rows, never a class): the folder has neither
    config = gpt_model.gpt2_config(cfg, attention="sdpa", end_of_text=end_of_text, padded=False)
    config.use_cache = True  # training turns the KV cache off; generation wants it
    config.pad_token_id = config.eos_token_id
    with torch.device("meta"):  # no weights of its own: it takes the dict's tensors (assign), never a copy
        model = GPT2LMHeadModel(config)
    padded = lambda k, v: k in ("transformer.wte.weight", "lm_head.weight") and v.shape[0] > cfg.vocab_size  # noqa: E731
    state_dict = {k: v[:cfg.vocab_size].clone() if padded(k, v) else v for k, v in state_dict.items()}
    if not gpt_model.has_biases(cfg):  # --no-bias: GPT-2's zero biases, so that GPT-2's loaders read it as they are
        state_dict = gpt_model.with_zero_biases(state_dict, model)
    state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    missing, unexpected = model.load_state_dict(state_dict, strict=False, assign=True)
    if unexpected or set(missing) - {"lm_head.weight"}:  # lm_head is tied to the token embedding
        raise ValueError(f"the state dict is not this GPT-2's: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    model.tie_weights()
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                               pad_token_id=config.eos_token_id, max_length=config.n_positions)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)

    def write():
        with shard_bar(sys.stderr.isatty()):
            model.save_pretrained(partial, max_shard_size=SHARD, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(partial)
    if (problem := disk_full(write, folder.parent)) is not None:
        shutil.rmtree(partial, ignore_errors=True)
        need = sum(v.numel() for k, v in state_dict.items() if k != "lm_head.weight") * dtype.itemsize
        source = f"its checkpoint {checkpoint} is intact" if checkpoint else "the run's checkpoints are intact"
        raise DiskFull(f"no space left to write the Hugging Face folder {folder}: it needs about {need / 2**20:,.1f} MiB "
                       f"and the disk has {free_bytes(folder.parent) / 2**20:,.1f} MiB free ({why_full(problem)}); the "
                       f"partial folder was removed and {source}. Fix: free space and run `make export "
                       f"RUN={folder.parent.name}` (python -m core.gpt.hf_export {folder.parent})")
    replace_folder(partial, folder)
    return folder


@contextlib.contextmanager
def shard_bar(shown: bool):
    """save_pretrained's progress bar over the shards, on a terminal only: in a log it is a line of control characters."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if not shown:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def run_tokenizer(run_dir: Path, cfg):
    """A text run's tokenizer as transformers' own fast tokenizer: <|endoftext|> its eos, bos and pad token, and the
    run's sequence length its model_max_length (generation then cuts a longer prompt instead of failing). None for
    a run without one (random tokens)."""
    path = run_dir / "tokenizer.json"
    if not path.is_file():
        return None
    from transformers import PreTrainedTokenizerFast

    from core.gpt import text_corpus

    eot = text_corpus.END_OF_TEXT
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token=eot, bos_token=eot, pad_token=eot,
                                   model_max_length=cfg.seq_len, truncation_side="left", padding_side="left")


def replace_folder(new: Path, folder: Path) -> None:
    """`new` becomes `folder`; the folder it replaces is renamed aside first and deleted only once the new one is in
    place, so an interruption leaves a complete folder under one of the two names (the next export puts it back)."""
    previous = folder.with_name(folder.name + ".previous")
    if previous.exists() and not folder.exists():  # an earlier export stopped between the renames
        previous.rename(folder)
    shutil.rmtree(previous, ignore_errors=True)
    if folder.exists():
        folder.rename(previous)
    new.rename(folder)
    shutil.rmtree(previous, ignore_errors=True)


def export_run(run_dir, dtype: str = "auto") -> Path:
    """The newest complete checkpoint of a run, whatever its strategy, as runs/<run>/hf/."""
    import json

    from core.gpt import strategies
    from core.run.checkpoints import Checkpoints

    run_dir = Path(run_dir)
    checkpoints = Checkpoints(run_dir / "checkpoints").complete()
    if not checkpoints:
        raise FileNotFoundError(f"{run_dir} has no complete checkpoint to export (runs/<run>/checkpoints/step-N); "
                                f"train it first, or pass the run's folder")
    newest = checkpoints[-1]
    cfg = saved_config(json.loads((newest / "config.json").read_text()))
    if getattr(cfg, "kind", "gpt") != "gpt":
        raise ValueError(f"{run_dir} is a {cfg.kind} run; only GPT-2 runs export to Hugging Face")
    if getattr(cfg, "nvme_path", ""):  # DeepSpeed's NVMe-offload checkpoint keeps empty placeholders for the states
        raise ValueError(f"{newest} is an NVMe-offload checkpoint, whose weights DeepSpeed keeps in the NVMe folder and "
                         f"cannot read back from the checkpoint; export such a run at its end with --export")
    folder = write_hf_folder(strategies.export_checkpoint(newest), cfg, run_dir / "hf",
                             export_dtype(cfg.precision, dtype), newest)
    print(f"exported {newest} to {folder}: load it with AutoModelForCausalLM.from_pretrained({str(folder)!r})")
    return folder


def build_parser():
    from core.run.flags import Folder, Parser, choice

    parser = Parser(description=__doc__, prog="python -m core.gpt.hf_export")
    parser.add_argument("run", type=Folder(create=False), help="a GPT-2 run folder with a checkpoint (runs/<run>)")
    parser.add_argument("--dtype", default="auto", type=choice(("auto", *EXPORT_DTYPES)), help="the weights' dtype "
                        "(default: auto, the run's training dtype: bfloat16 for bf16 runs, float16 for 16-mixed)")
    return parser


def main(argv=None) -> Path:
    args = build_parser().parse_args(argv)
    try:
        return export_run(args.run, args.dtype)
    except (FileNotFoundError, ValueError, DiskFull) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
