"""Causal language models from transformers, called as their users call them, in causal mode
(TeraPipe's prefill): token ids found as the token input by keyword or position (through
transformers' decorated forwards), the default K/V cache (whose first update concatenates
an empty 1-d tensor), GPT-2's Conv1D (addmm over [batch * tokens, width]), and a graph break
before the output head. Each equals eager within 1e-5 relative (float32), or is refused by
name.
"""

from __future__ import annotations

import pytest
import torch

import tokpipe_compiler as tp
from tokpipe_compiler.stage_programs.plan_reads import input_arguments

transformers = pytest.importorskip("transformers")

OPTIONS = {"stages": 2, "chunks": 4, "mode": "causal", "compiler": "eager"}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """transformers' decorators share their code objects between model classes: past
    Dynamo's recompile limit for them, a later test's model would run eagerly."""
    torch._dynamo.reset()


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=128, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(config).eval()


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128,
                                     n_positions=256, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


MODELS = {"llama": _llama, "gpt2": _gpt2}


def _ids(batch: int = 1, tokens: int = 48) -> torch.Tensor:
    return torch.randint(0, 128, (batch, tokens), generator=torch.Generator().manual_seed(1))


def _token_argument(plan) -> str | int | None:
    """The forward's argument the plan chunks (its placeholder's name depends on how
    transformers' decorators pass it on)."""
    return input_arguments(plan)[plan.graphs.input_names.index(plan.token_input)]


def _assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    error = ((got - expected).norm() / expected.norm()).item()
    assert error <= 1e-5, error


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("by", ["keyword", "position"])
def test_token_ids_are_found_and_the_prefill_equals_eager(name, by):
    """No token_input: ids were taken for no token sequence (run unpipelined with a
    warning); the default use_cache=True crashed the cat rule on the cache's empty start;
    GPT-2 was refused for its addmm."""
    model, ids = MODELS[name](), _ids(batch=2)
    compiled = torch.compile(model, backend="tokpipe", dynamic=False, options=OPTIONS)
    with torch.no_grad():
        got = compiled(input_ids=ids) if by == "keyword" else compiled(ids)
        expected = model(input_ids=ids)
    assert len(tp.programs(compiled)) == 1  # pipelined, not run as traced
    _assert_close(got.logits, expected.logits)
    got_cache, expected_cache = _cache_tensors(got), _cache_tensors(expected)
    assert len(got_cache) == len(expected_cache) == 2 * 2  # K and V of each layer
    for got_kv, expected_kv in zip(got_cache, expected_cache, strict=True):
        _assert_close(got_kv, expected_kv)


def _cache_tensors(output) -> list[torch.Tensor]:
    """The K and V tensors of each layer in the returned cache, in whichever form this
    transformers keeps them (a `DynamicCache`'s layers, its lists, or legacy tuples)."""
    cache = output.past_key_values
    if hasattr(cache, "layers"):
        return [t for layer in cache.layers for t in (layer.keys, layer.values)]
    if hasattr(cache, "key_cache"):
        return [t for kv in zip(cache.key_cache, cache.value_cache, strict=True) for t in kv]
    return [t for layer in cache for t in layer]


def test_a_named_token_input_passed_by_position_is_found():
    """`token_input="input_ids"` with `model(ids)`: transformers' forward is decorated as
    `wrapped(*args, **kwargs)`, so the ids came as args[1], and the name matched nothing."""
    model, ids = _llama(), _ids()
    compiled = torch.compile(model, backend="tokpipe", dynamic=False,
                             options={**OPTIONS, "token_input": "input_ids"})
    with torch.no_grad():
        got = compiled(ids, use_cache=False)
        _assert_close(got.logits, model(ids, use_cache=False).logits)
    (program,) = tp.programs(compiled)
    assert _token_argument(program.plan) == "input_ids"


def test_a_misspelt_token_input_raises_though_the_forward_takes_kwargs():
    """A name the whole model's graph does not read, where no graph break leaves another
    graph to read it, is misspelt: it only warned, as any name may pass through **kwargs."""
    model = _llama()
    compiled = torch.compile(model, backend="tokpipe", dynamic=False,
                             options={**OPTIONS, "token_input": "inputs_ids"})
    with torch.no_grad(), pytest.raises(tp.TokpipeError,
                                        match=r"token_input='inputs_ids' names no input of "
                                              r"the graph; its inputs are \['input_ids'\]"):
        compiled(input_ids=_ids(), use_cache=False)


