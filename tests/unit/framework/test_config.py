import dataclasses
from pathlib import Path

import pytest

from titan_dmuon.config import (
    ConfigError,
    JobConfig,
    config_from_dict,
    dump_toml,
    load_toml,
    parse_args,
    parse_args_or_exit,
    validate_config,
    validate_parallelism,
)

REPO = Path(__file__).resolve().parents[3]


def write(tmp_path, text, name="cfg.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_defaults():
    cfg = parse_args([])
    assert cfg == JobConfig()
    assert cfg.job.dump_folder == "./outputs"
    assert (cfg.model.name, cfg.model.flavor, cfg.model.tokenizer) == ("llama3", "debugmodel", "byte")
    o, m, a, d = cfg.optimizer, cfg.optimizer.muon, cfg.optimizer.adamw, cfg.optimizer.dmuon
    assert (o.name, o.muon_params) == ("dmuon", "")  # "" = the model family's Muon params
    assert (m.lr, m.momentum, m.nesterov, m.weight_decay, m.ns_steps) == (0.02, 0.95, True, 0.0, 5)
    assert (m.ns_coefficients, m.eps, m.adjust_lr_fn, m.ns_dtype) == ("polar_express", 1e-7, "match_rms_adamw", "")
    assert (a.lr, a.betas, a.eps, a.weight_decay) == (1e-3, (0.9, 0.95), 1e-8, 0.01)
    assert (d.reshard_after_forward, d.replicate_async, d.tp_distributed_gram) == (True, True, False)
    assert d.tp_distributed_gram_policy == "beneficial"
    assert cfg.lr_scheduler.decay_ratio is None
    t = cfg.training
    assert (t.max_norm, t.gradient_accumulation_steps, t.seed, t.dataset, t.dataset_field) == (
        1.0,
        1,
        None,
        "stdlib",
        "text",
    )
    p = cfg.parallelism
    assert (p.data_parallel_replicate_degree, p.data_parallel_shard_degree, p.tensor_parallel_degree) == (1, -1, 1)
    assert p.fsdp_reshard_after_forward == "default"
    assert (cfg.activation_checkpoint.mode, cfg.compile.enable) == ("none", False)
    assert (cfg.metrics.log_freq, cfg.metrics.enable_tensorboard, cfg.metrics.save_tb_folder) == (10, True, "tb")
    assert (cfg.profiling.enable_profiling, cfg.profiling.profile_freq) == (False, 100)
    assert cfg.profiling.save_traces_folder == "profile_traces"
    assert (cfg.validation.enable, cfg.validation.freq, cfg.validation.steps, cfg.validation.dataset) == (
        False,
        100,
        10,
        "",
    )


def test_every_field_has_a_docstring():
    import ast
    import inspect

    from titan_dmuon.config import job_config

    tree = ast.parse(inspect.getsource(job_config))
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name != "JobConfig"):
        for i, node in enumerate(cls.body):
            if isinstance(node, ast.AnnAssign):
                nxt = cls.body[i + 1] if i + 1 < len(cls.body) else None
                assert isinstance(nxt, ast.Expr) and isinstance(nxt.value.value, str), (cls.name, node.target.id)


def test_toml_load(tmp_path):
    path = write(
        tmp_path,
        """
[training]
steps = 7
seed = 3
[optimizer]
name = "adamw"
[optimizer.muon]
lr = 1          # int accepted for a float
[optimizer.adamw]
betas = [0.8, 0.99]
[lr_scheduler]
decay_ratio = 0.25
decay_type = "cosine"
""",
    )
    cfg = load_toml(path)
    assert cfg.training.steps == 7 and cfg.training.seed == 3
    assert cfg.optimizer.name == "adamw"
    assert cfg.optimizer.muon.lr == 1.0 and isinstance(cfg.optimizer.muon.lr, float)
    assert cfg.optimizer.adamw.betas == (0.8, 0.99)
    assert cfg.optimizer.adamw.lr == 1e-3  # untouched keys of a sub-table keep defaults
    assert (cfg.lr_scheduler.decay_ratio, cfg.lr_scheduler.decay_type) == (0.25, "cosine")
    assert cfg.training.local_batch_size == 8  # untouched keys keep defaults
    assert parse_args(["--config", path]) == cfg
    assert parse_args([f"--config={path}"]) == cfg


