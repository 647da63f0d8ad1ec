"""The schema-first prompt layout.

A prompt is cut in two at the point where the state enters:

    prefix (depends only on the questions; computed once per schema and cached)
        [chat head] instructions, then every question with its lettered options
    suffix (per state; the only part run per request)
        "Context:" <state> [chat tail] "Answer 1:" "Answer 2:" ...   <- one answer slot per question

An answer slot is the last token of its "Answer i:" piece: the model's next-token distribution there, read over the
option-label tokens " A", " B", ..., is the answer.  Slots never contain an answer, so no question's answer can leak
into another's.  Pieces are tokenized separately and concatenated as ids, so slot positions are exact and the
oracle (`engine.reference`) runs the very same ids.

Long states are truncated to `max_ctx_tokens` keeping their END: streams carry log windows, transcripts and event
histories whose most recent part is what a decision is about; a marker token sequence ("…") says text was cut.
"""
from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from engine.errors import InputError

MAX_OPTIONS = 26
"""Options per question at most: one per label A..Z (each " A" .. " Z" is a single token in the Qwen3.5 vocabulary,
checked at load by `label_token_ids`); the read-out has one unembedding row per label, so every answer's row is
MAX_OPTIONS wide and the options a question lacks are masked to exactly 0."""
MAX_QUESTIONS = 64
"""Questions per schema at most, in packed and independent mode alike: a packed row then holds up to 64 answer slots
(`engine.graphs` keys its graphs by the power of 2 at or above a row's answers), an independent request 64 rows."""

CHAT_SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>"]
INSTRUCTIONS = ("You will read a situation and answer multiple-choice questions about it. "
                "Answer each question with the letter of one option.\n\n")
TRUNCATION_MARK = "…"
DEFAULT_MAX_CTX_TOKENS = 1536

# A schema's prefix runs once, on the device thread, while no state is scored: bounded so that one schema cannot
# stall a worker (a 100,000-character question took 55 s to prepare on CPU). English runs about 4 characters a
# token, so the character limits of a schema file (see worker.cli.user_files) fit well inside the token limit.
MAX_QUESTION_CHARS = 2000
"""Characters of one question's text at most."""
MAX_OPTION_CHARS = 500
"""Characters of one option at most."""
MAX_PREFIX_TOKENS = 16384
"""Tokens of one prefix (packed: all questions; independent: each question's own) at most. The widest schema (64
questions of 26 options) must fit: with one-token options ("1".."26") its packed prefix is 10,501 Qwen3.5 tokens
(each option line "A. 1" is 5 tokens: Qwen splits " 1" into a space and a digit). The prefix bank's K/V slots are as
long as its longest prefix (`engine.prefix_bank`), so a long schema costs every slot its length."""


def option_label(i: int) -> str:
    """The letter that names option i (0 -> "A", 25 -> "Z")."""
    if not 0 <= i < 26:
        raise ValueError(f"option {i}: labels run from A (0) to Z (25)")
    return chr(ord("A") + i)


@dataclass(frozen=True)
class Question:
    text: str
    options: tuple[str, ...]
    temperature: float = 1.0
    id: str | None = None
    option_bias: tuple[float, ...] | None = None   # a log-probability per option position, subtracted (calibration)


@dataclass(frozen=True)
class ChatTemplate:
    """The wrapping of a chat-tuned model: `head` opens the user turn, `tail` closes it and opens the answer turn."""
    head: str
    tail: str


