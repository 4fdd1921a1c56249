"""LeNet-5's training step as one static-shape program (`--cuda-graph`): the batch gathered on the device from the
in-memory split by the epoch's indices, its shifts, forward, loss, backward and AdamW, with no host work inside and no
shape that changes, so that on a GPU it is captured once as a CUDA graph and each step is one replay instead of ~60
kernel launches. The eager step (fabric_lenet.train_step) is its reference and it keeps that step's arithmetic:
- the same samples: the epoch's order (fabric_lenet.epoch_order) as a table of full batches, the short last batch
  padded with samples of weight zero (one graph for every step; the loss is the mean over the real samples);
- the same shifts: drawn for the whole epoch ahead, per step from the seeds the eager step's batches use, and
  gathered with the batch from the split's windows (datasets_local.windows), then prepared as the eager in-memory
  path prepares them (fabric_lenet: the uint8 pixels normalized);
- the same schedule: torch's scheduler steps on the host as before, and its learning rate and AdamW's beta1 (which
  OneCycleLR cycles) are written into two device scalars that the captured AdamW reads (graph_adamw.py: torch's
  capturable AdamW reads a tensor beta1 to the host, which a capture refuses).
On a CPU the same program runs uncaptured: what the tests compare with the eager step. tests/test_capture.py runs it
on fake CUDA tensors, where any read of a device value to the host fails with the line that read it."""

import warnings

import torch
import torch.nn.functional as F

from core.lenet import graph_adamw

CAPTURED = "the whole step captured as one CUDA graph and replayed"
WARM_UP = 3  # eager steps before the capture (PyTorch's whole-network example): lazy set-up stays out of the graph


class WholeStep:
    """Call it once per optimizer step; `epoch()` first loads an epoch's tables. Returns the step's loss (a device
    tensor of its own, not yet read). `train_windows`: the split as fabric_lenet.memory_windows (its pixels' windows,
    its labels);
    `draw(step, n)`: a step's shifts of its n images, (rows, columns) on the device; None: no shifts (every image
    through its centre window). `prepare(images)`: the gathered windows as the model takes them (fabric_lenet's
    datasets_local.normalize of the pixels, which adds the channel)."""

    def __init__(self, fabric, cfg, model, optimizer, scheduler, train_windows, local_batch: int, epoch_steps: int,
                 draw, prepare):
        self.fabric, self.cfg, self.model, self.optimizer, self.scheduler = fabric, cfg, model, optimizer, scheduler
        self.draw, self.prepare = draw, prepare
        self.x, self.y = train_windows
        device = fabric.device
        self.captures = device.type == "cuda"
        self.at = torch.zeros(1, dtype=torch.long, device=device)  # the step within the epoch: the step advances it
        # one device: every epoch is the whole split, so each step's count of samples is the same every epoch
        self.step_samples = [min(local_batch, len(self.x) - s * local_batch) for s in range(epoch_steps)]
        self.indices = torch.zeros((epoch_steps, local_batch), dtype=torch.long, device=device)  # loaded per epoch
        self.weights = (torch.arange(local_batch) < torch.tensor(self.step_samples)[:, None]).float().to(device)
        self.counts = torch.tensor(self.step_samples, dtype=torch.float32, device=device)  # the loss's divisors
        # where no shifts are drawn, each image through the window that holds it unshifted
        self.offsets = torch.full((epoch_steps, 2, local_batch), centre(self.x), dtype=torch.long, device=device)
        self.lr, self.beta1 = (torch.zeros((), device=device) for _ in range(2))  # float32, as the scheduler's numbers
        self.graph, self.graph_loss, self.steps_run = None, None, 0
        # AdamW's state made here, before any capture (inside one it would live in the graph's pool), or a resumed
        # checkpoint's step counts moved to the device: the run loads its checkpoint before this step is built
        graph_adamw.init_state(optimizer)

    def described(self) -> str:
        if self.graph is not None:
            return CAPTURED
        if not self.captures:
            return (f"not captured: CUDA graphs record CUDA kernels and this run is on {self.x.device.type}; the same "
                    "static step ran uncaptured")
        return f"not captured: {self.steps_run} step(s) ran, the {WARM_UP} eager ones before the capture"

    def epoch(self, order: torch.Tensor, start: int, first_step: int):
        """Load an epoch's tables (`order`: this rank's indices for it; `first_step`: the global step of its step 0)
        and yield, per step from `start` on, (samples, None): what the training loop counts; the data is here."""
        steps, batch = self.indices.shape
        counts = self.step_samples
        padded = torch.zeros(steps * batch, dtype=torch.long)
        padded[:len(order)] = order
        self.indices.copy_(padded.view(steps, batch))
        if self.draw:
            for s in range(start, steps):  # the eager step's draw, per step from its seed
                self.offsets[s, :, :counts[s]] = self.draw(first_step + s, counts[s])
        self.at.fill_(start)
        for s in range(start, steps):
            yield counts[s], None

    def __call__(self) -> torch.Tensor:
        group = self.optimizer.param_groups[0]  # the scheduler's values for this step, into the graph's scalars
        self.lr.fill_(group["lr"])
        self.beta1.fill_(group["betas"][0])
        loss = self.step()
        with warnings.catch_warnings():  # graph_adamw stepped the optimizer, not its step(), which the scheduler watches
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
            self.scheduler.step()  # on the host, as in the eager step
        return loss

    def step(self) -> torch.Tensor:
        if self.graph is not None:
            self.graph.replay()
            return self.graph_loss.clone()
        if not self.captures:
            return self.eager()
        if self.steps_run < WARM_UP:
            return self.on_side_stream(self.eager)
        self.optimizer.zero_grad(set_to_none=True)  # the backward in the graph allocates the gradients from its pool
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.graph_loss = self.program()
        self.graph.replay()  # a capture records the step; this runs it
        return self.graph_loss.clone()

    def eager(self) -> torch.Tensor:
        loss = self.program()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_run += 1
        return loss

    def on_side_stream(self, step):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            loss = step()
        torch.cuda.current_stream().wait_stream(stream)
        return loss

    def program(self) -> torch.Tensor:
        """One step, every shape fixed and every index read on the device."""
        cfg, at = self.cfg, self.at
        idx = self.indices.index_select(0, at).view(-1)
        oy, ox = self.offsets.index_select(0, at).view(2, -1)
        xb, yb = self.prepare(self.x[idx, oy, ox]), self.y.index_select(0, idx)  # the batch and its shifts: one gather
        if cfg.channels_last:
            xb = xb.contiguous(memory_format=torch.channels_last)
        per_sample = F.cross_entropy(self.model(xb), yb, label_smoothing=cfg.label_smoothing, reduction="none")
        weights = self.weights.index_select(0, at).view(-1)
        loss = (per_sample * weights).sum() / self.counts.index_select(0, at).view(())
        self.fabric.backward(loss)
        graph_adamw.step(self.optimizer, self.lr, self.beta1)
        at.add_(1)
        return loss.detach()


def centre(windows: torch.Tensor) -> int:
    """The window of datasets_local.windows (n, rows, columns, h, w) that holds each image unshifted: the shift
    fabric_lenet's eager batches and this step take where none is drawn."""
    return (windows.shape[1] - 1) // 2


def shift_seed(cfg, step: int, fabric) -> int:
    """The seed of a step's shifts: one per step and rank (fabric_lenet.step_shifts draws with it)."""
    return cfg.seed * 1_000_003 + step * fabric.world_size + fabric.global_rank
