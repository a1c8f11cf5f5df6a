"""dmuon.MuonOptions (titan_dmuon/dmuon/options.py): the library's defaults are torch.optim.Muon's (by value and by
the step they take), every option is checked where it is built (naming the field), the framework's [optimizer.muon]
table converts to it, and the one dtype map."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re

import pytest
import torch

from tests.reference import fp32_torch_muon, momentum_buffers
from tests.tiny_models import proj_predicate
from tests.unit.dmuon.helpers import dedicated, tiny, x
from titan_dmuon import dmuon
from titan_dmuon.dmuon.newton_schulz import MUON_COEFFICIENTS

# torch.optim.Muon's keyword -> ours (the same name; `adjust_lr_fn` None is torch's spelling of "original").
TORCH_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn")


def test_defaults_are_torch_optim_muons():
    torch_defaults = {k: v.default for k, v in inspect.signature(torch.optim.Muon).parameters.items() if k != "params"}
    assert set(torch_defaults) == set(TORCH_KEYS)  # a new torch.optim.Muon option shows up here
    ours = dmuon.MuonOptions()
    for key in TORCH_KEYS:
        want, got = torch_defaults[key], getattr(ours, key)
        if key == "adjust_lr_fn":
            assert want is None and got == "original", (key, got)  # torch: None means "original"
        elif key == "ns_coefficients":
            assert got == "muon" and tuple(MUON_COEFFICIENTS) == tuple(want), (key, got, want)
        else:
            assert got == want and type(got) is type(want), (key, got, want)


def test_default_step_is_torch_optim_muons(one_rank):
    """dmuon.Muon(model) and torch.optim.Muon + torch.optim.AdamW, all with their defaults (fp32 NS on both
    sides), take the same three steps: weights and momentum buffers within fp32 rounding."""
    plain, model = dedicated(tiny())
    opt = dmuon.Muon(model, ns_dtype=torch.float32)
    named = list(plain.named_parameters())
    muon = torch.optim.Muon([p for n, p in named if proj_predicate(n, p)])
    adamw = torch.optim.AdamW([p for n, p in named if not proj_predicate(n, p)])
    with fp32_torch_muon():
        for step in range(3):
            for m in (model, plain):
                m(x(step)).backward()
            for o in (opt, muon, adamw):
                o.step()
                o.zero_grad()
    got, want = dmuon.get_model_state_dict(model), plain.state_dict()
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-7, msg=key)
    names = {p: n for n, p in model.named_parameters()}
    bufs = {names[p]: s["momentum_buffer"] for p, s in opt.state.items() if "momentum_buffer" in s}
    want_bufs = momentum_buffers(plain, muon)
    assert set(bufs) == set(want_bufs) and bufs
    for key in want_bufs:
        torch.testing.assert_close(bufs[key], want_bufs[key], rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.parametrize(
    "field, value",
    [
        ("lr", -1.0),
        ("lr", "0.1"),
        ("momentum", 1.0),
        ("momentum", -0.1),
        ("nesterov", 1),
        ("weight_decay", -0.1),
        ("ns_steps", 0),
        ("ns_steps", 100),
        ("ns_steps", 2.0),
        ("ns_coefficients", "no such set"),
        ("ns_coefficients", [(1.0, 2.0)]),
        ("eps", float("nan")),
        ("adjust_lr_fn", "sqrt"),
        ("ns_dtype", "float8"),
        ("ns_dtype", torch.int32),
        ("ns_formulation", "svd"),
        ("kernel", "cublas"),
        ("ns_max_batch_elements", 0),
    ],
)
def test_invalid_option_names_its_field(field, value):
    with pytest.raises(dmuon.OptionError, match=rf"^dmuon\.MuonOptions\.{field} ") as e:
        dmuon.MuonOptions(**{field: value})
    assert e.value.field == field and isinstance(e.value, ValueError)


def test_optimizers_check_their_options(one_rank):
    from titan_dmuon.components.optimizer import NaiveMuon

    _, model = dedicated(tiny())
    with pytest.raises(ValueError, match=r"MuonOptions\.momentum must be in \[0, 1\)"):
        dmuon.Muon(model, momentum=1.0)
    with pytest.raises(TypeError, match=r"unknown Muon option\(s\) \['lrr'\]"):
        dmuon.Muon(model, lrr=0.02)
    with pytest.raises(TypeError, match="pass the Muon hyper-parameters by keyword"):
        dmuon.Muon(model, 0.02)
    proj = [p for n, p in model.named_parameters() if proj_predicate(n, p)]
    with pytest.raises(ValueError, match=r"MuonOptions\.ns_steps"):  # a param group's override too
        dmuon.Muon(model, param_groups=[{"params": proj[:1], "ns_steps": 0}])
    a, b = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match=r"MuonOptions\.adjust_lr_fn"):
        NaiveMuon([a], [b], adjust_lr_fn="rms")


def test_options_object_and_keywords(one_rank):
    """An `options` object, keywords overriding it; the param groups carry the per-group fields, the optimizer
    the rest; the options are immutable."""
    _, model = dedicated(tiny())
    base = dmuon.MuonOptions(lr=0.02, adjust_lr_fn="match_rms_adamw", ns_dtype="bfloat16", kernel="torch")
    opt = dmuon.Muon(model, base, momentum=0.9)
    assert opt.options == dataclasses.replace(base, momentum=0.9)
    (group,) = [g for g in opt.param_groups if g["kind"] == "muon"]
    assert {k: group[k] for k in dmuon.MuonOptions.PER_GROUP} == opt.options.group_defaults()
    assert (group["lr"], group["momentum"], group["adjust_lr_fn"]) == (0.02, 0.9, "match_rms_adamw")
    assert (opt.ns_dtype, opt.kernel, opt.ns_formulation) == (torch.bfloat16, "torch", "direct")
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.lr = 1.0


def test_framework_config_converts_to_options():
    """[optimizer.muon] is MuonOptions by field name; its defaults differ from the library's only where the
    framework chooses otherwise (AdamW-sized lr, no Muon weight decay, Polar Express), and its errors are
    ConfigErrors under optimizer.muon.<field>."""
    from titan_dmuon.config import ConfigError, JobConfig, MuonConfig, validate_config

    fields = {f.name for f in dataclasses.fields(MuonConfig)}
    assert fields <= {f.name for f in dataclasses.fields(dmuon.MuonOptions)}
    options = MuonConfig().to_options()
    library = dmuon.MuonOptions()
    differ = {k for k in fields if getattr(options, k) != getattr(library, k)}
    assert differ == {"lr", "weight_decay", "ns_coefficients", "adjust_lr_fn"}
    assert (options.lr, options.weight_decay, options.ns_coefficients, options.adjust_lr_fn) == (
        0.02,
        0.0,
        "polar_express",
        "match_rms_adamw",
    )
    assert options.ns_dtype is None and MuonConfig(ns_dtype="float32").to_options().ns_dtype == torch.float32
    cfg = JobConfig()
    cfg.optimizer.muon.ns_steps = 0
    with pytest.raises(ConfigError, match=r"^optimizer\.muon\.ns_steps must be an integer in \[1, 99\]"):
        validate_config(cfg)


def test_dtype_map():
    assert dmuon.to_dtype("bfloat16") is torch.bfloat16 and dmuon.to_dtype("torch.float32") is torch.float32
    assert dmuon.to_dtype(torch.float16) is torch.float16
    assert all(dmuon.to_dtype(name) is dtype for name, dtype in dmuon.DTYPES.items())
    with pytest.raises(ValueError, match="unknown dtype 'bf16'"):
        dmuon.to_dtype("bf16")
    assert dmuon.MuonOptions(ns_dtype="float32").ns_dtype is torch.float32


def test_muon_docstring_documents_every_argument():
    """Muon's Args section names each of its arguments and each MuonOptions field with its default."""
    doc = inspect.getdoc(dmuon.Muon)
    args = doc[doc.index("Args:") :]
    for name in inspect.signature(dmuon.Muon).parameters:
        if name != "self":
            assert f"{name}:" in args, name
    text = " ".join(args.split())
    for f in dataclasses.fields(dmuon.MuonOptions):
        documented = re.search(rf"`{f.name}` \(([^:)]+)", text)
        assert documented, f.name
        default = documented.group(1)
        want = {"ns_dtype": None, "ns_max_batch_elements": 2**26}.get(f.name, f.default)
        got = 2**26 if default == "2**26" else ast.literal_eval(default)
        assert got == want and f.default == want, (f.name, default, f.default)


def test_public_names_only():
    """muon_naive builds on the library's public API alone."""
    from titan_dmuon.components.optimizer import muon_naive

    tree = ast.parse(inspect.getsource(muon_naive))
    private = [
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("titan_dmuon.dmuon")
    ]
    assert not private, private
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "dmuon"
    }
    assert used and used <= set(dmuon.__all__), used - set(dmuon.__all__)
