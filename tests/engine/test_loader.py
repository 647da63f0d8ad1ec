"""Loading: the text layout, and the published multimodal layout whose language model is loaded alone."""
import json
import shutil

import torch
from safetensors.torch import load_file, save_file

from engine import Engine, SchemaEngine

from .conftest import make_questions, make_states


def test_label_rows_are_the_unembedding_of_the_labels(eng):
    assert eng.W.shape == (26, eng.cfg.hidden_size)           # " A" .. " Z"
    assert torch.equal(eng.W, eng.model.lm_head.weight[eng.label_ids])
    assert not eng.use_graphs and eng.dtype == torch.float32


def test_multimodal_checkpoint_layout_loads_its_language_model(se, tiny_dir, tmp_path):
    d = tmp_path / "qwen3_5-multimodal"
    shutil.copytree(tiny_dir, d)
    text_cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({
        "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
        "tie_word_embeddings": text_cfg["tie_word_embeddings"], "text_config": {**text_cfg, "model_type": "qwen3_5_text"},
        "vision_config": {"depth": 1}}))
    state = load_file(d / "model.safetensors")
    renamed = {k.replace("model.", "model.language_model.", 1): v.contiguous() for k, v in state.items() if k.startswith("model.")}
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)
    renamed["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(renamed, d / "model.safetensors")
    other = Engine.load(d)
    qs, states = make_questions([2, 4]), make_states(3)
    a = torch.stack(se.score(se.prepare(qs), states))
    se2 = SchemaEngine(other)
    b = torch.stack(se2.score(se2.prepare(qs), states))
    assert torch.equal(a, b)