def test_precedence_cli_over_toml_over_defaults(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 7\nseq_len = 64\n[compile]\nenable = true\n")
    cfg = parse_args(["--training.steps", "5", "--config", path, "--optimizer.adamw.betas", "0.5", "0.6"])
    assert cfg.training.steps == 5  # CLI
    assert cfg.training.seq_len == 64  # TOML
    assert cfg.training.local_batch_size == 8  # default
    assert cfg.optimizer.adamw.betas == (0.5, 0.6)
    assert cfg.compile.enable is True
    # dashes and underscores, TOML-style and Python-style booleans
    cfg = parse_args(
        [
            "--config",
            path,
            "--training.local-batch-size",
            "3",
            "--compile.enable",
            "false",
            "--metrics.enable_tensorboard=False",
            "--training.seed",
            "None",
            "--optimizer.dmuon.replicate-async",
            "FALSE",
            "--optimizer.muon.nesterov=false",
        ]
    )
    assert cfg.training.local_batch_size == 3
    assert cfg.compile.enable is False and cfg.metrics.enable_tensorboard is False
    assert cfg.training.seed is None
    assert cfg.optimizer.dmuon.replicate_async is False and cfg.optimizer.muon.nesterov is False
    # a bool flag with no value is true (`--job.dry_run`), before another flag or at the end
    cfg = parse_args(["--compile.enable", "--job.dry_run", "--job.dry_run_world_size", "8", "--job.dry-run"])
    assert cfg.compile.enable is True and cfg.job.dry_run is True and cfg.job.dry_run_world_size == 8


def test_unknown_section_and_key(tmp_path):
    path = write(tmp_path, "[trainig]\nsteps = 5\n")
    with pytest.raises(ConfigError) as e:
        load_toml(path)
    assert path in str(e.value) and "trainig" in str(e.value) and "[training]" in str(e.value)

    path = write(tmp_path, "[training]\nstpes = 5\n")
    with pytest.raises(ConfigError) as e:
        load_toml(path)
    msg = str(e.value)
    assert path in msg and "training.stpes" in msg and "did you mean training.steps?" in msg

    # a key put in the wrong section points to where it lives
    path = write(tmp_path, "[optimizer]\nwarmup_steps = 5\n")
    with pytest.raises(ConfigError, match=r"optimizer\.warmup_steps.*did you mean lr_scheduler\.warmup_steps"):
        load_toml(path)
    # sub-tables: a key of the old flat [optimizer] layout points to its sub-table, typos inside one too
    for text, pattern in [
        ("[optimizer]\nlr = 0.01\n", r"optimizer\.lr.*did you mean optimizer\.muon\.lr\?"),
        ("[optimizer]\nadamw_lr = 0.01\n", r"optimizer\.adamw_lr.*did you mean optimizer\.adamw\.lr\?"),
        ("[optimizer.muon]\nmomentun = 0.9\n", r"optimizer\.muon\.momentun.*did you mean optimizer\.muon\.momentum"),
        ("[optimizer]\nmuon = 3\n", r"\[optimizer\.muon\].*must be a table"),
    ]:
        with pytest.raises(ConfigError, match=pattern):
            load_toml(write(tmp_path, text))


def test_wrong_type(tmp_path):
    path = write(tmp_path, '[training]\nsteps = "five"\n')
    with pytest.raises(ConfigError) as e:
        load_toml(path)
    msg = str(e.value)
    assert path in msg and "training.steps" in msg and "expected int" in msg and "'five'" in msg

    with pytest.raises(ConfigError, match=r"compile\.enable.*expected bool.*1"):
        config_from_dict({"compile": {"enable": 1}})
    with pytest.raises(ConfigError, match=r"optimizer\.adamw\.betas.*expected array of float, float"):
        config_from_dict({"optimizer": {"adamw": {"betas": [0.9]}}})
    with pytest.raises(ConfigError, match=r"training\.steps.*expected int.*2\.5"):
        config_from_dict({"training": {"steps": 2.5}})
    with pytest.raises(ConfigError, match=r"\[training\].*must be a table"):
        config_from_dict({"training": 3})


def test_invalid_choice(tmp_path):
    path = write(tmp_path, '[lr_scheduler]\ndecay_type = "exp"\n')
    with pytest.raises(ConfigError) as e:
        load_toml(path)
    msg = str(e.value)
    assert "lr_scheduler.decay_type" in msg and "'exp'" in msg and "'linear', 'cosine', 'sqrt'" in msg
    with pytest.raises(ConfigError, match=r"activation_checkpoint\.mode.*'none', 'selective', 'full'"):
        config_from_dict({"activation_checkpoint": {"mode": "op"}})
    # validate_config catches what Python code set directly
    cfg = JobConfig()
    cfg.optimizer.muon.adjust_lr_fn = "rms"
    with pytest.raises(ConfigError, match=r"optimizer\.muon\.adjust_lr_fn.*'match_rms_adamw', 'original'"):
        validate_config(cfg)


def test_tp_distributed_gram_policy(tmp_path):
    """[optimizer.dmuon] tp_distributed_gram_policy: one of the three (the TOML, a flag), else a ConfigError naming
    the key, the value and the choices."""
    toml = '[optimizer.dmuon]\ntp_distributed_gram = true\ntp_distributed_gram_policy = "always"\n'
    d = load_toml(write(tmp_path, toml)).optimizer.dmuon
    assert (d.tp_distributed_gram, d.tp_distributed_gram_policy) == (True, "always")
    assert (
        parse_args(["--optimizer.dmuon.tp_distributed_gram_policy", "never"]).optimizer.dmuon.tp_distributed_gram_policy
        == "never"
    )
    path = write(tmp_path, '[optimizer.dmuon]\ntp_distributed_gram_policy = "sometimes"\n', "bad.toml")
    with pytest.raises(ConfigError) as e:
        load_toml(path)
    msg = str(e.value)
    assert "optimizer.dmuon.tp_distributed_gram_policy" in msg and "'sometimes'" in msg
    assert "'beneficial', 'always', 'never'" in msg
    with pytest.raises(ConfigError, match=r"tp_distributed_gram_policy.*'beneficial', 'always', 'never'.*'rarely'"):
        parse_args(["--optimizer.dmuon.tp_distributed_gram_policy", "rarely"])
    cfg = JobConfig()  # validate_config catches what Python code set directly
    cfg.optimizer.dmuon.tp_distributed_gram_policy = "rarely"
    with pytest.raises(ConfigError, match=r"optimizer\.dmuon\.tp_distributed_gram_policy.*'beneficial'"):
        validate_config(cfg)


def test_range_validation(tmp_path):
    for argv, pattern in [
        (["--training.steps", "0"], r"training\.steps must be >= 1"),
        (["--lr_scheduler.decay_ratio", "1.5"], r"decay_ratio must be in \[0, 1\]"),
        (["--optimizer.muon_params", "("], r"muon_params is not a valid regex"),
        (["--training.dataset", "jsonl"], r"dataset_path is required"),
        (["--parallelism.data_parallel_shard_degree", "0"], r"-1 or >= 1"),
        (["--optimizer.muon.momentum", "1"], r"optimizer\.muon\.momentum must be in \[0, 1\)"),
        (["--optimizer.adamw.lr", "-1"], r"optimizer\.adamw\.lr must be >= 0"),
        (["--job.dry_run"], r"job\.dry_run needs job\.dry_run_world_size >= 1"),
        (["--job.dry_run_tflops", "0"], r"job\.dry_run_tflops must be > 0"),
    ]:
        with pytest.raises(ConfigError, match=pattern):
            parse_args(argv)


def test_cli_errors_exit_nonzero(tmp_path, capsys, monkeypatch):
    """A flag mistake is a ConfigError, as a TOML mistake is: through the entry point one `config error:` line on
    stderr, nothing else, exit 2; under our launchers the line goes to the rank's status file (the launcher prints
    it)."""
    from titan_dmuon.exit_status import ENV

    with pytest.raises(ConfigError, match=r"^unknown flag --training\.stepz; did you mean --training\.steps\?$"):
        parse_args(["--training.stepz", "5"])
    with pytest.raises(ConfigError) as e:
        parse_args(["--lr_scheduler.decay_type", "exp"])
    assert str(e.value) == (
        "wrong value for --lr_scheduler.decay_type: expected one of 'linear', 'cosine', 'sqrt', got 'exp'"
    )
    monkeypatch.delenv(ENV, raising=False)
    for argv, line in [
        (["--training.stepz", "5"], "unknown flag --training.stepz; did you mean --training.steps?"),
        (["--training.steps", "ten"], "wrong value for --training.steps: expected int, got 'ten'"),
        (["--config", str(tmp_path / "missing.toml")], f"config file not found: {tmp_path / 'missing.toml'}"),
    ]:
        with pytest.raises(SystemExit) as e:
            parse_args_or_exit(argv)
        assert e.value.code == 2
        out, err = capsys.readouterr()
        assert (out, err) == ("", f"config error: {line}\n")
    with pytest.raises(ConfigError, match="--config needs a path"):
        parse_args(["--config"])

    monkeypatch.setenv(ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(SystemExit) as e:
        parse_args_or_exit(["--training.steps"])
    assert e.value.code == 0 and capsys.readouterr() == ("", "")  # the launcher speaks for the ranks
    assert (tmp_path / "rank-3").read_text() == "2\nconfig error: missing value for --training.steps: expected int\n"


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        (["--training.step", "10"], "unknown flag --training.step; did you mean --training.steps?"),
        (["--training.steps", "ten"], "wrong value for --training.steps: expected int, got 'ten'"),
        (
            ["--lr_scheduler.decay_type", "exp"],
            "wrong value for --lr_scheduler.decay_type: expected one of 'linear', 'cosine', 'sqrt', got 'exp'",
        ),
        (["--training.steps"], "missing value for --training.steps: expected int"),
        (["foo"], "unexpected argument 'foo'; settings are flags: --section.field value (see --help)"),
    ],
    ids=["unknown-flag", "wrong-int", "bad-choice", "missing-value", "stray-positional"],
)
def test_cli_mistake_through_train_py_is_one_line_exit_2_without_torch(flag, expected):
    """`python train.py --config ... <mistake>` as a user types it: exit 2, one line naming the flag and the fix
    (not a box of tyro's, not the value taken for a flag), and torch never imported (-X importtime lists every
    module imported, on stderr, in lines of its own)."""
    import os
    import subprocess
    import sys

    from titan_dmuon.exit_status import ENV

    env = {k: v for k, v in os.environ.items() if k != ENV}
    argv = [sys.executable, "-X", "importtime", "train.py", "--config", "train_configs/debug_model.toml", *flag]
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    lines = (proc.stdout + proc.stderr).splitlines()
    imported = [ln.rsplit("|", 1)[1].strip() for ln in lines if ln.startswith("import time:")]
    assert "titan_dmuon.config.manager" in imported  # the trace is there to read
    assert not [m for m in imported if m.split(".")[0] == "torch"]
    said = [ln for ln in lines if not ln.startswith("import time:")]
    assert (proc.returncode, said) == (2, [f"config error: {expected}"])


