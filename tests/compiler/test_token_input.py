"""Which input carries the tokens: found by the graph's structure (not by size), or named by
the forward's parameter however the argument was passed; a misspelt name is an error."""

from __future__ import annotations

import warnings

import pytest
import torch

import tokpipe_compiler as tp
from tests.compiler.test_joint import TinyJoint
from tests.fixtures.models import TinyDiT, dit_inputs
from tests.fixtures.tracing import assert_rel_close, trace
from tests.fixtures.zoo import ZOO, build
from tokpipe_compiler import released
from tokpipe_compiler.core.errors import NoTokenInput, TokpipeError
from tokpipe_compiler.core.fx import argument_of, is_user_input, node_shape
from tokpipe_compiler.passes.token_input import (
    find_token_input,
    is_conditioning,
    piece_token_input,
    seed_axes,
)
from tokpipe_compiler.planning.capture import capture


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch.compiler.reset()


def largest_input(gm: torch.fx.GraphModule) -> str | int | None:
    """What the old rule picked: the largest float user input of rank >= 3."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder" and is_user_input(n)
              and node_shape(n) is not None and len(node_shape(n)) >= 3]
    return argument_of(max(inputs, key=lambda n: node_shape(n).numel()))


SMALL = {"image": (16, 16), "packed": (16, 16), "video": (2, 16, 16),
         "frames_first": (2, 16, 16), "tokens": (2, 16, 16)}


@pytest.mark.parametrize("name", released.NAMES)
def test_released_widths_pick_the_latent_not_the_larger_text(name):
    """At released widths the text embedding is the largest input (PixArt 120 x 4096 against
    a 4 x 16 x 16 latent here); the latent is the input the output is made from."""
    grid = SMALL[released.family(name).layout]
    model = released.build(name, device="meta", grid=grid)  # only the graph is needed
    inputs = released.inputs(name, grid=grid, device="meta")
    (captured,) = capture(model, kwargs=inputs, fresh=True)
    if not name.startswith("dit-"):  # class-conditioned: no text
        assert largest_input(captured.gm) != "hidden_states"
    assert argument_of(find_token_input(captured.gm, None)) == "hidden_states"


def test_a_grid_the_patches_do_not_tile_names_the_latent_not_the_text():
    """SD3 crops a 15x15 latent to 7x7 patches: no input's shape matches the output's, and
    the larger text was taken for the tokens, silently; now the latent is, and the grid's
    rows are refused with what to do."""
    import diffusers

    torch.manual_seed(0)
    config = ZOO["SD3Transformer2DModel"].config
    model = diffusers.SD3Transformer2DModel(**{**config, "sample_size": 15,
                                               "pos_embed_max_size": 16}).eval()
    kwargs = {"hidden_states": torch.randn(1, 4, 15, 15),
              "encoder_hidden_states": torch.randn(1, 300, config["joint_attention_dim"]),
              "pooled_projections": torch.randn(1, config["pooled_projection_dim"]),
              "timestep": torch.tensor([700.0]), "return_dict": False}
    with pytest.raises(TokpipeError, match=r"hidden_states.* 15 rows .*pad the input"):
        tp.explain(model, (), kwargs, stages=2, chunks=2)


def test_joint_model_with_more_text_than_image_tokens_pipelines_the_image():
    torch.manual_seed(0)
    model = TinyJoint().eval()
    x, text = torch.randn(1, 12, 16), torch.randn(1, 40, 16) * 0.5
    traced = trace(model, x, text)
    assert largest_input(traced.gm) == "text"
    program = traced.program(mode="sync", stages=2, chunks=3)
    assert program.plan.token_input == traced.placeholder("x")
    with torch.no_grad():
        assert_rel_close(program(*traced.inputs)[0], model(x, text))


class MaskedAttention(torch.nn.Module):
    """Self-attention with an additive float mask [B, 1, L, L], larger than the tokens, and
    an output in no input's shape (OmniGen: text tokens lead the image's, cut off at the end
    before the unpatchify)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(8, 24), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(1, -1, 3, 2, 4).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        image = self.out(a.transpose(1, 2).reshape(1, -1, 8))[:, 8:]
        return image.reshape(1, 4, 4, 8).permute(0, 3, 1, 2)


def test_an_attention_mask_larger_than_the_tokens_is_not_the_token_input():
    x, mask = torch.randn(1, 24, 8), torch.zeros(1, 1, 24, 24)
    traced = trace(MaskedAttention().eval(), x, mask)
    assert largest_input(traced.gm) == "mask"
    assert find_token_input(traced.gm, None).name == traced.placeholder("x")


def test_keyword_passed_token_input_is_pipelined():
    """SD3's forward takes **kwargs (diffusers' decorator): Dynamo names the input
    l_kwargs_hidden_states_; token_input="hidden_states" still names it."""
    name = "SD3Transformer2DModel"
    model, inputs = build(name), ZOO[name].inputs(1)
    compiled = torch.compile(model, backend="tokpipe", dynamic=False, options={
        "token_input": "hidden_states", "compiler": "eager", "stages": 2, "chunks": 2,
        "mode": "sync"})
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # running unpipelined warns: it must not
        out = compiled(**inputs)[0]
        expected = model(**inputs)[0]
    (program,) = tp.programs(compiled)
    assert program.plan.token_input == "l_kwargs_hidden_states_"
    assert_rel_close(out, expected)


