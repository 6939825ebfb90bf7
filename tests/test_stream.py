"""Text at scale: the formats corpora ship in, token files read as they are, a token budget, and the streamed path
(split across ranks, resumed at the exact token, after SIGKILL too)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import CLI_ENV, ROOT, SMALL, run_cli
from tests.test_data import as_bytes, assert_one_line, joined, load, make_dm, ready, real_text, split_of
from tests.test_reliability import kill_after_step, step_losses
from trainer.core.corpus import Source, split
from trainer.core.data import BYTE_DOC_SEPARATOR, DataError
from trainer.core.stream import TokenStream
from trainer.core.tokens import Encoder


@pytest.fixture(autouse=True)
def _hub_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")


DOCS = [d for d in real_text() if d.strip()][:40]


def write_corpus(root: Path, fmt: str, docs: list[str] = DOCS, field: str = "text") -> Path:
    """`docs` as a corpus ships: two JSON Lines or Parquet files, or a folder saved by `save_to_disk`."""
    import datasets

    root.mkdir(parents=True, exist_ok=True)
    half = len(docs) // 2
    parts = [docs[:half], docs[half:]]
    if fmt == "json":
        for i, part in enumerate(parts):
            with (root / f"part-{i}.jsonl").open("w") as fh:
                for d in part:
                    fh.write(json.dumps({field: d, "chars": len(d)}) + "\n")
    elif fmt == "parquet":
        for i, part in enumerate(parts):
            datasets.Dataset.from_dict({field: part, "chars": [len(d) for d in part]}).to_parquet(
                root / f"part-{i}.parquet"
            )
    else:
        datasets.Dataset.from_dict({field: docs, "chars": [len(d) for d in docs]}).save_to_disk(root / "saved")
    return root


# ---- formats ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["json", "parquet", "arrow"])
def test_each_format_reads_every_document_in_order(tmp_path: Path, fmt: str) -> None:
    corpus = write_corpus(tmp_path / "corpus", fmt)
    dm = ready(make_dm(tmp_path, source="local", path=[str(corpus)], seq_len=32, batch_size=2))
    assert dm.source.format == fmt
    segments = list(Source(dm.cfg).segments())
    assert "".join(s.text for s in segments) == "".join(DOCS)  # every document, in order, nothing lost
    assert sum(s.opens for s in segments) == len(DOCS)
    train, val = split_of(dm)
    assert as_bytes(dm.cache_path / "train.bin") == joined(train).encode()
    assert as_bytes(dm.cache_path / "val.bin") == joined(val).encode()
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (2, 32) and torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.parametrize("fmt", ["json", "parquet"])
def test_a_missing_or_non_text_field_is_one_line(tmp_path: Path, fmt: str) -> None:
    corpus = write_corpus(tmp_path / "corpus", fmt, field="body")
    with pytest.raises(DataError) as exc:
        ready(make_dm(tmp_path, source="local", path=[str(corpus)]))
    assert_one_line(exc, "data.text_field='text'", "body", "chars")
    assert not any((tmp_path / "cache").glob("*/meta.json"))  # nothing half-written
    with pytest.raises(DataError) as exc:
        ready(make_dm(tmp_path, source="local", path=[str(corpus)], text_field="chars"))
    assert_one_line(exc, "not text")


def test_mixed_formats_are_one_line(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus", "json")
    (corpus / "notes.txt").write_text(DOCS[0])
    with pytest.raises(DataError) as exc:
        make_dm(tmp_path, source="local", path=[str(corpus)])
    assert_one_line(exc, "mixes formats", "data.format")


# ---- token files -----------------------------------------------------------------------------------


def test_a_token_file_is_read_as_it_is(tmp_path: Path) -> None:
    ids = np.random.default_rng(0).integers(0, 1000, 20_000).astype(np.uint16)
    ids.tofile(tmp_path / "train.bin")
    dm = ready(
        make_dm(tmp_path, source="local", path=[str(tmp_path / "train.bin")], token_dtype="uint16", vocab_size=1000)
    )
    assert dm.vocab_size == 1000 and dm.train_tokens + dm.val_tokens == len(ids)
    x, y = dm.train_dataloader().dataset[2]
    assert x.tolist() == ids[2 * 65 : 2 * 65 + 64].tolist() and y.tolist() == ids[2 * 65 + 1 : 3 * 65].tolist()
    x, _ = dm.val_dataloader().dataset[0]
    assert x.tolist() == ids[dm.train_tokens : dm.train_tokens + 64].tolist()  # the tail is held out
    assert not (tmp_path / "cache").exists()  # nothing copied
    # nanoGPT's pair of files, and a .npy with its own dtype
    np.save(tmp_path / "t.npy", ids[:15_000].astype(np.int32))
    np.save(tmp_path / "val.npy", ids[15_000:].astype(np.int32))
    dm = ready(
        make_dm(tmp_path, source="local", path=[str(tmp_path / "t.npy"), str(tmp_path / "val.npy")], vocab_size=1000)
    )
    assert (dm.train_tokens, dm.val_tokens) == (15_000, 5_000)


def test_a_token_file_that_does_not_fit_the_vocabulary_is_one_line(tmp_path: Path) -> None:
    ids = np.arange(0, 300, dtype=np.uint16).repeat(40)
    ids.tofile(tmp_path / "tokens.bin")
    path = [str(tmp_path / "tokens.bin")]
    with pytest.raises(DataError) as exc:  # read with a narrower type than written
        ready(make_dm(tmp_path, source="local", path=path, token_dtype="uint8", vocab_size=50257))
    assert_one_line(exc, "uint8", "50257", "data.token_dtype", "uint16")
    with pytest.raises(DataError) as exc:  # ids past the vocabulary
        ready(make_dm(tmp_path, source="local", path=path, token_dtype="uint16", vocab_size=256))
    assert_one_line(exc, "id 299", "vocabulary of 256")
    with pytest.raises(DataError) as exc:
        ready(make_dm(tmp_path, source="local", path=path, vocab_size=256))
    assert_one_line(exc, "data.token_dtype")
    with pytest.raises(DataError) as exc:
        ready(make_dm(tmp_path, source="local", path=path, token_dtype="uint16"))
    assert_one_line(exc, "data.vocab_size")


# ---- token budget, BPE sample -----------------------------------------------------------------------


def test_max_tokens_stops_the_train_split(tmp_path: Path) -> None:
    dm = ready(make_dm(tmp_path, max_tokens=5_000))
    full = ready(make_dm(tmp_path / "full"))
    assert dm.train_tokens == 5_000
    assert np.array_equal(load(dm.cache_path / "train.bin"), load(full.cache_path / "train.bin")[:5_000])
    with pytest.raises(DataError) as exc:
        make_dm(tmp_path, max_tokens=100, seq_len=64, batch_size=4)
    assert_one_line(exc, "data.max_tokens=100", "260")


def test_bpe_trains_on_a_sample_and_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trainer.core.data")
    dm = ready(make_dm(tmp_path, tokenizer="bpe", bpe_vocab_size=400, bpe_sample_chars=20_000))
    said = [r.getMessage() for r in caplog.records if "sample" in r.getMessage()]
    assert said and "20,000 characters" in said[0] and "data.bpe_sample_chars" in said[0]
    big = ready(make_dm(tmp_path / "big", tokenizer="bpe", bpe_vocab_size=400, bpe_sample_chars=200_000))
    # A bigger sample learns merges the small one did not see: fewer tokens for the same text.
    assert big.train_tokens < dm.train_tokens


# ---- the stream ------------------------------------------------------------------------------------


def stream_of(tmp_path: Path, rank: int = 0, world: int = 1, **kw: object) -> TokenStream:
    dm = make_dm(tmp_path, source="local", path=[str(write_corpus(tmp_path / "c", "json"))], streaming=True, **kw)
    return TokenStream(dm.source, Encoder("byte"), 16, dm.cfg.val_fraction, dm.seed, rank, world, dm.cfg.max_tokens)


def test_the_stream_packs_the_train_segments_and_never_the_held_out(tmp_path: Path) -> None:
    stream = stream_of(tmp_path)
    blocks = [x.tolist() + y[-1:].tolist() for x, y in _take(stream, 200)]
    text = bytes(b for block in blocks for b in block).decode()
    train = [s for s, held in split(stream.source.segments(), stream.fraction, stream.seed) if not held]
    want = "".join((BYTE_DOC_SEPARATOR if s.opens and i else "") + s.text for i, s in enumerate(train))
    assert want.startswith(text)  # corpus order, separators between documents
    held = [s.text for s, h in split(stream.source.segments(), stream.fraction, stream.seed) if h]
    assert all(t[:40] not in text for t in held if len(t) >= 40)


def test_two_ranks_read_disjoint_segments_in_turn(tmp_path: Path) -> None:
    n = 300
    starts = {}
    for rank in (0, 1):
        stream = stream_of(tmp_path / str(rank), rank, 2)
        _take(stream, n)
        starts[rank] = {stream.position(i)["segment"] for i in range(n)}
    assert len(starts[0]) > 3 and len(starts[1]) > 3 and not starts[0] & starts[1]
    # Round robin over the train segments: the j-th goes to rank j % 2.
    train = [k for k, (_, held) in enumerate(split(stream.source.segments(), stream.fraction, stream.seed)) if not held]
    for rank, segments in starts.items():
        assert all(train.index(k) % 2 == rank for k in segments)


@pytest.mark.parametrize("at", [0, 1, 37, 250])  # 250: past the first epoch of a 4,000-token budget
def test_a_resumed_stream_continues_at_the_exact_token(tmp_path: Path, at: int) -> None:
    stream = stream_of(tmp_path, max_tokens=4_000)
    it = iter(stream)
    whole = [next(it)[0] for _ in range(at + 20)]
    state = json.loads(json.dumps(stream.position(at)))  # as a checkpoint holds it
    again = stream_of(tmp_path, max_tokens=4_000)
    again.resume(state)
    got = [x for x, _ in _take(again, 20)]
    assert all(torch.equal(g, w) for g, w in zip(got, whole[at:], strict=True))


def test_streaming_refusals_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(DataError) as exc:
        make_dm(tmp_path, streaming=True, num_workers=2)
    assert_one_line(exc, "data.num_workers=0")
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "t.bin")
    with pytest.raises(DataError) as exc:
        make_dm(tmp_path, source="local", path=[str(tmp_path / "t.bin")], streaming=True)
    assert_one_line(exc, "data.streaming=false")


def _take(stream: TokenStream, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    it = iter(stream)
    return [next(it) for _ in range(n)]


# ---- end to end ------------------------------------------------------------------------------------

STREAM = [
    *SMALL,
    "data.source=local",
    "data.streaming=true",
    "trainer.max_steps=40",
    "trainer.checkpoint_every_n_steps=1",
    "trainer.val_every_n_steps=15",
    "measure.activation_every_n_steps=0",
    "model.dropout=0.1",
]


@pytest.mark.slow
def test_sigkill_during_a_streamed_run_then_resume_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus", "parquet", docs=[d for d in real_text() if d.strip()])
    args = [*STREAM, f"data.path=[{corpus}]", f"data.cache_dir={tmp_path / 'cache'}"]
    reference = tmp_path / "reference"
    r = run_cli(*args, f"hydra.run.dir={reference}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "(streamed; tokenizer byte" in r.stdout  # the run says where its data comes from
    killed = tmp_path / "killed"
    kill_after_step(killed, 7, *args)
    assert max(step_losses(killed)) < 40
    r = run_cli(*args, f"hydra.run.dir={killed}", "ckpt_path=last")
    assert r.returncode == 0, r.stderr[-2000:]
    want, got = step_losses(reference), step_losses(killed)
    assert sorted(got) == list(range(1, 41)) == sorted(want)
    assert got == want, "the resumed stream trains on the tokens the uninterrupted one did"
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["data"]["streaming"] is True and summary["data"]["train_tokens"] is None


DDP_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import lightning as L
    import torch
    from trainer.core.data import DataConfig, TextDataModule

    class Record(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.seen = []

        def training_step(self, batch, i):
            x, _ = batch
            self.seen += [x[j].tolist() for j in range(len(x))]
            return (self.w * 0).sum() + self.w.sum()

        def on_train_end(self):
            stream = self.trainer.train_dataloader.dataset
            starts = [stream.position(i)["segment"] for i in range(len(self.seen))]
            with open(f"{sys.argv[1]}/rank{self.global_rank}.json", "w") as fh:
                json.dump({"blocks": self.seen, "segments": starts}, fh)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    cfg = DataConfig(source="local", path=[sys.argv[2]], streaming=True, cache_dir=sys.argv[1] + "/cache")
    data = TextDataModule(cfg, seq_len=16, batch_size=2, seed=0)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=30, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0)
    trainer.fit(Record(), datamodule=data)
    """
)


@pytest.mark.slow
def test_a_ddp_run_on_two_processes_reads_disjoint_blocks(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus", "json")
    script = tmp_path / "ddp_stream.py"
    script.write_text(DDP_SCRIPT)
    r = subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(corpus)],
        cwd=ROOT,
        env={**CLI_ENV, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    seen = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    assert len(seen[0]["blocks"]) == len(seen[1]["blocks"]) == 60  # 30 steps of 2 blocks each
    assert seen[0]["blocks"] != seen[1]["blocks"]
    a, b = set(seen[0]["segments"]), set(seen[1]["segments"])
    assert len(a) >= 2 and len(b) >= 2 and not a & b  # the blocks start in disjoint parts of the corpus
