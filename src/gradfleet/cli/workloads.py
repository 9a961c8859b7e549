"""Built-in training workloads: generated data with a known answer, a model, a loss, a metric.

Both workloads generate their data from a seed inside the package, so nothing is downloaded:

* ``digits`` -- 8x8 images of the ten digits drawn from a 3x5 pixel font, shifted, blurred by
  stroke dropout and Gaussian noise; a 64-128-10 MLP (dense gradients).
* ``ctr`` -- click-through-style logistic regression over 8 categorical fields hashed into
  2**14 buckets, labels drawn from a sparse ground-truth logistic model; an
  ``nn.EmbeddingBag(sparse=True)`` so FTRL / AdagradDA / sparse Adam see sparse gradients.

A user's own workload is a Python file defining ``workload(seed) -> Workload`` (or another
function named as ``file.py:function``).
"""

from __future__ import annotations

import dataclasses
import difflib
import runpy
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "Workload",
    "WORKLOADS",
    "check_workload",
    "load_workload",
    "batch_indices",
    "workload_to",
]


@dataclass
class Workload:
    """Everything a worker needs: the model, train/test tensors, loss and prediction rule.

    ``predict`` maps model outputs to class labels comparable with the targets; ``target``
    is the test accuracy the default settings reach (documentation, checked by the tests).
    """

    name: str
    description: str
    model: nn.Module
    train: tuple[torch.Tensor, torch.Tensor]
    test: tuple[torch.Tensor, torch.Tensor]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    predict: Callable[[torch.Tensor], torch.Tensor]
    batch_size: int = 64
    optimizer: dict[str, Any] = field(default_factory=lambda: {"class": "adam"})
    steps: int = 300
    target: float | None = None