class Gathering(torch.nn.Module):
    """forward(*args): the token input is a position."""

    def __init__(self):
        super().__init__()
        self.dit = TinyDiT(depth=2, width=32, heads=2, grid=8)

    def forward(self, *args):
        return self.dit(*args)


def test_token_input_by_position_in_star_args():
    torch.manual_seed(0)
    model = Gathering().eval()
    plan = tp.explain(model, dit_inputs(model.dit, 8), token_input=0, mode="sync")
    assert plan.token_input == "l_args_0_"


def test_misspelt_token_input_raises_with_the_inputs():
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    with pytest.raises(TokpipeError, match=r"latent.*'latents', 'timestep', 'labels'") as err:
        tp.explain(model, dit_inputs(model, 8), token_input="latent")
    assert not isinstance(err.value, NoTokenInput)
    compiled = torch.compile(model, backend="tokpipe", dynamic=False,
                             options={"token_input": "latent", "compiler": "eager"})
    with pytest.raises(TokpipeError, match=r"latent.*'latents'") as err:
        compiled(*dit_inputs(model, 8))
    assert not isinstance(err.value, NoTokenInput)


@pytest.mark.parametrize("choice", ["labels", 2])
def test_a_token_input_without_a_token_axis_is_a_user_error(choice):
    """A label input (one value a sample) was taken for the tokens, and a token rule then
    crashed: "tokpipe internal error ... Please report it"."""
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    compiled = torch.compile(model, backend="tokpipe", dynamic=False,
                             options={"token_input": choice, "compiler": "eager"})
    with pytest.raises(TokpipeError, match=rf"token_input={choice!r} is a tensor of shape "
                                           r"\(1,\), which has no token axis"):
        compiled(*dit_inputs(model, 8))


class Broken(torch.nn.Module):
    """Two graphs: the text projection, then (after a graph break) the DiT."""

    def __init__(self):
        super().__init__()
        self.text = torch.nn.Linear(12, 32)
        self.dit = TinyDiT(depth=2, width=32, heads=2, grid=8)

    def forward(self, latents, timestep, labels, text):
        t = self.text(text).mean()
        torch._dynamo.graph_break()
        return self.dit(latents, timestep, labels) + t


def test_graph_without_the_named_input_runs_unpipelined_when_another_reads_it():
    torch.manual_seed(0)
    model = Broken().eval()
    args = (*dit_inputs(model.dit, 8), torch.randn(1, 5, 12))
    compiled = torch.compile(model, backend="tokpipe", dynamic=False, options={
        "token_input": "latents", "compiler": "eager", "mode": "sync", "chunks": 2})
    with torch.no_grad(), pytest.warns(UserWarning, match="unpipelined.*latents"):
        out = compiled(*args)
    (program,) = tp.programs(compiled)
    assert program.plan.token_input == "l_latents_"
    with torch.no_grad():
        assert_rel_close(out, model(*args))
    assert tp.explain(model, args, token_input="latents").token_input == "l_latents_"
    with pytest.raises(TokpipeError, match="names no input of this model"):
        tp.explain(model, args, token_input="latent")


@pytest.mark.parametrize(("shape", "axes"), [
    ((1, 4, 3, 8, 8), [2, 1]),  # frames, then the [B, F, C, H, W] layout's frames
    ((1, 4, 1, 8, 16), [3, 1]),  # an image as one frame (Z-Image): its rows
    ((1, 1, 4, 8, 16), [2, 3]),  # one frame first: rows stand in for the frames
    ((1, 16, 8), [1, 2]),
])
def test_a_video_of_one_frame_is_seeded_along_its_rows(shape, axes):
    node = torch.fx.Graph().placeholder("x")
    node.meta["example_value"] = torch.empty(shape)
    assert seed_axes(node) == axes


class RefineTextPatchifyVideo(torch.nn.Module):
    """A first piece as HunyuanVideo 1.5 has one: it refines the text by self-attention and
    returns it in the text's shape, and only patchifies the video (the blocks come later)."""

    def __init__(self):
        super().__init__()
        self.patchify = torch.nn.Conv3d(4, 16, kernel_size=(1, 2, 2), stride=(1, 2, 2))
        self.refine = torch.nn.Linear(12, 12)

    def forward(self, hidden_states, encoder_hidden_states):
        text = self.refine(encoder_hidden_states)[:, None]
        text = torch.nn.functional.scaled_dot_product_attention(text, text, text)[:, 0]
        return self.patchify(hidden_states).flatten(2).transpose(1, 2), text


def test_a_piece_takes_the_video_not_the_text_its_output_resembles():
    traced = trace(RefineTextPatchifyVideo(), torch.randn(1, 4, 2, 8, 8), torch.randn(1, 5, 12))
    by_shape = find_token_input(traced.gm, None)  # a whole model's output is its latent
    assert argument_of(by_shape) == "encoder_hidden_states" and is_conditioning(by_shape)
    piece = piece_token_input(traced.gm)
    assert argument_of(piece) == "hidden_states" and not is_conditioning(piece)


def test_a_resumed_frames_stack_values_keep_their_conditioning_names():
    """After a graph break inside a block (offloading hooks), Dynamo names the block's
    inputs from the resume function's stack: `l_stack0_1_encoder_hidden_states_`, with no
    argument name to read. The text stream is still told by its name."""
    graph = torch.fx.Graph()
    text = graph.placeholder("l_stack0_1_encoder_hidden_states_")
    image = graph.placeholder("l_stack0_1_hidden_states_")
    assert is_conditioning(text) and not is_conditioning(image)
