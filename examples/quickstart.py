"""Train a small classifier with TensorFlow-exact optimizers, the torch way and the TF way.

Run: python examples/quickstart.py
"""

from __future__ import annotations

import torch

import gradfleet as gf


def make_data(n: int = 512, features: int = 20, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    true_w = torch.randn(features, 1, generator=g)
    y = (x @ true_w > 0).float()
    return x, y


def train(config: dict, steps: int = 200) -> float:
    torch.manual_seed(0)
    x, y = make_data()
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = gf.create_optimizer(model.parameters(), config)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        return ((model(x) > 0).float() == y).float().mean().item()


def main() -> None:
    for config in (
        {"class": "adam", "learning_rate": 0.01},
        {"class": "momentum", "learning_rate": 0.1, "momentum": 0.9, "use_nesterov": True},
        {"class": "gradientdescent", "learning_rate": 0.5},
    ):
        print(f"{config['class']:>16}: train accuracy {train(config):.3f}")

    # The TF1 API: minimize() with a global step, as in a ported TF graph.
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = gf.AdamOptimizer([w], learning_rate=0.1)
    global_step = torch.zeros((), dtype=torch.int64)
    for _ in range(3):
        opt.minimize(lambda: (w**2).sum(), global_step=global_step)
    print(f"TF-style minimize: w={w.tolist()}, global_step={int(global_step)}")


if __name__ == "__main__":
    main()
