"""Data pipeline at scale: start-up and memory per rank against corpus size, and loader vs training throughput.

    python3 scripts/bench_data.py                      # 1M-document and 1k-document JSONL, 4 ranks
    python3 scripts/bench_data.py --docs 200000 --workdir /tmp/bench_data   # keep the corpora and shards

1. Writes two synthetic JSONL corpora of tiny documents (``--docs`` and ``--small-docs``), and tokenizes each
   with scripts/prepare_data.py (``--prepare-workers`` processes, with its progress bar).
2. Start-up: ``--ranks`` processes in one gloo process group (as train.py's ranks) each build their DP rank's
   loader and take the first batch, from the shards (``tokens``) and from the raw JSONL; reported per corpus
   size: the slowest rank's seconds, and the largest per-rank growth over the imported baseline of private
   memory and of file-backed resident pages (the shard pages the first batch touched through the memory map).
3. Throughput: DP rank 0 of ``--ranks``' loader tokens/s (shards and raw JSONL of the large corpus; 0 and 2
   workers) next to the debug model's training tokens/s on this machine (forward, backward and an AdamW
   step in this process, the debug config's batch shape), and the ratio: above 1 the loader is not the
   bottleneck.

Prints the tables and one summary line: ``bench_data: ... | loader/train min R``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

WORDS = "the of and to in is was for on that with as by at from his her it an were are which this be".split()


def write_corpus(path: str, docs: int, seed: int = 0) -> float:
    """``docs`` tiny JSONL documents (3-12 words); returns seconds taken."""
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 13, size=docs)
    words = np.array(WORDS)[rng.integers(0, len(WORDS), size=int(lengths.sum()))]
    ends = np.cumsum(lengths)
    with open(path, "w") as f:
        for i in range(docs):
            text = " ".join(words[ends[i] - lengths[i] : ends[i]])
            f.write(json.dumps({"text": f"{i}: {text}"}) + "\n")
    return time.perf_counter() - start


def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def startup_figures(rank: int, world: int, kw: dict) -> tuple[float, float, float, float]:
    """In a process group of `world` ranks: this rank's seconds to its first batch, its growth of private and
    of file-backed resident memory (MiB) over the imported baseline, and the CPU seconds it spent on the way (what
    other jobs on a shared machine do not stretch)."""
    import torch.distributed as dist

    from titan_dmuon.data import ByteTokenizer, build_dataloader

    dist.barrier()
    anon, file = _rss_mib("RssAnon"), _rss_mib("RssFile")
    start, cpu_start = time.perf_counter(), time.process_time()
    loader = build_dataloader(tokenizer=ByteTokenizer(), dp_rank=rank, dp_world_size=world, **kw)
    next(iter(loader))
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    figures = (elapsed, _rss_mib("RssAnon") - anon, _rss_mib("RssFile") - file, cpu)
    dist.barrier()
    return figures


def _startup_rank(rank: int, world: int, store: str, kw: dict, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    out.put((rank, *startup_figures(rank, world, kw)))
    dist.destroy_process_group()


def measure_startup(world: int, **kw) -> tuple[float, float, float]:
    """(slowest rank's seconds to its first batch, largest growth of private (anonymous) memory in MiB, and of
    file-backed resident pages in MiB: memory-mapped shard pages, shared with the page cache)."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_startup_rank, args=(r, world, os.path.join(tmp, "store"), kw, out))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        results = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(timeout=60)
            if p.exitcode != 0:
                raise RuntimeError(f"a rank exited with {p.exitcode}")
    return max(r[1] for r in results), max(r[2] for r in results), max(r[3] for r in results)


def loader_tokens_per_s(batches: int, **kw) -> float:
    from titan_dmuon.data import ByteTokenizer, build_dataloader

    loader = build_dataloader(tokenizer=ByteTokenizer(), **kw)
    it = iter(loader)
    next(it)  # workers started, first units read
    start = time.perf_counter()
    tokens = sum(next(it)[1].numel() for _ in range(batches))
    return tokens / (time.perf_counter() - start)


