"""Hook-boundary resolution (titan_dmuon.dmuon.hooks.resolve_hook_modules)."""

import re

import pytest
import torch
import torch.nn as nn

from titan_dmuon.dmuon.hooks import resolve_hook_modules


class Attention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)

    def forward(self, x):
        return self.wo(self.wq(x) + self.wk(x))


class FeedForward(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w1 = nn.Linear(d, 2 * d, bias=False)
        self.w2 = nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attention = Attention(d)
        self.feed_forward = FeedForward(d)
        self.scale = nn.Parameter(torch.ones(d, d))  # a matrix directly on the block

    def forward(self, x):
        return self.feed_forward(self.attention(x)) @ self.scale


class Tiny(nn.Module):
    """Llama-like: tok_embeddings, layers (ModuleList or torchtitan-style ModuleDict), norm, output."""

    def __init__(self, d=4, n=3, container="list", name="layers"):
        super().__init__()
        self.tok_embeddings = nn.Embedding(10, d)
        blocks = [Block(d) for _ in range(n)]
        layers = (
            nn.ModuleList(blocks) if container == "list" else nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})
        )
        setattr(self, name, layers)
        self._name = name
        self.output = nn.Linear(d, 10, bias=False)
        self.root_mat = nn.Parameter(torch.zeros(d, d))

    def forward(self, t):
        h = self.tok_embeddings(t)
        layers = getattr(self, self._name)
        for b in layers if isinstance(layers, nn.ModuleList) else layers.values():
            h = b(h)
        return self.output(h @ self.root_mat)


class Wrapper(nn.Module):
    def __init__(self, n=5):
        super().__init__()
        self.model = Tiny(n=n)

    def forward(self, t):
        return self.model(t)


def mats(model):
    return [n for n, p in model.named_parameters() if p.ndim == 2]


# ----------------------------------------------------------------------------------------------------------
# default heuristic


@pytest.mark.parametrize("container", ["list", "dict"])
def test_default_layers_n(container):
    m = Tiny(container=container)
    fqns = mats(m)
    got = resolve_hook_modules(m, fqns, None)
    assert list(got) == fqns
    assert got == {
        "tok_embeddings.weight": "tok_embeddings",
        **{
            f"layers.{i}.{k}": f"layers.{i}"
            for i in range(3)
            for k in (
                "attention.wq.weight",
                "attention.wk.weight",
                "attention.wo.weight",
                "feed_forward.w1.weight",
                "feed_forward.w2.weight",
                "scale",
            )
        },
        "output.weight": "output",
        "root_mat": "",
    }


def test_default_blocks_n():
    m = Tiny(name="blocks")
    got = resolve_hook_modules(m, ["blocks.1.attention.wq.weight", "blocks.2.scale", "output.weight"], None)
    assert got == {"blocks.1.attention.wq.weight": "blocks.1", "blocks.2.scale": "blocks.2", "output.weight": "output"}


def test_default_nested_layers():
    m = Wrapper(n=12)
    got = resolve_hook_modules(
        m,
        [
            "model.layers.3.feed_forward.w1.weight",
            "model.layers.11.attention.wo.weight",
            "model.output.weight",
            "model.root_mat",
        ],
        None,
    )
    assert got == {
        "model.layers.3.feed_forward.w1.weight": "model.layers.3",
        "model.layers.11.attention.wo.weight": "model.layers.11",  # all digits, not "model.layers.1"
        "model.output.weight": "model.output",
        "model.root_mat": "model",
    }


def test_default_name_must_be_exactly_layers_or_blocks():
    # "sublayers.N" / "myblocks.N" are not transformer blocks: fall back to the parent module
    m = nn.Module()
    m.sublayers = nn.ModuleList([FeedForward(4)])
    m.myblocks = nn.ModuleList([FeedForward(4)])
    got = resolve_hook_modules(m, ["sublayers.0.w1.weight", "myblocks.0.w2.weight"], None)
    assert got == {"sublayers.0.w1.weight": "sublayers.0.w1", "myblocks.0.w2.weight": "myblocks.0.w2"}


def test_default_layers_without_index_is_not_a_block():
    # "layers.attention..." (no integer) is not a layers.N ancestor
    m = nn.Module()
    m.layers = Attention(4)
    got = resolve_hook_modules(m, ["layers.wq.weight"], None)
    assert got == {"layers.wq.weight": "layers.wq"}


# ----------------------------------------------------------------------------------------------------------
# predicate