@pytest.mark.parametrize(
    ("argv", "key", "expected"),
    [
        (["--training.steps", "5"], "training.steps", 5),
        (["--training.steps=5"], "training.steps", 5),
        (["--training.local-batch-size", "3"], "training.local_batch_size", 3),
        (["--training.local-batch-size=3"], "training.local_batch_size", 3),
        (["--lr-scheduler.warmup-steps", "4"], "lr_scheduler.warmup_steps", 4),
        (["--training.steps", "5", "--training.steps", "6"], "training.steps", 6),  # the last one wins
        (["--optimizer.muon.lr", "1"], "optimizer.muon.lr", 1.0),  # an int for a float, as in TOML
        (["--optimizer.muon.lr", "1e-3"], "optimizer.muon.lr", 1e-3),
        (["--compile.enable"], "compile.enable", True),  # no value, at the end
        (["--compile.enable", "--training.steps", "4"], "compile.enable", True),  # no value, before a flag
        *((["--compile.enable", text], "compile.enable", text.lower() == "true") for text in ["true", "True", "TRUE"]),
        *((["--compile.enable", text], "compile.enable", False) for text in ["false", "False", "FALSE"]),
        (["--compile.enable=false"], "compile.enable", False),
        (["--compile.enable=TRUE"], "compile.enable", True),
        (["--training.seed", "None"], "training.seed", None),
        (["--training.seed", "7"], "training.seed", 7),
        (["--lr_scheduler.decay_ratio", "None"], "lr_scheduler.decay_ratio", None),
        (["--lr_scheduler.decay_ratio", "0.25"], "lr_scheduler.decay_ratio", 0.25),
        (["--optimizer.adamw.betas", "0.5", "0.6"], "optimizer.adamw.betas", (0.5, 0.6)),
        (["--optimizer.adamw.betas=0.5", "0.6"], "optimizer.adamw.betas", (0.5, 0.6)),
        (["--optimizer.adamw.betas", "0", "0"], "optimizer.adamw.betas", (0.0, 0.0)),  # ints for floats
        (
            ["--parallelism.data_parallel_replicate_degree", "nodes"],
            "parallelism.data_parallel_replicate_degree",
            "nodes",
        ),
        (["--parallelism.data_parallel_replicate_degree", "2"], "parallelism.data_parallel_replicate_degree", 2),
        (["--parallelism.data_parallel_shard_degree", "-1"], "parallelism.data_parallel_shard_degree", -1),
        (["--parallelism.data_parallel_shard_degree=-1"], "parallelism.data_parallel_shard_degree", -1),
        (["--lr_scheduler.decay_type", "cosine"], "lr_scheduler.decay_type", "cosine"),
        (["--activation_checkpoint.mode", "none"], "activation_checkpoint.mode", "none"),  # a choice, not None
        (["--job.description", "None"], "job.description", "None"),  # a str field: the text
        (["--job.description", "two words"], "job.description", "two words"),
        (["--job.description=a=b"], "job.description", "a=b"),
        (["--job.description", "-x"], "job.description", "-x"),
        (["--job.description="], "job.description", ""),
    ],
)
def test_cli_flag_spellings(argv, key, expected):
    cfg = parse_args(argv)
    section, *path = key.split(".")
    value = getattr(cfg, section)
    for name in path:
        value = getattr(value, name)
    assert value == expected and type(value) is type(expected)
    if isinstance(expected, tuple):
        assert all(type(v) is float for v in value)