def test_a_graph_after_a_break_that_does_not_read_the_named_input_runs_as_traced():
    """A fresh model's first call with output_hidden_states installs transformers' output
    hooks under a lock: Dynamo breaks the graph there, and the resumed graph (the output
    head, reading the hidden states) raised UnknownTokenInput at every call."""
    model, ids = _llama(), _ids()
    compiled = torch.compile(model, backend="tokpipe", dynamic=False,
                             options={**OPTIONS, "token_input": "input_ids"})
    with torch.no_grad():
        for _ in range(2):
            got = compiled(input_ids=ids, use_cache=False, output_hidden_states=True)
            expected = model(input_ids=ids, use_cache=False, output_hidden_states=True)
            _assert_close(got.logits, expected.logits)
            assert len(got.hidden_states) == len(expected.hidden_states)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("mode", ["causal", "sync"])
def test_a_padding_mask_and_positions_equal_eager(name, mode):
    """A tokenizer's 2-d attention_mask (left padding) and position_ids, from which
    transformers builds its mask inside the model: with the ids' dtype they were cut to
    the chunk, and the mask's key axis indexed them whole (refused in causal mode); its
    mask functions are joined with `&`, which was taken for an in-place write (sync)."""
    model, ids = MODELS[name](), _ids(batch=2)
    mask = torch.ones(2, ids.shape[1], dtype=torch.long)
    mask[1, :10] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    compiled = torch.compile(model, backend="tokpipe", dynamic=False,
                             options={**OPTIONS, "mode": mode})
    inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions,
              "use_cache": False}
    with torch.no_grad():
        got, expected = compiled(**inputs).logits, model(**inputs).logits
    assert len(tp.programs(compiled)) == 1
    _assert_close(got[1, 10:], expected[1, 10:])  # the padded sample's real tokens
    _assert_close(got, expected)


def test_gpt2s_flattened_rows_are_not_taken_for_a_batch():
    """GPT-2 flattens [batch, tokens, width] to [batch * tokens, width] for its addmm: at
    width = tokens that looked like a batch of 64 one-token samples, and the plan counted
    one token and no FLOPs (a warning said its stages had nothing to compute)."""
    model, ids = _gpt2(), _ids(tokens=64)
    with torch.no_grad():
        plan = tp.explain(model, (ids,), **OPTIONS)
    assert plan.tokens == 64 and not plan.imbalance_warning
    assert all(flops > 0 for stage in plan.chunk_flops() for flops in stage)


def test_a_plan_names_the_decoder_layers_each_stage_holds():
    """transformers' decorated forward reaches the model as args[0] (the layers read '0'),
    and its kernelized rotary function is a module reached through a global (it read
    'apply_rotary_pos_emb' between the layers)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=128, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        plan = tp.explain(model, (_ids(),), **OPTIONS)
    paths = [path for stage in plan.stages for path in stage.modules]
    assert all(path.startswith(("model", "lm_head")) for path in paths), paths
    assert "model.layers.0.self_attn" in plan.stages[0].modules
    assert "model.layers.3.self_attn" in plan.stages[1].modules


def test_gpt2s_ids_are_told_from_its_positions_and_token_types():
    """All three index embedding tables and tie in the ranking: the earlier input won, so
    position_ids passed before token ids were taken for the tokens (and refused)."""
    model = _gpt2()
    ids = _ids(batch=2)
    positions = torch.arange(ids.shape[1]).expand_as(ids).contiguous()
    inputs = {"position_ids": positions, "token_type_ids": torch.zeros_like(ids),
              "input_ids": ids, "use_cache": False}
    compiled = torch.compile(model, backend="tokpipe", dynamic=False, options=OPTIONS)
    with torch.no_grad():
        _assert_close(compiled(**inputs).logits, model(**inputs).logits)
    (program,) = tp.programs(compiled)
    assert _token_argument(program.plan) == "input_ids"


class FlatRows(torch.nn.Module):
    """GPT-2's Conv1D shape: addmm over [batch * tokens, width], with a bias vector, scaled
    (beta, alpha), or a residual of the rows themselves as its bias (refused before)."""

    def __init__(self, how: str, width: int = 32):
        super().__init__()
        self.how = how
        self.qkv = torch.nn.Parameter(torch.randn(width, 3 * width) * 0.1)
        self.bias = torch.nn.Parameter(torch.randn(3 * width) * 0.1)
        self.out = torch.nn.Parameter(torch.randn(width, width) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        scale = {"beta": 0.5, "alpha": 2.0} if self.how == "scaled" else {}
        q, k, v = torch.addmm(self.bias, x.reshape(-1, width), self.qkv, **scale) \
            .view(batch, tokens, 3, width).unbind(2)
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.how == "residual":
            return torch.addmm(x.reshape(-1, width), attended.reshape(-1, width),
                               self.out).view(batch, tokens, width)
        return x + attended


@pytest.mark.parametrize("how", ["bias", "scaled", "residual"])
def test_addmm_over_flattened_rows_equals_eager(how):
    torch.manual_seed(0)
    model, x = FlatRows(how).eval(), torch.randn(2, 16, 32)
    compiled = torch.compile(model, backend="tokpipe", dynamic=False, options=OPTIONS)
    with torch.no_grad():
        _assert_close(compiled(x), model(x))
    assert len(tp.programs(compiled)) == 1


class KeysInNewEmpty(torch.nn.Module):
    """DeepSeek's spelling: keys built as `k.new_empty(..., d)`, a literal token length."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(64, 192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(1, -1, 3, 4, 16).permute(2, 0, 3, 1, 4)
        keys = k.new_empty(*k.shape[:-1], 16)
        keys[..., :8].copy_(k[..., :8])
        keys[..., 8:].copy_(k[..., 8:] * 2)
        attended = torch.nn.functional.scaled_dot_product_attention(q, keys, v, is_causal=True)
        return x + attended.transpose(1, 2).reshape(x.shape)


