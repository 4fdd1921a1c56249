"""The course's GPT-2: transformers' GPT2LMHeadModel in the presets' shapes, built with GPT-2's initialisation
(the same weights whatever the strategy), its parameter count, and the attention it computes (transformers' SDPA,
in float32 on a CPU where that measures faster). What nanoGPT keeps in model.py; the training is fabric_gpt.py's.
"""

import functools
import math
import zlib
from contextlib import nullcontext

import torch

from core.run.hardware import native_bf16, sdpa_kernel
from core.run.measurements import cached, rank_threads, seconds_per_call, threads

# name: (n_embd, n_layer, n_head, n_positions/seq_len, vocab_size)
PRESETS = {
    "tiny": (64, 2, 4, 64, 256),
    "small": (256, 4, 4, 256, 50257),
    "gpt2": (768, 12, 12, 1024, 50257),
    "gpt2-medium": (1024, 24, 16, 1024, 50257),
    "gpt2-large": (1280, 36, 20, 1024, 50257),
    "gpt2-xl": (1600, 48, 25, 1024, 50257),
    "1.6b": (1600, 48, 32, 1024, 50257),  # the course's table: hidden 1600, 32 heads, 48 layers, seq 1024
}



def model_vocab(cfg) -> int:
    """The embedding's and the head's rows: the vocabulary padded up to a multiple of --pad-vocab-to (nanoGPT's
    50,304 for 50,257), whose padding rows stay zero and whose classes the loss never counts (mask_padding)."""
    multiple = getattr(cfg, "pad_vocab_to", 1) or 1
    return -(-cfg.vocab_size // multiple) * multiple


def gpt2_config(cfg, attention: str | None = None, end_of_text: int | None = None, padded: bool = True):
    """The transformers GPT2Config of a run's shape (no dropout by default, no KV cache), with the attention the run
    computes (attention_implementation) unless `attention` names one, and the padded vocabulary unless `padded` is
    False (an exported folder's). `end_of_text`: the tokenizer's <|endoftext|> id, the folder's bos/eos (training
    reads neither; a run without a tokenizer has the last id)."""
    from transformers import GPT2Config

    eot = cfg.vocab_size - 1 if end_of_text is None else end_of_text
    # GPT-2's tanh GELU as one kernel: the same function as gelu_new, whose eight elementwise ops took 15% of a CPU
    # step of the nanoGPT recipe (python -m lab.bench text) and saved 12 of a block's 112 bytes per element for backward
    return GPT2Config(n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head, n_positions=cfg.seq_len,
                      activation_function="gelu_pytorch_tanh",
                      vocab_size=model_vocab(cfg) if padded else cfg.vocab_size, resid_pdrop=cfg.dropout,
                      embd_pdrop=cfg.dropout,
                      attn_pdrop=cfg.dropout, use_cache=False, bos_token_id=eot, eos_token_id=eot,
                      attn_implementation=attention or attention_implementation(cfg))


SDPA_FLOAT32 = "sdpa_float32"


def sdpa_in_float32(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention computed in float32, outside autocast, for a run whose 16-bit attention is the
    slower (float32_attention_faster); the output goes back to the run's dtype for the projection."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    with torch.autocast(query.device.type, enabled=False):
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
    return out.to(query.dtype), weights


SDPA_CAUSAL = "sdpa_causal"


def attention_implementation(cfg) -> str:
    """SDPA_CAUSAL: transformers' own SDPA attention under a name its mask functions do not know, so that no mask is
    built: a run's windows are whole causal sequences without padding, which SDPA's is_causal computes as "sdpa"'s
    skipped mask did, and the mask's check for packed sequences (masking_utils.find_packed_sequence_indices: a host
    read of a device value in every forward, a GPU's queue drained) never runs. SDPA_FLOAT32 (equally maskless) for a
    16-bit run whose --attention-precision is float32 (fabric_gpt.resolve_attention decides auto before anything is
    built). An exported folder says "sdpa" (hf_export.py): its users pad."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    half = cfg.precision in ("16-mixed", "bf16-mixed", "bf16-true")
    if half and getattr(cfg, "attention_precision", "autocast") == "float32":
        AttentionInterface.register(SDPA_FLOAT32, sdpa_in_float32)
        return SDPA_FLOAT32
    AttentionInterface.register(SDPA_CAUSAL, sdpa_attention_forward)
    return SDPA_CAUSAL


def count_parameters(cfg) -> tuple[int, str]:
    """(parameters, attention implementation), from the model on the meta device (no memory); kept per shape: a run
    asks 4-5 times (its plans, its summary), each a model built, 15-20 ms of CPU."""
    return _counted_model(cfg)[:2]


def largest_parameter(cfg) -> int:
    """Elements of the model's largest parameter (GPT-2's tied embedding, or the MLP's or the positions' where those
    are wider): what one of ZeRO-Infinity's swap buffers holds a partition of (strategies.nvme_param_buffer)."""
    return _counted_model(cfg)[2]


def _counted_model(cfg) -> tuple[int, str, int]:
    from transformers import GPT2LMHeadModel

    config = gpt2_config(cfg)
    key = config.to_json_string(), config._attn_implementation, has_biases(cfg)
    if key not in _counted:
        with torch.device("meta"):
            model = without_biases(GPT2LMHeadModel(config), cfg)
        sizes = [p.numel() for p in model.parameters()]  # tied once
        _counted[key] = sum(sizes), model.config._attn_implementation, max(sizes)
    return _counted[key]


_counted = {}


def build_model(cfg, fabric=None):
    """GPT2LMHeadModel with GPT-2's initialisation. Under ZeRO-3 (given the Fabric) it is built inside
    deepspeed.zero.Init, so that no rank ever holds it whole: each parameter is partitioned as it is created and
    then filled one gathered parameter at a time. Every other strategy builds it whole on every rank and cuts or
    shards it. Either way each weight comes from `initial_weights`, by name: the same model for every strategy."""
    from transformers import GPT2LMHeadModel
    try:
        from transformers.initialization import no_init_weights  # transformers >= 5
    except ImportError:
        from transformers.modeling_utils import no_init_weights

    torch.manual_seed(cfg.seed)
    partitioned = fabric is not None and cfg.layout.zero_stage == 3
    # transformers' own initialisation would draw every weight that fill_initial_weights then draws again (0.75 s
    # of CPU for GPT-2 small's width with 4 blocks, the embedding most of it)
    model_class = chunked_head_model() if getattr(cfg, "chunked_loss", False) else GPT2LMHeadModel
    with fabric.init_module(empty_init=True) if partitioned else nullcontext(), no_init_weights():
        model = without_biases(model_class(gpt2_config(cfg)), cfg)
        model.tie_weights()  # lm_head is the token embedding: the skipped initialisation ties them
    model.loss_type = "ForCausalLM"  # the loss transformers falls back to for GPT2LMHeadModel, named: no warning per rank
    model.lm_head.classes = cfg.vocab_size  # the chunked loss reads it too
    if model_vocab(cfg) > cfg.vocab_size:
        model.lm_head.register_forward_hook(mask_padding)  # a pipeline's last stage holds this module too
    fill_initial_weights(model, cfg, partitioned)
    if cfg.grad_checkpointing:
        kwargs = {"use_reentrant": False}  # the reentrant variant drops gradients of inputs without grad
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 renamed it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def has_biases(cfg) -> bool:
    """GPT-2's biases (the default), or none (--no-bias); a config saved before the flag existed had them."""
    return getattr(cfg, "bias", True)


def without_biases(model, cfg):
    """--no-bias (nanoGPT's bias=False): the blocks' four linear layers and every LayerNorm without their biases, the
    rest GPT-2 as it is. GPT-2 initialises its biases to zero, so the two start as the same function. HF's Conv1D
    computes addmm(bias, x, W), which copies the bias into every row of the output before the matmul adds to it: 7-9%
    of a CPU step of nanoGPT's recipe (docs/text.md). A bias-free Conv1D keeps its [in, out] weight and its name, so
    strategies, checkpoints and exports read it as before; the exported folder is GPT-2's, with zero biases
    (with_zero_biases)."""
    if has_biases(cfg):
        return model
    from transformers.pytorch_utils import Conv1D

    for module in model.modules():
        if isinstance(module, Conv1D):
            module.bias = None
            module.__class__ = conv1d_without_bias()
        elif isinstance(module, torch.nn.LayerNorm):
            module.bias = None
    return model


@functools.cache
def conv1d_without_bias():
    """HF's Conv1D computing x @ W: one matmul, no bias copied into its output first."""
    from transformers.pytorch_utils import Conv1D

    class Conv1DWithoutBias(Conv1D):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.matmul(x, self.weight)

    return Conv1DWithoutBias


def with_zero_biases(state_dict: dict, model) -> dict:
    """A --no-bias run's state dict completed with the zero biases of `model` (a GPT2LMHeadModel of the run's shape,
    on any device), so that it loads as GPT-2's: the same function, in the format every GPT-2 tool reads."""
    zeros = {name: torch.zeros(p.shape) for name, p in model.named_parameters()
             if name.endswith(".bias") and name not in state_dict}
    return {**state_dict, **zeros}


def mask_padding(head, inputs, logits: torch.Tensor) -> torch.Tensor:
    """The head's forward hook under --pad-vocab-to: the padding's logits are -inf, so that softmax and the loss see
    the vocabulary's classes only (exp(-inf) = 0: no probability, no gradient, the padding rows stay zero)."""
    padding = torch.arange(logits.shape[-1], device=logits.device) >= head.classes
    return logits.masked_fill(padding, float("-inf"))


def compile_blocks(model) -> None:
    """--compile: torch.compile each transformer block in place, as torchtitan does, not the whole model: dynamo
    inlines the blocks' modules with their weights as inputs, so the L blocks share one graph, compiled once (the whole
    model's graph grows with its layers, and so does its compile time); the blocks stay the modules that FSDP shards,
    checkpointing recomputes and a pipeline stage holds, and the state dict keeps its keys, so a checkpoint reads
    back compiled or not. The embedding and the head with its loss stay eager."""
    for block in model.transformer.h:
        block.compile()


def positions(cfg) -> int:
    """The positions a training step computes in each window of seq_len tokens: all but the last (window_loss)."""
    return cfg.seq_len - 1


def window_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' causal LM loss of windows of seq_len tokens: each of the first seq_len - 1 predicts the one after
    it. The labels go in shifted already (shift_labels), so the last position, which has nothing to predict, is never
    computed: labels=input_ids would carry it through every layer and drop its logits (1/seq_len of the work: at
    nanoGPT's window of 65, 4.6% of its step's time on a 2-core Xeon, docs/text.md)."""
    targets = tokens[:, 1:].contiguous()
    return model(input_ids=tokens[:, :-1], labels=targets, shift_labels=targets).loss


@functools.cache
def chunked_head_model():
    """GPT2LMHeadModel whose loss, given labels, takes the head a chunk of tokens at a time (core/gpt/chunked_loss.py)
    and returns no logits; the same parameters and state dict. Its forward reads the head's weight itself: a
    strategy that gathers parameters per module (ZeRO-3) or splits the head (tp, pp) is refused with it."""
    from transformers import GPT2LMHeadModel
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

    from core.gpt.chunked_loss import causal_lm_loss

    class GPT2ChunkedLoss(GPT2LMHeadModel):
        def forward(self, input_ids=None, labels=None, shift_labels=None, **kwargs):
            if labels is None:
                return super().forward(input_ids=input_ids, **kwargs)
            hidden = self.transformer(input_ids, **kwargs).last_hidden_state
            return CausalLMOutputWithCrossAttentions(loss=causal_lm_loss(
                hidden, self.lm_head.weight, labels, classes=self.lm_head.classes, shift_labels=shift_labels))

    return GPT2ChunkedLoss


def initial_weights(name: str, shape: torch.Size, cfg) -> torch.Tensor:
    """transformers' GPT-2 initialisation (N(0, 0.02), c_proj weights N(0, 0.02/sqrt(2L)), zero biases, unit
    LayerNorms), each parameter drawn from its own generator seeded by the run's seed and the parameter's name,
    so that it does not depend on the order parameters are created or filled in."""
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if ".ln_" in name:
        return torch.ones(shape)
    std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj.weight") else 0.02
    generator = torch.Generator().manual_seed(cfg.seed * 2**32 + zlib.crc32(name.encode()))
    if name.endswith("wte.weight") and shape[0] > cfg.vocab_size:  # --pad-vocab-to: the vocabulary's rows as an
        # unpadded run draws them, the padding zero (and zero it stays: no logit of it counts, no token is one)
        rows = torch.randn((cfg.vocab_size, *shape[1:]), generator=generator) * std
        return torch.cat([rows, rows.new_zeros((shape[0] - cfg.vocab_size, *shape[1:]))])
    return torch.randn(shape, generator=generator) * std


def fill_initial_weights(model, cfg, partitioned: bool) -> None:
    """Write initial_weights into every parameter; a ZeRO-3 partitioned one is gathered alone, filled on rank 0
    and partitioned again (DeepSpeed broadcasts rank 0's values): at most one whole parameter is held at once."""
    first = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if partitioned:
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters
    for name, p in model.named_parameters():
        with GatheredParameters(p, modifier_rank=0) if partitioned else nullcontext(), torch.no_grad():
            if first or not partitioned:
                p.copy_(initial_weights(name, p.shape, cfg).to(p.dtype))


def math_dtype(cfg) -> torch.dtype:
    """The dtype the run's matmuls compute in: autocast's, else the weights' (compute_dtype)."""
    weights, autocast = compute_dtype(cfg.precision, cfg.layout.deepspeed)
    return autocast or weights


def resolve_attention(cfg, on_gpu: bool) -> str:
    """--attention-precision auto as this run will compute it: float32 on a CPU where SDPA's forward and backward at
    the run's shape measure faster in float32 than in the run's 16-bit type (the CPU flash kernel's bf16 backward was
    4x its float32 time on the AVX-512 BF16 EPYC, more than bf16 matmuls save), else the 16-bit type. Without bf16
    instructions float32, untimed, as --precision auto: emulated bf16 SDPA took 2.6-5.9x float32's time on an AVX2
    EPYC at three shapes, and the 1.6B preset's probe alone 4.1 s."""
    if cfg.attention_precision != "auto":
        return cfg.attention_precision
    half = math_dtype(cfg)
    if on_gpu or half == torch.float32:
        return "autocast"
    if half == torch.bfloat16 and not native_bf16():
        return "float32"
    faster = float32_attention_faster(cfg.n_head // cfg.layout.tp_size, cfg.seq_len,
                                                cfg.n_embd // cfg.n_head, cfg.micro_batch_size, half,
                                                rank_threads(cfg.devices))
    return "float32" if faster else "autocast"


def attention_kernel(cfg, device: torch.device, implementation: str) -> str:
    """The attention kernel this run's shape gets on its device (a rank's heads under tensor parallel), in the
    dtype its matmuls run in: for the record, since PyTorch picks it silently (the 1.6B preset's head dimension 50
    is not a multiple of 8, which some kernels need)."""
    if implementation not in ("sdpa", SDPA_CAUSAL, SDPA_FLOAT32):
        return f"{implementation} (transformers' own, scores materialised)"
    # --attention-precision float32 (chosen by auto where it measured faster), else the run's matmul dtype
    dtype = torch.float32 if implementation == SDPA_FLOAT32 else math_dtype(cfg)
    heads, head_dim = cfg.n_head // cfg.layout.tp_size, cfg.n_embd // cfg.n_head
    kernel = sdpa_kernel(device, dtype, heads, cfg.seq_len, head_dim, cfg.dropout)
    return f"SDPA {kernel}, {heads} heads x {head_dim} dims x {cfg.seq_len} positions in {str(dtype).split('.')[-1]}"


def compute_dtype(precision: str, deepspeed: bool) -> tuple[torch.dtype, torch.dtype | None]:
    """(the weights' dtype, autocast's dtype or None) of a run: Fabric's *-mixed autocasts float32 weights;
    DeepSpeed's bf16/fp16 and *-true keep the weights in the 16-bit type itself."""
    half = torch.bfloat16 if "bf16" in precision else torch.float16 if "16" in precision else None
    if half is None:
        return torch.float32, None
    if precision.endswith("-true") or deepspeed:
        return half, None
    return torch.float32, half


# ATen's CPU flash attention splits past 768 positions into blocks of 256 queries x 512 keys (FlashAttentionKernel.cpp)
ATTENTION_PROBE_POSITIONS = 2048


def float32_attention_faster(heads: int, seq_len: int, head_dim: int, micro_batch: int, dtype: torch.dtype,
                             n_threads: int) -> bool:
    """Whether SDPA's forward and backward at this shape run faster in float32 than in the run's 16-bit dtype here
    (cached). On the AVX-512 BF16 EPYC the CPU flash kernel's bf16 backward took 4x its float32 time, more than the
    bf16 matmuls save; a CPU with AMX or without bf16 instructions may differ, so it is measured, not assumed.
    Measured at most ATTENTION_PROBE_POSITIONS long: the kernel's blocks are the same past them, and the run's own
    length (a 100,000-position run's forward and backward took minutes a call) would cost more than the run."""
    settings = {"heads": heads, "seq_len": min(seq_len, ATTENTION_PROBE_POSITIONS), "head_dim": head_dim,
                "micro_batch": micro_batch, "dtype": str(dtype), "threads": n_threads}
    return cached("attention", settings, lambda: _measure_attention(settings, dtype, n_threads),
                  timed_threads=n_threads)["float32_faster"]


def _measure_attention(settings: dict, dtype: torch.dtype, n_threads: int) -> dict:
    shape = (settings["micro_batch"], settings["heads"], settings["seq_len"], settings["head_dim"])
    times = {}
    with threads(n_threads):
        for name, dt in (("float32", torch.float32), ("16-bit", dtype)):
            q, k, v = (torch.randn(shape, dtype=dt, requires_grad=True) for _ in range(3))

            def step():
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                out.backward(torch.ones_like(out))
            times[name] = seconds_per_call(step, seconds=0.1)
    return {"float32_s": times["float32"], "16bit_s": times["16-bit"], "float32_faster": times["float32"] < times["16-bit"]}