def test_cli_none_is_none_for_any_optional_field():
    """No `str | None` field yet: `None` must not become the text "None" when one comes (nor for a plain str)."""
    from titan_dmuon.config.manager import _from_text

    assert _from_text("None", str | None) is None and _from_text("none", None | str) is None
    assert _from_text("None", str) == "None" and _from_text("x", str | None) == "x"


def test_cli_flags_with_the_config_anywhere(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 7\nseq_len = 64\n")
    for argv in (
        ["--config", path, "--training.seq_len", "32"],
        ["--training.seq_len", "32", "--config", path],
        ["--training.seq_len", "32", f"--config={path}"],
        ["--job.dry_run_world_size", "2", "--config", path, "--job.dry-run", "--training.seq_len", "32"],
    ):
        cfg = parse_args(argv)
        assert (cfg.training.steps, cfg.training.seq_len) == (7, 32), argv
    assert cfg.job.dry_run is True and cfg.job.dry_run_world_size == 2


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--training.steps", "2.5"], "wrong value for --training.steps: expected int, got '2.5'"),
        (["--training.steps", "None"], "wrong value for --training.steps: expected int, got 'None'"),
        (["--training.steps="], "wrong value for --training.steps: expected int, got ''"),
        (["--training.seed", "nan"], "wrong value for --training.seed: expected int or None, got 'nan'"),
        (["--optimizer.muon.lr", "fast"], "wrong value for --optimizer.muon.lr: expected float, got 'fast'"),
        (["--compile.enable", "yes"], "wrong value for --compile.enable: expected bool, got 'yes'"),
        (["--compile.enable", "1"], "wrong value for --compile.enable: expected bool, got '1'"),
        (["--compile.enable="], "wrong value for --compile.enable: expected bool, got ''"),
        (
            ["--parallelism.data_parallel_replicate_degree", "node"],
            "wrong value for --parallelism.data_parallel_replicate_degree: expected int or one of 'nodes', got 'node'",
        ),
        (
            ["--activation_checkpoint.mode", "None"],
            "wrong value for --activation_checkpoint.mode: expected one of 'none', 'selective', 'full', got 'None'",
        ),
        (
            ["--optimizer.adamw.betas", "0.5"],
            "wrong value for --optimizer.adamw.betas: expected 2 values (float, float), got '0.5'",
        ),
        (
            ["--optimizer.adamw.betas", "0.5", "--training.steps", "3"],
            "wrong value for --optimizer.adamw.betas: expected 2 values (float, float), got '0.5'",
        ),
        (
            ["--optimizer.adamw.betas", "0.5", "high"],
            "wrong value for --optimizer.adamw.betas: expected 2 values (float, float), got '0.5 high'",
        ),
        (["--optimizer.adamw.betas"], "missing value for --optimizer.adamw.betas: expected 2 values (float, float)"),
        (["--optimizer.muon.lr", "--training.steps", "3"], "missing value for --optimizer.muon.lr: expected float"),
        (["--training.seed"], "missing value for --training.seed: expected int or None"),
        (
            ["--training.steps", "3", "4"],
            "unexpected argument '4' after --training.steps 3; settings are flags: --section.field value (see --help)",
        ),
        (
            ["--optimizer.adamw.betas", "0.5", "0.6", "0.7"],
            "unexpected argument '0.7' after --optimizer.adamw.betas 0.5 0.6; settings are flags: --section.field "
            "value (see --help)",
        ),
        (
            ["--compile.enable=true", "false"],
            "unexpected argument 'false' after --compile.enable=true; settings are "
            "flags: --section.field value (see --help)",
        ),
        (["debug.toml"], "unexpected argument 'debug.toml'; did you mean --config debug.toml?"),
        (["-training.steps", "3"], "unexpected argument '-training.steps'; did you mean --training.steps?"),
        (["--", "x"], "unexpected argument '--'; settings are flags: --section.field value (see --help)"),
        (["--training.step=10"], "unknown flag --training.step; did you mean --training.steps?"),
        (["--steps", "3"], "unknown flag --steps; did you mean --training.steps?"),
        # the same name in another section or sub-table first, as for a TOML key
        (
            ["--optimizer.warmup_steps", "3"],
            "unknown flag --optimizer.warmup_steps; did you mean --lr_scheduler.warmup_steps?",
        ),
        (["--optimizer.lr", "0.01"], "unknown flag --optimizer.lr; did you mean --optimizer.muon.lr?"),
        (
            ["--optimizer.muon.momentun", "0.9"],
            "unknown flag --optimizer.muon.momentun; did you mean --optimizer.muon.momentum?",
        ),
        (
            ["--optimizer.muon", "3"],
            "unknown flag --optimizer.muon: [optimizer.muon] is a table, set its keys (e.g. --optimizer.muon.lr)",
        ),
    ],
)
def test_cli_flag_mistakes(argv, expected):
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert str(e.value) == expected


