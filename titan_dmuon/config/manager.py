"""Build a JobConfig: defaults <- TOML file (--config) <- CLI flags (--section.field value), then validate.

TOML values and CLI flags are type-checked here against the dataclass annotations, by one checker (`_coerce`;
a flag's text is first read as its field's type), so a typo or a wrong type in a config file or on the command line
fails at start-up with one line naming the key or flag and the fix, not mid-run. tyro only prints `--help` (it
reads the field docstrings).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, Literal, Union

from titan_dmuon.config.job_config import ConfigError, JobConfig, require

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


# ---------------------------------------------------------------------------------------------------
# Types: one checker used for TOML values and for the final validation.


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if _is_union(tp):
        return " or ".join("None" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is tuple:
        return "array of " + ", ".join(_type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """(ok, value converted to tp). bool is not accepted as int/float; int is accepted as float."""
    origin = typing.get_origin(tp)
    if tp is type(None):
        return value is None, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if tp is str:
        return isinstance(value, str), value
    if origin is Literal:
        return any(type(value) is type(a) and value == a for a in typing.get_args(tp)), value
    if _is_union(tp):
        for arg in typing.get_args(tp):
            ok, converted = _coerce(value, arg)
            if ok:
                return True, converted
        return False, value
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            return False, value
        pairs = [_coerce(v, a) for v, a in zip(value, args, strict=True)]
        return all(ok for ok, _ in pairs), tuple(v for _, v in pairs)
    raise TypeError(f"unsupported config field type {tp!r}")


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


def _fields(section_cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def _is_table(tp: Any) -> bool:
    """A field holding a dataclass is a sub-table (`[optimizer.muon]`), not a value."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _leaves(cls: type, prefix: str) -> dict[str, Any]:
    """Every value field under `cls` by dotted path (`optimizer.muon.lr`), sub-tables flattened."""
    out = {}
    for name, tp in _fields(cls).items():
        path = f"{prefix}.{name}"
        out.update(_leaves(tp, path) if _is_table(tp) else {path: tp})
    return out


def _all_leaves() -> dict[str, Any]:
    return {k: v for section, cls in _sections().items() for k, v in _leaves(cls, section).items()}


def _values_name(tp: Any) -> str:
    """What a tuple field takes on the command line: `2 values (float, float)`."""
    args = typing.get_args(tp)
    return f"{len(args)} values ({', '.join(_type_name(a) for a in args)})"


def _bad_value_message(key: str, value: Any, tp: Any, where: str, *, flag: bool = False) -> str:
    """Why `value` does not fit `key`, of type `tp`. With `flag`, `key` is a command-line flag and `value` its text
    (a list of texts for a tuple field): its Python type says nothing, what the field takes does."""
    if flag:
        if typing.get_origin(tp) is tuple:
            return f"wrong value for {key}: expected {_values_name(tp)}, got {' '.join(value)!r}"
        return f"wrong value for {key}: expected {_type_name(tp)}, got {value!r}"
    if typing.get_origin(tp) is Literal:
        allowed = ", ".join(repr(a) for a in typing.get_args(tp))
        return f"invalid value {value!r} for {key}{where}: allowed values are {allowed}"
    return f"wrong type for {key}{where}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})"


def _closest(name: str, candidates: Sequence[str]) -> str | None:
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return match[0] if match else None


# ---------------------------------------------------------------------------------------------------
# TOML


def _closest_key(path: str, key: str) -> str | None:
    """The closest valid dotted key to `path.key`: the same name in another table (a misplaced key), else a near
    miss under this table, else a near miss anywhere."""
    all_keys = list(_all_leaves())
    hint = next((k for k in all_keys if k.rsplit(".", 1)[1] == key), None)
    if hint is None:
        here = [k for k in all_keys if k.startswith(f"{path}.")]
        hint = _closest(f"{path}.{key}", here) or _closest(f"{path}.{key}", all_keys)
    return hint


def _unknown_key_message(path: str, key: str, where: str) -> str:
    hint = _closest_key(path, key)
    msg = f"unknown key {path}.{key}{where}"
    if hint:
        return msg + f"; did you mean {hint}?"
    cls = _table_class(path)
    return msg + f"; valid keys: {', '.join(_fields(cls))}"


