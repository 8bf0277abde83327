"""Every invalid configuration or file fails before any work, naming the field, the value and what is
allowed (table-driven)."""
import numpy as np
import pytest
import torch

from mapl.core.config import load_run_config
from mapl.data import load_split
from mapl.core.run import run

BAD_CONFIGS = [
    # (overrides on the micro profile, text the message must contain)
    ({"method": "mapl", "ratio": 1}, "ratio=1"),                              # r >= d
    ({"method": "mapl", "ratio": 0.5}, "ratio=0.5"),                          # r > d
    ({"method": "mapl", "ratio": 3}, "reachable ratios divide 64"),           # no integer rank
    ({"method": "ssn", "ratio": 128}, "ratio=128"),                           # rank < 1
    ({"method": "mapl-rvq", "ratio": 4, "compressor.rvq.groups": 3}, "rvq.groups=3"),
    ({"method": "mapl-rvq", "ratio": 4, "compressor.rvq.codebook_size": 100}, "power of two"),
    ({"method": "mapl-rvq", "ratio": 4, "compressor.rvq.sync": "lazy"}, "rvq.sync='lazy'"),
    ({"method": "mapl-rvq", "ratio": 4, "compressor.rvq.search_with": "both"}, "rvq.search_with"),
    ({"stages": 5}, "n_layers=4"),                                             # P > layers
    ({"stages": 0}, "stages=0"),
    ({"method": "mapl", "ratio": 4, "compressor.anchor.kind": "big"}, "anchor.kind='big'"),
    ({"method": "mapl", "ratio": 4, "compressor.projector.kind": "magic"}, "projector.kind='magic'"),
    ({"method": "mapl", "ratio": 4, "compressor.projector.receiver_grad": "half"}, "receiver_grad"),
    ({"method": "mapl", "ratio": 4, "compressor.spel.polar": "qr"}, "spel.polar"),
    ({"method": "mapl", "ratio": 4, "compressor.projector.unconstrained_optimizer": "sgd"}, "unconstrained_optimizer"),
    ({"method": "mapl", "ratio": 4, "compressor.anchor.rank": 1000}, "anchor.rank=1000"),
    ({"method": "zip"}, "method='zip'"),
    ({"model": "3B"}, "model='3B'"),
    ({"train.schedule": "1f1b", "train.micro_batches": 1, "train.batch_size": 4}, "1f1b needs at least"),
    ({"train.micro_batches": 3}, "must divide train.batch_size=4"),
    ({"train.steps": 0}, "train.steps=0"),
    ({"train.steps": 5, "train.warmup_steps": 6}, r"train.warmup_steps=6 is invalid: must be <= train.steps=5"),
    ({"train.precision": "fp8"}, "train.precision='fp8'"),
    ({"train.schedule": "zb"}, "train.schedule='zb'"),
    ({"train.min_lr_frac": 2}, "train.min_lr_frac=2"),
    ({"train.seq_len": 4096}, "max_seq_len=64"),
    ({"data.source": "ftp"}, "data.source='ftp'"),
    ({"data.tokenizer": "wordpiece"}, "data.tokenizer='wordpiece'"),
    ({"data.vocab_size": 100, "data.tokenizer": "bpe"}, "data.vocab_size=100"),
    ({"method": "int8", "compressor.int8_block": 7}, "int8_block=7"),
    ({"model.n_heads": 3}, "n_heads"),
]


@pytest.mark.parametrize("overrides,message", BAD_CONFIGS, ids=[str(i) for i in range(len(BAD_CONFIGS))])
def test_bad_configuration_is_refused_with_a_clear_message(overrides, message, tmp_path, monkeypatch):
    # data must not be touched: make any data access fail loudly
    import mapl.data as D
    monkeypatch.setattr(D, "prepare", lambda *a, **k: pytest.fail("data touched before validation"))
    with pytest.raises(ValueError, match=None) as e:
        cfg = load_run_config("micro", overrides)
        run(cfg, progress=False, log=lambda *a: None)
    assert message in str(e.value), str(e.value)


def test_unknown_profile_lists_the_allowed_ones():
    with pytest.raises(ValueError, match=r"profile='gpu'.*allowed.*cpu"):
        load_run_config("gpu")


def test_unknown_key_in_a_section_is_named():
    with pytest.raises(ValueError, match=r"train has no key 'lr_magic'"):
        load_run_config("micro", {"train.lr_magic": 1})


def test_model_vocab_smaller_than_the_tokenizer(micro_cfg):
    with pytest.raises(ValueError, match=r"model.vocab_size=100 .*tokenizer's vocabulary \(257\)"):
        run(micro_cfg("none", **{"model.vocab_size": 100}), progress=False, log=lambda *a: None)


