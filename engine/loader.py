"""Loading a model of the Qwen3.5 family from a local Hugging Face directory."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from engine import cublas_workspace
from engine.errors import DeviceUnavailableError, ModelLoadError
from engine.fingerprint import decider_part, kernels_part, model_part, model_part_of_tensors
from engine.label_mass import FullVocabulary
from engine.prompt import label_token_ids

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen3_5_text", "qwen3_5")
"""Text checkpoints, and the published multimodal ones whose language model is loaded alone."""
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_DEFAULT_DTYPE = {"cpu": "float32", "cuda": "bfloat16"}
DETERMINISTIC_BY_DEFAULT = {"cuda": True, "cpu": False}
"""Batch-invariant kernels where they cost at most 5% throughput: on the H200 (bf16, 0.8B shape) they cost 3.0% at
batch 32 and 4.1% at batch 128 (bench/README.md, "Deterministic scoring")."""


class Engine:
    """A loaded model on one device: the transformers module, its tokenizer, and the option-label read-out.

    Attributes: `model` (Qwen3_5ForCausalLM), `core` (its decoder), `cfg` (text config), `tok`, `dev`, `dtype`,
    `W` ([MAX_OPTIONS, hidden]: the unembedding rows of the labels " A".." Z"), `vocab` (the whole unembedding in chunks,
    for the label mass: `engine.label_mass.FullVocabulary`), `label_ids`, `use_graphs`, `model_id`,
    `deterministic` (batch-invariant kernels: a state's probabilities do not depend on its batch), `model_digest`
    (the scoring fingerprint's `model` part, `engine.fingerprint`: hashed from the directory at `load`, else from the
    weights in memory when first asked).
    CUDA-graph memory pools belong to each SchemaEngine's graph manager (`engine.graphs.GraphManager`).
    """

    def __init__(self, model, tok, model_id: str, use_graphs: bool | None = None, deterministic: bool = False,
                 model_digest: str | None = None):
        self.model = model.eval()
        self.core = model.model
        self.cfg = model.config
        self.tok = tok
        self.model_id = model_id
        p = next(model.parameters())
        self.dev, self.dtype = p.device, p.dtype
        self.label_ids = label_token_ids(tok)
        self.W = model.lm_head.weight[self.label_ids].detach().clone()          # [MAX_OPTIONS, hidden]
        self.vocab = FullVocabulary(model.lm_head.weight.detach())
        self.use_graphs = (self.dev.type == "cuda") if use_graphs is None else (use_graphs and self.dev.type == "cuda")
        self.deterministic = bool(deterministic)
        self._forward = None
        self._model_digest = model_digest
        self._fingerprint_parts: tuple[str, str, str] | None = None

    @property
    def model_digest(self) -> str:
        """The fingerprint's `model` part (`engine.fingerprint.model_part`)."""
        if self._model_digest is None:
            self._model_digest = model_part_of_tensors(self.model.state_dict(), self.cfg.to_dict())
        return self._model_digest

    def fingerprint_parts(self) -> tuple[str, str, str]:
        """The scoring fingerprint's parts this engine decides, computed once: (model, decider, kernels)."""
        if self._fingerprint_parts is None:
            self._fingerprint_parts = (self.model_digest, decider_part(),
                                       kernels_part(self.forward.kernels, self.dev, self.dtype))
        return self._fingerprint_parts

    @property
    def forward(self):
        """The engine's own layer loop (`engine.model.HybridForward`), built once and shared by every SchemaEngine."""
        if self._forward is None:
            from engine.model import HybridForward
            self._forward = HybridForward(self.model, self.deterministic,
                                          readout_weights=(self.W, self.vocab.chunk_weight))
        return self._forward

    @classmethod
    def load(cls, model_dir: str | Path, device: str = "cpu", dtype: str | None = None,
             use_graphs: bool | None = None, deterministic: bool | None = None) -> "Engine":
        """Load a local HF directory of the Qwen3.5 family onto `device` ("cpu", "cuda", "cuda:N").

        dtype: "float32" | "bfloat16" | "float16"; default float32 on CPU, bfloat16 on CUDA.
        deterministic: a state's probabilities are bit-identical whatever its batch size, position, neighbours and
        length bucket, so a replay reproduces live records exactly (`engine.kernels.table.batch_invariant_kernels` on
        CUDA, `engine.kernels.cpu_deterministic` on the CPU). None: `DETERMINISTIC_BY_DEFAULT` for the device, on where
        it costs at most 5% throughput.
        Raises ModelLoadError (a ValueError) naming what is missing or unsupported.
        """
        from transformers import AutoTokenizer

        model_dir = Path(model_dir)
        dev = _device(device)
        torch_dtype = _dtype(dtype or _DEFAULT_DTYPE[dev.type])
        text_cfg = read_text_config(model_dir)
        if not any((model_dir / f).exists() for f in _TOKENIZER_FILES):
            raise ModelLoadError(f"{model_dir}: no tokenizer (expected one of {', '.join(_TOKENIZER_FILES)})")
        tok = AutoTokenizer.from_pretrained(model_dir)
        model = build_model(text_cfg, load_weights(model_dir), dev, torch_dtype)
        log.info("loaded %s on %s (%s): %d layers%s", model_dir, dev, torch_dtype, text_cfg.num_hidden_layers,
                 f"; cuBLAS: {cublas_workspace.describe()}" if dev.type == "cuda" else "")
        if deterministic is None:
            deterministic = DETERMINISTIC_BY_DEFAULT[dev.type]
        return cls(model, tok, model_id=model_dir.name, use_graphs=use_graphs, deterministic=deterministic,
                   model_digest=model_part(model_dir))     # once, while the weights' files are in the page cache


def read_text_config(model_dir: Path):
    """The Qwen3.5 text config of a model directory, or ModelLoadError."""
    from transformers import Qwen3_5TextConfig

    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir}: model directory does not exist")
    cfg_file = model_dir / "config.json"
    if not cfg_file.exists():
        raise ModelLoadError(f"{model_dir}: missing config.json (not a Hugging Face model directory)")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg_file}: not valid JSON ({e})") from None
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(f"{model_dir}: model_type {model_type!r} is not supported; decider runs the Qwen3.5 "
                             f"hybrid family ({', '.join(SUPPORTED_MODEL_TYPES)})")
    if model_type == "qwen3_5":
        raw = {**raw.get("text_config", {}), "tie_word_embeddings": raw.get("tie_word_embeddings", False)}
    raw.pop("model_type", None)
    return Qwen3_5TextConfig(**raw)


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of the directory's safetensors files, with multimodal checkpoints' keys mapped to the text model's."""
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weight files")
    state = {}
    for f in files:
        for key, t in load_file(f).items():
            key = key.replace("model.language_model.", "model.")
            if key.startswith(("model.visual.", "mtp.")):
                continue
            state[key] = t
    return state


