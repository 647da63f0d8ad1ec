"""The scoring fingerprint: what decides whether two scores of the same state are comparable bit for bit.

Two records of one state carry the same probabilities, to the bit, when the same numbers went through the same code on
the same kernels (the deterministic tables make the batch around a state irrelevant). The fingerprint names each of
those in a part of its own, so a mismatch can say which one differs:

    model        the model directory: config.json, the tokenizer's files and the weights (sha256 of each safetensors
                 file, or the Hugging Face cache's own sha256 when the file is a blob of it), hashed once at load
    decider      decider's version and a digest of the engine's source (the code that computes scores)
    kernels      the kernel table and what its bits depend on: device (and GPU name), dtype, the table (fla or the
                 torch formulas, deterministic or fast, with the launches a deterministic CUDA table chose at load),
                 torch's and transformers' versions (and fla's)
    prompt       the schema version's questions, options and mode, and the prompt layout's settings (chat template,
                 the state's token limit)
    calibration  the schema version's calibration parameters: "none" or "contextual", every question's temperature
                 and option bias (a contextual bias is computed from the model and the prompt: the parts above)

Each part is one short string, readable where it can be (`decider` is "0.1.0 #<digest>", `kernels` starts with
"cpu float32 torch deterministic", `calibration` with its mode) and ending in a 64-bit digest of what it covers;
`digest` is the digest of all five. Equal digests: comparable bit for bit. A schema version number is not part of it:
two versions of the same questions and calibration give the same bits.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

from engine import cublas_workspace

log = logging.getLogger(__name__)

PARTS = ("model", "decider", "kernels", "prompt", "calibration")
"""The fingerprint's parts, in the order the combined digest hashes them."""
DIGEST_HEX = 16
"""Hex digits kept of each sha256: 64 bits, ample to tell configurations apart."""
MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
               "merges.txt", "chat_template.jinja")
"""The model directory's files besides the weights that change what a state scores, where present."""
_CHUNK = 16 << 20


def short_digest(*items: Any) -> str:
    """sha256 of `items` as canonical JSON, `DIGEST_HEX` hex digits."""
    text = json.dumps(items, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:DIGEST_HEX]


@dataclass(frozen=True)
class Fingerprint:
    """One prepared schema's scoring fingerprint on one engine (`SchemaEngine.fingerprint`)."""
    model: str
    decider: str
    kernels: str
    prompt: str
    calibration: str

    @cached_property
    def digest(self) -> str:
        """The digest of all parts: equal digests, comparable bit for bit."""
        return short_digest(*(getattr(self, part) for part in PARTS))

    def as_record(self) -> dict[str, str]:
        """The fingerprint as the probability record carries it (`schemas/probability_record.avsc`): `digest` and
        the parts."""
        return {"digest": self.digest, **{part: getattr(self, part) for part in PARTS}}


def differing_parts(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The parts (`PARTS`) in which two fingerprint records differ ([] when their digests match)."""
    if a.get("digest") == b.get("digest"):
        return []
    parts = [part for part in PARTS if a.get(part) != b.get(part)]
    return parts or ["digest"]


# ---- the parts ----------------------------------------------------------------------------------------------------
def model_part(model_dir: str | Path) -> str:
    """The `model` part of a model directory: its config, tokenizer files and weights, each by its sha256. Reads the
    weights once (about a second a GB from the page cache on the development machine); a file in the Hugging Face cache (a symlink
    to blobs/<sha256>) is named by that hash instead, for free."""
    model_dir = Path(model_dir)
    started = time.perf_counter()
    files = [(name, _file_sha256(model_dir / name)) for name in MODEL_FILES if (model_dir / name).is_file()]
    files += [(f.name, _file_sha256(f)) for f in sorted(model_dir.glob("*.safetensors"))]
    digest = short_digest("model-dir", files)
    log.info("model digest %s of %s (%d files) in %.2f s", digest, model_dir, len(files), time.perf_counter() - started)
    return digest


def model_part_of_tensors(state: dict[str, Any], config: dict[str, Any]) -> str:
    """The `model` part of a model built in memory (no directory): its config and every tensor's name, dtype, shape
    and bytes. Tensors on a GPU are copied to the host one at a time."""
    import torch

    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name in sorted(state):
        t = state[name].detach()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
    return short_digest("model-tensors", h.hexdigest())


def _file_sha256(path: Path) -> str:
    resolved = path.resolve()
    if resolved.parent.name == "blobs" and len(resolved.name) == 64 and _is_hex(resolved.name):
        return resolved.name            # the Hugging Face cache names a (large) blob by its content's sha256
    h = hashlib.sha256()
    with open(resolved, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def decider_part() -> str:
    """decider's version and a digest of the engine package's source files: "0.1.0 #<digest>"."""
    try:
        version = importlib.metadata.version("decider")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    root = Path(__file__).resolve().parent
    sources = [(str(p.relative_to(root)), hashlib.sha256(p.read_bytes()).hexdigest()) for p in sorted(root.rglob("*.py"))]
    return f"{version} #{short_digest('engine-source', sources)}"


def kernels_part(kernels, device, dtype) -> str:
    """The `kernels` part: "<device type> <dtype> <fla|torch> <deterministic|fast> #<digest>", the digest covering the
    table's whole name, the GPU's name and the versions of torch, transformers and fla."""
    import torch

    family = "fla" if kernels.name.startswith("fla") else "torch"
    label = f"{device.type} {str(dtype).removeprefix('torch.')} {family} {'deterministic' if kernels.batch_invariant else 'fast'}"
    env = {"torch": torch.__version__, "transformers": _version("transformers"), "table": kernels.name}
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda, fla=_version("fla-core"),
                   cublas=cublas_workspace.describe())     # which GEMM kernels cuBLAS may pick, so the bits
    return f"{label} #{short_digest('kernels', label, env)}"


def prompt_part(questions: Sequence, independent: bool, chat, max_ctx_tokens: int) -> str:
    """The `prompt` part: a digest of the questions' texts and options, the mode and the layout's settings."""
    return short_digest("prompt", [[q.text, list(q.options)] for q in questions], bool(independent),
                        None if chat is None else [chat.head, chat.tail], int(max_ctx_tokens))


def calibration_part(questions: Sequence, calibration: str) -> str:
    """The `calibration` part: "<none|contextual> #<digest of the mode, temperatures and option biases>"."""
    params = [[float(q.temperature).hex(), None if q.option_bias is None else [float(b).hex() for b in q.option_bias]]
              for q in questions]
    return f"{calibration} #{short_digest('calibration', calibration, params)}"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
