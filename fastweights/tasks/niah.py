"""Single needle-in-a-haystack (S-NIAH-1/2/3) after RULER, fully offline.

Spec: research/benchmarks.md §3 (RULER `niah_single_1..3`) and §2.2 (Gated DeltaNet's table).

| task            | aliases                        | haystack | value              |
|-----------------|--------------------------------|----------|--------------------|
| `niah_single_1` | `s-niah-1`, `passkey`          | noise    | 7-digit number     |
| `niah_single_2` | `s-niah-2`, `number`           | essay    | 7-digit number     |
| `niah_single_3` | `s-niah-3`, `uuid`             | essay    | uuid4              |

* Noise haystack: RULER's fixed five-sentence paragraph, repeated and joined by ``\\n``; the needle is
  placed between two repetitions at a uniformly random index.
* Essay haystack: RULER uses Paul Graham essays. Nothing is downloaded here: a small seeded generator
  writes plausible English-like sentences from a bundled word list, joined by spaces; the needle is
  placed at a sentence boundary at a depth drawn from RULER's 40 depths ``round(linspace(0, 100, 40))``.
* Needle: ``One of the special magic {numbers|uuids} for {key} is: {value}.`` with an adjective-noun key
  such as ``gentle-harbor`` (RULER draws from wonderwords; we draw from the bundled lists).
* Prompt (RULER's single-needle base template): ``A special magic {number|uuid} is hidden within the
  following text. Make sure to memorize it. I will quiz you about the {number|uuid} afterwards.\\n
  {haystack}\\nWhat is the special magic {number|uuid} for {key} mentioned in the provided text? The
  special magic {number|uuid} for {key} mentioned in the provided text is``; the model must continue
  with `` {value}``.
* Length: RULER binary-searches the haystack so that prompt + 128 generated tokens fit in the context.
  Here the haystack is filled token-exactly so that ``len(input_ids) + len(answer_ids) == context_len``
  (prompt and answer fill the window; the haystack ends with a cut-off sentence where needed).

Scoring (RULER ``string_match_all``): the fraction of references found, case-insensitively, in the
output, averaged over samples, ×100 — see :func:`string_match_all`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypedDict

import numpy as np
import torch

__all__ = [
    "ByteTokenizer",
    "NIAHExample",
    "NIAH_TASKS",
    "NOISE_PARAGRAPH",
    "filler_text",
    "make_niah",
    "niah_training_batch",
    "string_match_all",
]

IGNORE_INDEX = -100

NOISE_PARAGRAPH = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
"""RULER's `noise` haystack unit (benchmarks.md §3.2)."""

NIAH_DEPTHS = tuple(int(d) for d in np.round(np.linspace(0, 100, num=40)))
"""RULER's 40 evenly spaced needle depths (percent) for essay haystacks."""

_PREFIX = (
    "A special magic {kind} is hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind} afterwards.\n"
)
_QUESTION = (
    "\nWhat is the special magic {kind} for {key} mentioned in the provided text? "
    "The special magic {kind} for {key} mentioned in the provided text is"
)
_NEEDLE = "One of the special magic {kinds} for {key} is: {value}."


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------