def build_model(text_cfg, state: dict[str, torch.Tensor], dev: torch.device, dtype: torch.dtype):
    """A Qwen3_5ForCausalLM holding `state`; ModelLoadError if weights are missing or misshapen."""
    from transformers import Qwen3_5ForCausalLM

    if "lm_head.weight" not in state and text_cfg.tie_word_embeddings:
        state["lm_head.weight"] = state.get("model.embed_tokens.weight")
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(text_cfg)
    expected = {k for k in model.state_dict()}
    missing = sorted(expected - state.keys())
    if missing:
        raise ModelLoadError(f"weights missing for {len(missing)} parameters, e.g. {missing[:3]}")
    try:
        model.load_state_dict({k: state[k] for k in expected}, assign=True, strict=True)
    except RuntimeError as e:
        raise ModelLoadError(f"weights do not fit the config: {str(e).splitlines()[0]}") from None
    model.tie_weights()
    _materialize_buffers(model, text_cfg)
    return model.to(device=dev, dtype=dtype).eval()


def _materialize_buffers(model, text_cfg) -> None:
    # Non-persistent buffers (the RoPE frequencies) are not in the checkpoint: rebuild them off the meta device.
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    model.model.rotary_emb = Qwen3_5TextRotaryEmbedding(text_cfg)


def _device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ModelLoadError(f"device {device!r}: expected cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this PyTorch is a CPU-only build" if torch.version.cuda is None
                   else "no CUDA device is visible: check the driver and CUDA_VISIBLE_DEVICES")
            raise DeviceUnavailableError(device, f"CUDA is not available on this machine ({why})")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            raise DeviceUnavailableError(device, f"this machine has {count} CUDA device{'s' if count > 1 else ''} "
                                                 f"(cuda:0 to cuda:{count - 1})")
    elif dev.type != "cpu":
        raise ModelLoadError(f"device {device!r}: expected cpu, cuda or cuda:N")
    return dev


def _dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ModelLoadError(f"dtype {name!r}: expected one of {', '.join(table)}")
    return table[name]
