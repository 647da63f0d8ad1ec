import random

import pytest

from engine import Engine, SchemaEngine
from engine.testing import write_tiny_model

WORDS = ("order late refund angry disk full alert payment card fraud login failed latency spike user asked "
         "for help the box was damaged again and nobody answered my email within three days").split()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def eng(tiny_dir):
    return Engine.load(tiny_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def se(eng):
    return SchemaEngine(eng)


def make_states(n: int, seed: int = 0, max_words: int = 60) -> list[str]:
    """States of mixed lengths (1..max_words words), so batches are right-padded unevenly."""
    rnd = random.Random(seed)
    return [" ".join(rnd.choice(WORDS) for _ in range(rnd.randint(1, max_words))) for _ in range(n)]


def make_questions(n_options: list[int], temperatures: list[float] | None = None) -> list[dict]:
    qs = []
    for i, k in enumerate(n_options):
        q = {"question": f"Question number {i} about the situation: is it {WORDS[i % len(WORDS)]}?",
             "options": [f"{WORDS[(i + j) % len(WORDS)]} {j}" for j in range(k)]}
        if temperatures:
            q["temperature"] = temperatures[i]
        qs.append(q)
    return qs
