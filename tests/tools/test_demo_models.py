"""The tiny random-weight models the examples and engine tests build
(``tools/demo/engine.py``): the DeepSeek builder's two forms. The MTP form is what SGLang's
NEXTN reads: a DeepSeek-V3 whose config counts its decoder layers without the MTP layer and
names one ``num_nextn_predict_layers``, with DeepSeek's MTP weights under the layer index
past the last decoder layer."""

import json
import os

import pytest

pytest.importorskip("transformers")

from hygon_attn_backend.tools.demo import engine  # noqa: E402


def _read(path):
    from safetensors.torch import load_file

    with open(os.path.join(path, "config.json")) as f:
        return json.load(f), load_file(os.path.join(path, "model.safetensors"))


def test_deepseek_mtp_model_has_its_nextn_layer(tmp_path):
    path = engine.build_tiny_deepseek(str(tmp_path / "m"), rope_scaling=engine.DEEPSEEK_YARN,
                                      engine="sglang", mtp=True)
    cfg, weights = _read(path)
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["num_hidden_layers"] == engine.LAYERS and cfg["num_nextn_predict_layers"] == 1
    assert cfg["kv_lora_rank"] == 512 and cfg["qk_rope_head_dim"] == 64
    for key, value in engine.SGLANG_DEEPSEEK_KEYS.items():
        assert cfg[key] == value, key
    pre = f"model.layers.{engine.LAYERS}."
    h, v = engine.MTP_HIDDEN, engine.VOCAB_SIZE
    assert cfg["hidden_size"] == h
    assert tuple(weights[pre + "eh_proj.weight"].shape) == (h, 2 * h)
    for name in ("enorm", "hnorm", "shared_head.norm"):
        assert (weights[pre + name + ".weight"] == 1).all()
    assert weights[pre + "embed_tokens.weight"].equal(weights["model.embed_tokens.weight"])
    assert weights[pre + "shared_head.head.weight"].equal(weights["lm_head.weight"])
    assert tuple(weights[pre + "shared_head.head.weight"].shape) == (v, h)
    assert pre + "self_attn.kv_a_proj_with_mqa.weight" in weights  # its own MLA layer
    assert not any(k.startswith(f"model.layers.{engine.LAYERS + 1}.") for k in weights)


def test_deepseek_plain_model_for_each_engine(tmp_path):
    cfg, weights = _read(engine.build_tiny_deepseek(str(tmp_path / "v"), engine="vllm"))
    assert cfg["architectures"] == ["DeepseekV2ForCausalLM"]
    assert "moe_layer_freq" not in cfg and "num_nextn_predict_layers" not in cfg
    assert not any(k.startswith(f"model.layers.{engine.LAYERS}.") for k in weights)
    cfg, _ = _read(engine.build_tiny_deepseek(str(tmp_path / "s"), engine="sglang"))
    assert cfg["moe_layer_freq"] == 1
    with pytest.raises(ValueError, match="engine"):
        engine.build_tiny_deepseek(str(tmp_path / "x"), engine="trtllm")


def test_eagle3_head_reads_the_targets_hidden_states(tmp_path):
    target = engine.build_tiny_llama(str(tmp_path / "t"))
    cfg, weights = _read(engine.build_tiny_eagle3_head(target, str(tmp_path / "h")))
    _, target_weights = _read(target)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    # SGLang captures layer i + 1's input for id i: every id must name a layer it runs
    assert all(0 <= i + 1 < engine.LAYERS for i in ids)
    h = cfg["hidden_size"]
    assert tuple(weights["fc.weight"].shape) == (h, len(ids) * h)
    assert weights["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * h
    assert weights["embed_tokens.weight"].equal(target_weights["model.embed_tokens.weight"])
    assert weights["lm_head.weight"].equal(target_weights["lm_head.weight"])


def test_eagle3_head_has_a_full_draft_vocabulary(tmp_path):
    target = engine.build_tiny_llama(str(tmp_path / "t"))
    cfg, weights = _read(engine.build_tiny_eagle3_head(target, str(tmp_path / "h")))
    assert cfg["draft_vocab_size"] == cfg["vocab_size"] == engine.VOCAB_SIZE
    assert "d2t" not in weights and weights["layers.0.hidden_norm.weight"].eq(1).all()
