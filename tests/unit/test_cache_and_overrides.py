"""An unreadable sample-index cache file is rebuilt (rtd_scale/data/packed.py), and ``--set`` of a
field whose default is None converts the value by the field's annotation (rtd_scale/config.py)."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pytest

from rtd_scale.config import ConfigError, apply_override
from rtd_scale.presets import preset
from rtd_scale.data.packed import PackedDataset
from rtd_scale.data.shards import ShardWriter

DOCS = [np.arange(5, 5 + n) for n in (7, 3, 11, 5)]
# the stream [CLS] … [SEP] content of DOCS packed into samples of 6 (4 content tokens each)
STREAM = [t for d in DOCS for t in [*d.tolist(), 2]]


def _dataset(tmp_path):
    prefix = str(tmp_path / "corpus")
    with ShardWriter(prefix, vocab_size=100) as w:
        for d in DOCS:
            w.add_document(d)
    cache = tmp_path / "cache"
    return prefix, cache


def _contents(ds):
    return [t for i in range(len(ds)) for t in ds.content(i).tolist()]


def _damage(path, how: str) -> None:
    if how == "empty":
        path.write_bytes(b"")
    elif how == "garbage":
        path.write_bytes(b"\x00\xffnot a numpy file at all" * 7)
    elif how == "wrong shape":  # a valid .npy of another array
        np.save(path, np.arange(3, dtype=np.int64))
    elif how == "wrong dtype":
        np.save(path, np.zeros(4, dtype=np.float32))
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[:-8])


@pytest.mark.parametrize("how", ["empty", "garbage", "wrong shape", "wrong dtype", "truncated"])
@pytest.mark.parametrize("kind", ["doc_starts", "samples", "order"])
def test_unreadable_cache_file_is_rebuilt(tmp_path, kind, how):
    prefix, cache = _dataset(tmp_path)
    first = PackedDataset([prefix], seq_length=6, cache_dir=str(cache))
    order = first.order(3, 0).tolist()
    assert _contents(first) == STREAM
    (target,) = cache.glob(f"*.{kind}*.npy")
    good = target.read_bytes()
    _damage(target, how)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = PackedDataset([prefix], seq_length=6, cache_dir=str(cache))
        assert _contents(again) == STREAM
        assert again.order(3, 0).tolist() == order
    notes = [str(w.message) for w in caught if "rebuilding the sample-index cache" in str(w.message)]
    assert len(notes) == 1 and str(target) in notes[0]
    assert target.read_bytes() == good  # replaced by the rebuilt array


def test_cache_hit_gives_no_note(tmp_path):
    prefix, cache = _dataset(tmp_path)
    PackedDataset([prefix], seq_length=6, cache_dir=str(cache)).order(3, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        PackedDataset([prefix], seq_length=6, cache_dir=str(cache)).order(3, 0)
    assert not [w for w in caught if "sample-index cache" in str(w.message)]


def test_set_optional_int_field():
    cfg = preset("tiny")
    assert cfg.optim.lr_decay_iters is None
    apply_override(cfg, "optim.lr_decay_iters=100")
    assert cfg.optim.lr_decay_iters == 100 and type(cfg.optim.lr_decay_iters) is int
    cfg.validate()
    apply_override(cfg, "optim.lr_decay_iters=none")
    assert cfg.optim.lr_decay_iters is None


def test_set_optional_str_field():
    cfg = preset("tiny")
    apply_override(cfg, "data.data_cache_path=/tmp/idx")
    assert cfg.data.data_cache_path == "/tmp/idx"
    apply_override(cfg, "data.data_cache_path=None")
    assert cfg.data.data_cache_path is None


@dataclass(kw_only=True)
class _Section:
    scale: Optional[float] = None
    count: Optional[int] = None


@dataclass(kw_only=True)
class _Tree:
    section: _Section


def test_set_optional_float_field():
    tree = _Tree(section=_Section())
    apply_override(tree, "section.scale=2.5e-3")
    assert tree.section.scale == 2.5e-3 and type(tree.section.scale) is float
    with pytest.raises(ConfigError, match=r"^--set section.scale=inf: expected a finite value "
                                          r"of type float or none, e.g. --set section.scale=0.0025$"):
        apply_override(tree, "section.scale=inf")


@pytest.mark.parametrize("assignment, message", [
    ("optim.lr_decay_iters=ten", "--set optim.lr_decay_iters=ten: expected a value of type int or none"),
    ("optim.lr_decay_iters=1.5", "--set optim.lr_decay_iters=1.5: expected a value of type int or none"),
    ("train.train_iters=none", "--set train.train_iters=none: expected a value of type int, "
                               "e.g. --set train.train_iters=300"),
    ("train.precision=fp8", "--set train.precision=fp8: expected one of fp32, bf16, fp16, "
                            "e.g. --set train.precision=fp32"),
])
def test_set_bad_value_is_one_line(assignment, message):
    cfg = preset("tiny")
    with pytest.raises(ConfigError) as e:
        apply_override(cfg, assignment)
    assert str(e.value) == message and "\n" not in str(e.value)
