"""Generate text from a checkpoint: a DCP step folder (saved on any number of ranks), a run's checkpoint folder (its
newest complete step), or a Hugging Face folder (scripts/convert_checkpoint.py's export).

    python scripts/generate.py outputs/checkpoint/step-1000 --prompt "Once upon a time" --max-new-tokens 64
    python scripts/generate.py outputs/hf-1000 --prompt "def main(" --prompt "import" --temperature 0.8 --top-p 0.95
    torchrun --nproc_per_node 2 scripts/generate.py outputs/checkpoint --prompt "Hello"   # TP over 2 ranks

The model configuration is the job's (the TOML saved with the checkpoint, else `--config`, else the defaults; any
`--section.field value` of train.py overrides it; an HF folder's family and flavor are the ones whose config.json
has its model_type and shapes); the tokenizer is the run's (`model.tokenizer`), or the HF
folder's own when it holds one, or `--tokenizer`. Under torchrun the model is tensor-parallel over all ranks
(loaded straight into each rank's shard) and rank 0 prints. Errors print one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

_DTYPES = ("float32", "bfloat16", "float16")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_SHAPE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_experts",  # MoE: absent from dense configs (then not compared)
    "num_experts_per_tok",
    "moe_intermediate_size",
)


class GenerateError(Exception):
    """A source, configuration or prompt that cannot be used; the message names it and the fix."""


def resolve_source(src: Path) -> tuple[str, Path]:
    """("dcp" | "hf", folder): a step folder, the newest complete step of a checkpoint folder, or an HF folder."""
    from titan_dmuon.components.checkpoint.folder import complete_steps
    from titan_dmuon.components.checkpoint.hf_io import is_hf_folder

    if (src / ".metadata").is_file():
        return "dcp", src
    if is_hf_folder(src):
        return "hf", src
    steps = complete_steps(src)
    if steps:
        return "dcp", src / f"step-{steps[-1]}"
    raise GenerateError(
        f"{src} is neither a DCP checkpoint (step-<N> with .metadata), a folder of them, nor a Hugging Face folder "
        "(*.safetensors): give a checkpoint step folder or scripts/convert_checkpoint.py's output"
    )


def load_tokenizer(kind: str, src: Path, cfg, override: str | None):
    from titan_dmuon.data import build_tokenizer

    spec = override or (str(src) if kind == "hf" and any((src / f).is_file() for f in _TOKENIZER_FILES) else None)
    spec = spec or cfg.model.tokenizer
    try:
        return build_tokenizer(spec)
    except (OSError, ValueError) as e:
        raise GenerateError(f"tokenizer {spec!r}: {e}") from None


def match_hf_config(cfg, hf_config: dict, vocab_size: int, name_given: bool) -> None:
    """Set `cfg.model.name` and `cfg.model.flavor` to the family (unless `name_given`) and flavor whose Hugging Face
    config has the folder's `model_type` and shapes, the first whose adapter accepts the folder's config.json among
    them (flavors of one shape that differ otherwise, e.g. DeepSeek-V3's with and without YaRN), else the first (its
    adapter's error then says what differs)."""
    from titan_dmuon.components.model import available_models, build_meta_model, get_model_spec
    from titan_dmuon.config import ConfigError

    first = None
    for name in [cfg.model.name] if name_given else available_models():
        spec = get_model_spec(name)
        if spec.state_dict_adapter is None:
            continue
        for flavor in spec.flavors:
            cfg.model.name, cfg.model.flavor = name, flavor
            try:
                adapter = spec.state_dict_adapter(build_meta_model(spec, cfg, vocab_size))
            except ConfigError:
                continue
            ours = adapter.hf_config()
            if not all(hf_config.get(k, ours.get(k)) == ours.get(k) for k in ("model_type", *_SHAPE_KEYS)):
                continue
            first = first or (name, flavor)
            try:
                adapter.check_hf_config(hf_config)
            except ValueError:
                continue
            return
    if first is not None:
        cfg.model.name, cfg.model.flavor = first
        return
    shapes = {k: hf_config.get(k) for k in ("model_type", *_SHAPE_KEYS)}
    families = cfg.model.name if name_given else ", ".join(available_models())
    raise GenerateError(
        f"no flavor of {families} has the shapes of {hf_config.get('_name_or_path', 'config.json')} ({shapes}): give "
        "--model.name and --model.flavor"
    )


def load_model(kind: str, src: Path, cfg, vocab_size: int, max_len: int, device, tp_mesh, given: set[str]):
    """The model with the checkpoint's weights on `device` (each TP rank loads only its shard), ready for
    `generate`: evaluation mode, its RoPE table covering `max_len` positions. An HF folder's family and flavor are
    the ones whose HF config has its config.json's model_type and shapes, unless `given` ("name", "flavor")."""
    import torch.distributed.checkpoint as dcp

    from titan_dmuon.components.checkpoint import SafeLoadPlanner, SafeReader
    from titan_dmuon.components.checkpoint.convert import check_shapes, read_dcp_metadata
    from titan_dmuon.components.checkpoint.hf_io import load_hf_weights
    from titan_dmuon.components.model import build_meta_model, get_model_spec, model_vocab_size
    from titan_dmuon.config import ConfigError

    cfg.training.seq_len = max(cfg.training.seq_len, max_len)
    if kind != "hf":
        try:  # the run's padded vocabulary (model.vocab_size in its saved config), if it had one
            vocab_size = model_vocab_size(cfg, vocab_size)
        except ConfigError as e:
            raise GenerateError(str(e)) from None
    if kind == "hf":
        hf_config = json.loads((src / "config.json").read_text())
        vocab_size = hf_config.get("vocab_size", vocab_size)
        if "flavor" not in given:
            match_hf_config(cfg, hf_config, vocab_size, name_given="name" in given)
    spec = get_model_spec(cfg.model.name)
    try:
        model = build_meta_model(spec, cfg, vocab_size)
    except ConfigError as e:
        raise GenerateError(str(e)) from None
    if tp_mesh is not None:
        if spec.apply_tp is None:
            raise GenerateError(f"model family {spec.name} has no TP plan: run one process")
        try:  # decode steps are one token long: no sequence parallelism; full logits on every rank
            spec.apply_tp(model, tp_mesh, loss_parallel=False, sequence_parallel=False)
        except ValueError as e:
            raise GenerateError(f"{tp_mesh.size()} ranks: {e}") from None
    model.to_empty(device=device)
    spec.init_buffers(model, device)
    sd = model.state_dict()
    if kind == "hf":
        if spec.state_dict_adapter is None:
            raise GenerateError(f"model family {spec.name} has no Hugging Face adapter")
        try:
            load_hf_weights(sd, src, spec.state_dict_adapter(model))
        except ValueError as e:
            raise GenerateError(str(e)) from None
    else:
        found = {k: tuple(md.size) for k, md in read_dcp_metadata(src).items()}
        check_shapes({k: tuple(t.shape) for k, t in sd.items()}, found, src, "weights")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            # the safe reader: a checkpoint folder from elsewhere must not run code through its pickled metadata
            dcp.load({"model": sd}, storage_reader=SafeReader(src), planner=SafeLoadPlanner(), no_dist=tp_mesh is None)
    return model.eval()


def parse(argv: list[str] | None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Other --section.field flags (train.py's config) override the model configuration.",
    )
    parser.add_argument("src", type=Path, help="a DCP step folder, a run's checkpoint folder, or an HF folder")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 (default): no top-k cut")
    parser.add_argument("--top-p", type=float, default=1.0, help="1.0 (default): no nucleus cut")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", choices=_DTYPES, default=None, help="default: bfloat16 on CUDA, else float32")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer spec as model.tokenizer takes")
    parser.add_argument("--config", default=None, help="the job's TOML (default: the one saved with the checkpoint)")
    parser.add_argument("--ids", action="store_true", help="also print each completion's token ids")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse(argv)
    import torch
    import torch.distributed as dist

    from titan_dmuon.components.checkpoint.convert import ExportError, job_config
    from titan_dmuon.components.generation import Sampling, generate
    from titan_dmuon.components.model import get_model_spec

    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    rank = int(os.environ.get("RANK", "0"))
    try:
        if not args.prompt:
            raise GenerateError("no prompt: give --prompt TEXT (repeat it for a batch)")
        sampling = Sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)
        kind, src = resolve_source(args.src)
        cfg = job_config(src if kind == "dcp" else None, args.config, overrides)
        tokenizer = load_tokenizer(kind, src, cfg, args.tokenizer)
        prompts = [tokenizer.encode(p, bos=True, eos=False) for p in args.prompt]
        tp_mesh = None
        if world > 1:
            from titan_dmuon.parallel.parallel_dims import ParallelDims
            from titan_dmuon.parallel.runtime import init_process_group

            init_process_group(device, cfg.comm)
            tp_mesh = ParallelDims(1, 1, world, world).build_mesh(device.type)["tp"]
        max_len = max(len(p) for p in prompts) + sampling.max_new_tokens
        given = {k for k in ("name", "flavor") if any(a.startswith(f"--model.{k}") for a in overrides)}
        given |= {"name", "flavor"} if args.config is not None else set()
        model = load_model(kind, src, cfg, tokenizer.vocab_size, max_len, device, tp_mesh, given)
    except (GenerateError, ExportError, ValueError) as e:
        print(f"generate: error: {e}", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model.to(dtype)
    get_model_spec(cfg.model.name).init_buffers(model, device)  # the RoPE table stays fp32, as in training
    out = generate(model, prompts, sampling, eos_id=getattr(tokenizer, "eos_id", None), device=device)
    if rank == 0:
        for prompt, tokens in zip(args.prompt, out.tokens, strict=True):
            print(f"--- {prompt!r}\n{prompt}{tokenizer.decode(tokens)}")
            if args.ids:
                print("ids:", " ".join(map(str, tokens)))
        seconds = out.prefill_seconds + out.decode_seconds
        print(
            f"{out.new_tokens} new tokens from {len(prompts)} prompt(s) in {seconds:.2f} s: "
            f"{out.tokens_per_second():.1f} tokens/s ({src}, {world} rank(s), {device.type}, {dtype})"
        )
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
