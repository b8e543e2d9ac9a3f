"""The pipelines ring mode takes, and the call options that keep a generation per call.

A family needs no code: its loop is observed (see `glue`). An entry only names the
options of its `__call__` under which the step stops being token-wise or stops being the
same every step, with the value that keeps it so (or a test of the value, where several
do), the option's default counted where the call does not pass it.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from tokpipe_compiler.core.autocast import autocast_state, describe
from tokpipe_compiler.pipelines.guiders import guider_reasons

RING_PIPELINES: dict[str, dict[str, Any]] = {
    "DiTPipeline": {},
    "PixArtAlphaPipeline": {},
    "PixArtSigmaPipeline": {},
    "StableDiffusion3Pipeline": {"skip_guidance_layers": None},
    "StableDiffusion3Img2ImgPipeline": {},
    "StableDiffusion3InpaintPipeline": {},
    "FluxPipeline": {},
    "FluxImg2ImgPipeline": {},
    "FluxKontextPipeline": {},
    "FluxFillPipeline": {},
    "FluxInpaintPipeline": {},
    "FluxControlPipeline": {},
    "FluxControlImg2ImgPipeline": {},
    "Flux2Pipeline": {},
    "Flux2KleinPipeline": {},
    "HunyuanDiTPipeline": {"guidance_rescale": 0.0},
    "CogVideoXPipeline": {"use_dynamic_cfg": False},
    "CogVideoXImageToVideoPipeline": {"use_dynamic_cfg": False},
    "CogVideoXVideoToVideoPipeline": {"use_dynamic_cfg": False},
    "LattePipeline": {},
    "WanPipeline": {},
    "WanVideoToVideoPipeline": {},
    "WanImageToVideoPipeline": {},
    "LTXPipeline": {"guidance_rescale": 0.0},
    "AuraFlowPipeline": {},
    "SanaPipeline": {},
    "SanaVideoPipeline": {},
    "SkyReelsV2Pipeline": {},
    "OvisImagePipeline": {},
    "HunyuanImagePipeline": {},
    "EasyAnimatePipeline": {"guidance_rescale": 0.0},
    "CogView3PlusPipeline": {},
    "Krea2Pipeline": {},
    "PRXPipeline": {},
    "AllegroPipeline": {},
    "Kandinsky5T2VPipeline": {},
    "BriaPipeline": {},
    "QwenImageEditPlusPipeline": {},
    "WanVACEPipeline": {},
    "ChronoEditPipeline": {"num_temporal_reasoning_steps": 0},
    "MotifVideoPipeline": {},
    "HeliosPipeline": {},
    "ErnieImagePipeline": {},
    "HiDreamImagePipeline": {},
    "Kandinsky5T2IPipeline": {},
    "NucleusMoEImagePipeline": {},
    "LongCatImagePipeline": {"cfg_renorm_min": 0.0},
    "ZImagePipeline": {"cfg_normalization": lambda norm: not norm,
                       "cfg_truncation": lambda ratio: ratio is None or float(ratio) >= 1},
    "WanModularPipeline": {},
    "Wan22ModularPipeline": {},
    "WanImage2VideoModularPipeline": {},
    "FluxModularPipeline": {},
    "FluxKontextModularPipeline": {},
    "Flux2ModularPipeline": {},
    "Flux2KleinModularPipeline": {},
    "Flux2KleinBaseModularPipeline": {},
    "Flux3ModularPipeline": {},
    "StableDiffusion3ModularPipeline": {},
    "QwenImageModularPipeline": {},
    "QwenImageEditModularPipeline": {},
    "QwenImageEditPlusModularPipeline": {},
    "LTXModularPipeline": {},
    "Krea2ModularPipeline": {},
    "ErnieImageModularPipeline": {},
    "ZImageModularPipeline": {},
    "ChromaPipeline": {},
    "ChromaImg2ImgPipeline": {},
    "CogView4Pipeline": {},
    "HunyuanVideoPipeline": {},
    "QwenImagePipeline": {},
    "QwenImageEditPipeline": {},
    "QwenImageImg2ImgPipeline": {},
    "QwenImageInpaintPipeline": {},
    # perturbed-attention guidance: the same steps with a third, perturbed part of the batch
    "PixArtSigmaPAGPipeline": {"pag_adaptive_scale": 0.0},
    "StableDiffusion3PAGPipeline": {"pag_adaptive_scale": 0.0},
    "StableDiffusion3PAGImg2ImgPipeline": {"pag_adaptive_scale": 0.0},
    "HunyuanDiTPAGPipeline": {"guidance_rescale": 0.0, "pag_adaptive_scale": 0.0},
    "SanaPAGPipeline": {"pag_adaptive_scale": 0.0},
}

WHY = {
    "skip_guidance_layers": "skip-layer guidance adds a third transformer call on some "
                            "steps only",
    "guidance_rescale": "guidance rescaling takes statistics over all tokens",
    "use_dynamic_cfg": "dynamic guidance changes the guidance scale every step",
    "pag_adaptive_scale": "adaptive perturbed-attention guidance changes its scale every "
                          "step",
    "cfg_normalization": "guidance normalisation clamps the guided prediction's norm over "
                         "the whole image",
    "cfg_truncation": "guidance truncation turns the guidance off partway through the "
                      "generation",
    "cfg_renorm_min": "a renormalisation floor above 0 clamps the guided prediction's scale "
                      "per token from below, a form the ring does not replay",
    "num_temporal_reasoning_steps": "temporal reasoning keeps only the first and the last "
                                    "frame from that step on",
}


def call_reasons(pipe: Any, kwargs: dict[str, Any], denoisers: dict[str, Any]) -> list[str]:
    """Why this call of `pipe`, with these transformers as they are now, runs per call:
    the pipeline and its options, the transformers' caches and hooks, autocast."""
    hooks = {name: module_hooks(module) for name, module in denoisers.items()}
    return [*per_call_reasons(pipe, kwargs), *cache_reasons(denoisers, hooks),
            *hook_reasons(denoisers, hooks), *autocast_reasons()]


