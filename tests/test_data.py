"""TextDataModule on real text: sources, split, tokenizers, cache, and every user-facing DataError."""

from __future__ import annotations

import json
import logging
import pickle
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from trainer.core.corpus import HeldOut, Segment, Source, split
from trainer.core.data import (
    BYTE_DOC_SEPARATOR,
    EOT,
    DataConfig,
    DataError,
    TextDataModule,
    TokenBlocks,
)


@pytest.fixture(autouse=True)
def _hub_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # No test may touch the network or the user's HF cache.
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")


def load(path: Path) -> np.ndarray:
    """A prepared token file (a flat array of the dtype its meta.json names)."""
    meta = json.loads((path.parent / "meta.json").read_text())
    return np.fromfile(path, dtype=meta["dtype"])


def as_bytes(path: Path) -> bytes:
    """A cached byte-tokenizer array back as the bytes it encodes (stored as uint16)."""
    return load(path).astype(np.uint8).tobytes()


def joined(segments: list[Segment], sep: str = BYTE_DOC_SEPARATOR) -> str:
    """Segments as one stream: the separator before each that opens a document, except the first."""
    return "".join((sep if s.opens and i else "") + s.text for i, s in enumerate(segments))


def split_of(dm: TextDataModule) -> tuple[list[Segment], list[Segment]]:
    """The module's source cut into segments, by split: what the prepared files must hold."""
    train: list[Segment] = []
    val: list[Segment] = []
    for s, held in split(Source(dm.cfg).segments(), dm.cfg.val_fraction, dm.seed):
        (val if held else train).append(s)
    return train, val


def real_text() -> list[str]:
    """Real English documents (the CPython pydoc topics) to write into local-source fixtures."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def make_dm(tmp_path: Path, seq_len: int = 64, batch_size: int = 4, seed: int = 0, **kw: object) -> TextDataModule:
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"), **kw)  # type: ignore[arg-type]
    return TextDataModule(cfg, seq_len=seq_len, batch_size=batch_size, seed=seed)


def ready(dm: TextDataModule) -> TextDataModule:
    dm.prepare_data()
    dm.setup("fit")
    return dm


def assert_one_line(exc: pytest.ExceptionInfo[DataError], *needles: str) -> None:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"


# ---- embedded corpus, batches ----------------------------------------------------------------------


def test_embedded_byte_batches(tmp_path: Path) -> None:
    dm = ready(make_dm(tmp_path, seq_len=64, batch_size=4))
    assert dm.vocab_size == 256
    assert dm.train_tokens > 300_000 and dm.val_tokens > 10_000
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        batches = list(loader)
        assert batches
        for x, y in batches:
            assert x.shape == y.shape == (4, 64)
            assert x.dtype == y.dtype == torch.int64
            assert torch.equal(x[:, 1:], y[:, :-1])
            assert int(x.max()) < 256
    # y is the next token of the stream, including at the block's end.
    tokens = load(dm.cache_path / "train.bin")
    x, y = dm.train_dataloader().dataset[3]
    assert x.tolist() == tokens[3 * 65 : 3 * 65 + 64].tolist()
    assert y.tolist() == tokens[3 * 65 + 1 : 3 * 65 + 65].tolist()
    assert dm.decode(x.tolist()).encode() == bytes(x.tolist())  # real UTF-8 text


def test_datamodule_lifecycle_is_idempotent(tmp_path: Path) -> None:
    dm = make_dm(tmp_path)
    with pytest.raises(RuntimeError):
        _ = dm.vocab_size
    ready(dm)
    first = dm.train_dataloader().dataset
    ready(dm)  # train.py then Lightning: both call prepare_data + setup
    assert dm.train_dataloader().dataset is first


def test_setup_alone_prepares(tmp_path: Path) -> None:
    dm = make_dm(tmp_path)
    dm.setup("fit")
    assert dm.vocab_size == 256


# ---- determinism -----------------------------------------------------------------------------------


def first_batches(dm: TextDataModule, n: int = 3) -> list[torch.Tensor]:
    it = iter(dm.train_dataloader())
    return [next(it)[0] for _ in range(n)]


def test_same_seed_same_split_and_order(tmp_path: Path) -> None:
    a = ready(make_dm(tmp_path / "a", seed=7))
    b = ready(make_dm(tmp_path / "b", seed=7))
    assert np.array_equal(load(a.cache_path / "val.bin"), load(b.cache_path / "val.bin"))
    assert np.array_equal(load(a.cache_path / "train.bin"), load(b.cache_path / "train.bin"))
    for xa, xb in zip(first_batches(a), first_batches(b), strict=True):
        assert torch.equal(xa, xb)


def test_other_seed_other_split_and_order(tmp_path: Path) -> None:
    a = ready(make_dm(tmp_path, seed=1))
    b = ready(make_dm(tmp_path, seed=2))
    assert a.cache_path != b.cache_path
    va, vb = load(a.cache_path / "val.bin"), load(b.cache_path / "val.bin")
    assert va.shape != vb.shape or not np.array_equal(va, vb)
    assert not torch.equal(first_batches(a)[0], first_batches(b)[0])


def test_data_parallel_ranks_take_disjoint_shares_of_one_order_and_resume_within_them() -> None:
    """Rank r of w takes every w-th block of the one-process order (cut to a multiple of w), so the ranks' shares are
    disjoint, equal and together that order; one rank alone is the one-process order itself; and a resume skips
    within the rank's own share."""
    from trainer.core.data import ResumableRandomSampler

    whole = list(ResumableRandomSampler(11, seed=5))
    assert sorted(whole) == list(range(11))
    shares = [list(ResumableRandomSampler(11, 5, rank, 2)) for rank in range(2)]
    assert [len(x) for x in shares] == [5, 5] and not set(shares[0]) & set(shares[1])
    assert [i for pair in zip(*shares, strict=True) for i in pair] == whole[:10]
    resumed = ResumableRandomSampler(11, 5, 1, 2)
    resumed.resume_at(0, 3)
    assert list(resumed) == shares[1][3:]