def test_help_shows_field_docs(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    # one spelling everywhere: --help says what the docs, the configs and the error messages say
    assert "--training.local_batch_size" in out and "--job.dry_run_world_size" in out
    assert "--training.local-batch-size" not in out
    assert "Sequences per data-parallel rank" in out
    assert "--optimizer.muon.lr" in out and "Muon learning rate" in out
    # and the hyphenated spelling still parses
    assert parse_args(["--training.local-batch-size", "3"]).training.local_batch_size == 3
    with pytest.raises(SystemExit) as e:
        parse_args(["--training.stepz", "-h"])  # -h too, whatever else is there
    assert e.value.code == 0 and "Muon learning rate" in capsys.readouterr().out


def test_validate_parallelism():
    cfg = JobConfig()
    assert validate_parallelism(cfg, 8) == (1, 8, 1)
    cfg.parallelism.data_parallel_replicate_degree = 2
    cfg.parallelism.tensor_parallel_degree = 2
    assert validate_parallelism(cfg, 8) == (2, 2, 2)
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible .* = 4"):
        validate_parallelism(cfg, 6)
    cfg.parallelism.data_parallel_shard_degree = 3
    with pytest.raises(ConfigError) as e:
        validate_parallelism(cfg, 8)
    assert "= 12" in str(e.value) and "world size is 8" in str(e.value)
    cfg.parallelism.data_parallel_shard_degree = 2
    assert validate_parallelism(cfg, 8) == (2, 2, 2)
    cfg.parallelism.expert_parallel_degree = 2  # borrowed from the shard axis
    assert validate_parallelism(cfg, 8) == (2, 2, 2)
    cfg.parallelism.expert_parallel_degree = 4
    with pytest.raises(ConfigError, match=r"expert_parallel_degree \(4\) must divide data_parallel_shard_degree \(2\)"):
        validate_parallelism(cfg, 8)


@pytest.mark.slow  # the 70B config validates through the library (imports) and its TP plan: ~25 s
@pytest.mark.parametrize("path", sorted((REPO / "train_configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = parse_args(["--config", str(path)])
    assert cfg != JobConfig()
    # every key written in the file is a real field and took the file's value
    from titan_dmuon.config.manager import tomllib

    with open(path, "rb") as f:
        data = tomllib.load(f)

    def check(obj, table, path):
        for key, value in table.items():
            got = getattr(obj, key)
            if isinstance(value, dict):  # a sub-table, e.g. [optimizer.muon]
                check(got, value, f"{path}.{key}")
            else:
                assert got == (tuple(value) if isinstance(value, list) else value), f"{path}.{key}"

    for section, table in data.items():
        check(getattr(cfg, section), table, section)


def test_shipped_debug_config_values():
    cfg = parse_args(["--config", str(REPO / "train_configs" / "debug_model.toml")])
    t, o = cfg.training, cfg.optimizer
    assert (t.local_batch_size, t.seq_len, t.steps, t.dataset) == (8, 128, 30, "stdlib")
    assert (o.name, o.muon_params, o.muon.lr, o.muon.adjust_lr_fn, o.adamw.lr) == (
        "dmuon",
        "",
        0.01,
        "match_rms_adamw",
        3e-3,
    )
    assert cfg.lr_scheduler.warmup_steps == 5
    assert (cfg.metrics.enable_tensorboard, cfg.metrics.log_freq) == (True, 1)
    assert dataclasses.asdict(cfg)  # plain data, loggable


def test_dump_toml_round_trips(tmp_path):
    """The resolved config a run saves (<dump_folder>/config.toml) loads back to the same config."""
    cfg = parse_args(
        ["--config", str(REPO / "train_configs" / "llama3_70b.toml"), "--optimizer.muon_params", r"^a\.\d+\.w$"]
    )
    text = dump_toml(cfg)
    assert "[optimizer.muon]" in text and "# seed: unset" in text
    assert load_toml(write(tmp_path, text)) == cfg


def test_tp_gather(tmp_path):
    """[optimizer.dmuon] tp_gather: "backward" (default) or "step" (the TOML, a flag), else a ConfigError naming the
    key, the value and the choices."""
    assert JobConfig().optimizer.dmuon.tp_gather == "backward"
    d = load_toml(write(tmp_path, '[optimizer.dmuon]\ntp_gather = "step"\n')).optimizer.dmuon
    assert d.tp_gather == "step"
    assert parse_args(["--optimizer.dmuon.tp_gather", "step"]).optimizer.dmuon.tp_gather == "step"
    with pytest.raises(
        ConfigError, match=r"optimizer\.dmuon\.tp_gather: expected one of 'backward', 'step', got 'forward'"
    ):
        parse_args(["--optimizer.dmuon.tp_gather", "forward"])
