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

from trainer.core.data import (
    BYTE_DOC_SEPARATOR,
    EOT,
    DataConfig,
    DataError,
    TextDataModule,
    TokenBlocks,
    split_documents,
)


@pytest.fixture(autouse=True)
def _hub_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # No test may touch the network or the user's HF cache.
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")


def as_bytes(path: Path) -> bytes:
    """A cached byte-tokenizer array back as the bytes it encodes (stored as uint16)."""
    return np.load(path).astype(np.uint8).tobytes()


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
    tokens = np.load(dm.cache_path / "train.npy")
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
    assert np.array_equal(np.load(a.cache_path / "val.npy"), np.load(b.cache_path / "val.npy"))
    assert np.array_equal(np.load(a.cache_path / "train.npy"), np.load(b.cache_path / "train.npy"))
    for xa, xb in zip(first_batches(a), first_batches(b), strict=True):
        assert torch.equal(xa, xb)


def test_other_seed_other_split_and_order(tmp_path: Path) -> None:
    a = ready(make_dm(tmp_path, seed=1))
    b = ready(make_dm(tmp_path, seed=2))
    assert a.cache_path != b.cache_path
    va, vb = np.load(a.cache_path / "val.npy"), np.load(b.cache_path / "val.npy")
    assert va.shape != vb.shape or not np.array_equal(va, vb)
    assert not torch.equal(first_batches(a)[0], first_batches(b)[0])


def test_split_documents_fraction_and_determinism() -> None:
    docs = real_text()
    train, val = split_documents(docs, 0.1, seed=3)
    total = sum(map(len, docs))
    assert sorted(train + val) == sorted(docs)  # whole documents, nothing lost
    assert 0.1 * total <= sum(map(len, val)) <= 0.5 * total
    assert split_documents(docs, 0.1, seed=3) == (train, val)


def test_single_document_split_at_newline() -> None:
    doc = "".join(f"line {i} of the only document\n" for i in range(1000))
    train, val = split_documents([doc], 0.2, seed=0)
    assert train[0] + val[0] == doc
    assert train[0].endswith("\n") and val[0].startswith("line ")
    assert abs(len(val[0]) - 0.2 * len(doc)) < 40


def test_dominant_document_does_not_swallow_val() -> None:
    docs = ["short\n" * 10, "big line\n" * 10_000]
    for seed in range(5):
        train, val = split_documents(docs, 0.05, seed=seed)
        share = sum(map(len, val)) / sum(map(len, docs))
        assert 0.05 <= share < 0.06


# ---- cache -----------------------------------------------------------------------------------------


def test_second_prepare_uses_cache(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dm = ready(make_dm(tmp_path))
    npy = dm.cache_path / "train.npy"
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
    train = np.load(dm.cache_path / "train.npy")
    meta = json.loads((dm.cache_path / "meta.json").read_text())
    assert int((train == eot[0]).sum()) == meta["n_docs"]["train"] - 1
    assert train.dtype == np.uint16


def test_byte_stream_joins_documents(tmp_path: Path) -> None:
    d = tmp_path / "docs"
    d.mkdir()
    texts = real_text()[:30]
    for i, text in enumerate(texts):
        (d / f"{i:02d}.txt").write_text(text)
    dm = ready(make_dm(tmp_path, source="local", path=[str(d)], val_fraction=0.3, seed=5))
    train_docs, val_docs = split_documents(texts, 0.3, seed=5)
    assert as_bytes(dm.cache_path / "train.npy") == BYTE_DOC_SEPARATOR.join(train_docs).encode()
    assert as_bytes(dm.cache_path / "val.npy") == BYTE_DOC_SEPARATOR.join(val_docs).encode()


# ---- local sources ---------------------------------------------------------------------------------


def test_local_single_file(tmp_path: Path) -> None:
    f = tmp_path / "book.txt"
    text = "\n".join(real_text()[:20])
    f.write_text(text)
    dm = ready(make_dm(tmp_path, source="local", path=[str(f)], val_fraction=0.1))
    meta = json.loads((dm.cache_path / "meta.json").read_text())
    assert meta["n_docs"] == {"train": 1, "val": 1}
    train = as_bytes(dm.cache_path / "train.npy")
    val = as_bytes(dm.cache_path / "val.npy")
    assert train + val == text.encode()  # the one document cut in two, at a newline
    assert train.endswith(b"\n")


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
    stream = as_bytes(dm.cache_path / "train.npy") + as_bytes(dm.cache_path / "val.npy")
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
    dm = ready(make_dm(tmp_path, source="hub", name=str(hub_folder(tmp_path)), text_field="body"))
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
