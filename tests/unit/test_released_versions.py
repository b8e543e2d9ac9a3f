"""A diffusers too old for the released models, or without a model's class, is named with
the way out: diffusers 0.32's pipelines crashed deep inside on the parts the released
pipelines leave out (`'NoneType' object has no attribute 'config'`), and a class it lacks
(Wan) gave an AttributeError that spoke of another class."""

import diffusers
import pytest

from tokpipe_compiler import released
from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.released import model_class


def test_an_older_diffusers_is_refused_naming_the_version_it_needs(monkeypatch):
    monkeypatch.setattr(diffusers, "__version__", "0.32.2")
    with pytest.raises(TokpipeError, match=r"need diffusers >= 0\.33 \(installed: 0\.32\.2\): "
                                           r"pip install -U diffusers"):
        model_class("pixart-sigma-xl-2-1024-ms")


def test_a_class_this_diffusers_lacks_is_named(monkeypatch):
    monkeypatch.setattr(released, "load", lambda name: {"class": "LaterTransformer3DModel"})
    with pytest.raises(TokpipeError, match=r"has no LaterTransformer3DModel, the model of "
                                           r"'wan2\.1-t2v-1\.3b'.*pip install -U diffusers"):
        model_class("wan2.1-t2v-1.3b")


def test_the_installed_diffusers_builds_each_released_class():
    assert model_class("pixart-sigma-xl-2-1024-ms") is diffusers.PixArtTransformer2DModel