def test_missing_shard_is_named(tiny_corpus, tmp_path):
    import shutil
    d = tmp_path / "copy"
    shutil.copytree(tiny_corpus, d)
    (d / "val.bin").unlink()
    with pytest.raises(FileNotFoundError, match="val.bin"):
        load_split(d, "val")


def test_shard_with_a_wrong_hash_is_named(tiny_corpus, tmp_path):
    import shutil
    d = tmp_path / "copy"
    shutil.copytree(tiny_corpus, d)
    arr = np.fromfile(d / "train.bin", dtype=np.uint16)
    arr[0] ^= 1
    arr.tofile(d / "train.bin")
    with pytest.raises(ValueError, match="train.bin"):
        load_split(d, "train")


class Evil:
    """Anything that is not a tensor or a plain container needs unpickling code: refused."""


def test_checkpoint_that_needs_pickled_objects_is_refused(micro_cfg, tmp_path):
    ck = tmp_path / "evil.pt"
    torch.save({"format": "mapl-checkpoint-v1", "obj": Evil()}, ck)
    with pytest.raises(ValueError, match="needs pickled objects"):
        run(micro_cfg("none"), ckpt=ck, progress=False, log=lambda *a: None)


def test_foreign_checkpoint_is_refused(micro_cfg, tmp_path):
    ck = tmp_path / "foreign.pt"
    torch.save({"model": {}}, ck)
    with pytest.raises(ValueError, match="not a mapl checkpoint"):
        run(micro_cfg("none"), ckpt=ck, progress=False, log=lambda *a: None)


BAD_STRINGS = [
    # (--set / flag values as the command line gives them, text the message must contain)
    ({"train.steps": "abc"}, "train.steps='abc' is invalid: must be an integer"),
    ({"train.lr_muon": "abc"}, "train.lr_muon='abc' is invalid: must be a number"),
    ({"stages": "two"}, "stages='two' is invalid: must be an integer"),
    ({"train.batch_size": "4.0"}, "train.batch_size='4.0' is invalid: must be an integer"),
    ({"train.checkpoint_every": "0"}, "train.checkpoint_every=0 is invalid: must be >= 1"),
    ({"train.grad_clip": "-1"}, "train.grad_clip=-1.0 is invalid: must be >= 0"),
    ({"train": "5"}, "'train' is a section"),
    ({"method": "mapl", "ratio": "nan"}, "compressor.ratio=nan is invalid: must be a finite number"),
    ({"train.seed": "-1"}, "train.seed=-1 is invalid: must be >= 0"),
    ({"train.lr_muon": "-0.02"}, "train.lr_muon=-0.02 is invalid: must be >= 0"),
    ({"compressor.rvq": "x"}, "'compressor.rvq' is a section"),
    ({"train.steps.x": "1"}, "train.steps is a value, not a section"),
    ({"magic.key": "1"}, "'magic.key' is not a setting"),
]


@pytest.mark.parametrize("overrides,message", BAD_STRINGS, ids=[str(i) for i in range(len(BAD_STRINGS))])
def test_command_line_values_are_parsed_by_the_field_type(overrides, message):
    from mapl.core.config import ConfigError
    with pytest.raises(ConfigError) as e:
        load_run_config("micro", overrides, from_string=True).validate()
    assert message in str(e.value), str(e.value)


def test_int_and_float_spellings_give_one_config_hash():
    from mapl.core.config import config_hash
    a = load_run_config("micro", {"method": "mapl", "ratio": 4})
    b = load_run_config("micro", {"method": "mapl", "ratio": "4.0"}, from_string=True)
    assert a.compressor.ratio == 4.0 and isinstance(a.compressor.ratio, float)
    assert config_hash(a) == config_hash(b)


def test_params_yaml_errors_are_one_line(tmp_path):
    from mapl.core.config import ConfigError, load_params
    with pytest.raises(ConfigError, match="not found"):
        load_params(tmp_path / "params.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("profiles:\n  micro: {model: micro\n")
    with pytest.raises(ConfigError, match=r"invalid YAML at line"):
        load_params(bad)
    typed = {"profiles": {"micro": {"model": "micro", "train": {"steps": "many"}}}}
    with pytest.raises(ConfigError, match=r"profiles.micro.train.steps='many' is invalid: must be an integer"):
        load_run_config("micro", params=typed)
    extra = {"profiles": {"micro": {"model": "micro", "trian": {}}}}
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['trian'\]"):
        load_run_config("micro", params=extra)
