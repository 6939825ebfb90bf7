"""Real text at scale: time to the first optimizer step and peak resident memory when the corpus streams, when it is
prepared into token files, and when a nanoGPT-style reference prepares it, on one corpus the benchmark writes itself
(the pydoc topics, reshuffled per file); then the loader's steady tokens/s beside the training step's at gpt2's shape.

    python -m bench data --gib 1 10 --dir /a/disk/with/room --write-docs
    python -m bench data --gib 0.05                     # a quick look

Each path runs `trainer.core.run.train` (model=tiny, one optimizer step, the byte tokenizer) in a fresh interpreter
with cold caches: its time counts from the interpreter's start, its memory is the peak resident set of it and its
children (`getrusage`).
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import DOCS, Block, environment, environment_text, estimator, parser, publish

FIRST_STEP = Block("data-first-step", "## Time to the first step")
LOADER = Block("data-loader", "## Loader rate")
PATHS = ("streamed", "prepared", "reference")
FILE_BYTES = 64 << 20  # one corpus file (the last is shorter)
MODEL = ["model=tiny", "trainer=smoke", "trainer.max_steps=1", "trainer.enable_progress_bar=false"]


def make_corpus(root: Path, gib: float) -> Path:
    """`gib` GiB of real English text (the pydoc topics, reshuffled per file) in files of 64 MiB; written once."""
    from pydoc_data.topics import topics

    target = int(gib * (1 << 30))
    folder = root / f"corpus-{gib:g}GiB"
    done = folder / ".complete"
    if done.is_file():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    docs = [topics[k].encode() + b"\n\n" for k in sorted(topics)]
    written, index = 0, 0
    while written < target:
        rng = random.Random(index)
        size = min(FILE_BYTES, target - written)
        with (folder / f"part-{index:05d}.txt").open("wb") as fh:
            n = 0
            while n < size:
                doc = docs[rng.randrange(len(docs))]
                if len(doc) > size - n:  # the file's end: whole lines only, never half a UTF-8 character
                    doc = doc[: doc.rfind(b"\n", 0, size - n) + 1]
                    if not doc:
                        break
                fh.write(doc)
                n += len(doc)
        written += n
        index += 1
        if n == 0:  # what is left is less than a line
            break
    done.write_text(str(written))
    return folder


def reference_tokens(corpus: Path, work: Path) -> Path:
    """nanoGPT's prepare.py on our files and tokenizer: `load_dataset('text')`, a `map(num_proc=...)` to ids, then
    the ids written shard by shard into one memory-mapped uint16 file."""
    import datasets
    import numpy as np
    import pyarrow.compute as pc

    files = sorted(str(p) for p in corpus.glob("*.txt"))
    ds = datasets.load_dataset(
        "text", data_files=files, sample_by="paragraph", split="train", cache_dir=str(work / "hf")
    )

    def encode(batch: dict[str, list[str]]) -> dict[str, list[Any]]:
        ids = [np.frombuffer((t + "\n\n").encode(), dtype=np.uint8).astype(np.uint16) for t in batch["text"]]
        return {"ids": ids, "len": [len(x) for x in ids]}

    ds = ds.map(encode, batched=True, remove_columns=["text"], num_proc=os.cpu_count())
    # nanoGPT's loop (shard by shard into the memmap), reading the ids as Arrow: datasets' row-wise numpy view of a
    # list column is ~100x slower than the reference deserves.
    total = int(pc.sum(ds.data.column("len")).as_py())
    out = work / "reference.bin"
    arr = np.memmap(out, dtype=np.uint16, mode="w+", shape=(total,))
    shards, at = 64, 0
    for i in range(shards):
        part = ds.shard(num_shards=shards, index=i, contiguous=True)
        ids = pc.list_flatten(part.data.column("ids")).to_numpy()
        arr[at : at + len(ids)] = ids
        at += len(ids)
    arr.flush()
    return out


def child(path: str, corpus: Path, work: Path, spawned: float) -> dict[str, Any]:
    """One path, in this (fresh) interpreter: prepare if it prepares, train to the first optimizer step."""
    import lightning as L

    from trainer.core.run import train
    from trainer.core.schema import compose_config

    first: dict[str, float] = {}

    class FirstStep(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step >= 1 and "s" not in first:
                first["s"] = time.time() - spawned

    data = [f"data.cache_dir={work / 'cache'}", "data.source=local"]
    if path == "reference":
        data += [f"data.path=[{reference_tokens(corpus, work)}]", "data.vocab_size=256", "data.token_dtype=uint16"]
    else:
        data += [f"data.path=[{corpus}]", f"data.streaming={str(path == 'streamed').lower()}"]
    config = compose_config([*MODEL, *data])
    train(config, work / "run", callbacks=[FirstStep()])
    kib = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return {"first_step_s": first["s"], "peak_rss_gib": kib / 2**20}


def measure(path: str, corpus: Path, work: Path) -> dict[str, Any]:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    spawned = time.time()
    cmd = [sys.executable, "-m", "bench.data", "--child", path, str(corpus), str(work), repr(spawned)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"error: the {path} path failed: {r.stderr.strip()[-800:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    shutil.rmtree(work, ignore_errors=True)  # the next path starts from a cold cache and has the disk
    return out


def loader_rates(corpus: Path, work: Path, seconds: float = 10.0) -> list[tuple[str, float]]:
    """Steady tokens/s of the streamed loader at the gpt2 shape (seq 1024, batch 8), byte and BPE, over `seconds`
    after its first batch (many tokenizer calls, not one batch's buffer); of one gpt2 training step at that shape on
    this CPU (batch 1, best of two); and the estimator's predicted gpt2 step on an H100 (batch 8)."""
    from bench.harness import Harness, bench_config
    from trainer.core import build
    from trainer.core.schema import compose_config

    rates = []
    for tokenizer in ("byte", "bpe"):
        overrides = ["data=local", f"data.path=[{corpus}]", "data.streaming=true", f"data.tokenizer={tokenizer}"]
        overrides += [f"data.cache_dir={work / 'cache'}", "data.bpe_vocab_size=8192", "data.bpe_sample_chars=10000000"]
        dm = build.data_module(compose_config([*overrides, "model=gpt2", "seq_len=1024", "batch_size=8", "seed=0"]))
        it = iter(dm.train_dataloader())
        next(it)
        t0, batches = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            next(it)
            batches += 1
        rates.append((f"streamed loader, {tokenizer}", batches * 8 * 1024 / (time.perf_counter() - t0)))
    config, _ = bench_config(["model=gpt2", "seq_len=1024", "batch_size=1"], "cpu")
    h = Harness(config, "cpu")  # the configured policy: none
    h.warm()
    step_s = min(h.timed() for _ in range(2))
    rates.append((f"gpt2 training step, this CPU ({config.precision})", h.batch[0].numel() / step_s))
    out = work / "estimate.json"
    estimator(
        ["model=gpt2", "seq_len=1024", "batch_size=8", "--device", "cuda", "--gpu", "H100-80GB", "--json", str(out)]
    )
    predicted = json.loads(out.read_text())["estimate"]["predicted_step"]["tokens_per_s"]
    rates.append(("gpt2 training step, H100-80GB (the estimator's prediction, bf16)", predicted))
    return rates


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--child"]:
        path, corpus, work, spawned = args[1:5]
        print(json.dumps(child(path, Path(corpus), Path(work), float(spawned))))
        return 0
    ap = parser("python -m bench data", __doc__, page=DOCS / "data.md", blocks=(FIRST_STEP, LOADER))
    ap.add_argument("--gib", type=float, nargs="+", default=[1.0], help="corpus sizes in GiB (default 1)")
    ap.add_argument("--dir", type=Path, default=Path("bench-data"), help="where corpora and caches go")
    ap.add_argument("--no-loader", action="store_true", help="skip the loader-rate table")
    opts = ap.parse_args(args)
    head = f"From `python -m bench data --gib {' '.join(f'{g:g}' for g in opts.gib)}` "
    head += f"({environment_text(environment('cpu', 'auto'))}):\n\n"
    rows = [
        "| corpus | path | first optimizer step | peak resident memory | vs reference (time, memory) |",
        "|---|---|---:|---:|---|",
    ]
    for gib in opts.gib:
        corpus = make_corpus(opts.dir, gib)
        got = {p: measure(p, corpus, opts.dir / "work") for p in PATHS}
        ref = got["reference"]
        for p, g in got.items():
            vs = f"{g['first_step_s'] / ref['first_step_s']:.3f}×, {g['peak_rss_gib'] / ref['peak_rss_gib']:.2f}×"
            rows.append(f"| {gib:g} GiB | {p} | {g['first_step_s']:.1f} s | {g['peak_rss_gib']:.2f} GiB | {vs} |")
            print(rows[-1], flush=True)
    blocks = {FIRST_STEP: head + "\n".join(rows), LOADER: ""}
    if not opts.no_loader:
        rates = loader_rates(make_corpus(opts.dir, opts.gib[0]), opts.dir / "work")
        cpu, gpu = rates[-2][1], rates[-1][1]
        lines = ["| what | tokens/s | vs the gpt2 step here | vs on an H100 |", "|---|---:|---:|---:|"]
        lines += [f"| {name} | {rate:,.0f} | {rate / cpu:,.1f}× | {rate / gpu:.2f}× |" for name, rate in rates]
        blocks[LOADER] = head + "\n".join(lines)
        shutil.rmtree(opts.dir / "work", ignore_errors=True)
    return publish("\n\n".join(b for b in blocks.values() if b), opts, blocks)


if __name__ == "__main__":
    raise SystemExit(main())
