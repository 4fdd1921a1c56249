"""A trained GPT-2 as a Hugging Face model folder that the tools people already use load as they are:

    python hf_export.py runs/<run>          # the run's newest checkpoint (any strategy) -> runs/<run>/hf/
    make export RUN=<run>                   # the same
    python fabric_gpt.py ... --export       # at the end of a run, from the live model

runs/<run>/hf/ holds config.json, generation_config.json and model.safetensors (sharded with an index file above
2 GB, as save_pretrained writes it), and a text run's tokenizer; `AutoModelForCausalLM.from_pretrained("runs/<run>/hf")`
(and `AutoTokenizer`) load it. Sharded
checkpoints (ZeRO, FSDP2, tensor and pipeline parallel) are gathered into one ordinary state dict in one process
(strategies.export_checkpoint); the weights are written from that dict itself, never copied into a second model.
"""

import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

import gpt_model

SHARD = "2GB"  # save_pretrained's shards: serializing one holds its bytes once more, so small ones keep the peak low


def write_hf_folder(state_dict: dict, cfg, folder) -> Path:
    """Write `state_dict` (GPT2LMHeadModel keys, any dtype) for a run of `cfg`'s shape as a Hugging Face folder,
    atomically: written under `<folder>.partial` and renamed."""
    from transformers import GenerationConfig, GPT2LMHeadModel

    folder = Path(folder)
    config = gpt_model.gpt2_config(cfg, attention="sdpa")  # what any transformers loads (float32 attention is ours)
    config.use_cache = True  # training turns the KV cache off; generation wants it
    with torch.device("meta"):  # no weights of its own: it takes the dict's tensors (assign), never a copy
        model = GPT2LMHeadModel(config)
    missing, unexpected = model.load_state_dict(state_dict, strict=False, assign=True)
    if unexpected or set(missing) - {"lm_head.weight"}:  # lm_head is tied to the token embedding
        raise ValueError(f"the state dict is not this GPT-2's: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    model.tie_weights()
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                               pad_token_id=config.eos_token_id, max_length=config.n_positions)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, max_shard_size=SHARD, safe_serialization=True)
    tokenizer = folder.parent / "tokenizer.json"  # a text run's (runs/<run>/tokenizer.json): AutoTokenizer loads it
    if tokenizer.is_file():
        shutil.copyfile(tokenizer, partial / "tokenizer.json")
        (partial / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}\n')
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def export_run(run_dir) -> Path:
    """The newest complete checkpoint of a run, whatever its strategy, as runs/<run>/hf/."""
    import json

    import strategies
    from checkpoints import Checkpoints

    run_dir = Path(run_dir)
    checkpoints = Checkpoints(run_dir / "checkpoints").complete()
    if not checkpoints:
        raise FileNotFoundError(f"{run_dir} has no complete checkpoint to export (runs/<run>/checkpoints/step-N); "
                                f"train it first, or pass the run's folder")
    newest = checkpoints[-1]
    cfg = SimpleNamespace(**json.loads((newest / "config.json").read_text()))
    if getattr(cfg, "kind", "gpt") != "gpt":
        raise ValueError(f"{run_dir} is a {cfg.kind} run; only GPT-2 runs export to Hugging Face")
    if getattr(cfg, "nvme_path", ""):  # DeepSpeed's NVMe-offload checkpoint keeps empty placeholders for the states
        raise ValueError(f"{newest} is an NVMe-offload checkpoint, whose weights DeepSpeed keeps in the NVMe folder and "
                         f"cannot read back from the checkpoint; export such a run at its end with --export")
    folder = write_hf_folder(strategies.export_checkpoint(newest), cfg, run_dir / "hf")
    print(f"exported {newest} to {folder}: load it with AutoModelForCausalLM.from_pretrained({str(folder)!r})")
    return folder


def build_parser():
    from flags import Folder, Parser

    parser = Parser(description=__doc__, prog="hf_export.py")
    parser.add_argument("run", type=Folder(create=False), help="a GPT-2 run folder with a checkpoint (runs/<run>)")
    return parser


def main(argv=None) -> Path:
    args = build_parser().parse_args(argv)
    try:
        return export_run(args.run)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
