"""A small class-conditional DiT trained on scikit-learn's 8x8 digits, shipped with the
package so that the main job and the fidelity benchmark work on a model that has learned
something. `load()` returns it; `train` reproduces it; `classifier` and `metrics` score
what it generates."""

from tokpipe_compiler.digits.model import WEIGHTS, load, sample

__all__ = ["WEIGHTS", "load", "sample"]