def test_predicate_lowest_true_ancestor():
    m = Tiny()
    fqns = ["layers.0.attention.wq.weight", "layers.1.feed_forward.w2.weight", "layers.2.scale", "output.weight"]
    got = resolve_hook_modules(m, fqns, lambda mod: isinstance(mod, (Block, Tiny)))
    assert got == {
        "layers.0.attention.wq.weight": "layers.0",
        "layers.1.feed_forward.w2.weight": "layers.1",
        "layers.2.scale": "layers.2",
        "output.weight": "",
    }
    # Attention and Block both true: the lowest (Attention) wins where it is an ancestor
    got = resolve_hook_modules(m, fqns[:2], lambda mod: isinstance(mod, (Attention, Block)))
    assert got == {"layers.0.attention.wq.weight": "layers.0.attention", "layers.1.feed_forward.w2.weight": "layers.1"}
    # the param's own parent counts as an ancestor
    got = resolve_hook_modules(m, fqns[:2], lambda mod: isinstance(mod, nn.Linear))
    assert got == {
        "layers.0.attention.wq.weight": "layers.0.attention.wq",
        "layers.1.feed_forward.w2.weight": "layers.1.feed_forward.w2",
    }
    # true only at the root
    got = resolve_hook_modules(m, fqns, lambda mod: mod is m)
    assert got == {f: "" for f in fqns}


def test_predicate_overrides_default_heuristic():
    m = Wrapper(n=4)
    f = "model.layers.2.attention.wk.weight"
    assert resolve_hook_modules(m, [f], None) == {f: "model.layers.2"}
    assert resolve_hook_modules(m, [f], lambda mod: isinstance(mod, Tiny)) == {f: "model"}


def test_predicate_true_nowhere_names_the_param():
    m = Tiny()
    with pytest.raises(ValueError, match=re.escape("layers.1.feed_forward.w1.weight")):
        resolve_hook_modules(m, ["layers.1.feed_forward.w1.weight"], lambda mod: False)
    # true for some params' ancestors, not for this one's
    with pytest.raises(ValueError, match=re.escape("output.weight")):
        resolve_hook_modules(m, ["layers.0.attention.wq.weight", "output.weight"], lambda mod: isinstance(mod, Block))


# ----------------------------------------------------------------------------------------------------------
# boundary modules without their own forward


def test_bare_moduledict_layer_raises():
    # a torchtitan-shaped model whose layer is a bare ModuleDict: hooks on it would never fire
    m = nn.Module()
    m.layers = nn.ModuleList([nn.ModuleDict({"attention": Attention(4), "ffn": FeedForward(4)}) for _ in range(2)])
    with pytest.raises(ValueError, match=re.escape("layers.1")):
        resolve_hook_modules(m, ["layers.1.attention.wq.weight"], None)


def test_predicate_selecting_a_container_raises():
    m = Tiny()
    with pytest.raises(ValueError, match="ModuleList"):
        resolve_hook_modules(m, ["layers.0.attention.wq.weight"], lambda mod: isinstance(mod, nn.ModuleList))


def test_parent_without_forward_raises():
    m = Tiny()
    m.extra = nn.ParameterDict({"p": nn.Parameter(torch.zeros(3, 3))})
    with pytest.raises(ValueError, match=re.escape("extra.p")):
        resolve_hook_modules(m, ["extra.p"], None)


def test_root_without_forward_raises():
    m = nn.Module()
    m.w = nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError):
        resolve_hook_modules(m, ["w"], None)


def test_container_subclass_with_forward_is_fine():
    class Layer(nn.ModuleDict):
        def forward(self, x):
            return self["ffn"](x)

    m = nn.Module()
    m.layers = nn.ModuleList([Layer({"ffn": FeedForward(4)})])
    assert resolve_hook_modules(m, ["layers.0.ffn.w1.weight"], None) == {"layers.0.ffn.w1.weight": "layers.0"}


def test_hooks_on_resolved_module_fire():
    # the resolved boundary is really called in forward: a forward pre-hook on it sees every layer once
    m = Tiny()
    fqns = mats(m)
    got = resolve_hook_modules(m, fqns, None)
    calls = []
    for b in sorted(set(got.values())):
        m.get_submodule(b).register_forward_pre_hook(lambda mod, args, b=b: calls.append(b))
    m(torch.tensor([[1, 2]]))
    assert sorted(calls) == sorted(set(got.values()))