def _table_class(path: str) -> type:
    section, *subs = path.split(".")
    cls = _sections()[section]
    for sub in subs:
        cls = _fields(cls)[sub]
    return cls


def _build_table(cls: type, table: dict[str, Any], path: str, where: str) -> Any:
    """An instance of the dataclass `cls` from a TOML table at `path`; sub-tables recurse."""
    fields = _fields(cls)
    values = {}
    for key, value in table.items():
        if key not in fields:
            raise ConfigError(_unknown_key_message(path, key, where))
        tp = fields[key]
        if _is_table(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"[{path}.{key}]{where} must be a table of keys, got {value!r}")
            values[key] = _build_table(tp, value, f"{path}.{key}", where)
            continue
        ok, converted = _coerce(value, tp)
        if not ok:
            raise ConfigError(_bad_value_message(f"{path}.{key}", value, tp, where))
        values[key] = converted
    return cls(**values)


def config_from_dict(data: dict[str, Any], source: str = "<dict>") -> JobConfig:
    """JobConfig from a {section: {key: value}} dict (a parsed TOML file named `source`); a dataclass field is a
    sub-table ({section: {sub: {key: value}}}, `[section.sub]` in TOML)."""
    sections = _sections()
    where = f" in {source}"
    built = {}
    for section, table in data.items():
        if section not in sections:
            hint = _closest(section, list(sections))
            msg = f"unknown section [{section}]{where}"
            raise ConfigError(
                msg + (f"; did you mean [{hint}]?" if hint else f"; valid sections: {', '.join(sections)}")
            )
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}]{where} must be a table of keys, got {table!r}")
        built[section] = _build_table(sections[section], table, section, where)
    return JobConfig(**built)