def per_call_reasons(pipe: Any, kwargs: dict[str, Any]) -> list[str]:
    """Why this call of `pipe` cannot run as a ring (empty: it can)."""
    name = type(pipe).__name__
    if getattr(pipe, "controlnet", None) is not None:
        return [f"{name} runs its ControlNet (pipe.controlnet) before the transformer at "
                "every step, on the step's latents: a second model a ring's step does not "
                "hold (the ControlNet runs whole on every rank)"]
    if name not in RING_PIPELINES:
        return [f"{name} is not in the ring table ({len(RING_PIPELINES)} pipelines are: "
                "tokpipe_compiler.pipelines.table.RING_PIPELINES lists them)"]
    reasons = []
    for option, neutral in RING_PIPELINES[name].items():
        value = kwargs[option] if option in kwargs else _default(pipe, option)
        if not (neutral(value) if callable(neutral) else value == neutral):
            reasons.append(f"{option}={value!r}: {WHY[option]}")
    return reasons + guider_reasons(pipe) + _callback_reasons(kwargs.get("callback_on_step_end"))


def _default(pipe: Any, option: str) -> Any:
    """The value `pipe.__call__` gives `option` when a call does not pass it."""
    parameter = inspect.signature(type(pipe).__call__).parameters.get(option)
    return None if parameter is None else parameter.default


def _callback_reasons(callback: Any) -> list[str]:
    """diffusers' own step-end callbacks (`diffusers.callbacks`: guidance and IP-adapter
    cutoffs) change the step at their cutoff, which a ring cannot follow; other callbacks
    run in the ring (`step_callbacks`)."""
    members = getattr(callback, "callbacks", [callback])  # MultiPipelineCallbacks
    changing = [type(c).__name__ for c in members
                if type(c).__module__ == "diffusers.callbacks"]
    if not changing:
        return []
    return [f"callback_on_step_end={', '.join(changing)}: diffusers' cutoff callbacks change "
            "the guidance or the embeddings partway through the generation"]


