"""The LLaMA model: causality, preset shapes and sizes, stage splits."""
import pytest
import torch

from mapl.model import ModelConfig, Transformer, count_params
from mapl.stages import split_layers


def test_causal_future_tokens_do_not_change_the_past():
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("micro")).eval()
    x = torch.randint(0, 256, (2, 24))
    y = x.clone()
    y[:, 12:] = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.allclose(a[:, :12], b[:, :12], atol=1e-6)
    assert not torch.allclose(a[:, 12:], b[:, 12:], atol=1e-3), "the future did change: the test must be able to fail"


@pytest.mark.parametrize("name", ["micro", "tiny", "mini"])
def test_cpu_presets_build_and_have_the_right_shapes(name):
    cfg = ModelConfig.preset(name)
    model = Transformer(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    assert model(x).shape == (2, 16, cfg.vocab_size)
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg)


@pytest.mark.parametrize("name,target", [("150M", 150e6), ("500M", 500e6), ("1B", 1e9)])
def test_paper_presets_match_their_names_within_10_percent(name, target):
    cfg = ModelConfig.preset(name)
    assert cfg.n_layers % 8 == 0, "P = 8 needs layer counts divisible by 8"
    assert abs(count_params(cfg) - target) / target < 0.10


def test_count_params_matches_a_built_model_with_gqa():
    cfg = ModelConfig.preset("micro", n_kv_heads=2)
    assert sum(p.numel() for p in Transformer(cfg).parameters()) == count_params(cfg)


@pytest.mark.parametrize("bad,msg", [({"n_heads": 3}, "n_heads"), ({"n_kv_heads": 3}, "n_kv_heads"),
                                     ({"d_model": 0}, "d_model")])
def test_bad_model_config_names_the_field(bad, msg):
    with pytest.raises(ValueError, match=msg):
        ModelConfig.preset("micro", **bad)


def test_unknown_preset_lists_the_allowed_ones():
    with pytest.raises(ValueError, match="allowed"):
        ModelConfig.preset("3B")


@pytest.mark.parametrize("name,P", [("tiny", 4), ("mini", 4), ("mini", 8), ("1B", 8), ("150M", 4)])
def test_split_layers_is_contiguous_and_balanced(name, P):
    cfg = ModelConfig.preset(name)
    split = split_layers(cfg, P)
    assert [i for part in split for i in part] == list(range(cfg.n_layers))
    assert all(part for part in split)
    sizes = [len(p) for p in split]
    assert max(sizes) - min(sizes) <= 2


def test_split_layers_rejects_more_stages_than_layers():
    with pytest.raises(ValueError, match="stages"):
        split_layers(ModelConfig.preset("micro"), 5)