def load_toml(path: str | os.PathLike) -> JobConfig:
    """JobConfig from a TOML file: missing sections and keys keep their defaults."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"invalid TOML in {path}: {e}") from None
    return config_from_dict(data, source=path)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a valid TOML basic string
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)  # int, float (repr round-trips; inf and nan are TOML too)


def _dump_table(obj: Any, path: str, lines: list[str]) -> None:
    lines.append(f"[{path}]")
    subs = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            subs.append((f.name, value))
        elif value is None:  # TOML has no null: leave the key out (its default is None)
            lines.append(f"# {f.name}: unset")
        else:
            lines.append(f"{f.name} = {_toml_value(value)}")
    lines.append("")
    for name, value in subs:
        _dump_table(value, f"{path}.{name}", lines)


def dump_toml(cfg: JobConfig) -> str:
    """The whole config as TOML, every field spelled out: `load_toml` of it gives `cfg` back."""
    lines: list[str] = []
    for section in _sections():
        _dump_table(getattr(cfg, section), section, lines)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Validation


def _check_types(obj: Any, cls: type, path: str) -> None:
    require(isinstance(obj, cls), f"{path} must be a {cls.__name__}, got {obj!r}")
    for key, tp in _fields(cls).items():
        value = getattr(obj, key)
        if _is_table(tp):
            _check_types(value, tp, f"{path}.{key}")
        else:
            require(_coerce(value, tp)[0], _bad_value_message(f"{path}.{key}", value, tp, ""))


def validate_config(cfg: JobConfig) -> JobConfig:
    """Types and choices of every field, then each section's own `validate()`, then the checks that span sections.

    Names (optimizer.name, model.name, model.flavor) are checked against their registries when the trainer
    starts: the registries import torch and the model families. Checks that need the world size or the model
    raise ConfigError where those are known (validate_parallelism, parallelize, the trainer).
    """
    for section, section_cls in _sections().items():
        _check_types(getattr(cfg, section), section_cls, section)
    for section in _sections():
        validate = getattr(getattr(cfg, section), "validate", None)
        if validate is not None:
            validate()

    # Across sections.
    v = cfg.validation
    own = v.own_dataset(cfg.training)
    require(
        not v.enable or own is None or own[0] == "stdlib" or bool(own[1]),
        f"validation.dataset_path is required for validation.dataset = {v.dataset!r}",
    )
    return cfg


def validate_parallelism(cfg: JobConfig, world_size: int, ranks_per_node: int | None = None) -> tuple[int, int, int]:
    """(replicate, shard, tp) degrees of each pipeline stage for this world size (the whole world without a pipeline),
    resolving shard = -1 to the remaining ranks and replicate = "nodes" to the number of nodes (a stage's ranks /
    ranks_per_node, each node one whole replica)."""
    p = cfg.parallelism
    dp_replicate, dp_shard, tp, pp = (
        p.data_parallel_replicate_degree,
        p.data_parallel_shard_degree,
        p.tensor_parallel_degree,
        p.pipeline_parallel_degree,
    )
    if world_size % pp:
        raise ConfigError(
            f"parallelism.pipeline_parallel_degree ({pp}) does not divide the world size {world_size}: each pipeline "
            "stage takes world_size / pipeline_parallel_degree ranks"
        )
    stage_size = world_size // pp  # the replicate x shard x tp ranks of one stage
    if dp_replicate == "nodes":
        dp_replicate = _replicas_per_node(stage_size, ranks_per_node, dp_shard, tp)
    if dp_shard == -1:
        rest, remainder = divmod(stage_size, dp_replicate * tp)
        if remainder or rest == 0:
            raise ConfigError(
                f"parallelism.data_parallel_shard_degree = -1 cannot be resolved: world size {world_size} / "
                f"pipeline_parallel_degree ({pp}) = {stage_size} is not divisible by data_parallel_replicate_degree "
                f"({dp_replicate}) x tensor_parallel_degree ({tp}) = {dp_replicate * tp}"
                if pp > 1
                else f"parallelism.data_parallel_shard_degree = -1 cannot be resolved: world size {world_size} is "
                f"not divisible by data_parallel_replicate_degree ({dp_replicate}) x tensor_parallel_degree ({tp}) "
                f"= {dp_replicate * tp}"
            )
        dp_shard = rest
    problem = parallel_degrees_problem(dp_replicate, dp_shard, tp, world_size, p.expert_parallel_degree, pp)
    if problem is not None:
        raise ConfigError(problem)
    return dp_replicate, dp_shard, tp


def parallel_degrees_problem(
    replicate: int, shard: int, tp: int, world_size: int, ep: int = 1, pp: int = 1
) -> str | None:
    """The one rule resolved parallel degrees obey: each is >= 1, pp x replicate x shard x tp is the world size, and the
    expert-parallel degree divides the shard degree (expert parallelism borrows its ranks from the shard axis).
    None when they do, else what is wrong, in the config's keys. `validate_parallelism` (at launch) and ParallelDims
    (titan_dmuon/parallel/parallel_dims.py, on every construction) both ask it, so the rule is stated here only;
    it needs no torch, as the config package must not (titan_dmuon/preflight.py imports it without torch)."""
    degrees = {
        "data_parallel_replicate_degree": replicate,
        "data_parallel_shard_degree": shard,
        "tensor_parallel_degree": tp,
        "expert_parallel_degree": ep,
        "pipeline_parallel_degree": pp,
    }
    for key, value in degrees.items():
        if value < 1:
            return f"parallelism.{key} must be >= 1, got {value}"
    product = pp * replicate * shard * tp
    if product != world_size:
        what = f"pipeline_parallel_degree ({pp}) x " if pp > 1 else ""
        return (
            f"parallelism degrees do not match the world size: {what}data_parallel_replicate_degree ({replicate}) x "
            f"data_parallel_shard_degree ({shard}) x tensor_parallel_degree ({tp}) = {product}, "
            f"but the world size is {world_size}"
        )
    if shard % ep:
        return (
            f"parallelism.expert_parallel_degree ({ep}) must divide data_parallel_shard_degree ({shard}): "
            "expert parallelism borrows its ranks from the shard axis"
        )
    return None


def _replicas_per_node(world_size: int, ranks_per_node: int | None, dp_shard: int, tp: int) -> int:
    """The replicate degree for "nodes": one replica per node, so shard x tp must fill a node exactly."""
    key = 'parallelism.data_parallel_replicate_degree = "nodes"'
    if ranks_per_node is None:
        raise ConfigError(f"{key} needs the ranks per node (torchrun's LOCAL_WORLD_SIZE; job.dry_run_gpus_per_node)")
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ConfigError(f"{key}: world size {world_size} is not a whole number of nodes of {ranks_per_node} ranks")
    if ranks_per_node % tp:
        raise ConfigError(f"{key}: tensor_parallel_degree ({tp}) does not divide the {ranks_per_node} ranks per node")
    if dp_shard != -1 and dp_shard * tp != ranks_per_node:
        raise ConfigError(
            f"{key} needs data_parallel_shard_degree x tensor_parallel_degree = the ranks per node ({ranks_per_node}), "
            f"got {dp_shard} x {tp}: set data_parallel_shard_degree = -1 (or {ranks_per_node // tp})"
        )
    return world_size // ranks_per_node


# ---------------------------------------------------------------------------------------------------
# CLI


def _split_config_flag(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """Take `--config PATH` / `--config=PATH` out of argv (anywhere in it; the last one wins)."""
    path, rest, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError("--config needs a path to a TOML file")
            path, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return path, rest


def _from_text(text: str, tp: Any) -> Any:
    """The value `text` spells for a field of type `tp` (booleans as true/false in any case, `None` for an optional
    field), or `text` itself where it spells none: `_coerce` then rejects it, as it rejects a TOML value."""
    if _is_union(tp):
        args = sorted(typing.get_args(tp), key=lambda a: a is not type(None))  # `None` is None, not the text "None"
        for arg in args:
            value = _from_text(text, arg)
            if _coerce(value, arg)[0]:
                return value
        return text
    if tp is type(None):
        return None if text.lower() == "none" else text
    if tp is bool:
        return {"true": True, "false": False}.get(text.lower(), text)
    if tp in (int, float):
        try:
            return tp(text)
        except ValueError:
            return text
    if typing.get_origin(tp) is Literal:
        return next((a for a in typing.get_args(tp) if str(a) == text), text)
    return text


def _is_flag(arg: str) -> bool:
    """`--name...` is a flag; anything else is a value (a negative number too: `-1`)."""
    return arg.startswith("--")


def _flag_hint(name: str) -> str | None:
    """The closest valid flag to `--name` (`name` with underscores), as _closest_key finds a TOML key's."""
    path, _, key = name.rpartition(".")
    hint = _closest_key(path, key)
    return f"--{hint}" if hint else None