def test_the_loaders_shard_by_rank_unless_lightning_does_and_a_resume_keeps_the_ranks(tmp_path: Path) -> None:
    """Rank 1 of 2 data-parallel ranks: under train.py (Lightning's distributed sampler off) the loaders take rank
    1's share themselves; in a Trainer that adds Lightning's sampler they leave the sharding to it, as before (cut
    twice, each rank would read a quarter). A position saved over 2 ranks resumed over 1 is one line."""
    from types import SimpleNamespace

    from trainer.core.data import ResumableRandomSampler

    dm = ready(make_dm(tmp_path))
    for lightning_shards, ranks in ((False, 2), (True, 1)):
        dm.trainer = SimpleNamespace(  # type: ignore[assignment]
            strategy=SimpleNamespace(distributed_sampler_kwargs={"rank": 1, "num_replicas": 2}),
            _accelerator_connector=SimpleNamespace(use_distributed_sampler=lightning_shards),
        )
        train, val = dm.train_dataloader(), dm.val_dataloader()
        assert isinstance(train.sampler, ResumableRandomSampler) and train.sampler.world == ranks
        assert len(val.sampler) == -(-len(dm._val) // ranks)  # type: ignore[arg-type]
    dm.trainer = None
    single = dm.train_dataloader()
    with pytest.raises(DataError) as e:
        single.load_state_dict({"epoch": 0, "batches": 3, "batch_size": 4, "ranks": 2})
    assert_one_line(e, "trained over 2 data-parallel ranks, this run has 1", "resume with the same trainer.devices")


def test_split_fraction_and_determinism(tmp_path: Path) -> None:
    dm = make_dm(tmp_path, val_fraction=0.1, seed=3)
    source = Source(dm.cfg)
    segments = list(source.segments())
    # Nothing lost: the segments are the documents, in order, each cut at line ends.
    assert joined(segments, sep="") == "".join(d for d in real_text() if d.strip())
    assert all(len(s.text) <= source.segment_chars for s in segments)
    assert sum(s.opens for s in segments) == sum(1 for d in real_text() if d.strip())
    flags = [held for _, held in split(segments, 0.1, seed=3)]
    assert flags == [held for _, held in split(segments, 0.1, seed=3)]
    # The held-out share of the characters tracks the fraction within one segment at every point of the stream.
    seen = held = 0
    for s, h in zip(segments, flags, strict=True):
        seen += len(s.text)
        held += len(s.text) * h
        assert abs(held - 0.1 * seen) <= 1.5 * source.segment_chars
    assert abs(held - 0.1 * seen) <= 0.01 * seen


def test_single_document_split_at_newlines(tmp_path: Path) -> None:
    doc = "".join(f"line {i} of the only document\n" for i in range(1000))
    f = tmp_path / "one.txt"
    f.write_text(doc)
    source = Source(DataConfig(source="local", path=[str(f)], val_fraction=0.2))
    pairs = list(split(source.segments(), 0.2, seed=0))
    assert "".join(s.text for s, _ in pairs) == doc
    assert all(s.text.endswith("\n") and s.text.startswith("line ") for s, _ in pairs)
    assert [s.opens for s, _ in pairs] == [True] + [False] * (len(pairs) - 1)
    val = sum(len(s.text) for s, held in pairs if held)
    assert abs(val - 0.2 * len(doc)) <= source.segment_chars  # within one segment of the share
    assert sum(held for _, held in pairs) >= 8  # a small corpus still gets several held-out segments


def test_dominant_document_does_not_swallow_val() -> None:
    docs = ["short\n" * 10, "big line\n" * 10_000]
    for seed in range(5):
        held = HeldOut(0.05, seed)
        pieces = [s for d in docs for s in _pieces(d, 2048)]
        val = sum(len(p) for p in pieces if held(len(p)))
        assert abs(val - 0.05 * sum(map(len, docs))) <= 2048  # within one segment of the share


def test_other_seed_holds_out_other_segments() -> None:
    lengths = [1000] * 400
    picks = {seed: [i for i, n in enumerate(lengths) if h(n)] for seed in range(4) for h in [HeldOut(0.05, seed)]}
    assert all(len(p) == 20 for p in picks.values())
    assert len({tuple(p) for p in picks.values()}) == 4


def _pieces(doc: str, n: int) -> list[str]:
    return [doc[i : i + n] for i in range(0, len(doc), n)]


# ---- cache -----------------------------------------------------------------------------------------


def test_second_prepare_uses_cache(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dm = ready(make_dm(tmp_path))
    npy = dm.cache_path / "train.bin"
    mtime = npy.stat().st_mtime_ns
    meta = json.loads((dm.cache_path / "meta.json").read_text())
    assert meta["vocab_size"] == 256 and meta["train_tokens"] == dm.train_tokens
    caplog.set_level(logging.INFO, logger="trainer.core.data")
    again = make_dm(tmp_path)
    t0 = time.perf_counter()
    ready(again)
    assert time.perf_counter() - t0 < 1.0
    assert any("using cached corpus" in r.getMessage() for r in caplog.records)
    assert not any("tokenizing" in r.getMessage() for r in caplog.records)
    assert npy.stat().st_mtime_ns == mtime
    assert again.cache_path == dm.cache_path
    # Only the finished entry is left: the temp dir was renamed into place.
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [dm.cache_path.name]


def test_cache_key_follows_file_changes(tmp_path: Path) -> None:
    f = tmp_path / "a.txt"
    f.write_text("\n".join(real_text()[:10]))
    dm = ready(make_dm(tmp_path, source="local", path=[str(f)]))
    f.write_text("\n".join(real_text()[10:20]))
    dm2 = ready(make_dm(tmp_path, source="local", path=[str(f)]))
    assert dm2.cache_path != dm.cache_path


# ---- BPE -------------------------------------------------------------------------------------------


def test_bpe_trains_and_round_trips(tmp_path: Path) -> None:
    dm = ready(make_dm(tmp_path, tokenizer="bpe", bpe_vocab_size=1000))
    assert 257 < dm.vocab_size <= 1000
    assert (dm.cache_path / "tokenizer.json").is_file()
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 64) and int(x.max()) < dm.vocab_size
    sample = "The with statement wraps a block — “smart quotes”, tabs\tand ünïcödé.\n"
    ids = dm.encode(sample)
    assert len(ids) < len(sample.encode())  # merges happened
    assert dm.decode(ids) == sample
    # Documents are separated by the end-of-text token in the stream.
    eot = dm.encode(EOT)
    assert len(eot) == 1
    train = load(dm.cache_path / "train.bin")
    segments, _ = split_of(dm)
    opened = sum(s.opens for s in segments[1:])  # a separator before each but the first
    assert int((train == eot[0]).sum()) == opened
    assert train.dtype == np.uint16


def test_byte_stream_joins_documents(tmp_path: Path) -> None:
    d = tmp_path / "docs"
    d.mkdir()
    texts = real_text()[:30]
    for i, text in enumerate(texts):
        (d / f"{i:02d}.txt").write_text(text)
    dm = ready(make_dm(tmp_path, source="local", path=[str(d)], val_fraction=0.3, seed=5))
    train, val = split_of(dm)
    assert as_bytes(dm.cache_path / "train.bin") == joined(train).encode()
    assert as_bytes(dm.cache_path / "val.bin") == joined(val).encode()
    assert sum(s.opens for s in train + val) == len(texts)  # each file one document, opened once


# ---- local sources ---------------------------------------------------------------------------------


def test_local_single_file(tmp_path: Path) -> None:
    f = tmp_path / "book.txt"
    text = "\n".join(real_text()[:20])
    f.write_text(text)
    dm = ready(make_dm(tmp_path, source="local", path=[str(f)], val_fraction=0.1))
    meta = json.loads((dm.cache_path / "meta.json").read_text())
    assert meta["n_docs"]["train"] + meta["n_docs"]["val"] == 1
    train_segments, val_segments = split_of(dm)
    assert len(val_segments) >= 2  # the one document cut at newlines, several pieces held out
    assert all(s.text.endswith("\n") for s in (train_segments + val_segments) if not text.endswith(s.text))
    train = as_bytes(dm.cache_path / "train.bin")
    val = as_bytes(dm.cache_path / "val.bin")
    assert train == "".join(s.text for s in train_segments).encode()
    assert val == "".join(s.text for s in val_segments).encode()
    assert len(train) + len(val) == len(text.encode())


def test_local_folder_recursive_skips_hidden(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / ".git").mkdir()
    texts = real_text()
    (root / "a.md").write_text(texts[0])
    (root / "sub" / "b.rst").write_text(texts[1])
    (root / "sub" / "deeper" / "c.txt").write_text(texts[2])
    (root / ".hidden.txt").write_bytes(b"\x00binary would fail")
    (root / ".git" / "index").write_bytes(b"\x00\x01binary would fail")
    dm = ready(make_dm(tmp_path, source="local", path=[str(root)], seq_len=32, batch_size=2))
    files = [Path(f[0]).name for f in json.loads((dm.cache_path / "meta.json").read_text())["description"]["files"]]
    assert files == ["a.md", "b.rst", "c.txt"]


def test_local_glob(tmp_path: Path) -> None:
    root = tmp_path / "g"
    (root / "x").mkdir(parents=True)
    texts = real_text()
    for i in range(4):
        (root / "x" / f"{i}.txt").write_text(texts[i])
    (root / "x" / "skip.log").write_text("not matched")
    dm = ready(make_dm(tmp_path, source="local", path=[str(root / "**" / "*.txt")], seq_len=32, batch_size=2))
    files = [Path(f[0]).name for f in json.loads((dm.cache_path / "meta.json").read_text())["description"]["files"]]
    assert files == ["0.txt", "1.txt", "2.txt", "3.txt"]


def test_invalid_utf8_decoded_with_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    f = tmp_path / "latin1.txt"
    f.write_bytes(("\n".join(real_text()[:5]) + "\ncaf\xe9 na\xefve\n").encode("latin-1", errors="replace"))
    caplog.set_level(logging.WARNING, logger="trainer.core.data")
    dm = ready(make_dm(tmp_path, source="local", path=[str(f)], seq_len=32, batch_size=2))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "UTF-8" in r.getMessage()]
    assert len(warnings) == 1 and str(f) in warnings[0].getMessage()
    stream = as_bytes(dm.cache_path / "train.bin") + as_bytes(dm.cache_path / "val.bin")
    assert "caf\ufffd na\ufffdve".encode() in stream