QWEN_CHAT = ChatTemplate(head="<|im_start|>user\n",
                         tail="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def parse_questions(questions: Any) -> list[Question]:
    """Validate user question dicts ({"question", "options", optional "temperature", "id" and "option_bias"}) into
    Questions.

    Raises ValueError naming the question and the problem.
    """
    if isinstance(questions, (str, bytes)) or not isinstance(questions, Sequence):
        raise InputError("questions: expected a list of {'question': str, 'options': [str, ...]} objects")
    if not questions:
        raise InputError("questions: the schema has no questions")
    if len(questions) > MAX_QUESTIONS:
        raise InputError(f"questions: the schema has {len(questions)} questions; at most {MAX_QUESTIONS} are allowed "
                         "(split them into several schemas)")
    return [_parse_question(i, q) for i, q in enumerate(questions)]


def _parse_question(i: int, q: Any) -> Question:
    where = f"question {i + 1}"
    if not isinstance(q, dict):
        raise InputError(f"{where}: expected an object with 'question' and 'options', got {type(q).__name__}")
    text = q.get("question")
    if not isinstance(text, str) or not text.strip():
        raise InputError(f"{where}: 'question' must be a non-empty string")
    if len(text) > MAX_QUESTION_CHARS:
        raise InputError(f"{where}: 'question' is {len(text)} characters; at most {MAX_QUESTION_CHARS} are allowed")
    options = q.get("options")
    if isinstance(options, (str, bytes)) or not isinstance(options, Sequence):
        raise InputError(f"{where} ({text!r}): 'options' must be a list of strings")
    if not 2 <= len(options) <= MAX_OPTIONS:
        raise InputError(f"{where} ({text!r}): has {len(options)} options; between 2 and {MAX_OPTIONS} are allowed")
    if not all(isinstance(o, str) and o.strip() for o in options):
        raise InputError(f"{where} ({text!r}): every option must be a non-empty string")
    longest = max(len(o) for o in options)
    if longest > MAX_OPTION_CHARS:
        raise InputError(f"{where} ({text!r}): an option is {longest} characters; at most {MAX_OPTION_CHARS} are allowed")
    dupes = sorted({o for o in options if options.count(o) > 1})
    if dupes:
        raise InputError(f"{where} ({text!r}): duplicate options {dupes}")
    return Question(text=text.strip(), options=tuple(options), temperature=check_temperature(q.get("temperature", 1.0), where),
                    id=q.get("id"), option_bias=check_option_bias(q.get("option_bias"), len(options), where))


def check_option_bias(bias: Any, n_options: int, where: str = "option_bias") -> tuple[float, ...] | None:
    """None, or one finite number per option (a log-probability per position, subtracted before renormalising);
    InputError otherwise."""
    if bias is None:
        return None
    if isinstance(bias, (str, bytes)) or not isinstance(bias, Sequence):
        raise InputError(f"{where}: option_bias must be a list of numbers, one per option")
    if len(bias) != n_options:
        raise InputError(f"{where}: option_bias has {len(bias)} values for {n_options} options")
    if not all(isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b) for b in bias):
        raise InputError(f"{where}: option_bias must hold finite numbers, got {list(bias)!r}")
    return tuple(float(b) for b in bias)


def check_temperature(t: Any, where: str = "temperature") -> float:
    """A positive finite float, or ValueError."""
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < float(t) < float("inf"):
        raise InputError(f"{where}: temperature must be a positive number, got {t!r}")
    return float(t)


def resolve_temperatures(questions: Sequence[Question], temperature: Any) -> list[float]:
    """Per-question temperatures: None -> each question's own; a number -> that for all; a list -> one per question."""
    if temperature is None:
        return [q.temperature for q in questions]
    if isinstance(temperature, (list, tuple)):
        if len(temperature) != len(questions):
            raise InputError(f"temperature: {len(temperature)} values for a schema with {len(questions)} questions")
        return [check_temperature(t, f"temperature {i + 1}") for i, t in enumerate(temperature)]
    return [check_temperature(temperature)] * len(questions)


def build_schema_first(questions: Sequence[Question], chat: ChatTemplate | None = None) -> str:
    """The prefix text: optional chat head, the instructions, then each question with lettered options."""
    blocks = []
    numbered = len(questions) > 1
    for n, q in enumerate(questions, 1):
        title = f"Question {n}: {q.text}" if numbered else f"Question: {q.text}"
        opts = "\n".join(f"{option_label(j)}. {o}" for j, o in enumerate(q.options))
        blocks.append(f"{title}\n{opts}\n\n")
    return (chat.head if chat else "") + INSTRUCTIONS + "".join(blocks)


def schema_prefix_ids(tok, questions: Sequence[Question], chat: ChatTemplate | None = None) -> list[int]:
    """Token ids of the prefix for these questions; InputError beyond MAX_PREFIX_TOKENS."""
    ids = _encode(tok, build_schema_first(questions, chat))
    if len(ids) > MAX_PREFIX_TOKENS:
        raise InputError(f"the schema's prefix is {len(ids)} tokens; at most {MAX_PREFIX_TOKENS} are allowed "
                         "(shorten the questions or options, or split them into several schemas)")
    return ids


def answer_pieces(n_slots: int) -> list[str]:
    """The text of each answer slot: "Answer:" for a single-question row, else "Answer 1:", "\\nAnswer 2:", ..."""
    if n_slots == 1:
        return ["Answer:"]
    return [("" if i == 1 else "\n") + f"Answer {i}:" for i in range(1, n_slots + 1)]


def schema_suffix_ids(tok, context: str, n_slots: int, max_ctx_tokens: int = DEFAULT_MAX_CTX_TOKENS,
                      chat: ChatTemplate | None = None) -> tuple[list[int], list[int], bool]:
    """Suffix ids for one state: -> (ids, slot positions within ids, truncated?)."""
    ctx = _encode(tok, context)
    truncated = len(ctx) > max_ctx_tokens
    if truncated:
        mark = _encode_fixed(tok, TRUNCATION_MARK)
        ctx = mark + ctx[len(ctx) - max(max_ctx_tokens - len(mark), 0):]
    ids = _encode_fixed(tok, "Context:\n") + ctx + _encode_fixed(tok, "\n\n" + (chat.tail if chat else ""))
    slots = []
    for piece in answer_pieces(n_slots):
        ids += _encode_fixed(tok, piece)
        slots.append(len(ids) - 1)
    return ids, slots, truncated


