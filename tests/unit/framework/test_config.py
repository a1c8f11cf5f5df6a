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


def test_cli_errors_exit_nonzero(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--training.stepz", "5"])
    assert e.value.code != 0
    assert "--training.stepz" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        parse_args(["--lr_scheduler.decay_type", "exp"])
    assert e.value.code != 0
    with pytest.raises(SystemExit) as e:
        parse_args_or_exit(["--config", str(tmp_path / "missing.toml")])
    assert e.value.code == 2
    assert "config file not found" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--config needs a path"):
        parse_args(["--config"])


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
