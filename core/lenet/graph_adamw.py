"""AdamW's step with its learning rate and beta1 read from device scalars, for a step captured as a CUDA graph.

torch.optim.AdamW cannot be that step when OneCycleLR cycles beta1: its capturable foreach path hands `1 - beta1` to
`torch._foreach_lerp_` and `beta1` to `torch._foreach_pow`, whose overloads take a host number, so a tensor beta1
is read to the host (torch 2.14, torch/optim/adam.py) and a capturing stream refuses the read; a float beta1 would be
baked into the graph at capture and never cycle. Here every hyperparameter that changes per step is a 0-dim tensor
on the device, combined by foreach ops that take such a tensor (`.Tensor` overloads), so one graph replays every step.
The state is torch's (`step`, `exp_avg`, `exp_avg_sq` per parameter, the step a float32 tensor on the device as fused
AdamW keeps it), so a checkpoint resumes under torch's AdamW and torch's under this. The arithmetic is torch's
decoupled AdamW (tests/test_lenet.py holds it against torch.optim.AdamW with beta1 cycled per step)."""

import torch


def init_state(optimizer: torch.optim.Optimizer) -> None:
    """Each parameter's state as torch's AdamW makes it on its first step, made before a capture (allocating it inside
    would put it in the graph's private pool); a step count restored on the host moves to the device."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif state["step"].device != p.device:
                state["step"] = state["step"].to(p.device, torch.float32)


@torch.no_grad()
def step(optimizer: torch.optim.Optimizer, lr: torch.Tensor, beta1: torch.Tensor) -> None:
    """One AdamW step of every group, `lr` and `beta1` (float32 device scalars) standing for the groups' numbers; beta2,
    eps and the weight decay are the groups' own (constant over a run). No value is read to the host."""
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        states = [optimizer.state[p] for p in params]
        grads = [p.grad for p in params]
        exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        steps = [s["step"] for s in states]
        beta2, eps, decay = group["betas"][1], group["eps"], group["weight_decay"]
        torch._foreach_add_(steps, 1)
        t = steps[0]  # every parameter of a group steps together
        if decay:
            torch._foreach_mul_(params, (1 - lr * decay).to(params[0].dtype))
        # m = beta1 m + (1 - beta1) g, v = beta2 v + (1 - beta2) g^2
        torch._foreach_mul_(exp_avgs, beta1.to(params[0].dtype))
        torch._foreach_add_(exp_avgs, torch._foreach_mul(grads, (1 - beta1).to(params[0].dtype)))
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        # p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps), torch's bias corrections at today's beta1
        step_size = lr / (1 - beta1 ** t)
        denominators = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denominators, torch.sqrt(1 - beta2 ** t).to(params[0].dtype))
        torch._foreach_add_(denominators, eps)
        updates = torch._foreach_div(exp_avgs, denominators)
        torch._foreach_mul_(updates, (-step_size).to(params[0].dtype))
        torch._foreach_add_(params, updates)