# ---- errors ----------------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(DataError) as exc:
        ready(make_dm(tmp_path, source="local", path=[str(tmp_path / "nope.txt")]))
    assert_one_line(exc, "data.path", "nope.txt", "does not exist")


def test_glob_matching_nothing(tmp_path: Path) -> None:
    with pytest.raises(DataError) as exc:
        ready(make_dm(tmp_path, source="local", path=[str(tmp_path / "*.nothing")]))
    assert_one_line(exc, "matched nothing")


def test_local_without_path(tmp_path: Path) -> None:
    with pytest.raises(DataError) as exc:
        make_dm(tmp_path, source="local")
    assert_one_line(exc, "data.path=")


def test_empty_file(tmp_path: Path) -> None:
    f = tmp_path / "empty.txt"
    f.write_text("")
    with pytest.raises(DataError) as exc:
        ready(make_dm(tmp_path, source="local", path=[str(f)]))
    assert_one_line(exc, "empty")


def test_whitespace_only_file(tmp_path: Path) -> None:
    f = tmp_path / "blank.txt"
    f.write_text("\n\n   \n")
    with pytest.raises(DataError) as exc:
        ready(make_dm(tmp_path, source="local", path=[str(f)]))
    assert_one_line(exc, "no text")


def test_binary_file(tmp_path: Path) -> None:
    good = tmp_path / "good.txt"
    good.write_text(real_text()[0])
    blob = tmp_path / "weights.bin"
    blob.write_bytes(b"PK\x03\x04\x00\x00" + bytes(range(256)) * 10)
    with pytest.raises(DataError) as exc:
        ready(make_dm(tmp_path, source="local", path=[str(good), str(blob)]))
    assert_one_line(exc, "weights.bin", "binary", "data.path")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_corpus_smaller_than_one_batch(tmp_path: Path) -> None:
    f = tmp_path / "tiny.txt"
    f.write_text("A short but real sentence.\nAnd a second line of it.\n" * 4)
    with pytest.raises(DataError) as exc:
        ready(make_dm(tmp_path, source="local", path=[str(f)], seq_len=64, batch_size=4))
    assert_one_line(exc, "needs 260", "smaller seq_len or batch_size", "val_fraction")
    assert "train" in str(exc.value) and "tokens" in str(exc.value)