def schema_suffix_arrays(tok, contexts: Sequence[str], n_slots: int, max_ctx_tokens: int = DEFAULT_MAX_CTX_TOKENS,
                         chat: ChatTemplate | None = None) -> list[tuple[np.ndarray, list[int], bool]]:
    """`schema_suffix_ids` of several states at once, the ids as int64 arrays: one tokenizer call for all of them, and
    the pieces every suffix shares (the "Context:" head, the tail and the answer slots) copied in as arrays."""
    head, tail, tail_slots = _suffix_layout(tok, n_slots, chat)
    mark = None
    out = []
    for ctx in _encode_many(tok, contexts):
        truncated = len(ctx) > max_ctx_tokens
        if truncated:
            mark = mark if mark is not None else _encode_fixed(tok, TRUNCATION_MARK)
            ctx = mark + ctx[len(ctx) - max(max_ctx_tokens - len(mark), 0):]
        start = len(head) + len(ctx)
        ids = np.empty(start + len(tail), dtype=np.int64)
        ids[:len(head)] = head
        ids[len(head):start] = ctx
        ids[start:] = tail
        out.append((ids, [start + s for s in tail_slots], truncated))
    return out


_SUFFIX_LAYOUTS: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def _suffix_layout(tok, n_slots: int, chat: ChatTemplate | None) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """What every suffix of `n_slots` answer slots shares, per tokenizer: the head's ids, the tail's (the closing
    newlines, the chat tail, the answer pieces) and the slots' positions within the tail."""
    layouts = _SUFFIX_LAYOUTS.get(tok)
    if layouts is None:
        layouts = _SUFFIX_LAYOUTS.setdefault(tok, {})
    key = (n_slots, chat)
    layout = layouts.get(key)
    if layout is None:
        tail = _encode_fixed(tok, "\n\n" + (chat.tail if chat else ""))
        slots = []
        for piece in answer_pieces(n_slots):
            tail += _encode_fixed(tok, piece)
            slots.append(len(tail) - 1)
        layout = layouts[key] = (np.asarray(_encode_fixed(tok, "Context:\n"), dtype=np.int64),
                                 np.asarray(tail, dtype=np.int64), slots)
    return layout


def label_token_ids(tok) -> list[int]:
    """The token ids of " A" .. " Z" (the labels as they follow "Answer i:"); InputError if one is not a single token
    or two labels share one."""
    ids = []
    for i in range(MAX_OPTIONS):
        piece = _encode(tok, " " + option_label(i))
        if len(piece) != 1:
            raise InputError(f"tokenizer: option label {' ' + option_label(i)!r} is {len(piece)} tokens, not 1; "
                             "this tokenizer is not of a supported family")
        ids.append(piece[0])
    if len(set(ids)) != len(ids):
        raise InputError(f"tokenizer: the option labels A..{option_label(MAX_OPTIONS - 1)} map to {len(set(ids))} "
                         f"distinct tokens, not {MAX_OPTIONS}; this tokenizer is not of a supported family")
    return ids


# One text at a time: the Rust tokenizer's thread pool would not help (`_encode` goes through its batch call only to
# release the GIL), and a process that forks after using it is warned on stderr and has it turned off.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _encode(tok, text: str) -> list[int]:
    # The Rust tokenizer underneath a fast tokenizer gives the same ids without transformers' per-call Python
    # (about half the cost of a state's tokenization, which the worker pays for every event). Its batch call, not its
    # single one, releases the GIL while it works: the worker's tokenizer threads then leave its loop and its GPU
    # thread free (a 128-token state is ~60 us of Rust; with `encode` a Python thread beside it ran at half speed,
    # with `encode_batch` at full speed, on this project's CPU machine)
    return _encode_many(tok, [text])[0]


def _encode_many(tok, texts: Sequence[str]) -> list[list[int]]:
    """`_encode` of each text, in one call of the Rust tokenizer. Its `encode_batch_fast` gives the same ids as
    `encode_batch` without the character offsets, which nothing here reads: 40 against 75 us for a 128-token state
    of the tiny model's tokenizer on this project's CPU machine (bench/README.md, issue 46)."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        encode = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
        return [encoding.ids for encoding in encode(list(texts), add_special_tokens=False)]
    return [tok.encode(text, add_special_tokens=False) for text in texts]


_FIXED_PIECES: "weakref.WeakKeyDictionary[object, dict[str, list[int]]]" = weakref.WeakKeyDictionary()


def _encode_fixed(tok, text: str) -> list[int]:
    """`_encode` of a piece of the layout that is the same for every state (the answer slots, "Context:"), cached
    per tokenizer: a state's suffix then costs one tokenizer call instead of one per question (~40 us each)."""
    pieces = _FIXED_PIECES.get(tok)
    if pieces is None:
        pieces = _FIXED_PIECES.setdefault(tok, {})
    ids = pieces.get(text)
    if ids is None:
        ids = pieces[text] = _encode(tok, text)
    return list(ids)