def autocast_reasons() -> list[str]:
    """Why a call under `torch.autocast` runs per call: a ring's step is traced and planned
    under one autocast state (its values', caches' and messages' dtypes) and would run the
    same under another; per call, Dynamo guards on it and traces each state apart."""
    state = autocast_state()
    if not state:
        return []
    return [f"the call runs under {describe(state)}, which a ring, traced once, would hold "
            "for every later call"]


def cache_reasons(denoisers: dict[str, Any], hooks: dict[str, list[str]]) -> list[str]:
    """Why a transformer with one of diffusers' step caches on (`enable_cache`, or its hooks
    applied directly: `apply_first_block_cache`, ...) runs per call: the cache decides each
    step, from whole tensors of earlier steps, which blocks to skip; the ring computes
    every step from the first step's form. `hooks`: each transformer's `module_hooks`."""
    reasons = []
    for name, module in denoisers.items():
        config = getattr(module, "_cache_config", None)
        caches = [h for h in hooks[name] if is_step_cache(h)]
        if getattr(module, "is_cache_enabled", False) or caches:
            cache = (type(config).__name__ if config is not None
                     else f"step cache ({', '.join(caches)})")
            reasons.append(f"{name} has diffusers' {cache} on, which decides each step from "
                           "earlier steps' whole tensors which blocks to skip")
    return reasons


def is_step_cache(hook: str) -> bool:
    """Whether a diffusers hook (as `module_hooks` names it) is one of its step caches'."""
    return hook.startswith("diffusers' ") and any(
        word in hook for word in ("cache", "fbc_", "pyramid_attention_broadcast"))


def hook_reasons(denoisers: dict[str, Any], hooks: dict[str, list[str]]) -> list[str]:
    """Why a transformer with hooks at its modules' calls runs per call: diffusers'
    layerwise casting and group offloading, accelerate's offloading (enable_model_cpu_offload,
    a device_map) cast or move the weights as each module runs, which a ring's step, traced
    once, would hold fixed (and its probe, run on fake tensors, would leave them fake).
    A step cache's hooks are cache_reasons'. torch hooks on the transformer itself run in
    its module call, which the ring's step does not make (it calls the forward)."""
    reasons = []
    for name, module in denoisers.items():
        own = own_hooks(module)
        if own:
            reasons.append(f"{name} has {own} of its own, which run around its call, and a "
                           "ring's step calls its forward")
        others = [h for h in hooks[name] if not is_step_cache(h)]
        if others:
            reasons.append(f"{name} runs hooks as its modules run ({', '.join(others)}), "
                           "which cast or move its weights at every call: per call, Dynamo "
                           "traces them, and breaks its graphs where they cannot be traced")
    return reasons


def own_hooks(module: torch.nn.Module) -> str:
    """torch forward hooks and pre-hooks on `module` itself or on every module, for a
    message ("" where none)."""
    from torch.nn.modules import module as torch_module

    found = [kind for kind, hooks in [
        ("forward hooks", {**module._forward_hooks, **torch_module._global_forward_hooks}),
        ("forward pre-hooks", {**module._forward_pre_hooks,
                               **torch_module._global_forward_pre_hooks})] if hooks]
    return " and ".join(found)


def module_hooks(module: Any) -> list[str]:
    """The diffusers hooks (by name) and accelerate hooks (by class) on `module`'s modules."""
    found: set[str] = set()
    for sub in module.modules():
        registry = getattr(sub, "_diffusers_hook", None)
        found |= {f"diffusers' {hook}" for hook in getattr(registry, "hooks", {})}
        accelerate = getattr(sub, "_hf_hook", None)
        if accelerate is not None:
            found.add(f"accelerate's {type(accelerate).__name__}")
    return sorted(found)