def _stray_message(arg: str, after: str | None) -> str:
    """A value no flag takes: `train.py foo`, one value too many, a flag spelled with one dash."""
    msg = f"unexpected argument {arg!r}" + (f" after {after}" if after else "")
    hint = f"--config {arg}" if arg.endswith(".toml") else None
    if hint is None and arg.startswith("-") and not arg.lstrip("-")[:1].isdigit():
        hint = _flag_hint(arg.lstrip("-").partition("=")[0].replace("-", "_"))
    return msg + (f"; did you mean {hint}?" if hint else "; settings are flags: --section.field value (see --help)")


def _unknown_flag_message(flag: str, name: str, leaves: Sequence[str]) -> str:
    msg = f"unknown flag {flag}"
    under = [k for k in leaves if k.startswith(f"{name}.")]
    if under:  # a table (`--optimizer.muon`), not a value
        return msg + f": [{name}] is a table, set its keys (e.g. --{under[0]})"
    hint = _flag_hint(name)
    return msg + (f"; did you mean {hint}?" if hint else "; see --help for the flags")


def _parse_flags(argv: Sequence[str]) -> dict[str, Any]:
    """{dotted key: value} from `--section.field value` flags (`--a.b=value` too; `-` for `_` in names; a tuple field
    takes its values one after another; a bool flag without a value is true; the last of a repeated flag wins).
    Each value is read as its field's type, then checked by `_coerce` as a TOML value is; a mistake raises
    ConfigError naming the flag and what it takes."""
    leaves = _all_leaves()
    values: dict[str, Any] = {}
    i, after = 0, None
    while i < len(argv):
        start, arg = i, argv[i]
        if not _is_flag(arg) or arg == "--":
            raise ConfigError(_stray_message(arg, after))
        flag, eq, inline = arg.partition("=")
        name = flag[2:].replace("-", "_")
        if name not in leaves:
            raise ConfigError(_unknown_flag_message(flag, name, list(leaves)))
        tp = leaves[name]
        arity = len(typing.get_args(tp)) if typing.get_origin(tp) is tuple else 1
        texts = [inline] if eq else []
        i += 1
        while len(texts) < arity and i < len(argv) and not _is_flag(argv[i]):
            texts.append(argv[i])
            i += 1
        after = " ".join(argv[start:i])
        if not texts:
            if tp is not bool:
                raise ConfigError(
                    f"missing value for {flag}: expected {_values_name(tp) if arity > 1 else _type_name(tp)}"
                )
            values[name] = True
            continue
        if arity == 1:
            value = _from_text(texts[0], tp)
        elif len(texts) == arity:
            value = [_from_text(t, a) for t, a in zip(texts, typing.get_args(tp), strict=True)]
        else:
            raise ConfigError(_bad_value_message(flag, texts, tp, "", flag=True))
        ok, converted = _coerce(value, tp)
        if not ok:
            raise ConfigError(_bad_value_message(flag, texts if arity > 1 else texts[0], tp, "", flag=True))
        values[name] = converted
    return values