@pytest.mark.parametrize("fraction", [0.0, -0.1, 0.6, 1.0])
def test_bad_val_fraction(tmp_path: Path, fraction: float) -> None:
    with pytest.raises(DataError) as exc:
        make_dm(tmp_path, val_fraction=fraction)
    assert_one_line(exc, "data.val_fraction", "(0, 0.5]")


def test_unknown_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(DataError) as exc:
        make_dm(tmp_path, tokenizer="sentencepiece")
    assert_one_line(exc, "sentencepiece", "byte", "bpe")


def test_bpe_vocab_too_small(tmp_path: Path) -> None:
    with pytest.raises(DataError) as exc:
        make_dm(tmp_path, tokenizer="bpe", bpe_vocab_size=100)
    assert_one_line(exc, "data.bpe_vocab_size", "257")


def test_unknown_source(tmp_path: Path) -> None:
    with pytest.raises(DataError) as exc:
        make_dm(tmp_path, source="s3")
    assert_one_line(exc, "s3", "embedded", "local", "hub")


def test_hub_offline_fails_fast(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    with pytest.raises(DataError) as exc:
        ready(make_dm(tmp_path, source="hub", name="wikitext", config_name="wikitext-103-raw-v1"))
    assert time.perf_counter() - t0 < 5.0
    assert_one_line(exc, "wikitext", "offline", "data.source=local")


def test_hub_offline_flag_wins_over_imported_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `datasets` read the env at import time (online); the env set now must still make it fail fast.
    import datasets
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    t0 = time.perf_counter()
    with pytest.raises(DataError) as exc:
        ready(make_dm(tmp_path, source="hub", name="surely-not/a-cached-dataset"))
    assert time.perf_counter() - t0 < 5.0
    assert_one_line(exc, "offline")
    assert datasets.config.HF_HUB_OFFLINE is False  # restored after the call


def test_hub_unreachable_fails_fast(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Online mode, but the endpoint is a closed loopback port: the probe must fail in well under the
    # retry loop's time and the cached-copy fallback must turn into one line.
    import socket

    import huggingface_hub.constants as hub_constants

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hub_constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    t0 = time.perf_counter()
    with pytest.raises(DataError) as exc:
        ready(make_dm(tmp_path, source="hub", name="surely-not/a-cached-dataset"))
    assert time.perf_counter() - t0 < 5.0
    assert_one_line(exc, f"127.0.0.1:{port} is unreachable", "data.source=local")


def hub_folder(tmp_path: Path) -> Path:
    """A dataset folder `load_dataset` reads without the network, to exercise the hub code path."""
    root = tmp_path / "hubds"
    root.mkdir(parents=True)
    with (root / "train.jsonl").open("w") as fh:
        for doc in real_text()[:30]:
            fh.write(json.dumps({"body": doc, "n": len(doc)}) + "\n")
    return root


def test_hub_unknown_column_lists_columns(tmp_path: Path) -> None:
    with pytest.raises(DataError) as exc:
        ready(make_dm(tmp_path, source="hub", name=str(hub_folder(tmp_path))))
    assert_one_line(exc, "data.text_field='text'", "body", "'n'")


def test_hub_loads_text_field(tmp_path: Path) -> None:
    folder = str(hub_folder(tmp_path))
    dm = ready(make_dm(tmp_path, source="hub", name=folder, text_field="body"))
    assert dm.streaming and dm.train_tokens is None  # a hub source streams by default
    assert dm.vocab_size == 256 and dm.val_tokens == 8 * 4 * 65
    x, _ = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 64)
    dm = ready(make_dm(tmp_path, source="hub", name=folder, text_field="body", streaming=False))
    assert dm.vocab_size == 256 and dm.train_tokens > 10_000
    with pytest.raises(DataError) as exc:
        ready(make_dm(tmp_path / "other", source="hub", name=str(hub_folder(tmp_path / "other")), text_field="n"))
    assert_one_line(exc, "not text")


# ---- config / plumbing -----------------------------------------------------------------------------


def test_data_overrides_compose_and_a_mistyped_value_is_one_line(compose_cfg: Any) -> None:
    from hydra.errors import ConfigCompositionException

    from trainer.core.schema import describe_user_error, validate

    config = validate(compose_cfg("data=local", "data.path=[a.txt,b/]", "data.name=wikitext"))
    assert config.data.path == ["a.txt", "b/"] and config.data.name == "wikitext"
    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg("data.val_fraction=abc")
    line = describe_user_error(e.value)
    assert line is not None and "\n" not in line, line
    assert "data.val_fraction=abc" in line and "'abc'" in line and "Float" in line, line


def test_dataset_pickles_without_token_array(tmp_path: Path) -> None:
    dm = ready(make_dm(tmp_path))
    ds = dm.train_dataloader().dataset
    assert isinstance(ds, TokenBlocks)
    blob = pickle.dumps(ds)
    assert len(blob) < 10_000  # workers re-open the memmap instead of receiving a copy
    clone = pickle.loads(blob)
    assert all(torch.equal(a, b) for a, b in zip(clone[5], ds[5], strict=True))


def test_accepts_hydra_dictconfig(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), {"cache_dir": str(tmp_path / "cache")})
    dm = ready(TextDataModule(cfg, seq_len=32, batch_size=2, seed=0))  # type: ignore[arg-type]
    assert dm.vocab_size == 256


def test_worker_processes(tmp_path: Path) -> None:
    dm = ready(make_dm(tmp_path, num_workers=1, seq_len=256, batch_size=16))
    x, y = next(iter(dm.val_dataloader()))
    assert x.shape == (16, 256) and torch.equal(x[:, 1:], y[:, :-1])
