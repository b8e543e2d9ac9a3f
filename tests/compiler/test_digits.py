"""The shipped digit model and its judge: the weights load, the digits they generate are
recognised, and the training script runs."""

from __future__ import annotations

import importlib.resources

import pytest
import torch

pytest.importorskip("sklearn")
pytest.importorskip("diffusers")

from tokpipe_compiler.digits import data
from tokpipe_compiler.digits.classifier import (
    classify,
    held_out_accuracy,
    load_classifier,
)
from tokpipe_compiler.digits.model import CONFIG, WEIGHTS, load, sample
from tokpipe_compiler.digits.train import main as train_main
from tokpipe_compiler.digits.train import parse_schedule


def test_the_weights_ship_inside_the_package_and_are_small():
    shipped = importlib.resources.files("tokpipe_compiler.digits") / "weights"
    for name in ("config.json", "scheduler_config.json", "diffusion_pytorch_model.safetensors",
                 "classifier.safetensors", "README.md"):
        assert (shipped / name).is_file(), name
    assert (WEIGHTS / "diffusion_pytorch_model.safetensors").stat().st_size < 20 * 2**20


def test_the_split_holds_out_a_fifth_of_the_digits():
    train, held = data.split("train"), data.split("held_out")
    assert len(train[1]) + len(held[1]) == 1797
    assert len(held[1]) == 360
    assert data.at_side(train[0][:2], 32).shape == (2, 1, 32, 32)


def test_the_classifier_reads_real_held_out_digits():
    assert held_out_accuracy(load_classifier(), side=32) > 0.9


def test_shipped_weights_generate_digits_the_classifier_recognises():
    torch.set_num_threads(1)
    model, scheduler = load()
    assert {k: model.config[k] for k in CONFIG} == CONFIG
    labels = torch.arange(10).repeat(2)
    images = sample(model, scheduler, labels, seeds=range(20), steps=10, side=8)
    assert images.shape == (20, 1, 8, 8) and torch.isfinite(images).all()
    preds, _ = classify(load_classifier(), images)
    assert (preds == labels).float().mean() >= 0.5  # chance is 0.1


def test_the_training_script_runs_a_few_steps(tmp_path, capsys):
    assert train_main(["--schedule", "8:4:2,16:2:1", "--out", str(tmp_path), "--no-card"]) == 0
    assert "trained 3 steps" in capsys.readouterr().out
    model, _ = load(tmp_path)
    assert model.config.num_layers == CONFIG["num_layers"]


def test_a_bad_schedule_is_refused():
    assert parse_schedule("8:64:10,32:8:5") == [(8, 64, 10), (32, 8, 5)]
    with pytest.raises(ValueError, match="side:batch:steps"):
        parse_schedule("8:64")