def train_tokens_per_s(flavor: str, batch: int, seq_len: int, steps: int) -> float:
    """Forward + backward + AdamW step of the model on random byte tokens, in this process."""
    import torch

    from titan_dmuon.components.model import get_model_spec

    spec = get_model_spec("llama3")
    model = spec.build(flavor, vocab_size=258, max_seq_len=seq_len)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 258, (batch, seq_len + 1))
    for i in range(steps + 2):
        if i == 2:
            start = time.perf_counter()
        opt.zero_grad()
        spec.loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        opt.step()
    return batch * seq_len * steps / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=1_000_000)
    p.add_argument("--small-docs", type=int, default=1000)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--prepare-workers", type=int, default=2)
    p.add_argument("--local-batch", type=int, default=8, help="the debug config's")
    p.add_argument("--seq-len", type=int, default=128, help="the debug config's")
    p.add_argument("--batches", type=int, default=300, help="batches timed per loader")
    p.add_argument("--train-steps", type=int, default=5)
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--workdir", default="", help="keep corpora and shards here (default: a temporary folder)")
    a = p.parse_args(argv)
    import prepare_data

    with tempfile.TemporaryDirectory() as tmp:
        work = a.workdir or tmp
        os.makedirs(work, exist_ok=True)
        paths = {}
        for name, docs in (("small", a.small_docs), ("large", a.docs)):
            raw, tokens = os.path.join(work, f"{name}.jsonl"), os.path.join(work, f"{name}_tokens")
            if not os.path.exists(raw):
                print(f"writing {raw}: {docs} documents ({write_corpus(raw, docs):.1f} s)", flush=True)
            if not os.path.exists(os.path.join(tokens, "manifest.json")):
                start = time.perf_counter()
                m = prepare_data.prepare(
                    dataset="jsonl", dataset_path=raw, output=tokens, workers=a.prepare_workers, overwrite=True
                )
                took = time.perf_counter() - start
                print(f"prepared {tokens}: {m['documents']} docs, {m['tokens']} tokens, {took:.1f} s")
            paths[name] = (raw, tokens)

        shape = {"local_batch_size": a.local_batch, "seq_len": a.seq_len, "seed": 0}
        print(f"\nstart-up to the first batch, {a.ranks} ranks (slowest rank; largest growth of private memory;")
        print("  and of file-backed resident pages: the mapped shard pages it touched, shared page cache)")
        startup = {}
        for kind in ("tokens", "jsonl"):
            for name, docs in (("small", a.small_docs), ("large", a.docs)):
                path = paths[name][1] if kind == "tokens" else paths[name][0]
                s, anon, file = measure_startup(a.ranks, dataset=kind, dataset_path=path, **shape)
                startup[kind, name] = (s, anon)
                print(f"  {kind:6s} {docs:>9,} docs: {s:6.3f} s  private +{anon:5.1f} MiB  mapped +{file:5.1f} MiB")

        rank0 = {"dp_rank": 0, "dp_world_size": a.ranks, **shape}
        rates = {}
        print(f"\nloader tokens/s, DP rank 0 of {a.ranks}, {a.docs:,}-document corpus")
        for kind in ("tokens", "jsonl"):
            path = paths["large"][1] if kind == "tokens" else paths["large"][0]
            for workers in (0, 2):
                rates[kind, workers] = loader_tokens_per_s(
                    a.batches, dataset=kind, dataset_path=path, num_workers=workers, **rank0
                )
                print(f"  {kind:6s} {workers} workers: {rates[kind, workers]:12,.0f}", flush=True)
        train = train_tokens_per_s(a.flavor, a.local_batch, a.seq_len, a.train_steps)
        print(f"  {a.flavor} training (fwd+bwd+AdamW, {a.local_batch} x {a.seq_len}): {train:12,.0f}")

    ratio = min(rates.values()) / train
    (st_s, st_rss), (sl_s, sl_rss) = startup["tokens", "small"], startup["tokens", "large"]
    print(
        f"\nbench_data: start-up tokens {a.small_docs:,} docs {st_s:.2f} s +{st_rss:.1f} MiB vs {a.docs:,} docs "
        f"{sl_s:.2f} s +{sl_rss:.1f} MiB private (x{sl_s / st_s:.2f} time); jsonl "
        f"{startup['jsonl', 'small'][0]:.2f} s vs {startup['jsonl', 'large'][0]:.2f} s | "
        f"loader tok/s/rank tokens {rates['tokens', 0]:,.0f} (0 workers) "
        f"{rates['tokens', 2]:,.0f} (2), jsonl {rates['jsonl', 0]:,.0f} (0) {rates['jsonl', 2]:,.0f} (2) | "
        f"{a.flavor} train {train:,.0f} tok/s | loader/train min {ratio:.1f}"
    )


if __name__ == "__main__":
    main()