def _help(base: JobConfig) -> typing.NoReturn:
    """tyro's --help (every flag with its field docstring and its default, `base`'s value); exits 0."""
    import tyro  # only here: a run, or a mistake, does not wait for it

    # use_underscores: --help spells flags as the docs, the configs and the error messages do (--job.dry_run)
    tyro.cli(JobConfig, default=base, args=["--help"], config=(tyro.conf.FlagConversionOff,), use_underscores=True)
    raise AssertionError("tyro --help returned")  # pragma: no cover


class ConfigManager:
    """Parses argv into a validated JobConfig (precedence: CLI > TOML > defaults)."""

    def __init__(self) -> None:
        self.config_path: str | None = None
        self.config: JobConfig | None = None

    def parse_args(
        self, argv: Sequence[str] | None = None, check: Callable[[JobConfig], None] | None = None
    ) -> JobConfig:
        """Raises ConfigError for every config mistake: in the file, in a flag, in the validated values.
        `--help` (`-h`) prints every flag with its docstring and exits 0 (SystemExit). `check` runs on the parsed
        config before it is validated: validation imports the optimizer library (and torch), a launch's path checks
        (titan_dmuon/preflight.py) are meant to answer before that."""
        argv = list(sys.argv[1:] if argv is None else argv)
        self.config_path, rest = _split_config_flag(argv)
        cfg = load_toml(self.config_path) if self.config_path else JobConfig()
        if "--help" in rest or "-h" in rest:
            _help(cfg)
        for name, value in _parse_flags(rest).items():
            *tables, key = name.split(".")
            obj = cfg
            for table in tables:
                obj = getattr(obj, table)
            setattr(obj, key, value)
        if check is not None:
            check(cfg)
        self.config = validate_config(cfg)
        return self.config


def parse_args(argv: Sequence[str] | None = None, check: Callable[[JobConfig], None] | None = None) -> JobConfig:
    """ConfigManager().parse_args(argv, check)."""
    return ConfigManager().parse_args(argv, check)


def report_config_error(e: ConfigError) -> int:
    """The one place a config error is printed, as `config error: ...`: the exit status (2, or 0 under our
    launchers, which print each rank's distinct message once; titan_dmuon/exit_status.py)."""
    from titan_dmuon.exit_status import report

    return report(2, f"config error: {e}")


def parse_args_or_exit(
    argv: Sequence[str] | None = None, check: Callable[[JobConfig], None] | None = None
) -> JobConfig:
    """For entry points: a ConfigError (a bad file, flag or value, or one `check` raises) exits through
    `report_config_error`: one line, status 2 (under our launchers, titan_dmuon/exit_status.py, the line goes to the
    launcher, which prints each distinct one once, instead of once per rank). `--help` exits 0."""
    try:
        return parse_args(argv, check)
    except ConfigError as e:
        raise SystemExit(report_config_error(e)) from None