def test_a_literal_token_length_is_refused_as_tokpipes_own_error():
    """It was told as Inductor's failure, advising compiler='eager', which was set."""
    model = KeysInNewEmpty().eval()
    compiled = torch.compile(model, backend="tokpipe", dynamic=False, options=OPTIONS)
    with torch.no_grad(), pytest.raises(tp.TokpipeError) as info:
        compiled(torch.randn(1, 48, 64))
    assert str(info.value).startswith("new_empty((1, 4, 48, 16))"), str(info.value)
    assert "Inductor" not in str(info.value)


def _gpt_neo() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPTNeoConfig(
        num_layers=2, hidden_size=64, num_heads=4, vocab_size=128, max_position_embeddings=256,
        attention_types=[[["global", "local"], 1]], window_size=16, bos_token_id=0,
        eos_token_id=0)
    return transformers.GPTNeoForCausalLM(config).eval()


def _mpt() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.MptConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=128,
                                    max_seq_len=256, attn_config={"alibi": True})
    return transformers.MptForCausalLM(config).eval()


@pytest.mark.parametrize("make", [_gpt_neo, _mpt])
def test_attention_filled_by_a_table_pipelines_in_causal_mode(make):
    """GPT-Neo fills the scores with torch.where(causal, scores, torch.tensor(lowest)) and
    adds the padding mask on top (a global layer and a sliding-window one); MPT adds its
    ALiBi bias, then fills with masked_fill(lowest). Both were left as written, a score
    matrix mixing every token, and causal mode refused the model."""
    model = make()
    ids = _ids(batch=2)
    mask = torch.ones(2, ids.shape[1], dtype=torch.long)
    mask[1, :10] = 0
    compiled = torch.compile(model, backend="tokpipe", dynamic=False, options=OPTIONS)
    with torch.no_grad():
        got = compiled(input_ids=ids, attention_mask=mask, use_cache=False).logits
        expected = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert len(tp.programs(compiled)) == 1
    assert len(tp.programs(compiled)[0].plan.caches) == 2
    _assert_close(got[1, 10:], expected[1, 10:])  # the padded sample's real tokens
    _assert_close(got[0], expected[0])


def test_generate_decodes_unpipelined_with_fallback_or_names_the_one_token_grid():
    """model.generate pipelines the prefill, then calls the model with one token and the
    cache of earlier keys and values: the cache's keys (float, rank 4) were taken for the
    token input, and the error blamed attention whose tokens differ."""
    model = _gpt2()
    ids = _ids(tokens=32)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=3, do_sample=False)
    model.compile(backend="tokpipe", dynamic=False, options=OPTIONS)
    with pytest.raises(tp.TokpipeError, match=r"one unit .*a sequence's one token"), \
            torch.no_grad():
        model.generate(ids, max_new_tokens=3, do_sample=False)
    torch._dynamo.reset()
    model.compile(backend="tokpipe", dynamic=False, options={**OPTIONS, "fallback": True})
    with pytest.warns(UserWarning, match="unpipelined"), torch.no_grad():
        assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False), expected)