class Tokenizer(Protocol):
    """What :func:`make_niah` needs: ``encode(str) -> list[int]`` without added specials, and
    ``decode(ids) -> str``. Optional attributes ``bos_id``, ``eos_id``, ``pad_id`` are used when set."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 byte tokenizer: ids 0..255 are bytes, then pad=256, bos=257, eos=258, sep=259.

    vocab_size = 260. ``encode`` adds no specials unless asked; ``decode`` drops specials by default
    and replaces invalid UTF-8 with U+FFFD.
    """

    pad_id = 256
    bos_id = 257
    eos_id = 258
    sep_id = 259
    vocab_size = 260

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """list of ids for ``text`` (one per UTF-8 byte), optionally framed by bos/eos."""
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int] | torch.Tensor, *, skip_special: bool = True) -> str:
        """Text for ``ids``; specials are dropped (``skip_special``) or rendered as ``<pad>`` etc."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        names = {self.pad_id: "<pad>", self.bos_id: "<bos>", self.eos_id: "<eos>", self.sep_id: "<sep>"}
        out, run = [], bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                run.append(i)
                continue
            if i not in names:
                raise ValueError(f"ids must be in [0, {self.vocab_size}), got {i}")
            if not skip_special:
                out.append(run.decode("utf-8", errors="replace"))
                run = bytearray()
                out.append(names[i])
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


# --------------------------------------------------------------------------------------------------
# Bundled word list and filler text
# --------------------------------------------------------------------------------------------------

# Common concrete nouns (plurals are formed by _plural).
_NOUNS = """
apple anchor animal answer artist bag bakery balloon band bank basket beach bell bench bicycle bird
blanket boat book bottle branch bridge brother bucket building button cabin camera candle canyon car
card carpet castle cat chair chapter child cloud coat coin college corner cottage country cousin
crowd cup curtain desk diary doctor dog door dragon drawer dream driver engine farmer feather fence
field finger flag flower forest fountain friend garden gate gift glove guitar hammer harbor hat hill
horse hotel island jacket journey kettle kitchen lake lamp lantern letter library lighthouse map
market meadow message mirror monkey morning mountain museum neighbor notebook ocean office orchard
painter palace pencil pocket pond poet puzzle rabbit radio river road rocket room sailor school
scientist season shadow shelf ship shop singer sister song station stone story street student
summer table teacher tent theater ticket tower town train traveler tree tunnel umbrella valley
village violin wagon wall window winter wizard writer
""".split()

_ADJECTIVES = """
able ancient angry brave bright broken busy calm careful cheerful clever cold colorful curious dark
distant dusty eager early elegant empty famous fancy fierce fresh friendly gentle giant golden
graceful green happy heavy hidden honest huge humble icy kind large lazy little lonely loud lucky
modern narrow noisy odd old orange patient plain polite proud purple quiet rapid rare rough round
rusty shiny short silent silver simple sleepy small smooth soft steady strange strong sudden sunny
sweet swift tall tender thin tidy tiny tired wandering warm wild wise wooden young
""".split()

_TRANSITIVE_PAST = """
admired borrowed built carried cleaned collected described discovered drew followed found guarded
painted mended moved noticed opened ordered packed photographed planted pushed remembered repaired
sold shared studied visited washed watched welcomed wrapped
""".split()

_INTRANSITIVE_PAST = """
arrived danced disappeared drifted escaped hesitated laughed lingered paused rested returned
shivered slept smiled stumbled vanished waited wandered whispered worked
""".split()

_INTRANSITIVE_PRESENT_PLURAL = """
appear gather grow linger rest return shine sleep travel wait wander work
""".split()

_ADVERBS = """
briefly calmly carefully eagerly gently happily honestly loudly nearly often patiently quickly
quietly rarely really slowly softly suddenly surely warmly
""".split()

_PREPOSITIONS = "above across behind below beside beyond inside near under around toward".split()

_DETERMINERS = "the the the a this that every one another our their my".split()

_TIME_PHRASES = [
    "last winter",
    "every morning",
    "after dinner",
    "before noon",
    "at dawn",
    "in the evening",
    "during the storm",
    "on a quiet afternoon",
    "long ago",
    "the next day",
    "once again",
    "by the end of the week",
    "early in the spring",
    "late at night",
]

_CONNECTIVES = [
    "After a while",
    "Even so",
    "In the end",
    "For a moment",
    "Without a word",
    "Meanwhile",
    "Later that year",
    "As usual",
    "Sooner or later",
    "At first",
]


def _pick(rng: np.random.Generator, words: Sequence[str]) -> str:
    return words[int(rng.integers(len(words)))]


def _noun_phrase(rng: np.random.Generator, adjective_p: float = 0.5) -> str:
    det = _pick(rng, _DETERMINERS)
    words = []
    if rng.random() < adjective_p:
        words.append(_pick(rng, _ADJECTIVES))
    words.append(_pick(rng, _NOUNS))
    if det == "a" and words[0][0] in "aeiou":
        det = "an"
    return " ".join([det, *words])


def _plural(noun: str) -> str:
    if noun == "child":
        return "children"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    if noun.endswith(("s", "sh", "ch", "x")):
        return noun + "es"
    return noun + "s"


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _sentence(rng: np.random.Generator) -> str:
    """One English-like sentence from the bundled word lists (no digits, no 'magic')."""
    form = int(rng.integers(8))
    if form == 0:
        s = (
            f"{_noun_phrase(rng)} {_pick(rng, _TRANSITIVE_PAST)} {_noun_phrase(rng)} "
            f"{_pick(rng, _PREPOSITIONS)} {_noun_phrase(rng, 0.3)}"
        )
    elif form == 1:
        s = f"{_noun_phrase(rng)} {_pick(rng, _INTRANSITIVE_PAST)} {_pick(rng, _ADVERBS)} {_pick(rng, _TIME_PHRASES)}"
    elif form == 2:
        s = (
            f"{_pick(rng, _PREPOSITIONS)} {_noun_phrase(rng, 0.3)}, {_noun_phrase(rng)} "
            f"{_pick(rng, _INTRANSITIVE_PAST)} {_pick(rng, _ADVERBS)}"
        )
    elif form == 3:
        s = (
            f"{_noun_phrase(rng, 0.2)} {_pick(rng, _INTRANSITIVE_PAST)} because "
            f"{_noun_phrase(rng)} {_pick(rng, _TRANSITIVE_PAST)} {_noun_phrase(rng, 0.3)}"
        )
    elif form == 4:
        s = (
            f"{_pick(rng, _ADJECTIVES)} {_plural(_pick(rng, _NOUNS))} {_pick(rng, _INTRANSITIVE_PRESENT_PLURAL)} "
            f"{_pick(rng, _PREPOSITIONS)} {_noun_phrase(rng, 0.3)} {_pick(rng, _TIME_PHRASES)}"
        )
    elif form == 5:
        s = f"{_pick(rng, _CONNECTIVES)}, {_noun_phrase(rng)} {_pick(rng, _TRANSITIVE_PAST)} {_noun_phrase(rng)}"
    elif form == 6:
        s = (
            f"it seemed {_pick(rng, _ADJECTIVES)} that {_noun_phrase(rng, 0.2)} "
            f"{_pick(rng, _TRANSITIVE_PAST)} {_noun_phrase(rng)} {_pick(rng, _TIME_PHRASES)}"
        )
    else:
        s = (
            f"{_noun_phrase(rng)} and {_noun_phrase(rng, 0.3)} {_pick(rng, _INTRANSITIVE_PAST)} "
            f"{_pick(rng, _PREPOSITIONS)} {_noun_phrase(rng, 0.4)}"
        )
    return _cap(s) + "."


def filler_text(num_sentences: int, seed: int) -> str:
    """``num_sentences`` generated English-like sentences joined by spaces (deterministic per seed)."""
    if num_sentences < 0:
        raise ValueError(f"num_sentences must be >= 0, got {num_sentences}")
    rng = np.random.default_rng(seed)
    return " ".join(_sentence(rng) for _ in range(num_sentences))


def _random_key(rng: np.random.Generator) -> str:
    return f"{_pick(rng, _ADJECTIVES)}-{_pick(rng, _NOUNS)}"


def _random_number(rng: np.random.Generator) -> str:
    return str(int(rng.integers(10**6, 10**7)))  # 7 digits


def _random_uuid4(rng: np.random.Generator) -> str:
    b = bytearray(rng.bytes(16))
    b[6] = (b[6] & 0x0F) | 0x40  # version 4
    b[8] = (b[8] & 0x3F) | 0x80  # RFC 4122 variant
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


# --------------------------------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TaskSpec:
    name: str
    haystack: str  # "noise" | "essay"
    kind: str  # singular value kind used in the prompt: "number" | "uuid"
    make_value: Callable[[np.random.Generator], str]


NIAH_TASKS: dict[str, _TaskSpec] = {
    "niah_single_1": _TaskSpec("niah_single_1", "noise", "number", _random_number),
    "niah_single_2": _TaskSpec("niah_single_2", "essay", "number", _random_number),
    "niah_single_3": _TaskSpec("niah_single_3", "essay", "uuid", _random_uuid4),
}
"""Canonical S-NIAH tasks (RULER names) → haystack type and value kind."""

_ALIASES = {
    "s-niah-1": "niah_single_1",
    "s_niah_1": "niah_single_1",
    "passkey": "niah_single_1",
    "s-niah-2": "niah_single_2",
    "s_niah_2": "niah_single_2",
    "number": "niah_single_2",
    "s-niah-3": "niah_single_3",
    "s_niah_3": "niah_single_3",
    "uuid": "niah_single_3",
}


def _resolve_task(task: str) -> _TaskSpec:
    if not isinstance(task, str):
        raise ValueError(f"task must be a str, got {task!r}")
    name = _ALIASES.get(task.lower(), task.lower())
    if name not in NIAH_TASKS:
        raise ValueError(f"task must be one of {sorted([*NIAH_TASKS, *_ALIASES])}, got {task!r}")
    return NIAH_TASKS[name]


class NIAHExample(TypedDict):
    """One S-NIAH example.

    input_ids:       LongTensor [P], bos (if the tokenizer has one) + prompt up to "… text is".
    answer_ids:      LongTensor [A], the continuation " {value}"; P + A == context_len.
    answer:          the value string (7 digits or a uuid).
    key:             the adjective-noun key the question asks about.
    needle:          the needle sentence as inserted.
    needle_position: index in input_ids of the needle's first token.
    depth:           needle depth in percent (essay: RULER depth; noise: index / repetitions · 100).
    task:            canonical task name.
    """

    input_ids: torch.Tensor
    answer_ids: torch.Tensor
    answer: str
    key: str
    needle: str
    needle_position: int
    depth: float
    task: str


def _build_example(spec: _TaskSpec, context_len: int, rng: np.random.Generator, tok: Tokenizer) -> NIAHExample:
    key = _random_key(rng)
    value = spec.make_value(rng)
    needle = _NEEDLE.format(kinds=spec.kind + "s", key=key, value=value)

    bos = getattr(tok, "bos_id", None)
    head = ([bos] if bos is not None else []) + list(tok.encode(_PREFIX.format(kind=spec.kind)))
    tail = list(tok.encode(_QUESTION.format(kind=spec.kind, key=key)))
    answer_ids = list(tok.encode(" " + value))
    budget = context_len - len(head) - len(tail) - len(answer_ids)

    if spec.haystack == "noise":
        sep = "\n"

        def next_sentence() -> str:
            return NOISE_PARAGRAPH
    else:
        sep = " "

        def next_sentence() -> str:
            return _sentence(rng)

    needle_first = list(tok.encode(needle))
    needle_sep = list(tok.encode(sep + needle))
    if budget < max(len(needle_first), len(needle_sep)):
        raise ValueError(
            f"context_len={context_len} is too small for task {spec.name!r}: prompt, needle and "
            f"answer alone take {context_len - budget + len(needle_sep)} tokens"
        )

    # Full filler sentences (encoded with their leading separator) while they fit with the needle.
    sentences: list[str] = []
    encoded: list[list[int]] = []  # encode(sep + sentence)
    used = len(needle_sep)
    pending = next_sentence()
    pending_ids = list(tok.encode(sep + pending))
    while used + len(pending_ids) <= budget:
        sentences.append(pending)
        encoded.append(pending_ids)
        used += len(pending_ids)
        pending = next_sentence()
        pending_ids = list(tok.encode(sep + pending))

    while True:
        m = len(sentences)
        if spec.haystack == "noise":
            j = int(rng.integers(0, m + 1))
            depth = 100.0 * j / m if m else 0.0
        else:
            depth = float(NIAH_DEPTHS[int(rng.integers(len(NIAH_DEPTHS)))])
            j = int(m * depth / 100.0)
        pieces = [*encoded[:j], needle_sep, *encoded[j:]]
        # The first piece follows the prompt's own newline: encode it without the separator.
        pieces[0] = needle_first if j == 0 else list(tok.encode(sentences[0]))
        total = sum(len(p) for p in pieces)
        if total <= budget or m == 0:
            break
        # A tokenizer whose pieces do not add up (not the byte tokenizer): drop one sentence.
        sentences.pop()
        encoded.pop()

    # Fill the remaining tokens exactly with the start of the following sentence(s).
    remainder = budget - total
    fragment: list[int] = []
    while len(fragment) < remainder:
        fragment.extend(pending_ids)
        pending_ids = list(tok.encode(sep + next_sentence()))
    fragment = fragment[:remainder]

    needle_offset = sum(len(p) for p in pieces[:j]) + (0 if j == 0 else len(needle_sep) - len(needle_first))
    haystack_ids = [t for p in pieces for t in p] + fragment
    input_ids = head + haystack_ids + tail
    return NIAHExample(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        answer_ids=torch.tensor(answer_ids, dtype=torch.long),
        answer=value,
        key=key,
        needle=needle,
        needle_position=len(head) + needle_offset,
        depth=depth,
        task=spec.name,
    )


def make_niah(
    task: str,
    context_len: int,
    num_examples: int,
    seed: int,
    tokenizer: Tokenizer | None = None,
) -> list[NIAHExample]:
    """Generate ``num_examples`` S-NIAH examples of exactly ``context_len`` tokens (benchmarks.md §3).

    Args:
        task:         ``niah_single_1|2|3`` or an alias (``passkey``/``number``/``uuid``,
                      ``s-niah-1|2|3``).
        context_len:  total tokens of prompt + answer: ``len(input_ids) + len(answer_ids) == context_len``.
        num_examples: number of examples.
        seed:         non-negative seed of the local generator (keys, values, haystacks, depths).
        tokenizer:    anything with ``encode(str) -> list[int]`` / ``decode``; default :class:`ByteTokenizer`.
                      Pieces are encoded separately and concatenated, so lengths are exact for any
                      tokenizer.

    Returns:
        list of :class:`NIAHExample` dicts (input_ids [P], answer_ids [A], answer, key, needle, …).
    """
    spec = _resolve_task(task)
    for name, value, minimum in (("context_len", context_len, 1), ("num_examples", num_examples, 1), ("seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{name} must be an int, got {value!r}")
        if value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")
    tok = ByteTokenizer() if tokenizer is None else tokenizer
    rng = np.random.default_rng(seed)
    return [_build_example(spec, int(context_len), rng, tok) for _ in range(num_examples)]


def niah_training_batch(
    examples: Sequence[NIAHExample],
    *,
    pad_id: int | None = None,
    eos_id: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack examples into a next-token training batch supervised only on the answer.

    Each row is ``input_ids ++ answer_ids`` (length P + A = context_len), right-padded with ``pad_id``
    (default: ByteTokenizer's pad, 256) to the longest row. Labels are already shifted:
    ``labels[b, t]`` is the target of the prediction at position t, i.e. the token at t + 1 when that
    token belongs to the answer, else −100. With ``eos_id`` set, the last position of each row is
    trained to emit ``eos_id`` (a stop signal after the answer).

    Returns:
        input_ids: LongTensor [B, T]; labels: LongTensor [B, T] (T = max(P + A)).
    """
    if len(examples) == 0:
        raise ValueError("examples must be non-empty")
    pad = ByteTokenizer.pad_id if pad_id is None else int(pad_id)
    rows = [torch.cat([ex["input_ids"], ex["answer_ids"]]) for ex in examples]
    width = max(int(r.numel()) for r in rows)
    inputs = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for b, (row, ex) in enumerate(zip(rows, examples)):
        p, n = int(ex["input_ids"].numel()), int(row.numel())
        inputs[b, :n] = row
        labels[b, p - 1 : n - 1] = ex["answer_ids"]
        if eos_id is not None:
            labels[b, n - 1] = int(eos_id)
    return inputs, labels


def string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str] | str]) -> float:
    """RULER's ``string_match_all`` ×100: per sample, the fraction of its references found as
    case-insensitive substrings of the prediction; averaged over samples."""
    if len(predictions) != len(references):
        raise ValueError(
            f"predictions and references must have the same length, got {len(predictions)} and {len(references)}"
        )
    if len(predictions) == 0:
        raise ValueError("predictions must be non-empty")
    total = 0.0
    for pred, refs in zip(predictions, references):
        refs = [refs] if isinstance(refs, str) else list(refs)
        if not refs:
            raise ValueError("each sample needs at least one reference")
        low = pred.lower()
        total += sum(r.lower() in low for r in refs) / len(refs)
    return 100.0 * total / len(predictions)
