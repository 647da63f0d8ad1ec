"""The scoring fingerprint (`engine.fingerprint`): equal wherever the scores are the same bits (another load of the
same directory, another process, a Hugging Face cache blob of the same file), and different in exactly the part that
changed: the weights or config (model), the kernel table (kernels), the questions or mode (prompt), a temperature, an
option bias or the calibration mode (calibration)."""
import hashlib
import json
import shutil
import subprocess
import sys

import pytest

from engine import Engine, SchemaEngine
from engine.fingerprint import PARTS, differing_parts, model_part
from engine.testing import write_tiny_model

from .conftest import make_questions

QUESTIONS = make_questions([2, 3, 5], temperatures=[1.0, 0.5, 2.0])


def fingerprint(se, questions=QUESTIONS, **options) -> dict:
    return se.fingerprint(se.prepare(questions, **options)).as_record()


@pytest.fixture(scope="module")
def det_se(tiny_dir):
    return SchemaEngine(Engine.load(tiny_dir, device="cpu", dtype="float32", deterministic=True))


def test_the_record_holds_a_digest_of_its_parts(det_se):
    record = fingerprint(det_se)
    assert list(record) == ["digest", *PARTS]
    assert record["kernels"].startswith("cpu float32 torch deterministic #")
    assert record["calibration"].startswith("none #") and record["decider"].split(" #")[0]
    assert all(len(v.rsplit("#", 1)[-1].strip()) == 16 for v in record.values())
    assert det_se.fingerprint(det_se.prepare(QUESTIONS)).as_record() == record      # the same schema again
    assert differing_parts(record, dict(record)) == []


def test_another_load_and_another_process_give_the_same_fingerprint(tiny_dir, det_se):
    again = SchemaEngine(Engine.load(tiny_dir, device="cpu", dtype="float32", deterministic=True))
    assert fingerprint(again) == fingerprint(det_se)
    code = ("import json, sys; from engine import Engine, SchemaEngine; "
            "se = SchemaEngine(Engine.load(sys.argv[1], device='cpu', dtype='float32', deterministic=True)); "
            "print(json.dumps(se.fingerprint(se.prepare(json.loads(sys.argv[2]))).as_record()))")
    out = subprocess.run([sys.executable, "-c", code, str(tiny_dir), json.dumps(QUESTIONS)], capture_output=True,
                         text=True, timeout=120, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == fingerprint(det_se)


@pytest.mark.parametrize("change, part", [
    (lambda qs, o: qs[1].update(temperature=0.7), "calibration"),
    (lambda qs, o: qs[0].update(option_bias=[0.1, -0.1]), "calibration"),
    (lambda qs, o: o.update(calibration="contextual"), "calibration"),
    (lambda qs, o: qs[2].update(question="Another question?"), "prompt"),
    (lambda qs, o: qs[2]["options"].reverse(), "prompt"),
    (lambda qs, o: o.update(independent=True), "prompt"),
    (lambda qs, o: qs[0].update(id="renamed"), None),              # ids do not reach the model
    (lambda qs, o: o.update(label_mass=False), None),              # nor does the label mass switch
])
def test_a_schema_change_shows_in_its_part_only(det_se, change, part):
    questions, options = json.loads(json.dumps(QUESTIONS)), {}
    change(questions, options)
    assert differing_parts(fingerprint(det_se), fingerprint(det_se, questions, **options)) == ([part] if part else [])


def test_the_fast_table_differs_in_the_kernels_part(tiny_dir, det_se):
    fast = fingerprint(SchemaEngine(Engine.load(tiny_dir, device="cpu", dtype="float32", deterministic=False)))
    assert differing_parts(fingerprint(det_se), fast) == ["kernels"]
    assert fast["kernels"].startswith("cpu float32 torch fast #")
    bf16 = fingerprint(SchemaEngine(Engine.load(tiny_dir, device="cpu", dtype="bfloat16", deterministic=False)))
    assert differing_parts(fast, bf16) == ["kernels"] and bf16["kernels"].startswith("cpu bfloat16 ")


def test_other_weights_or_config_differ_in_the_model_part(tiny_dir, det_se, tmp_path):
    other = write_tiny_model(tmp_path / "seed1", seed=1)
    se = SchemaEngine(Engine.load(other, device="cpu", dtype="float32", deterministic=True))
    assert differing_parts(fingerprint(det_se), fingerprint(se)) == ["model"]
    copy = shutil.copytree(tiny_dir, tmp_path / "copy")
    assert model_part(copy) == model_part(tiny_dir)
    weights = next(copy.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1                                               # one bit of one weight
    weights.write_bytes(bytes(data))
    assert model_part(copy) != model_part(tiny_dir)
    shutil.copy(next(tiny_dir.glob("*.safetensors")), weights)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert model_part(copy) != model_part(tiny_dir)


def test_a_hugging_face_cache_blob_is_named_by_its_hash_without_reading_it(tiny_dir, tmp_path):
    """In the Hugging Face cache a snapshot's files are symlinks to blobs/<sha256>: the name is the file's digest,
    so the model part is the same as the plain directory's, and the blob is not read (a wrong name shows it)."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for f in tiny_dir.iterdir():
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, blobs / sha)
        (snapshot / f.name).symlink_to(blobs / sha)
    assert model_part(snapshot) == model_part(tiny_dir)
    weights = next(snapshot.glob("*.safetensors"))
    wrong = blobs / ("0" * 64)
    weights.resolve().rename(wrong)
    weights.unlink()
    weights.symlink_to(wrong)
    assert model_part(snapshot) != model_part(tiny_dir)


def test_an_engine_built_in_memory_digests_its_weights(eng):
    a, b = Engine(eng.model, eng.tok, "in-memory"), Engine(eng.model, eng.tok, "in-memory")
    assert a.model_digest == b.model_digest and len(a.model_digest) == 16
