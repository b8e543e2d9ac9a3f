"""A small CNN that recognises digits: the judge of generated samples.

It trains on the same split as the diffusion model and is scored on the held-out digits, which
neither model saw. Its 64-wide penultimate layer gives the features of the Frechet distance
(an FID for this domain). Any side is resized to 16x16 first, so it judges 8x8, 16x16 and
32x32 samples alike.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tokpipe_compiler.digits import data
from tokpipe_compiler.digits.model import WEIGHTS

CLASSIFIER = WEIGHTS / "classifier.safetensors"
INPUT_SIDE = 16


class DigitClassifier(nn.Module):
    """Images in [-1, 1] of any side -> (logits [N, 10], features [N, 64])."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.features = nn.Sequential(nn.Flatten(), nn.Linear(64 * 4 * 4, 64), nn.ReLU())
        self.head = nn.Linear(64, 10)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if images.shape[-1] != INPUT_SIDE:
            images = F.interpolate(images, size=(INPUT_SIDE, INPUT_SIDE), mode="bilinear",
                                   align_corners=False, antialias=True)
        feats = self.features(self.convs(images))
        return self.head(feats), feats


def train_classifier(seed: int = 0, epochs: int = 20) -> DigitClassifier:
    """Trained on the 'train' split at 16x16, shifted by up to one pixel for robustness."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    images, labels = data.split("train")
    pixels = data.at_side(images, INPUT_SIDE)
    model = DigitClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    for _ in range(epochs):
        order = torch.randperm(len(labels), generator=gen)
        for i in range(0, len(order), 64):
            index = order[i: i + 64]
            dx, dy = (int(v) for v in torch.randint(-1, 2, (2,), generator=gen))
            batch = torch.roll(pixels[index], shifts=(dy, dx), dims=(2, 3))
            loss = F.cross_entropy(model(batch)[0], labels[index])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()


def save_classifier(model: DigitClassifier, path: Path = CLASSIFIER) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))


def load_classifier(path: Path = CLASSIFIER) -> DigitClassifier:
    """The shipped classifier, in eval mode."""
    from safetensors.torch import load_file

    model = DigitClassifier()
    model.load_state_dict(load_file(str(path)))
    return model.eval()


@torch.no_grad()
def classify(model: DigitClassifier, images: torch.Tensor,
             batch: int = 500) -> tuple[torch.Tensor, torch.Tensor]:
    """(predicted labels [N], features [N, 64]) of images in [-1, 1]."""
    preds, feats = [], []
    for i in range(0, len(images), batch):
        logits, f = model(images[i: i + batch].clamp(-1, 1))
        preds.append(logits.argmax(1))
        feats.append(f)
    return torch.cat(preds), torch.cat(feats)


def held_out_accuracy(model: DigitClassifier, side: int = 32) -> float:
    """Accuracy on the held-out real digits, upsampled to `side`."""
    images, labels = data.split("held_out")
    preds, _ = classify(model, data.at_side(images, side))
    return (preds == labels).float().mean().item()


if __name__ == "__main__":  # python -m tokpipe_compiler.digits.classifier: retrain, save
    torch.set_num_threads(1)
    clf = train_classifier()
    save_classifier(clf)
    print({side: round(held_out_accuracy(clf, side), 4) for side in (8, 16, 32)})
