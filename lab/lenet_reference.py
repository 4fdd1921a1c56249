"""LeNet-5 on MNIST as one plain preloaded PyTorch loop: the reference `lab.bench lenet` races fabric_lenet.py's
default run against (issue 77). What a reader would write from PyTorch's MNIST example with the data held in memory:
the same LeNet-5 (conv-ReLU-pool twice, 120-84-10), AdamW, one-cycle, batch 256, no augmentation, the epoch's
batches sliced from one shuffled index, NCHW tensors, nothing fused, compiled or padded.

    python -m lab.lenet_reference [--precision 32-true|bf16-mixed] [--epochs 16] [--out record.json]

It reads the IDX files through datasets_local (the same verified MNIST, $MNIST_MIRROR offline) and writes its
training samples/s (the steps alone, as fabric_lenet.py counts them) and test accuracy.
"""

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import datasets_local


class LeNet5(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 6, 5, padding=2), nn.Conv2d(6, 16, 5)
        self.fc1, self.fc2, self.fc3 = nn.Linear(16 * 5 * 5, 120), nn.Linear(120, 84), nn.Linear(84, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def train(args) -> dict:
    torch.manual_seed(args.seed)
    train_set = datasets_local.MNIST(args.data_dir, train=True, download=True)
    test_set = datasets_local.MNIST(args.data_dir, train=False, download=True)
    (x, y), (xt, yt) = train_set.tensors(), test_set.tensors()
    if args.train_samples:
        x, y = x[:args.train_samples], y[:args.train_samples]
    model = LeNet5()
    steps = args.epochs * -(-len(y) // args.batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=5e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=steps)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16-mixed")
    seconds = 0.0
    for epoch in range(args.epochs):
        order = torch.randperm(len(y))
        started = time.perf_counter()
        for i in range(0, len(y), args.batch_size):
            idx = order[i:i + args.batch_size]
            with autocast:
                loss = F.cross_entropy(model(x[idx]), y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
        seconds += time.perf_counter() - started
    model.eval()
    with torch.no_grad(), autocast:
        correct = sum(int((model(xt[i:i + 1000]).argmax(1) == yt[i:i + 1000]).sum()) for i in range(0, len(yt), 1000))
    return {"samples_per_s": args.epochs * len(y) / seconds, "train_time_s": seconds, "test_acc": correct / len(yt),
            "precision": args.precision, "batch_size": args.batch_size, "epochs": args.epochs, "seed": args.seed}


def build_parser() -> argparse.ArgumentParser:
    from core.run.flags import Folder, OutFile, Parser, choice, number

    parser = Parser(description=__doc__, prog="python -m lab.lenet_reference")
    parser.add_argument("--precision", default="32-true", type=choice(("32-true", "bf16-mixed")),
                        help="float32, or bf16 autocast (default: 32-true)")
    parser.add_argument("--epochs", default=16, type=number(int, min=1, max=1000), help="default: 16")
    parser.add_argument("--batch-size", default=256, type=number(int, min=1, max=60000), help="default: 256")
    parser.add_argument("--lr", default=8e-3, type=number(float, above=0), help="peak of the one-cycle (default: 8e-3)")
    parser.add_argument("--seed", default=0, type=number(int, min=0), help="default: 0")
    parser.add_argument("--train-samples", default=0, type=number(int, min=1, max=60000, zero=True),
                        help="the first N training images (0: all 60,000)")
    parser.add_argument("--data-dir", default="data/mnist", type=Folder(), help="default: data/mnist")
    parser.add_argument("--out", default="", type=OutFile(optional=True), help="write the record as JSON here")
    return parser


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    result = train(args)
    print(f"test acc {100 * result['test_acc']:.2f}%, {result['train_time_s']:.1f} s of training, "
          f"{result['samples_per_s']:,.0f} samples/s ({args.precision}, batch {args.batch_size}, {args.epochs} epochs)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