def workload_to(workload: Workload, device: torch.device) -> Workload:
    """``workload`` with its model (moved in place) and its data on ``device``."""
    workload.model.to(device)

    def move(pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return (pair[0].to(device), pair[1].to(device))

    return dataclasses.replace(workload, train=move(workload.train), test=move(workload.test))


def batch_indices(n: int, batch_size: int, seed: int, rank: int, step: int) -> torch.Tensor:
    """Indices of the batch of ``rank`` at ``step``: a pure function of its arguments, so a
    resumed run draws exactly the batches the uninterrupted run would have drawn."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + rank * 10_007 + step) % 2**63)
    return torch.randint(0, n, (batch_size,), generator=g)


# ----------------------------------------------------------------------------- digits
# A 3x5 pixel font, one string per row; '#' is ink.
_FONT = {
    0: ["###", "#.#", "#.#", "#.#", "###"],
    1: [".#.", "##.", ".#.", ".#.", "###"],
    2: ["###", "..#", "###", "#..", "###"],
    3: ["###", "..#", ".##", "..#", "###"],
    4: ["#.#", "#.#", "###", "..#", "..#"],
    5: ["###", "#..", "###", "..#", "###"],
    6: ["###", "#..", "###", "#.#", "###"],
    7: ["###", "..#", ".#.", ".#.", ".#."],
    8: ["###", "#.#", "###", "#.#", "###"],
    9: ["###", "#.#", "###", "..#", "###"],
}


def _glyphs() -> torch.Tensor:
    """[10, 5, 3] ink masks of the font."""
    return torch.tensor(
        [[[c == "#" for c in row] for row in _FONT[d]] for d in range(10)], dtype=torch.float32
    )


def digit_images(
    n: int, g: torch.Generator, noise: float = 0.25
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` noisy 8x8 digit images (flattened to 64) and their labels."""
    labels = torch.randint(0, 10, (n,), generator=g)
    glyphs = _glyphs()[labels]
    # Scale the 3x5 glyph to 6x5 (double width) so strokes are 2 pixels wide.
    glyphs = glyphs.repeat_interleave(2, dim=2)
    keep = (torch.rand(glyphs.shape, generator=g) > 0.05).float()
    ink = glyphs * keep * (0.8 + 0.2 * torch.rand(n, 1, 1, generator=g))
    # One-pixel jitter: enough to need a learned (not memorised) rule, too little to make two
    # glyphs coincide.
    images = torch.zeros(n, 8, 8)
    dy = torch.randint(0, 2, (n,), generator=g)
    for i in range(n):
        y = 1 + int(dy[i])
        images[i, y : y + 5, 1:7] = ink[i]
    images += noise * torch.randn(images.shape, generator=g)
    return images.reshape(n, 64), labels


def digits(seed: int = 0) -> Workload:
    g = torch.Generator().manual_seed(10_000 + seed)
    train = digit_images(6000, g)
    test = digit_images(2000, g)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    return Workload(
        name="digits",
        description="MLP 64-128-10 on generated noisy 8x8 digits (6000 train / 2000 test)",
        model=model,
        train=train,
        test=test,
        loss_fn=nn.functional.cross_entropy,
        predict=lambda out: out.argmax(dim=1),
        batch_size=64,
        optimizer={"class": "adam", "learning_rate": 0.01},
        steps=300,
        target=0.9,
    )


# ----------------------------------------------------------------------------- ctr
_CARDINALITIES = (1000, 500, 200, 100, 50, 20, 10, 4)
_BUCKETS = 2**14


class HashedLogistic(nn.Module):
    """Logistic regression over hashed categorical features: one weight per bucket."""

    def __init__(self, buckets: int) -> None:
        super().__init__()
        self.weights = nn.EmbeddingBag(buckets, 1, mode="sum", sparse=True)
        nn.init.zeros_(self.weights.weight)
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weights(ids).squeeze(1) + self.bias


def _hash_ids(values: torch.Tensor) -> torch.Tensor:
    """Field-salted multiplicative hash of ``values`` [n, fields] into the bucket range."""
    salt = torch.arange(values.shape[1], dtype=torch.int64) * 1_000_003
    return ((values + salt) * 2_654_435_761 % 2**32) % _BUCKETS


def ctr_data(n: int, g: torch.Generator, truth: list[torch.Tensor], bias: float):
    """``n`` impressions: hashed ids [n, 8] and click labels from the true logistic model."""
    cols, logit = [], torch.full((n,), bias)
    for card, w in zip(_CARDINALITIES, truth):
        # Zipf-like popularity: a few values are frequent, the long tail is rare.
        probs = 1.0 / torch.arange(1, card + 1, dtype=torch.float64) ** 1.1
        v = torch.multinomial(probs, n, replacement=True, generator=g)
        cols.append(v)
        logit += w[v]
    clicks = (torch.rand(n, generator=g) < torch.sigmoid(logit)).float()
    return _hash_ids(torch.stack(cols, dim=1)), clicks, logit


def ctr(seed: int = 0) -> Workload:
    g = torch.Generator().manual_seed(20_000 + seed)
    # Sparse ground truth: most feature values carry no signal, which is where L1 (FTRL) helps.
    truth = [
        torch.randn(c, generator=g) * 1.5 * (torch.rand(c, generator=g) < 0.3)
        for c in _CARDINALITIES
    ]
    x_train, y_train, _ = ctr_data(20_000, g, truth, bias=-1.0)
    x_test, y_test, logit_test = ctr_data(5_000, g, truth, bias=-1.0)
    bayes = ((logit_test > 0).float() == y_test).float().mean().item()
    torch.manual_seed(seed)
    return Workload(
        name="ctr",
        description=(
            f"hashed logistic regression, 8 fields -> {_BUCKETS} buckets, sparse EmbeddingBag "
            f"(20000 train / 5000 test; the true model scores {bayes:.3f})"
        ),
        model=HashedLogistic(_BUCKETS),
        train=(x_train, y_train),
        test=(x_test, y_test),
        loss_fn=nn.functional.binary_cross_entropy_with_logits,
        predict=lambda out: (out > 0).float(),
        batch_size=128,
        optimizer={"class": "ftrl", "learning_rate": 0.5, "l1_regularization_strength": 0.001},
        steps=300,
        target=round(bayes - 0.05, 2),
    )


WORKLOADS: dict[str, Callable[[int], Workload]] = {"digits": digits, "ctr": ctr}


def check_workload(spec: str) -> None:
    """A ``ValueError`` unless ``spec`` names a built-in workload or an existing ``file.py``:
    what can be known without building it."""
    if spec in WORKLOADS:
        return
    path = spec.partition(":")[0]
    if not path.endswith(".py"):
        close = difflib.get_close_matches(spec, WORKLOADS, n=1)
        meant = f"did you mean {close[0]}? " if close else ""
        raise ValueError(
            f"unknown workload {spec!r}; {meant}use one of {', '.join(WORKLOADS)} or a "
            "file.py[:function]"
        )
    if not Path(path).is_file():
        raise ValueError(f"workload file {path!r} does not exist")


def load_workload(spec: str, seed: int) -> Workload:
    """A built-in name, ``file.py`` (function ``workload``) or ``file.py:function``."""
    check_workload(spec)
    if spec in WORKLOADS:
        return WORKLOADS[spec](seed)
    path, _, func = spec.partition(":")
    namespace = runpy.run_path(path, run_name="__gradfleet_workload__")
    factory = namespace.get(func or "workload")
    if not callable(factory):
        raise ValueError(f"{path} defines no function {func or 'workload'!r}(seed) -> Workload")
    result = factory(seed)
    if not isinstance(result, Workload):
        raise ValueError(f"{spec} returned {type(result).__name__}, expected a Workload")
    return result
